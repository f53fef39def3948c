"""``ckpt-archive gc REPO``: remove leftovers of interrupted writes, holding the lock, and say what went.

The collection itself is :func:`ckpt_archive.ops.gc.gc`; this module parses options and renders."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ckpt_archive.cli.common import JSON_OPTION, Output, command, exit_codes_help, KEY_FILE_OPTION, open_cli_repo
from ckpt_archive.cli.prune_cmd import WAIT


def register(app: typer.Typer) -> None:
    @app.command("gc", help="Remove leftovers of interrupted writes (partial generations, temporary files, "
                 "shared objects no manifest references), "
                 "holding the repository lock, and list what was removed. Damaged generations are reported, "
                 "not removed (use forget)."
                 + exit_codes_help({0: "leftovers removed (or listed with --dry-run), or nothing to remove",
                                    2: "could not be carried out (not a repository, lock held by another writer, "
                                       "store unreachable or refused a removal)"}, codes=(0, 2)))
    @command
    def gc_cmd(
        repo: str = typer.Argument(..., metavar="REPO", help="Repository path or URL."),
        dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List what would be removed; remove nothing."),
        wait: float = WAIT,
        key_file: Optional[Path] = KEY_FILE_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.gc import gc

        out = Output(json_output)
        result = gc(open_cli_repo(repo, key_file=key_file), dry_run=dry_run, wait=wait)
        verb = "would remove" if dry_run else "removed"
        for item in result.removed:
            out.say(f"{verb} generation {item['generation']}: partial ({item['reason']})")
        for key in result.removed_files:
            out.say(f"{verb} {key}: temporary file of an interrupted write")
        if result.removed_objects:
            out.say(f"{verb} {len(result.removed_objects)} shared object(s) no manifest references "
                    f"({result.freed_object_bytes} bytes)")
        if result.objects_kept:
            out.warn(result.objects_kept)
        for why in result.objects_skipped:
            out.warn(f"left alone: {why}")
        for why in result.skipped_keys:
            out.warn(why)
        for item in result.kept_not_usable:
            out.warn(f"generation {item['generation']} is {item['status']} ({item['reason']}); not a leftover, "
                     f"left in place")
        if not result.removed and not result.removed_files and not result.removed_objects:
            out.say("nothing to remove: no leftovers of interrupted writes")
        out.json({"ok": True, **result.to_json()})


__all__ = ["register"]
