"""Sizes a manifest may declare, checked before anything is allocated (docs/FORMAT.md, "Reading hostile
archives").

A manifest is hostile until checked: a reader allocates by what is really there, never by what a
manifest says. So every size a reader will allocate or decode by is bounded here, from the manifest
alone, when the manifest is parsed (:func:`ckpt_archive.format.manifest.parse`):

* a chunk's raw size is at most :data:`MAX_CHUNK_RAW_BYTES` (the writer makes 4 MiB chunks; ``pack``
  refuses a larger ``chunk_bytes``), so decoding one chunk never allocates more than that;
* a ``store`` chunk's raw size equals its stored size; a zstandard chunk's raw size is at most
  :data:`MAX_ZSTD_RATIO` times its stored size (a zstd block of 128 KiB takes at least 4 stored bytes:
  nothing decodes to more);
* the chunk table tiles the member's raw and stored bytes exactly;
* a tensors member's header and every entry lie inside the member's raw bytes, and its header is at most
  :data:`MAX_MEMBER_HEADER_BYTES`; a chunk's stored size is at most :func:`stored_bound` of its raw size;
* a member every reader holds whole (the state tree, the data ids: :data:`WHOLE_READ_LIMITS`) declares at
  most its limit (:func:`check_whole_read`).

What passes these checks is still only *declared*: readers then decode chunk by chunk and compare every
size and sha256, and buffers that must hold a whole entry are allocated lazily
(:func:`lazy_buffer`, zero pages until written) after :func:`check_allocation` compared them with the
memory the machine has.

Everything a reader holds *whole* in memory has a limit of its own, checked from the declared numbers
before the first byte is read or decoded (:func:`check_whole_read`, :func:`read_bounded`), and again on
the bytes really read: the state tree (:data:`MAX_TREE_BYTES`), the data ids (:data:`MAX_DATA_IDS_BYTES`),
a tensors member's safetensors header (:data:`MAX_MEMBER_HEADER_BYTES`), ``manifest.json``
(:data:`MAX_MANIFEST_BYTES`), the marker, ``repository.json``, a failed-check note and ``backup-state.json``
(:data:`MAX_SMALL_DOC_BYTES`). A JSON document's parse is bounded too (``ckpt_archive.format.jsonio``'s
``max_cost``): Python objects cost up to ~25 times the bytes that spell them (``[[],[],...]``). Members
read as a stream (tensors, raw files, skeletons) hold at most :data:`IN_FLIGHT_RAW_BYTES` of decoded
chunks at once, whatever their chunk size and the number of cores.
"""
from __future__ import annotations

import os

from ckpt_archive.errors import ImplausibleSize, IntegrityError, TooLargeHere

__all__ = ["MAX_CHUNK_RAW_BYTES", "MAX_CHUNK_STORED_BYTES", "MAX_ZSTD_RATIO", "MAX_ANNOTATION_BYTES",
           "MAX_DATA_IDS_BYTES", "MAX_DATA_IDS_COST", "MAX_TREE_BYTES", "MAX_TREE_COST", "MAX_HEADER_BYTES", "MAX_HEADER_COST", "MAX_MEMBER_HEADER_BYTES", "WHOLE_READ_LIMITS",
           "MAX_MANIFEST_BYTES", "MAX_SOURCE_PICKLE_BYTES", "MAX_MANIFEST_COST", "MAX_SMALL_DOC_BYTES", "MAX_SMALL_DOC_COST", "IN_FLIGHT_RAW_BYTES",
           "stored_bound", "check_member_sizes", "check_manifest_sizes", "check_whole_read", "read_bounded",
           "memory_available", "check_allocation", "view_size_problem", "lazy_buffer", "frame_size_problem", "frame_header_problem",
           "FRAME_HEADER_MAX", "tree_read_problem"]

