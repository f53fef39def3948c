"""Strict JSON, one way in and one way out: every JSON document ckpt-archive writes or reads goes here.

* :func:`dumps` writes RFC 8259 JSON (``allow_nan=False``) as UTF-8 bytes ending in a newline. A
  non-finite float is written the way the format tags it in a state tree
  (``{"$t": "float", "v": "nan" | "inf" | "-inf"}``, see ``docs/FORMAT.md``), never as the
  non-standard ``NaN``/``Infinity`` tokens other parsers refuse.
* :func:`loads` reads hostile bytes: it refuses duplicate keys (which of two values would a reader
  take?), the ``NaN``/``Infinity`` constants, documents larger than ``max_bytes``, documents whose
  parse would cost more than ``max_cost`` bytes of Python objects (:func:`parse_cost`, counted before
  parsing) and nesting deeper than ``max_depth``, with :class:`~ckpt_archive.errors.InvalidJSON` naming
  where. A valid document parses exactly as ``json.loads`` parses it.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from ckpt_archive.errors import InvalidJSON

__all__ = ["dumps", "loads", "depth_exceeds", "parse_cost", "tag_float", "MAX_BYTES", "MAX_DEPTH"]

#: Largest JSON document :func:`loads` reads by default (bytes). A manifest of a model with 100,000
#: tensors is a few tens of MiB.
MAX_BYTES = 256 << 20
#: Deepest nesting :func:`loads` accepts by default (objects and arrays). Python's own parser gives up
#: near 1,000 levels with a RecursionError; nothing we write comes near this.
MAX_DEPTH = 512


def tag_float(value: float) -> Any:
    """A float as the format stores it: itself when finite, else ``{"$t": "float", "v": "nan"|"inf"|"-inf"}``."""
    if math.isfinite(value):
        return value
    return {"$t": "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _tag_nonfinite(obj: Any) -> Any:
    if isinstance(obj, float):
        return tag_float(obj)
    if isinstance(obj, dict):
        return {k: _tag_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tag_nonfinite(v) for v in obj]
    return obj


def dumps(obj: Any, *, indent: int | None = 1, sort_keys: bool = False, ensure_ascii: bool = False,
          default: Callable[[Any], Any] | None = None) -> bytes:
    """Encode ``obj`` as strict JSON (RFC 8259), UTF-8, with a trailing newline.

    Args:
        obj: dicts, lists, tuples, str, int, float (non-finite ones are tagged), bool, None.
        indent: spaces per level (``None``: one line).
        sort_keys: sort object keys (else the order as built).
        ensure_ascii: escape non-ASCII characters as ``\\u`` plus four hex digits (JSON's escape).
        default: called for values JSON cannot hold (e.g. ``str`` for paths); ``None`` refuses them.

    Returns:
        The document as bytes.

    Raises:
        TypeError: a value JSON cannot hold and no ``default``.
        ValueError: a circular reference.

    Example:
        >>> dumps({"loss": float("nan"), "step": 3}, indent=None)
        b'{"loss": {"$t": "float", "v": "nan"}, "step": 3}\\n'
    """
    kw = dict(indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, default=default, allow_nan=False)
    try:
        text = json.dumps(obj, **kw)
    except ValueError:
        # only now walk the value: a non-finite float somewhere (or a circular reference, raised again)
        text = json.dumps(_tag_nonfinite(obj), **kw)
    return (text + "\n").encode("utf-8")


def _refuse_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 overflows to inf: a value the format never writes as a number
        raise ValueError(f"number {text[:40]} is out of range (not a finite float)")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def depth_exceeds(doc: Any, limit: int) -> bool:
    """Whether a JSON value nests objects/arrays deeper than ``limit`` levels (as :func:`loads` counts them).

    Walks with one iterator per open level, so its memory follows the depth, not the width: a parse of
    ``[[],[],...]`` is not doubled by the check that follows it (:func:`parse_cost` counts only the parse)."""
    if not isinstance(doc, (dict, list)):
        return False
    stack = [iter(doc.values() if isinstance(doc, dict) else doc)]
    while stack:
        if len(stack) > limit:
            return True
        for child in stack[-1]:
            if isinstance(child, (dict, list)):
                stack.append(iter(child.values() if isinstance(child, dict) else child))
                break
        else:
            stack.pop()
    return False


#: What :func:`parse_cost` charges (bytes of CPython 3.11 objects, 64-bit, rounded up): a container (dict or
#: list, with its GC header), an element slot after ``,``, a key/value pair after ``:`` (dict entry, the pair
#: list the duplicate-key check builds), a string (two ``"``: one str object).
_COST_CONTAINER, _COST_COMMA, _COST_COLON, _COST_QUOTE = 72, 40, 56, 32


def parse_cost(data: bytes | str) -> int:
    """An upper estimate of the memory (bytes) that parsing ``data`` takes, from its structure alone.

    JSON is dense: ``[[],[],...]`` spends 3 bytes per list, which costs Python 64, so a parse may take ~25
    times the document's size. Counting the structural characters (C speed, nothing allocated) before the
    parse bounds that: 72 bytes per ``{``/``[``, 40 per ``,``, 56 per ``:``, 32 per ``"``, plus the document's
    characters held three times (the bytes, the decoded text, the strings parsed from it), each 1, 2 or 4
    bytes wide as CPython stores the widest character. Characters inside strings count as structure too,
    which only overestimates. Measured against real parses (tests/test_jsonio.py): 0.6-1.0 of the estimate
    for the worst shapes; a real manifest takes half of it (the parser shares repeated keys).

    Args:
        data: the document (UTF-8 bytes or text).

    Returns:
        the estimate in bytes.

    Example:
        >>> parse_cost(b"[[],[]]")
        277
    """
    if isinstance(data, str):
        width = 1 if data.isascii() else 4
        marks: tuple = ("{", "[", ",", ":", '"')
    else:
        data = data if isinstance(data, (bytes, bytearray)) else bytes(data)  # (a bytearray is counted in place)
        width = 1 if data.isascii() else 4 if _UTF8_4.search(data) else 2
        marks = (b"{", b"[", b",", b":", b'"')
    brace, bracket, comma, colon, quote = (data.count(m) for m in marks)
    return (_COST_CONTAINER * (brace + bracket) + _COST_COMMA * comma + _COST_COLON * colon
            + _COST_QUOTE * quote + len(data) * (1 + 2 * width))


#: The most :func:`parse_cost` charges per byte of a document: a document smaller than ``max_cost`` divided by
#: this cannot be charged more than ``max_cost`` (and is not counted).
_MAX_COST_PER_BYTE = max(_COST_CONTAINER, _COST_COMMA, _COST_COLON, _COST_QUOTE) + 1 + 2 * 4
#: A UTF-8 lead byte of a 4-byte character (beyond U+FFFF: CPython then stores 4 bytes per character).
_UTF8_4 = re.compile(rb"[\xf0-\xf4]")


def loads(data: bytes | str, *, where: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
          allow_nonfinite: bool = False, max_cost: int | None = None) -> Any:
    """Parse one strict JSON document read from an archive, a repository or a report.

    Args:
        data: the document (UTF-8 bytes, or text).
        where: the file or key it came from, named in every error.
        max_bytes: refuse a larger document (bytes).
        max_depth: refuse deeper nesting (levels of objects/arrays).
        allow_nonfinite: accept ``NaN``/``Infinity`` and numbers beyond the float range, as Python's
            ``json`` writes them by default: only for third-party files whose format has them (an HF
            ``trainer_state.json`` logging an infinite grad norm), never for what ckpt-archive writes.
        max_cost: refuse a document whose parse would take more than this many bytes of memory
            (:func:`parse_cost`, estimated before parsing); None: only ``max_bytes`` bounds it (the user's
            own input files). Every document read from an archive or a repository passes one
            (``ckpt_archive.format.limits``).

    Returns:
        The parsed value, as ``json.loads`` gives it.

    Raises:
        InvalidJSON: not UTF-8, not JSON, a duplicate key, ``NaN``/``Infinity`` or a number beyond the
            float range (``1e999``), an integer of more digits than Python converts, too large, too costly
            to parse or too deep (exit 1; also a ``ValueError``).

    Example:
        >>> loads(b'{"a": 1}', where="x.json")
        {'a': 1}
        >>> loads(b'{"a": 1, "a": 2}', where="x.json")
        Traceback (most recent call last):
        ...
        ckpt_archive.errors.InvalidJSON: x.json: not valid JSON (duplicate key 'a')
    """
    if len(data) > max_bytes:
        raise InvalidJSON(f"not read: {len(data)} bytes, more than the {max_bytes} a JSON document may have here",
                          where=where)
    if max_cost is not None and len(data) * _MAX_COST_PER_BYTE > max_cost:  # smaller ones cannot cost more
        cost = parse_cost(data)
        if cost > max_cost:
            raise InvalidJSON(f"not parsed: its {len(data)} bytes would take about {cost} bytes of memory to "
                              f"parse, more than the {max_cost} allowed here", where=where)
    try:
        text = data if isinstance(data, str) else str(data, "utf-8")
        hooks = {} if allow_nonfinite else {"parse_constant": _refuse_constant, "parse_float": _finite_float}
        doc = json.loads(text, object_pairs_hook=_unique_keys, **hooks)
    except RecursionError:
        raise InvalidJSON(f"not read: nested more than {max_depth} levels deep", where=where) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidJSON(f"not valid JSON ({exc})", where=where) from None
    if depth_exceeds(doc, max_depth):
        raise InvalidJSON(f"not read: nested more than {max_depth} levels deep", where=where)
    return doc
