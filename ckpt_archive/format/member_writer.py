"""Write one member as chunked-v1 (docs/FORMAT.md, "Member encoding"): :class:`MemberWriter` cuts the raw
bytes into chunks, encodes them on a thread pool (:func:`ckpt_archive.format.codec.encode_chunk`), writes
them in order and fingerprints on the way; :class:`ChunkSink` routes one entry's chunks to a shared
object instead of the member's file (format 3, docs/FORMAT.md "Shared objects").

Split from :mod:`ckpt_archive.format.codec` (which keeps the chunk encoding itself and the readers) so that
both stay under the project's ~600-line guide; ``codec`` re-exports these names.
"""
from __future__ import annotations

import collections
import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Callable

from ckpt_archive.format import fingerprint
from ckpt_archive.format.codec import (CODEC_NAME, DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL, _HINTS, _fileno,
                                       default_jobs, encode_chunk)

#: While writing a local file, start writeback (fdatasync on a helper thread) every this many stored
#: bytes, so the disk works while the CPUs encode and the store's final fsync finds little left.
SYNC_EVERY_BYTES = 64 << 20
#: Stored bytes the feeding thread may queue for the writer thread before it waits (bounded memory).
WRITE_AHEAD_BYTES = 32 << 20


def _encode_and_crc(raw, hint: str, level: int) -> tuple[str, bytes, str, int]:
    """:func:`~ckpt_archive.format.codec.encode_chunk` plus the CRC-32 of the stored bytes (ISA-L,
    ~0.09 ns per byte, on the encoder's thread while the bytes are in its cache)."""
    from ckpt_archive.format.exact_bytes import crc32

    codec, stored, sha = encode_chunk(raw, hint, level)
    return codec, stored, sha, crc32(stored)


class ChunkSink:
    """Where one entry's chunks go instead of the member's file (format 3, docs/FORMAT.md "Shared objects").

    A new object has ``fh`` (a writable file, opened by the caller) and ``commit(chunks)`` /
    ``abort()`` callables: ``commit`` makes the object visible (fsync, atomic link) and gets the chunk
    records written to it; ``abort`` discards it. A reused object (``reused=True``) writes nothing.
    The member writer fills in ``raw_offset``, ``raw_bytes``, ``stored_offset`` and ``stored_bytes``
    (in the member's stored stream).
    """

    def __init__(self, fp: str, *, fh=None, commit: Callable | None = None, abort: Callable | None = None,
                 reused: bool = False):
        self.fp = fp
        self.fh = fh
        self.reused = reused
        self._commit = commit
        self._abort = abort
        self.raw_offset = self.raw_bytes = self.stored_offset = self.stored_bytes = 0
        self.submitted = self.written = 0
        self.sealed = False

    def commit(self, chunks: list[dict]) -> None:
        if self._commit is not None:
            self._commit(chunks)

    def abort(self) -> None:
        if self._abort is not None:
            self._abort()


