#!/usr/bin/env bash
# End of a rental: pack the newest checkpoint, export it to storage that outlives this machine, prove it
# recoverable THERE (re-read + trial reload at the destination), and print the recovery proof.
#
# Usage:
#   scripts/end-of-rental.sh CHECKPOINT REPO DEST [EXPORT OPTIONS...]
#   scripts/end-of-rental.sh --newest-in DIR REPO DEST [EXPORT OPTIONS...]
#
#   CHECKPOINT   a torch.save file or a checkpoint folder
#   --newest-in  pick the most recently modified entry of DIR (e.g. output/ holding checkpoint-*/)
#   REPO         the local repository to pack into (created if absent)
#   DEST         s3://bucket/prefix (the bucket must exist) or a path on storage that survives the machine
#   EXPORT OPTIONS are passed to `ckpt-archive export`, e.g. --endpoint-url URL, --sse aws:kms.
#
# Environment: the standard AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE,
# AWS_ENDPOINT_URL for MinIO/R2/Ceph); REPORT (default ./recovery-proof-<UTC time>.md);
# CKPT_ARCHIVE (default "ckpt-archive": the command to run).
#
# Exit status: 0 only when the destination holds the checkpoint, verified and trial-reloaded there.
# Anything else: do NOT return the machine yet; the message says what failed.
set -euo pipefail

die() { echo "end-of-rental: $*" >&2; echo "end-of-rental: NOT SAFE to return the machine yet." >&2; exit "${2:-2}"; }

read -r -a CA <<< "${CKPT_ARCHIVE:-ckpt-archive}"

if [[ "${1:-}" == "--newest-in" ]]; then
    [[ $# -ge 4 ]] || die "usage: $0 --newest-in DIR REPO DEST [export options]"
    dir=$2; shift 2
    [[ -d "$dir" ]] || die "no such folder: $dir"
    ckpt=$(find "$dir" -mindepth 1 -maxdepth 1 ! -name '.*' -printf '%T@ %p\n' | sort -n | tail -n 1 | cut -d' ' -f2-)
    [[ -n "$ckpt" ]] || die "no checkpoint in $dir"
else
    [[ $# -ge 3 ]] || die "usage: $0 CHECKPOINT REPO DEST [export options]  (or --newest-in DIR REPO DEST)"
    ckpt=$1; shift
fi
repo=$1; dest=$2; shift 2
[[ -e "$ckpt" ]] || die "no such checkpoint: $ckpt"
report=${REPORT:-recovery-proof-$(date -u +%Y%m%dT%H%M%SZ).md}

echo "end-of-rental: packing $ckpt into $repo" >&2
"${CA[@]}" pack "$ckpt" --repo "$repo" || die "pack failed (exit $?)" $?

echo "end-of-rental: exporting the newest usable generation to $dest" >&2
set +e
"${CA[@]}" export "$repo@latest" --to "$dest" --report "$report" "$@"
rc=$?
set -e
[[ $rc -eq 0 ]] || die "export failed (exit $rc)" $rc

echo
cat "$report"
echo "end-of-rental: OK. The checkpoint is recoverable from $dest (proof: $report)." >&2
