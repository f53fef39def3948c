"""``ckpt-archive adopt REPO``: make every copied generation of a moved repository usable at its new place."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, exit_with, human_bytes, KEY_FILE_OPTION, SIGN_KEY_OPTION, open_cli_repo)
from ckpt_archive.cli.prune_cmd import WAIT


def register(app: typer.Typer) -> None:
    @app.command("adopt", help="Make every generation of a moved or copied repository (cp -a, rsync, aws s3 "
                 "sync) usable at its new place, in one run: holding the writer lock, each 'copied' generation "
                 "is checked deeply here (every chunk decoded, every tensor rebuilt and compared: the trial "
                 "reload) and, when nothing is wrong, its marker is rewritten to name this place. Generations "
                 "already usable here are not read. (restore reads copied generations without this, checking "
                 "every byte; adopt makes them count for list, @latest and retention.)"
                 + exit_codes_help({0: "every copied generation is usable here now (or there was none)",
                                    1: "a copied generation failed its deep check (named; it stays copied)",
                                    2: "could not be carried out (not a repository, lock held, store refused)"}))
    @command
    def adopt_cmd(
        repo: str = typer.Argument(..., metavar="REPO", help="The repository at its new place (path or URL)."),
        jobs: int = typer.Option(None, "--jobs", "-j", help="Decoder threads (default: all cores)."),
        wait: float = WAIT,
        key_file: Optional[Path] = KEY_FILE_OPTION,
        sign_key: Optional[Path] = SIGN_KEY_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.verify import adopt

        out = Output(json_output)
        with out.progress(None, "adopt") as bar:
            report = adopt(open_cli_repo(repo, key_file=key_file, sign_key=sign_key), jobs=jobs, wait=wait, on_bytes=bar)
        for n, problems in report.failed.items():
            out.error(f"generation {n}: {len(problems)} problem(s); it stays copied")
            for p in problems:
                where = " ".join(x for x in (p.member, p.field) if x)
                out.error(f"  {where}: {p.reason}")
        for n, status in report.skipped.items():
            out.warn(f"generation {n} is {status}: not adopted (ckpt-archive list --all says why)")
        if report.adopted:
            out.say(f"adopted generation(s) {', '.join(map(str, report.adopted))} at {report.location}: deep-checked "
                    f"here ({human_bytes(report.bytes)} decoded) and marked usable", style="green")
        elif not report.failed:
            out.say(f"nothing to adopt: no copied generation at {report.location}")
        out.json(report.to_json())
        exit_with(report)


__all__ = ["register"]