class MemberWriter:
    """Write one member as chunked-v1 to an open binary file, fingerprinting on the way.

    Each chunk's stored bytes are hashed once (sha256, on the encoder thread); the member's stored
    fingerprint is derived from them (``sha256-chunks:``, :mod:`ckpt_archive.format.fingerprint`).
    The raw bytes are hashed as a whole only with ``raw_alg`` (``"sha256"``/``"blake3"``); a tensors
    member passes None and fingerprints each entry instead (its member fingerprint is derived).

    Args:
        fh: writable binary file (already opened write-once by the store).
        level: zstandard level (1-19).
        jobs: encoder threads (default: the machine's cores).
        chunk_bytes: maximum raw bytes per chunk.
        on_bytes: progress callback, called with raw bytes consumed.
        pool: an executor to share between members (optional).
        raw_alg: algorithm of the whole-member raw fingerprint, or None for none.
        io_pool: a one-thread executor that does every write, writeback start and object commit in order
            (shared between members; default: one of its own). [issue 29] The feeding thread only hands
            encoded chunks over, within :data:`WRITE_AHEAD_BYTES`: it no longer spends its time in the kernel
            copying them into the page cache while the encoders wait for it.

    Example:
        >>> import io
        >>> buf = io.BytesIO(); w = MemberWriter(buf); w.add(b"x" * 100, "zstd"); rec = w.finish()
        >>> rec["raw_bytes"], rec["chunks"][0]["codec"]
        (100, 'zstd')
    """

    def __init__(self, fh: BinaryIO, *, level: int = DEFAULT_LEVEL, jobs: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_bytes: Callable[[int], None] | None = None,
                 pool: ThreadPoolExecutor | None = None, raw_alg: str | None = "sha256",
                 io_pool: ThreadPoolExecutor | None = None):
        self.fh = fh
        self.raw_alg = raw_alg
        self.level = level
        self.jobs = jobs or default_jobs()
        self.chunk_bytes = chunk_bytes
        self.on_bytes = on_bytes
        self._own_pool = pool is None
        self.pool = pool or ThreadPoolExecutor(self.jobs, thread_name_prefix="ckpt-enc")
        self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-rawhash")
        self._raw_hash = fingerprint.new(raw_alg) if raw_alg else None
        self._pending: collections.deque[tuple[int, int, Future]] = collections.deque()
        self._hash_pending: collections.deque[tuple[int, Future]] = collections.deque()
        self._hash_pending_bytes = 0
        self._buf: list = []
        self._buf_len = 0
        self._buf_hint: str | None = None
        self._raw_offset = 0
        self._stored_offset = 0
        self.chunks: list[dict] = []
        #: CRC-32 of each chunk's stored bytes as this writer handed them to the store, in chunk order; None
        #: for a chunk it did not write (a reference to an existing shared object). Never in the manifest:
        #: pack's trial reload compares the bytes it reads back with these (ArchiveReader.written_crc).
        self.written_crc: list[int | None] = []
        self._fd = _fileno(fh)
        self._unsynced = 0
        self._sync_pool: ThreadPoolExecutor | None = None
        self._sync_fut: Future | None = None
        self._own_io = io_pool is None
        self._io = io_pool or ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self._io_pending: collections.deque[tuple[int, Future]] = collections.deque()
        self._io_bytes = 0
        self._io_limit = max(WRITE_AHEAD_BYTES, 2 * self.jobs * chunk_bytes)
        self._buf_sink: ChunkSink | None = None
        self._open_sinks: list[ChunkSink] = []
        self._commits: list[Future] = []
        #: format 3: the ranges of this member's stored stream kept in shared objects (docs/FORMAT.md)
        self.objects: list[dict] = []

    # -- feeding ----------------------------------------------------------------------------------
    def add(self, data, hint: str = "zstd", *, sink: "ChunkSink | None" = None) -> None:
        """Append raw bytes (bytes-like; not copied when large) with a codec hint.

        With ``sink`` (format 3, a new shared object), ``data`` is exactly one entry: its chunks are cut at
        its first and last byte and their stored bytes go to ``sink.fh`` instead of this member's file;
        the sink is committed once its last chunk is written (see :class:`ChunkSink`).
        """
        if hint not in _HINTS:
            raise ValueError(f"unknown hint {hint}")
        mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        n = len(mv)
        if n == 0:
            return
        if sink is not None:
            self._flush_buf()
            self._buf_sink = sink
            sink.raw_offset = self._raw_offset
            self._open_sinks.append(sink)
            try:
                self._add(mv, hint)
                self._flush_buf()
            finally:
                self._buf_sink = None
            sink.raw_bytes = self._raw_offset - sink.raw_offset
            sink.sealed = True
            self._maybe_commit(sink)
            return
        self._add(mv, hint)

    def add_reused(self, sink: "ChunkSink", chunks: list[dict]) -> None:
        """Reference an existing shared object (format 3): its chunk records (codec, sizes, stored
        sha256, as a manifest that references it lists them) join this member's chunk table with the
        offsets moved; nothing is encoded or written."""
        self._flush_buf()
        sink.raw_offset = self._raw_offset
        self._open_sinks.append(sink)
        for c in chunks:
            done: Future = Future()
            done.set_result((c["codec"], None, c["stored_sha256"], None))
            sink.submitted += 1
            self._pending.append((self._raw_offset, c["raw_bytes"], done, sink, c["stored_bytes"]))
            self._raw_offset += c["raw_bytes"]
        sink.raw_bytes = self._raw_offset - sink.raw_offset
        sink.sealed = True
        while len(self._pending) > 2 * self.jobs:
            self._write_one()
        self._maybe_commit(sink)

    def _add(self, mv: memoryview, hint: str) -> None:
        n = len(mv)
        if self._raw_hash is not None:
            # pending raw-hash updates hold their pieces: bound them by bytes (a source read into memory,
            # e.g. 8 MiB pieces of an opaque file, must not pile up behind a slow hash thread)
            self._hash_pending.append((n, self._hash_pool.submit(self._raw_hash.update, mv)))
            self._hash_pending_bytes += n
            while len(self._hash_pending) > 1 and self._hash_pending_bytes > max(8 * self.chunk_bytes, 32 << 20):
                size, fut = self._hash_pending.popleft()
                fut.result()
                self._hash_pending_bytes -= size
        if hint != self._buf_hint:
            self._flush_buf()
            self._buf_hint = hint
        pos = 0
        step = self.chunk_bytes
        if hint.startswith("bg"):
            item = int(hint[2:])
            step -= step % item
        while pos < n:
            room = step - self._buf_len
            take = min(room, n - pos)
            self._buf.append(mv[pos:pos + take])
            self._buf_len += take
            pos += take
            if self._buf_len >= step:
                self._flush_buf()
                self._buf_hint = hint

    def _flush_buf(self) -> None:
        if not self._buf_len:
            return
        raw = self._buf[0] if len(self._buf) == 1 else b"".join(self._buf)
        hint = self._buf_hint or "zstd"
        fut = self.pool.submit(_encode_and_crc, raw, hint, self.level)
        if self._buf_sink is not None:
            self._buf_sink.submitted += 1
        self._pending.append((self._raw_offset, self._buf_len, fut, self._buf_sink, None))
        self._raw_offset += self._buf_len
        self._buf, self._buf_len = [], 0
        while len(self._pending) > 2 * self.jobs:
            self._write_one()

    def _write_one(self) -> None:
        raw_offset, raw_len, fut, sink, reused_len = self._pending.popleft()
        codec, stored, sha, crc = fut.result()
        n = reused_len if stored is None else len(stored)
        self.written_crc.append(crc)
        if sink is not None:
            if sink.written == 0:
                sink.stored_offset = self._stored_offset
            if stored is not None:
                self._io_submit(n, self._io_write, sink.fh, stored, False)
            sink.written += 1
            sink.stored_bytes += n
        else:
            self._io_submit(n, self._io_write, self.fh, stored, True)
        # no whole-file hash: the member's stored fingerprint is derived from the chunks' (fingerprint.py)
        self.chunks.append({"raw_offset": raw_offset, "raw_bytes": raw_len, "stored_offset": self._stored_offset,
                            "stored_bytes": n, "stored_sha256": sha, "codec": codec})
        self._stored_offset += n
        if self.on_bytes:
            self.on_bytes(raw_len)
        if sink is not None:
            self._maybe_commit(sink)

    # -- the writer thread ------------------------------------------------------------------------
    def _io_submit(self, nbytes: int, fn, *args) -> None:
        """Queue one job for the writer thread (in order); wait while more than the write-ahead bound is
        queued. A failed write surfaces here or in :meth:`finish`, as the OSError it raised."""
        self._io_pending.append((nbytes, self._io.submit(fn, *args)))
        self._io_bytes += nbytes
        while self._io_pending and (self._io_bytes > self._io_limit or self._io_pending[0][1].done()):
            size, fut = self._io_pending.popleft()
            self._io_bytes -= size
            fut.result()

    def _io_drain(self) -> None:
        while self._io_pending:
            size, fut = self._io_pending.popleft()
            self._io_bytes -= size
            fut.result()

    def _io_write(self, fh, data, own: bool) -> None:
        """(writer thread) Write one chunk; for the member's own local file, start writeback (fdatasync on
        the sync thread) every :data:`SYNC_EVERY_BYTES`, so the disk works while the CPUs encode."""
        fh.write(data)
        if not own or self._fd is None:
            return
        self._unsynced += len(data)
        if self._unsynced >= SYNC_EVERY_BYTES and (self._sync_fut is None or self._sync_fut.done()):
            if self._sync_fut is not None:
                self._sync_fut.result()  # an I/O error surfaces here, as OSError
            self.fh.flush()
            self._sync_fut = self._sync().submit(os.fdatasync, self._fd)
            self._unsynced = 0

    def _sync(self) -> ThreadPoolExecutor:
        """(writer thread) The one-thread executor for fdatasync and object commits."""
        if self._sync_pool is None:
            self._sync_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-sync")
        return self._sync_pool

    def _io_commit(self, sink: "ChunkSink", chunks: list[dict]) -> None:
        """(writer thread) Commit a new object once its chunks are written: on the sync thread, so the next
        writes go on while it is fsynced."""
        self._commits.append(self._sync().submit(sink.commit, chunks))

    def finish(self) -> dict:
        """Flush and return the member record: sizes, ``stored_fp`` (derived from the chunks), ``raw_fp``
        (with ``raw_alg``) and the chunk list."""
        try:
            self._flush_buf()
            while self._pending:
                self._write_one()
            self._io_drain()
            while self._hash_pending:
                self._hash_pending.popleft()[1].result()
            if self._sync_fut is not None:
                self._sync_fut.result()
            for fut in self._commits:
                fut.result()  # an object's fsync/link error surfaces here
        finally:
            self._hash_pool.shutdown(wait=True)
            if self._own_io:
                self._io.shutdown(wait=True)
            if self._sync_pool is not None:
                self._sync_pool.shutdown(wait=True)
            if self._own_pool:
                self.pool.shutdown(wait=True)
        codecs = sorted({c["codec"] for c in self.chunks})
        rec = {"codec": CODEC_NAME, "chunk_codecs": codecs, "raw_bytes": self._raw_offset,
               "stored_bytes": self._stored_offset,
               "stored_fp": fingerprint.sha256_chunks(c["stored_sha256"] for c in self.chunks),
               "chunks": self.chunks}
        if self._raw_hash is not None:
            rec["raw_fp"] = f"{self.raw_alg}:{self._raw_hash.hexdigest()}"
        if self.objects:
            rec["objects"] = self.objects
        return rec

    def _maybe_commit(self, sink: "ChunkSink") -> None:
        """Once every chunk of a sealed sink is written: commit a new object (on the sync thread, so the
        encoders keep going while it is fsynced), and record the range either way."""
        if not sink.sealed or sink.written != sink.submitted or sink not in self._open_sinks:
            return
        self._open_sinks.remove(sink)
        self.objects.append({"fp": sink.fp, "raw_offset": sink.raw_offset, "raw_bytes": sink.raw_bytes,
                             "stored_offset": sink.stored_offset, "stored_bytes": sink.stored_bytes})
        if sink.reused:
            return
        first = len(self.chunks) - sink.written
        self._io_submit(0, self._io_commit, sink, self.chunks[first:])  # after its writes, in order

    def abort(self) -> None:
        for item in self._pending:
            item[2].cancel()
        # the writer thread finishes what it was given (bounded by WRITE_AHEAD_BYTES): nothing may still
        # write to a file the caller is about to discard, and a queued object commit completes or fails
        for _, fut in self._io_pending:
            with contextlib.suppress(BaseException):
                fut.result()
        self._io_pending.clear()
        if self._own_io:
            self._io.shutdown(wait=True)
        for fut in self._commits:
            with contextlib.suppress(BaseException):
                fut.result()
        for sink in self._open_sinks:
            with contextlib.suppress(Exception):
                sink.abort()
        self._open_sinks = []
        self._hash_pool.shutdown(wait=True)
        if self._sync_pool is not None:
            self._sync_pool.shutdown(wait=True)
        if self._own_pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
