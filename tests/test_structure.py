"""The package's import structure, read from its source with ``ast`` (nothing is imported).

Every ``import`` statement counts: at module level, inside functions and methods, under
``if TYPE_CHECKING:``; relative imports are resolved. Three rules (PROTOCOL.md, "Layers import one way"):

* no import cycle, not even through an import inside a function (a late import hides a cycle; it does
  not remove it: the two modules still cannot be understood, tested or moved apart);
* no private name (``_x``) imported from another module: a step two modules share is a public function,
  with a docstring, of the module that owns it;
* the layers: format -> store -> repo -> ops -> cli; ``training/`` and ``resume/`` go through ops
  (never repo or store); nothing imports cli except cli itself and ``__main__``.
"""
from __future__ import annotations

import ast
import functools
import pathlib


PACKAGE = "ckpt_archive"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """``{dotted module name: file}`` of every ``.py`` file of the package (a package is its ``__init__``)."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _base(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative levels resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _owner(name: str, mods: dict) -> str | None:
    """The package module ``name`` is in (the longest known prefix), or None outside the package."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=None)
def _parse(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _imports(mods: dict) -> list[tuple[str, str, str | None, int]]:
    """Every import edge ``(importer, imported module, imported name or None, line)`` inside the package."""
    edges = []
    for module, path in mods.items():
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, mods)
                    if target:
                        edges.append((module, target, None, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in mods:  # ``from pkg import submodule``
                        edges.append((module, full, None, node.lineno))
                    else:
                        target = _owner(base, mods)
                        if target:
                            edges.append((module, target, alias.name, node.lineno))
    return edges


def _graph(edges) -> dict[str, dict[str, int]]:
    """``{importer: {imported: first line}}``; the package root (lazy ``__getattr__`` API) is no edge."""
    graph: dict[str, dict[str, int]] = {}
    for src, dst, _, line in edges:
        if dst != src and dst != PACKAGE:
            graph.setdefault(src, {}).setdefault(dst, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:  # a shortest path back to the component's first module, for the message
        members, start = set(comp), comp[0]
        prev: dict[str, str] = {}
        frontier, seen = [start], {start}
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, {})):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append([start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start])
    return cycles


def _describe(cycle: list[str], graph) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycle():
    """Fault: two modules import each other (often through an import inside a function), so neither can be
    read, tested or moved alone. The message names every module of each cycle and the importing lines."""
    graph = _graph(_imports(_modules()))
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, graph) for c in cycles)


def _private_imports(mods: dict) -> list[str]:
    """``from x import _name`` (``_name`` not a submodule) and ``module._name`` on an imported package
    module, where the module is another one than the importer."""
    found = []
    for src, dst, name, line in _imports(mods):
        if dst != src and name and name.startswith("_") and not name.startswith("__"):
            found.append(f"{mods[src].relative_to(ROOT.parent)}:{line}: {src} imports {dst}.{name}")
    for module, path in mods.items():
        tree = _parse(path)
        aliases: dict[str, str] = {}  # local name -> package module, for ``import x.y as z`` / ``from x import y``
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path, node)
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != module and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {module} uses "
                             f"{aliases[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_private_name_imported_across_modules():
    """Fault: a module reaches into another's private helper (``from ckpt_archive.ops.pack import _prepare``):
    the helper's owner may change it freely, and the dependency is invisible. Make it public where it lives."""
    found = _private_imports(_modules())
    assert not found, "private names used across modules:\n" + "\n".join(found)


#: layer -> the package modules it may not import (by prefix); "cli" is checked for everyone below.
FORBIDDEN = {
    "format": ("store", "repo", "ops", "cli", "sources", "training", "resume", "retention", "integrations", "demo"),
    "store": ("repo", "ops", "cli", "sources", "training", "resume", "retention", "integrations", "demo"),
    "repo": ("ops", "cli", "sources", "training", "resume", "integrations", "demo"),
    "training": ("repo", "store", "cli"),
    "resume": ("repo", "store", "cli"),
}
#: Modules of a forbidden layer that a layer may still import, and why.
ALLOWED = {
    # THE file layer: every byte written outside a repository (check-resume's reports, a trainer's folder)
    # goes through it too (docs/architecture.md, "The file layer")
    "ckpt_archive.store.fs": ("training", "resume"),
}


def _layer_violations(mods: dict) -> list[str]:
    bad = []
    for src, dst, name, line in _imports(mods):
        src_parts, dst_parts = src.split("."), dst.split(".")
        layer = src_parts[1] if len(src_parts) > 1 else ""
        target = dst_parts[1] if len(dst_parts) > 1 else ""
        where = f"{mods[src].relative_to(ROOT.parent)}:{line}: {src} imports {dst}"
        if target in FORBIDDEN.get(layer, ()) and layer not in ALLOWED.get(dst, ()):
            bad.append(f"{where} ({layer}/ may not import {target}/)")
        elif target == "cli" and layer not in ("cli", "__main__"):
            bad.append(f"{where} (nothing imports cli/ but cli/ and __main__)")
    return sorted(set(bad))


def test_layers_import_one_way():
    """Fault: a lower layer imports a higher one (format -> sources, training -> repo, ops -> cli), so the
    layers no longer stack: format -> store -> repo -> ops -> cli; training/ and resume/ go through ops."""
    bad = _layer_violations(_modules())
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_guard_against(tmp_path):
    """The three checks above would pass on an empty graph: show each one fails on a small package that has
    the fault (a cycle through a function-level relative import, a private import, training -> repo)."""
    pkg = tmp_path / PACKAGE
    for sub in ("format", "repo", "training"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "format" / "a.py").write_text("from ckpt_archive.format.b import thing\n")
    (pkg / "format" / "b.py").write_text("def thing():\n    from . import a\n    return a\n")
    (pkg / "repo" / "r.py").write_text("def _helper():\n    pass\n")
    (pkg / "training" / "t.py").write_text("from ckpt_archive.repo.r import _helper\n")
    mods = _modules(pkg)
    cycles = find_cycles(_graph(_imports(mods)))
    assert cycles == [["ckpt_archive.format.a", "ckpt_archive.format.b", "ckpt_archive.format.a"]]
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        assert [x.split(": ", 1)[1] for x in _private_imports(mods)] == [
            "ckpt_archive.training.t imports ckpt_archive.repo.r._helper"]
        assert len(_layer_violations(mods)) == 1
    finally:
        ROOT = saved


def test_graph_sees_imports_inside_functions():
    """Fault: the graph reads only module-level imports and so misses the cycles the issue found (they all
    ran through imports inside functions, kept there to keep torch lazy). Every package import inside a
    function or method must be an edge of the graph."""
    mods = _modules()
    seen = {(src, line) for src, _, _, line in _imports(mods)}
    inner = set()
    for module, path in mods.items():
        for f in ast.walk(_parse(path)):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner |= {(module, n.lineno) for n in ast.walk(f) if isinstance(n, ast.ImportFrom)
                          and ((n.module or "").startswith(PACKAGE) or n.level)}
    assert len(inner) > 50 and inner <= seen, sorted(inner - seen)[:10]
