"""Fault injection points for the crash-safety test suite, as an explicit hook object.

Library code calls ``faults.point(name)`` at each lifecycle step (see docs/FORMAT.md, "Write order")
on the :class:`Faults` object its :class:`~ckpt_archive.repo.repository.Repository` carries. In normal
use that object is :data:`NO_FAULTS`, whose ``point`` does nothing. The plan is read from the
environment in exactly one place, :meth:`Faults.from_env`, which ``Repository.open`` (the entry point
that opens a repository) calls once; no other module reads the environment for it.

``CKPT_ARCHIVE_INJECT="<point>=<action>"`` (comma-separated for several) makes the named point
misbehave:

* ``kill``: SIGKILL the process (a crash, power loss as far as the process is concerned);
* ``enospc``: raise ``OSError(ENOSPC)`` (disk full);
* ``erofs``: raise ``OSError(EROFS)`` (read-only destination);
* ``raise``: raise ``RuntimeError`` (any other failure);
* ``sigint``: send the process SIGINT (a user's Ctrl-C: Python raises ``KeyboardInterrupt``).

``<point>=<action>@K`` fires on the K-th time the point is reached through the same object (1-based;
default 1).

Points (every one is exercised by tests/test_faults.py, tests/test_lifecycle.py, tests/test_export.py or
tests/test_shared_export.py):
pack: ``claim``, ``member-write``, ``object-write`` (a shared object fully written under its temporary
name, not yet linked), ``object-commit`` (linked to its final name), ``after-members``, ``seal-write`` (half
the manifest written under its temporary name), ``after-seal``,
``after-verify``, ``after-trial-reload``, ``publish``, ``after-publish``, ``retention``; restore:
``restore-placed`` (the output renamed into place, complete); deletion:
``prune-before-marker-removal``, ``prune-after-marker-removal``, ``prune-mid-delete``, ``object-delete``
(before each shared object's deletion in the sweep that follows forget, prune and gc); export:
``export-claim``, ``export-after-manifest``, ``export-member-write``, ``export-after-member``,
``export-object-write`` (a shared object being copied), ``export-after-object`` (one copied or found
present), ``export-after-members``, ``export-after-verify``, ``export-after-trial-reload``, ``export-after-publish``.
"""
from __future__ import annotations

import errno
import os
import signal
from typing import Mapping

ENV_VAR = "CKPT_ARCHIVE_INJECT"


class Faults:
    """A fault-injection plan: which lifecycle points misbehave, how, and on which visit.

    Args:
        plan: ``{point: (action, nth)}``; action is ``kill``, ``enospc``, ``erofs`` or ``raise``.
    """

    def __init__(self, plan: Mapping[str, tuple[str, int]] | None = None):
        self.plan = dict(plan or {})
        self.counts: dict[str, int] = {}

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        """Build a plan from the ``CKPT_ARCHIVE_INJECT`` syntax (see the module docstring).

        Args:
            spec: ``"<point>=<action>[@K],..."``; empty for no faults.

        Returns:
            the :class:`Faults` object (:data:`NO_FAULTS` behaviour when ``spec`` is empty).

        Raises:
            ValueError: ``@K`` is not an integer.
        """
        plan = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, action = part.partition("=")
            action, _, nth = action.partition("@")
            plan[name] = (action or "raise", int(nth or 1))
        return cls(plan)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Faults":
        """The plan the environment asks for (``CKPT_ARCHIVE_INJECT``); :data:`NO_FAULTS` without one.

        Args:
            environ: the environment to read (default ``os.environ``).
        """
        spec = (os.environ if environ is None else environ).get(ENV_VAR)
        return cls.parse(spec) if spec else NO_FAULTS

    def __bool__(self) -> bool:
        return bool(self.plan)

    def point(self, name: str) -> None:
        """Mark a lifecycle step; misbehave if the plan asks for it (see the module docstring).

        Raises:
            OSError: ``enospc`` / ``erofs``. RuntimeError: ``raise``. KeyboardInterrupt: ``sigint``.
            (``kill`` never returns.)
        """
        if name not in self.plan:
            return
        self.counts[name] = self.counts.get(name, 0) + 1
        action, nth = self.plan[name]
        if self.counts[name] != nth:
            return
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "sigint":
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
            return
        if action == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
        if action == "erofs":
            raise OSError(errno.EROFS, f"Read-only file system (injected at {name})")
        raise RuntimeError(f"injected failure at {name}")


class _NoFaults(Faults):
    """The production hook: every point is a no-op (and nothing is counted)."""

    def point(self, name: str) -> None:
        return None


#: The hook used when no fault is planned.
NO_FAULTS: Faults = _NoFaults()

__all__ = ["Faults", "NO_FAULTS", "ENV_VAR"]
