"""[issue 29] Writing a file in pieces at their offsets, fast and checked: :class:`ParallelWrites` (``pwrite``
on a few threads) and :class:`InOrderSha256` (the file's sha256 in file order, as its pieces are written).
Used by restore (:func:`ckpt_archive.format.exact_bytes.rebuild`, :mod:`ckpt_archive.ops.restore_torch`).
"""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

from ckpt_archive.errors import IntegrityError

#: read-back piece size
READ_BYTES = 8 << 20


def pwrite_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte is written (a full file system may write short without an error).

    Raises:
        OSError: ENOSPC when nothing more can be written, or what the write raised.
    """
    import errno

    mv = memoryview(data).cast("B")
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no space left on device (short write)")
        mv, offset = mv[n:], offset + n


class InOrderSha256:
    """[issue 29] The sha256 of a file written in pieces at their offsets, taken in file order while it is
    written: a piece that lands at the frontier is hashed from memory on a hash thread (what is written is
    what is hashed); pieces that land ahead of it are kept (up to :data:`KEEP_AHEAD_BYTES`, else read
    back with ``pread`` from the page cache) until the frontier reaches them. Rebuilding a ``.pt`` writes
    its skeleton first and then every tensor in file order, so nearly every byte is hashed from memory,
    beside the decoding, instead of in a second read of the whole file once it is written (0.6-0.9 s per
    GiB, on one core, after the rest). Thread-safe: the writer threads report each piece once written.

    Args:
        fd: the file (open for writing; for reading too, or read through ``/proc/self/fd``). size: its size.
    """

    #: bytes of pieces written ahead of the frontier kept in memory (beyond: read back when reached)
    KEEP_AHEAD_BYTES = 64 << 20

    def __init__(self, fd: int, size: int):
        import collections
        from concurrent.futures import ThreadPoolExecutor

        self.fd, self.size = fd, size
        self.sha = hashlib.sha256()
        self.front = 0
        self.ahead: dict[int, tuple[int, Any]] = {}  # start -> (end, the piece, or None: read it back)
        self.kept = 0
        self.reader: int | None = None  # a read-only descriptor, when fd was opened for writing only
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-filehash")
        self.pending: collections.deque = collections.deque()

    def wrote(self, offset: int, piece) -> None:
        """``piece`` (bytes-like, kept unchanged until hashed) is written at ``offset``.

        Raises:
            IntegrityError: bytes at an offset already reported.
        """
        n = len(piece)
        with self.lock:
            if offset == self.front:
                self._hash(piece)
                self.front += n
                while self.front in self.ahead:
                    end, kept = self.ahead.pop(self.front)
                    if kept is not None:
                        self.kept -= len(kept)
                        self._hash(kept)
                        self.front = end
                        continue
                    while self.front < end:
                        k = min(READ_BYTES, end - self.front)
                        data = self._pread(k, self.front)
                        if len(data) != k:
                            raise OSError(f"{k} bytes at {self.front} could not be read back")
                        self._hash(data)
                        self.front += k
            elif offset > self.front and offset not in self.ahead:
                keep = piece if self.kept + n <= self.KEEP_AHEAD_BYTES else None
                self.kept += n if keep is not None else 0
                self.ahead[offset] = (offset + n, keep)
            elif n:
                raise IntegrityError(f"bytes at {offset} written twice")

    def _pread(self, n: int, offset: int) -> bytes:
        """Read back what was written; a descriptor opened for writing only is read through a read-only one
        of the same open file (``/proc/self/fd``: the very inode, whatever its name now points to)."""
        try:
            return os.pread(self.reader if self.reader is not None else self.fd, n, offset)
        except OSError as exc:
            import errno

            if exc.errno != errno.EBADF or self.reader is not None or not os.path.isdir("/proc/self/fd"):
                raise
            self.reader = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY)
            return os.pread(self.reader, n, offset)

    def _hash(self, data) -> None:
        self.pending.append(self.pool.submit(self.sha.update, data))
        while len(self.pending) > 8:
            self.pending.popleft().result()

    def hexdigest(self) -> str | None:
        """The file's sha256 once every byte was written (None when some never were)."""
        with self.lock:
            while self.pending:
                self.pending.popleft().result()
            return self.sha.hexdigest() if self.front == self.size and not self.ahead else None

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.reader is not None:
            os.close(self.reader)
            self.reader = None


