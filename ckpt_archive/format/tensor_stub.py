"""A stand-in for an archived tensor that was not decoded: its manifest record's shape and dtype.

Readers that need the structure of a state but not its bulk (the policy audit reads step counters and
LRs, never the weights) put a :class:`TensorStub` where a tensor was left in its member. Analyses treat
it as a tensor of that shape (``shape``, ``dtype``, ``numel()``, ``dim()``) and never see its values.
"""
from __future__ import annotations

import math


class TensorStub:
    """Stands for an archived tensor that was not decoded (only its manifest record: shape, dtype).

    Args:
        rec: the manifest's ``tensors[key]`` record (``shape``: list of ints, ``dtype``: str, ``kind``).
    """

    def __init__(self, rec: dict):
        self.shape = tuple(int(x) for x in rec.get("shape", ()))
        self.dtype = rec.get("dtype")
        self.kind = rec.get("kind")

    def numel(self) -> int:
        """Number of elements (the product of ``shape``)."""
        return math.prod(self.shape)

    def dim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def __repr__(self) -> str:
        return f"TensorStub(shape={list(self.shape)}, dtype={self.dtype})"


#: torch dtype name -> the NumPy dtype that holds its values exactly (bfloat16 widens to float32)
_NUMPY_OF = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<f4", "int64": "<i8",
             "int32": "<i4", "int16": "<i2", "int8": "i1", "uint8": "u1", "uint16": "<u2", "uint32": "<u4",
             "uint64": "<u8", "bool": "?", "complex64": "<c8", "complex128": "<c16"}
_STORED_AS = {"bfloat16": "<u2"}


class SmallTensor(TensorStub):
    """[issue 29] A small archived tensor decoded without torch: its shape, dtype name and values.

    The policy audit reads step counters and tensor LRs (a few elements each); building them as torch
    tensors cost ``import torch`` (~1 s of CPU) for every ``verify`` and ``inspect``. Analyses use
    ``numel()``, ``item()``, ``tolist()``, ``float()`` / ``int()`` as for a tensor; it stays a
    :class:`TensorStub` for code that tells tensors' structure apart from their values.

    Args:
        rec: the manifest's ``tensors[key]`` record.
        values: a NumPy array of the leaf's shape holding its values exactly (bfloat16 as float32).
    """

    def __init__(self, rec: dict, values):
        super().__init__(rec)
        self.values = values

    @staticmethod
    def numpy_dtype(dtype: str) -> str | None:
        """The NumPy dtype that holds a torch dtype's values exactly, or None (float8 and the like)."""
        return _NUMPY_OF.get(dtype)

    @classmethod
    def from_bytes(cls, rec: dict, raw) -> "SmallTensor":
        """From the leaf's contiguous raw bytes (C order, little-endian, as the archive stores them).

        Raises:
            ValueError: a dtype :meth:`numpy_dtype` does not know, or bytes of another length.
        """
        import numpy as np

        dtype = rec.get("dtype")
        if _NUMPY_OF.get(dtype) is None:
            raise ValueError(f"no NumPy dtype holds {dtype}")
        arr = np.frombuffer(bytes(raw), dtype=_STORED_AS.get(dtype, _NUMPY_OF[dtype]))
        if dtype == "bfloat16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        return cls(rec, arr.reshape([int(x) for x in rec.get("shape", ())]).copy())

    def is_floating_point(self) -> bool:
        return str(self.dtype).startswith(("float", "bfloat"))

    def item(self):
        """The one element as a Python number (``Tensor.item()``).

        Raises:
            ValueError: more or fewer than one element.
        """
        if self.values.size != 1:
            raise ValueError("only one element tensors can be converted to Python scalars")
        return self.values.reshape(-1)[0].item()

    def tolist(self):
        return self.values.tolist()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __repr__(self) -> str:
        return f"SmallTensor(shape={list(self.shape)}, dtype={self.dtype}, values={self.values.tolist()})"
