"""The repository's single-writer lock, as one :class:`~ckpt_archive.repo.repository.Repository` object holds it.

The lock itself is the store's (:meth:`~ckpt_archive.store.base.Store.writer_lock`): an OS lock on
``REPO/.lock`` for a local repository (:class:`ckpt_archive.store.fs.WriterLock`), a lease lock for a remote
one (:mod:`ckpt_archive.store.lease_lock`). What is here is how a repository holds it: re-entrant for the
object that took it (the publish lifecycle inside ``pack``'s lock just holds on), the holder named when it
cannot be taken (pid, host and time from ``.lock.owner``, and whether that process is gone), and fencing
(:meth:`RepositoryLock.check`: before a commit or a deletion, this writer still holds it -- a lease can
lapse while its holder stalls; an OS lock cannot).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

from ckpt_archive.errors import LockError
from ckpt_archive.format import jsonio
from ckpt_archive.format.times import iso, utcnow
from ckpt_archive.store.base import Store
from ckpt_archive.store.fs import host_name, pid_alive


class RepositoryLock:
    """The writer lock of one repository object (see the module docstring).

    Args:
        store: the repository's store (it gives the lock). location: the repository's location, for errors.
    """

    def __init__(self, store: Store, location: str):
        self.store = store
        self.location = location
        self.depth = 0      # holds of this object (0: not held)
        self.held = None    # the store's lock while held

    @property
    def locked(self) -> bool:
        """True while this object holds the lock."""
        return self.depth > 0

    @contextlib.contextmanager
    def hold(self, wait: float = 0) -> Iterator[None]:
        """Hold the lock (re-entrant): :meth:`ckpt_archive.repo.repository.Repository.lock` says what it does.

        Raises:
            UsageError: ``wait`` negative, infinite or not a number.
            LockError: not obtained within ``wait`` seconds; says who holds it.
        """
        from ckpt_archive.format.durations import check_seconds

        wait = check_seconds(wait, "--wait")  # a negative wait would mean "forever" to some lock libraries
        if self.depth:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        lock = self.store.writer_lock()
        if not lock.acquire(timeout=wait):
            raise LockError(f"the repository is locked by another writer{holder_text(lock)}; retry later or pass "
                            f"--wait SECONDS", where=self.location) from None
        try:
            try:
                lock.write_owner(json.dumps({"pid": os.getpid(), "host": host_name(),
                                             "since": iso(utcnow())}).encode())
            except OSError:
                pass
            self.depth = 1
            self.held = lock
            yield
        finally:
            self.depth = 0
            self.held = None
            lock.release()

    def check(self) -> None:
        """Fencing: this object still holds the lock (:meth:`ckpt_archive.repo.repository.Repository.check_lock`).

        Raises:
            LockError: (exit 2) the lock is not held or was lost; the step must not be carried out.
        """
        held = self.held
        if held is None:
            raise LockError("the repository lock is not held", where=self.location)
        check = getattr(held, "check", None)
        if check is not None:
            check()


def holder_text(lock) -> str:
    """Who holds a lock that could not be taken, from its owner file: `` by pid P on HOST since TIME``, plus a
    note when that process is gone on this host; ``""`` when the owner file is missing or not a JSON object
    (read at most 64 KiB, the file layer's limit, as strict JSON)."""
    try:
        raw = lock.read_owner()
        if raw is None:
            raise ValueError("no owner file")
        info = jsonio.loads(raw, where=str(lock.path) + ".owner", max_bytes=1 << 16)
        if not isinstance(info, dict):
            raise ValueError("not an object")
        alive = pid_alive(info.get("pid")) if info.get("host") == host_name() else None
        return (f" by pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
                + ("" if alive is not False else " (that process is gone: the OS lock is held by "
                   "another process, or the file system does not release locks; if no writer "
                   f"runs, remove {lock.path})"))
    except (OSError, ValueError):
        return ""


__all__ = ["RepositoryLock", "holder_text"]