#: The largest raw size of one chunk a reader accepts (bytes). ``pack --chunk-bytes`` is bounded by it.
MAX_CHUNK_RAW_BYTES = 64 << 20
#: Largest ``--config`` / ``--metrics`` a manifest holds, as JSON (bytes): every ``list`` reads every
#: manifest, so these stay small. Large experiment records belong in the checkpoint folder itself.
MAX_ANNOTATION_BYTES = 1 << 20
#: Largest ``--data-ids`` (as JSON, bytes). Data ids are stored as a member (``data-ids.json``) with their
#: fingerprint in the manifest, so they may be larger, but they are read into memory once.
MAX_DATA_IDS_BYTES = 256 << 20
#: Largest estimated parse cost of the data ids (bytes of Python objects, ``jsonio.parse_cost``): pack refuses
#: ids a reader would refuse. 8 million integer ids (64 MB of JSON) estimate at 500 MiB.
MAX_DATA_IDS_COST = 512 << 20
#: No zstandard frame decodes to more than this many times its size (128 KiB RLE block in 4 bytes).
MAX_ZSTD_RATIO = 32768
#: The largest stored size of one chunk (bytes): a zstandard frame of :data:`MAX_CHUNK_RAW_BYTES` that does
#: not compress at all (:func:`stored_bound`). Every stored chunk is read whole before it is decoded.
MAX_CHUNK_STORED_BYTES = MAX_CHUNK_RAW_BYTES + (MAX_CHUNK_RAW_BYTES >> 7) + 1024

# -- what a reader holds whole in memory (each refused from the declared sizes before any read) -------------
#: Largest state tree a reader decodes (raw JSON bytes). Measured: the tree of a state of 100,000 tensors is
#: 11 MB (docs/FORMAT.md, "Reading hostile archives"; tests/test_hostile_sizes.py keeps the limits above it).
MAX_TREE_BYTES = 64 << 20
#: Largest estimated parse cost of a state tree (bytes of Python objects, ``jsonio.parse_cost``). The tree of
#: 100,000 tensors estimates at 75 MiB.
MAX_TREE_COST = 256 << 20
#: Largest safetensors header of a source file (bytes; the safetensors library's own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20
#: Largest estimated parse cost of a safetensors header (bytes of Python objects).
MAX_HEADER_COST = 256 << 20
#: Largest safetensors header of an archive's tensors member (bytes, length prefix included). The writer
#: makes ~100 bytes per entry: 32 MiB holds 300,000 entries, more than a manifest may list.
MAX_MEMBER_HEADER_BYTES = 32 << 20
#: [break] Largest ``data.pkl`` of a zip-format ``torch.save`` source (raw bytes, as its zip record declares it):
#: every reader holds it whole. A pickle of 100,000 tensors is ~10 MB.
MAX_SOURCE_PICKLE_BYTES = 256 << 20
#: Largest ``manifest.json`` (bytes). Measured: 100,000 tensors (one shard, indent 1) make a 57 MB manifest.
MAX_MANIFEST_BYTES = 128 << 20
#: Largest estimated parse cost of a manifest (bytes of Python objects). The 57 MB manifest of 100,000
#: tensors estimates at ~430 MiB (it really takes 160 MiB once parsed: repeated keys are shared): about
#: 120,000 tensors fit. A larger parse would break the 600 MB bound on a hostile repository.
MAX_MANIFEST_COST = 512 << 20
#: Largest marker (``USABLE.json``), ``repository.json``, failed-check note (``CHECK-FAILED.json``) and
#: ``backup-state.json`` (bytes). Each is a few KiB; a backup state lists one fingerprint per source file.
MAX_SMALL_DOC_BYTES = 16 << 20
#: Largest estimated parse cost of those documents (bytes of Python objects, ``jsonio.parse_cost``).
MAX_SMALL_DOC_COST = 256 << 20
#: Decoded chunks a streaming read keeps in flight at once (raw bytes, summed over the chunks submitted to
#: the decoders and not yet consumed or hashed). 32 default 4 MiB chunks: every core of a 16-core machine
#: stays busy, while 64 MiB chunks on that machine can no longer take 2 GiB.
IN_FLIGHT_RAW_BYTES = 128 << 20


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def tree_read_problem(raw: bytes) -> str | None:
    """Why a reader would refuse a state tree of these raw JSON bytes, or None when it reads it.

    The one rule for both sides: the reader (``ArchiveReader.tree``) reads at most :data:`MAX_TREE_BYTES`
    and parses within :data:`MAX_TREE_COST` (``jsonio.parse_cost``); pack applies this function to the tree
    it encoded *before* it claims a generation, so a tree no reader would read is refused (exit 2), never
    published and then found unreadable by the trial reload. Both read the limits from this module when
    called (tests patch them here).
    """
    from ckpt_archive.format.jsonio import parse_cost

    if len(raw) > MAX_TREE_BYTES:
        return f"its state tree would be {len(raw)} bytes of JSON, more than the {MAX_TREE_BYTES} a reader reads"
    cost = parse_cost(raw)
    if cost > MAX_TREE_COST:
        return (f"its state tree would be {len(raw)} bytes of JSON taking about {cost} bytes of memory to parse, "
                f"more than the {MAX_TREE_COST} a reader allows")
    return None


