"""Exact bytes of decomposed source files: a skeleton member plus the tensor entries already stored.

A ``torch.save`` zip stores every storage as an uncompressed record (``archive/data/<key>``); a
``.safetensors`` file stores every tensor's bytes verbatim after its header. Those byte ranges are
the very bytes the tensors shards hold. So a source file is kept exactly, at the cost of its
non-tensor bytes only, as:

* a **skeleton** member (``exact/<relpath>``): the file with every range that equals a stored tensor
  entry cut out (pickle, ``version``, ``byteorder``, ``.data/serialization_id``, zip headers,
  alignment padding and central directory, or the safetensors header -- whatever the writer put
  there, byte for byte);
* a **segment list** in the manifest (``source.files[].exact``): ``[file offset, length, entry key]``
  for every cut, in file order.

Restore writes the skeleton pieces and the entries back at their offsets and checks the sha256 of
the whole rebuilt file against ``source.files[].sha256``: a rebuilt file that differs is refused,
never written as the result. Ranges are matched to entries by length and raw fingerprint, so a range this
module misplaces is simply not cut (it stays in the skeleton); a file with no recognisable ranges
(a legacy, non-zip ``torch.save`` file) is kept whole in its skeleton. Exact bytes are therefore
always had, at worst at the cost of storing the file twice (``exact.cut_bytes`` says how much of it
the entries cover).
"""
from __future__ import annotations

import hashlib
import os
import struct
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from ckpt_archive.format import fingerprint, jsonio
from ckpt_archive.format.ordered_writes import InOrderSha256, ParallelWrites, pwrite_all  # noqa: F401 (re-exported)
from ckpt_archive.errors import IntegrityError

try:  # ISA-L's CRC-32 (python-isal): ~5x zlib's here; the same checksum (zlib.crc32's signature)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without an isal wheel
    from zlib import crc32

#: What reading a damaged or unsupported zip raises: bad structure, I/O, a short read, a bad header field
#: (struct.error), an encrypted record (RuntimeError), an unknown compression method (NotImplementedError),
#: bad sizes (ValueError), a record marked deflated that does not inflate (zlib.error).
ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, struct.error, RuntimeError, NotImplementedError, ValueError,
              zlib.error)

READ_BYTES = 8 << 20
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_MAGIC = 0x04034B50


def candidate_ranges(path: Path, kind: str) -> list[tuple[int, int]]:
    """Byte ranges of ``path`` that may equal a stored tensor entry: ``[(offset, length)]``, sorted.

    Args:
        path: the source file.
        kind: ``"torch"`` (zip records ``*/data/<key>`` stored uncompressed) or ``"safetensors"``.

    Returns:
        non-overlapping ranges; empty when none are recognised (legacy torch files, anything else).
    """
    try:
        if kind == "safetensors":
            return _safetensors_ranges(path)
        if kind == "torch" and zipfile.is_zipfile(path):
            return _disjoint([(start, length) for start, length, _, name, stored in zip_records(path)
                              if stored and length and _is_tensor_record(name)])
    except ZIP_ERRORS:
        return []
    return []


def _is_tensor_record(name: str) -> bool:
    parts = name.split("/")
    return len(parts) >= 3 and parts[-2] == "data"


def zip_records(path: Path) -> list[tuple[int, int, int, str, bool]]:
    """Every record of a zip file: ``(data offset, stored length, CRC-32 from the central directory, name,
    stored uncompressed)``, in central-directory order; the data offset comes from the record's own local
    header (its extra field may differ from the central directory's).

    Raises:
        zipfile.BadZipFile / OSError / struct.error: the structure cannot be read.
    """
    out = []
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        size = os.fstat(fh.fileno()).st_size
        for info in zf.infolist():
            if not 0 <= info.header_offset < size:
                raise zipfile.BadZipFile(f"record {info.filename}: its local header offset {info.header_offset} "
                                         f"lies outside the file ({size} bytes)")
            fh.seek(info.header_offset)
            head = fh.read(_LOCAL_HEADER.size)
            if len(head) != _LOCAL_HEADER.size:
                raise zipfile.BadZipFile(f"record {info.filename}: local header past the end of the file")
            fields = _LOCAL_HEADER.unpack(head)
            if fields[0] != _LOCAL_MAGIC:
                raise zipfile.BadZipFile(f"record {info.filename}: bad local header")
            start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            out.append((start, info.compress_size, info.CRC, info.filename,
                        info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1))
    return out


