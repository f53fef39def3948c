"""``ckpt-archive list``: the generations of a repository."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, human_bytes, KEY_FILE_OPTION, TRUST_OPTION, open_cli_repo)
from ckpt_archive.cli.tables import Col, date_forms, fit


def register(app: typer.Typer) -> None:
    @app.command("list", help="List usable generations (--all: also partial, copied and damaged ones, with "
                              "why). 'new' is what a generation stored itself, 'stored' everything it references "
                              "(tensors stored once and shared with other generations included)."
                 + exit_codes_help({0: "listed (also when nothing is usable)",
                                    2: "could not list (not a repository, store refused)"}, codes=(0, 2)))
    @command
    def list_cmd(
        repo: str = typer.Argument(..., metavar="REPO"),
        all_: bool = typer.Option(False, "--all", help="Also list generations that are not usable."),
        key_file: Optional[Path] = KEY_FILE_OPTION,
        trust: Optional[List[Path]] = TRUST_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        out = Output(json_output)
        r = open_cli_repo(repo, key_file=key_file, trust=trust)
        every = r.generations()
        gens = every if all_ else [g for g in every if g.usable]
        from ckpt_archive.ops.common import untrusted_reason
        from ckpt_archive.ops.list import generation_row

        rows = [generation_row(g) for g in gens]
        for g, row in zip(gens, rows):  # --trust: a generation no trusted key signed is shown as such
            why = untrusted_reason(r, g)
            if why is not None:
                row.update(status="untrusted", reason=why)
        if rows:
            if not out.json_mode:  # --json prints the rows: no table (nor rich) is built
                table = list_table(rows, repo, out.width)
                out.table(table)
                _say_reasons_left_out(rows, table, out)
        else:
            out.note("no usable generation" + ("" if all_ else f" ({r.existing_summary(every)}; --all shows them)"))
        copied = [g.number for g in every if g.status == "copied"]
        if copied and not all_:
            out.note(f"{len(copied)} generation(s) copied here from another place (restore reads them); "
                     f"`ckpt-archive adopt {r.location}` makes them usable here")
        out.json({"repository": r.location, "generations": rows})


#: ``list``'s columns (``new``: stored bytes this generation wrote; ``stored``: all it references, shared
#: objects included) and what gives way, in order, on a narrow terminal: the seconds of the date, the raw
#: size, the tags' full text, the ``why`` column (printed under the table instead), the new size, the year,
#: the tags.
LIST_COLUMNS = (Col("gen", "gen", justify="right"), Col("status", "status"), Col("step", "step", justify="right"),
                Col("created", "created (UTC)", forms=date_forms()), Col("new", "new", justify="right"),
                Col("stored", "stored", justify="right"), Col("raw", "raw", justify="right"),
                Col("tags", "tags", kind="text", min_width=6), Col("why", "why", kind="prose", min_width=20))
LIST_DEGRADE = (("abbrev", "created"), ("drop", "raw"), ("cut", "tags"), ("drop", "why"), ("drop", "new"),
                ("abbrev", "created"), ("drop", "tags"))


def list_table(rows: list[dict], title: str, width: int):
    """The generations as a table fitted to ``width`` columns (:func:`ckpt_archive.cli.tables.fit`); the
    ``why`` column only when some generation has a reason (``--all``)."""
    cols = [c for c in LIST_COLUMNS if c.name != "why" or any(r["reason"] for r in rows)]
    cells = [[str(r["generation"]), r["status"], "" if r["step"] is None else str(r["step"]),
              (r["created"] or "")[:19].replace("T", " "), human_bytes(r["new_stored_bytes"]),
              human_bytes(r["stored_bytes"]), human_bytes(r["raw_bytes"]), ",".join(r["tags"]), r["reason"] or ""]
             for r in rows]
    keep = [i for i, c in enumerate(LIST_COLUMNS) if c in cols]
    return fit(cols, [[row[i] for i in keep] for row in cells], width, title=title, degrade=LIST_DEGRADE)


def _say_reasons_left_out(rows: list[dict], table, out: Output) -> None:
    """When the terminal had no room for the ``why`` column, each reason under the table."""
    if "why" in table.shown or not any(r["reason"] for r in rows):
        return
    for r in rows:
        if r["reason"]:
            out.say(f"  {r['generation']}: {r['reason']}")


__all__ = ["register", "LIST_COLUMNS", "LIST_DEGRADE", "list_table"]