#: Members every reader holds whole, by role: their declared size is refused at parse above these (bytes).
WHOLE_READ_LIMITS = {"tree": MAX_TREE_BYTES, "data-ids": MAX_DATA_IDS_BYTES}


def stored_bound(raw_bytes: int) -> int:
    """The most stored bytes a chunk (or a member) of ``raw_bytes`` raw bytes can take: zstandard's own
    worst case (``ZSTD_compressBound``: raw + raw/256 + a frame header) with room to spare; the writer
    stores a chunk raw as soon as compression saves under 1 %, so real chunks stay below ``raw_bytes``.

    Example:
        >>> stored_bound(4 << 20) - (4 << 20)
        33792
    """
    return raw_bytes + (raw_bytes >> 7) + 1024


def check_chunk_table(record: dict, member: str) -> None:
    """Check that a member's chunks tile its raw and stored bytes exactly (no gap, no overlap).

    This is the one place where a chunk table's sizes are checked. With it, every chunk passing its
    stored sha256 implies the member's stored fingerprint: format 2 derives it from the chunks'
    digests (checked here), format 1's whole-file sha256 covers the same bytes in the same order.

    Raises:
        IntegrityError: the chunk table is inconsistent (names the member and the chunk).
    """
    raw = stored = 0
    for i, c in enumerate(record.get("chunks") or []):
        if c["raw_offset"] != raw or c["stored_offset"] != stored or c["raw_bytes"] < 0 or c["stored_bytes"] < 0:
            raise IntegrityError(f"chunk table inconsistent at chunk {i}: offsets raw {c['raw_offset']} / stored "
                                 f"{c['stored_offset']}, expected {raw} / {stored}", where=member)
        raw += c["raw_bytes"]
        stored += c["stored_bytes"]
    if raw != record["raw_bytes"] or stored != record["stored_bytes"]:
        raise IntegrityError(f"chunk table covers {raw} raw / {stored} stored bytes, member records "
                             f"{record['raw_bytes']} / {record['stored_bytes']}", where=member)
    if "stored_fp" in record:  # format 2: the member's stored fingerprint is derived from the chunks'
        from ckpt_archive.format import fingerprint  # here: the CLI's start-up imports limits, not hashing

        got = fingerprint.sha256_chunks(c["stored_sha256"] for c in record.get("chunks") or [])
        if got != record["stored_fp"]:
            raise IntegrityError(f"stored fingerprint {record['stored_fp']} is not the one its chunk table "
                                 f"derives ({got})", where=member)


def check_member_sizes(rec: dict, member: str) -> None:
    """Refuse a member record whose sizes cannot be true (see the module docstring).

    Args:
        rec: one ``members[]`` record of a schema-valid manifest.
        member: its path, named in the error.

    Raises:
        ImplausibleSize: (exit 1) naming the member and the chunk.
    """
    chunks = rec.get("chunks") or []
    for i, c in enumerate(chunks):
        _check_chunk(i, c, member)
    if chunks or rec.get("raw_bytes") or rec.get("stored_bytes"):
        try:
            check_chunk_table(rec, member)
        except IntegrityError as exc:
            raise ImplausibleSize(exc.message, where=member) from None
    if rec.get("role") == "tensors":
        _check_tensors_layout(rec, member)
    whole = WHOLE_READ_LIMITS.get(rec.get("role"))
    if whole is not None:  # held whole by every reader: a larger one is damaged for all of them, here already
        check_whole_read(rec, member, whole)
    _check_objects(rec, member)


