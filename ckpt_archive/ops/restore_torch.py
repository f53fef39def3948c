"""[issue 14] Restore a re-serialised ``torch.save`` file in one pass: no spill files, no second copy.

A generation packed from a Python object (``ckpt_archive.pack(state)``, the in-loop Checkpointer) has no
original file to give back byte for byte, so ``restore`` writes the state with ``torch.save``. Done
naively that needs every tensor in memory, or (as before) decoded into spill files first: twice the
raw size on disk. Here the file is written once, in place:

1. The state is rebuilt with *fake* tensors (``torch._subclasses.FakeTensorMode``): one fake storage per
   stored entry, every leaf a view of it with its own dtype, shape, stride and offset, so views share
   storages exactly as in the state that was packed; plain values and NumPy arrays are real.
2. ``torch.save`` writes it under ``torch.serialization.skip_data(materialize_fake_tensors=True)``:
   the pickle, every record and space for every storage's bytes, at their final offsets (torch's own
   writer: every record is what ``torch.save`` of the real state writes, but the random
   ``.data/serialization_id`` and the pickle, which loads the same and memoises the location string
   ``'cpu'`` less often). A pickler hook records which storage torch named ``data/<key>``.
3. Each storage record is filled from its entry's decoded bytes, one decoded chunk at a time, written in
   place with ``pwrite`` (every chunk and the member's raw fingerprint checked by the reader on the way;
   memory is the chunk pipeline's whatever a storage's size, [issue 29]) and its CRC-32, taken on the way,
   written into the record's data descriptor and the central directory. Views of part of an entry are
   checked against their own fingerprints from the written file (a read-only file-backed map).

States this path cannot reproduce exactly go the old way (``None`` is returned before anything is
written): an ``nn.Parameter``, a conj/neg view, a tensor with Python attributes, a sparse, quantized,
nested or meta tensor, a storage kept as a value, views of one storage as different dtypes, anything
whose storage is not one of ours or a small real one built by the tree. Sources: ``torch/serialization.py``
(``_save``: records ``data/<key>`` in the order storages are first pickled; ``skip_data``); the zip
format (APPNOTE.TXT 4.3.7 local header, 4.3.9 data descriptor, 4.3.12 central directory).
"""
from __future__ import annotations

import os
import struct
import zipfile
from typing import Any

from ckpt_archive.errors import IntegrityError
from ckpt_archive.format.exact_bytes import crc32, pwrite_all, zip_records
from ckpt_archive.format.ordered_writes import ParallelWrites
from ckpt_archive.format.leaves import leaf_from_base
from ckpt_archive.repo.reader import ArchiveReader, tensor_refs
from ckpt_archive.store.fs import Entry

_CD_MAGIC = b"PK\x01\x02"
_DD_MAGIC = b"PK\x07\x08"


def write_torch_file(reader: ArchiveReader, tree: Any, target: Entry, on_bytes=None, on_start=None) -> int | None:
    """Write the state of ``tree`` (an encoded state tree of ``reader``'s generation) as a ``torch.save``
    file at ``target`` in one pass (see the module docstring).

    Args:
        reader: the generation's reader (its chunks and fingerprints are checked as they are decoded).
        tree: the encoded tree to write (the whole state, or a sub-tree).
        target: the file to create, a name in a folder the file layer opened (restore's staging folder:
            :class:`~ckpt_archive.store.fs.Entry`); created exclusively, never through a link.
        on_bytes: progress callback, raw bytes decoded.
        on_start: called once the state is taken (nothing is declined after it), before any entry is decoded.

    Returns:
        bytes written, or None when the state needs the general path (nothing was written then).

    Raises:
        IntegrityError: a chunk or entry fails its check (``target`` is removed), or torch laid out a
            record this module does not recognise.
        OSError: the file cannot be written (``target`` is removed).
    """
    from ckpt_archive.format.state_tree import decode
    from ckpt_archive.format.tree_walk import iter_nodes

    torch_leaves = _torch_leaves(reader, tree)
    if torch_leaves is None:
        return None
    # NumPy arrays are pickled inline by torch.save: they are decoded (and checked) for real
    numpy_nodes = [node for node in iter_nodes(tree) if node.get("$t") == "ndarray"]
    numpy_values = dict(zip((n["key"] for n in numpy_nodes), reader.load_node(numpy_nodes))) if numpy_nodes else {}
    member_of, entry_rec = _tensor_entries(reader)
    fake = _fake_leaves(reader.manifest["tensors"], torch_leaves, entry_rec)
    if fake is None:
        return None
    bases, built, part_views = fake
    built.update(numpy_values)
    try:
        state = decode(tree, built.__getitem__)
    except Exception:  # noqa: BLE001 - an object that does not take a fake tensor: the general path decodes
        return None  # it for real (and raises the same error there if the tree itself is at fault)
    named = _write_skeleton(state, target)
    if named is None:
        return None
    storage_entry = {b.untyped_storage()._cdata: key for key, b in bases.items()}
    try:
        plan = _fill_plan(named, storage_entry)
        if on_start is not None:
            on_start()
        size = _fill(reader, target, plan, member_of, on_bytes, part_views)
    except _Fallback:
        target.remove()
        return None
    except BaseException:
        target.remove()
        raise
    return size


