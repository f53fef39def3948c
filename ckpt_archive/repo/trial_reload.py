"""The trial reload: decode every member of a generation and check every tensor, without torch.

This is what makes a generation *usable* (docs/FORMAT.md, "Write order" step 5): every chunk decoded
(its stored sha256 checked once, in parallel), every member's and every tensor's raw fingerprint
compared with the manifest -- each byte hashed once: a format-2 tensors member is fingerprinted entry
by entry as it streams (the member's own fingerprint is derived from those), a format-1 member as a
whole -- each tensor's dtype and shape checked against its entry (byte counts, views inside their
storage, a view's own bytes fingerprinted), the state tree rebuilt and every tensor reference
resolved. Tensors are checked as bytes with NumPy: ``import torch`` is not needed (it costs ~1 s of
start-up). Run by pack and export before the marker is written, and by ``verify --deep``.

One exception, only in pack's own trial reload: a shared object the new generation reuses whose stored
bytes pack hashed in this operation, under a chunk table a usable generation's trial reload proved, is
not decoded again (``ArchiveReader.proven_objects``; the rule and why it is sound: docs/FORMAT.md,
"Write order", step 5). ``verify --deep``, export and adopt decode everything.
"""
from __future__ import annotations

from ckpt_archive.errors import CkptArchiveError, IntegrityError, StoreError, TooLargeHere
from ckpt_archive.format import fingerprint
from ckpt_archive.repo import exact_stream
# the leaf checks are format's (every reader runs them); they are named here too, where the trial reload uses them
from ckpt_archive.format.leaf_checks import (TORCH_ITEMSIZE, check_leaf_bytes, check_leaf_fp,  # noqa: F401
                                             check_leaf_geometry, check_tree_kinds)
from ckpt_archive.format.limits import MAX_DATA_IDS_BYTES, check_whole_read
from ckpt_archive.format.state_tree import decode
from ckpt_archive.repo.entries import ProvenSize
from ckpt_archive.repo.reader import ArchiveReader, Problem, tensor_refs

def trial_reload(reader: ArchiveReader, problems: list[Problem], on_bytes=None) -> dict:
    """Decode every member of the generation ``reader`` reads; check every tensor's raw fingerprint,
    dtype and shape; rebuild the tree and resolve every tensor reference.

    Args:
        reader: the generation's :class:`~ckpt_archive.repo.reader.ArchiveReader` (over the store where
            the check must hold: the repository itself, or an export's destination).
        problems: what is wrong is appended here (each naming the member and/or tensor).
        on_bytes: progress callback (raw bytes decoded).

    Returns:
        counts: ``tensors`` checked, ``bytes`` decoded, ``members``; ``proven_bytes``: raw bytes of shared
        objects in ``reader.proven_objects`` that were not decoded again (pack hashed their stored bytes;
        present when not 0).
    
    A manifest that passed its schema and reference checks but still lacks what a reader indexes
    (``KeyError``/``TypeError``/``IndexError`` on its content) is a problem of the generation, named as
    such, as ``load`` names it -- never an "internal error" (the hostile-archive suite's rule).
    """
    try:
        return _reload(reader, problems, on_bytes)
    except (KeyError, TypeError, IndexError) as exc:
        problems.append(Problem(f"the manifest is malformed where it is read ({type(exc).__name__}: {exc})",
                                member="manifest.json"))
        return {"tensors": 0, "bytes": 0, "members": len(reader.manifest.get("members") or ())}