def _check_chunk(i: int, c: dict, member: str) -> None:
    """Refuse chunk ``i`` of a member unless its sizes and offsets are non-negative integers, its raw size is
    at most :data:`MAX_CHUNK_RAW_BYTES` and its raw and stored sizes fit its codec (see the module docstring).

    Raises:
        ImplausibleSize: naming the member and the chunk.
    """
    raw, stored, codec = c.get("raw_bytes"), c.get("stored_bytes"), c.get("codec")
    if not (_int(raw) and _int(stored) and _int(c.get("raw_offset")) and _int(c.get("stored_offset"))):
        raise ImplausibleSize(f"chunk {i} has a size or offset that is not a non-negative integer", where=member)
    if raw > MAX_CHUNK_RAW_BYTES:
        raise ImplausibleSize(f"chunk {i} declares {raw} raw bytes; no chunk is larger than "
                              f"{MAX_CHUNK_RAW_BYTES} (refused before decoding)", where=member)
    if codec == "store" and raw != stored:
        raise ImplausibleSize(f"chunk {i} is stored raw but declares {raw} raw bytes for {stored} stored",
                              where=member)
    if codec != "store" and raw > max(stored, 1) * MAX_ZSTD_RATIO:
        raise ImplausibleSize(f"chunk {i} declares {raw} raw bytes from {stored} stored bytes, more than any "
                              f"zstandard frame decodes to", where=member)
    if stored > stored_bound(raw):
        raise ImplausibleSize(f"chunk {i} declares {stored} stored bytes for {raw} raw bytes; no chunk is "
                              f"stored in more than {stored_bound(raw)} (refused before reading it)",
                              where=member)


def _check_tensors_layout(rec: dict, member: str) -> None:
    """Refuse a tensors member whose safetensors header is larger than the member or than
    :data:`MAX_MEMBER_HEADER_BYTES`, or an entry whose data lies outside the member's raw bytes.

    Raises:
        ImplausibleSize: naming the member (and the entry).
    """
    total = rec.get("raw_bytes", 0)
    base = rec.get("header_bytes", 0)
    if not _int(base) or base > total:
        raise ImplausibleSize(f"safetensors header of {base} bytes in a member of {total} raw bytes", where=member)
    if base > MAX_MEMBER_HEADER_BYTES:  # the header is held whole to be parsed
        raise ImplausibleSize(f"declares a safetensors header of {base} bytes; the limit is "
                              f"{MAX_MEMBER_HEADER_BYTES} (refused before reading it)", where=member)
    for key, e in (rec.get("entries") or {}).items():
        off = e.get("data_offsets") if isinstance(e, dict) else None
        if not (isinstance(off, list) and len(off) == 2 and all(_int(x) for x in off)
                and off[0] <= off[1] and base + off[1] <= total):
            raise ImplausibleSize(f"entry {key!r} has data_offsets {off!r} outside the member's {total} raw "
                                  f"bytes", where=member)


def _check_objects(rec: dict, member: str) -> None:
    """Format 3: the shared-object ranges of a member must fit its chunk table and entries
    (:func:`ckpt_archive.format.objects.check_objects`)."""
    if not rec.get("objects"):
        return
    from ckpt_archive.format.objects import check_objects

    try:
        check_objects(rec, member)
    except IntegrityError as exc:
        raise ImplausibleSize(exc.message, where=exc.where or member) from None
    except (KeyError, TypeError):
        raise ImplausibleSize("objects table does not fit its member's chunks and entries", where=member) from None


def check_manifest_sizes(doc: dict, *, where: str = "manifest.json") -> None:
    """:func:`check_member_sizes` for every member of a manifest.

    Raises:
        ImplausibleSize: (exit 1) naming the member.
    """
    for rec in doc.get("members") or []:
        if isinstance(rec, dict):
            check_member_sizes(rec, str(rec.get("path")))
    src = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    for f in src.get("files") or []:
        exact = f.get("exact") if isinstance(f, dict) else None
        if exact is not None and not _exact_record_ok(f, exact):
            raise ImplausibleSize("exact.segments must be [offset, length, entry key] with non-negative sizes",
                                  where=f"{where}: source.files {f.get('relpath')!r}")


