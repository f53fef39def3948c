"""The canonical form of data ids (``--data-ids``): JSON with sorted keys, and its sha256 fingerprint.

The same map in another key order (a label map rebuilt from a set, whose iteration order changes between
interpreter runs) is the same data identity, so it must give the same bytes and the same fingerprint.
The member ``data-ids.json`` is written in this form; archives written before it hold the ids as given
(their fingerprint is the sha256 of those bytes and still verifies: it is the member's raw sha256).
Comparing identities (:mod:`ckpt_archive.ops.data_identity`) never relies on stored bytes' key order.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any


def plain_keys(value: Any) -> Any:
    """``value`` with every dict key a string (as JSON writes it), so keys of mixed types sort; lists and
    tuples become lists, everything else is returned as is. Never raises (recursion on a cycle aside)."""
    if isinstance(value, dict):
        return {str(k): plain_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_keys(v) for v in value]
    return value


def canonical_bytes(data_ids: Any) -> bytes:
    """The canonical JSON of ``data_ids``: keys sorted (as strings), compact separators, UTF-8.

    Raises:
        ValueError: a non-finite float (strict JSON has none).
        TypeError: a value JSON cannot hold.

    Example:
        >>> canonical_bytes({"b": 1, "a": [2, {"d": 0, "c": 1}]})
        b'{"a":[2,{"c":1,"d":0}],"b":1}'
    """
    return json.dumps(plain_keys(data_ids), allow_nan=False, ensure_ascii=False, sort_keys=True,
                      separators=(",", ":")).encode("utf-8")


def fingerprint(data_ids: Any) -> str:
    """sha256 (hex) of :func:`canonical_bytes`: the canonical data-ids fingerprint."""
    return hashlib.sha256(canonical_bytes(data_ids)).hexdigest()


__all__ = ["canonical_bytes", "fingerprint"]
