"""What a state may hold: torch's own ``weights_only`` allowlist, plus plain-data classes named on request.

The rule (docs/FORMAT.md, "What round-trips"): everything ``torch.load(weights_only=True)`` of the
installed torch accepts round-trips exactly. That set is not copied here: it is read from torch
(:func:`torch_allowed_globals`, i.e. ``torch._weights_only_unpickler._get_allowed_globals``) so it
stays in step with torch, and ``tests/test_exact_roundtrip.py`` fails when torch adds an entry that
has no round-trip case.

Beyond torch's list, a caller may admit **plain-data classes** (as torch does with
``safe_globals``): ``argparse.Namespace`` (timm's ``CheckpointSaver`` and torchvision's reference
scripts save ``args`` as one) and any class named with ``--allow module.Class`` /
``PackOptions(allow=[...])`` / ``load(..., allow=[...])``. A class qualifies only when building an instance runs no code of its own: no
metaclass, ``object.__new__``, no ``__slots__``, and no ``__reduce__`` / ``__reduce_ex__`` /
``__getstate__`` / ``__setstate__`` / ``__getnewargs__`` anywhere in its MRO. Its instances are
stored as their ``__dict__`` (allowed values only) and rebuilt with ``object.__new__`` plus a
``__dict__`` update, exactly what torch's weights-only unpickler does for such a class.

Decoding resolves a class name only for classes named by the caller (``allow``) or
:data:`BUILTIN_PLAIN_CLASSES`, so an archive cannot make a reader import a module it did not ask for.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import sys
from typing import Any, Iterable, Iterator

from ckpt_archive.errors import FormatError, SourceError, UsageError

#: Plain-data classes that may be admitted by name without importing anything unusual (stdlib).
BUILTIN_PLAIN_CLASSES = ("argparse.Namespace",)

#: Methods whose presence in a class means building it could run its code (never admitted).
_CODE_HOOKS = ("__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__getnewargs__",
               "__getnewargs_ex__", "__new__", "__init_subclass__", "__class_getitem__", "__set_name__")

_current: contextvars.ContextVar[dict] = contextvars.ContextVar("ckpt_archive_allow", default={})


@functools.lru_cache(maxsize=1)
def torch_allowed_globals() -> dict[str, Any]:
    """torch's ``weights_only`` allowlist: ``{"module.name": object}`` (read from torch, never copied).

    Returns:
        a new dict; the same mapping ``torch.load(weights_only=True)`` resolves ``GLOBAL`` opcodes with.
    """
    from torch._weights_only_unpickler import _get_allowed_globals

    return dict(_get_allowed_globals())


@functools.lru_cache(maxsize=1)
def _by_identity() -> dict[int, tuple[str, Any]]:
    rev: dict[int, tuple[str, Any]] = {}
    for name, obj in torch_allowed_globals().items():
        rev.setdefault(id(obj), (name, obj))
    return rev


def global_name(obj: Any) -> str | None:
    """The allowlist name of ``obj`` when ``obj`` *is* one of torch's allowlisted objects (a dtype, a
    quantization scheme, a legacy tensor class, ...), else None."""
    hit = _by_identity().get(id(obj))
    return hit[0] if hit is not None and hit[1] is obj else None


def resolve_global(name: str) -> Any:
    """The allowlisted object called ``name``.

    Raises:
        FormatError: ``name`` is not in torch's allowlist (a hostile or newer archive).
    """
    try:
        return torch_allowed_globals()[name]
    except KeyError:
        raise FormatError(f"the state tree names {name!r}, which is not in torch's weights_only allowlist "
                          f"(torch {_torch_version()})") from None


def _torch_version() -> str:
    import torch

    return torch.__version__


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def plain_class_problem(cls: Any) -> str | None:
    """Why ``cls`` is not a plain-data class (see the module docstring), or None when it is."""
    if not isinstance(cls, type):
        return f"{cls!r} is not a class"
    if type(cls) is not type:
        return f"it has a metaclass ({type(cls).__qualname__})"
    if "<locals>" in cls.__qualname__:
        return "it is defined inside a function (no importable name)"
    for base in cls.__mro__[:-1]:
        if base is object:
            continue
        if base.__module__ == "builtins":
            return f"it subclasses the builtin {base.__qualname__} (its state is not a plain __dict__)"
        if "__slots__" in vars(base):
            return f"{base.__qualname__} defines __slots__"
        hooks = [h for h in _CODE_HOOKS if h in vars(base)]
        if hooks:
            return f"{base.__qualname__} defines {', '.join(hooks)} (building it would run its code)"
    if cls.__new__ is not object.__new__:
        return "it does not use object.__new__"
    return None


def _lookup(module: str, qualname: str, *, import_module: bool) -> Any:
    mod = sys.modules.get(module)
    if mod is None and import_module:
        mod = importlib.import_module(module)
    if mod is None:
        return None
    obj: Any = mod
    for part in qualname.split("."):
        d = getattr(obj, "__dict__", None)  # no getattr on the object: a module __getattr__ is code
        if not isinstance(d, dict) and not hasattr(d, "get"):
            return None
        obj = d.get(part)
        if obj is None:
            return None
    return obj


def _split(name: str) -> tuple[str, str]:
    parts = name.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise UsageError(f"--allow takes module.Class (e.g. argparse.Namespace), not {name!r}")
    # the longest importable module prefix
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in sys.modules:
            return module, ".".join(parts[i:])
    return ".".join(parts[:-1]), parts[-1]


def resolve_allow(allow: Iterable[Any] = ()) -> dict[str, type]:
    """Turn ``allow`` (``"module.Class"`` names and/or classes) into checked plain-data classes.

    Importing a named class's module is the user's explicit consent (the same as importing it before
    ``torch.serialization.safe_globals``).

    Returns:
        ``{"module.Class": cls}``.

    Raises:
        UsageError: a name that does not resolve, or a class that is not plain data (says why).
    """
    out: dict[str, type] = {}
    for item in allow or ():
        if isinstance(item, type):
            cls, name = item, class_name(item)
        else:
            name = str(item).strip()
            module, qual = _split(name)
            try:
                cls = _lookup(module, qual, import_module=True)
            except ImportError as exc:
                raise UsageError(f"--allow {name}: cannot import module {module!r} ({exc})") from None
            if cls is None:
                raise UsageError(f"--allow {name}: module {module!r} has no class {qual!r}")
        why = plain_class_problem(cls)
        if why is not None:
            raise UsageError(f"--allow {name}: not a plain-data class: {why}; only classes whose state is a "
                             f"plain __dict__ of allowed values are admitted")
        out[class_name(cls)] = cls
    return out


@contextlib.contextmanager
def allowing(allow: Iterable[Any] = ()) -> Iterator[dict[str, type]]:
    """Admit these plain-data classes in this context: source readers pass them to
    ``torch.serialization.safe_globals``, :func:`ckpt_archive.format.state_tree.encode` stores their
    instances, and decoding rebuilds them (see :func:`decode_class`).

    Yields:
        every class admitted in this context, ``{"module.Class": cls}``.

    Raises:
        UsageError: see :func:`resolve_allow`.
    """
    resolved = {**_current.get(), **resolve_allow(allow)}
    token = _current.set(resolved)
    try:
        yield resolved
    finally:
        _current.reset(token)


def current_allowed() -> dict[str, type]:
    """The plain-data classes admitted in this context (:func:`allowing`)."""
    return dict(_current.get())


def decode_class(name: str) -> type:
    """The class an archived plain object names, if the reader admitted it.

    Admitted: :data:`BUILTIN_PLAIN_CLASSES` and names given to :func:`allowing` (``allow=`` of
    ``load``/``restore``, CLI ``--allow``). Never imports any other module.

    Raises:
        FormatError: not admitted (names the ``--allow`` that would admit it), or not plain data.
    """
    if name not in BUILTIN_PLAIN_CLASSES and name not in _current.get():
        raise FormatError(f"the state holds {name} objects; admit the class to rebuild them: "
                          f"--allow {name} (Python: allow=[{name!r}])")
    module, qual = _split(name)
    cls = _lookup(module, qual, import_module=True)
    why = plain_class_problem(cls) if cls is not None else "no such class"
    if why is not None:
        raise FormatError(f"the state holds {name} objects, but {name} is not a plain-data class here: {why}")
    return cls


def refused_global_hint(name: str) -> str:
    """What to tell a user whose file references the global ``name`` (``weights_only`` refused it)."""
    if name in BUILTIN_PLAIN_CLASSES:
        return (f"it holds {name} objects (plain data): re-run with --allow {name} "
                f"(Python: PackOptions(allow=[{name!r}])) "
                f"to store and restore them as {name}, building nothing else")
    if name.startswith("builtins."):  # frozenset, range, ...: no __dict__, so --allow could never admit it
        return (f"{name} cannot be admitted (it is not a class whose state is a plain __dict__); convert it to "
                f"plain values before saving (a frozenset to a set or a sorted list, a range to a list)")
    special = _NOT_ADMISSIBLE_HINTS.get(name)
    if special is not None:
        return f"{name} cannot be admitted: {special}"
    try:  # a class already imported (torch's own) can be judged now, without importing anything new
        module, qual = _split(name)
        cls = _lookup(module, qual, import_module=False)
    except Exception:  # a name that does not split or resolve: judged when --allow imports it
        cls = None
    why = plain_class_problem(cls) if cls is not None else None
    if why is not None:
        return (f"{name} cannot be admitted ({why}; only classes whose state is a plain __dict__ are); convert "
                f"it to plain values (dict, list, numbers, str, tensors) before saving")
    return (f"if {name} is a plain-data class you trust, re-run with --allow {name}; only classes whose state "
            f"is a plain __dict__ are admitted, never code")


#: Refused globals that --allow can never admit, with what to save instead.
_NOT_ADMISSIBLE_HINTS = {
    "torch._C.Generator": "save its state instead (generator.get_state(), a uint8 tensor) and restore it "
                          "with generator.set_state(...)",
    "torch.nn.parameter.UninitializedParameter": "a lazy module was saved before its first forward pass; run "
                                                 "one batch through the model (or call its initialising "
                                                 "method) so every parameter has a shape, then save",
    "torch.nn.parameter.UninitializedBuffer": "a lazy module was saved before its first forward pass; run "
                                              "one batch through the model so every buffer has a shape, then save",
}


def refusal(path: str, obj: Any, why: str = "") -> SourceError:
    """The error for a value that cannot round-trip exactly: names its path, type and what to do."""
    tname = f"{type(obj).__module__}.{type(obj).__qualname__}"
    problem = plain_class_problem(type(obj))
    if problem is None:
        hint = (f"if it is plain data you trust, admit it: --allow {tname} "
                f"(Python: PackOptions(allow=[{tname!r}])); "
                f"else convert it to a dict/list of plain values before saving")
    else:
        hint = ("convert it to plain values (dict, list, tuple, numbers, str, tensors) before saving; "
                "torch.load(weights_only=True) refuses it too")
    return SourceError(f"a value of type {tname} cannot be archived exactly" + (f" ({why})" if why else ""),
                       where=path, hint=hint)


__all__ = ["BUILTIN_PLAIN_CLASSES", "torch_allowed_globals", "global_name", "resolve_global", "class_name",
           "plain_class_problem", "resolve_allow", "allowing", "current_allowed", "decode_class", "refused_global_hint",
           "refusal"]
