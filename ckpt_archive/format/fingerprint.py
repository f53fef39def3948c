"""Fingerprints: one hash per role, each recorded with its algorithm (docs/FORMAT.md, "Fingerprints").

Format 2 records a fingerprint as ``"<algorithm>:<64 hex>"``:

* ``sha256:`` -- sha256 of the bytes (stored chunks, raw/opaque files and skeletons: what
  ``sha256sum`` gives, so anyone can check them with standard tools);
* ``blake3:`` -- BLAKE3 (32-byte output, the ``blake3`` package) of the bytes: every tensor entry's raw
  bytes, the state tree and data ids (BLAKE3 is ~5x sha256 per core here and hashes on all cores);
* ``sha256-chunks:`` -- *derived*, a member's stored fingerprint: sha256 of the concatenated 32-byte
  sha256 digests of its chunks in order. With a chunk table that tiles the file, every chunk
  matching its sha256 implies this one; nothing hashes the whole file;
* ``blake3-entries:`` -- *derived*, a tensors member's raw fingerprint: BLAKE3 of the concatenated
  32-byte digests of ``blake3(safetensors header)`` and of every entry (in data order).

Format 1 recorded sha256 only (``raw_sha256`` / ``stored_sha256`` fields); :func:`raw_fp` and
:func:`stored_fp` read either, so callers check fingerprints without caring which format wrote them.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

from ckpt_archive.errors import FormatError

SHA256 = "sha256"
BLAKE3 = "blake3"
SHA256_CHUNKS = "sha256-chunks"
BLAKE3_ENTRIES = "blake3-entries"
#: Inputs at least this large are hashed by BLAKE3 on several threads (it releases the GIL).
_BLAKE3_THREADED_BYTES = 16 << 20


class _Blake3:
    """hashlib-like wrapper: ``update`` / ``hexdigest`` / ``digest`` (threads on large updates)."""

    def __init__(self, threads: int | None = None):
        import blake3

        self._mod = blake3
        self._h = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)

    def update(self, data) -> None:
        self._h.update(memoryview(data).cast("B") if not isinstance(data, bytes) else data)

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def new(alg: str, *, threads: int | None = None):
    """A streaming hasher for ``alg`` (``"sha256"`` or ``"blake3"``): ``update``, ``digest``, ``hexdigest``.
    ``threads``: BLAKE3's threads per update (default: all cores, for large updates)."""
    if alg == SHA256:
        return hashlib.sha256()
    if alg == BLAKE3:
        return _Blake3(threads)
    raise FormatError(f"unknown fingerprint algorithm {alg!r}")


def digest(data, alg: str = BLAKE3) -> str:
    """The fingerprint string ``"<alg>:<hex>"`` of bytes-like ``data`` (any memoryview format, mmap)."""
    mv = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if alg == SHA256:
        return f"{SHA256}:{hashlib.sha256(mv).hexdigest()}"
    if alg == BLAKE3:
        import blake3

        threads = blake3.blake3.AUTO if len(mv) >= _BLAKE3_THREADED_BYTES else 1
        return f"{BLAKE3}:{blake3.blake3(mv, max_threads=threads).hexdigest()}"
    raise FormatError(f"unknown fingerprint algorithm {alg!r}")


