"""Retention policy flags shared by ``pack``, ``prune`` and ``backup`` (restic's vocabulary)."""
from __future__ import annotations

from ..errors import UsageError

POLICY_HELP = ("Retention flags (restic's names, UTC calendar buckets) apply only after the new generation "
               "is usable; the newest usable generation is never removed.")


def policy_from_flags(*, keep_last=None, keep_hourly=None, keep_daily=None, keep_weekly=None, keep_monthly=None,
                      keep_within=None, keep_tag=(), keep_best=None, best_by=None, allow_empty=False) -> dict | None:
    """Build a retention policy dict from CLI flags; None when no flag was given and ``allow_empty``.

    Raises:
        UsageError: an empty policy where one is required; ``--keep-best`` without ``--best-by``.
    """
    policy = {k: v for k, v in {
        "keep_last": keep_last, "keep_hourly": keep_hourly, "keep_daily": keep_daily,
        "keep_weekly": keep_weekly, "keep_monthly": keep_monthly, "keep_within": keep_within,
        "keep_tag": list(keep_tag or []) or None, "keep_best": keep_best, "best_by": best_by,
    }.items() if v is not None}
    if (keep_best is None) != (best_by is None):
        raise UsageError("--keep-best N and --best-by METRIC:min|max go together")
    if not policy:
        if allow_empty:
            return None
        raise UsageError("empty retention policy: give at least one --keep-* flag (refusing to guess what to delete)")
    from ..retention import RetentionPolicy

    RetentionPolicy.from_dict(policy)  # a bad value (--keep-within 2x) is refused before anything is written
    return policy
