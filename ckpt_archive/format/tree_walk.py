"""Walking an encoded state tree (docs/FORMAT.md "State tree") as readers do: its nodes, the tensors it
references, and its aliasing (``shared`` / ``ref`` nodes). Split out of
:mod:`ckpt_archive.format.state_tree`, which encodes and decodes trees; these only read them, and treat
what they read as hostile (a node without a string key is a FormatError, never a KeyError).
"""
from __future__ import annotations

from typing import Any

from ckpt_archive.errors import FormatError, IntegrityError


def iter_nodes(tree: Any):
    """Yield every dict node of an encoded tree (depth first; a tensor node's ``attrs`` included)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            # only containers go on the stack: a list of a million ints is one pass, not a million pops
            stack.extend([v for v in node if isinstance(v, (dict, list))])
        elif isinstance(node, dict):
            yield node
            stack.extend([v for k, v in node.items() if k != "$t" and isinstance(v, (dict, list))])


def walk_refs(tree: Any):
    """Yield every tensor/ndarray key referenced by an encoded tree (for reference checks)."""
    for node in iter_nodes(tree):
        if node.get("$t") in ("tensor", "ndarray"):
            if not isinstance(node.get("key"), str):  # [issue 17] hostile until checked
                raise FormatError(f"malformed {node.get('$t')} node (no string 'key')")
            yield node["key"]


def shared_nodes(tree: Any) -> dict[int, dict]:
    """``{id: shared node}`` of every ``{"$t":"shared"}`` node in an encoded tree (the first met, in
    :func:`iter_nodes` order, for an id given twice)."""
    out: dict[int, dict] = {}
    for node in iter_nodes(tree):
        if node.get("$t") == "shared" and type(node.get("id")) is int:
            out.setdefault(node["id"], node)
    return out


def inline_refs(node: Any, origins: dict[int, dict]) -> Any:
    """A sub-tree made self-contained: the first ``ref`` to a container whose ``shared`` node lies outside
    it becomes that shared node (later refs then resolve to the same object)."""
    inside = set(shared_nodes(node))
    placed: set[int] = set()

    def walk(n):
        if isinstance(n, list):
            return [walk(v) for v in n]
        if not isinstance(n, dict):
            return n
        if n.get("$t") == "shared":
            placed.add(n.get("id"))
        if n.get("$t") == "ref" and n.get("id") not in inside and n.get("id") not in placed \
                and n.get("id") in origins:
            placed.add(n["id"])
            return walk(origins[n["id"]])
        return {k: walk(v) for k, v in n.items()}

    return walk(node) if any(n.get("$t") == "ref" for n in iter_nodes(node)) else node


def folder_file_node(tree: Any, relpath: str) -> Any:
    """The encoded node of one source file in the state tree of a folder generation (the tree's top level
    is ``{relpath: node}``, a plain dict or a ``{"$t": "dict"/"odict", "items": [[key, node], ...]}`` one).

    Args:
        tree: the generation's encoded state tree. relpath: a ``source.files[].relpath`` of the manifest.

    Returns:
        the node (a sub-tree for :meth:`~ckpt_archive.repo.reader.ArchiveReader.load_node`).

    Raises:
        IntegrityError: (exit 1) the tree has no entry for ``relpath``.
    """
    if isinstance(tree, dict) and "$t" not in tree:
        if relpath in tree:
            return tree[relpath]
    elif isinstance(tree, dict) and tree.get("$t") in ("dict", "odict"):
        for k, v in tree["items"]:
            if k == relpath:
                return v
    raise IntegrityError(f"state tree has no entry for source file {relpath!r}", where="tree.json")


__all__ = ["iter_nodes", "walk_refs", "shared_nodes", "inline_refs", "folder_file_node"]