def _reload(reader: ArchiveReader, problems: list[Problem], on_bytes) -> dict:
    """:func:`trial_reload`'s work, on a manifest that may still lack what it indexes."""
    tensors = reader.manifest["tensors"]
    by_entry: dict[str, list[str]] = {}
    for leaf, rec in tensors.items():
        by_entry.setdefault(rec["entry"], []).append(leaf)
    checked = 0
    decoded = 0
    proven = 0  # raw bytes of proven shared objects, checked by their stored bytes' hash, not decoded again
    # [issue 24 item 8, issue 29] the exact-bytes files' sha256, taken in this one read where it can be
    taps, read_whole = exact_stream.plan(reader, on_bytes) if not reader.written_crc else ({}, set())
    file_sha256: dict[int, str] = {}
    for rec in reader.manifest["members"]:
        if rec["role"] == "tensors":
            fast, fast_counts = _tensors_member(reader, rec, by_entry, on_bytes, taps.get(rec["path"]), file_sha256)
            if fast is not None:
                problems.extend(fast)
                checked, decoded, proven = (x + y for x, y in zip((checked, decoded, proven), fast_counts))
                continue
        try:
            if rec["role"] == "tensors":
                more_checked, more_decoded = _tensors_member_by_entry(reader, rec, by_entry, on_bytes, problems)
                checked += more_checked
                decoded += more_decoded
            elif rec["path"] == reader.manifest["tree_member"]:
                continue  # read whole below (reader.tree(): its declared size checked before any byte is read)
            elif rec["role"] == "data-ids":  # read whole and parsed as `restore --data-ids` reads them
                decoded += len(data_ids(reader, rec, on_bytes))
            elif rec["path"] in read_whole:  # a skeleton the plan read whole: chunks and raw fingerprint checked
                decoded += rec["raw_bytes"]
            else:
                for _, chunk in reader.iter_member(rec, on_bytes=on_bytes):
                    decoded += len(chunk)
        except StoreError:
            raise
        except CkptArchiveError as exc:
            problems.append(Problem.of(exc, member=rec["path"]))
    try:
        tree = reader.tree()
        tree_bytes = reader.by_path[reader.manifest["tree_member"]]["raw_bytes"]
        decoded += tree_bytes
        if on_bytes:
            on_bytes(tree_bytes)
    except StoreError:
        raise
    except CkptArchiveError as exc:
        problems.append(Problem.of(exc, member=reader.manifest["tree_member"]))
    else:
        # the leaves were checked against their bytes above: the index checks here need no geometry pass
        problems.extend(index_problems(reader, tree, geometry=False))
    if not reader.written_crc:  # [issue 24] bytes this process did not just write from the source itself
        problems.extend(exact_sha256_problems(reader, on_bytes=on_bytes, known=file_sha256))
    counts = {"tensors": checked, "bytes": decoded, "members": len(reader.manifest["members"])}
    if proven:
        counts["proven_bytes"] = proven
    return counts


def _tensors_member(reader: ArchiveReader, rec: dict, by_entry: dict, on_bytes, tap=None,
                    file_sha256: dict | None = None) -> tuple[list | None, tuple]:
    """One tensors member in one read: chunks checked and decoded in parallel, the member's raw fingerprint
    (format 2: every entry's) taken on the way by ``iter_member``. Leaves are checked against their entry's
    bytes; only views (their own bytes) are hashed again. ``tap``: a
    :class:`~ckpt_archive.repo.exact_stream.FileOrderHasher` fed the same decoded chunks; when the member's
    read completes, the sha256 of the files it gives go into ``file_sha256`` (index in ``source.files``).

    Returns:
        ``(problems, (tensors checked, bytes decoded, proven bytes))``; problems None when a format-1 member's
        whole sha256 fails: :func:`_tensors_member_by_entry` then re-reads it to name the tensor(s) at fault.

    Raises:
        StoreError: the store failed (unreachable, refusing): could not check (exit 2), not a finding.
    """
    tensors = reader.manifest["tensors"]
    fast: list[Problem] = []
    checked = decoded = proven = 0
    try:
        # entries whose every leaf is the entry itself (no view) need only their length here:
        # their bytes are hashed chunk by chunk on the way, not assembled
        plain = frozenset(k for k in rec["entries"]
                          if all(not tensors[leaf].get("view") for leaf in by_entry.get(k, [])))
        # shared objects whose stored bytes pack hashed now, under a chunk table a trial reload
        # proved (reader.proven_objects): an entry no view reads needs only its fingerprint, which is
        # the object's -- not decoded again (docs/FORMAT.md, "Write order", step 5)
        for key, erec, buf in reader.iter_entries(rec, on_bytes=on_bytes, transient=True,
                                                  sizes_only=plain, skip_objects=reader.proven_objects,
                                                  tap=None if tap is None else tap.feed):
            if isinstance(buf, ProvenSize):
                proven += len(buf)
            else:
                decoded += len(buf)
            checked += check_entry_leaves(tensors, rec, erec, buf, by_entry.get(key, []),
                                          fingerprint.raw_fp(erec), fast)
        if tap is not None:  # the read completed: every chunk's stored sha256 and every entry's fingerprint held
            file_sha256.update(tap.finish())
    except StoreError:
        raise
    except CkptArchiveError as exc:
        if exc.message.startswith("raw sha256 mismatch"):
            return None, (0, 0, 0)  # format 1: the entry-by-entry pass
        fast.append(Problem.of(exc, member=rec["path"]))
    return fast, (checked, decoded, proven)


