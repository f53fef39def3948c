"""A place in a nested state: one type, one display form, one parser for each written form.

A state is dicts, lists and tuples nested to any depth. A place in it is the sequence of steps from the
root: dict keys (strings, or the ints of an optimizer's ``state``) and list/tuple positions. The two
must stay apart: ``optimizer.state.0`` is the dict key ``0`` of the optimizer's per-parameter state,
``optimizer.param_groups[0]`` the first element of a list.

Written forms:

* the **display form** (:meth:`StatePath.__str__`, parsed back by :meth:`StatePath.parse`):
  ``optimizer.param_groups[0].lr``. Keys are joined with ``.``, positions are ``[i]``; a key that holds
  ``.``, ``[``, ``]`` or ``"`` (a state_dict key such as ``fc1.weight``) or is empty is written
  JSON-quoted in brackets, ``model["fc1.weight"]``, so the form never splits one key in two.
* the **slash form** of ``--only`` (:meth:`StatePath.parse_slash`, :meth:`StatePath.slash`):
  ``optimizer/state/0``: ``/``-separated steps, none of which may hold ``/``; a digit step addresses a
  list position or a key written the same way, decided by the node it is applied to.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable, Iterator

_PLAIN_KEY = re.compile(r'^[^.\[\]"]+$')
_TOKEN = re.compile(r'\.?([^.\[\]"]+)|\[(\d+)\]|\[("(?:[^"\\]|\\.)*")\]')


class Index(int):
    """A list/tuple position inside a path (displayed ``[i]``; a plain int is a dict key, displayed ``.i``)."""

    def __repr__(self) -> str:
        return f"Index({int(self)})"


class StatePath(tuple):
    """The steps from the root of a state to one place in it.

    A tuple of steps: :class:`Index` for a list/tuple position, anything else for a dict key. Being a
    tuple, it compares, hashes and slices like one (``path[:-1]``, ``path + ("lr",)`` give tuples;
    :meth:`child` and :meth:`at` give paths).

    Example:
        >>> p = StatePath(("optimizer", "param_groups")).at(0).child("lr")
        >>> str(p)
        'optimizer.param_groups[0].lr'
        >>> str(StatePath(("model", "fc1.weight")))
        'model["fc1.weight"]'
        >>> StatePath.parse('model["fc1.weight"]') == ("model", "fc1.weight")
        True
    """

    def __new__(cls, steps: Iterable[Any] = ()):
        return super().__new__(cls, tuple(steps))

    # -- building ---------------------------------------------------------------------------------
    def child(self, key: Any) -> "StatePath":
        """This path extended by the dict key ``key``."""
        return StatePath((*self, key))

    def at(self, index: int) -> "StatePath":
        """This path extended by the list/tuple position ``index``."""
        return StatePath((*self, Index(index)))

    @property
    def parent(self) -> "StatePath":
        """The path without its last step (the root's parent is the root)."""
        return StatePath(self[:-1])

    @property
    def top(self) -> Any:
        """The first step (the top-level key), or None for the root."""
        return self[0] if self else None

    def startswith(self, prefix: Iterable[Any]) -> bool:
        """Whether ``prefix`` is this path or one of its ancestors (step by step, never by text)."""
        prefix = tuple(prefix)
        return tuple(self[:len(prefix)]) == prefix

    # -- display form -----------------------------------------------------------------------------
    def __str__(self) -> str:
        """The display form (``""`` for the root; callers say what the root is called)."""
        out = ""
        for step in self:
            if isinstance(step, Index):
                out += f"[{int(step)}]"
                continue
            text = str(step)
            if _PLAIN_KEY.match(text):
                out += f".{text}" if out else text
            else:
                out += f"[{json.dumps(text)}]"
        return out

    def __repr__(self) -> str:
        return f"StatePath({str(self)!r})"

    @classmethod
    def parse(cls, text: "str | Iterable[Any]") -> "StatePath":
        """Read the display form back (``a.b[0]["c.d"]``); a path or tuple is taken as is.

        In a tuple, an int step stays a plain int: :meth:`get` applies it as a position to a list and
        as a key to a dict.

        Raises:
            ValueError: text that is not in the display form (the message quotes it).
        """
        if not isinstance(text, str):
            return text if isinstance(text, StatePath) else cls(text)
        steps: list[Any] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or (m.group(1) is not None and text[pos] == "." and not steps):
                raise ValueError(f"not a state path: {text!r} (at character {pos})")
            if m.group(1) is not None:
                if text[pos] != "." and steps:
                    raise ValueError(f"not a state path: {text!r} (at character {pos})")
                steps.append(m.group(1))
            elif m.group(2) is not None:
                steps.append(Index(int(m.group(2))))
            else:
                steps.append(json.loads(m.group(3)))
            pos = m.end()
        return cls(steps)

    # -- slash form (--only) ----------------------------------------------------------------------
    @classmethod
    def parse_slash(cls, text: str) -> "StatePath":
        """Read the ``--only`` form ``optimizer/state/0`` (empty steps are ignored; all steps are str)."""
        return cls(p for p in text.split("/") if p)

    def slash(self) -> str:
        """The ``--only`` form of this path.

        Raises:
            ValueError: a key holds ``/`` (the slash form cannot address it).
        """
        steps = [str(int(s)) if isinstance(s, Index) else str(s) for s in self]
        bad = [s for s in steps if "/" in s or not s]
        if bad:
            raise ValueError(f"the key {bad[0]!r} cannot be written in the '/'-separated form")
        return "/".join(steps)

    # -- applying ---------------------------------------------------------------------------------
    def get(self, root: Any) -> Any:
        """The node at this path in ``root``.

        Raises:
            KeyError / IndexError / TypeError: a step names nothing in ``root``.
        """
        node = root
        for step in self:
            if isinstance(node, (list, tuple)):
                if not isinstance(step, int) or isinstance(step, bool):
                    raise TypeError(f"a position in a list is an int, not {step!r}")
                node = node[int(step)]
            elif isinstance(node, dict):
                node = node[step]
            else:
                raise KeyError(step)
        return node

    def set(self, root: Any, value: Any) -> Any:
        """Put ``value`` at this path in ``root`` and return the new root.

        Dicts and lists are changed in place; tuples (immutable) are rebuilt on the way, keeping their
        type (a named tuple stays one). The root itself is returned (or ``value`` for the empty path).
        """
        if not self:
            return value
        head, rest = self[0], StatePath(self[1:])
        key = int(head) if isinstance(head, Index) else head
        if isinstance(root, tuple):
            items = list(root)
            items[key] = rest.set(items[key], value)
            return type(root)(items) if type(root) is tuple else type(root)(*items)
        root[key] = rest.set(root[key], value)
        return root


def children(node: Any) -> list[tuple[Any, Any]]:
    """The ``(step, child)`` pairs of a dict, list or tuple (positions as :class:`Index`); ``[]`` for a leaf."""
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return [(Index(i), v) for i, v in enumerate(node)]
    return []


def walk(node: Any, path: StatePath = StatePath(), skip_top: Iterable[Any] = ()) -> Iterator[tuple[StatePath, Any]]:
    """Yield ``(path, node)`` for ``node`` and everything below it, depth first.

    Args:
        skip_top: top-level keys whose sub-trees are not entered (e.g. ``("model",)``).
    """
    skip = tuple(skip_top)
    yield path, node
    for step, child in children(node):
        if not path and not isinstance(step, Index) and step in skip:
            continue
        yield from walk(child, path.child(step) if not isinstance(step, Index) else path.at(step), skip)


__all__ = ["Index", "StatePath", "children", "walk"]
