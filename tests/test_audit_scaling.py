"""Issue 29: the policy audit's read of small tensors (ops/audit_read.py) is linear in the number of tensors.

A break test found ``verify`` and ``inspect`` quadratic: 10k tiny tensors 7.5 s, 20k 33 s, 60k 204 s, 29 s of 37 s
in one list comprehension of ``_decode_small`` that rebuilt a set of every fast key once per key. Speed is never
asserted by a timed test: these count the hash and equality operations made on the tensor keys instead.
"""
from __future__ import annotations

import torch

import ckpt_archive
from ckpt_archive.ops import audit_read


class _CountedKey(str):
    """A tensor key that counts every hash and comparison made on it (both are per-key work)."""

    ops = 0

    def __hash__(self):
        _CountedKey.ops += 1
        return str.__hash__(self)

    def __eq__(self, other):
        _CountedKey.ops += 1
        return str.__eq__(self, other)

    __ne__ = lambda self, other: not self.__eq__(other)  # noqa: E731


def _key_ops(tmp_path, n, monkeypatch):
    g = torch.Generator().manual_seed(0)
    src = tmp_path / f"n{n}.pt"
    torch.save({"model": {f"layer{i}.w": torch.randn(3, generator=g) for i in range(n)}}, src)
    repo = tmp_path / f"r{n}"
    ckpt_archive.pack(src, repo)
    real = audit_read._decode_small
    calls = []

    def counted(reader, tree, keys, recs):
        calls.append(len(keys))
        _CountedKey.ops = 0
        out = real(reader, tree, [_CountedKey(k) for k in keys], recs)
        calls.append(_CountedKey.ops)
        return out

    monkeypatch.setattr(audit_read, "_decode_small", counted)
    info: dict = {}
    audit_read.state_for_audit(repo, info=info)
    assert info["small_tensors_decoded"] == n and calls[0] == n, (info, calls)
    return calls[1]


def test_small_tensors_for_the_audit_are_read_in_linear_operations(tmp_path, monkeypatch):
    """Guards against the audit's small-tensor read doing work per key that grows with the number of keys
    (a set of every fast key rebuilt for each key: N^2 hashes, 29 s of a 37 s ``verify`` at 20k tensors): the
    hash/equality operations on the keys stay a small constant per tensor, at 1500 tensors as at 500."""
    small, large = _key_ops(tmp_path, 500, monkeypatch), _key_ops(tmp_path, 1500, monkeypatch)
    assert large <= 30 * 1500, (small, large)
    assert large <= 4 * small, (small, large)  # linear: 3x the tensors, about 3x the operations (N^2 gives 9x)
