"""``ckpt-archive status REPO --max-age 2h``: the watchdog for scheduled backups (cron / systemd alerting)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, exit_with, KEY_FILE_OPTION, TRUST_OPTION, open_cli_repo)


def register(app: typer.Typer) -> None:
    @app.command("status", help="Watchdog for scheduled backups: is the newest usable generation of REPO recent "
                 "(--max-age) and did training move on since the last check (a newer generation must hold a "
                 "later step)? Reads the repository only; the last check is remembered in --state FILE "
                 "(default ~/.local/state/ckpt-archive/status/, keyed by the repository's place). Run it from "
                 "cron or a systemd timer and alert on a non-zero exit."
                 + exit_codes_help({0: "healthy",
                                    1: "unhealthy: no usable generation, the newest is older than --max-age or "
                                       "dated more than 5 min in the future (clock skew), or a newer generation "
                                       "did not advance the step",
                                    2: "could not check (not a repository, store refused, bad flags)"}))
    @command
    def status_cmd(
        repo: str = typer.Argument(..., metavar="REPO", help="Repository path or URL."),
        max_age: Optional[str] = typer.Option(None, "--max-age", metavar="AGE",
                                              help="The oldest the newest usable generation may be: 2h, 90min, "
                                                   "1d12h, 45s (w d h min s)."),
        state: Optional[Path] = typer.Option(None, "--state", metavar="FILE",
                                             help="Where the last check is remembered (for the step check)."),
        no_record: bool = typer.Option(False, "--no-record", help="Do not remember this check."),
        key_file: Optional[Path] = KEY_FILE_OPTION,
        trust: Optional[List[Path]] = TRUST_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.status import status

        out = Output(json_output)
        report = status(open_cli_repo(repo, key_file=key_file, trust=trust), max_age=max_age, state=state, record=not no_record)
        if report.ok:
            from ckpt_archive.ops.common import human_seconds

            age = "" if report.age_s is None else f", {human_seconds(report.age_s)} old"
            out.say(f"ok: newest usable generation {report.generation} (step {report.step}{age}) at "
                    f"{report.location}", style="green")
        else:  # the verdict cron must mail: printed even with --quiet
            for line in report.problems:
                out.say(f"unhealthy: {report.location}: {line}", style="red", even_quiet=True)
        out.json(report.to_json())
        exit_with(report)


__all__ = ["register"]
