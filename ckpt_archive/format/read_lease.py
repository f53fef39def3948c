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

A pack gives its leases back as soon as it has read its source for the last time, not when it returns:
:func:`lease_scope` (entered by :func:`ckpt_archive.ops.pack.pack`) is one :class:`LeaseScope` per pack,
the current one of the pack's context (a ``contextvars`` variable, so two packs in two threads -- a
Checkpointer's background save beside another pack -- each have their own, and a scope entered inside
another is its own too). Every lease taken in it is recorded there; pack calls :meth:`LeaseScope.give_back`
right after it wrote the members (the last read of the source) -- before the seal, verify, trial reload,
publish and retention, which read only the repository -- and again when the scope ends. Giving back drops
the maps a reader made (:class:`~ckpt_archive.format.pt_pickle.PtFile`), removes each lease (``F_UNLCK``)
and closes its descriptor, so a trainer's in-place save (``torch.save`` opens the file with ``O_TRUNC``)
proceeds at once instead of waiting up to the kernel's lease-break-time (45 s) in its own training loop.
A write that fails -- a broken lease noticed between entries included -- gives the leases back as soon as
the writer's threads have stopped, before the claimed generation is withdrawn, so the waiting writer is
answered then.

pack reads its source a second time only on its retry path (a shared object found damaged after the trial
reload: the generation is written again from the state). :meth:`LeaseScope.take_again` then takes a fresh
lease of every file whose maps will be read again and proves it is still the file read the first time
(device, inode, size, mtime and ctime as ``fstat`` gives them); a reader that had a map makes a new one
(or reads with ``pread`` when no lease is granted now), and maps made by ``torch.load(mmap=True)`` are read
again only under a granted lease. Anything else is :class:`~ckpt_archive.errors.SourceChanged` naming the
file; what the retry re-reads is also checked against the fingerprints of the first read before it is
stored (ckpt_archive/ops/pack.py).