def file_sha256(path, on_bytes=None, piece_bytes: int = 1 << 20) -> str:
    """sha256 (hex) of a whole file (what ``sha256sum`` prints), read in pieces of ``piece_bytes`` (1 MiB:
    each piece is hashed while it is in the CPU cache, ~0.68 ns/B with its read here against ~0.74 ns/B
    for 8 MiB pieces);
    ``on_bytes`` gets each piece's size. The one whole-file sha256 of the project: ``source.files[].sha256``
    at pack, backup's change detection, and the check of a file restore rebuilt byte for byte.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while True:
            piece = fh.read(piece_bytes)
            if not piece:
                return h.hexdigest()
            h.update(piece)
            if on_bytes:
                on_bytes(len(piece))


def split(fp: str) -> tuple[str, str]:
    """``"blake3:ab.."`` -> ``("blake3", "ab..")``.

    Raises:
        FormatError: not ``<algorithm>:<hex>``.
    """
    alg, sep, hexd = fp.partition(":") if isinstance(fp, str) else ("", "", "")
    if not sep or not hexd:
        raise FormatError(f"malformed fingerprint {fp!r}")
    return alg, hexd


def digest_like(data, expected: str) -> str:
    """Fingerprint ``data`` with the algorithm ``expected`` names (``sha256`` or ``blake3``)."""
    return digest(data, split(expected)[0])


def raw_fp(rec: dict) -> str | None:
    """A member's, entry's or tensor's raw fingerprint as ``"<alg>:<hex>"`` (format 1: ``sha256:``)."""
    if "raw_fp" in rec:
        return rec["raw_fp"]
    sha = rec.get("raw_sha256")
    return f"{SHA256}:{sha}" if sha else None


def stored_fp(rec: dict) -> str:
    """A member's stored fingerprint (format 2: derived ``sha256-chunks:``; format 1: ``sha256:`` of the file)."""
    return rec["stored_fp"] if "stored_fp" in rec else f"{SHA256}:{rec['stored_sha256']}"


def sha256_chunks(chunk_sha256s: Iterable[str]) -> str:
    """The derived stored fingerprint of a member from its chunks' sha256 hex digests, in order."""
    h = hashlib.sha256()
    for c in chunk_sha256s:
        h.update(bytes.fromhex(c))
    return f"{SHA256_CHUNKS}:{h.hexdigest()}"


def blake3_entries(header_fp: str, entry_fps: Iterable[str]) -> str:
    """The derived raw fingerprint of a tensors member: from ``blake3:`` fingerprints of its header
    and of every entry in data order."""
    h = new(BLAKE3)
    for fp in (header_fp, *entry_fps):
        alg, hexd = split(fp)
        if alg != BLAKE3:
            raise FormatError(f"a derived blake3-entries fingerprint needs blake3 parts, got {alg}")
        h.update(bytes.fromhex(hexd))
    return f"{BLAKE3_ENTRIES}:{h.hexdigest()}"


def entries_in_order(rec: dict) -> list[tuple[str, dict]]:
    """A tensors member's entries sorted by data offset, checked to tile its data exactly.

    Raises:
        FormatError: a gap or overlap between entries, or entries that do not end at the member's end.
    """
    order = sorted((rec.get("entries") or {}).items(), key=lambda kv: kv[1]["data_offsets"][0])
    pos = 0
    for key, e in order:
        start, end = e["data_offsets"]
        if start != pos or end < start:
            raise FormatError(f"entries do not tile the shard's data at entry {key!r} ({start}..{end}, expected "
                              f"start {pos})", where=rec.get("path"))
        pos = end
    if rec.get("header_bytes", 0) + pos != rec["raw_bytes"]:
        raise FormatError(f"header ({rec.get('header_bytes')}) plus entries ({pos}) is not the member's "
                          f"{rec['raw_bytes']} raw bytes", where=rec.get("path"))
    return order


def derived_member_raw_fp(rec: dict, header_fp: str) -> str:
    """Recompute a format-2 tensors member's ``blake3-entries:`` fingerprint from its entry records."""
    return blake3_entries(header_fp, [e["raw_fp"] for _, e in entries_in_order(rec)])


