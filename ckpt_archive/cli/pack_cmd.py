"""``ckpt-archive pack``: pack a checkpoint file/folder into a new usable generation."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, human_bytes, seconds_callback, KEY_FILE_OPTION, SIGN_KEY_OPTION, open_cli_repo)
from ckpt_archive.cli.prune_cmd import (BEST_BY, KEEP_BEST, KEEP_DAILY, KEEP_HOURLY, KEEP_LAST, KEEP_MONTHLY, KEEP_TAG, KEEP_WEEKLY,
                    KEEP_WITHIN, policy_from_flags)


_RETENTION_NOTE = ("Retention flags (restic's names, UTC calendar buckets, as for prune) apply only after the new "
                   "generation is usable; the newest usable generation is never removed.")


def register(app: typer.Typer) -> None:
    @app.command("pack", help="Pack a checkpoint (a torch.save file or a trainer's checkpoint folder) into a "
                              "new generation of REPO: written unseen, verified, trial-reloaded, then marked "
                              "usable. " + _RETENTION_NOTE
                 + exit_codes_help({0: "the new generation is usable",
                                    1: "the new generation failed its verify or trial reload (left partial; "
                                       "earlier generations untouched)",
                                    2: "could not be carried out (unreadable or refused source, bad flags, lock "
                                       "held, disk full)"}))
    @command
    def pack_cmd(
        source: Path = typer.Argument(..., metavar="SOURCE", help="A torch.save file or a checkpoint folder."),
        repo: str = typer.Option(..., "--repo", help="Repository path or URL (created if absent)."),
        config: Optional[Path] = typer.Option(None, "--config", help="Experiment config (JSON/YAML/TOML)."),
        metrics: Optional[Path] = typer.Option(None, "--metrics", help="Metrics (JSON/YAML/TOML)."),
        data_ids: Optional[Path] = typer.Option(None, "--data-ids", help="Sample ids / dataset identity."),
        instructions: Optional[Path] = typer.Option(None, "--instructions", help="Loading instructions (text)."),
        code_version: Optional[str] = typer.Option(None, "--code-version", help="Code version text."),
        tag: List[str] = typer.Option([], "--tag", metavar="TAG", help="Tag (repeatable)."),
        step: Optional[int] = typer.Option(None, "--step", min=0, help="Progress step to record in the manifest "
                                           "(overrides the step found in the state)."),
        epoch: Optional[int] = typer.Option(None, "--epoch", min=0, help="Progress epoch to record (overrides "
                                            "the epoch found in the state)."),
        fmt: Optional[str] = typer.Option(None, "--format", help="Force a source format (auto-detected)."),
        allow_numpy: bool = typer.Option(False, "--allow-numpy",
                                         help="Admit NumPy's own types (arrays, scalars, dtypes) in a .pt; "
                                              "nothing else is ever unpickled."),
        allow: List[str] = typer.Option([], "--allow", metavar="MODULE.CLASS",
                                        help="Admit a plain-data class (repeatable), e.g. --allow argparse.Namespace "
                                             "(timm, torchvision reference scripts): stored and restored as the same "
                                             "class; only classes whose state is a plain __dict__, never code."),
        jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Encoder/decoder threads (default: all cores)."),
        level: Optional[int] = typer.Option(None, "--level", help="zstd level (default 3)."),
        wait: float = typer.Option(0.0, "--wait", callback=seconds_callback("--wait"), help="Seconds to wait for another writer's lock."),
        no_share: bool = typer.Option(False, "--no-share",
                                      help="Store every tensor in this generation, even when an equal one is "
                                           "already stored in the repository (default: tensors of 1 MiB or "
                                           "more are stored once and referenced; docs/FORMAT.md, Shared objects)."),
        keep_last: Optional[int] = KEEP_LAST, keep_hourly: Optional[int] = KEEP_HOURLY,
        keep_daily: Optional[int] = KEEP_DAILY, keep_weekly: Optional[int] = KEEP_WEEKLY,
        keep_monthly: Optional[int] = KEEP_MONTHLY, keep_within: Optional[str] = KEEP_WITHIN,
        keep_tag: Optional[List[str]] = KEEP_TAG, keep_best: Optional[int] = KEEP_BEST,
        best_by: Optional[str] = BEST_BY,
        key_file: Optional[Path] = KEY_FILE_OPTION,
        sign_key: Optional[Path] = SIGN_KEY_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        import ckpt_archive
        from ckpt_archive.format.objects import DEFAULT_SHARE_MIN_BYTES
        from ckpt_archive.ops.pack import Annotations, PackOptions

        out = Output(json_output)
        from ckpt_archive.cli.common import split_repo_spec

        if split_repo_spec(repo)[0] != repo:
            out.warn(f"the repository path {repo!r} ends like a generation selector (@N, @latest, @tag:NAME): "
                     f"other commands will read it as one; address this repository as {repo}@latest")
        policy = policy_from_flags(keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, keep_within,
                                   keep_tag, keep_best, best_by)
        # phases, each with its bytes: read and hash the source, write, verify, trial reload
        with out.progress(_source_bytes(source), "pack: read") as bar:
            res = ckpt_archive.pack(
                source, open_cli_repo(repo, create=True, key_file=key_file, sign_key=sign_key),
                PackOptions(level=level, jobs=jobs, wait=wait, source_format=fmt, allow_numpy=allow_numpy,
                            allow=tuple(allow), share_min_bytes=0 if no_share else DEFAULT_SHARE_MIN_BYTES),
                Annotations(config=config, metrics=metrics, data_ids=data_ids, tags=tuple(tag),
                            code_version=code_version, instructions=instructions,
                            progress={"step": step, "epoch": epoch}),
                retention=policy, on_bytes=bar)
        from ckpt_archive.ops.common import leftover_note

        for line in res.leftovers:
            out.warn(leftover_note(line))
        for line in res.warnings:
            out.warn(line)
        s = res.manifest["summary"]
        ratio = s["raw_bytes"] / s["stored_bytes"] if s["stored_bytes"] else 0.0
        out.say(f"generation {res.generation} usable: {s['tensor_count']} tensors, {human_bytes(s['raw_bytes'])} "
                f"raw -> {human_bytes(s['stored_bytes'])} stored ({ratio:.2f}x), verified and trial-reloaded at "
                f"{res.trial_reload['where']}", style="green")
        if res.retention:
            removed = res.retention.get("removed") or []
            if removed:
                objs = res.retention.get("objects") or {}
                freed = (f"; freed {objs['removed_count']} shared object(s), {human_bytes(objs['freed_bytes'])}"
                         if objs.get("removed_count") else "")
                out.say(f"retention removed generation(s) {', '.join(str(n) for n in removed)}{freed}")
        out.json(res.to_json())


def _source_bytes(p: Path) -> int | None:
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    except OSError:
        return None
    return None


__all__ = ["register"]
