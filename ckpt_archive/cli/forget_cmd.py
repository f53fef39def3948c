"""``ckpt-archive forget REPO@GEN``: remove one generation, marker first, under the lock.

The removal itself is :func:`ckpt_archive.ops.forget.forget`; this module parses options and renders."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, split_repo_spec, KEY_FILE_OPTION, open_cli_repo)
from ckpt_archive.cli.prune_cmd import WAIT


def register(app: typer.Typer) -> None:
    @app.command("forget", help="Remove one generation: its USABLE marker first (from that instant it is not "
                 "usable), then its members, manifest and folder, holding the repository lock. Refuses the "
                 "newest usable generation unless --force. Never leaves nothing restorable: the generations "
                 "that remain are verified newest first until one passes; forgetting the only generation "
                 "that verifies is refused, --force or not."
                 + exit_codes_help({0: "the generation was removed",
                                    1: "nothing removed: it is the only generation that verifies (what fails in "
                                       "the others is named)",
                                    2: "nothing removed: no such generation (the existing ones are listed), the "
                                       "newest usable one without --force, lock held by another writer, not a "
                                       "repository"}, codes=(0, 1, 2)))
    @command
    def forget_cmd(
        spec: str = typer.Argument(..., metavar="REPO@GEN", help="Repository and generation: number, latest or "
                                   "tag:NAME (REPO alone means latest)."),
        force: bool = typer.Option(False, "--force", help="Also remove the newest usable generation."),
        wait: float = WAIT,
        key_file: Optional[Path] = KEY_FILE_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.forget import forget

        out = Output(json_output)
        repo, gen = split_repo_spec(spec)
        result = forget(open_cli_repo(repo, key_file=key_file), gen, force=force, wait=wait)
        newest = result.newest_usable
        out.say(f"forgot generation {result.generation} (was {result.status}); newest usable now: "
                f"{newest if newest is not None else 'none'}")
        for w in result.warnings:
            out.warn(w)
        line = result.objects.describe() if result.objects is not None and not result.objects.kept else None
        if line:
            out.say(f"shared objects: {line}")
        out.json({"ok": True, **result.to_json()})


__all__ = ["register"]
