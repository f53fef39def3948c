"""Hashing a member's decoded chunk stream beside the thread that consumes it.

:meth:`ckpt_archive.repo.reader.ArchiveReader.iter_member` hands each decoded chunk to :class:`ChunkHashers`:
the member's raw fingerprint is updated on one thread and an optional ``tap`` (verify --deep's exact file
sha256, repo/exact_stream.py) on another, in chunk order, with a bounded queue, so hashing overlaps decoding
and never holds more than :data:`~ckpt_archive.format.limits.IN_FLIGHT_RAW_BYTES` (but one chunk). It
decodes and reads nothing itself.
"""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

from ckpt_archive.errors import IntegrityError
from ckpt_archive.format.limits import IN_FLIGHT_RAW_BYTES
from ckpt_archive.repo.objects import ProvenRange


def _skip_or_fail(raw_check, proven: ProvenRange, member: str) -> None:
    """Give the member's raw check a proven object's fingerprint for its entry (on the raw-hash thread, in
    stream order); a range that is not exactly one entry is a problem of the member."""
    if not raw_check.skip(proven.nbytes, proven.fp):
        raise IntegrityError(f"shared object {proven.oid} is not one entry of its member", where=member)


class ChunkHashers:
    """:meth:`ArchiveReader.iter_member`'s hashing beside the consumer: the member's raw fingerprint on one
    thread, an optional ``tap`` on another (both in chunk order; hashlib and BLAKE3 release the GIL, so they
    run side by side), at most ``window`` chunks and :data:`IN_FLIGHT_RAW_BYTES` (but one chunk) queued."""

    def __init__(self, raw_check, tap, window: int):
        self.raw_check, self.tap, self.window = raw_check, tap, window
        self.raw_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-rawhash")
        self.tap_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-filehash") if tap is not None else None
        self.pending: collections.deque = collections.deque()  # (raw bytes, futures)
        self.queued = 0

    def skip(self, proven: ProvenRange, member: str) -> None:
        """A proven shared object's fingerprint for the raw check, in stream order."""
        self.pending.append((0, (self.raw_pool.submit(_skip_or_fail, self.raw_check, proven, member),)))

    def submit(self, off: int, chunk) -> None:
        futs = []
        if self.raw_check is not None:
            futs.append(self.raw_pool.submit(self.raw_check.update, chunk))
        if self.tap_pool is not None:
            futs.append(self.tap_pool.submit(self.tap, off, chunk))
        if not futs:
            return
        self.pending.append((len(chunk), futs))
        self.queued += len(chunk)
        while len(self.pending) > self.window or (len(self.pending) > 1 and self.queued > IN_FLIGHT_RAW_BYTES):
            self._collect()

    def _collect(self) -> None:
        n, futs = self.pending.popleft()
        for fut in futs:
            fut.result()
        self.queued -= n

    def drain(self) -> None:
        while self.pending:
            self._collect()

    def shutdown(self) -> None:
        for pool in (self.raw_pool, self.tap_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["ChunkHashers"]