class ParallelWrites:
    """[issue 29] ``pwrite`` of pieces at their offsets on a few threads, within a bounded queue: copying
    into the page cache is restore's largest cost (1-2 ns/B on the benchmark VM), and one thread doing
    every write was its slowest stage. ``on_written(offset, piece)`` is called on the writer thread once a
    piece is written (the in-order hash). Errors surface in :meth:`write` or :meth:`drain`.

    Every :data:`WRITEBACK_EVERY_BYTES` queued, writeback of what is written so far is started
    (``fdatasync`` on a thread of its own, one at a time, as pack's member writer does): the disk works while
    the CPUs decode, and the caller's final ``fsync`` finds little left ([issue 29]: that fsync was 0.45-0.55 s
    of a 1 GiB restore's wall time, spent after everything else). It is a head start only: the caller still
    fsyncs the whole file before handing it out.

    Args:
        fd: the file. threads: writer threads (default: the cores, at most 2). depth: writes in flight.
        on_written: optional callback.
    """

    #: bytes queued between two writeback starts
    WRITEBACK_EVERY_BYTES = 64 << 20

    def __init__(self, fd: int, *, threads: int | None = None, depth: int = 8, on_written=None):
        import collections
        from concurrent.futures import ThreadPoolExecutor

        from ckpt_archive.format.codec import default_jobs

        self.fd, self.depth, self.on_written = fd, depth, on_written
        self.pool = ThreadPoolExecutor(threads or min(2, default_jobs()), thread_name_prefix="ckpt-pwrite")
        self.pending: collections.deque = collections.deque()
        self.unsynced = 0
        self.sync_pool: Any = None  # the one-thread executor of the writeback starts, made on first use
        self.sync_fut: Any = None

    def write(self, piece, offset: int) -> None:
        """Queue ``piece`` (kept unchanged until written) for ``offset``; waits while ``depth`` are queued."""
        self.pending.append(self.pool.submit(self._job, piece, offset))
        while self.pending and (len(self.pending) > self.depth or self.pending[0].done()):
            self.pending.popleft().result()
        self.unsynced += memoryview(piece).nbytes
        if self.unsynced >= self.WRITEBACK_EVERY_BYTES and (self.sync_fut is None or self.sync_fut.done()):
            self._start_writeback()

    def _start_writeback(self) -> None:
        """``fdatasync`` of what is written so far, on the sync thread; the previous one's error raised here."""
        from concurrent.futures import ThreadPoolExecutor

        if self.sync_fut is not None:
            self.sync_fut.result()  # an I/O error of the last writeback surfaces here, as OSError
        if self.sync_pool is None:
            self.sync_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-wsync")
        self.sync_fut = self.sync_pool.submit(os.fdatasync, self.fd)
        self.unsynced = 0

    def _job(self, piece, offset: int) -> None:
        pwrite_all(self.fd, piece, offset)
        if self.on_written is not None:
            self.on_written(offset, piece)

    def drain(self) -> None:
        """Wait for every queued write and the writeback in progress (raising the first error)."""
        while self.pending:
            self.pending.popleft().result()
        if self.sync_fut is not None:
            fut, self.sync_fut = self.sync_fut, None
            fut.result()

    def close(self) -> None:
        """Stop: queued writes not yet started are dropped, running ones finish (errors ignored)."""
        for fut in self.pending:
            fut.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)
        if self.sync_pool is not None:
            self.sync_pool.shutdown(wait=True)


__all__ = ["READ_BYTES", "pwrite_all", "InOrderSha256", "ParallelWrites"]
