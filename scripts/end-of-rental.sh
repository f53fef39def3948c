#!/usr/bin/env bash
# End of a rental: back up the newest checkpoint, export it to storage that outlives this machine, prove
# it recoverable THERE (re-read + trial reload at the destination), and print the recovery proof.
#
# Usage:
#   scripts/end-of-rental.sh SOURCE REPO DEST [EXPORT OPTIONS...]
#   scripts/end-of-rental.sh --newest-in DIR REPO DEST [EXPORT OPTIONS...]
#   scripts/end-of-rental.sh --export-only REPO DEST [EXPORT OPTIONS...]
#
# A Hugging Face Trainer run with ckpt_archive.integrations.transformers.ArchiveCallback(REPO, export_to=DEST)
# does all of this itself when train() ends: every save is already a generation of REPO, and on_train_end
# exports the usable generations to DEST and writes the proof into the output folder
# (docs/integrations-transformers.md). Run this script when the run did NOT end that way (killed, out of
# time): `--newest-in OUTPUT_DIR REPO DEST` with the callback's REPO packs nothing twice (the callback's
# generation of the newest checkpoint-N/ is recognised) and exports it.
#
#   SOURCE       a torch.save file, a checkpoint folder, or a training output folder
#   --newest-in  DIR is a training output folder (the same as giving it as SOURCE)
#                The checkpoint is picked the way `ckpt-archive backup` picks it: the checkpoint-N/ folder
#                with the highest N, else the newest *.pt/*.pth/*.ckpt (top level or checkpoints/); never a
#                log file or other entry that happens to be newer.
#   REPO         the local repository to pack into (created if absent)
#   --export-only  REPO already holds the run's generations (written by ArchiveCallback, the Lightning
#                ArchiveCheckpointIO, which writes no checkpoint files, or a Checkpointer): nothing is
#                packed; its newest usable generation is exported
#   DEST         s3://bucket/prefix (the bucket must exist) or a path on storage that survives the machine
#   EXPORT OPTIONS are passed to `ckpt-archive export`, e.g. --endpoint-url URL, --sse aws:kms.
#
# Re-run it as often as you like; it is idempotent and resumable:
#   - the checkpoint is packed only when it differs from the newest usable generation of REPO
#     (`ckpt-archive backup`: size/mtime/inode, then sha256 against the generation's source fingerprints);
#   - a generation already usable at DEST is not copied again; an interrupted export resumes by archive
#     id, aborting the unfinished multipart uploads and removing the stray objects it left there.
#
# Environment: the standard AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE,
# AWS_REGION, AWS_ENDPOINT_URL for MinIO/R2/Ceph; the proof records endpoint and region);
# REPORT (default ./recovery-proof-<UTC time>.md); SETTLE (seconds the checkpoint must be unchanged
# before it is packed, default 2); WAIT (seconds to wait for a writer lock, default 60);
# CKPT_ARCHIVE (default "ckpt-archive": the command to run).
#
# Exit status: 0 only when the destination holds the checkpoint, verified and trial-reloaded there.
# 75: the checkpoint is still being written (run again once the save finished). Anything else: do NOT
# return the machine yet; the message says what failed.
set -euo pipefail

die() { echo "end-of-rental: $1" >&2; echo "end-of-rental: NOT SAFE to return the machine yet." >&2; exit "${2:-2}"; }

read -r -a CA <<< "${CKPT_ARCHIVE:-ckpt-archive}"

if [[ "${1:-}" == "--export-only" ]]; then
    [[ $# -ge 3 ]] || die "usage: $0 --export-only REPO DEST [export options]"
    shift
    src=""
elif [[ "${1:-}" == "--newest-in" ]]; then
    [[ $# -ge 4 ]] || die "usage: $0 --newest-in DIR REPO DEST [export options]"
    src=$2; shift 2
    [[ -d "$src" ]] || die "no such folder: $src"
else
    [[ $# -ge 3 ]] || die "usage: $0 SOURCE REPO DEST [export options]  (or --newest-in DIR REPO DEST)"
    src=$1; shift
fi
repo=$1; dest=$2; shift 2
report=${REPORT:-recovery-proof-$(date -u +%Y%m%dT%H%M%SZ).md}

if [[ -n "$src" ]]; then
    [[ -e "$src" ]] || die "no such checkpoint: $src"
    echo "end-of-rental: backing up the newest checkpoint of $src into $repo (packed only if it changed)" >&2
    set +e
    "${CA[@]}" backup "$src" --repo "$repo" --settle "${SETTLE:-2}" --wait "${WAIT:-60}"
    rc=$?
    set -e
    case $rc in
        0) ;;
        75) die "the checkpoint is still being written; run this again once the save has finished" 75 ;;
        *) die "backup failed (exit $rc)" "$rc" ;;
    esac
else
    echo "end-of-rental: $repo already holds the run's generations; nothing to pack" >&2
fi

echo "end-of-rental: exporting the newest usable generation to $dest (resumes an interrupted export)" >&2
set +e
"${CA[@]}" export "$repo@latest" --to "$dest" --report "$report" --wait "${WAIT:-60}" "$@"
rc=$?
set -e
[[ $rc -eq 0 ]] || die "export failed (exit $rc); fix what the line above says and run this again: it resumes" "$rc"

echo
cat "$report"
echo "end-of-rental: OK. The checkpoint is recoverable from $dest (proof: $report)." >&2
