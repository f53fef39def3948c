"""Tables laid out for the terminal they are printed on, 80 columns included (rendering only).

A rich table left to itself shrinks every column evenly when the terminal is narrow: dates and sizes
wrap across lines (``2026-12-01`` over ``09:57:52``) and numbers are cut to ``0.007…``. Here a table
is described by its columns' kinds and fitted before rich sees it:

* ``number`` (counts, sizes, dates, steps, LRs): never cut and never wrapped;
* ``text`` (paths, tags, keys): may be cut with ``…`` down to its ``min_width``, once a ``("cut", name)``
  step allows it (or as the last resort, when every step ran);
* ``prose`` (reasons): wraps at words inside its own column, at least ``min_width`` wide.

When the columns do not fit, the table's ``degrade`` steps run in order until they do: ``("abbrev",
name)`` switches a column to its next shorter form (``2026-12-01 09:57:52`` -> ``2026-12-01 09:57``),
``("drop", name)`` leaves it out. A table that still does not fit keeps every number whole and is printed
at the width it needs (:meth:`ckpt_archive.cli.common.Output.table`).

Layout: no box, one header rule, two cells between columns (``box.SIMPLE_HEAD``, right padding 1), so
each row is one line a ``grep`` finds whole.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

#: Cells between two columns (right padding 1 + the box's blank vertical).
GAP = 2


@dataclasses.dataclass
class Col:
    """One column of a fitted table.

    Attributes:
        name: the column's id (for ``degrade`` steps).
        header: its header.
        kind: ``"number"``, ``"text"`` or ``"prose"`` (see the module docstring).
        justify: ``"left"`` or ``"right"``.
        forms: shorter forms, in order: ``(header, cell -> shorter cell)``; ``("abbrev", name)`` steps
            switch to the next.
        min_width: the narrowest a ``text`` or ``prose`` column becomes.
    """

    name: str
    header: str
    kind: str = "number"
    justify: str = "left"
    forms: Sequence[tuple[str, Callable[[str], str]]] = ()
    min_width: int = 8


def _len(text) -> int:
    """Cells of a str or a :class:`rich.text.Text` (a styled cell)."""
    from rich.cells import cell_len

    return text.cell_len if hasattr(text, "cell_len") else cell_len(text)


def fit(cols: Sequence[Col], rows: Sequence[Sequence[str]], width: int, *, title: str | None = None,
        degrade: Sequence[tuple[str, str]] = (), styles: Sequence[str | None] | None = None):
    """A :class:`rich.table.Table` of ``rows`` that fits ``width`` cells, numbers whole.

    Args:
        cols: the columns, in order.
        rows: one list of cells per row (``len(cols)`` each): str, or a :class:`rich.text.Text` for a styled
            cell (never cut).
        width: the cells available (the console's width).
        title: a left-justified title line.
        degrade: the steps tried in order while the table is too wide (see the module docstring).
        styles: a rich style per row (or None).

    Returns:
        the table, with ``needed_width`` set when even every step could not make it fit (the width its
        numbers need), else ``None``; and ``shown``: the names of the columns it kept.
    """
    layout = _Layout(cols, rows)
    layout.degrade(degrade, width)
    return layout.table(width, title, styles)


class _Layout:
    """The state of fitting one table: each column's form, the columns dropped and the text columns that
    may be cut; the cells and widths follow from it."""

    def __init__(self, cols: Sequence[Col], rows: Sequence[Sequence[str]]):
        self.cols, self.rows = list(cols), rows
        self.form = {c.name: 0 for c in cols}
        self.dropped: set[str] = set()
        self.cuttable: set[str] = set()  # text columns that may be cut now (a "cut" step ran, or every step did)
        self.by_name = {c.name: c for c in cols}
        self.index = {c.name: i for i, c in enumerate(cols)}

    def header(self, c: Col) -> str:
        return c.forms[self.form[c.name] - 1][0] if self.form[c.name] else c.header

    def cell(self, c: Col, row):
        from ckpt_archive.cli.common import terminal_text

        # control characters escaped (a tag read from an archive never reaches the terminal as a sequence)
        text = terminal_text(row[self.index[c.name]])
        if hasattr(text, "cell_len"):  # a styled cell (rich Text) is shown as given
            return text
        text = terminal_text(str(text))
        for _, shorter in list(c.forms)[:self.form[c.name]]:
            text = shorter(text)
        return text

    def natural(self, c: Col) -> int:
        return max([_len(self.header(c))] + [_len(self.cell(c, r)) for r in self.rows])

    def least(self, c: Col) -> int:
        nat = self.natural(c)
        if c.kind == "number" or (c.kind == "text" and c.name not in self.cuttable):
            return nat
        return min(nat, max(c.min_width, _len(self.header(c))))

    def active(self) -> list[Col]:
        return [c for c in self.cols if c.name not in self.dropped]

    def needed(self) -> int:
        shown = self.active()
        return sum(self.least(c) for c in shown) + GAP * (len(shown) - 1)

    def degrade(self, degrade: Sequence[tuple[str, str]], width: int) -> None:
        """Run the ``degrade`` steps in order while the table is wider than ``width``; then, if it still is,
        let every text column be cut (the last resort before printing wider)."""
        steps = list(degrade)
        while self.needed() > width and steps:
            what, name = steps.pop(0)
            if what == "drop":
                self.dropped.add(name)
            elif what == "cut":
                self.cuttable.add(name)
            elif self.form[name] < len(self.by_name[name].forms):
                self.form[name] += 1
        if self.needed() > width:
            self.cuttable.update(c.name for c in self.cols if c.kind == "text")

    def widths(self, width: int) -> dict[str, int]:
        """Each shown column's width: its least, then what is left of ``width`` goes to cut text first (left
        to right), then to prose in proportion to what each lacks."""
        shown = self.active()
        widths = {c.name: self.least(c) for c in shown}
        spare = width - self.needed()
        for c in shown:
            if c.kind == "text" and spare > 0:
                more = min(spare, self.natural(c) - widths[c.name])
                widths[c.name] += more
                spare -= more
        prose = [c for c in shown if c.kind == "prose"]
        wants = {c.name: self.natural(c) - widths[c.name] for c in prose}
        total_want = sum(wants.values())
        if spare > 0 and total_want > 0:
            give = {n: min(w, spare * w // total_want) for n, w in wants.items()}
            for c in prose:
                widths[c.name] += give[c.name]
            rest = spare - sum(give.values())
            for c in reversed(prose):  # rounding: the last columns first
                more = min(rest, wants[c.name] - give[c.name])
                widths[c.name] += more
                rest -= more
        return widths

    def table(self, width: int, title: str | None, styles: Sequence[str | None] | None):
        """The rich table of the shown columns at their widths (text cells cut with an ellipsis)."""
        from rich import box
        from rich.table import Table

        from ckpt_archive.cli.common import terminal_text, cut_text

        shown = self.active()
        widths = self.widths(width)
        table = Table(title=title if title is None else terminal_text(title), title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      padding=(0, 1, 0, 0))
        for c in shown:
            table.add_column(self.header(c), justify=c.justify, width=widths[c.name], no_wrap=c.kind != "prose",
                             overflow="fold" if c.kind == "prose" else "ellipsis")
        for i, row in enumerate(self.rows):
            cells = [cut_text(self.cell(c, row), widths[c.name]) if c.kind == "text" and isinstance(self.cell(c, row), str)
                     else self.cell(c, row) for c in shown]
            table.add_row(*cells, style=styles[i] if styles else None)
        total = self.needed()
        table.needed_width = total if total > width else None
        table.shown = [c.name for c in shown]
        return table


def date_forms(header_short: str = "created") -> tuple:
    """Shorter forms of a ``YYYY-MM-DD HH:MM:SS`` cell: without seconds, then without the year too."""
    return ((header_short, lambda t: t[:16]), (header_short, lambda t: t[5:16] if len(t) >= 16 else t))


__all__ = ["Col", "fit", "date_forms", "GAP"]
