"""Text that is not UTF-8: one place for how ckpt-archive tells, shows and stores it.

POSIX names are bytes; Python hands a name that is not UTF-8 over as a ``str`` with lone surrogates
(``os.fsdecode(b"caf\\xe9") == "caf\\udce9"``, PEP 383). UTF-8 JSON cannot hold such a ``str``, so:

* :func:`utf8_ok` tells it (every reader and writer of manifests, trees and file names asks here);
* :func:`shown` writes it for people and for ``--json`` (the name's own bytes as ``\\xNN``);
* :func:`printable` writes any text for a terminal: control characters (an archive's tag holding
  ``ESC ]0;...BEL`` would retitle the window, recolour or rewrite the screen) as ``\\xNN`` escapes;
* :func:`str_node` / :func:`str_from_node` store it exactly in a state tree (docs/FORMAT.md, "State
  tree": ``{"$t": "str", "b64": ...}``, base64 of its UTF-8 with surrogates passed).
"""
from __future__ import annotations

import base64
import os
from typing import Any

from ckpt_archive.errors import FormatError


def utf8_ok(s: str) -> bool:
    """Whether ``s`` is a sequence of Unicode scalar values (UTF-8 can hold it): False for lone surrogates."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(s: str) -> str:
    """``s`` as Unicode text: a name that came from bytes that are not UTF-8 shows those bytes as ``\\xNN``;
    other lone surrogates as ``\\udcNN``. A ``str`` that is UTF-8 text comes back unchanged."""
    if utf8_ok(s):
        return s
    try:
        return os.fsencode(s).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # surrogates that did not come from undecodable bytes
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_control(c: str) -> bool:
    o = ord(c)
    return o < 0x20 or 0x7f <= o <= 0x9f  # C0, DEL and C1 (0x9b is a one-character CSI on some terminals)


def has_control(s: str) -> bool:
    """Whether ``s`` holds a control character (C0, DEL, C1), newline and tab included."""
    return any(_is_control(c) for c in s)


def printable(s: str, *, keep: str = "\n\t") -> str:
    """``s`` for a terminal: :func:`shown`, then every control character other than those in ``keep``
    (newline and tab) written as ``\\xNN``, so nothing read from an archive (a tag, a note, a host name)
    reaches a terminal as an escape sequence. Text without control characters comes back unchanged."""
    s = shown(s)
    if not has_control(s):
        return s
    return "".join(f"\\x{ord(c):02x}" if _is_control(c) and c not in keep else c for c in s)


def first_not_utf8(value: Any) -> str | None:
    """The first ``str`` in a JSON-like value (dict keys included) that UTF-8 cannot hold, or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not utf8_ok(v):
                return v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return None


def str_node(s: str) -> dict:
    """The state-tree node of a ``str`` that :func:`utf8_ok` refuses."""
    return {"$t": "str", "b64": base64.b64encode(s.encode("utf-8", "surrogatepass")).decode("ascii")}


def str_from_node(node: dict) -> str:
    """The ``str`` a ``{"$t": "str"}`` node holds.

    Raises:
        FormatError: not base64, or not UTF-8 even with surrogates passed (a hostile node).
    """
    try:
        return base64.b64decode(node.get("b64") or "", validate=True).decode("utf-8", "surrogatepass")
    except (ValueError, TypeError) as exc:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise FormatError(f"malformed str node: {exc}") from None


__all__ = ["utf8_ok", "shown", "has_control", "printable", "first_not_utf8", "str_node", "str_from_node"]
