"""Helpers every command uses: REPO@GEN parsing, output (results on stdout, diagnostics on stderr), exit
codes, progress bars with phases. Commands stay thin: parse, call the library, report.

Output modes, the same for every command (as restic, borg and git do it):

* default: the result (tables, verdicts, what was written) on **stdout**, so ``ckpt-archive list R | grep
  usable`` works; notes, warnings, errors and progress on **stderr**; a progress bar (phase, IEC bytes,
  MiB/s, ETA once a rate is known), one row wide, when stderr is a terminal;
* ``--json``: one JSON object on stdout and nothing on stderr -- errors too are that JSON object
  (``ok: false``, ``error``, ``reason``, ``exit_code``); a successful object has ``ok: true``;
* ``--quiet`` (for cron): only warnings and errors on stderr (and a failing verdict), no progress.

Tables and bars are laid out for the terminal's width, 80 columns included (:mod:`ckpt_archive.cli.tables`):
a number is never cut; columns are abbreviated or dropped instead.

``--quiet`` is added to every command by :func:`command`, which also maps exceptions to exit codes and
turns Ctrl-C into exit 130 with a line naming what was left and the command that cleans it.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from typing import Any, Callable

import typer

from ckpt_archive.ops.common import split_repo_spec  # noqa: F401 - REPO@GEN parsing lives in ops (integrations parse it too)
from ckpt_archive.errors import EXIT_MEANINGS, CkptArchiveError, UsageError, exit_code_for


def exit_codes_help(meanings: dict[int, str] | None = None, codes: tuple[int, ...] = (0, 1, 2)) -> str:
    """The exit-code paragraph of one command's ``--help``: the codes it returns, in its own words.

    A paragraph of its own (after a blank line), so the top-level ``--help`` shows only each command's
    first paragraph. Ctrl-C (130) is always listed.

    Args:
        meanings: ``{code: what it means for this command}``; codes not given use
            :data:`ckpt_archive.errors.EXIT_MEANINGS`.
        codes: the codes this command returns besides 130 (default 0, 1, 2).

    Returns:
        ``"\n\nExit codes: 0 ...; 1 ...; 2 ...; 130 ..."``.
    """
    meanings = dict(meanings or {})
    wanted = sorted(set(codes) | set(meanings) | {130})
    parts = [f"{c} {meanings.get(c, EXIT_MEANINGS[c])}" for c in wanted]
    return "\n\nExit codes: " + "; ".join(parts) + "."


#: ``--quiet`` of the command now running (set by :func:`command`; read by :class:`Output`).
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_archive_quiet", default=False)


def _unicode_only(obj):
    """``obj`` with every str that holds lone surrogates (a path in bytes that are not UTF-8) written with
    ``\\x`` escapes: JSON's ``\\udcXX`` for a lone surrogate is refused by strict parsers."""
    if isinstance(obj, str):
        from ckpt_archive.format.text import shown

        return shown(obj)
    if isinstance(obj, dict):
        return {_unicode_only(k): _unicode_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_unicode_only(v) for v in obj]
    return obj


class _Readable:
    """``sys.stdout`` or ``sys.stderr``, looked up at every write (a test runner swaps them), writing a path
    whose bytes are not UTF-8 with ``\\xNN`` escapes (:func:`ckpt_archive.format.text.shown`): stdout's
    strict encoder would raise on its lone surrogates, so a result naming such a path would crash."""

    def __init__(self, name: str):
        self._name = name

    @property
    def _stream(self):
        return getattr(sys, self._name)

    def write(self, text: str) -> int:
        from ckpt_archive.format.text import shown

        return self._stream.write(shown(text))

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"


