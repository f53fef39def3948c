"""Numbers and text for the policy modules: reading a number from a state, LR tolerance, formatting.

A checkpoint's LRs and counters come as floats, ints, 0-d tensors or NumPy scalars: :func:`as_number`
turns each into a Python number. Messages print values with :func:`fmt_value` (7 significant digits)
and :func:`fmt_pair` (two different values never print the same); JSON goes through :func:`jsonable`.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

#: Relative tolerance for "the same LR" between optimizer, scheduler ``_last_lr`` and session values.
#: torch writes the very same float in both places, so any real difference is far above this.
LR_RTOL = 1e-9

#: Relative tolerance between ``_last_lr`` and the closed-form LR: chainable (recursive) forms such as
#: ``CosineAnnealingLR.get_lr`` accumulate rounding over many steps.
DERIVED_RTOL = 1e-6


def fmt_value(v: Any) -> str:
    """Format a value for messages: floats with 7 significant digits (``0.001``, ``1e-05``); ``"-"`` for None."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.7g}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(fmt_value(x) for x in v)
        return f"({inner})" if isinstance(v, tuple) else f"[{inner}]"
    return str(v)


def fmt_pair(a: Any, b: Any) -> tuple[str, str]:
    """Format two values so that different values never print the same (falls back to ``repr``)."""
    fa, fb = fmt_value(a), fmt_value(b)
    if fa == fb and a != b:
        return repr(a), repr(b)
    return fa, fb


def jsonable(obj: Any) -> Any:
    """Strict JSON (RFC 8259) values: non-finite floats become ``"nan"``, ``"inf"``, ``"-inf"``; numbers from
    tensors/NumPy scalars become Python numbers; anything else its ``str``."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    num = as_number(obj)
    if num is not None:
        return jsonable(num)
    return str(obj)


def as_number(v: Any) -> float | int | None:
    """A Python number from an int/float/0-d tensor/numpy scalar; None otherwise (bools excluded)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v
    numel = getattr(v, "numel", None)
    if callable(numel):  # torch tensor
        try:
            if numel() == 1:
                return v.item()
        except Exception:
            return None
        return None
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "shape", None) in ((), None):
        try:
            x = item()
        except Exception:
            return None
        return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None
    return None


def as_float(v: Any) -> float | None:
    """:func:`as_number` as a float (None when not a number)."""
    n = as_number(v)
    return None if n is None else float(n)


def nearly_equal(a: float | None, b: float | None, rtol: float = LR_RTOL) -> bool:
    """Equal within the relative tolerance ``rtol``; NaN equals nothing; None equals only None."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return False
    return a == b or math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def coerce_float(v: Any) -> float | None:
    """A float from a config value: numbers, numeric strings (``"1e-4"``), 0-d tensors; else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return as_float(v)


def flatten(d: Any, prefix: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    """``(key path, leaf)`` for every leaf of nested dicts (keys as str)."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield from flatten(v, prefix + (str(k),))
    else:
        yield prefix, d


__all__ = ["LR_RTOL", "DERIVED_RTOL", "fmt_value", "fmt_pair", "jsonable", "as_number", "as_float", "nearly_equal",
           "coerce_float", "flatten"]
