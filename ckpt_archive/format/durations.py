"""THE check of a number of seconds given by a user (``--max-age``, ``--wait``, ``--settle``,
``--stale-after``, ``--timeout`` and their Python arguments).

A duration is a finite number: ``inf`` or ``nan`` (which ``float()`` and Click accept) would make a
watchdog that never fires, a lock wait that never ends, or a JSON report that cannot be plain JSON;
a negative one means "forever" to some libraries (filelock) and nothing to others. Both are usage
errors (exit 2). Zero is refused where it makes no sense (an age limit), allowed where it means "at
once" (``--wait 0``, ``--settle 0``).
"""
from __future__ import annotations

import math

from ckpt_archive.errors import UsageError


def check_seconds(value, name: str, *, allow_zero: bool = True) -> float:
    """Return ``value`` as float seconds, or raise :class:`UsageError` naming ``name``.

    Example:
        >>> check_seconds(2, "--wait")
        2.0
        >>> check_seconds(float("inf"), "--wait")
        Traceback (most recent call last):
        ...
        ckpt_archive.errors.UsageError: bad --wait inf: a number of seconds must be finite
    """
    if isinstance(value, bool):
        raise UsageError(f"bad {name} {value!r}: expected a number of seconds")
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"bad {name} {value!r}: expected a number of seconds") from None
    if not math.isfinite(seconds):
        raise UsageError(f"bad {name} {value}: a number of seconds must be finite")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise UsageError(f"bad {name} {value}: must be {'>= 0' if allow_zero else '> 0'} seconds")
    return seconds


__all__ = ["check_seconds"]