def _console(stream: str):
    import os

    from rich.console import Console

    # emoji=False: rich would print a path or reason holding ``:x:`` or ``:100:`` with an emoji in its place
    console = Console(file=_Readable(stream), stderr=stream == "stderr", highlight=False, soft_wrap=True,
                      emoji=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 200  # logs and pipes: do not cut paths and reasons at 80 columns
    return console


def terminal_text(text):
    """``text`` (a str or a :class:`rich.text.Text`) with every control character but newline and tab as a
    ``\\xNN`` escape (:func:`ckpt_archive.format.text.printable`): every line the CLI prints goes through
    here, so a tag, note, host name or path read from an archive never reaches a terminal (or a pipe) as an
    escape sequence. Rich adds its own styling after this, never from the text."""
    from ckpt_archive.format.text import has_control, printable

    plain = getattr(text, "plain", text)
    if not isinstance(plain, str) or not has_control(plain.replace("\n", "").replace("\t", "")):
        return text
    if plain is text:
        return printable(text)
    from rich.text import Text

    return Text(printable(plain), style=text.style)  # a styled cell: the style kept, its spans given up


def _terminal_renderable(obj):
    """A table (or a group of them and lines) with :func:`terminal_text` applied to its title, caption,
    headers and cells: a table built outside :func:`ckpt_archive.cli.tables.fit` (the LR-policy audit, whose
    scheduler kind and group names come from the archive) is escaped here."""
    from rich.console import Group
    from rich.table import Table

    if isinstance(obj, Group):
        obj._renderables = [_terminal_renderable(r) for r in obj.renderables]
    elif isinstance(obj, Table):
        for name in ("title", "caption"):
            if getattr(obj, name, None) is not None:
                setattr(obj, name, terminal_text(getattr(obj, name)))
        for col in obj.columns:
            col.header = terminal_text(col.header)
            col._cells = [_terminal_renderable(c) for c in col._cells]
    else:
        return terminal_text(obj)
    return obj


class Output:
    """The result on stdout, diagnostics on stderr (rich, no tracebacks); one JSON object on stdout in ``--json``
    mode.

    * :meth:`say`, :meth:`table`: the command's result (stdout); not with ``--json`` or ``--quiet``, except a
      failing verdict (``even_quiet=True``), which cron must mail;
    * :meth:`note`: what the command is doing, hints (stderr); not with ``--json`` or ``--quiet``;
    * :meth:`warn`, :meth:`error`: stderr, also with ``--quiet``; not with ``--json`` (the object carries them);
    * :meth:`json`: the one object, with ``ok`` (true unless the object or the caller says otherwise).

    Args:
        json_mode: ``--json`` was given.
        quiet: ``--quiet`` was given (default: the running command's, see :func:`command`).
    """

    def __init__(self, json_mode: bool, quiet: bool | None = None):
        self.json_mode = json_mode
        self.quiet = _QUIET.get() if quiet is None else quiet

    # the consoles are made on first use: ``--json`` prints without rich (its import is ~0.03 s of start-up)
    @functools.cached_property
    def out(self):
        """The rich console on stdout."""
        return _console("stdout")

    @functools.cached_property
    def err(self):
        """The rich console on stderr."""
        return _console("stderr")

    @property
    def width(self) -> int:
        """Columns available for a result (the stdout console's width; 200 with ``--json``, which prints no
        table, without making a console)."""
        return 200 if self.json_mode else self.out.width

    def say(self, text: str = "", style: str | None = None, *, even_quiet: bool = False) -> None:
        """A line of the result, on stdout (not in ``--json`` mode; not with ``--quiet`` unless ``even_quiet``)."""
        if not self.json_mode and (even_quiet or not self.quiet):
            self.out.print(terminal_text(text), style=style, markup=False)

    def note(self, text: str = "", style: str | None = None) -> None:
        """A diagnostic line on stderr: what is being done, a hint (not in ``--json`` or ``--quiet`` mode)."""
        if not (self.json_mode or self.quiet):
            self.err.print(terminal_text(text), style=style, markup=False)

    def warn(self, text: str) -> None:
        """A warning on stderr (not in ``--json`` mode, where the JSON object carries it)."""
        if not self.json_mode:
            self.err.print(terminal_text(f"warning: {text}"), style="yellow", markup=False)

    def error(self, text: str) -> None:
        """An error line on stderr (not in ``--json`` mode, where the JSON object carries it)."""
        if not self.json_mode:
            self.err.print(terminal_text(text), style="red", markup=False)

    def table(self, table) -> None:
        """A table of the result, on stdout (not in ``--json`` or ``--quiet`` mode). A table laid out by
        :func:`ckpt_archive.cli.tables.fit` that cannot fit even with its columns dropped is printed at the
        width it needs, never with a number cut."""
        if not (self.json_mode or self.quiet):
            table = _terminal_renderable(table)
            need = getattr(table, "needed_width", None)
            if need and need > self.out.width:  # rich would shrink every column to its width, numbers too
                width, self.out.width = self.out.width, need
                try:
                    self.out.print(table)
                finally:
                    self.out.width = width
            else:
                self.out.print(table)

    def json(self, obj: dict, *, ok: bool | None = None) -> None:
        """Print ``obj`` as the one JSON object on stdout (``--json`` mode only), ``ok`` first: the object's
        own, else ``ok`` as given, else true (an error is printed by :func:`command`, with ``ok: false``)."""
        if self.json_mode:
            from ckpt_archive.format.jsonio import dumps

            if "ok" not in obj:
                obj = {"ok": True if ok is None else bool(ok), **obj}
            sys.stdout.write(dumps(_unicode_only(obj), indent=2, ensure_ascii=True, default=str).decode("utf-8"))
            sys.stdout.flush()

    def progress(self, total: int | None, description: str):
        """A progress bar (phase, bytes in IEC units, MiB/s, ETA once a rate is known), one row at any width,
        when stderr is a terminal and neither ``--json`` nor ``--quiet`` is given; else a no-op. The returned
        object is a context manager, a callable ``advance(nbytes)`` and has ``phase(name, total)``."""
        return make_progress(total, description,
                             enabled=not (self.json_mode or self.quiet) and self.err.is_terminal)


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, nbytes: int) -> None:
        pass

    def phase(self, name: str, total: int | None = None) -> None:
        pass


