"""A tensor leaf of the state tree against its entry's bytes: the checks every reader runs (pure, no I/O).

The manifest's ``tensors`` record of a leaf says what it is (kind, dtype, shape, a view's offset and
strides, its raw fingerprint); the entry it points at is raw bytes in a tensors member. What is checked
here is whether the one can be rebuilt from the other as the record says (docs/FORMAT.md, "Tensor
records"): the trial reload (:mod:`ckpt_archive.repo.trial_reload`), ``load``
(:class:`~ckpt_archive.repo.reader.ArchiveReader`), ``restore`` and the policy audit run the same
functions, so a generation they read is the one the trial reload proved. Tensors are checked as bytes
with NumPy: ``import torch`` is needed only for a dtype newer than :data:`TORCH_ITEMSIZE`.
"""
from __future__ import annotations

import math
import re

from ckpt_archive.errors import IntegrityError, TooLargeHere
from ckpt_archive.format import fingerprint
from ckpt_archive.format.limits import view_size_problem
from ckpt_archive.format.tensor_bytes import NUMPY_TO_ST, TORCH_TO_ST

#: Element size of every torch dtype by name, so tensors are checked without importing torch.
TORCH_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex32": 4, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}


class SizeOnly:
    """Stands for an entry's bytes when only their number matters (:meth:`ArchiveReader.iter_entries`
    with ``sizes_only``): ``len()`` and ``nbytes`` give the length; there is no buffer."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


#: A NumPy array's plain numeric dtype as its record writes it (``dtype.str``: ``<u4``, ``|b1``, ``<c16``): the
#: digits are the item size in bytes. Told without importing NumPy (~0.1 s), which ``inspect`` paid for the
#: ``np.random.get_state()`` array of an RNG state (issue 29); any other dtype string asks NumPy.
_NUMPY_PLAIN = re.compile(r"[<>|=]?[fiucb]([0-9]{1,2})")


def _itemsize(dtype: str, kind: str) -> int:
    if kind == "numpy":
        plain = _NUMPY_PLAIN.fullmatch(dtype) if isinstance(dtype, str) else None
        if plain and int(plain.group(1)) in (1, 2, 4, 8, 16):
            return int(plain.group(1))
        import numpy as np

        return np.dtype(dtype).itemsize
    size = TORCH_ITEMSIZE.get(dtype)
    if size is None:  # a dtype newer than this table: ask torch (the only path that imports it)
        from ckpt_archive.format.tensor_bytes import torch_dtype

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
        buf: the entry's raw bytes (bytes-like, or :class:`SizeOnly`).
        erec: the entry's record (member ``entries``); lrec: the leaf's record (manifest ``tensors``).
        leaf: the leaf's key (for messages). entry_fp: the entry's raw fingerprint, known to hold for
            ``buf`` or checked by the caller.
    """
    nbytes = buf.nbytes if isinstance(buf, SizeOnly) else (len(memoryview(buf).cast("B")) if len(buf) else 0)
    whole = check_leaf_geometry(erec, lrec, leaf, nbytes)
    view = lrec.get("view")
    if whole:  # the leaf's bytes are the entry's: its fingerprint is the entry's
        check_leaf_fp(lrec, leaf, entry_fp or fingerprint.digest_like(buf, fingerprint.raw_fp(lrec)))
    else:
        import numpy as np  # only views need it (the policy audit of small leaves does not import it)

        size = _itemsize(lrec["dtype"], lrec["kind"])
        shape = [int(x) for x in lrec["shape"]]
        offset, stride = int(view["storage_offset"]), [int(s) for s in view["stride"]]
        want = fingerprint.raw_fp(lrec)
        if math.prod(shape):
            too_large = view_size_problem(math.prod(shape) * size, nbytes)
            if too_large:
                raise TooLargeHere(too_large, where=leaf)
            elems = np.frombuffer(buf, dtype=np.uint8)[:(nbytes // size) * size].view(f"V{size}")
            view_ = np.lib.stride_tricks.as_strided(elems[offset:], shape=shape, strides=[s * size for s in stride],
                                                    writeable=False)
            # hashed piece by piece: a view's logical bytes may be any multiple of its entry's (stride 0)
            got = fingerprint.digest_pieces(fingerprint.view_pieces(
                view_, size, lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8)), fingerprint.split(want)[0])
        else:
            got = fingerprint.digest_like(b"", want)
        check_leaf_fp(lrec, leaf, got)


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
    if not view:
        _check_plain_leaf(erec, kind, dtype, shape, leaf, nbytes)
        return True
    return _check_view_leaf(erec, lrec, leaf, nbytes)


def _check_plain_leaf(erec: dict, kind: str, dtype: str, shape: list[int], leaf: str, nbytes: int) -> None:
    """A leaf that is its whole entry: dtype, shape and byte count as the entry's.

    Raises:
        IntegrityError: they differ, or the dtype has no safetensors code (names the leaf).
    """
    size = _itemsize(dtype, kind)
    numel = math.prod(shape)
    st_of = NUMPY_TO_ST if kind == "numpy" else TORCH_TO_ST
    try:
        if kind == "numpy" and dtype not in NUMPY_TO_ST:  # a table key is its own np.dtype(...).str: no NumPy
            import numpy as np

            dtype_str = np.dtype(dtype).str
        else:
            dtype_str = dtype
        want_st = st_of.get(dtype_str)
    except TypeError:
        raise IntegrityError(f"dtype {dtype!r} is not a NumPy dtype", where=leaf) from None
    want_shape = shape
    if want_st is None and kind == "numpy":  # the writer keeps such an array as raw bytes (U8)
        want_st, want_shape = "U8", [numel * size]
    if want_st is None:  # the writer keeps such a tensor as a view of raw bytes, never plain
        raise IntegrityError(f"dtype {dtype} has no safetensors code: it cannot be a plain entry", where=leaf)
    if want_st != erec.get("dtype"):
        raise IntegrityError(f"dtype {dtype} != entry dtype {erec.get('dtype')}", where=leaf)
    if want_shape != list(erec.get("shape", want_shape)):
        raise IntegrityError(f"shape {shape} != entry shape {erec.get('shape')}", where=leaf)
    if numel * size != nbytes:
        raise IntegrityError(f"shape {shape} of {dtype} needs {numel * size} bytes, the entry has {nbytes}",
                             where=leaf)


def _check_view_dtype(erec: dict, view: dict, dtype: str, leaf: str) -> str | None:
    """A view's dtype against its entry's: the writer keeps views of one dtype over an entry of that dtype,
    and views of several dtypes (or of one with no safetensors code) over raw bytes (uint8); any other
    pairing is a reinterpretation.

    Returns:
        the view's recorded ``entry_dtype`` (None when not recorded).

    Raises:
        IntegrityError: a reinterpretation, or an ``entry_dtype`` that is not the entry's (names the leaf).
    """
    entry_dtype = view.get("entry_dtype")
    if entry_dtype is not None and TORCH_TO_ST.get(entry_dtype, erec.get("dtype")) != erec.get("dtype"):
        raise IntegrityError(f"view's entry dtype {entry_dtype} != entry dtype {erec.get('dtype')}", where=leaf)
    typed = entry_dtype if entry_dtype is not None else next(
        (k for k, v in TORCH_TO_ST.items() if v == erec.get("dtype")), None)
    if typed not in (None, "uint8") and dtype != typed:
        raise IntegrityError(f"a {dtype} view of a {typed} entry", where=leaf)
    return entry_dtype


def _check_view_leaf(erec: dict, lrec: dict, leaf: str, nbytes: int) -> bool:
    """A leaf that is a view of its entry: the view's dtype against the entry's, its offset and strides inside
    the entry's ``nbytes``.

    Returns:
        True when the view is the whole entry (see :func:`check_leaf_geometry`).

    Raises:
        IntegrityError: a reinterpretation, or a view reaching outside its storage (names the leaf).
    """
    kind, dtype, shape = lrec["kind"], lrec["dtype"], [int(x) for x in lrec["shape"]]
    view = lrec["view"]
    size = _itemsize(dtype, kind)
    numel = math.prod(shape)
    entry_dtype = _check_view_dtype(erec, view, dtype, leaf)
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


__all__ = ["TORCH_ITEMSIZE", "SizeOnly", "check_leaf_bytes", "check_leaf_fp", "check_leaf_geometry", "check_tree_kinds"]