The lease signal (SIGIO, whose default action ends the process) is ignored: the lease is polled, never
signalled. It is set so only while its disposition is the default and only from the main thread;
otherwise a lease is not taken.
"""
from __future__ import annotations

import contextlib
import contextvars
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
#: The scope (one pack's leases, :func:`lease_scope`) of the running context; None outside any.
_CURRENT: "contextvars.ContextVar[LeaseScope | None]" = contextvars.ContextVar("ckpt_archive_lease_scope",
                                                                              default=None)


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


def _identity(st: os.stat_result) -> tuple:
    """What says a file opened again is the one opened before: device, inode, size, mtime and ctime (ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ReadLease:
    """A read-only descriptor of ``path`` holding a read lease where one can be had.

    Attributes:
        path: the file. fd: the descriptor (``O_RDONLY``), -1 once :meth:`close`\\ d.
        held: the lease was granted: mapping the file (from ``fd`` or any other descriptor) is safe from
            SIGBUS while this object is open, and a writer's open or truncate waits until it is closed.
        identity: ``(device, inode, size, mtime ns, ctime ns)`` of the file opened (``fstat``), as
            :func:`~ckpt_archive.format.exact_bytes.file_identity` gives them.
        holder: a weak reference to the reader that maps through this lease (:meth:`hold_for`), or None.
        maps_outside: maps made by someone else depend on it (:meth:`keep_until_gone`).

    Raises:
        OSError: the file cannot be opened for reading.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.held = False
        self.holder: "weakref.ref | None" = None
        self.maps_outside = False
        try:
            st = os.fstat(self.fd)
        except OSError:
            os.close(self.fd)
            raise
        self.identity = _identity(st)
        if _F_SETLEASE is not None and _sigio_quiet():
            try:
                fcntl.fcntl(self.fd, _F_SETLEASE, fcntl.F_RDLCK)
                self.held = True
                _ACTIVE.add(self)
            except OSError:  # EAGAIN (open for writing somewhere), EACCES (not ours), EINVAL (NFS, ...)
                self.held = False
        scope = _CURRENT.get()
        if scope is not None:  # a reader's descriptor too (pread): given back, and taken again, with the rest
            scope.add(self)

    def hold_for(self, reader) -> None:
        """Tell the scope that ``reader`` maps the file through this lease: when the scope gives the lease back
        it calls ``reader._lease_given_back()`` first (the reader drops its map), and when it takes the file
        again ``reader._lease_taken_again(new_lease)`` (the reader maps or reads through the new one)."""
        self.holder = weakref.ref(reader)

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
        self.maps_outside = bool(objects)

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


class LeaseScope:
    """The read leases one pack took (:func:`lease_scope`), given back together, and taken again together.

    Thread-safe. A lease taken in a context where this scope is current joins it (:meth:`add`); one taken in
    another thread (which has its own context) does not -- no pack reader takes one there.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: list[ReadLease] = []
        #: what :meth:`give_back` let go of that a later read needs again: (path, identity, holder ref)
        self._given: list[tuple[Path, tuple, "weakref.ref | None"]] = []

    def add(self, lease: ReadLease) -> None:
        """Record ``lease`` as this scope's (once)."""
        with self._lock:
            if not any(x is lease for x in self._leases):
                self._leases.append(lease)

    def leases(self) -> list[ReadLease]:
        """The leases this scope holds now (taken and not given back)."""
        with self._lock:
            return [x for x in self._leases if x.fd >= 0]

    def check(self) -> None:
        """Raise :class:`~ckpt_archive.errors.SourceChanged` for the first of this scope's leases that
        someone broke."""
        for lease in self.leases():
            lease.check()

    def give_back(self) -> None:
        """Give every lease back now: a reader that maps through one drops its map first (its holder), then
        the lease is removed (``F_UNLCK``) and its descriptor closed, so a writer's open or truncate proceeds
        at once. Call it only once nothing reads the maps any more (the writer's threads stopped). What a
        second read would need is remembered for :meth:`take_again`. Idempotent."""
        with self._lock:
            leases, self._leases = self._leases, []
        for lease in leases:
            if lease.fd < 0:
                continue  # closed by its owner: nothing reads through it any more
            holder = lease.holder() if lease.holder is not None else None
            try:
                if holder is not None:
                    holder._lease_given_back()
            finally:
                lease.release()
            if holder is not None or lease.maps_outside:
                with self._lock:
                    self._given.append((lease.path, lease.identity, lease.holder))

    def take_again(self) -> None:
        """Before the source is read a second time (pack's retry): take a fresh lease of every file given back
        whose maps or reader will be read again, and prove it is still the file first read (``fstat``: device,
        inode, size, mtime, ctime). A reader (:meth:`ReadLease.hold_for`) maps through the new lease, or reads
        with ``pread`` where none is granted now; maps made by someone else (``torch.load(mmap=True)``) are
        read again only under a granted lease.

        Raises:
            SourceChanged: a file is gone, replaced, rewritten or touched since it was read, or its maps cannot
                be protected again (another process holds it open for writing); names the file.
        """
        with self._lock:
            given, self._given = self._given, []
        for path, identity, holder_ref in given:
            holder = holder_ref() if holder_ref is not None else None
            if holder_ref is not None and holder is None:
                continue  # its reader is gone: nothing reads through it again
            try:
                lease = ReadLease(path)
            except OSError as exc:
                raise changed(path, f"it cannot be opened again: {exc.strerror or exc}") from None
            self.add(lease)
            if lease.identity != identity:
                lease.release()
                raise changed(path, "it was replaced, rewritten or touched after pack read it, before the retry "
                                    "read it again")
            if holder is not None:
                holder._lease_taken_again(lease)
            elif not lease.held:
                lease.release()
                raise changed(path, "another process holds it open for writing, so its maps cannot be read "
                                    "again safely")


@contextlib.contextmanager
def lease_scope():
    """One pack's leases (:class:`LeaseScope`, the value of the block): every lease taken inside the block in
    this context joins it, and whatever it still holds is given back when the block ends. Two packs in two
    threads each have their own scope, and a scope entered inside another is its own: giving one back
    leaves the others' leases alone."""
    scope = LeaseScope()
    token = _CURRENT.set(scope)
    try:
        yield scope
    finally:
        _CURRENT.reset(token)
        scope.give_back()


def current_scope() -> "LeaseScope | None":
    """The scope of the running context (:func:`lease_scope`), or None."""
    return _CURRENT.get()


def changed(path: Path, how: str):
    """The :class:`~ckpt_archive.errors.SourceChanged` a file changed under its read raises (exit 2)."""
    from ckpt_archive.errors import SourceChanged

    return SourceChanged(f"the file changed while it was being read ({how}): nothing was kept -- pack it again "
                         f"once it is complete", where=str(path))


def check_leases() -> None:
    """Raise :class:`~ckpt_archive.errors.SourceChanged` for the first lease of the current scope (this pack's,
    :func:`lease_scope`) that someone broke -- outside any scope, for the first held by this process (the
    writer calls it before each entry's bytes are taken). Another pack's broken lease is that pack's to
    report."""
    scope = _CURRENT.get()
    if scope is not None:
        scope.check()
        return
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


__all__ = ["ReadLease", "LeaseScope", "check_leases", "changed", "current_scope", "lease_scope", "pread_exact"]
