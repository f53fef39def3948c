"""``ckpt-archive verify``: check a generation (sizes + sha256; ``--deep``: the full trial reload)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, exit_with, split_repo_spec, KEY_FILE_OPTION, TRUST_OPTION, open_cli_repo)


def register(app: typer.Typer) -> None:
    @app.command("verify", help="Check a generation: manifest schema and version, marker, every member's size "
                                "and sha256; --deep also decodes every chunk and rebuilds every tensor (the "
                                "trial reload) and marks a copied generation usable here (ckpt-archive adopt does "
                                "that for every copied generation at once)."
                 + exit_codes_help({0: "the generation checks out",
                                    1: "something was found wrong (corrupt, tampered or missing member; with "
                                       "--strict an incomplete state; without @GEN, every published generation "
                                       "damaged); the problem names the member",
                                    2: "could not check (no such generation, a partial one -- never published --, "
                                       "not a repository, newer format, lock held while marking a copied "
                                       "generation)"}))
    @command
    def verify_cmd(
        spec: str = typer.Argument(..., metavar="REPO[@GEN]", help="GEN: a number, 'latest' or 'tag:NAME'."),
        deep: bool = typer.Option(False, "--deep", help="Decode everything and rebuild every tensor."),
        fallback: bool = typer.Option(False, "--fallback",
                                      help="If @latest fails, verify the newest generation that passes instead."),
        strict: bool = typer.Option(False, "--strict", help="Completeness warnings fail the check (exit 1)."),
        jobs: int = typer.Option(None, "--jobs", "-j", help="Decoder threads (default: all cores)."),
        key_file: Optional[Path] = KEY_FILE_OPTION,
        trust: Optional[List[Path]] = TRUST_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        import ckpt_archive

        out = Output(json_output)
        repo, gen = split_repo_spec(spec)
        with out.progress(None, "verify") as bar:  # each check tells the bar its phase and total
            report = ckpt_archive.verify(open_cli_repo(repo, key_file=key_file, trust=trust), gen,
                                         ckpt_archive.VerifyOptions(deep=deep, strict=strict, fallback=fallback,
                                                                    jobs=jobs), on_bytes=bar)
        _extend_report(report, out)
        for w in report.warnings:
            if is_info(w):  # what could not be checked, a guess: not a warning (cron would mail it every run)
                out.say(f"info: {_without_info_tag(w)}")
            else:
                out.warn(w)
        if report.ok:
            what = "deep check (trial reload)" if deep else "sizes and sha256"
            extra = " and marked usable here" if report.marked_usable else ""
            out.say(f"generation {report.generation}: ok ({what}){extra}", style="green")
        else:  # the failing verdict is printed even with --quiet: it is what cron must mail
            out.say(f"generation {report.generation}: {len(report.problems)} problem(s)", style="red", even_quiet=True)
            for p in report.problems:
                where = " ".join(x for x in (p.member, p.field) if x)
                out.say(f"  {where}: {p.reason}", style="red", even_quiet=True)
        out.json(report.to_json())
        exit_with(report)


def _extend_report(report, out: Output) -> None:
    """The policy audit's table and counters (its verdict is in the report: ``--strict`` lint findings fail)."""
    from ckpt_archive.cli.policy_views import cli_verify

    cli_verify(report, out)


def is_info(warning: str) -> bool:
    """A finding of severity ``info`` in ``VerifyReport.warnings`` (``"completeness (info): ..."``, ``"policy
    (info): ..."``): what could not be checked or a guess, never a failure (even ``--strict``). It is part of
    the result (stdout), not a warning: ``verify -q`` from cron prints nothing for a state that is fine."""
    head = warning.split(":", 1)[0]
    return head.endswith("(info)")


def _without_info_tag(warning: str) -> str:
    head, _, rest = warning.partition(":")
    return f"{head.replace(' (info)', '')}:{rest}"


__all__ = ["register", "is_info"]
