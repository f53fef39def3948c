"""The one path rule: every path read from a manifest, a marker or a store key is a relative POSIX path of
plain names, checked before any I/O (docs/FORMAT.md, "Reading hostile archives").

A *plain name* is a non-empty path part other than ``.`` and ``..`` holding no backslash, no NUL and no
other control character. A path is plain names joined by ``/``: never absolute, never empty, no
``//``, no trailing ``/``, no Windows drive (``C:``). Stores check every key with :func:`check_relpath`
(:mod:`ckpt_archive.store.local`, :mod:`ckpt_archive.store.fsspec_store`); the manifest parser checks
every path a manifest names with :func:`check_manifest_paths` (so a generation that breaks the rule is
``damaged``, listed as such, and never read); ``restore`` resolves each final output path with
:func:`inside` and refuses one that leaves the target folder.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

from ckpt_archive.errors import UnsafePath

__all__ = ["check_relpath", "check_manifest_paths", "inside", "manifest_paths"]

#: Longest path accepted (bytes of UTF-8); longer ones are refused rather than passed to a file system.
MAX_PATH_BYTES = 4096
#: Most parts (names between ``/``) a path may have: deeper ones are refused before anything is written
#: (restore creates and removes folders with functions that recurse once per level).
MAX_PATH_PARTS = 512
#: Most parts of a source file's relpath that ``pack`` takes: its member's store key adds a few
#: (``generations/<n>/files/...``) and must still pass :data:`MAX_PATH_PARTS`.
MAX_SOURCE_PARTS = 500
#: A NUL or other control character (C0 and DEL). One regular-expression scan, not a Python loop per
#: character: every store key is checked at each open (a load of a 1 GiB state, ~1,100 keys: 34 ms -> 4 ms).
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _why_not_plain(path: Any) -> str | None:
    if not isinstance(path, str):
        return f"not a string ({type(path).__name__})"
    if not path:
        return "empty"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"longer than {MAX_PATH_BYTES} bytes"
    if "\\" in path:
        return "holds a backslash"
    if _CONTROL.search(path):
        return "holds a NUL or control character"
    if path.startswith("/"):
        return "absolute"
    if len(path) >= 2 and path[1] == ":" and path[0].isalpha():
        return "starts with a drive letter"
    parts = path.split("/")
    if len(parts) > MAX_PATH_PARTS:
        return f"has {len(parts)} parts, more than {MAX_PATH_PARTS}"
    for part in parts:
        if part == "":
            return "has an empty part (// or a trailing /)"
        if part in (".", ".."):
            return f"has a {part!r} part"
    return None


def check_relpath(path: Any, *, where: str | None = None, what: str = "path") -> str:
    """Refuse anything but a relative POSIX path of plain names.

    Args:
        path: the path as read (a manifest field, a store key).
        where: the file or field it came from, named in the error.
        what: what the path is ("member path", "store key"), named in the error.

    Returns:
        ``path`` itself, unchanged.

    Raises:
        UnsafePath: (exit 1) not a plain relative path; says why.

    Example:
        >>> check_relpath("files/a.bin")
        'files/a.bin'
        >>> check_relpath("../x", where="manifest.json")
        Traceback (most recent call last):
        ...
        ckpt_archive.errors.UnsafePath: manifest.json: path '../x' is refused: has a '..' part (a path read from an archive must be relative and made of plain names)
    """
    why = _why_not_plain(path)
    if why is not None:
        raise UnsafePath(f"{what} {path!r} is refused: {why} (a path read from an archive must be relative and "
                         f"made of plain names)", where=where)
    return path


def manifest_paths(doc: dict) -> Iterator[tuple[str, Any]]:
    """Every ``(field, path)`` of a manifest that names a member or a file relative to something."""
    for i, m in enumerate(doc.get("members") or []):
        if isinstance(m, dict):
            yield f"members/{i}/path", m.get("path")
            yield f"members/{i}/stored_path", m.get("stored_path")
    if doc.get("tree_member") is not None:
        yield "tree_member", doc.get("tree_member")
    src = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    for i, f in enumerate(src.get("files") or []):
        if not isinstance(f, dict):
            continue
        if f.get("relpath") != "" or src.get("layout") == "folder":  # "": an in-memory state (no file name)
            yield f"source/files/{i}/relpath", f.get("relpath")
        for name in ("member", "hardlink_of"):
            if f.get(name) is not None:
                yield f"source/files/{i}/{name}", f.get(name)
        if isinstance(f.get("exact"), dict):
            yield f"source/files/{i}/exact/member", f["exact"].get("member")
    data = doc.get("data") if isinstance(doc.get("data"), dict) else {}
    if data.get("ids_member") is not None:
        yield "data/ids_member", data.get("ids_member")
    tensors = doc.get("tensors") if isinstance(doc.get("tensors"), dict) else {}
    for key, t in tensors.items():
        if isinstance(t, dict) and t.get("member") is not None:
            yield f"tensors/{key}/member", t.get("member")


def check_manifest_paths(doc: dict, *, where: str = "manifest.json") -> None:
    """Check every path a manifest names (:func:`manifest_paths`) with :func:`check_relpath`.

    A file source of layout ``file`` records the path it was packed from in ``source.path`` (not used
    to write anything) and the base name in ``source.files[].relpath``; both read-side uses go through
    this rule.

    Raises:
        UnsafePath: (exit 1) naming the field and why.
    """
    for field, path in manifest_paths(doc):
        check_relpath(path, where=f"{where}: {field}", what="path")


def inside(base: str | os.PathLike, relpath: str, *, where: str | None = None) -> Path:
    """The path ``base/relpath`` after checking ``relpath`` and resolving symbolic links already on disk:
    refuse one that ends outside ``base`` (a ``..``, an absolute path, or a link inside ``base`` that
    points out).

    Args:
        base: the target folder (restore's output folder).
        relpath: a path read from a manifest.
        where: named in the error.

    Returns:
        ``base / relpath`` (not resolved: the caller writes there).

    Raises:
        UnsafePath: (exit 1) the path is not plain or resolves outside ``base``.
    """
    check_relpath(relpath, where=where)
    root = Path(os.path.realpath(base))
    target = Path(base) / relpath
    real = Path(os.path.realpath(target))
    if real != root and root not in real.parents:
        raise UnsafePath(f"path {relpath!r} resolves to {real}, outside {root}; refused", where=where)
    return target
