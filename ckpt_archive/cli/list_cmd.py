"""``ckpt-archive list``: the generations of a repository."""
from __future__ import annotations

import typer

from ckpt_archive.cli.common import EXIT_CODES_HELP, JSON_OPTION, Output, command, human_bytes


def register(app: typer.Typer) -> None:
    @app.command("list", help="List usable generations (--all: also partial, copied and damaged ones, with "
                              "why). " + EXIT_CODES_HELP)
    @command
    def list_cmd(
        repo: str = typer.Argument(..., metavar="REPO"),
        all_: bool = typer.Option(False, "--all", help="Also list generations that are not usable."),
        json_output: bool = JSON_OPTION,
    ) -> None:
        import ckpt_archive
        from rich.table import Table

        out = Output(json_output)
        gens = ckpt_archive.list_generations(repo, all=all_)
        rows = [g.to_json() for g in gens]
        table = Table(title=f"{repo}", show_lines=False)
        for col in ("gen", "status", "step", "created (UTC)", "stored", "raw", "tags", "why"):
            table.add_column(col)
        for r in rows:
            table.add_row(str(r["generation"]), r["status"], "" if r["step"] is None else str(r["step"]),
                          (r["created"] or "")[:19].replace("T", " "), human_bytes(r["stored_bytes"]),
                          human_bytes(r["raw_bytes"]), ",".join(r["tags"]), r["reason"] or "")
        if rows:
            out.table(table)
        else:
            out.say("no usable generation" + ("" if all_ else " (--all shows the others)"))
        from ckpt_archive.repo.repository import Repository

        out.json({"repository": Repository.open(repo).location, "generations": rows})