#: An ETA is shown only once the phase has run this long (seconds) and a rate was measured: the first
#: tick's rate (a few bytes after the set-up of the phase) would promise hours.
ETA_AFTER_S = 2.0


def eta_seconds(task) -> float | None:
    """Seconds left in a rich ``Task``, or None while no trustworthy rate is known: no total, nothing done,
    fewer than :data:`ETA_AFTER_S` seconds into the phase, or no measured speed."""
    if task.total is None or task.finished:
        return None
    elapsed = task.elapsed or 0.0
    speed = task.speed
    if elapsed < ETA_AFTER_S or not task.completed or not speed:
        return None
    return max(0.0, (task.total - task.completed) / speed)


def _clock(seconds: float) -> str:
    """``75`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def size_text(done: int, total: int | None) -> str:
    """``"12.3/464.0 MiB"`` (one unit when both sides share it), ``"512 B/1.5 KiB"``, or ``done`` alone."""
    d = human_bytes(int(done))
    if total is None:
        return d
    t = human_bytes(int(total))
    dv, du = d.rsplit(" ", 1)
    tv, tu = t.rsplit(" ", 1)
    return f"{dv}/{tv} {tu}" if du == tu else f"{d}/{t}"


def cut_text(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, cut with an ellipsis at a word boundary (never inside a word or
    a number: ``generation 12`` never becomes ``generation 1…``). Never raises; ``width`` in terminal cells."""
    from rich.cells import cell_len, set_cell_size

    if cell_len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = set_cell_size(text, width - 1).rstrip()
    if len(head) < len(text) and text[len(head)].isalnum() and head[-1:].isalnum():
        cut = max(head.rfind(c) for c in " ,;:/-_(")
        head = head[:cut + 1].rstrip() if cut > 0 else ""
    return head + "…"


#: A progress row's description is cut to no fewer cells than this to keep the speed (the phase's first words
#: stay: "restore: decode, check and…").
DESC_KEEP = 24


