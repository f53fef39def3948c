"""Member encoding "chunked-v1": independent chunks, float-aware, hashed on the way, on all cores.

A member's raw bytes are fed to :class:`MemberWriter` as pieces with a codec hint; pieces are cut into
chunks of at most ``chunk_bytes`` that never mix hints, each chunk is encoded on a thread pool
(zstandard and hashlib release the GIL) and written in order. Chunk codecs (docs/FORMAT.md):

* ``store``  -- raw bytes (used when compression does not pay: stored >= 99 % of raw);
* ``zstd``   -- one zstandard frame;
* ``bg2+zstd`` / ``bg4+zstd`` / ``bg8+zstd`` -- byte grouping (byte k of every N-byte element into
  plane k) before zstandard; for float tensors of element size N. The exponent bytes of trained
  weights and optimizer moments vary little, so their plane compresses well.
* ``bg2r+zstd`` / ``bg4r+zstd`` / ``bg8r+zstd`` (format 3) -- each element, read as a little-endian
  N-byte unsigned integer, is rotated left by one bit before byte grouping, so the sign bit leaves the
  top byte and the whole 8-bit exponent of bf16/fp32 lands in one plane (ZipNN's observation). The
  writer uses them for 2- and 4-byte floats (:data:`ROTATE_SIZES`); fp64 keeps ``bg8+zstd``
  (rotating moves 3 of its 11 exponent bits into a mantissa byte: 1-2 % larger).

Float chunks are compressed with zstd parameters tuned for byte planes (:data:`FLOAT_PARAMS`: the
``fast`` strategy, minimum match 7, tiny hash tables) whenever ``level <= 3``: on exponent planes
long matches are rare and short ones cost more than Huffman-coded literals, so these settings compress
*better* than levels 1-3 (bf16 exponent plane 2.9x vs 2.7x at level 1 and 2.4x at level 3) at 1-2x
the speed of level 1; mantissa planes are near-random and zstd stores their blocks raw. The output is
an ordinary zstd frame: decoders need nothing special. Measurements: benchmarks/README.md.

Decoded chunks are returned as zero-copy ``memoryview``s where possible (a ``store`` chunk is the
stored buffer itself; a byte-grouped chunk is interleaved straight into a fresh array).

:func:`iter_decoded` reads a stored member back chunk by chunk, checking each chunk's stored sha256,
decoding in parallel with ordered output.
"""
from __future__ import annotations

import collections
import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Callable, Iterator

from ckpt_archive.errors import IntegrityError
from ckpt_archive.format.crc import crc32
from ckpt_archive.format.limits import FRAME_HEADER_MAX, IN_FLIGHT_RAW_BYTES, check_chunk_table, frame_header_problem
from ckpt_archive.format.planes import SMALL_PLANES_BYTES, byte_group, byte_ungroup, populate, scratch

#: Raw bytes per chunk. 4 MiB: ratio within 0.3 % of 16 MiB chunks (benchmarks/proto_codec.py), enough
#: chunks to keep every core busy on a 1 GiB member, and 2 * jobs chunks in flight stay small.
DEFAULT_CHUNK_BYTES = 4 << 20
#: zstd level for non-float chunks; float chunks use FLOAT_PARAMS at levels <= 3 (see module docstring).
DEFAULT_LEVEL = 3
#: A chunk is stored raw when compression saves less than this fraction.
STORE_BELOW_SAVING = 0.01
CODEC_NAME = "chunked-v1"
#: Element sizes whose float chunks the writer sign-rotates (``bg<N>r+zstd``). Measured on the benchmark
#: state (benchmarks/README.md, "Sign rotation"): bf16 -0.9 % stored, fp32 moments -0.3 % / -1.2 %, fp16
#: unchanged (its 5-bit exponent straddles bytes either way; it shares the hint ``bg2`` with bf16), fp64
#: +1-2 % (so not rotated).
ROTATE_SIZES = frozenset({2, 4})
#: The codec hints a writer accepts with each piece (:class:`~ckpt_archive.format.member_writer.MemberWriter`).
HINTS = ("store", "zstd", "bg2", "bg4", "bg8")
#: byte-grouped chunk codecs: name -> (element size, sign-rotated)
_GROUPED = {f"bg{n}{r}+zstd": (n, r == "r") for n in (2, 4, 8) for r in ("", "r")}

_tls = threading.local()


