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