def bar_line(task, width: int):
    """One progress row for a rich ``Task``, at most ``width - 1`` cells (a full row wraps on some
    terminals): ``description  bar  done/total unit  speed  ETA m:ss``. The sizes and the ETA are never
    cut: as the row narrows, the description is cut (to :data:`DESC_KEEP` cells) before the speed goes (at 80
    columns restore's "decode, check and write generation 1" dropped its MiB/s [issue 26]), then it is cut
    further (to 12 cells), then the bar goes."""
    from rich.cells import cell_len
    from rich.text import Text

    avail = max(24, width - 1)
    size = size_text(task.completed, task.total)
    speed = task.finished_speed or task.speed
    speed_s = f"{human_bytes(int(speed))}/s" if speed else ""
    eta = eta_seconds(task)
    eta_s = f"ETA {_clock(eta)}" if eta is not None else ""
    right = cell_len(size) + (2 + cell_len(eta_s) if eta_s else 0)
    desc = task.description
    d = cell_len(desc)
    gap, bar_min, bar_max = 2, 10, 40
    spd = gap + cell_len(speed_s) if speed_s else 0
    if d + gap + bar_min + gap + right + spd <= avail:            # everything
        bar_w = min(bar_max, avail - d - 2 * gap - right - spd)
    elif spd and avail - (2 * gap + bar_min + right + spd) >= DESC_KEEP:  # the description cut, the speed kept
        bar_w = bar_min
        d = avail - (2 * gap + bar_min + right + spd)
    elif d + gap + bar_min + gap + right <= avail:               # without the speed
        spd, bar_w = 0, min(bar_max, avail - d - 2 * gap - right)
    elif avail - (gap + bar_min + gap + right) >= 12:            # the description cut
        spd, bar_w = 0, bar_min
        d = avail - (2 * gap + bar_min + right)
    else:                                                        # no bar
        spd, bar_w = 0, 0
        d = max(8, avail - gap - right)
    line = Text(cut_text(desc, d).ljust(d))
    if bar_w:
        line.append(" " * gap)
        filled = int(bar_w * min(1.0, task.completed / task.total)) if task.total else 0
        line.append("━" * filled, style="bar.complete")
        line.append("━" * (bar_w - filled), style="bar.back")
    line.append(" " * gap + size, style="progress.download")
    if spd:
        line.append(" " * gap + speed_s, style="progress.data.speed")
    if eta_s:
        line.append(" " * gap + eta_s, style="progress.remaining")
    return line


def _line_progress_class():
    from rich.progress import Progress

    class LineProgress(Progress):
        """A rich Progress whose every task is one row laid out for the console's width (:func:`bar_line`)."""

        def get_renderables(self):
            tasks = [t for t in self.tasks if t.visible]
            if not tasks:  # rich's Live renders once while the Progress is still being built
                return
            width = self.console.width
            for task in tasks:
                yield bar_line(task, width)

    return LineProgress


class _RichProgress:
    def __init__(self, total, description):
        from rich.console import Console

        # no redirection of stdout: results printed meanwhile go to stdout, not into the bar's stream
        self._p = _line_progress_class()(console=Console(stderr=True, emoji=False), transient=True, redirect_stdout=False,
                                         redirect_stderr=False)
        self._total = total
        self._desc = description
        self._base = description.split(":", 1)[0]  # "pack: write" -> phases read "pack: trial reload"

    def __enter__(self):
        self._p.__enter__()
        self._task = self._p.add_task(self._desc, total=self._total)
        return self

    def __exit__(self, *exc):
        return self._p.__exit__(*exc)

    def __call__(self, nbytes: int) -> None:
        self._p.advance(self._task, nbytes)

    def phase(self, name: str, total: int | None = None) -> None:
        """A new phase of the work (``verify``, ``trial reload``, ``re-read``): the bar starts over, and so
        do its rate and ETA."""
        self._p.reset(self._task, total=total, completed=0, description=f"{self._base}: {name}")
        self._p.refresh()  # show each phase at once, however short (not only at the next timed refresh)


def make_progress(total: int | None, description: str, enabled: bool):
    """Return a context manager that is also a callable ``advance(nbytes)`` with ``phase(name, total)``."""
    return _RichProgress(total, description) if enabled else _NoProgress()


__all__ = ["JSON_OPTION", "KEY_FILE_OPTION", "TRUST_OPTION", "SIGN_KEY_OPTION", "open_cli_repo", "QUIET_OPTION", "Output", "command", "exit_code_for", "exit_codes_help",
           "exit_with", "human_bytes", "make_progress", "split_repo_spec"]


def exit_with(result: Any) -> None:
    """End a command with the exit code :func:`ckpt_archive.errors.exit_code_for` gives ``result``.

    Returns normally (exit 0) when the result is ok; raises ``typer.Exit(code)`` otherwise.
    """
    code = exit_code_for(result)
    if code:
        raise typer.Exit(code)


QUIET_OPTION = typer.Option(False, "--quiet", "-q", help="Only warnings and errors on stderr, no progress "
                                                         "(for cron).")


#: Commands that only read a repository (a failed-check note aside) and write, at most, one output that is
#: complete, closed and renamed into place before they return (restore): a Ctrl-C leaves nothing in the
#: repository to clean (:func:`interrupted_text`), and nothing they made waits for a garbage collection at
#: exit (``cli/app.py: main`` leaves their objects out of it).
READ_ONLY_COMMANDS = frozenset({"verify", "list", "status", "inspect", "restore"})