def _torch_leaves(reader: ArchiveReader, tree: Any) -> list[str] | None:
    """The torch tensor leaves ``tree`` references (its NumPy ones aside), or None when the state needs the
    general path (a declined node, a parameter or a tensor with bits, views of one storage as two dtypes).

    Raises:
        IntegrityError: the tree references a tensor the manifest does not hold, or kinds that disagree.
    """
    from ckpt_archive.format.tree_walk import iter_nodes
    from ckpt_archive.repo.trial_reload import check_tree_kinds

    tensors = reader.manifest["tensors"]
    refs = set(tensor_refs(tree))
    check_tree_kinds(tree, tensors)
    if any(_declined(node) for node in iter_nodes(tree)):
        return None
    torch_leaves = []
    for leaf in refs:
        lrec = tensors.get(leaf)
        if lrec is None:
            raise IntegrityError(f"state tree references tensor {leaf!r}, not in the manifest",
                                 where=reader.manifest["tree_member"])
        if lrec["kind"] == "numpy":
            continue
        if lrec.get("bits") or lrec.get("parameter"):
            return None
        torch_leaves.append(leaf)
    dtypes: dict[str, set] = {}
    for leaf in torch_leaves:
        dtypes.setdefault(tensors[leaf]["entry"], set()).add(tensors[leaf]["dtype"])
    if any(len(d) > 1 for d in dtypes.values()):
        return None  # views of one storage as different dtypes: torch.save refuses such a state itself
    return torch_leaves


def _tensor_entries(reader: ArchiveReader) -> tuple[dict, dict]:
    """``({entry key: its tensors member}, {entry key: its entry record})`` of the generation."""
    member_of, entry_rec = {}, {}
    for m in reader.manifest["members"]:
        if m["role"] == "tensors":
            for key, erec in m["entries"].items():
                member_of[key], entry_rec[key] = m, erec
    return member_of, entry_rec


