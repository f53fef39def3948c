"""Metrics in the manifest: plain JSON values, readable by any JSON reader and by retention as they are.

Rule (docs/FORMAT.md, "Manifest"): ``metrics`` is a JSON object whose values are plain JSON: numbers,
strings, booleans, null, lists and objects with string keys. When packing,

* NumPy scalars become Python numbers (``np.float32(0.2)`` -> ``0.2`` as the float32 value, widened),
  NumPy booleans booleans, tuples lists;
* non-finite floats are stored as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (kept rather than
  refused: a metric that diverged is worth recording; retention's ``keep_best`` never counts a string
  as a number, as it never counted NaN);
* tensors are refused naming the metric (pass ``loss.item()``), and so is anything else JSON cannot
  hold (bytes, objects, non-string keys).

Manifests written before this rule (format 1 as first released, e.g. tests/fixtures/v1-basic) may hold
the state tree's tags in ``metrics`` (``{"$t": "npscalar", ...}``, ``{"$t": "float", "v": "nan"}``,
``{"$t": "int", "v": "..."}``). :func:`read_metrics` turns them into the same plain values; it is the one
place old tags are read (``Generation.metrics`` calls it), so retention and the CLI never decode tags.
"""
from __future__ import annotations

import math
from typing import Any

from ckpt_archive.errors import UsageError

_NON_FINITE = {"nan", "inf", "-inf"}


def _float(v: float) -> float | str:
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _plain(v: Any, path: str) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return _float(float(v))
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise UsageError(f"metric names must be strings, not {type(k).__name__} ({k!r})",
                                 where=f"metrics{path}")
            out[k] = _plain(x, f"{path}.{k}")
        return out
    if isinstance(v, (list, tuple)):
        return [_plain(x, f"{path}[{i}]") for i, x in enumerate(v)]
    module = type(v).__module__ or ""
    if module == "numpy" and getattr(v, "shape", None) == () and hasattr(v, "item"):
        item = v.item()  # a NumPy scalar or 0-d array: int / float / bool / complex / str / bytes
        if isinstance(item, (bool, int, float, str)):
            return _plain(item, path)
    raise UsageError(f"metric {path.lstrip('.') or '(top)'} is a {type(v).__name__}: metrics must be plain JSON "
                     f"values (numbers, strings, booleans, null, lists, objects)", where="metrics")


def metrics_to_json(metrics: Any) -> dict:
    """The ``metrics`` field of a new manifest, as plain JSON (see the module docstring).

    Args:
        metrics: a mapping of names to values (``None``: no metrics).

    Returns:
        a dict of plain JSON values (``json.dumps(..., allow_nan=False)`` works).

    Raises:
        SourceError: a tensor among the values (names it, says ``loss.item()``).
        UsageError: not a mapping, or a value JSON cannot hold (names it).
    """
    if metrics is None:
        return {}
    from ckpt_archive.format.state_tree import encode_value

    encode_value(metrics)  # refuses tensors with the message that names them and the fix
    if not isinstance(metrics, dict):
        raise UsageError("metrics must be a mapping of names to values (a JSON object)")
    return _plain(metrics, "")


def _read_tagged(node: Any) -> Any:
    if isinstance(node, list):
        return [_read_tagged(x) for x in node]
    if not isinstance(node, dict):
        return _float(node) if isinstance(node, float) else node
    t = node.get("$t")
    try:
        if t is None:
            return {k: _read_tagged(x) for k, x in node.items()}
        if t == "int":
            return int(node["v"])
        if t == "float":
            v = str(node["v"])
            return v if v in _NON_FINITE else _float(float(v))
        if t == "tuple":
            return [_read_tagged(x) for x in node["v"]]
        if t in ("dict", "odict"):
            items = [(k, _read_tagged(x)) for k, x in node["items"]]
            if all(isinstance(k, str) for k, _ in items):
                return dict(items)
        if t == "npscalar":
            return _read_npscalar(node)
    except (KeyError, TypeError, ValueError):
        pass
    return node  # a tag this reader does not turn into a plain value: shown as stored


def _read_npscalar(node: dict) -> Any:
    """An old tagged NumPy scalar as a plain number; ``node`` itself (shown as stored) when it is not one.

    Raises:
        KeyError / TypeError / ValueError: a malformed node (the caller shows it as stored).
    """
    import numpy as np

    arr = np.frombuffer(bytes.fromhex(node["hex"]), dtype=np.dtype(node["dtype"]))
    if arr.shape == (1,) and arr.dtype.kind in "biuf":
        item = arr[0].item()
        return _float(item) if isinstance(item, float) else item
    return node


def read_metrics(stored: Any) -> dict:
    """A manifest's ``metrics`` as plain JSON values, old tagged values included (see the module docstring).

    Args:
        stored: the manifest's ``metrics`` field (hostile: any JSON).

    Returns:
        a dict; a value this reader cannot make plain is returned as stored. Non-finite floats are the
        strings ``"nan"``, ``"inf"``, ``"-inf"``, as new manifests store them.
    """
    if not isinstance(stored, dict):
        return {}
    value = _read_tagged(stored)
    return value if isinstance(value, dict) else {}


__all__ = ["metrics_to_json", "read_metrics"]