def interrupted_text(exc: BaseException, command: str | None = None) -> tuple[str, str | None, str | None]:
    """What a Ctrl-C left behind, from the notes the library attached to the ``KeyboardInterrupt``
    (``ckpt_left``: what was left, ``ckpt_cleanup``: the command that cleans it); without a note, what a
    command of ``command``'s kind can have left (:data:`READ_ONLY_COMMANDS`: nothing in the repository).

    Returns:
        ``(message, left, cleanup)``.
    """
    left = getattr(exc, "ckpt_left", None)
    cleanup = getattr(exc, "ckpt_cleanup", None)
    if left:
        text = f"interrupted: {left}"
        if cleanup:
            text += f"; {cleanup}"
    elif command in READ_ONLY_COMMANDS:  # [break] not pack's words about partial generations: nothing was written
        text = "interrupted before anything was written; the repository was only read"
    else:
        text = ("interrupted; nothing is known to be left half-written (`ckpt-archive list --all REPO` shows "
                "any partial generation, `ckpt-archive gc REPO` removes it)")
    return text, left, cleanup


def command(fn: Callable) -> Callable:
    """Wrap a command body: add ``--quiet``, map any exception to its exit code
    (:func:`~ckpt_archive.errors.exit_code_for`), never show a traceback.

    The wrapped function must accept ``json_output: bool`` as a keyword argument. In ``--json`` mode an
    error is the one JSON object on stdout (nothing on stderr). Ctrl-C exits 130 naming what was left and
    the command that cleans it.
    """
    sig = inspect.signature(fn)
    takes_quiet = "quiet" in sig.parameters

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> Any:
        STARTED.append(fn.__name__.removesuffix("_cmd").replace("_", "-"))
        import warnings

        from ckpt_archive.repo.publish import record_publishes

        quiet = bool(kwargs.get("quiet", False)) if takes_quiet else bool(kwargs.pop("quiet", False))
        json_mode = bool(kwargs.get("json_output", False))
        token = _QUIET.set(quiet)
        out = Output(json_mode, quiet)
        with record_publishes() as published, warnings.catch_warnings(record=True) as caught:
            try:
                _run_body(fn, args, kwargs, out, published)
                FINISHED.append(0)
            except typer.Exit as exc:
                FINISHED.append(exc.exit_code)
                raise
            finally:
                _QUIET.reset(token)
                _show_warnings(caught, out)

    if not takes_quiet:
        params = list(sig.parameters.values())
        quiet_param = inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, default=QUIET_OPTION, annotation=bool)
        wrapper.__signature__ = sig.replace(parameters=[*params, quiet_param])
    return wrapper


#: Names of the commands whose body started in this process (a Ctrl-C that escapes a command's own handler, a
#: second one while the first was reported, must not be told as "nothing was done": ``cli/app.py: main``).
STARTED: list[str] = []

#: Exit codes of the commands that finished in this process (a Ctrl-C landing after the command's body
#: returned must not turn its result into 130: :func:`ckpt_archive.cli.app.main` reads this).
FINISHED: list[int] = []


def _show_warnings(caught: list, out: Output) -> None:
    """Warnings raised through the ``warnings`` module while a command ran (torch's own, mostly), each once,
    as the tool's warnings; none under ``--quiet`` or ``--json``."""
    if out.quiet or out.json_mode:
        return
    seen: set[str] = set()
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"
        if text not in seen:
            seen.add(text)
            out.warn(text)


def published_text(published: list[tuple[str, int]], left: str | None) -> str:
    """The line for a Ctrl-C that landed after a generation was published (the command then exits 0)."""
    gens = ", ".join(f"generation {n} of {loc}" for loc, n in published)
    text = f"interrupted after {gens} was published: it is usable (`ckpt-archive list` shows it)"
    if left:
        text += f"; also: {left}"
    return text