def _fake_leaves(tensors: dict, torch_leaves: list[str], entry_rec: dict) -> tuple[dict, dict, dict] | None:
    """Every torch leaf as a view of one fake storage per entry (``FakeTensorMode``), after the trial
    reload's checks of the leaf against its entry (dtype, shape, a view's bounds).

    Returns:
        ``(bases: {entry key: fake base tensor}, built: {leaf: fake tensor}, part_views: {entry key: [(leaf,
        record)] of views of part of it}, checked by ``_fill`` when the entry is decoded)``, or None when the
        state needs the general path.

    Raises:
        IntegrityError: a leaf names an entry no tensors member holds, or disagrees with it.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ckpt_archive.format import fingerprint
    from ckpt_archive.format.tensor_bytes import torch_dtype
    from ckpt_archive.repo.trial_reload import check_leaf_fp, check_leaf_geometry

    part_views: dict[str, list] = {}
    bases: dict[str, Any] = {}
    built: dict[str, Any] = {}
    with FakeTensorMode():
        for leaf in sorted(torch_leaves):
            lrec = tensors[leaf]
            key = lrec["entry"]
            erec = entry_rec.get(key)
            if erec is None:
                raise IntegrityError(f"tensor {leaf!r} names entry {key!r}, which no tensors member holds",
                                     where="manifest.json")
            start, end = erec["data_offsets"]
            if check_leaf_geometry(erec, lrec, leaf, end - start):
                check_leaf_fp(lrec, leaf, fingerprint.raw_fp(erec))  # its bytes are the entry's
            else:
                part_views.setdefault(key, []).append((leaf, lrec))
            if key not in bases:
                view = lrec.get("view")
                dname = view["entry_dtype"] if view and "entry_dtype" in view else lrec["dtype"]
                base = torch.empty(erec["shape"], dtype=torch_dtype(dname), device="cpu")
                if base.untyped_storage().nbytes() != end - start:
                    return None  # an entry whose bytes are not one whole storage of its dtype
                bases[key] = base
            try:
                built[leaf] = leaf_from_base(bases[key], lrec)
            except (RuntimeError, ValueError, TypeError):
                return None  # torch refuses what the record says: the general path names it (IntegrityError)
    return bases, built, part_views


def _write_skeleton(state: Any, target: Entry) -> dict | None:
    """Create ``target`` and let ``torch.save`` write the state's skeleton into it (:func:`_save_skeleton`);
    returns the storages torch named, or None (``target`` removed) when torch's fake-tensor save does not
    take the state.

    Raises:
        OSError: the file cannot be written (``target`` removed; the general path would meet the same).
    """
    try:
        os.close(target.create())  # the name is ours (O_EXCL | O_NOFOLLOW) before torch writes it by path
        return _save_skeleton(state, target.path)
    except OSError:
        target.remove()
        raise  # disk full, permissions: the general path would meet the same
    except Exception:  # noqa: BLE001 - a torch without skip_data(materialize_fake_tensors) (< 2.5), or a
        target.remove()  # value its fake-tensor save does not take: the general path writes it
        return None


def _fill_plan(named: dict, storage_entry: dict) -> list[tuple[str, Any]]:
    """``[(record name, entry key or real storage)]`` for each storage torch named; a storage that is neither
    one of ours nor a small real CPU one raises :class:`_Fallback`."""
    import torch

    plan = []
    for key, storage in named.items():
        entry = storage_entry.get(storage._cdata)
        if entry is None and (storage.device.type != "cpu" or type(storage) is not torch.UntypedStorage):
            raise _Fallback()
        plan.append((f"data/{key}", entry if entry is not None else storage))
    return plan


class _Fallback(Exception):
    """The skeleton holds a storage this module cannot fill: the general path writes the file instead."""


def _declined(node: dict) -> bool:
    """Nodes a fake-tensor save cannot reproduce: a tensor with Python attributes (dropped), a tensor
    rebuilt by a function (sparse, quantized, nested, meta: built from real parts), a storage kept as a
    value (it would be written on the meta device)."""
    tag = node.get("$t")
    return (tag == "tensor" and bool(node.get("attrs"))) or tag in ("rebuild", "storage")


def _save_skeleton(state: Any, target: str) -> dict:
    """``torch.save`` of ``state`` with storages' space reserved, not written; returns ``{record key:
    untyped storage}`` as torch's own pickler named them (``data/<key>``)."""
    import pickle
    import types

    import torch

    named: dict = {}

    class Recording(pickle.Pickler):
        def __init__(self, *args, **kwargs):
            inner = self.persistent_id  # torch's (its subclass of this class defines it)

            def persistent_id(obj):
                pid = inner(obj)
                if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                    named.setdefault(pid[2], obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage)
                                     else obj)
                return pid

            self.persistent_id = persistent_id  # read by the C pickler at __init__, before the class's
            super().__init__(*args, **kwargs)

    module = types.SimpleNamespace(Pickler=Recording, Unpickler=pickle.Unpickler, __name__="pickle")
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, target, pickle_module=module)
    return named


def _records(path: str) -> dict[str, tuple[int, int, int, int]]:
    """``{record name below the archive folder: (data offset, bytes, flag bits, central-directory entry
    offset)}`` of a zip written by torch (data offsets: :func:`~ckpt_archive.format.exact_bytes.zip_records`)."""
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        fh.seek(zf.start_dir)
        cd = fh.read()
        pos = 0
        cd_at = {}
        for info in zf.infolist():
            if cd[pos:pos + 4] != _CD_MAGIC:
                raise IntegrityError("torch.save wrote a central directory this reader does not follow",
                                     where=str(path))
            n, m, k = struct.unpack_from("<HHH", cd, pos + 28)
            cd_at[info.filename] = (info.flag_bits, zf.start_dir + pos)
            pos += 46 + n + m + k
    return {name.split("/", 1)[-1]: (start, length, *cd_at[name])
            for start, length, _, name, _ in zip_records(path)}