def _safetensors_ranges(path: Path) -> list[tuple[int, int]]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > min(size, 100 << 20):
            return []
        try:  # the one strict JSON reader (a source is hostile until checked)
            header = jsonio.loads(fh.read(n), where=str(path), max_bytes=100 << 20)
        except ValueError:
            return []
    base = 8 + n
    out = []
    for key, rec in (header.items() if isinstance(header, dict) else ()):
        if key == "__metadata__" or not isinstance(rec, dict):
            continue
        offsets = rec.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2):
            continue
        start, end = offsets
        if isinstance(start, int) and isinstance(end, int) and end > start:
            out.append((base + start, end - start))
    return _disjoint(out)


def _disjoint(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, length in sorted(ranges):
        if out and start < out[-1][0] + out[-1][1]:
            continue  # overlapping ranges (a malformed file): keep the first, the rest stays in the skeleton
        out.append((start, length))
    return out


def file_identity(path: Path) -> tuple | None:
    """What says two paths name the same, unchanged file: ``(device, inode, size, mtime ns, ctime ns)``
    (the ctime moves on every write even when a tool puts the mtime back, as ``rsync --inplace -t``
    does); None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def early_scan(path: Any, pool: ThreadPoolExecutor) -> "ScanJob | None":
    """[issue 14] Start the reads pack needs of a source *file* before it is parsed: a zip-format
    ``torch.save`` file (kind ``"torch"``, zip records' CRC-32 checked in the same read) or a
    ``.safetensors`` file; None for anything else (folders, legacy pickles), read later as before."""
    try:
        p = Path(path)
        if not p.is_file():
            return None
        if zipfile.is_zipfile(p):
            return ScanJob(p, "torch", fingerprint.BLAKE3, check_crc=True, pool=pool)
        if p.suffix == ".safetensors":
            return ScanJob(p, "safetensors", fingerprint.BLAKE3, pool=pool)
    except OSError:
        return None
    return None


class ScanJob:
    """[issue 14] The one read of a source file that pack needs, started as early as possible on ``pool``:
    the whole file's sha256, every candidate range's fingerprint and (``check_crc``) every zip record's
    CRC-32, all three taken from each 1 MiB piece while it is in the CPU cache (0.8-0.9 ns/B here with the
    read, against 1.1 ns/B for the same hashes in separate reads: sha256 alone runs at 0.5 ns/B from cache
    and 0.85 ns/B from memory). The hashes release the GIL, so the read overlaps ``import torch`` and ``torch.load``.

    Args:
        path: the source file. kind: ``"torch"`` or ``"safetensors"`` (:func:`candidate_ranges`).
        alg: the range fingerprints' algorithm (``"blake3"``).
        check_crc: also check the CRC-32 of every record of a zip-format ``torch.save`` file, as
            :func:`ckpt_archive.sources.torchfile.check_zip_records` does (``torch.load`` does not check
            them: one flipped byte in a tensor record loads silently as a changed value).
        pool: the executor to read on.

    Methods :meth:`checked` and :meth:`result` raise what the reads raised: ``SourceError`` (exit 2) for a
    record that fails its CRC or a damaged zip structure, ``OSError`` for a file that cannot be read.
    """

    def __init__(self, path: Path, kind: str, alg: str = "blake3", *, check_crc: bool = False,
                 pool: ThreadPoolExecutor):
        self.path = Path(path)
        self.kind = kind
        #: the file as it was when the read started (:func:`file_identity`)
        self.identity = file_identity(self.path)
        self.crc_checked = check_crc
        self.progress = [0]  # bytes read so far (the read updates it)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int], Any] = {}  # (offset, length) -> fingerprint or a waiting Future
        self._read = pool.submit(_scan, self.path, kind, alg, check_crc, self._stop, self.progress, self._found)
        self._read.add_done_callback(self._ended)

    def range_fp(self, offset: int, length: int):
        """[issue 29] A Future of the fingerprint of the candidate range ``(offset, length)``, set the moment
        the read has passed it (so a tensor entry equal to that range is not hashed a second time), or of
        None when the read ends without such a range; it raises what the read raised."""
        from concurrent.futures import Future

        with self._lock:
            got = self._ranges.get((offset, length), _MISSING)
            if isinstance(got, Future):
                return got
            fut: Future = Future()
            if got is not _MISSING:
                fut.set_result(got)
            elif self._read.done():  # the read ended: the range was not one of its candidates, or it failed
                exc = ScanCancelled(str(self.path)) if self._read.cancelled() else self._read.exception()
                fut.set_exception(exc) if exc is not None else fut.set_result(None)
            else:
                self._ranges[(offset, length)] = fut
            return fut

    def _found(self, offset: int, length: int, fp: str) -> None:
        from concurrent.futures import Future

        with self._lock:
            waiting = self._ranges.get((offset, length))
            self._ranges[(offset, length)] = fp
        if isinstance(waiting, Future):
            waiting.set_result(fp)

    def _ended(self, read) -> None:
        from concurrent.futures import Future

        exc = None if read.cancelled() else read.exception()
        with self._lock:
            waiting = [(k, f) for k, f in self._ranges.items() if isinstance(f, Future)]
            for k, _ in waiting:
                self._ranges[k] = None
        for _, f in waiting:
            if exc is not None or read.cancelled():
                f.set_exception(exc if exc is not None else ScanCancelled(str(self.path)))
            else:
                f.set_result(None)

    def checked(self) -> None:
        """Wait for the read: its CRC-32 verdict."""
        self._read.result()

    def result(self) -> tuple[list[tuple[int, int, str]], str]:
        """(``[(offset, length, "<alg>:<hex>")]`` per candidate range read whole, sha256 hex of the file)."""
        return self._read.result()

    def unchanged(self) -> bool:
        """Whether the path still names the file the read started on, unchanged (:func:`file_identity`):
        a file replaced or rewritten meanwhile would pair one version's tensors with another's bytes."""
        return file_identity(self.path) == self.identity

    def cancel(self) -> None:
        """Stop the read at its next piece (or before it starts) and wait for it: nothing is left reading
        the file, and a refusal of the input does not wait for a whole-file read."""
        self._stop.set()
        if not self._read.cancel():
            try:
                self._read.exception()
            except BaseException:  # noqa: BLE001 - only waiting here, the caller's error stands
                pass


_MISSING = object()


class ScanCancelled(Exception):
    """A :class:`ScanJob` stopped by :meth:`ScanJob.cancel`."""


#: Piece size of a source file's scan: small enough that sha256, the range fingerprints and CRC-32 all
#: read each piece from the CPU cache (L2 is 2-4 MiB on the machines measured).
SCAN_PIECE_BYTES = 1 << 20


def _scan(path: Path, kind: str, alg: str, check_crc: bool, stop: "threading.Event | None" = None,
          progress: list | None = None, found: Callable | None = None) -> tuple[list[tuple[int, int, str]], str]:
    """One sequential read of ``path``: the sha256 of the whole file, the fingerprint of every candidate
    range and, with ``check_crc``, the CRC-32 of every zip record (see :class:`ScanJob`). ``stop`` set:
    raise :class:`ScanCancelled` at the next piece; ``progress[0]``: bytes read so far; ``found(offset,
    length, fp)`` is told each range's fingerprint as soon as it is taken."""
    from ckpt_archive.errors import SourceError

    crc_records: list[tuple[int, int, int, str]] = []
    if check_crc and zipfile.is_zipfile(path):
        try:
            records = zip_records(path)
        except ZIP_ERRORS as exc:
            raise SourceError(f"damaged torch.save file: {exc}", where=str(path)) from None
        if not all(stored for *_, stored in records):
            # not what torch.save writes (it stores records uncompressed): zipfile checks those
            from ckpt_archive.sources.torchfile import check_zip_records

            check_zip_records(path)
        crc_records = sorted((start, length, crc, name) for start, length, crc, name, stored in records if stored)
    ranges = candidate_ranges(path, kind)
    out: list[tuple[int, int, str]] = []
    whole = hashlib.sha256()
    pos = 0
    state = {"ri": 0, "cur": None, "ci": 0, "crc": 0}
    # [issue 29] the whole file's sha256 (the slowest of the three, ~0.5 ns/B) runs on a thread of its own
    # over the same pieces, so the scan -- pack's critical path when the tensors are already stored (a
    # frozen base) -- takes the time of the slower hash, not of both; SCAN_BUFFERS pieces rotate
    # (read into again once their sha256 update is done: no fresh pages per piece)
    from concurrent.futures import ThreadPoolExecutor

    bufs = [bytearray(SCAN_PIECE_BYTES) for _ in range(SCAN_BUFFERS)]
    sha_done: list = [None] * SCAN_BUFFERS
    sha_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-scansha")
    i = 0
    try:
        with open(path, "rb", buffering=0) as fh:
            while True:
                if stop is not None and stop.is_set():
                    raise ScanCancelled(str(path))
                slot = i % SCAN_BUFFERS
                if sha_done[slot] is not None:
                    sha_done[slot].result()  # this buffer's bytes are hashed: it may be read into again
                n = fh.readinto(bufs[slot])
                if not n:
                    break
                i += 1
                if progress is not None:
                    progress[0] += n
                mv = memoryview(bufs[slot])[:n]
                sha_done[slot] = sha_pool.submit(whole.update, mv)
                pos = _scan_piece(mv, pos, ranges, crc_records, state, alg, out, found, path)
            for fut in sha_done:
                if fut is not None:
                    fut.result()
    finally:
        sha_pool.shutdown(wait=True)
    ci = state["ci"]
    if ci < len(crc_records):
        raise SourceError(f"damaged torch.save file: record {crc_records[ci][3]} runs past the end of the file "
                          f"(a truncated file); refused", where=str(path))
    return out, whole.hexdigest()  # a range past the end (the file shrank) gets no fingerprint


#: Pieces in flight between the scan's read and its sha256 thread.
SCAN_BUFFERS = 4


def _scan_piece(mv, pos: int, ranges, crc_records, state: dict, alg: str, out: list, found, path) -> int:
    """Feed one piece of :func:`_scan`'s read (at file offset ``pos``) to the range fingerprints and the
    records' CRC-32; ``state`` carries the range and record in progress. Returns the next offset."""
    from ckpt_archive.errors import SourceError

    ri, cur, ci, crc = state["ri"], state["cur"], state["ci"], state["crc"]
    end = pos + len(mv)
    # feed every candidate range that overlaps this piece (ranges are sorted and disjoint)
    while ri < len(ranges) and ranges[ri][0] < end:
        start, length = ranges[ri]
        if cur is None:
            cur = fingerprint.new(alg, threads=1)  # one core: the pieces are small
        lo, hi = max(start, pos), min(start + length, end)
        cur.update(mv[lo - pos:hi - pos])
        if start + length > end:
            break
        out.append((start, length, f"{alg}:{cur.hexdigest()}"))
        if found is not None:
            found(start, length, out[-1][2])
        cur, ri = None, ri + 1
    # and every zip record (sorted; records of a well-formed zip do not overlap)
    while ci < len(crc_records) and crc_records[ci][0] < end:
        start, length, want, name = crc_records[ci]
        lo, hi = max(start, pos), min(start + length, end)
        if hi > lo:
            crc = crc32(mv[lo - pos:hi - pos], crc)
        if start + length > end:
            break
        if crc != want:
            raise SourceError(f"damaged torch.save file: record {name} fails its CRC (a changed byte); "
                              f"refused", where=str(path))
        crc, ci = 0, ci + 1
    state.update(ri=ri, cur=cur, ci=ci, crc=crc)
    return end


def plan(scanned: list[tuple[int, int, str]], entries: dict[str, tuple[int, str]]) -> list[list]:
    """Which scanned ranges to cut: those equal (length and fingerprint) to a stored entry.

    Args:
        scanned: :func:`scan`'s ranges.
        entries: ``{raw fingerprint ("blake3:<hex>"): (raw bytes, entry key)}`` of the tensors shards written.

    Returns:
        segments ``[[offset, length, entry key], ...]`` in file order.
    """
    segments = []
    for start, length, fp in scanned:
        hit = entries.get(fp)
        if hit is not None and hit[0] == length:
            segments.append([start, length, hit[1]])
    return segments


def skeleton_pieces(path: Path, segments: list[list]) -> Iterator[tuple[bytes, str]]:
    """The file's bytes without the cut segments, in pieces (for a member writer: ``(bytes, "zstd")``)."""
    pos = 0
    with open(path, "rb") as fh:
        for start, length, _ in [*segments, [os.fstat(fh.fileno()).st_size, 0, None]]:
            fh.seek(pos)
            left = start - pos
            while left > 0:
                piece = fh.read(min(READ_BYTES, left))
                if not piece:
                    raise OSError(f"{path}: changed while being read")
                left -= len(piece)
                yield piece, "zstd"
            pos = start + length


def rebuild(target: Any, record: dict, skeleton: Iterator[bytes],
            entry_pieces: Callable[[set], Iterator[tuple[str, int, Any]]]) -> int:
    """Write the exact original file at ``target`` and check its sha256.

    Memory stays that of one decoded chunk whatever the tensors' sizes: the skeleton and every entry are
    written piece by piece at their offsets (``pwrite``), never assembled ([issue 29]: a 1 GiB file of two
    512 MiB tensors peaked at 1.1 GiB of anonymous memory).

    Args:
        target: the file to create, a name in a folder the file layer opened
            (:class:`ckpt_archive.store.fs.Entry`: ``create()`` makes it exclusively, ``O_NOFOLLOW``, and
            returns its descriptor; ``remove()``; ``path`` for reading it back). It must not exist.
        record: the ``source.files[]`` entry (``raw_bytes``, ``sha256``, ``exact`` {member, segments}).
        skeleton: the skeleton member's decoded bytes, in order (checked by the caller's reader).
        entry_pieces: given the wanted entry keys, yields ``(key, offset in the entry, piece)`` in entry
            order (:meth:`ckpt_archive.repo.reader.ArchiveReader.iter_entry_pieces`: checked by the reader,
            whose last verdict comes when it is exhausted).

    Returns:
        bytes written.

    Raises:
        IntegrityError: the segments do not tile the file, or the rebuilt file's sha256 differs from
            the source's (the target is removed).
    """
    segments = record["exact"]["segments"]
    size = int(record["raw_bytes"])
    by_key: dict[str, list[int]] = {}
    pos = 0
    for start, length, key in segments:
        if start < pos or length <= 0 or start + length > size:
            raise IntegrityError("exact-bytes segments overlap or leave the file", where=record["relpath"] or "file")
        by_key.setdefault(key, []).append((start, length))
        pos = start + length
    gaps = []
    pos = 0
    for start, length, _ in segments:
        gaps.append((pos, start - pos))
        pos = start + length
    gaps.append((pos, size - pos))
    fd = target.create()
    sha = InOrderSha256(fd, size)
    writes = ParallelWrites(fd, on_written=sha.wrote)
    try:
        os.ftruncate(fd, size)
        gi, written_in_gap = 0, 0
        for piece in skeleton:
            mv = memoryview(piece).cast("B")
            while len(mv):
                while gi < len(gaps) and written_in_gap == gaps[gi][1]:
                    gi, written_in_gap = gi + 1, 0
                if gi == len(gaps):
                    raise IntegrityError("skeleton is longer than the file it belongs to", where=record["relpath"])
                take = min(len(mv), gaps[gi][1] - written_in_gap)
                writes.write(mv[:take], gaps[gi][0] + written_in_gap)
                written_in_gap += take
                mv = mv[take:]
        while gi < len(gaps) and written_in_gap == gaps[gi][1]:
            gi, written_in_gap = gi + 1, 0
        if gi != len(gaps):
            raise IntegrityError("skeleton is shorter than the file it belongs to", where=record["relpath"])
        filled: dict[str, int] = {}  # entry key -> bytes written so far (pieces come in entry order)
        for key, offset, piece in entry_pieces(set(by_key)):
            mv = memoryview(piece).cast("B")
            if key not in by_key or offset != filled.get(key, 0):
                raise IntegrityError(f"entry {key}: a piece at offset {offset} out of order", where=record["relpath"])
            for start, length in by_key[key]:
                if offset + len(mv) > length:
                    raise IntegrityError(f"entry {key} has more than the segment's {length} bytes",
                                         where=record["relpath"])
                writes.write(mv, start + offset)
            filled[key] = offset + len(mv)
        short = [k for k, segs in by_key.items() if filled.get(k, 0) != segs[0][1]]
        if short:
            raise IntegrityError(f"entries missing or short for the exact bytes: {sorted(short)[:5]}",
                                 where=record["relpath"])
        writes.drain()
        got = sha.hexdigest()
        os.fsync(fd)
    except BaseException:
        writes.close()
        sha.close()
        os.close(fd)
        target.remove()
        raise
    writes.close()
    sha.close()
    os.close(fd)
    if got != record.get("sha256"):
        target.remove()
        raise IntegrityError(f"the rebuilt file's sha256 {got} differs from the source's {record.get('sha256')}: "
                             f"a stored chunk is damaged (`ckpt-archive verify --deep` names it); nothing was "
                             f"written", where=record["relpath"] or "file")
    return size


def exact_summary(manifest: dict) -> dict:
    """Per source file, whether restore gives back its exact bytes (for ``inspect`` and the recovery proof).

    Returns:
        ``{"all_exact": bool, "files": {relpath: how}}`` where ``how`` is ``"byte for byte"`` (raw/opaque
        members), ``"rebuilt exactly (N of M bytes from tensor entries)"``, ``"hardlink of X"``, or
        ``"not kept: re-serialised with torch.save / safetensors (equal content, not equal bytes)"``
        (generations packed before exact bytes were kept, and Python objects, which have no file).
    """
    files = {}
    exact = True
    for f in manifest["source"].get("files") or []:
        name = f["relpath"] or "(the file)"
        if f.get("hardlink_of"):
            files[name] = f"hardlink of {f['hardlink_of']}"
        elif f["kind"] in ("raw", "opaque"):
            files[name] = "byte for byte"
        elif f.get("exact"):
            files[name] = (f"rebuilt exactly ({f['exact'].get('cut_bytes', 0)} of {f.get('raw_bytes')} bytes from "
                           f"tensor entries, the rest from its skeleton member)")
        elif f.get("sha256") is None and manifest["source"].get("format") == "python-object":
            files[name] = "a Python object (no source file): restored with torch.save"
        else:
            exact = False
            files[name] = "not kept: re-serialised on restore (equal content, not equal bytes)"
    return {"all_exact": exact, "files": files}


def exact_note(manifest: dict) -> str:
    """One line for the recovery proof: whether every source file restores byte for byte, else which not."""
    exact = exact_summary(manifest)
    if exact["all_exact"]:
        return "yes, every file"
    not_exact = [name for name, how in exact["files"].items() if how.startswith("not kept")]
    return (f"NOT for {', '.join(not_exact[:5])}: re-serialised on restore (equal content, not equal bytes; "
            f"packed before exact bytes were kept)")


def exact_problems(manifest: dict) -> list[str]:
    """Consistency of every ``exact`` record: segments in order and inside the file, entries present with
    the segment's length, skeleton member present with the remaining length. Reads no member."""
    entries = {}
    for m in manifest["members"]:
        if m["role"] == "tensors":
            for key, e in (m.get("entries") or {}).items():
                entries[key] = e["data_offsets"][1] - e["data_offsets"][0]
    members = {m["path"]: m for m in manifest["members"]}
    problems = []
    for f in manifest["source"].get("files") or []:
        ex = f.get("exact")
        if not ex:
            continue
        name = f["relpath"] or "file"
        pos = cut = 0
        for seg in ex.get("segments") or []:
            if not (isinstance(seg, list) and len(seg) == 3):
                problems.append(f"{name}: malformed exact-bytes segment {seg!r}")
                break
            start, length, key = seg
            if start < pos or length <= 0 or entries.get(key) != length:
                problems.append(f"{name}: exact-bytes segment at {start} ({length} bytes, entry {key!r}) does not "
                                f"fit the file or its entry")
                break
            pos, cut = start + length, cut + length
        skel = members.get(ex.get("member"))
        if skel is None:
            problems.append(f"{name}: skeleton member {ex.get('member')!r} is missing from the manifest")
        elif f.get("raw_bytes") is not None and skel["raw_bytes"] + cut != f["raw_bytes"]:
            problems.append(f"{name}: skeleton ({skel['raw_bytes']} bytes) plus segments ({cut}) is not the "
                            f"file's {f['raw_bytes']} bytes")
    return problems
