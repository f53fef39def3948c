"""[issue 29] Encode a state read without torch (:mod:`ckpt_archive.format.pt_pickle`) exactly as
:func:`ckpt_archive.format.state_tree.encode` encodes what ``torch.load`` gives for the same file.

:func:`encode` is ``state_tree.encode`` with one more leaf type, :class:`~ckpt_archive.format.pt_pickle.PtTensor`:
the walk, the sharing, the refusals and every non-tensor node are state_tree's own code; only the
tensor grouping of :meth:`_TorchFreeEncoder.finish_tensors` is restated for tensors described by
(storage key, offset, shape, stride) instead of live torch tensors, rule for rule:

* tensors are grouped by storage (a storage of 0 bytes never groups: ``torch.load`` gives each reference
  its own), groups in the order their first tensor was met;
* a group of one tensor, or of tensors of the same geometry, that covers its storage contiguously from
  offset 0 (C strides when empty) and whose dtype safetensors names, is a *natural* entry under the first
  tensor's key; the others view it;
* any other group is one flat entry ``storage/<n>:<first key>`` of the storage's bytes (its dtype, or
  bytes when safetensors has no name for it) that every tensor views with its offset and strides.

States with torch tensors go through ``state_tree``'s own grouping unchanged (this encoder is pack's for
both). ``tests/test_torch_free.py`` checks tree, tensor records and entries against the torch path.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ckpt_archive.format.pt_pickle import ITEMSIZE, PtStorage, PtTensor
from ckpt_archive.format.state_tree import Encoder, Entry, TensorTable
from ckpt_archive.format.tensor_bytes import TORCH_TO_ST, c_strides, check_view_size


@dataclasses.dataclass
class FileEntry(Entry):
    """An entry whose bytes are one storage record of the source file, as they lie there: ``file_offset``
    in the file of ``file_identity``. [issue 29] Its raw fingerprint is the one the file's scan takes of
    that range (:meth:`ckpt_archive.format.exact_bytes.ScanJob.range_fp`): the bytes are hashed once, while
    they are read, and a frozen tensor already stored is not read again at all."""

    file_identity: Any = None
    file_offset: int = 0


def _file_entry(key: str, st_dtype: str, shape: list, storage: PtStorage) -> FileEntry:
    return FileEntry(key, st_dtype, shape, lambda st=storage: st.file.view(st.offset, st.nbytes), storage.nbytes,
                     file_identity=storage.file.identity, file_offset=storage.offset)


class _TorchFreeEncoder(Encoder):
    def _leaf_types(self) -> tuple:
        return super()._leaf_types() + (PtTensor,)

    def _enc(self, obj: Any, path: tuple) -> Any:
        if type(obj) is PtTensor:
            key = self._leaf_key(path)
            self._tensor_leaves.append((key, obj))
            return {"$t": "tensor", "key": key}
        return super()._enc(obj, path)

    def finish_tensors(self) -> None:
        if not any(type(t) is PtTensor for _, t in self._tensor_leaves):
            return super().finish_tensors()
        if not all(type(t) is PtTensor for _, t in self._tensor_leaves):
            raise TypeError("a state mixes tensors read without torch and torch tensors")
        self.table = _group(self._tensor_leaves, self.table)


def _natural(t: PtTensor) -> bool:
    n = t.numel()
    return (t.is_contiguous() and t.offset == 0 and n * t.element_size() == t.storage.nbytes
            and (n > 0 or list(t.stride) == c_strides(t.shape)))


def _group(leaves: list[tuple[str, PtTensor]], table: TensorTable) -> TensorTable:
    """state_tree's ``finish_tensors`` for :class:`PtTensor` leaves (see the module docstring)."""
    n_shared = 0
    for views in _by_storage(leaves):
        t0 = views[0][1]
        same_geometry = all(t.dtype == t0.dtype and t.shape == t0.shape and t.stride == t0.stride
                            and t.offset == t0.offset for _, t in views)
        if (len(views) == 1 or same_geometry) and _natural(t0) and t0.dtype in TORCH_TO_ST:
            _add_natural(table, views)
        else:
            n_shared += 1
            _add_shared(table, views, n_shared)
    return table


def _by_storage(leaves: list[tuple[str, PtTensor]]) -> list[list[tuple[str, PtTensor]]]:
    """The leaves grouped by the storage they view (each empty storage a group of its own), in first-seen
    order."""
    groups: dict[tuple, list[tuple[str, PtTensor]]] = {}
    for key, t in leaves:
        st = t.storage
        gid = ("cpu", st.key, st.nbytes) if st.nbytes > 0 else ("empty", key)
        groups.setdefault(gid, []).append((key, t))
    return list(groups.values())


def _add_natural(table: TensorTable, views: list[tuple[str, PtTensor]]) -> None:
    """Natural: the first tensor's bytes are its whole storage, i.e. its record of the file; the other
    views (same geometry) point at its entry."""
    key0, t0 = views[0]
    dname = t0.dtype
    table.entries[key0] = _file_entry(key0, TORCH_TO_ST[dname], [int(x) for x in t0.shape], t0.storage)
    for i, (key, t) in enumerate(views):
        rec = {"entry": key0, "kind": "torch", "dtype": dname, "shape": [int(x) for x in t.shape]}
        if i > 0:
            rec["view"] = {"storage_offset": 0, "stride": [int(s) for s in t.stride]}
            table.leaf_bytes[key] = t.contiguous_pieces
        table.leaves[key] = rec


def _add_shared(table: TensorTable, views: list[tuple[str, PtTensor]], n_shared: int) -> None:
    """A storage entry ``storage/<n>:<first key>`` of the whole storage (its dtype, or uint8 where that has
    no safetensors dtype or does not divide the bytes), every tensor a view of it."""
    key0, t0 = views[0]
    nbytes_storage = t0.storage.nbytes
    fname, itemsize = t0.dtype, ITEMSIZE[t0.dtype]  # one dtype per storage (pt_pickle refuses another)
    if fname not in TORCH_TO_ST or nbytes_storage % itemsize:
        fname, itemsize = "uint8", 1
    entry_key = f"storage/{n_shared}:{key0}"
    table.entries[entry_key] = _file_entry(entry_key, TORCH_TO_ST[fname], [nbytes_storage // itemsize], t0.storage)
    for key, t in views:
        check_view_size(key, t.numel() * t.element_size(), nbytes_storage)
        table.leaves[key] = {"entry": entry_key, "kind": "torch", "dtype": t.dtype,
                             "shape": [int(x) for x in t.shape],
                             "view": {"storage_offset": int(t.offset), "stride": [int(s) for s in t.stride],
                                      "entry_dtype": fname}}
        table.leaf_bytes[key] = t.contiguous_pieces


def encode(state: Any, *, allow=None) -> tuple[Any, TensorTable]:
    """:func:`ckpt_archive.format.state_tree.encode`, also for states holding
    :class:`~ckpt_archive.format.pt_pickle.PtTensor` (same returns and errors)."""
    from ckpt_archive.format import state_tree

    return state_tree.encode(state, allow=allow, encoder=_TorchFreeEncoder)


__all__ = ["FileEntry", "encode"]
