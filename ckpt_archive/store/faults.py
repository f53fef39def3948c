"""Fault injection points for the crash-safety test suite.

Library code calls :func:`point` at each lifecycle step (see docs/FORMAT.md, "Write order"). In normal
use it does nothing. With ``CKPT_ARCHIVE_INJECT="<point>=<action>"`` (comma-separated for several) the
named point misbehaves:

* ``kill``: SIGKILL the process (a crash, power loss as far as the process is concerned);
* ``enospc``: raise ``OSError(ENOSPC)`` (disk full);
* ``erofs``: raise ``OSError(EROFS)`` (read-only destination);
* ``raise``: raise ``RuntimeError`` (any other failure).

``<point>=<action>@K`` fires on the K-th time the point is reached (1-based; default 1).
"""
from __future__ import annotations

import errno
import os
import signal

_counts: dict[str, int] = {}


def _plan() -> dict[str, tuple[str, int]]:
    spec = os.environ.get("CKPT_ARCHIVE_INJECT", "")
    plan = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = part.partition("=")
        action, _, nth = action.partition("@")
        plan[name] = (action or "raise", int(nth or 1))
    return plan


def point(name: str) -> None:
    """Mark a lifecycle step; misbehave if the environment asks for it (see module docstring)."""
    if "CKPT_ARCHIVE_INJECT" not in os.environ:
        return
    plan = _plan()
    if name not in plan:
        return
    _counts[name] = _counts.get(name, 0) + 1
    action, nth = plan[name]
    if _counts[name] != nth:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    if action == "erofs":
        raise OSError(errno.EROFS, f"Read-only file system (injected at {name})")
    raise RuntimeError(f"injected failure at {name}")
