"""A part of the state tree named by a ``--only`` path (``model``, ``optimizer/state/0``): the encoded sub-tree
it names, found by walking the encoded tree (no tensor is read). Used by ``restore --only`` and
``load(only=...)``; pure, no I/O.
"""
from __future__ import annotations

from typing import Any

from ckpt_archive.errors import FormatError, NotFound, UsageError


def subtree(tree: Any, path: str) -> Any:
    """The encoded sub-tree at a ``/``-separated path of dict keys and list/tuple indices
    (``"model"``, ``"optimizer/state/0"``; state_dict keys such as ``fc1.weight`` contain dots, so the
    separator is ``/`` only).

    A key may itself contain ``/`` (a folder source's relpaths, ``global_step10/mp_rank_00_model_states.pt``):
    every split of the remaining parts into keys is tried, so ``global_step10/mp_rank_00_model_states.pt/module``
    reaches ``module`` inside that file. Exactly one resolution must exist: two (``{"a/b": X, "a": {"b": Y}}``
    with ``a/b``) are refused as ambiguous, listing them, never one picked silently.

    Raises:
        UsageError: an empty path or an empty component (``""``, ``/``, ``model//w``); an ambiguous path.
        NotFound: a part of the path names nothing.
    """
    from ckpt_archive.format.tree_walk import inline_refs, shared_nodes

    parts = check_only(path).split("/")
    origins = shared_nodes(tree)
    found = _resolve(tree, parts, [], origins)
    if not found:
        node, walked = tree, []
        for part in parts:  # no resolution: name the first part that names nothing, as before
            walked.append(part)
            node = _child(_unshare(node, origins), part, "/".join(walked))
    if len(found) > 1:
        shown = "; ".join(" -> ".join(repr(k) for k in keys) for keys, _ in found[:6])
        raise UsageError(f"--only {path!r} is ambiguous: it names {len(found)} places in the state ({shown}); "
                         f"nothing was selected")
    # a container shared with a part outside the sub-tree comes along (first occurrence inlined)
    return inline_refs(found[0][1], origins)


def check_only(path) -> str:
    """Refuse an empty selector or one with an empty component (``""``, ``/``, ``model//weight``): it
    would silently select the whole state, or another place than written. Returns ``path``."""
    if not isinstance(path, str) or any(p == "" for p in path.split("/")):
        raise UsageError(f"--only {path!r}: empty path component; name a part of the state as KEY/KEY/... "
                         f"(e.g. 'model' or 'optimizer/state/0'), without leading, trailing or doubled '/'")
    return path


_MISSING = object()


def _resolve(node, parts: list[str], keys: list[str], origins: dict) -> list[tuple[list[str], Any]]:
    """Every way ``parts`` walks down from ``node``, a key taking one or more parts joined with ``/``."""
    if not parts:
        return [(keys, node)]
    out = []
    node = _unshare(node, origins)
    for i in range(1, len(parts) + 1):
        key = "/".join(parts[:i])
        if i > 1 and not _has_slash_keys(node):
            break
        child = _lookup(node, key)
        if child is not _MISSING:
            out += _resolve(child, parts[i:], keys + [key], origins)
            if len(out) > 1:
                break
    return out


def _has_slash_keys(node) -> bool:
    if isinstance(node, dict) and "$t" not in node:
        return any("/" in str(k) for k in node)
    if isinstance(node, dict) and node.get("$t") in ("dict", "odict", "counter"):
        return any("/" in (_key_text(kv[0]) or "") for kv in node.get("items") or []
                   if isinstance(kv, list) and len(kv) == 2)
    return False


def _lookup(node, part: str):
    try:
        return _child(node, part, part)
    except NotFound:
        return _MISSING


def _unshare(node, origins: dict):
    """The container a ``shared`` / ``ref`` node stands for (docs/FORMAT.md, "State tree")."""
    while isinstance(node, dict) and node.get("$t") in ("shared", "ref"):
        node = node.get("v") if node["$t"] == "shared" else (origins.get(node.get("id")) or {}).get("v")
    return node


def _child(node, part: str, where: str):
    """The child of an encoded container that one ``--only`` step names: a list/tuple position written as
    plain decimal digits (``0``, ``12``; not ``-1``, ``+2``, ``01`` or ``1_0``, which ``int()`` would take),
    or the key whose text is ``part`` (a tagged key by its decoded text: an int key ``1``, a str with lone
    surrogates). Two keys with the same text (``1`` and ``"1"``, ``True`` and ``"True"``) are refused as
    ambiguous, never one picked silently."""
    if isinstance(node, list) or (isinstance(node, dict) and node.get("$t") == "tuple"):
        return _element(node if isinstance(node, list) else node["v"], part, where)
    texts = [(_key_text(k), k, v) for k, v in _pairs(node)]
    found = [(k, v) for text, k, v in texts if text == part]
    if len(found) > 1:
        kinds = ", ".join(_key_kind(k) for k, _ in found)
        raise UsageError(f"--only step {part!r} is ambiguous: {len(found)} keys there read {part!r} "
                         f"({kinds}); nothing was selected (load the container and pick the key in Python)")
    if found:
        return found[0][1]
    keys = [t for t, _, _ in texts if t is not None]
    shown = ", ".join(keys[:12]) + (", ..." if len(keys) > 12 else "")
    raise NotFound(f"no key {part!r} in the state" + (f"; keys there: {shown}" if keys else ""), where=where)


def _element(items: list, part: str, where: str):
    """The element of a list/tuple that ``part`` (plain decimal digits) names.

    Raises:
        NotFound: no such position (names the positions there).
    """
    if part.isascii() and part.isdigit() and (part == "0" or not part.startswith("0")) and int(part) < len(items):
        return items[int(part)]
    raise NotFound(f"no element {part!r} in the state (positions are 0..{len(items) - 1})", where=where)


def _pairs(node) -> list:
    """The ``(encoded key, encoded value)`` pairs of a dict node (plain or tagged); [] for anything else."""
    if isinstance(node, dict) and "$t" not in node:
        return list(node.items())
    if isinstance(node, dict) and node.get("$t") in ("dict", "odict", "counter"):
        return [kv for kv in node.get("items") or [] if isinstance(kv, list) and len(kv) == 2]
    return []


def _key_text(k) -> str | None:
    """The text an ``--only`` step matches a key by: a plain key as ``str()`` gives it (``1``, ``True``,
    ``None``), a tagged int/float by its digits, a tagged str (lone surrogates) decoded; None for keys
    that have no text of their own (tuples, dtypes)."""
    if k is None or isinstance(k, (str, int, float, bool)):
        return str(k)
    if isinstance(k, dict):
        if k.get("$t") == "str":
            from ckpt_archive.format.text import str_from_node

            try:
                return str_from_node(k)
            except FormatError:
                return None
        if k.get("$t") in ("int", "float") and isinstance(k.get("v"), str):
            return k["v"]
    return None


def _key_kind(k) -> str:
    """The type of an encoded key, for messages."""
    if isinstance(k, dict):
        return str(k.get("$t"))
    return type(k).__name__ if k is not None else "None"


__all__ = ["subtree", "check_only"]