def _tensors_member_by_entry(reader: ArchiveReader, rec: dict, by_entry: dict, on_bytes,
                             problems: list[Problem]) -> tuple[int, int]:
    """A format-1 tensors member whose whole sha256 failed, read again entry by entry, each entry's bytes
    hashed: names the tensor(s) at fault (appended to ``problems``).

    Returns:
        ``(tensors checked, bytes decoded)``.

    Raises:
        CkptArchiveError: the member cannot be read (the caller records it).
    """
    tensors = reader.manifest["tensors"]
    checked = decoded = 0
    for key, erec, buf in reader.iter_entries(rec, on_bytes=on_bytes):
        decoded += len(buf)
        want = fingerprint.raw_fp(erec)
        got = fingerprint.digest_like(buf, want)
        if got != want:
            problems.append(Problem(f"tensor bytes sha256 mismatch: expected {want.partition(':')[2]}, "
                                    f"got {got.partition(':')[2]}", member=rec["path"], field=f"tensors/{key}"))
            continue
        checked += check_entry_leaves(tensors, rec, erec, buf, by_entry.get(key, []), got, problems)
    return checked, decoded


def data_ids(reader: ArchiveReader, rec: dict, on_bytes=None) -> bytearray:
    """The data ids member as ``restore --data-ids`` reads it: whole, bounded (``limits.MAX_DATA_IDS_BYTES``,
    refused from the declared size before any byte is read), strict JSON within ``limits.MAX_DATA_IDS_COST``
    of parse. Returns its raw bytes.

    Raises:
        ImplausibleSize: (exit 1) larger than the limit. IntegrityError: a chunk or fingerprint fails; not
            strict JSON; too costly to parse.
    """
    from ckpt_archive.format import jsonio
    from ckpt_archive.format.limits import MAX_DATA_IDS_COST

    check_whole_read(rec, rec["path"], MAX_DATA_IDS_BYTES)
    raw = reader.read_member_bytes(rec["path"], limit=MAX_DATA_IDS_BYTES)
    if on_bytes:
        on_bytes(len(raw))
    try:
        jsonio.loads(raw, where=rec["path"], max_bytes=MAX_DATA_IDS_BYTES, max_cost=MAX_DATA_IDS_COST)
    except ValueError as exc:
        raise IntegrityError(f"data ids are not valid JSON ({getattr(exc, 'message', exc)})",
                             where=rec["path"]) from None
    return raw


def index_problems(reader: ArchiveReader, tree, *, geometry: bool = True) -> list[Problem]:
    """The checks of the trial reload that need no tensor bytes, for readers that do not decode every tensor
    (``restore`` of exact bytes, ``load`` of a part; docs/FORMAT.md, "One status rule"): every tensor the
    state tree references is in the manifest, with the kind the tree says (:func:`check_tree_kinds`); every
    tree node can be rebuilt (``decode(..., objects="check")``); with ``geometry``, every tensor record's
    dtype, shape and view fit its entry (:func:`check_leaf_geometry`); every ``exact`` record of a source
    file fits its entries and skeleton (``format/exact_bytes.py: exact_problems``).

    Args:
        reader: the generation's reader. tree: its parsed state tree (:meth:`ArchiveReader.tree`).
        geometry: check every tensor record against its entry (the trial reload does it with the bytes).

    Returns:
        the problems found (empty when the index is sound).
    """
    from ckpt_archive.format.exact_bytes import exact_problems  # [issue 11]

    problems: list[Problem] = []
    manifest = reader.manifest
    tensors = manifest["tensors"]
    tree_member = manifest["tree_member"]
    try:
        missing = [k for k in tensor_refs(tree) if k not in tensors]
        if missing:
            problems.append(Problem(f"state tree references {len(missing)} tensor(s) not in the manifest: "
                                    f"{', '.join(missing[:5])}", member=tree_member))
        check_tree_kinds(tree, tensors)
        decode(tree, lambda k: None, objects="check")
    except StoreError:
        raise
    except CkptArchiveError as exc:
        problems.append(Problem.of(exc, member=tree_member))
    if geometry:
        for leaf, lrec in tensors.items():
            erec = reader.by_path[lrec["member"]]["entries"][lrec["entry"]]
            start, end = erec["data_offsets"]
            try:
                check_leaf_geometry(erec, lrec, leaf, end - start)
            except CkptArchiveError as exc:
                problems.append(Problem(exc.message, member=lrec["member"], field=f"tensors/{leaf}"))
    problems.extend(Problem(p, field="source.files") for p in exact_problems(manifest))
    return problems