def _exact_record_ok(f: dict, exact) -> bool:
    """Whether a source file's ``exact`` record (how its bytes are rebuilt) is well formed: segments
    ``[offset, length, entry key]`` with non-negative sizes, a non-negative ``cut_bytes``, the file's raw
    size, its sha256 and the member it is rebuilt from."""
    segs = exact.get("segments") if isinstance(exact, dict) else None
    return isinstance(segs, list) and all(
        isinstance(sg, list) and len(sg) == 3 and _int(sg[0]) and _int(sg[1]) and isinstance(sg[2], str)
        for sg in segs) and _int(exact.get("cut_bytes", 0)) and _int(f.get("raw_bytes")) \
        and isinstance(f.get("sha256"), str) and isinstance(exact.get("member"), str)


def check_whole_read(rec: dict, member: str, limit: int) -> None:
    """Refuse, from its manifest record alone, a member that would be held whole in memory and is larger
    than ``limit``: its declared raw bytes, its stored bytes (at most :func:`stored_bound` of the limit), and
    every chunk's (the chunk table tiles the member, :func:`check_member_sizes`; checked again here so the
    bound does not rest on that).

    Args:
        rec: the member's manifest record. member: its path, named in the error.
        limit: the most raw bytes the caller will hold (e.g. :data:`MAX_TREE_BYTES`).

    Raises:
        ImplausibleSize: (exit 1) naming the member, its declared size and the limit.
    """
    raw, stored = rec.get("raw_bytes"), rec.get("stored_bytes")
    chunks = rec.get("chunks") or []
    if not (_int(raw) and _int(stored)):
        raise ImplausibleSize("declares a size that is not a non-negative integer", where=member)
    if raw > limit:
        raise ImplausibleSize(f"declares {raw} raw bytes; a reader holds at most {limit} of it "
                              f"(refused before reading it)", where=member)
    if stored > stored_bound(limit):
        raise ImplausibleSize(f"declares {stored} stored bytes; at most {stored_bound(limit)} for the "
                              f"{limit} raw bytes a reader holds of it (refused before reading it)", where=member)
    total_raw = sum(c.get("raw_bytes") if _int(c.get("raw_bytes")) else limit + 1 for c in chunks)
    total_stored = sum(c.get("stored_bytes") if _int(c.get("stored_bytes")) else stored_bound(limit) + 1
                       for c in chunks)
    if total_raw > limit or total_stored > stored_bound(limit):
        raise ImplausibleSize(f"its {len(chunks)} chunks declare {total_raw} raw / {total_stored} stored bytes; a "
                              f"reader holds at most {limit} raw bytes of it (refused before reading it)",
                              where=member)


def read_bounded(fh, limit: int, *, where: str) -> bytes:
    """Read a whole file that is held in memory (a manifest, a marker, ``repository.json``) -- at most
    ``limit + 1`` bytes: a larger file is refused without reading the rest (its size, when the file can
    say, before reading anything).

    Args:
        fh: the file, opened for reading (binary).
        limit: the most bytes accepted (e.g. :data:`MAX_MANIFEST_BYTES`).
        where: the file, named in the error.

    Returns:
        the file's bytes (at most ``limit``).

    Raises:
        ImplausibleSize: (exit 1) the file is larger than ``limit``; names the file and the limit.
    """
    import stat

    size = None
    try:
        st = os.fstat(fh.fileno())
        size = st.st_size if stat.S_ISREG(st.st_mode) else None
    except Exception:  # noqa: BLE001 - no descriptor (a remote store's file): read and count instead
        pass
    if size is not None and size > limit:
        raise ImplausibleSize(f"{size} bytes, more than the {limit} a reader accepts here (not read)", where=where)
    data = fh.read(limit + 1)
    data = b"" if data is None else bytes(data)
    if len(data) > limit:
        raise ImplausibleSize(f"more than the {limit} bytes a reader accepts here (not read further)", where=where)
    return data