class MemberRawCheck:
    """Fingerprint a member's raw bytes as its decoded chunks stream by, in order, once.

    A member with a whole fingerprint (``sha256:``/``blake3:``) is hashed whole. A format-2 tensors
    member (``blake3-entries:``) is hashed range by range -- its header and each entry -- so one pass
    gives every entry's fingerprint (:meth:`bad_entries` names those that differ) and the member's
    derived one. Feed with :meth:`update` (any piece sizes, in order); then :meth:`problem`.
    """

    def __init__(self, rec: dict):
        self.rec = rec
        self.expected = raw_fp(rec)
        alg, _ = split(self.expected)
        self.alg = alg
        self.total = 0
        self.ranges: list[tuple[int, int, str | None]] = []
        if alg == BLAKE3_ENTRIES:
            base = rec.get("header_bytes", 0)
            self.ranges.append((0, base, None))
            for key, e in entries_in_order(rec):
                start, end = e["data_offsets"]
                self.ranges.append((base + start, base + end, key))
            self._ri = 0
            self._h = new(BLAKE3)
            self.got: list[str] = []
        else:
            self._h = new(alg)

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        if self.alg != BLAKE3_ENTRIES:
            self._h.update(mv)
            self.total += len(mv)
            return
        pos = self.total
        self.total += len(mv)
        while len(mv):
            self._close_finished(pos)
            if self._ri >= len(self.ranges):
                return  # longer than the entries: problem() reports the size
            end = self.ranges[self._ri][1]
            take = min(len(mv), end - pos)
            self._h.update(mv[:take])
            mv, pos = mv[take:], pos + take
        self._close_finished(pos)

    def skip(self, nbytes: int, fp: str) -> bool:
        """Account for one entry's ``nbytes`` raw bytes without feeding them: their fingerprint is ``fp``,
        proven otherwise (a shared object whose stored bytes were hashed now, under a chunk table a trial
        reload proved decodes to ``fp``; docs/FORMAT.md, "Write order", step 5).

        Returns:
            False (nothing recorded) unless this is a format-2 tensors member and the next bytes are exactly
            one whole entry of ``nbytes``: the caller must then feed the bytes instead.
        """
        if self.alg != BLAKE3_ENTRIES or nbytes <= 0:
            return False
        pos = self.total
        self._close_finished(pos)
        if self._ri >= len(self.ranges) or self.ranges[self._ri][:2] != (pos, pos + nbytes):
            return False
        self.got.append(fp)
        self._h = new(BLAKE3)
        self._ri += 1
        self.total += nbytes
        return True

    def _close_finished(self, pos: int) -> None:
        while self._ri < len(self.ranges) and self.ranges[self._ri][1] <= pos:
            self.got.append(f"{BLAKE3}:{self._h.hexdigest()}")
            self._h = new(BLAKE3)
            self._ri += 1

    def bad_entries(self) -> list[tuple[str, str, str]]:
        """``[(entry key, expected, got)]`` for each entry whose fingerprint differs (format 2 tensors)."""
        if self.alg != BLAKE3_ENTRIES:
            return []
        out = []
        for (_, _, key), got in zip(self.ranges[1:], self.got[1:]):
            want = self.rec["entries"][key]["raw_fp"]
            if got != want:
                out.append((key, want, got))
        return out

    def result(self) -> str:
        """The fingerprint of what was fed (derived for a tensors member)."""
        if self.alg != BLAKE3_ENTRIES:
            return f"{self.alg}:{self._h.hexdigest()}"
        if len(self.got) != len(self.ranges):
            return f"{BLAKE3_ENTRIES}:(incomplete)"
        return blake3_entries(self.got[0], self.got[1:])

    def problem(self) -> str | None:
        """None when the bytes fed are the member's raw bytes, else what differs (one line)."""
        if self.total != self.rec["raw_bytes"]:
            return f"raw size {self.total} != manifest {self.rec['raw_bytes']}"
        bad = self.bad_entries()
        if bad:
            key, want, got = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            return f"raw fingerprint mismatch in entry {key}: expected {want}, got {got}{more}"
        got = self.result()
        if got != self.expected:
            if self.alg == SHA256:  # format 1's wording (callers and tests key on it)
                return f"raw sha256 mismatch: expected {split(self.expected)[1]}, got {split(got)[1]}"
            return f"raw fingerprint mismatch: expected {self.expected}, got {got}"
        return None