def _fill(reader: ArchiveReader, target: Entry, plan: list, member_of: dict, on_bytes,
          part_views: dict | None = None) -> int:
    """Write every planned record's bytes and CRC-32; returns the file's size. ``part_views``: entry key
    -> ``[(leaf, record)]`` of views of part of that entry, whose own bytes are checked against their
    raw fingerprints while the entry's decoded bytes are at hand (IntegrityError when one fails)."""
    import torch

    from ckpt_archive.format import fingerprint
    from ckpt_archive.repo.trial_reload import check_leaf_bytes

    records = _records(target.path)
    by_entry: dict[str, list[str]] = {}  # entry key -> the records it fills
    real = []  # (record, storage) of storages the tree built itself
    for name, what in plan:
        if name not in records:
            raise IntegrityError(f"torch.save wrote no record {name}", where=str(target))
        if isinstance(what, str):
            by_entry.setdefault(what, []).append(name)
        else:
            real.append((name, what))
    fd = target.open(os.O_RDWR)
    try:
        def seal(name: str, crc: int, nbytes: int) -> None:
            """The record holds ``nbytes`` written bytes: write its CRC-32 into its data descriptor and its
            central-directory entry."""
            start, length, flags, cd_at = records[name]
            if nbytes != length:
                raise IntegrityError(f"record {name} holds {length} bytes, its storage {nbytes}", where=str(target))
            packed = struct.pack("<I", crc & 0xFFFFFFFF)
            if flags & 0x08:  # a data descriptor follows the data: [signature] crc, sizes
                sig = os.pread(fd, 4, start + length)
                pwrite_all(fd, packed, start + length + (4 if sig == _DD_MAGIC else 0))
            pwrite_all(fd, packed, cd_at + 16)

        for name, storage in real:  # small: their bytes from memory
            data = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage).numpy() if storage.nbytes() else b""
            pwrite_all(fd, data, records[name][0])
            seal(name, crc32(memoryview(data).cast("B")), len(memoryview(data).cast("B")))
        members: dict[str, set] = {}
        for entry in by_entry:
            members.setdefault(member_of[entry]["path"], set()).add(entry)
        for path, wanted in members.items():
            # [issue 29] chunk by chunk, written in place: memory does not grow with a storage's size (the
            # reader checks every chunk and every entry's raw fingerprint; its verdict comes at the member's
            # end, and any error removes the file)
            rec = reader.by_path[path]
            crcs: dict[str, int] = {}
            written: dict[str, int] = {}
            writes = ParallelWrites(fd)  # the page-cache copies on their own threads
            try:
                for key, erec, offset, piece in reader.iter_entry_pieces(rec, wanted=wanted, on_bytes=on_bytes):
                    for name in by_entry[key]:
                        start, length = records[name][:2]
                        if offset != written.get(name, 0) or offset + len(piece) > length:
                            raise IntegrityError(f"record {name} holds {length} bytes, its storage more",
                                                 where=str(target))
                        writes.write(piece, start + offset)
                        crcs[name] = crc32(piece, crcs.get(name, 0))
                        written[name] = offset + len(piece)
                writes.drain()
            finally:
                writes.close()
            for key in wanted:
                erec = rec["entries"][key]
                for name in by_entry[key]:
                    seal(name, crcs.get(name, 0), written.get(name, 0))
                if (part_views or {}).get(key):
                    _check_part_views(fd, records[by_entry[key][0]][0], erec, part_views[key], check_leaf_bytes,
                                      fingerprint.raw_fp(erec))
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _check_part_views(fd: int, start: int, erec: dict, views: list, check_leaf_bytes, entry_fp: str) -> None:
    """Check the views of part of one entry against their own raw fingerprints, reading the entry's bytes
    back from the file just written (a read-only, file-backed map: no anonymous copy of the entry)."""
    import mmap

    lo, hi = erec["data_offsets"]
    nbytes = hi - lo
    if nbytes == 0:
        for leaf, lrec in views:
            check_leaf_bytes(b"", erec, lrec, leaf, entry_fp)
        return
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, start - aligned + nbytes, offset=aligned, access=mmap.ACCESS_READ)
    buf = memoryview(mm)[start - aligned:]
    for leaf, lrec in views:
        check_leaf_bytes(buf, erec, lrec, leaf, entry_fp)
    del buf  # the map is closed when the last view of it goes


__all__ = ["write_torch_file"]
