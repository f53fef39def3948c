"""``ckpt-archive export REPO[@GEN] --to DEST``: copy usable generations elsewhere and prove them
recoverable there (re-read from DEST, trial reload from DEST, marker last). See docs/export.md."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ckpt_archive.cli.common import (JSON_OPTION, Output, command, exit_codes_help, exit_with, human_bytes, split_repo_spec, seconds_callback, KEY_FILE_OPTION, TRUST_OPTION, SIGN_KEY_OPTION, open_cli_repo)


def register(app: typer.Typer) -> None:
    @app.command("export", help="Copy usable generations to DEST (a local path or s3://bucket/prefix), re-read "
                 "every member from DEST (size, sha256 of every chunk and whole), trial-reload from DEST, then "
                 "write DEST's USABLE marker last. Idempotent and resumable: a generation already usable at DEST "
                 "is not copied again, but its stored bytes are re-read there (sha256 of every chunk; a mismatch "
                 "is exit 1 naming the member); a re-run after an interruption finishes its own partial copy, aborting the "
                 "unfinished multipart uploads it left. Credentials, region and endpoint come from the standard "
                 "AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_REGION, "
                 "AWS_ENDPOINT_URL); the recovery proof records the endpoint and region it used."
                 + exit_codes_help({0: "every selected generation is usable at DEST",
                                    1: "a member at the source or at DEST does not match its manifest, or the "
                                       "trial reload at DEST failed (named; DEST's marker not written); a "
                                       "selected generation is damaged at the source, or every one is",
                                    2: "could not be carried out (no such bucket, access denied, DEST holds "
                                       "another archive at that number, lock held, bad arguments; a selected "
                                       "generation partial or in a newer format at the source)"}))
    @command
    def export_cmd(
        spec: str = typer.Argument(..., metavar="REPO[@GEN]", help="Source repository and generation (number, "
                                   "latest or tag:NAME; default the newest usable)."),
        to: str = typer.Option(..., "--to", metavar="DEST", help="Destination: a path or an fsspec URL "
                               "(s3://bucket/prefix). Its repository.json is created if absent."),
        all_usable: bool = typer.Option(False, "--all-usable", help="Export every usable generation."),
        latest: Optional[int] = typer.Option(None, "--latest", metavar="N", min=1,
                                             help="Export the N newest usable generations."),
        endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", metavar="URL",
                                                   help="S3-compatible endpoint for DEST (MinIO, Ceph, R2...); "
                                                        "default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / AWS."),
        sse: Optional[str] = typer.Option(None, "--sse", metavar="ALGO", help="Server-side encryption of the "
                                          "objects written to DEST: AES256 or aws:kms (s3 only)."),
        sse_kms_key_id: Optional[str] = typer.Option(None, "--sse-kms-key-id", metavar="KEY",
                                                     help="KMS key for --sse aws:kms."),
        report: Optional[Path] = typer.Option(None, "--report", metavar="FILE", help="Write the recovery proof "
                                              "here: Markdown, or JSON with --json."),
        wait: float = typer.Option(0.0, "--wait", metavar="SECONDS", callback=seconds_callback("--wait"), help="Wait this long for DEST's writer lock."),
        key_file: Optional[Path] = typer.Option(
            None, "--key-file", metavar="PATH",
            help="The key file of the encrypted side (default: $CKPT_ARCHIVE_KEY_FILE for an encrypted source). "
                 "An encrypted source is read with it and DEST is encrypted with it too (unless --to-key-file or "
                 "--to-plain); a plain source is copied to a DEST encrypted with it."),
        trust: Optional[List[Path]] = TRUST_OPTION,
        to_key_file: Optional[Path] = typer.Option(
            None, "--to-key-file", metavar="PATH",
            help="DEST's key file when it is not --key-file's: an encrypted source copied under another key (a "
                 "new DEST is created encrypted with it; an encrypted DEST is opened with it)."),
        to_plain: bool = typer.Option(False, "--to-plain", help="Write DEST in the clear from an encrypted "
                                      "source (never the default: a copy keeps its encryption unless asked)."),
        sign_key: Optional[Path] = SIGN_KEY_OPTION,
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.errors import UsageError
        from ckpt_archive.ops.export import ExportOptions, export, select_generations

        out = Output(json_output)
        repo, gen = split_repo_spec(spec)
        explicit = repo != spec
        if sum([explicit, all_usable, latest is not None]) > 1:
            raise UsageError("give one of REPO@GEN, --all-usable, --latest N")
        selection = "all" if all_usable else f"latest:{latest}" if latest is not None else gen
        storage_options = _sse_options(to, sse, sse_kms_key_id)

        source, to_key_file = _open_source(repo, key_file, to_key_file, to_plain, trust)
        picked = select_generations(source, selection)
        from ckpt_archive.ops.export_copy import unique_stored_bytes

        total = unique_stored_bytes([g.manifest for g in picked])  # each shared object once
        out.note(f"exporting {len(picked)} generation(s) ({', '.join(str(g.number) for g in picked)}; "
                f"{human_bytes(total)} stored) from {source.location} to {to}")
        argv = "ckpt-archive " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        with out.progress(total, "export") as advance:  # phases: copy, re-read, trial reload (per generation)
            dest_options = {k: v for k, v in (("endpoint_url", endpoint_url), ("storage_options", storage_options))
                            if v}
            options = ExportOptions(generations=[g.number for g in picked], report=report,
                                    report_format="json" if json_output else "markdown", command=argv,
                                    to_key_file=to_key_file, to_plain=to_plain, sign_key=sign_key)
            result = export(source, to, options, on_bytes=advance, wait=wait, dest_store_options=dest_options)
        _say_result(out, result, report)
        out.json(result.to_json())
        exit_with(result)


def _sse_options(to: str, sse: Optional[str], sse_kms_key_id: Optional[str]) -> Optional[dict]:
    """DEST's storage options for ``--sse`` / ``--sse-kms-key-id`` (a KMS key alone means ``aws:kms``), or
    None without them.

    Raises:
        UsageError: an unknown algorithm, or a destination that is not s3://.
    """
    from ckpt_archive.errors import UsageError

    if sse_kms_key_id and not sse:
        sse = "aws:kms"
    if not sse:
        return None
    if sse not in ("AES256", "aws:kms", "aws:kms:dsse"):
        raise UsageError(f"--sse {sse!r}: use AES256 or aws:kms")
    if "://" not in to or not to.startswith(("s3://", "s3a://")):
        raise UsageError("--sse applies to s3:// destinations only")
    extra = {"ServerSideEncryption": sse}
    if sse_kms_key_id:
        extra["SSEKMSKeyId"] = sse_kms_key_id
    return {"s3_additional_kwargs": extra}


def _say_result(out: Output, result, report: Optional[Path]) -> None:
    """One line per generation exported (and what an interrupted run left that was cleaned), the bytes
    moved and skipped, the restore command and where the proof is."""
    for g in result.generations:
        checks = sum(c.ok for c in g.checks)
        skipped = f", {human_bytes(g.bytes_skipped)} already there" if g.bytes_skipped else ""
        out.say(f"generation {g.generation} (step {g.step}): {g.status}, {human_bytes(g.bytes_copied)} copied"
                f"{skipped}, {checks}/{len(g.checks)} checks ok, usable at {result.destination}")
        aborted, removed = g.cleaned.get("aborted_uploads") or [], g.cleaned.get("removed") or []
        if aborted or removed:
            out.say(f"  cleaned what an interrupted run left there: {len(aborted)} unfinished upload(s) "
                    f"aborted, {len(removed)} stray object(s) removed")
    out.say(f"moved {human_bytes(result.bytes_copied)}; skipped {human_bytes(result.bytes_skipped)} already at "
            f"the destination (re-read there all the same)")
    out.say(f"restore on a new machine: {result.restore_command}")
    if report is not None:
        out.say(f"recovery proof written to {report}")


def _open_source(repo: str, key_file, to_key_file, to_plain: bool, trust):
    """The source repository and DEST's key: ``--key-file`` reads an encrypted source and, unless
    ``--to-key-file`` or ``--to-plain``, is DEST's key too; for a plain source it is DEST's key alone (plain
    to encrypted). docs/keys.md, "Export"."""
    from ckpt_archive.format.crypto import KeyRefused

    if key_file is None or to_key_file is not None or to_plain:
        return open_cli_repo(repo, key_file=key_file, trust=trust), to_key_file
    try:
        source = open_cli_repo(repo, key_file=False, trust=trust)  # plain: the key is DEST's alone
    except KeyRefused:
        source = open_cli_repo(repo, key_file=key_file, trust=trust)  # encrypted: read with it, DEST keeps it
    return source, key_file


__all__ = ["register"]
