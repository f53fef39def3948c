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


#: torch dtype name -> ``struct`` format of one element (little-endian), as its values read exactly
_STRUCT_OF = {"float64": "d", "float32": "f", "float16": "e", "bfloat16": "H", "int64": "q", "int32": "i",
              "int16": "h", "int8": "b", "uint8": "B", "uint16": "H", "uint32": "I", "uint64": "Q", "bool": "?",
              "complex64": "ff", "complex128": "dd"}


class SmallTensor(TensorStub):
    """[issue 29] A small archived tensor decoded without torch (and without NumPy): its shape, dtype name
    and values as Python numbers.

    The policy audit reads step counters and tensor LRs (a few elements each); building them as torch
    tensors cost ``import torch`` (~1 s of CPU) for every ``verify`` and ``inspect``. Analyses use
    ``numel()``, ``item()``, ``tolist()``, ``float()`` / ``int()`` as for a tensor, with the values
    ``Tensor.item()`` gives (a bfloat16 or float16 value exactly, as a Python float); it stays a
    :class:`TensorStub` for code that tells tensors' structure apart from their values.

    Args:
        rec: the manifest's ``tensors[key]`` record.
        values: the elements in C order, as Python numbers.
    """

    def __init__(self, rec: dict, values: list):
        super().__init__(rec)
        self.values = values

    @staticmethod
    def readable(dtype: str) -> bool:
        """Whether :meth:`from_bytes` reads this torch dtype (not float8 and the like)."""
        return dtype in _STRUCT_OF

    @classmethod
    def from_bytes(cls, rec: dict, raw) -> "SmallTensor":
        """From the leaf's contiguous raw bytes (C order, little-endian, as the archive stores them).

        Raises:
            ValueError: a dtype :meth:`readable` refuses, or bytes of another length than the shape's.
        """
        import struct

        dtype = rec.get("dtype")
        if dtype not in _STRUCT_OF:
            raise ValueError(f"cannot read {dtype} values without torch")
        n = math.prod(int(x) for x in rec.get("shape", ()))
        flat = list(struct.unpack("<" + _STRUCT_OF[dtype] * n, bytes(raw)))
        if dtype == "bfloat16":  # the upper half of a float32
            flat = list(struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *(v << 16 for v in flat))))
        elif dtype.startswith("complex"):
            flat = [complex(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
        return cls(rec, flat)

    def is_floating_point(self) -> bool:
        return str(self.dtype).startswith(("float", "bfloat"))

    def item(self):
        """The one element as a Python number (``Tensor.item()``).

        Raises:
            ValueError: more or fewer than one element.
        """
        if len(self.values) != 1:
            raise ValueError("only one element tensors can be converted to Python scalars")
        return self.values[0]

    def tolist(self):
        """The values nested by ``shape`` (``Tensor.tolist()``; a number for a 0-d tensor)."""
        out = list(self.values)
        if not self.shape:
            return out[0]
        for size in reversed(self.shape[1:]):
            out = [out[i:i + size] for i in range(0, len(out), size)]
        return out

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __repr__(self) -> str:
        return f"SmallTensor(shape={list(self.shape)}, dtype={self.dtype}, values={self.values})"
