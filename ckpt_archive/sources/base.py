"""What every source reader shares: :class:`SourceCheckpoint`, :class:`SourceFile`, the reader
registry (:func:`register`, :data:`READERS`), :func:`read_source` and :func:`from_object`.

Readers turn what a trainer wrote into a :class:`SourceCheckpoint`.

A source is either one file (a ``torch.save`` file, a ``.safetensors`` file) or a folder (a Hugging
Face Trainer ``checkpoint-N/``, an Accelerate ``save_state`` folder, per-rank files, a
torch.distributed.checkpoint folder). Every file of a source is one of:

* ``torch``: decomposed with ``torch.load(weights_only=True)`` into the state tree;
* ``safetensors``: decomposed with safetensors into the state tree (its str->str metadata kept);
* ``raw``: kept byte for byte (JSON, text), readable;
* ``opaque``: kept byte for byte, fingerprinted, **never loaded** (a pickled ``training_args.bin``,
  DCP's pickled ``.metadata`` as far as the archive is concerned).

Readers register themselves in :data:`READERS` when imported (:mod:`ckpt_archive.sources` imports the
built-in ones); :func:`read_source` detects the format (or takes ``fmt``) and returns the checkpoint.
The archive writer needs nothing else. This module imports no reader.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from ckpt_archive.errors import SourceError

#: The kinds a source file may have (see module docstring).
FILE_KINDS = ("torch", "safetensors", "raw", "opaque")


@dataclasses.dataclass
class SourceFile:
    """One file of a source.

    Attributes:
        relpath: POSIX path relative to the source folder; ``""`` for a single-file source.
        kind: one of :data:`FILE_KINDS`.
        path: where the file is on disk (``None`` for a Python object handed to the API).
        metadata: for ``safetensors`` files, the header's str->str metadata (kept for restore).
        link_of: the relpath of an earlier file of the source this one is a hardlink of (same inode):
            not stored again, restored as a hardlink of it.
    """

    relpath: str
    kind: str
    path: Path | None
    metadata: dict[str, str] | None = None
    link_of: str | None = None


@dataclasses.dataclass
class SourceCheckpoint:
    """What a reader found: the nested state plus the files that make up the source.

    Attributes:
        format: e.g. ``"torch-file"``, ``"python-object"``, ``"safetensors-file"``, ``"hf-trainer"``,
            ``"accelerate"``, ``"lightning"``, ``"rank-files"``, ``"dcp"``.
        layout: ``"file"`` (``state`` is the one file's object) or ``"folder"`` (``state`` maps each
            decomposed file's relpath to its object; raw/opaque files are not in ``state``).
        state: the nested state (dict/list/tuple/tensors/plain values).
        files: every file of the source, in a stable order.
        progress: ``step`` / ``epoch`` / ``cursor`` (ints) found in the source, for the manifest.
        info: format-specific facts for the manifest's ``source`` section (strict-JSON values only).
        warnings: human-readable notes found while reading (e.g. "2 CUDA RNG states saved").
    """

    format: str
    layout: str
    state: Any
    files: list[SourceFile]
    root: Path | None = None
    progress: dict = dataclasses.field(default_factory=dict)
    info: dict = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)


#: name -> (detect(path) -> bool, read(path, **options) -> SourceCheckpoint).
READERS: dict[str, tuple[Callable[[Path], bool], Callable[..., SourceCheckpoint]]] = {}
_PRIORITY: dict[str, int] = {}


@contextlib.contextmanager
def library_path(path: Path):
    """A path string that torch's and safetensors' file readers accept for ``path``.

    Both take paths as UTF-8 text: a path holding bytes that are not UTF-8 (a folder named in Latin-1;
    Python gives it as a str with lone surrogates) fails inside them with a codec error. Such a file is
    opened here and named through ``/proc/self/fd/<n>`` (Linux), which reads the same file; elsewhere it
    is refused with what to do.

    Raises:
        SourceError: the path is not UTF-8 and this system has no ``/proc/self/fd``.
    """
    from ckpt_archive.format.text import shown, utf8_ok

    text = str(path)
    if utf8_ok(text):
        yield text
        return
    if not os.path.isdir("/proc/self/fd"):
        raise SourceError("path is not UTF-8 text, which torch and safetensors cannot open; rename it",
                          where=shown(text))
    fd = os.open(path, os.O_RDONLY)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def register(name: str, detect: Callable[[Path], bool], read: Callable[..., SourceCheckpoint],
             priority: int = 50) -> None:
    """Register a reader under ``name`` (used by ``--format``).

    Detection tries readers by ascending ``priority``: specific folder layouts (HF Trainer,
    Accelerate, DCP) should use low numbers, generic fallbacks (any ``.pt`` file) high ones.
    """
    READERS[name] = (detect, read)
    _PRIORITY[name] = priority


def read_source(path: str | Path, fmt: str | None = None, **options) -> SourceCheckpoint:
    """Read a checkpoint file or folder from disk.

    Args:
        path: a file or folder.
        fmt: a reader name from :data:`READERS` to force; ``None`` detects.
        **options: passed to the reader (e.g. ``allow_numpy=True``).

    Raises:
        SourceError: missing path, not a regular file or folder, unknown format, unreadable or refused
            content.
    """
    p = Path(path)
    if not p.exists():
        raise SourceError("no such file or folder", where=str(p))
    if not (p.is_file() or p.is_dir()):  # a FIFO would block a reader forever, a device never ends
        raise SourceError("not a regular file or folder (a FIFO, socket or device); refused", where=str(p))
    if fmt is not None:
        if fmt not in READERS:
            raise SourceError(f"unknown format {fmt!r}; known: {', '.join(sorted(READERS))}", where=str(p))
        return READERS[fmt][1](p, **options)
    for _name in sorted(READERS, key=lambda n: _PRIORITY.get(n, 50)):
        detect, read = READERS[_name]
        if detect(p):
            return read(p, **options)
    kind = "folder" if p.is_dir() else "file"
    raise SourceError(f"not a checkpoint this tool recognises ({kind}); use --format to force one of "
                      f"{', '.join(sorted(READERS))}", where=str(p))


def from_object(state: Any, *, progress: dict | None = None) -> SourceCheckpoint:
    """Wrap a nested state handed to the Python API."""
    return SourceCheckpoint(format="python-object", layout="file", state=state,
                            files=[SourceFile("", "torch", None)], progress=dict(progress or {}))


__all__ = ["FILE_KINDS", "SourceFile", "SourceCheckpoint", "READERS", "library_path", "register", "read_source",
           "from_object"]
