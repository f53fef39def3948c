"""[issue 25, "Smaller"] No function of the package is above cyclomatic complexity 20 or longer than 100 lines.

Complexity is radon's (``radon.complexity.cc_visit``: McCabe, +1 per ``if``/``elif``/loop/``except``/boolean
operator/comprehension clause), for every function, method and nested function. A nested function is
measured on its own *and* its lines count in the outer function's length: a function's length is its full
span, from its ``def`` line to its last line (docstring and nested functions included, decorators not), as
the issue counts it. A function over either limit is split into named steps by concern, not raised past
the limit.

The check is strict over the whole package; every offender is named.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_archive"
MAX_COMPLEXITY = 20
MAX_LINES = 100
#: subpackages allowed to hold offenders for a while (they xfail, named); none today: the gate is strict
SHRINKING: tuple[str, ...] = ()


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    """``ckpt_archive/...`` for the package's modules (the gate's own check passes other files)."""
    return path.relative_to(PACKAGE.parent).as_posix() if PACKAGE in path.parents else path.name


def _radon_blocks(blocks, prefix: str = ""):
    """Every function, method and nested function radon measured, with its qualified name."""
    from radon.visitors import Class

    for b in blocks:
        name = f"{prefix}{b.name}"
        if isinstance(b, Class):
            yield from _radon_blocks(list(b.methods) + list(b.inner_classes), f"{name}.")
        else:
            yield name, b
            yield from _radon_blocks(b.closures, f"{name}.")


def complexity_offenders(paths=None, limit: int = MAX_COMPLEXITY) -> list[str]:
    """``path:line name (complexity N)`` for every function above ``limit``."""
    from radon.complexity import cc_visit

    out = []
    for path in paths or _modules():
        found: dict[int, tuple[str, int]] = {}  # radon lists a nested function twice: keep its qualified name
        for name, b in _radon_blocks(cc_visit(path.read_text(encoding="utf-8"))):
            if b.complexity > limit and len(name) > len(found.get(b.lineno, ("", 0))[0]):
                found[b.lineno] = (name, b.complexity)
        out += [f"{_rel(path)}:{line} {name} (complexity {c})" for line, (name, c) in sorted(found.items())]
    return out


def length_offenders(paths=None, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function longer than ``limit`` lines (its full span)."""
    out = []
    for path in paths or _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def walk(node, prefix: str):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        lines = child.end_lineno - child.lineno + 1
                        if lines > limit:
                            out.append(f"{_rel(path)}:{child.lineno} {name} ({lines} lines)")
                    walk(child, f"{name}.")
                else:
                    walk(child, prefix)

        walk(tree, "")
    return out


def _judge(offenders: list[str], what: str) -> None:
    shrinking = [o for o in offenders if o.split("/")[1] in SHRINKING]
    elsewhere = [o for o in offenders if o not in shrinking]
    assert not elsewhere, f"{len(elsewhere)} function(s) {what}: split each into named steps by concern:\n" + \
        "\n".join(elsewhere)
    if shrinking:
        pytest.xfail(f"{len(shrinking)} function(s) {what} in {', '.join(SHRINKING)} (being split, issue 25):\n"
                     + "\n".join(shrinking))


def test_no_function_is_above_complexity_20():
    """A function whose branches pile up past 20 (issue 25 counted 48 such, up to 84) fails, named."""
    _judge(complexity_offenders(), f"above cyclomatic complexity {MAX_COMPLEXITY}")


def test_no_function_is_longer_than_100_lines():
    """A function longer than 100 lines (issue 25: ``ops/restore.py: restore`` was 211) fails, named."""
    _judge(length_offenders(), f"longer than {MAX_LINES} lines")


_BRANCHY = '''
def branchy(x):
    {body}
    return x
'''


def test_the_measures_catch_what_they_gate(tmp_path):
    """The gate's own measures: 21 ``if``s make complexity 22 (caught, also inside a method's nested
    function); a 101-line function is caught, and a nested function's lines count in its outer one's."""
    branchy = tmp_path / "branchy.py"
    body = "\n    ".join(f"if x == {i}:\n        x += 1" for i in range(21))
    branchy.write_text("class K:\n    def m(self):\n" + "\n".join("        " + line for line in
                       _BRANCHY.format(body=body).splitlines()) + "\n        return branchy\n")
    found = complexity_offenders([branchy.resolve()], limit=20)
    assert len(found) == 1 and found[0].endswith("K.m.branchy (complexity 22)"), found
    assert complexity_offenders([branchy.resolve()], limit=22) == []

    long = tmp_path / "long.py"
    inner = "\n".join(f"        y{i} = {i}" for i in range(96))
    long.write_text(f"def outer():\n    x = 1\n    def inner():\n{inner}\n        return 0\n    return inner\n")
    assert [o.split(" ", 1)[1] for o in length_offenders([long.resolve()], limit=100)] == ["outer (101 lines)"]
    assert length_offenders([long.resolve()], limit=101) == []
