"""``ckpt-archive list``: the generations of a repository."""
from __future__ import annotations

import typer

from ckpt_archive.cli.common import JSON_OPTION, Output, command, exit_codes_help, human_bytes


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
        json_output: bool = JSON_OPTION,
    ) -> None:
        import ckpt_archive
        from rich.table import Table

        out = Output(json_output)
        from ckpt_archive.repo.repository import Repository

        r = Repository.open(repo)
        every = r.generations()
        gens = every if all_ else [g for g in every if g.usable]
        from ckpt_archive.ops.list import generation_row

        rows = [generation_row(g) for g in gens]
        table = Table(title=f"{repo}", show_lines=False)
        # new: stored bytes this generation wrote; stored: all it references (shared objects included)
        for col in ("gen", "status", "step", "created (UTC)", "new", "stored", "raw", "tags", "why"):
            table.add_column(col)
        for row in rows:
            table.add_row(str(row["generation"]), row["status"], "" if row["step"] is None else str(row["step"]),
                          (row["created"] or "")[:19].replace("T", " "), human_bytes(row["new_stored_bytes"]),
                          human_bytes(row["stored_bytes"]), human_bytes(row["raw_bytes"]), ",".join(row["tags"]),
                          row["reason"] or "")
        if rows:
            out.table(table)
        else:
            out.say("no usable generation" + ("" if all_ else f" ({r.existing_summary(every)}; --all shows them)"))
        copied = [g.number for g in every if g.status == "copied"]
        if copied and not all_:
            out.say(f"{len(copied)} generation(s) copied here from another place (restore reads them); "
                    f"`ckpt-archive adopt {r.location}` makes them usable here")
        out.json({"repository": r.location, "generations": rows})
