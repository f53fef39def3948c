"""``ckpt-archive backup SOURCE --repo REPO``: one idempotent backup run, for cron and systemd timers."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, exit_with, seconds_callback, KEY_FILE_OPTION, SIGN_KEY_OPTION, open_cli_repo)
from ckpt_archive.cli.prune_cmd import (BEST_BY, KEEP_BEST, KEEP_DAILY, KEEP_HOURLY, KEEP_LAST, KEEP_MONTHLY, KEEP_TAG, KEEP_WEEKLY,
                    KEEP_WITHIN, WAIT, policy_from_flags)

BACKUP_EXIT_CODES = exit_codes_help({
    0: "a new generation was packed, or the source equals the newest usable generation (nothing done), also "
       "when a newer broken checkpoint was skipped (with a warning)",
    75: "(EX_TEMPFAIL) the newest checkpoint is still being written (changed within the settle window, or "
        "incomplete - a zip without its directory, a truncated safetensors file, a missing shard, a temporary "
        "file, a checkpoint-N/ folder lacking a training-state file such as trainer_state.json or optimizer.pt "
        "that its complete older sibling has - and changed within --stale-after): it is not packed, retry on the "
        "next tick; the newest complete checkpoint is packed meanwhile when no usable generation holds it yet",
    1: "the new generation failed verification or trial reload (nothing published)",
    2: "could not be carried out (SOURCE missing, holding no checkpoint, or holding only broken ones - "
       "incomplete and unchanged for longer than --stale-after; refused input, bad flags, lock held by another "
       "writer)"})


def register(app: typer.Typer) -> None:
    @app.command("backup", help="Back up the newest checkpoint in SOURCE to REPO, for cron or a systemd timer. "
                 "SOURCE is a checkpoint file or folder, or a training output folder (the checkpoint-N/ folder "
                 "with the highest N, else the newest *.pt/*.pth/*.ckpt). An incomplete checkpoint unchanged for longer than "
                 "--stale-after is broken, not being written: it is skipped with a warning and the newest complete "
                 "one is backed up instead. Idempotent: decides from size, mtime "
                 "and inode first (remembered in REPO/backup-state.json) and reads the files only when those "
                 "changed; when the content equals the newest usable generation's source, does nothing. Never "
                 "packs a checkpoint still being written (exit 75; the newest complete one is packed meanwhile "
                 "when no usable generation holds it yet). Retention (policy flags, else the repository's "
                 "default) runs only after the new generation is usable." + BACKUP_EXIT_CODES)
    @command
    def backup_cmd(
        source: str = typer.Argument(..., metavar="SOURCE", help="Checkpoint file/folder or training output folder."),
        repo: str = typer.Option(..., "--repo", "-r", metavar="REPO", help="Repository path or URL (created if absent)."),
        settle: float = typer.Option(10.0, "--settle", metavar="SECONDS", callback=seconds_callback("--settle"),
                                     help="The checkpoint must stay unchanged this long before it is packed."),
        stale_after: Optional[float] = typer.Option(None, "--stale-after", metavar="SECONDS",
                                                    callback=seconds_callback("--stale-after", allow_zero=False),
                                                    help="An incomplete checkpoint whose newest mtime is older than "
                                                    "this is broken (a killed save), not being written: skip it and "
                                                    "back up the newest complete one (default: max(600, 10 x "
                                                    "--settle) seconds)."),
        keep_last: Optional[int] = KEEP_LAST, keep_hourly: Optional[int] = KEEP_HOURLY,
        keep_daily: Optional[int] = KEEP_DAILY, keep_weekly: Optional[int] = KEEP_WEEKLY,
        keep_monthly: Optional[int] = KEEP_MONTHLY, keep_within: Optional[str] = KEEP_WITHIN,
        keep_tag: Optional[List[str]] = KEEP_TAG, keep_best: Optional[int] = KEEP_BEST,
        best_by: Optional[str] = BEST_BY,
        tag: List[str] = typer.Option([], "--tag", metavar="TAG", help="Tag for a new generation (repeatable)."),
        allow: List[str] = typer.Option([], "--allow", metavar="MODULE.CLASS",
                                        help="Admit a plain-data class (repeatable), e.g. --allow argparse.Namespace "
                                             "(timm, torchvision reference scripts): stored and restored as the same "
                                             "class; only classes whose state is a plain __dict__, never code."),
        wait: float = WAIT,
        key_file: Optional[Path] = KEY_FILE_OPTION,
        sign_key: Optional[Path] = SIGN_KEY_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.backup import BackupOptions, backup

        out = Output(json_output)
        policy = policy_from_flags(keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, keep_within,
                                   keep_tag, keep_best, best_by)
        result = backup(source, open_cli_repo(repo, create=True, key_file=key_file, sign_key=sign_key),
                        BackupOptions(settle=settle, stale_after=stale_after, tags=tuple(tag), allow=tuple(allow)),
                        retention=policy, wait=wait)
        for w in result.warnings:
            out.warn(w)
        if result.action == "busy":
            out.say(f"skipped {result.checkpoint}: {result.reason} (exit 75: retry later)", style="yellow")
        elif result.action == "unchanged":
            out.say(f"unchanged: {result.checkpoint} equals generation {result.generation}; nothing to do")
        else:
            out.say(f"packed {result.checkpoint} as generation {result.generation} (usable)")
            if result.busy:
                out.say(f"not yet {result.busy['checkpoint']}: {result.busy['reason']} (exit 75: retry later)",
                        style="yellow")
            ret = result.retention or {}
            if ret.get("removed"):
                out.say(f"retention removed generation(s) {', '.join(map(str, ret['removed']))}")
        out.json(result.to_json())
        exit_with(result)


__all__ = ["BACKUP_EXIT_CODES", "register"]
