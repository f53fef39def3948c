"""``ckpt-archive restore``: write a generation back as a .pt file or a folder, atomically."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, human_bytes, split_repo_spec, KEY_FILE_OPTION, TRUST_OPTION, open_cli_repo)


def register(app: typer.Typer) -> None:
    @app.command("restore", help="Restore a generation to FILE.pt or, for a folder source, to a folder, and say "
                                 "how the file loads (read from the file written): torch.load(path, "
                                 "weights_only=True), or, for a state holding NumPy values or other Python "
                                 "objects, a snippet allowing exactly those with torch.serialization.safe_globals. "
                                 "Never overwrites without --force; writes a temporary name then renames; checks "
                                 "free space first. Every byte is decoded and checked on the way, so a generation "
                                 "copied here by another tool (status 'copied') restores too, and the restore says "
                                 "it served as its trial reload."
                                 "\n\n--only PATH restores a part: keys and indices joined by '/' ('model', "
                                 "'optimizer/state/0'). A key may itself contain '/' (a folder source's files): "
                                 "--only global_step10/mp_rank_00_model_states.pt/module -- every split into keys "
                                 "is tried and exactly one must name something; an ambiguous path or an empty "
                                 "component ('', '/', 'a//b') is refused (exit 2)."
                 + exit_codes_help({0: "restored",
                                    1: "the generation failed its checks (a member corrupt, tampered or missing; "
                                       "named), or is damaged, or without @GEN every published one is; nothing "
                                       "was written",
                                    2: "could not be carried out (no such generation: the existing ones are "
                                       "listed; a partial one or one in a newer format; output exists without "
                                       "--force; not enough space)"}))
    @command
    def restore_cmd(
        spec: str = typer.Argument(..., metavar="REPO[@GEN]"),
        output: Path = typer.Option(..., "--output", "-o", help="The .pt file or folder to create."),
        force: bool = typer.Option(False, "--force", help="Replace an existing output (after the new one is complete); never a FIFO, device or socket."),
        only: Optional[str] = typer.Option(None, "--only", metavar="PATH",
                                           help="Restore part of the state: keys and indices joined by '/', e.g. "
                                                "'model' or 'optimizer/state/0' (keys holding '/': see above)."),
        fallback: bool = typer.Option(False, "--fallback", help="If @latest fails its checks, use the newest "
                                                                "generation that verifies."),
        map_location: Optional[str] = typer.Option(None, "--map-location", help="Device for tensors (default cpu)."),
        jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Decoder threads (default: all cores)."),
        consolidate: Optional[Path] = typer.Option(
            None, "--consolidate", help="For a torch.distributed.checkpoint (DCP) folder source: also write the "
                                        "whole state as one torch.save file at this path."),
        allow: List[str] = typer.Option([], "--allow", metavar="MODULE.CLASS",
                                        help="Rebuild objects of this plain-data class where a file is re-serialised (repeatable; "
                                             "argparse.Namespace needs none); only classes whose state is a plain __dict__, never code."),
        session_config: Optional[Path] = typer.Option(
            None, "--session-config", help="This session's config (JSON/YAML/TOML): warn where the archived "
                                           "lr/weight_decay/... differ, naming the field and which value wins."),
        expect_lr: Optional[str] = typer.Option(
            None, "--expect-lr", metavar="LR[,LR...]",
            help="The LR you expect the next step to use; warn if the archive says otherwise (relative tolerance "
                 "1e-6, so a value copied from inspect's 7 digits passes). One LR is compared with group 0 of each "
                 "optimizer; a comma-separated list gives one LR per param group, in inspect's order. Without "
                 "optimizer state it is compared with the archived scheduler's _last_lr."),
        policy: str = typer.Option(
            "checkpoint", "--policy", help="'checkpoint' (default: the archived lr wins, as load_state_dict does) "
                                           "or 'session': rewrite lr/initial_lr/base_lrs in the output from "
                                           "--session-config (moments untouched); in a folder source, each "
                                           "optimizer/scheduler file pair, re-saved with torch.save."),
        data_ids: Optional[Path] = typer.Option(
            None, "--data-ids", help="This session's data ids (JSON/YAML/TOML, or .txt one id per line): compared "
                                     "with those packed with the generation, key order aside; a difference "
                                     "refuses the restore (exit 1), listing changed, added and removed entries."),
        allow_data_change: bool = typer.Option(
            False, "--allow-data-change", help="Restore although --data-ids differ from the archived ids (the "
                                               "differences are printed as a warning)."),
        restore_unverified: bool = typer.Option(
            False, "--restore-unverified", help="Restore a partial or damaged generation anyway (refused otherwise, "
                                                "exit 2); every byte is still checked against its manifest."),
        key_file: Optional[Path] = KEY_FILE_OPTION,
        trust: Optional[List[Path]] = TRUST_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        import ckpt_archive
        from ckpt_archive.cli.policy_views import cli_restore_prepare
        from ckpt_archive.repo.publish import note_complete

        out = Output(json_output)
        repo, gen = split_repo_spec(spec)
        repo = open_cli_repo(repo, key_file=key_file, trust=trust)  # one repository for the audit and the restore
        transform, policy_json = cli_restore_prepare(repo, gen, session_config=session_config,
                                                     expect_lr=expect_lr, policy=policy, out=out)
        res = None
        try:
            with out.progress(None, "restore") as bar:  # the restore tells the bar each phase and its total
                options = ckpt_archive.RestoreOptions(
                    force=force, only=only, fallback=fallback, unverified=restore_unverified,
                    map_location=map_location, jobs=jobs, allow=allow, transform=transform,
                    folder_rewrite=policy_json.pop("_folder_rewrite", None), consolidate=consolidate,
                    data_ids=data_ids, allow_data_change=allow_data_change)
                res = ckpt_archive.restore(repo, gen, output, options, on_bytes=bar)
            _report(res, policy_json, out, only)
        except KeyboardInterrupt as exc:
            if res is not None:  # [break] the output is in place and complete: not a failure (exit 0, said)
                note_complete(exc, f"{res.output} is restored and complete (generation {res.generation})")
            raise


def _report(res, policy_json: dict, out: Output, only: str | None) -> None:
    """Say what the restore did (its output is in place by now)."""
    from ckpt_archive.cli.policy_views import cli_restore_finish

    res.extra.update(cli_restore_finish(policy_json, out, res.extra.pop("folder_rewrite", None)))
    for w in res.warnings:
        out.warn(w)
    what = f" ({only})" if only else ""
    out.say(f"restored generation {res.generation}{what} to {res.output} ({human_bytes(res.bytes_written)})",
            style="green")
    loading = res.extra.get("loading")
    if loading and loading.get("allow"):  # the file needs more than weights_only's defaults: say exactly what
        out.say(f"it {loading['text']}:")
        for line in loading["snippet"].splitlines():
            out.say(f"    {line}")
    elif loading:
        out.say(f"it {loading['text']}")
    if res.extra.get("consolidated"):
        out.say(f"consolidated the DCP state into {res.extra['consolidated']}", style="green")
    out.json(res.to_json())


__all__ = ["register"]