def _run_body(fn: Callable, args: tuple, kwargs: dict, out: Output, published: list) -> None:
    """Run a command body; map every exception to its exit code and report it (see :func:`command`)."""
    try:
        fn(*args, **kwargs)
    except typer.Exit:
        raise
    except CkptArchiveError as exc:
        code = exit_code_for(exc)
        import os

        if os.environ.get("CKPT_ARCHIVE_DEBUG") and exc.__cause__ is not None \
                and not isinstance(exc.__cause__, CkptArchiveError):  # a wrapped unexpected error
            raise
        out.error(f"error: {exc}")
        out.json({"ok": False, **exc.to_json(), "exit_code": code})
        raise typer.Exit(code)
    except KeyboardInterrupt as exc:
        text, left, cleanup = interrupted_text(exc, fn.__name__.removesuffix("_cmd").replace("_", "-"))
        complete = getattr(exc, "ckpt_complete", None)  # e.g. restore's output renamed into place
        if published or complete:  # the interrupt came after the commit point: the work it was asked for is done
            text = (published_text(published, getattr(exc, "ckpt_left", None)) if published
                    else f"interrupted after the work was done: {complete}")
            out.warn(text)
            out.json({"ok": True, "interrupted": True, "published": [n for _, n in published],
                      "complete": complete, "reason": text, "left": left, "cleanup": cleanup, "exit_code": 0})
            return
        code = exit_code_for(exc)
        out.error(text)
        out.json({"ok": False, "error": "Interrupted", "reason": text, "left": left, "cleanup": cleanup,
                  "exit_code": code})
        raise typer.Exit(code)
    except OSError as exc:
        code = exit_code_for(exc)
        where = getattr(exc, "filename", None)
        reason = f"{where}: {exc.strerror or exc}" if where else str(exc)
        out.error(f"error: {reason}")
        out.json({"ok": False, "error": type(exc).__name__, "where": where, "reason": str(exc),
                  "exit_code": code})
        raise typer.Exit(code)
    except Exception as exc:  # last resort: still no traceback for a user, but say it is a bug
        code = exit_code_for(exc)
        import os

        if os.environ.get("CKPT_ARCHIVE_DEBUG"):
            raise
        notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))  # e.g. the partial generation left
        out.error(f"internal error ({type(exc).__name__}): {exc}{notes}. This is a bug in ckpt-archive; "
                  f"set CKPT_ARCHIVE_DEBUG=1 for a traceback.")
        out.json({"ok": False, "error": type(exc).__name__, "reason": f"{exc}{notes}", "exit_code": code})
        raise typer.Exit(code)


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def seconds_callback(name: str, *, allow_zero: bool = True):
    """A Typer callback refusing ``inf``, ``nan``, negative (and, unless ``allow_zero``, zero) seconds as a
    usage error (exit 2) at parse time (:func:`ckpt_archive.format.durations.check_seconds`)."""

    def check(value):
        if value is None:
            return None
        from ckpt_archive.format.durations import check_seconds

        try:
            return check_seconds(value, name, allow_zero=allow_zero)
        except UsageError as exc:
            raise typer.BadParameter(str(exc)) from None

    return check


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else there.")


#: ``--key-file``: an encrypted repository's key (docs/FORMAT.md, "Encrypted repositories").
KEY_FILE_OPTION = typer.Option(
    None, "--key-file", metavar="PATH",
    help="Key file of an encrypted repository (default: $CKPT_ARCHIVE_KEY_FILE); a repository created with one "
         "is encrypted. Without it an encrypted repository is refused (exit 2).")
#: ``--trust``: public keys a generation must be signed by (docs/FORMAT.md, "Signatures").
TRUST_OPTION = typer.Option(
    None, "--trust", metavar="PUBKEY",
    help="Require a signature by this public key (PATH.pub; repeatable; default: $CKPT_ARCHIVE_TRUST, paths "
         "separated by ':'): an unsigned or foreign-signed generation is refused (exit 1).")
#: ``--sign-key``: sign every generation published (docs/FORMAT.md, "Signatures").
SIGN_KEY_OPTION = typer.Option(
    None, "--sign-key", metavar="PATH",
    help="Sign each generation published with this Ed25519 private key (ckpt-archive key new; default: "
         "$CKPT_ARCHIVE_SIGN_KEY).")


def open_cli_repo(repo: str, *, create: bool = False, key_file=None, trust=None, sign_key=None):
    """The repository a command works on, opened with the key options it was given (None: the environment
    default, :mod:`ckpt_archive.repo.keys`). Key material never reaches output or errors."""
    from ckpt_archive.repo.repository import Repository

    return Repository.open(repo, create=create, key_file=key_file, trust=list(trust) if trust else None,
                           sign_key=sign_key)
