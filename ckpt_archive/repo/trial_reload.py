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

import math

from ckpt_archive.errors import CkptArchiveError, IntegrityError, StoreError, TooLargeHere
from ckpt_archive.format import fingerprint
from ckpt_archive.format.limits import MAX_DATA_IDS_BYTES, check_whole_read
from ckpt_archive.format.state_tree import NUMPY_TO_ST, TORCH_TO_ST, decode
from ckpt_archive.repo.reader import ArchiveReader, Problem, ProvenSize, SizeOnly, tensor_refs

#: Element size of every torch dtype by name, so tensors are checked without importing torch.
TORCH_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex32": 4, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}


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
    """
    tensors = reader.manifest["tensors"]
    by_entry: dict[str, list[str]] = {}
    for leaf, rec in tensors.items():
        by_entry.setdefault(rec["entry"], []).append(leaf)
    checked = 0
    decoded = 0
    proven = 0  # raw bytes of proven shared objects, checked by their stored bytes' hash, not decoded again
    for rec in reader.manifest["members"]:
        if rec["role"] == "tensors":
            # One read: chunks checked and decoded in parallel, the member's raw fingerprint (format 2:
            # every entry's) taken on the way by iter_member. Leaves are checked against their entry's
            # bytes; only views (their own bytes) are hashed again. A format-1 member whose whole sha256
            # fails is re-read entry by entry (below) to name the tensor(s) at fault.
            fast: list[Problem] | None = []
            fast_checked = fast_decoded = fast_proven = 0
            try:
                # entries whose every leaf is the entry itself (no view) need only their length here:
                # their bytes are hashed chunk by chunk on the way, not assembled
                plain = frozenset(k for k in rec["entries"]
                                  if all(not tensors[leaf].get("view") for leaf in by_entry.get(k, [])))
                # shared objects whose stored bytes pack hashed now, under a chunk table a trial reload
                # proved (reader.proven_objects): an entry no view reads needs only its fingerprint, which is
                # the object's -- not decoded again (docs/FORMAT.md, "Write order", step 5)
                for key, erec, buf in reader.iter_entries(rec, on_bytes=on_bytes, transient=True,
                                                          sizes_only=plain, skip_objects=reader.proven_objects):
                    if isinstance(buf, ProvenSize):
                        fast_proven += len(buf)
                    else:
                        fast_decoded += len(buf)
                    fast_checked += check_entry_leaves(tensors, rec, erec, buf, by_entry.get(key, []),
                                                       fingerprint.raw_fp(erec), fast)
            except StoreError:
                raise  # the store failed (unreachable, refusing): could not check (exit 2), not a finding
            except CkptArchiveError as exc:
                if exc.message.startswith("raw sha256 mismatch"):
                    fast = None  # format 1: fall through to the entry-by-entry pass
                else:
                    fast.append(Problem.of(exc, member=rec["path"]))
            if fast is not None:
                problems.extend(fast)
                checked += fast_checked
                decoded += fast_decoded
                proven += fast_proven
                continue
        try:
            if rec["role"] == "tensors":
                for key, erec, buf in reader.iter_entries(rec, on_bytes=on_bytes):
                    decoded += len(buf)
                    want = fingerprint.raw_fp(erec)
                    got = fingerprint.digest_like(buf, want)
                    if got != want:
                        problems.append(Problem(f"tensor bytes sha256 mismatch: expected {want.partition(':')[2]}, "
                                                f"got {got.partition(':')[2]}", member=rec["path"],
                                                field=f"tensors/{key}"))
                        continue
                    checked += check_entry_leaves(tensors, rec, erec, buf, by_entry.get(key, []), got, problems)
            elif rec["path"] == reader.manifest["tree_member"]:
                continue  # read whole below (reader.tree(): its declared size checked before any byte is read)
            elif rec["role"] == "data-ids":  # read whole and parsed as `restore --data-ids` reads them
                decoded += len(data_ids(reader, rec, on_bytes))
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
        problems.extend(exact_sha256_problems(reader, on_bytes=on_bytes))
    counts = {"tensors": checked, "bytes": decoded, "members": len(reader.manifest["members"])}
    if proven:
        counts["proven_bytes"] = proven
    return counts


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


def exact_sha256_problems(reader: ArchiveReader, on_bytes=None) -> list[Problem]:
    """[issue 24, item 8] What ``restore`` checks of a source file kept as exact bytes, checked here: the
    sha256 of the file its skeleton and segments rebuild (in file order) is ``source.files[].sha256``.

    The file is rebuilt as a stream, never held: its skeleton member is decoded chunk by chunk into the gaps
    between segments, and each segment's entry is decoded from its own chunks (a chunk never holds bytes of
    two entries; a hostile table that does is sliced), every chunk's stored sha256 and the entry's raw
    fingerprint checked. Memory: one chunk of each at a time.

    Returns:
        one problem per source file whose rebuilt sha256 differs (or that cannot be rebuilt).
    """
    from ckpt_archive.format.exact_bytes import exact_problems

    problems: list[Problem] = []
    if exact_problems(reader.manifest):
        return problems  # the records do not fit: already reported by index_problems
    for f in (reader.manifest.get("source") or {}).get("files") or []:
        if not f.get("exact") or f.get("hardlink_of"):
            continue
        name = f["relpath"] or "file"
        try:
            got = rebuilt_sha256(reader, f, on_bytes)
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
            problems.append(Problem(exc.message, member=rec["path"], field=f"tensors/{leaf}"))
    return passed


def _itemsize(dtype: str, kind: str) -> int:
    if kind == "numpy":
        import numpy as np

        return np.dtype(dtype).itemsize
    size = TORCH_ITEMSIZE.get(dtype)
    if size is None:  # a dtype newer than this table: ask torch (the only path that imports it)
        from ckpt_archive.format.state_tree import torch_dtype

        size = torch_dtype(dtype).itemsize
    return size


def check_leaf_bytes(buf, erec: dict, lrec: dict, leaf: str, entry_fp: str | None) -> None:
    """Raise IntegrityError when the leaf cannot be rebuilt from the entry's bytes as the manifest says.

    What is checked (the trial reload, ``load`` and ``restore`` run the same checks, so a generation
    they read is the one the trial reload proved): dtype and shape against the entry (or, for a view,
    its offset and strides inside the entry's bytes, and the view's own bytes against its raw
    fingerprint); a plain leaf's raw fingerprint is the entry's (``entry_fp``); a conjugate view is of a
    complex dtype.

    Args:
        buf: the entry's raw bytes (bytes-like, or :class:`~ckpt_archive.repo.reader.SizeOnly`).
        erec: the entry's record (member ``entries``); lrec: the leaf's record (manifest ``tensors``).
        leaf: the leaf's key (for messages). entry_fp: the entry's raw fingerprint, known to hold for
            ``buf`` or checked by the caller.
    """
    nbytes = buf.nbytes if isinstance(buf, SizeOnly) else (len(memoryview(buf).cast("B")) if len(buf) else 0)
    whole = check_leaf_geometry(erec, lrec, leaf, nbytes)
    view = lrec.get("view")
    if whole:
        data = buf  # the leaf's bytes are the entry's: its fingerprint is the entry's
    else:
        import numpy as np  # only views need it (the policy audit of small leaves does not import it)

        size = _itemsize(lrec["dtype"], lrec["kind"])
        shape = [int(x) for x in lrec["shape"]]
        offset, stride = int(view["storage_offset"]), [int(s) for s in view["stride"]]
        if math.prod(shape):
            elems = np.frombuffer(buf, dtype=np.uint8)[:(nbytes // size) * size].view(f"V{size}")
            data = np.ascontiguousarray(np.lib.stride_tricks.as_strided(
                elems[offset:], shape=shape, strides=[s * size for s in stride], writeable=False)).view(np.uint8)
        else:
            data = b""
        entry_fp = None
    check_leaf_fp(lrec, leaf, entry_fp or fingerprint.digest_like(data, fingerprint.raw_fp(lrec)))


def check_leaf_fp(lrec: dict, leaf: str, got: str) -> None:
    """Raise IntegrityError when ``got`` (the fingerprint of the leaf's bytes: for a leaf that is its whole
    entry, the entry's) is not the leaf's raw fingerprint in the manifest."""
    want = fingerprint.raw_fp(lrec)
    if got != want:
        if want.startswith("sha256:"):  # format 1's wording
            raise IntegrityError(f"raw sha256 mismatch: expected {want[7:]}, got {got.partition(':')[2]}", where=leaf)
        raise IntegrityError(f"raw fingerprint mismatch: expected {want}, got {got}", where=leaf)


def check_leaf_geometry(erec: dict, lrec: dict, leaf: str, nbytes: int) -> bool:
    """The checks of :func:`check_leaf_bytes` that need no bytes: dtype and shape against the entry of
    ``nbytes`` raw bytes, a view's offset and strides inside them, a conjugate view only of a complex dtype.

    Returns:
        True when the leaf's bytes are exactly the entry's (no view, or a view at offset 0 with the
        entry's dtype, C-contiguous strides and all its bytes): its raw fingerprint is then the entry's.

    Raises:
        IntegrityError: the leaf cannot be what the manifest says it is; names the leaf.
    """
    kind, dtype, shape = lrec["kind"], lrec["dtype"], [int(x) for x in lrec["shape"]]
    view = lrec.get("view")
    if (lrec.get("bits") or {}).get("conj") and not dtype.startswith("complex"):
        raise IntegrityError(f"a conjugate view of {dtype}: only complex tensors have one", where=leaf)
    if lrec.get("requires_grad") and not (dtype.startswith(("float", "bfloat", "complex"))):
        raise IntegrityError(f"requires_grad on a {dtype} tensor: only floating point and complex tensors "
                             f"can require gradients", where=leaf)
    size = _itemsize(dtype, kind)
    numel = math.prod(shape)
    st_of = NUMPY_TO_ST if kind == "numpy" else TORCH_TO_ST
    if not view:
        try:
            if kind == "numpy":
                import numpy as np

            want_st = st_of.get(np.dtype(dtype).str if kind == "numpy" else dtype)
        except TypeError:
            raise IntegrityError(f"dtype {dtype!r} is not a NumPy dtype", where=leaf) from None
        want_shape = shape
        if want_st is None and kind == "numpy":  # the writer keeps such an array as raw bytes (U8)
            want_st, want_shape = "U8", [numel * size]
        if want_st is None:  # the writer keeps such a tensor as a view of raw bytes, never plain
            raise IntegrityError(f"dtype {dtype} has no safetensors code: it cannot be a plain entry",
                                 where=leaf)
        if want_st != erec.get("dtype"):
            raise IntegrityError(f"dtype {dtype} != entry dtype {erec.get('dtype')}", where=leaf)
        if want_shape != list(erec.get("shape", want_shape)):
            raise IntegrityError(f"shape {shape} != entry shape {erec.get('shape')}", where=leaf)
        if numel * size != nbytes:
            raise IntegrityError(f"shape {shape} of {dtype} needs {numel * size} bytes, the entry has {nbytes}",
                                 where=leaf)
        return True
    entry_dtype = view.get("entry_dtype")
    if entry_dtype is not None and TORCH_TO_ST.get(entry_dtype, erec.get("dtype")) != erec.get("dtype"):
        raise IntegrityError(f"view's entry dtype {entry_dtype} != entry dtype {erec.get('dtype')}", where=leaf)
    # the writer keeps views of one dtype over an entry of that dtype, and views of several dtypes (or of
    # one with no safetensors code) over raw bytes (uint8): any other pairing is a reinterpretation
    typed = entry_dtype if entry_dtype is not None else next(
        (k for k, v in TORCH_TO_ST.items() if v == erec.get("dtype")), None)
    if typed not in (None, "uint8") and dtype != typed:
        raise IntegrityError(f"a {dtype} view of a {typed} entry", where=leaf)
    offset, stride = int(view["storage_offset"]), [int(s) for s in view["stride"]]
    if len(stride) != len(shape) or offset < 0 or any(s < 0 for s in stride):
        raise IntegrityError(f"view of shape {shape} has stride {stride}, offset {offset}", where=leaf)
    if numel:
        last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
        if (last + 1) * size > nbytes:
            raise IntegrityError(f"view (offset {offset}, shape {shape}, stride {stride}) reaches past its "
                                 f"storage of {nbytes} bytes", where=leaf)
    contiguous = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return (offset == 0 and numel * size == nbytes and stride == contiguous and kind == "torch"
            and (entry_dtype is None or entry_dtype == dtype) and TORCH_TO_ST.get(dtype) == erec.get("dtype"))


def check_tree_kinds(tree, tensors: dict) -> None:
    """Every tensor node of the state tree names a ``torch`` record, every ndarray node a ``numpy`` one.

    Raises:
        IntegrityError: a node and its record disagree (a hand-edited ``kind`` would otherwise restore a
            tensor as an ndarray, which ``torch.load(weights_only=True)`` then refuses).
    """
    from ckpt_archive.format.tree_walk import iter_nodes

    for node in iter_nodes(tree):
        tag = node.get("$t")
        if tag in ("tensor", "ndarray"):
            rec = tensors.get(node.get("key"))
            want = "torch" if tag == "tensor" else "numpy"
            if rec is not None and rec.get("kind") != want:
                raise IntegrityError(f"the state tree holds a {tag} here, the manifest's record says kind "
                                     f"{rec.get('kind')!r}", where=str(node.get("key")))
