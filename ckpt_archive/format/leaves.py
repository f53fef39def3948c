"""A tensor leaf built back from its stored entry: the decoding half of a leaf's bytes (pure, no I/O).

A manifest's ``tensors`` record of a leaf says how it comes back from the raw bytes of the entry it points at
(docs/FORMAT.md, "Tensor records"): the entry as a tensor of its stored dtype and shape (:func:`entry_tensor`),
then the leaf over it -- itself, or a view of its storage with its own dtype, offset and strides, its
conj/neg bits, ``nn.Parameter`` and ``requires_grad`` (:func:`leaf_from_base`). ``load``
(:class:`~ckpt_archive.repo.reader.ArchiveReader`) and the one-pass ``torch.save`` restore
(:mod:`ckpt_archive.ops.restore_torch`) build leaves with these; whether bytes *may* be built so is
:mod:`ckpt_archive.format.leaf_checks`'s question.
"""
from __future__ import annotations

from ckpt_archive.format.tensor_bytes import apply_view_bits, empty_tensor, torch_dtype


def entry_tensor(buf: bytearray, erec: dict, lrec: dict):
    """The stored entry as a tensor/ndarray (flat for shared storages): a view of ``buf``, no copy, unless the
    entry is misaligned for its dtype (then copied into an aligned buffer first).

    Args:
        buf: the entry's raw bytes (writable, bytes-like; already checked against its fingerprint or about to be).
        erec: the entry's record (``shape``). lrec: a leaf's record viewing it (``kind``, ``dtype``, and for
            a view whose entry is stored in another dtype ``view.entry_dtype``).

    Returns:
        a NumPy array (``kind`` numpy: ``lrec``'s dtype and shape) or a torch tensor of the entry's shape and dtype.

    Raises:
        FormatError: an unknown torch dtype name. What NumPy or torch raise for bytes that do not fit the shape
        (callers report it as damage).
    """
    import numpy as np

    if lrec["kind"] == "numpy":
        return np.frombuffer(buf, dtype=np.dtype(lrec["dtype"])).reshape(lrec["shape"]) if buf else \
            np.zeros(lrec["shape"], dtype=np.dtype(lrec["dtype"]))
    import torch

    view = lrec.get("view")
    dname = view.get("entry_dtype", lrec["dtype"]) if view and "entry_dtype" in view else lrec["dtype"]
    dt = torch_dtype(dname)
    if len(buf) == 0:
        return torch.empty(erec["shape"], dtype=dt, device="cpu")
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    # A safetensors entry starts wherever the previous one ended: a flat byte entry viewed as complex128
    # (or any entry of a wider dtype) may be misaligned, and torch kernels then crash (SIGSEGV on
    # clone). Such an entry is copied into an aligned buffer first.
    align = 16 if dt.itemsize == 1 and lrec["dtype"] != dname else dt.itemsize
    if raw.data_ptr() % align:
        raw = raw.clone()
    if dt.is_complex:
        real = raw.view(torch.float32 if dt == torch.complex64 else torch.float64)
        return torch.view_as_complex(real.reshape(-1, 2)).reshape(erec["shape"])
    return raw.view(dt).reshape(erec["shape"])


def leaf_from_base(base, lrec: dict):
    """The leaf a record describes, over the tensor of its entry (:func:`entry_tensor`): ``base`` itself, or
    a view of its storage (``view``: storage offset and stride in elements, the leaf's dtype and shape), with
    its conj/neg bits, ``nn.Parameter`` and ``requires_grad`` put back.

    Raises:
        FormatError: unknown view bits or dtype name. What torch raises for a view that does not fit the
        storage (callers report it as damage).
    """
    view = lrec.get("view")
    if lrec["kind"] == "numpy" or not view:
        t = base
    else:
        dt = torch_dtype(lrec["dtype"])
        t = empty_tensor(dt).set_(base.untyped_storage(), view["storage_offset"], lrec["shape"], view["stride"])
    if lrec.get("bits") and lrec["kind"] == "torch":  # an unresolved conj / neg view: the bytes are physical, the bits come back
        t = apply_view_bits(t, lrec["bits"])
    if lrec.get("parameter"):
        import torch

        t = torch.nn.Parameter(t, requires_grad=bool(lrec.get("requires_grad")))
    elif lrec.get("requires_grad"):
        t.requires_grad_(True)
    return t


def fp_words(fp: str) -> str:
    """How a mismatch of ``fp`` (``"<alg>:<hex>"``) is worded: ``"sha256"`` for format 1's fingerprints (the
    wording callers and tests key on), ``"fingerprint"`` for the others.

    Example:
        >>> fp_words("sha256:00"), fp_words("blake3:00")
        ('sha256', 'fingerprint')
    """
    return "sha256" if fp.startswith("sha256:") else "fingerprint"


__all__ = ["entry_tensor", "leaf_from_base", "fp_words"]