def default_jobs() -> int:
    """Worker threads: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def float_params():
    """zstd parameters for byte-grouped float chunks (used at ``level <= 3``).

    ``fast`` strategy, ``min_match`` 7, 256-entry hash/chain tables, 64 KiB window: finds only long
    repeats (zero runs, constant planes) and leaves the rest to the Huffman literal coder, which is
    what exponent planes need. ``target_length`` must stay 0: for the fast strategy a non-zero value
    turns off literal compression.
    """
    import zstandard

    return zstandard.ZstdCompressionParameters(window_log=16, hash_log=8, chain_log=8, search_log=1,
                                               min_match=7, target_length=0,
                                               strategy=zstandard.STRATEGY_FAST)


def _compressor(level: int, floats: bool = False):
    import zstandard

    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    key = ("float", 0) if floats and level <= 3 else ("level", level)
    if key not in cache:
        cache[key] = (zstandard.ZstdCompressor(compression_params=float_params()) if key[0] == "float"
                      else zstandard.ZstdCompressor(level=level))
    return cache[key]


def _decompressor():
    import zstandard

    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def encode_chunk(raw, hint: str, level: int) -> tuple[str, bytes, str]:
    """Encode one chunk.

    Args:
        raw: bytes-like, the chunk's raw bytes.
        hint: ``"store"``, ``"zstd"`` or ``"bgN"`` (N = element size in bytes of a float tensor).
        level: zstandard level.

    Returns:
        (codec, stored bytes (bytes-like; for ``store`` a view of ``raw``), stored sha256 hex). A
        ``bgN`` chunk becomes ``bgNr+zstd`` for N in :data:`ROTATE_SIZES` (a format-3 codec: the
        manifest is then written as format 3), else ``bgN+zstd``; ``zstd`` when its length is not a
        multiple of N; ``store`` when compression saves under 1 %.
    """
    mv = memoryview(raw).cast("B")
    if hint == "store" or len(mv) == 0:
        stored, codec = mv, "store"
    else:
        n = int(hint[2:]) if hint.startswith("bg") else 0
        if n > 1 and len(mv) % n == 0:
            rot = n in ROTATE_SIZES
            # a small chunk is grouped without NumPy (planes.SMALL_PLANES_BYTES), a large one into scratch
            small = len(mv) <= SMALL_PLANES_BYTES
            planes = byte_group(mv, n, rotate=rot, out=None if small else scratch("planes", len(mv)))
            stored = _compressor(level, floats=True).compress(planes)
            codec = f"bg{n}r+zstd" if rot else f"bg{n}+zstd"
        else:
            stored, codec = _compressor(level).compress(mv), "zstd"
        if len(stored) >= len(mv) * (1 - STORE_BELOW_SAVING):
            stored, codec = mv, "store"
    return codec, stored, hashlib.sha256(stored).hexdigest()


def decode_chunk(stored, codec: str, raw_bytes: int, out=None):
    """Decode one chunk.

    Args:
        stored: the chunk's stored bytes.
        codec: its codec from the manifest.
        raw_bytes: its raw size from the manifest.
        out: optional writable buffer of ``raw_bytes`` bytes to decode into.

    Returns:
        the raw bytes, bytes-like (``bytes`` or a 1-D ``memoryview``; a ``store`` chunk is ``stored``
        itself, not copied; with ``out``, a view of ``out``).

    Raises:
        IntegrityError: unknown codec, undecodable frame, or not exactly ``raw_bytes`` bytes.
    """
    try:
        if codec == "store":
            res = stored
        elif codec == "zstd":
            res = _unframe(stored, raw_bytes)
        elif codec in _GROUPED:
            n, rot = _GROUPED[codec]
            planes = _unframe(stored, raw_bytes)
            if len(planes) % n:
                raise IntegrityError(f"byte-grouped chunk of {len(planes)} bytes is not a multiple of {n}")
            if len(planes) != raw_bytes:
                raise IntegrityError(f"chunk decodes to {len(planes)} bytes, manifest says {raw_bytes}")
            res = byte_ungroup(planes, n, out, rotate=rot) if planes else b""
            if out is not None:
                return res
        else:
            raise IntegrityError(f"unknown chunk codec {codec!r}")
    except IntegrityError:
        raise
    except Exception as exc:  # zstandard.ZstdError and friends
        raise IntegrityError(f"chunk does not decode ({exc})") from None
    if len(res) != raw_bytes:
        raise IntegrityError(f"chunk decodes to {len(res)} bytes, manifest says {raw_bytes}")
    if out is not None and raw_bytes:
        mv = memoryview(out).cast("B")
        mv[:] = memoryview(res).cast("B")
        return mv
    return res


def _unframe(stored, raw_bytes: int):
    """The one zstd frame a chunk holds, decompressed: no byte may follow it (``allow_extra_data=False``),
    so every stored byte of a chunk is one that decoding reads -- what lets pack's trial reload check a
    chunk it has just written by decoding it, without hashing it again."""
    if not raw_bytes:
        return b""
    return _decompressor().decompress(stored, max_output_size=raw_bytes, allow_extra_data=False)


class StoredStream:
    """Check a member's stored bytes fed in order, in pieces of any size (copying, streaming stores).

    Every chunk's stored sha256 is checked as its bytes complete, and the member's stored fingerprint
    through the chunk table (format 2: derived from the chunks'; format 1: a whole-file sha256, which
    only format 1 records). :meth:`finish` says what, if anything, was wrong.

    Args:
        record: the member's manifest record (its chunk table is checked first, by :func:`check_chunk_table`).
        member: the member's path (for messages).
    """

    def __init__(self, record: dict, member: str, *, whole: bool = False):
        self.record = record
        self.member = member
        self.error: str | None = None
        try:
            check_chunk_table(record, member)
        except IntegrityError as exc:
            self.error = exc.message
        self._chunks = record.get("chunks") or []
        self._i = 0
        self._h = hashlib.sha256()
        self._head = bytearray()  # the current chunk's first bytes (its zstandard frame header)
        self._left = self._chunks[0]["stored_bytes"] if self._chunks else 0
        # format 1 records the file's sha256; format 2 derives it (``whole``: a caller's proof wants it)
        self._whole = hashlib.sha256() if ("stored_fp" not in record or whole) else None
        self.total = 0

    def update(self, piece) -> None:
        mv = memoryview(piece).cast("B")
        self.total += len(mv)
        if self._whole is not None:
            self._whole.update(mv)
        while len(mv) and self.error is None:
            self._advance_empty()
            if self._i >= len(self._chunks):
                self.error = f"longer than its chunks ({self.record['stored_bytes']} stored bytes)"
                return
            take = min(len(mv), self._left)
            if len(self._head) < FRAME_HEADER_MAX:  # the frame header, checked against the declared raw size
                self._head += mv[:min(take, FRAME_HEADER_MAX - len(self._head))]
            self._h.update(mv[:take])
            self._left -= take
            mv = mv[take:]
            self._advance_empty()

    def _advance_empty(self) -> None:
        while self._i < len(self._chunks) and self._left == 0 and self.error is None:
            c = self._chunks[self._i]
            got = self._h.hexdigest()
            if got != c["stored_sha256"]:
                self.error = (f"chunk {self._i} (stored bytes {c['stored_offset']}..+{c['stored_bytes']}) sha256 "
                              f"{got}, manifest says {c['stored_sha256']}")
                return
            # sound bytes under a record that lies about their raw size (a resealed manifest): named here, as
            # the local check reads it from the frame header (repo/reader.py), so every store says the same
            self.error = frame_header_problem(self._head, c, self._i)
            if self.error:
                return
            self._i += 1
            self._head = bytearray()
            self._h = hashlib.sha256()
            self._left = self._chunks[self._i]["stored_bytes"] if self._i < len(self._chunks) else 0

    @property
    def whole_sha256(self) -> str | None:
        """sha256 hex of every byte fed (format 1, or with ``whole=True``), else None."""
        return self._whole.hexdigest() if self._whole is not None else None

    def finish(self) -> str | None:
        """None when every byte matched, else the first thing wrong (one line)."""
        self._advance_empty()
        if self.error is None and (self._i < len(self._chunks) or self.total != self.record["stored_bytes"]):
            self.error = f"{self.total} bytes stored, manifest says {self.record['stored_bytes']}"
        if self.error is None and "stored_sha256" in self.record and self._whole.hexdigest() != self.record["stored_sha256"]:
            self.error = f"stored sha256 {self._whole.hexdigest()}, manifest says {self.record['stored_sha256']}"
        return self.error


def chunks_match(fh: BinaryIO, record: dict, *, member: str, jobs: int | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 pool: ThreadPoolExecutor | None = None) -> bool | None:
    """Check every chunk's stored sha256 of a member in parallel (the fast shallow verify).

    Every chunk matching its sha256, with a chunk table that tiles the file exactly, implies the
    whole file's stored sha256 (the writer hashed the same bytes in the same order) -- and unlike
    one whole-file hash, chunks hash on all cores.

    Args:
        fh: the stored file, opened for reading.
        record: the member's manifest record.
        pool: an executor to check on (default: a new one of ``jobs`` threads, shut down on return).

    Returns:
        True (all match), False (something differs: the caller's slow path names it), or None when
        ``fh`` is not a local file (no parallel positional reads; use a sequential hash).
    """
    fd = fileno_of(fh)
    if fd is None:
        return None
    own = pool is None
    pool = pool or ThreadPoolExecutor(jobs or default_jobs(), thread_name_prefix="ckpt-verify")
    try:
        futs = submit_chunk_checks(fd, record, member=member, pool=pool)
        if futs is None:
            return False
        ok = True
        for n, fut in futs:
            ok = fut.result() and ok
            if on_bytes:
                on_bytes(n)
        return ok
    finally:
        if own:
            pool.shutdown(wait=True)


def submit_chunk_checks(fd: int, record: dict, *, member: str, pool: ThreadPoolExecutor
                        ) -> list[tuple[int, Future]] | None:
    """Start checking every chunk's stored sha256 of one local stored file on ``pool``.

    Each chunk is read with ``preadv`` into a thread-local buffer reused across chunks and files (a fresh
    4 MiB ``bytes`` per chunk costs a page fault per 4 KiB on first touch), then hashed (sha256 releases
    the GIL). Callers checking many files submit the next file's chunks before collecting this one's, so
    single-chunk files (shared objects) keep every core busy.

    Args:
        fd: the open stored file. record: the member's (or object's rebased) manifest record.
        member: names the member in a chunk-table error. pool: the executor to run on.

    Returns:
        ``[(stored bytes, future of bool)]`` per chunk, or None when the chunk table does not tile the
        record or the file's size differs (a mismatch: the caller's slow path names it).
    """
    try:
        check_chunk_table(record, member)
    except IntegrityError:
        return None
    if os.fstat(fd).st_size != record["stored_bytes"]:
        return None
    return [(c["stored_bytes"], pool.submit(_stored_chunk_ok, fd, c)) for c in record["chunks"]]


#: Chunks submitted ahead of the consumer when they are decoded into the caller's buffer by workers that read
#: them themselves (:func:`iter_decoded` with ``into`` on a local file); 32 default chunks are
#: :data:`~ckpt_archive.format.limits.IN_FLIGHT_RAW_BYTES`, which bounds them too.
INTO_AHEAD = 32
#: A shallow check reads a stored chunk in pieces of at most this many bytes (one reused buffer per thread).
_CHECK_PIECE_BYTES = 16 << 20


def _stored_chunk_ok(fd: int, c: dict) -> bool:
    """True when chunk ``c`` of the file ``fd`` is as long as recorded and has its recorded sha256 (read in
    pieces of at most 16 MiB: memory is one reused buffer per thread, whatever size a chunk declares)."""
    n, pos = c["stored_bytes"], c["stored_offset"]
    if n <= _CHECK_PIECE_BYTES:
        buf = _read_buffer(n)
        got = os.preadv(fd, [buf], pos) if n else 0
        return got == n and hashlib.sha256(buf).hexdigest() == c["stored_sha256"]
    h = hashlib.sha256()
    left = n
    while left:
        buf = _read_buffer(min(left, _CHECK_PIECE_BYTES))
        got = os.preadv(fd, [buf], pos)
        if got != len(buf):
            return False
        h.update(buf)
        pos += got
        left -= got
    return h.hexdigest() == c["stored_sha256"]


def _read_buffer(nbytes: int) -> memoryview:
    """A thread-local writable buffer of ``nbytes`` (at most :data:`_CHECK_PIECE_BYTES`; anonymous ``mmap``,
    no NumPy: the shallow verify does not import it), reused across chunks."""
    import mmap

    buf = getattr(_tls, "read_buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _tls.read_buf = memoryview(mmap.mmap(-1, max(nbytes, DEFAULT_CHUNK_BYTES + (64 << 10))))
    return buf[:nbytes]


def _positional(fh) -> Callable[[int, int], bytes] | None:
    """``pread(n, offset)`` for ``fh`` when chunks can be read positionally in parallel: a plain local file,
    or a stream that offers ``pread``/``size`` itself (a format-3 member read through its shared objects,
    :class:`ckpt_archive.repo.objects.MemberStream`); None otherwise (read sequentially)."""
    if hasattr(fh, "pread"):
        return fh.pread if fh.positional else None
    fd = fileno_of(fh)
    if fd is None:
        return None
    return lambda n, off: os.pread(fd, n, off)


def fileno_of(fh) -> int | None:
    """The OS file descriptor behind ``fh`` when it is a plain local (regular) file, else None.

    Args:
        fh: any file-like object (a pipe, a socket, an fsspec file or ``io.BytesIO`` give None).

    Returns:
        the descriptor (not duplicated: ``fh`` still owns it), or None; never raises.
    """
    import io
    import stat

    try:
        fd = fh.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return None


def _read_exact(fh: BinaryIO, n: int) -> bytes:
    data = fh.read(n)
    return data if data is not None else b""


def _check_stored_size(fh, record: dict, member: str) -> None:
    """A positionally read stored file (``pread`` or a local descriptor) against its chunk table, before any
    chunk is read: no longer than its chunks, and every chunk inside it.

    Raises:
        IntegrityError: the file is longer than its chunks, or a chunk is truncated (names it).
    """
    size = fh.size() if hasattr(fh, "pread") else os.fstat(fileno_of(fh)).st_size
    if size > record["stored_bytes"]:
        raise IntegrityError("stored file is longer than its chunks", where=member)
    for i, c in enumerate(record["chunks"]):
        if c["stored_offset"] + c["stored_bytes"] > size:
            raise IntegrityError(f"truncated: chunk {i} has {max(0, size - c['stored_offset'])} of "
                                 f"{c['stored_bytes']} stored bytes", where=member)


def _dest_of(into, chunk: dict) -> memoryview:
    """Where chunk ``chunk`` is decoded in ``into`` (the member's raw bytes); [issue 29] its pages are taken
    in one call first (:func:`~ckpt_archive.format.planes.populate`), not by a fault per 4 KiB page."""
    populate(into, chunk["raw_offset"], chunk["raw_bytes"])
    return memoryview(into).cast("B")[chunk["raw_offset"]:chunk["raw_offset"] + chunk["raw_bytes"]]


def _chunks_ahead(jobs: int, into_by_workers: bool) -> int:
    """:func:`iter_decoded`'s bound on the chunks submitted and not yet consumed (their declared raw sizes
    add up to at most :data:`~ckpt_archive.format.limits.IN_FLIGHT_RAW_BYTES` as well, but one chunk):
    ``2 * jobs``. [issue 29] Decoded straight into the caller's buffer by workers that read their own chunk
    (``into_by_workers``), up to :data:`INTO_AHEAD`: the workers then do not wait on the consumer, which on
    a busy machine is often not scheduled for many milliseconds; a waiting chunk's result is a view of that
    buffer, so the memory held is the same.
    """
    return max(2 * jobs, INTO_AHEAD) if into_by_workers else 2 * jobs


def iter_decoded(fh: BinaryIO, record: dict, *, member: str, jobs: int | None = None,
                 stored_hasher=None, verify_chunks: bool = True, into=None,
                 skip_sha: frozenset = frozenset(), written_crc=None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(raw_offset, raw_chunk)`` for each chunk of a stored member, in order.

    Each chunk's stored sha256 is checked before decoding; decoding runs on a thread pool with ordered
    output and at most ``2 * jobs`` chunks in flight, whose declared raw sizes add up to at most
    :data:`~ckpt_archive.format.limits.IN_FLIGHT_RAW_BYTES` (one chunk alone may exceed it): 64 MiB chunks on
    many cores cannot hold gigabytes.

    Args:
        fh: the stored file, positioned at 0.
        record: the member's manifest record.
        member: the member's path (for error messages).
        stored_hasher: a hashlib object updated with every stored byte read (for the whole-file sha256).
        verify_chunks: check each chunk's stored sha256 before decoding. Only a caller that checks
            the decoded bytes end to end (raw sha256 of every byte it uses) may pass False; decoding
            damaged bytes is memory-safe (sizes are bounded) and fails or yields bytes that caller
            then rejects.
        into: optional writable buffer of the member's raw size: every chunk is decoded straight into
            its place there (no per-chunk allocation) and the yielded chunks are views of it.
        skip_sha: indices of chunks whose stored sha256 is not checked here (shared objects proven when
            they were created, whose decoded bytes the caller checks end to end; see
            :attr:`ckpt_archive.repo.reader.ArchiveReader.proven_objects`).
        written_crc: per chunk, the CRC-32 of the stored bytes as this process wrote them, or None:
            a chunk with one is compared with it instead of its sha256 (the sha256 was taken from those
            bytes; :attr:`ckpt_archive.repo.reader.ArchiveReader.written_crc`). Only for a caller that
            checks every decoded byte end to end.

    Raises:
        IntegrityError: a chunk is short, fails its sha256, or does not decode; names member and chunk.
    """
    jobs = jobs or default_jobs()
    check_chunk_table(record, member)
    chunks = record["chunks"]
    if into is not None and len(memoryview(into).cast("B")) != record["raw_bytes"]:
        raise ValueError("into must hold exactly the member's raw bytes")
    pread = None if stored_hasher is not None else _positional(fh)
    fd = pread  # (truthy when chunks are read positionally by the workers)
    if pread is not None:
        # Local file(s): workers read their own chunk with pread (parallel, main thread free)
        _check_stored_size(fh, record, member)

    def work(i, stored, chunk):
        if stored is None:
            stored = pread(chunk["stored_bytes"], chunk["stored_offset"])
            if len(stored) != chunk["stored_bytes"]:
                raise IntegrityError(f"truncated: chunk {i} has {len(stored)} of {chunk['stored_bytes']} "
                                     f"stored bytes", where=member)
        dest = None if into is None else _dest_of(into, chunk)
        want_crc = written_crc[i] if written_crc is not None and verify_chunks and i not in skip_sha else None
        if want_crc is not None:
            if crc32(stored) != want_crc:
                raise IntegrityError(f"chunk {i} (stored bytes {chunk['stored_offset']}..."
                                     f"{chunk['stored_offset'] + chunk['stored_bytes']}) is not the bytes written "
                                     f"there a moment ago (CRC-32 differs)", where=member)
        if not verify_chunks or i in skip_sha or want_crc is not None:
            try:
                return decode_chunk(stored, chunk["codec"], chunk["raw_bytes"], dest)
            except IntegrityError as exc:
                raise IntegrityError(f"chunk {i}: {exc.message} (`ckpt-archive verify` names damaged chunks)",
                                     where=member) from None
        sha = hashlib.sha256(stored).hexdigest()
        if sha != chunk["stored_sha256"]:
            raise IntegrityError(f"chunk {i} (stored bytes {chunk['stored_offset']}..."
                                 f"{chunk['stored_offset'] + chunk['stored_bytes']}) fails its sha256: "
                                 f"expected {chunk['stored_sha256']}, got {sha}", where=member)
        try:
            return decode_chunk(stored, chunk["codec"], chunk["raw_bytes"], dest)
        except IntegrityError as exc:
            raise IntegrityError(f"chunk {i}: {exc.message}", where=member) from None

    ahead = _chunks_ahead(jobs, into is not None and fd is not None)
    pool = ThreadPoolExecutor(jobs, thread_name_prefix="ckpt-dec")
    try:
        pending: collections.deque = collections.deque()  # (raw offset, declared raw bytes, future)
        in_flight = 0  # declared raw bytes submitted and not yet yielded: at most IN_FLIGHT_RAW_BYTES (but one chunk)
        for i, chunk in enumerate(chunks):
            while pending and (len(pending) >= ahead or in_flight + chunk["raw_bytes"] > IN_FLIGHT_RAW_BYTES):
                off, n, fut = pending.popleft()
                in_flight -= n
                yield off, fut.result()
            stored = None
            if fd is None:
                stored = _read_exact(fh, chunk["stored_bytes"])
                if stored_hasher is not None:
                    stored_hasher.update(stored)
                if len(stored) != chunk["stored_bytes"]:
                    raise IntegrityError(f"truncated: chunk {i} has {len(stored)} of {chunk['stored_bytes']} "
                                         f"stored bytes", where=member)
            pending.append((chunk["raw_offset"], chunk["raw_bytes"], pool.submit(work, i, stored, chunk)))
            in_flight += chunk["raw_bytes"]
        while pending:
            off, _, fut = pending.popleft()
            yield off, fut.result()
        if fd is None and fh.read(1):
            raise IntegrityError("stored file is longer than its chunks", where=member)
    finally:  # a failed chunk or a consumer that stops early: the chunks not started are not decoded at all
        pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_LEVEL", "INTO_AHEAD", "STORE_BELOW_SAVING", "CODEC_NAME", "ROTATE_SIZES", "default_jobs",
           "float_params", "encode_chunk", "decode_chunk", "check_chunk_table", "StoredStream", "chunks_match",
           "submit_chunk_checks", "iter_decoded"]