def memory_available() -> int | None:
    """Bytes of memory this process could still get (``MemAvailable`` plus free swap on Linux), or None."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            info = {line.split(b":")[0]: int(line.split()[1]) * 1024 for line in fh if line.strip()}
        return info.get(b"MemAvailable", 0) + info.get(b"SwapFree", 0) or None
    except (OSError, ValueError, IndexError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def check_allocation(nbytes: int, member: str) -> None:
    """Refuse to allocate more than the machine has for a buffer a manifest declared.

    Raises:
        TooLargeHere: (an ImplausibleSize, exit 1) ``nbytes`` exceeds the memory available; names the member.
    """
    avail = memory_available()
    if avail is not None and nbytes > avail:
        raise TooLargeHere(f"declares a buffer of {nbytes} bytes, more than the {avail} bytes of memory "
                              f"available (restore spills large members to disk)", where=member)


def view_size_problem(logical: int, stored: int) -> str | None:
    """[break] Why a tensor view of ``logical`` bytes over a storage of ``stored`` bytes is refused, or None.

    Only a stride of 0 makes a view's logical bytes exceed its storage's, by any factor: a 600-byte
    ``torch.save`` file (or a resealed manifest) may declare a view of 2**62 elements. Its bytes are hashed
    piece by piece (:func:`ckpt_archive.format.fingerprint.view_pieces`), so memory stays bounded; this
    bounds the time: a view larger than its storage and than the memory this machine has is refused.
    """
    avail = memory_available()
    if logical > stored and avail is not None and logical > avail:
        return (f"a view of {logical} logical bytes over a storage of {stored} bytes, more than the {avail} "
                f"bytes of memory available")
    return None


def lazy_buffer(nbytes: int, member: str) -> memoryview:
    """A writable, zero-filled buffer whose pages are only taken as they are written (``calloc``): memory
    follows the bytes really decoded into it, not the size a manifest declared.

    Raises:
        ImplausibleSize: ``nbytes`` exceeds the memory available (:func:`check_allocation`).
    """
    from ckpt_archive.format.planes import anon_buffer

    check_allocation(nbytes, member)
    return memoryview(anon_buffer(nbytes))  # not np.zeros: its huge-page advice makes first touch slow


def frame_size_problem(fh, rec: dict) -> str | None:
    """Compare every zstandard chunk's frame header (its declared content size, 18 bytes at most, never
    the body) with the raw size the manifest declares; local files only (``None`` elsewhere: a remote
    store would pay one request per chunk, and the deep check decodes every chunk anyway).

    Args:
        fh: the stored member, opened for reading.
        rec: its manifest record.

    Returns:
        one line naming the first chunk whose frame declares another size, or None.
    """
    import stat

    try:
        fd = fh.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
    except (AttributeError, OSError, ValueError):
        return None
    for i, c in enumerate(rec.get("chunks") or []):
        if c.get("codec") == "store" or not c.get("raw_bytes"):
            continue
        lie = frame_header_problem(os.pread(fd, min(FRAME_HEADER_MAX, c["stored_bytes"]), c["stored_offset"]), c, i)
        if lie:
            return lie
    return None


#: the most bytes a zstandard frame header takes (magic, descriptor, window, dictionary id, content size)
FRAME_HEADER_MAX = 18


def frame_header_problem(head: bytes, chunk: dict, i: int) -> str | None:
    """Whether the first bytes of stored chunk ``i`` (at most :data:`FRAME_HEADER_MAX`) begin a zstandard frame
    whose declared content size is the raw size ``chunk`` (its manifest record) declares; None for a ``store``
    chunk, an empty one, or a frame that does not declare its size.

    Returns:
        one line naming the chunk and both sizes, or None.
    """
    if chunk.get("codec") == "store" or not chunk.get("raw_bytes"):
        return None
    import zstandard

    try:
        size = zstandard.get_frame_parameters(bytes(head)).content_size
    except zstandard.ZstdError:
        return f"chunk {i} does not start with a zstandard frame header"
    if size != zstandard.CONTENTSIZE_UNKNOWN and size != chunk["raw_bytes"]:
        return f"chunk {i}'s zstandard frame holds {size} bytes, the manifest declares {chunk['raw_bytes']}"
    return None
