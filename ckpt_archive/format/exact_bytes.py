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
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

from ckpt_archive.format import fingerprint, jsonio
from ckpt_archive.errors import IntegrityError

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
            return _zip_ranges(path)
    except (OSError, ValueError, zipfile.BadZipFile, struct.error):
        return []
    return []


def _zip_ranges(path: Path) -> list[tuple[int, int]]:
    out = []
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if len(parts) < 3 or parts[-2] != "data" or info.compress_type != zipfile.ZIP_STORED \
                    or info.file_size == 0:
                continue
            fh.seek(info.header_offset)
            head = fh.read(_LOCAL_HEADER.size)
            if len(head) != _LOCAL_HEADER.size:
                continue
            fields = _LOCAL_HEADER.unpack(head)
            if fields[0] != _LOCAL_MAGIC:
                continue
            start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            out.append((start, info.file_size))
    return _disjoint(out)


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


def scan(path: Path, kind: str, alg: str = "blake3") -> tuple[list[tuple[int, int, str]], str]:
    """One sequential read of ``path``: the fingerprint (``alg``) of every candidate range and the sha256 of
    the whole file. Needs no stored entries, so it can run while the tensors are being written.

    Returns:
        (``[(offset, length, "<alg>:<hex>")]`` for each candidate range read whole, sha256 hex of the file).
    """

    ranges = candidate_ranges(path, kind)
    whole = hashlib.sha256()
    out: list[tuple[int, int, str]] = []
    ri, cur, pos = 0, None, 0
    with open(path, "rb") as fh:
        while True:
            piece = fh.read(READ_BYTES)
            if not piece:
                break
            whole.update(piece)
            mv = memoryview(piece)
            end = pos + len(mv)
            # feed every candidate range that overlaps this piece (ranges are sorted and disjoint)
            while ri < len(ranges) and ranges[ri][0] < end:
                start, length = ranges[ri]
                if cur is None:
                    cur = fingerprint.new(alg)
                lo, hi = max(start, pos), min(start + length, end)
                cur.update(mv[lo - pos:hi - pos])
                if start + length > end:
                    break
                out.append((start, length, f"{alg}:{cur.hexdigest()}"))
                cur, ri = None, ri + 1
            pos = end
    return out, whole.hexdigest()  # a range past the end (the file shrank) gets no fingerprint


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


def rebuild(target: Path, record: dict, skeleton: Iterator[bytes], entry_bytes: Callable[[set], Iterator[tuple[str, Any]]]
            ) -> int:
    """Write the exact original file at ``target`` and check its sha256.

    Args:
        target: the file to create (must not exist).
        record: the ``source.files[]`` entry (``raw_bytes``, ``sha256``, ``exact`` {member, segments}).
        skeleton: the skeleton member's decoded bytes, in order (checked by the caller's reader).
        entry_bytes: given the wanted entry keys, yields ``(key, raw bytes)`` (checked by the reader).

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
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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
                os.pwrite(fd, mv[:take], gaps[gi][0] + written_in_gap)
                written_in_gap += take
                mv = mv[take:]
        while gi < len(gaps) and written_in_gap == gaps[gi][1]:
            gi, written_in_gap = gi + 1, 0
        if gi != len(gaps):
            raise IntegrityError("skeleton is shorter than the file it belongs to", where=record["relpath"])
        seen = set()
        for key, data in entry_bytes(set(by_key)):
            mv = memoryview(data).cast("B")
            for start, length in by_key.get(key, ()):
                if len(mv) != length:
                    raise IntegrityError(f"entry {key} has {len(mv)} bytes, the segment {length}",
                                         where=record["relpath"])
                os.pwrite(fd, mv, start)
            seen.add(key)
        if seen != set(by_key):
            raise IntegrityError(f"entries missing for the exact bytes: {sorted(set(by_key) - seen)[:5]}",
                                 where=record["relpath"])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(target)
        raise
    os.close(fd)
    got = fingerprint.file_sha256(target, piece_bytes=READ_BYTES)
    if got != record.get("sha256"):
        os.unlink(target)
        raise IntegrityError(f"the rebuilt file's sha256 {got} differs from the source's {record.get('sha256')}",
                             where=record["relpath"] or "file")
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
