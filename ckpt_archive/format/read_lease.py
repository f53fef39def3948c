"""[break] A source file read through a memory map without dying of SIGBUS when someone truncates it.

Reading a mapped page of a file that another process has truncated meanwhile is answered by the kernel
with SIGBUS: the process dies (exit -7), no message, nothing cleaned up. Python cannot catch it (its
handler runs later, between bytecodes; the faulting instruction faults again). So a file pack maps --
a ``torch.save`` file read without torch (format/pt_pickle.py), one ``torch.load(mmap=True)`` maps
(sources/torchfile.py) -- is mapped only under a Linux *read lease* (``fcntl(F_SETLEASE, F_RDLCK)``):

* while the lease is held, another process's ``open`` for writing or ``truncate`` of the file waits
  (at most ``/proc/sys/fs/lease-break-time`` seconds, 45 by default) and the lease is marked broken
  (:meth:`ReadLease.broken`: ``F_GETLEASE`` no longer answers ``F_RDLCK``);
* the reader checks it between entries (:func:`check_leases`, :meth:`ReadLease.check`) and raises
  :class:`~ckpt_archive.errors.SourceChanged` naming the file: pack stops, withdraws what it wrote, drops
  its maps, and the lease goes with the last reference to the file (its map or its descriptor), after
  which the truncation proceeds. Bytes read before that were the old file's, whole: no page vanished.

Where no lease can be had -- not Linux, a file system without leases (NFS), a file not owned by this
user, a file some process holds open for writing, SIGIO taken by someone else's handler -- the caller
does not map the file: it reads what it needs with ``pread`` (a short read of a file that shrank is the
same SourceChanged), or lets ``torch.load`` read instead of map.

A lease is given back when pack returns, not when the garbage collector gets to the last map made from
it: :func:`lease_scope` (entered by :func:`ckpt_archive.ops.pack.pack`) keeps every lease taken inside it
and, when the last scope of the process ends, removes each one (``F_UNLCK``) and closes its descriptor.
Otherwise a map kept alive by a reference cycle held the lease on, and a trainer's next save over the same
file waited up to the kernel's lease-break-time (45 s) in its own training loop.

The lease signal (SIGIO, whose default action ends the process) is ignored: the lease is polled, never
signalled. It is set so only while its disposition is the default and only from the main thread;
otherwise a lease is not taken.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import weakref
from pathlib import Path

#: Leases taken and not yet released (the writer checks them all between entries: :func:`check_leases`).
_ACTIVE: "weakref.WeakSet[ReadLease]" = weakref.WeakSet()
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", None)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", None)
#: Scopes open in this process (:func:`lease_scope`) and the leases taken while any was open.
_SCOPE_LOCK = threading.Lock()
_SCOPES = [0]
_SCOPED: "list[ReadLease]" = []


def _sigio_quiet() -> bool:
    """SIGIO cannot end the process when a lease breaks: it is ignored (made so here when it was the
    default and this is the main thread). False: leave leases alone."""
    sigio = getattr(signal, "SIGIO", None)
    if sigio is None:
        return False
    current = signal.getsignal(sigio)
    if current == signal.SIG_IGN:
        return True
    if current == signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(sigio, signal.SIG_IGN)
        return True
    return False


class ReadLease:
    """A read-only descriptor of ``path`` holding a read lease where one can be had.

    Attributes:
        path: the file. fd: the descriptor (``O_RDONLY``), -1 once :meth:`close`\\ d.
        held: the lease was granted: mapping the file (from ``fd`` or any other descriptor) is safe from
            SIGBUS while this object is open, and a writer's open or truncate waits until it is closed.

    Raises:
        OSError: the file cannot be opened for reading.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.held = False
        if _F_SETLEASE is not None and _sigio_quiet():
            try:
                fcntl.fcntl(self.fd, _F_SETLEASE, fcntl.F_RDLCK)
                self.held = True
                _ACTIVE.add(self)
                with _SCOPE_LOCK:
                    if _SCOPES[0]:
                        _SCOPED.append(self)
            except OSError:  # EAGAIN (open for writing somewhere), EACCES (not ours), EINVAL (NFS, ...)
                self.held = False

    def broken(self) -> bool:
        """Someone asked to write or truncate the file since the lease was taken (False without a lease)."""
        if not self.held or self.fd < 0:
            return False
        try:
            return fcntl.fcntl(self.fd, _F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True

    def check(self) -> None:
        """Raise :class:`~ckpt_archive.errors.SourceChanged` (exit 2, naming the file) if :meth:`broken`."""
        if self.broken():
            raise changed(self.path, "another process opened it for writing or truncated it")

    def close(self) -> None:
        """Release the descriptor (the lease stays with a map made from it until that map is gone)."""
        if self.fd >= 0:
            _ACTIVE.discard(self)
            os.close(self.fd)
            self.fd = -1

    def release(self) -> None:
        """Give the lease back now (``F_UNLCK`` on the open file every map made from this descriptor shares)
        and close the descriptor: a writer no longer waits, even while a map made from it lives on (which
        nobody may read any more)."""
        if self.fd >= 0 and self.held:
            try:
                fcntl.fcntl(self.fd, _F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass  # already broken and gone: nothing left to give back
        self.close()

    def keep_until_gone(self, *objects) -> None:
        """Hold this lease (and its descriptor) until every one of ``objects`` is garbage: for maps made
        by someone else (``torch.load(mmap=True)``'s tensors), whose pages must not vanish while read."""
        remaining = [len(objects)]

        def gone() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.close()

        for obj in objects:
            weakref.finalize(obj, gone)
        if not objects:
            self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to release to
            pass


@contextlib.contextmanager
def lease_scope():
    """Hold every lease taken inside this block until it ends, then give each back (:meth:`ReadLease.release`)
    once no other scope of this process is open (two packs in two threads: the first to end leaves the
    other's leases alone). Reentrant and thread-safe."""
    with _SCOPE_LOCK:
        _SCOPES[0] += 1
    try:
        yield
    finally:
        with _SCOPE_LOCK:
            _SCOPES[0] -= 1
            done = list(_SCOPED) if _SCOPES[0] == 0 else []
            if _SCOPES[0] == 0:
                _SCOPED.clear()
        for lease in done:
            lease.release()


def changed(path: Path, how: str):
    """The :class:`~ckpt_archive.errors.SourceChanged` a file changed under its read raises (exit 2)."""
    from ckpt_archive.errors import SourceChanged

    return SourceChanged(f"the file changed while it was being read ({how}): nothing was kept -- pack it again "
                         f"once it is complete", where=str(path))


def check_leases() -> None:
    """Raise :class:`~ckpt_archive.errors.SourceChanged` for the first lease held by this process that
    someone broke (the writer calls it before each entry's bytes are taken)."""
    for lease in list(_ACTIVE):
        lease.check()


def pread_exact(fd: int, buf, offset: int, path: Path) -> None:
    """Fill the writable buffer ``buf`` from ``fd`` at ``offset``; a short read (the file shrank) is
    :class:`~ckpt_archive.errors.SourceChanged` naming ``path``.

    Raises:
        SourceChanged: fewer bytes than ``len(buf)`` lie at ``offset`` now.
        OSError: the read failed.
    """
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise changed(path, f"it ended at byte {offset + done}, before the {len(view)} bytes at {offset} "
                                f"it held when it was opened -- truncated")
        done += n


__all__ = ["ReadLease", "check_leases", "changed", "lease_scope", "pread_exact"]