def exact_sha256_problems(reader: ArchiveReader, on_bytes=None, known: dict | None = None) -> list[Problem]:
    """[issue 24, item 8] What ``restore`` checks of a source file kept as exact bytes, checked here: the
    sha256 of the file its skeleton and segments rebuild (in file order) is ``source.files[].sha256``.

    The file is rebuilt as a stream, never held: its skeleton member is decoded chunk by chunk into the gaps
    between segments, and each segment's entry is decoded from its own chunks (a chunk never holds bytes of
    two entries; a hostile table that does is sliced), every chunk's stored sha256 and the entry's raw
    fingerprint checked. Memory: one chunk of each at a time. ``known``: ``{index in source.files: sha256
    hex}`` already taken from a completed read of the same checked bytes (the trial reload's,
    :mod:`ckpt_archive.repo.exact_stream`): those files are not rebuilt again.

    Returns:
        one problem per source file whose rebuilt sha256 differs (or that cannot be rebuilt).
    """
    from ckpt_archive.format.exact_bytes import exact_problems

    problems: list[Problem] = []
    if exact_problems(reader.manifest):
        return problems  # the records do not fit: already reported by index_problems
    known = known or {}
    for i, f in enumerate((reader.manifest.get("source") or {}).get("files") or []):
        if not f.get("exact") or f.get("hardlink_of"):
            continue
        name = f["relpath"] or "file"
        try:
            got = known[i] if i in known else rebuilt_sha256(reader, f, on_bytes)
        except StoreError:
            raise
        except CkptArchiveError as exc:
            problems.append(Problem(f"{name}: its exact bytes cannot be rebuilt: {exc.message}",
                                    field="source.files", local=isinstance(exc, TooLargeHere)))
            continue
        if got != f.get("sha256"):
            problems.append(Problem(f"{name}: the file its exact bytes rebuild has sha256 {got}, the manifest "
                                    f"records {f.get('sha256')} (restore would refuse it)", field="source.files"))
    return problems


def rebuilt_sha256(reader: ArchiveReader, f: dict, on_bytes=None) -> str:
    """sha256 hex of the source file ``f`` (a ``source.files[]`` record with ``exact``) as its skeleton and
    segments rebuild it, in file order, streamed (see :func:`exact_sha256_problems`).

    Raises:
        IntegrityError: a chunk or fingerprint fails, or the skeleton does not fill the gaps exactly.
    """
    import hashlib

    exact = f["exact"]
    size = int(f["raw_bytes"])
    skeleton = reader.by_path.get(exact["member"])
    if skeleton is None:
        raise IntegrityError(f"manifest lists no member {exact['member']!r}", where="manifest.json")
    where = f["relpath"] or "file"
    owner = {k: m for m in reader.manifest["members"] if m["role"] == "tensors" for k in m.get("entries") or ()}
    h = hashlib.sha256()
    pieces = (memoryview(c).cast("B") for _, c in reader.iter_member(skeleton, on_bytes=on_bytes))
    buf = memoryview(b"")

    def take(n: int) -> None:  # feed n skeleton bytes
        nonlocal buf
        while n:
            if not len(buf):
                buf = next(pieces, None)
                if buf is None:
                    raise IntegrityError("skeleton is shorter than the file it belongs to", where=where)
                continue
            k = min(n, len(buf))
            h.update(buf[:k])
            buf, n = buf[k:], n - k

    pos = 0
    for start, length, key in exact["segments"]:
        take(start - pos)
        m = owner.get(key)
        if m is None:
            raise IntegrityError(f"segment entry {key!r} is in no tensors member", where=where)
        for piece in reader.entry_pieces(m, key, on_bytes=on_bytes):
            h.update(piece)
        pos = start + length
    take(size - pos)
    if len(buf) or next(pieces, None) is not None:
        raise IntegrityError("skeleton is longer than the file it belongs to", where=where)
    return h.hexdigest()


def check_entry_leaves(tensors: dict, rec: dict, erec: dict, buf, leaves: list[str], entry_fp: str | None,
                       problems: list[Problem]) -> int:
    """Check each tree leaf stored in one entry: dtype and shape against the entry, its raw fingerprint.

    ``entry_fp`` is the entry's raw fingerprint, already known to hold for ``buf``: a leaf that is the
    entry itself is not hashed again; a view's own bytes are gathered (NumPy, strided) and hashed.
    Returns the number of leaves that passed; appends a Problem per leaf that did not.
    """
    passed = 0
    for leaf in leaves:
        lrec = tensors[leaf]
        try:
            check_leaf_bytes(buf, erec, lrec, leaf, entry_fp)
            passed += 1
        except CkptArchiveError as exc:
            # [break] Problem.of: a view too large for this machine (TooLargeHere) is reported, never recorded
            problems.append(Problem(exc.message, member=rec["path"], field=f"tensors/{leaf}",
                                    local=isinstance(exc, TooLargeHere)))
    return passed


__all__ = ["TORCH_ITEMSIZE", "trial_reload", "data_ids", "index_problems", "exact_sha256_problems", "rebuilt_sha256",
           "check_entry_leaves", "check_leaf_bytes", "check_leaf_fp", "check_leaf_geometry", "check_tree_kinds"]
