"""A state tree's ``rebuild`` node: torch's own allowlisted rebuild function (sparse, quantized, nested and
meta tensors) applied to its decoded arguments, as ``torch.load(weights_only=True)`` does, after the checks
a hostile archive calls for (docs/FORMAT.md "Reading hostile archives"). Used by
:func:`ckpt_archive.format.state_tree.decode`. Its own module because it is the one place where archive data
reaches a torch function that builds something (the allowlisted rebuild functions), so its checks sit together.
"""
from __future__ import annotations

from ckpt_archive.errors import MalformedTree
from ckpt_archive.format.allowlist import resolve_global


def _torch():
    import torch

    return torch


def rebuild(node: dict, dec, build: bool):
    """A non-dense tensor: torch's own allowlisted rebuild function applied to its decoded arguments,
    exactly what ``torch.load(weights_only=True)`` does for it."""
    name = node.get("f")
    if not isinstance(name, str) or not name.startswith("torch._utils._rebuild"):
        raise MalformedTree(f"rebuild node names {name!r}, not one of torch's tensor rebuild functions")
    func = resolve_global(name)
    args = [dec(a) for a in node.get("args") or []]
    if not build:
        return None
    if holds_stub(args):  # a reader that left parts undecoded (the policy audit): so is the whole
        from ckpt_archive.format.tensor_stub import TensorStub

        return TensorStub({"kind": "torch", "dtype": None, "shape": []})
    torch = _torch()
    if name == "torch._utils._rebuild_sparse_tensor":
        # what torch.load does for a sparse tensor, with the invariant checks always on: an archive is
        # hostile until checked, and indices out of range would be memory errors later
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            t = func(*args)
            try:
                torch._utils._validate_loaded_sparse_tensors()
            except (RuntimeError, ValueError, IndexError) as exc:
                raise MalformedTree(f"sparse tensor fails torch's invariant checks: {exc}") from None
    else:
        _check_rebuild_geometry(name, args)
        t = func(*args)
    if node.get("parameter"):
        t = torch.nn.Parameter(t, requires_grad=bool(node.get("requires_grad")))
    elif node.get("requires_grad") and not t.requires_grad:
        t.requires_grad_(True)
    return t


#: torch's rebuild functions whose first four arguments are (storage, storage_offset, size, stride)
_STORAGE_REBUILDS = ("torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2",
                     "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_qtensor")


#: tensor elements per storage element of the sub-byte quantized dtypes
_PACKED = {"torch.quint4x2": 2, "torch.quint2x4": 4}


def _check_rebuild_geometry(name: str, args: list) -> None:
    """Refuse a storage-backed rebuild whose size/stride/offset reach outside its storage, before torch
    is asked: ``_rebuild_qtensor`` allocates ``size`` first (a hostile size would be a huge allocation),
    the others fail inside torch. What the sizes of a meta tensor claim costs nothing, torch checks it."""
    if name not in _STORAGE_REBUILDS:
        return
    torch = _torch()
    storage, offset, size, stride = (list(args) + [None] * 4)[:4]
    ok_ints = (lambda xs: isinstance(xs, (list, tuple, torch.Size))
               and all(type(x) is int and x >= 0 for x in xs))
    if not isinstance(storage, torch.TypedStorage) or type(offset) is not int or offset < 0 \
            or not ok_ints(size) or not ok_ints(stride) or len(size) != len(stride):
        raise MalformedTree(f"malformed {name} node (storage, offset, size, stride)")
    if 0 in size:
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    # its elements (the public size() warns that TypedStorage is deprecated); sub-byte quantized dtypes
    # pack several tensor elements into one storage element
    have = storage._size() * _PACKED.get(str(storage.dtype), 1)
    if last >= have:
        raise MalformedTree(f"{name} node reaches element {last} of a storage of {have} elements")


def holds_stub(value) -> bool:
    """Whether decoded rebuild arguments hold a :class:`~ckpt_archive.format.tensor_stub.TensorStub`."""
    from ckpt_archive.format.tensor_stub import TensorStub

    if isinstance(value, TensorStub):
        return True
    if isinstance(value, (list, tuple)):
        return any(holds_stub(v) for v in value)
    if isinstance(value, dict):
        return any(holds_stub(v) for v in value.values())
    return False


__all__ = ["rebuild", "holds_stub"]
