"""A tensor's bytes and dtype as this format stores them (the tensor side of the state tree's contract).

* dtype names: torch's and NumPy's names against safetensors' (:data:`TORCH_TO_ST`, :data:`NUMPY_TO_ST`,
  :data:`FLOAT_ST`), and a torch dtype back from its name, refusing any other attribute (:func:`torch_dtype`);
* bytes out: a tensor's contiguous CPU bytes (:func:`tensor_u8`, in pieces for a view's fingerprint:
  :func:`tensor_u8_pieces`), the whole storage under it (:func:`storage_u8`), as ``torch.save`` stores them:
  a conj/neg view gives its physical bytes (:func:`physical`);
* the lazy view bits ``torch.save`` keeps (:data:`VIEW_BITS`): read (:func:`view_bits`), refusing one this
  format does not know, and put back (:func:`apply_view_bits`);
* geometry: C-order strides (:func:`c_strides`), a view no larger than its storage and this machine's memory
  (:func:`check_view_size`), and a 0-element tensor to ``.set_()`` a storage into (:func:`empty_tensor`).

:mod:`ckpt_archive.format.state_tree` encodes with these; :mod:`ckpt_archive.format.leaves` builds leaves
back with them. torch is imported inside the functions that need it.
"""
from __future__ import annotations

from ckpt_archive.errors import FormatError, SourceError


def _torch():
    import torch

    return torch


# torch dtype name -> safetensors dtype string (safetensors spec, "dtype" field).
TORCH_TO_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
# numpy dtype.str (native little-endian forms) -> safetensors dtype string
NUMPY_TO_ST = {
    "<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32", "<i2": "I16", "|i1": "I8",
    "|u1": "U8", "|b1": "BOOL", "<u2": "U16", "<u4": "U32", "<u8": "U64", "<c8": "C64",
}
FLOAT_ST = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 4}


#: The lazy view bits ``torch.save`` keeps (``torch._utils.get_tensor_metadata``) and this format records.
VIEW_BITS = ("conj", "neg")


def view_bits(t) -> dict:
    """The lazy view bits of a dense tensor that ``torch.save`` keeps: ``{"conj": True}`` for an unresolved
    conjugate view, ``{"neg": True}`` for a negative view (``torch._utils.get_tensor_metadata``).

    Raises:
        SourceError: torch reports a bit this format does not know (a newer torch): refused, not dropped.
    """
    torch = _torch()
    bits = {k: bool(v) for k, v in torch._utils.get_tensor_metadata(t).items() if v}
    unknown = sorted(set(bits) - set(VIEW_BITS))
    if unknown:
        raise SourceError(f"tensor carries view metadata {unknown} that this format cannot record",
                          hint="resolve it before saving (e.g. t.clone())")
    return bits


def empty_tensor(dtype, device="cpu"):
    """A 0-element tensor of ``dtype`` for ``.set_()`` that allocates and fills nothing.

    ``torch.empty(0, dtype=...)`` runs the deterministic fill when a training script turned on
    ``torch.use_deterministic_algorithms(True)``, and that fill has no kernel for ``uint1``-``uint7``,
    ``int1``-``int7`` (``"fill_empty_deterministic_" not implemented for 'UInt4'``): a pack or restore in such
    a process crashed. A view of an empty ``uint8`` tensor runs no kernel. On the CPU unless ``device`` says
    otherwise, whatever default device the caller set (``torch.set_default_device("meta")`` made the copies of
    a Checkpointer's save meta tensors, which verify passed: break test).
    """
    torch = _torch()
    base = torch.empty(0, dtype=torch.uint8, device=device)
    return base if dtype == torch.uint8 else base.view(dtype)


def physical(t):
    """``t`` without its lazy conj/neg bits: the same storage, offset, shape and strides, i.e. the bytes
    as they lie in memory (what ``torch.save`` writes for such a view). ``t`` itself when it has none."""
    torch = _torch()
    if not (t.is_conj() or t.is_neg()):
        return t
    with torch.no_grad():
        return empty_tensor(t.dtype, t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def apply_view_bits(t, bits: dict):
    """Put recorded conj/neg bits back on a tensor built from the physical bytes (a new alias of it, as
    ``torch.load`` gives: ``is_conj()`` / ``is_neg()`` true, same storage).

    Raises:
        FormatError: a bit name this reader does not know (hostile or newer archive).
    """
    if not bits:
        return t
    if not isinstance(bits, dict) or any(k not in VIEW_BITS or v is not True for k, v in bits.items()):
        raise FormatError(f"unknown tensor view bits {bits!r}")
    torch = _torch()
    t = t.detach()  # a new alias: the shared base tensor keeps no bits
    torch._utils.set_tensor_metadata(t, dict(bits))
    return t


def tensor_u8_pieces(t):
    """:func:`tensor_u8`'s bytes as an iterable of uint8 pieces of at most ``fingerprint.VIEW_PIECE_BYTES``
    each, in C order (a view's own bytes for its fingerprint, never gathered whole: a stride of 0 makes its
    logical bytes any multiple of its storage's)."""
    from ckpt_archive.format.fingerprint import view_pieces

    t = physical(t.detach())
    return view_pieces(t, t.element_size(), tensor_u8)


def check_view_size(key: str, logical: int, stored: int) -> None:
    """[break] Refuse a source's view larger than its storage and than this machine's memory
    (:func:`ckpt_archive.format.limits.view_size_problem`).

    Raises:
        SourceError: names the leaf.
    """
    from ckpt_archive.format.limits import view_size_problem

    problem = view_size_problem(logical, stored)
    if problem:
        raise SourceError(f"{problem}: nothing could use it here", where=key)


def tensor_u8(t):
    """Contiguous CPU bytes of a tensor as a 1-D uint8 NumPy array (no copy when already contiguous).

    A conj/neg view gives its physical bytes (:func:`physical`), as ``torch.save`` stores them.

    Raises:
        what torch raises copying a tensor off its device (a meta tensor has no bytes).
    """
    torch = _torch()
    t = physical(t.detach())
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        import numpy as np

        return np.zeros(0, dtype=np.uint8)
    # [break] contiguous by torch's rule, a dim of size 1 may keep any stride (a (1, 1) slice of a transposed
    # weight has strides (1, 7)), and view(uint8) needs a last stride of 1: its elements lie in C order at
    # unit stride, so flatten it as such
    t = t.as_strided((t.numel(),), (1,))
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(torch.uint8).numpy()


def storage_u8(t):
    """The whole untyped storage under ``t`` as a 1-D uint8 NumPy array (CPU; copied off another device).

    Raises:
        what torch raises copying a storage off its device.
    """
    torch = _torch()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.numpy()


def c_strides(shape) -> list[int]:
    """The strides, in elements, of a C-contiguous tensor of ``shape`` (a sequence of ints; 0-sized
    dimensions count as 1, as torch strides them). Never raises for a sequence of integers."""
    out, acc = [], 1
    for n in reversed([int(x) for x in shape]):
        out.append(acc)
        acc *= max(n, 1)
    return out[::-1]


def torch_dtype(name: str):
    """torch dtype from its name (``"bfloat16"``).

    Raises:
        FormatError: not the name of a torch dtype (a hostile or newer archive).
    """
    torch = _torch()
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise FormatError(f"unknown torch dtype {name!r}")
    return dt


__all__ = ["TORCH_TO_ST", "NUMPY_TO_ST", "FLOAT_ST", "VIEW_BITS", "view_bits", "empty_tensor", "physical",
           "apply_view_bits", "tensor_u8", "tensor_u8_pieces", "storage_u8", "check_view_size", "c_strides",
           "torch_dtype"]
