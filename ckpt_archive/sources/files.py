"""Walk a source folder and give every file a kind (the machinery every folder reader shares).

Each file gets a kind (see :data:`ckpt_archive.sources.base.FILE_KINDS`) and what can be decomposed
safely is decomposed:

* ``*.safetensors`` -> ``safetensors`` (tensors plus the header's str->str metadata);
* a ``torch.save`` file (zip with a ``data.pkl`` record, or a legacy pickle stream) ->
  ``torch`` via ``torch.load(weights_only=True)``. A pickle that ``weights_only`` refuses because it
  references code (a pickled sampler, a dataclass of arguments) is kept ``opaque`` with a warning
  naming the global: it is fingerprinted and restored byte for byte, never loaded. So is a file
  torch loads but whose state holds a value that cannot round-trip exactly (a warning names the
  file, the path in its state and the type). A damaged
  ``torch.save`` file (truncated zip, CRC failure, empty) raises :class:`SourceError`: archiving a
  half-written checkpoint would only hide the damage;
* files named by the reader as foreign pickles (``training_args.bin``) and DCP files
  (``.metadata``, ``*.distcp``) -> ``opaque`` without ever being opened by a loader;
* any other file -> ``raw`` when it is UTF-8 text without NUL bytes (JSON, YAML, tokenizer
  files), else ``opaque``.

Relative paths are POSIX, sorted, and include hidden files (DCP's ``.metadata``). A file that is a
hardlink of an earlier one (same inode) is recorded with ``link_of`` and restored as a hardlink.
"""
from __future__ import annotations

import codecs
import os
import re
import warnings as warnings_mod
import zipfile
from pathlib import Path
from typing import Iterable

from ckpt_archive.errors import RefusedPickle, SourceError, UnsafePath, first_line
from ckpt_archive.format.paths import MAX_SOURCE_PARTS, check_relpath
from ckpt_archive.format.text import shown, utf8_ok
from ckpt_archive.sources.base import SourceFile, library_path
from ckpt_archive.sources.torchfile import load_torch_file

#: File suffixes ``torch.save`` files usually carry (a file with another suffix is still recognised by
#: its first bytes).
TORCH_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".pkl", ".tar"}
_TEXT_CHUNK = 1 << 20


def torch_magic(path: Path) -> str | None:
    """``"zip"`` for a zip-format ``torch.save`` file, ``"pickle"`` for a legacy/plain pickle stream.

    Returns ``None`` for anything else (including empty files).
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return None
    if head[:2] == b"PK":
        return "zip"
    if head[:1] == b"\x80":
        return "pickle"
    return None


def _is_utf8_text(path: Path) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(_TEXT_CHUNK)
                if not chunk:
                    decoder.decode(b"", final=True)
                    return True
                if b"\x00" in chunk:
                    return False
                decoder.decode(chunk)
    except UnicodeDecodeError:
        return False


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """All regular files under ``root`` as sorted POSIX relpaths, plus warnings for skipped entries."""
    rels: list[str] = []
    warnings: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dpath = Path(dirpath)
        for d in list(dirnames):
            if (dpath / d).is_symlink():
                warnings.append(f"{(dpath / d).relative_to(root).as_posix()}: symlinked folder not followed "
                                f"(not archived)")
                dirnames.remove(d)
        for name in filenames:
            full = dpath / name
            rel = full.relative_to(root).as_posix()
            if not utf8_ok(rel):  # os.walk gives a name that is not UTF-8 as a str with lone surrogates
                raise SourceError(f"file name is not UTF-8 text: {shown(rel)!r} (a manifest names every file in "
                                  f"UTF-8); "
                                  f"rename it (e.g. `convmv -f latin1 -t utf8`) or move it out of the folder, then "
                                  f"pack again", where=str(root))
            if full.is_symlink():
                if not full.is_file():
                    warnings.append(f"{rel}: dangling symlink skipped (not archived)")
                    continue
                warnings.append(f"{rel}: symlink archived as the file it points to")
            elif not full.is_file():
                warnings.append(f"{rel}: not a regular file (skipped)")
                continue
            try:  # the path rule every reader applies (format/paths.py): refused here, not at the read-back
                check_relpath(rel, what="file")
                if rel.count("/") >= MAX_SOURCE_PARTS:
                    raise UnsafePath(f"file {rel!r} lies {rel.count('/')} folders deep, more than "
                                     f"{MAX_SOURCE_PARTS - 1}")
            except UnsafePath as exc:
                raise SourceError(f"{exc.message}; it cannot be archived", where=str(root)) from None
            rels.append(rel)
    rels.sort()
    return rels, warnings


_DCP_MARKER = b"torch.distributed.checkpoint.metadata"


def is_dcp_file(relpath: str, siblings: Iterable[str], root: Path | None = None) -> bool:
    """True for a torch.distributed.checkpoint file: ``*.distcp``, or a ``.metadata`` beside one or
    whose first bytes name DCP's metadata module (so a folder whose shards are all gone is still
    recognised, and reported, as DCP)."""
    name = relpath.rsplit("/", 1)[-1]
    if name.endswith(".distcp"):
        return True
    if name == ".metadata":
        parent = relpath.rsplit("/", 1)[0] if "/" in relpath else ""
        prefix = f"{parent}/" if parent else ""
        if any(s.startswith(prefix) and "/" not in s[len(prefix):] and s.endswith(".distcp") for s in siblings):
            return True
        if root is not None:
            try:
                with open(root / relpath, "rb") as fh:
                    return _DCP_MARKER in fh.read(4096)
            except OSError:
                return False
    return False


def load_safetensors(path: Path) -> tuple[dict, dict[str, str]]:
    """Read a ``.safetensors`` file: ``(name -> CPU tensor, header metadata str->str)``.

    Raises:
        SourceError: the header or data cannot be read (truncated, not safetensors).
    """
    from safetensors import safe_open

    from ckpt_archive.format.read_lease import ReadLease

    lease = None
    try:
        # [break] safe_open maps the file: mapped only under a read lease (a file truncated under the map
        # would end the process with SIGBUS); without one its bytes are read (a short read: SourceChanged)
        lease = ReadLease(path)
        if not lease.held:
            return _safetensors_from_bytes(path, lease)
        tensors = {}
        with library_path(path) as name, safe_open(name, framework="pt", device="cpu") as fh:
            metadata = dict(fh.metadata() or {})
            # in the file's order, as safetensors.torch.load_file gives them (keys() is sorted by name)
            keys = fh.offset_keys() if hasattr(fh, "offset_keys") else fh.keys()
            for key in keys:
                tensors[key] = fh.get_tensor(key)
        lease.check()  # the tensors are copies: once read, the map is gone and the file may change
    except SourceError:
        raise
    except Exception as exc:  # safetensors raises SafetensorError/OSError/...: one line naming the file
        raise SourceError(f"unreadable safetensors file: {first_line(exc)}",
                          where=str(path)) from None
    finally:
        if lease is not None:
            lease.close()
    return tensors, metadata


def _safetensors_from_bytes(path: Path, lease) -> tuple[dict, dict[str, str]]:
    """:func:`load_safetensors` from the file's bytes read through ``lease``'s descriptor (no map), in
    the file's order, with its header metadata."""
    import json

    from safetensors.torch import load

    from ckpt_archive.format.read_lease import pread_exact

    buf = bytearray(os.fstat(lease.fd).st_size)
    pread_exact(lease.fd, buf, 0, Path(path))
    tensors = load(bytes(buf))
    n = int.from_bytes(buf[:8], "little") if len(buf) >= 8 else 0
    header = json.loads(bytes(buf[8:8 + n])) if 0 < n <= len(buf) - 8 else {}
    metadata = {str(k): str(v) for k, v in (header.pop("__metadata__", None) or {}).items()}
    order = sorted((k for k in header if k in tensors), key=lambda k: header[k]["data_offsets"][0])
    return {k: tensors[k] for k in order}, metadata


def classify_file(root: Path, rel: str, *, allow_numpy: bool = False, opaque: bool = False,
                  siblings: Iterable[str] = ()) -> tuple[SourceFile, object, list[str]]:
    """Give one file of a folder its kind and, for decomposable kinds, its object.

    Args:
        root: the source folder.
        rel: POSIX path of the file relative to ``root``.
        allow_numpy: admit NumPy's own types when loading a ``torch.save`` file.
        opaque: the caller knows this file is a foreign pickle (never opened by a loader).
        siblings: every relpath in the folder (to recognise DCP's ``.metadata``).

    Returns:
        ``(SourceFile, object or None, warnings)``; the object is ``None`` for raw/opaque files.

    Raises:
        SourceError: a damaged ``torch.save`` or safetensors file (truncated, bad CRC, empty).
    """
    path = root / rel
    name = rel.rsplit("/", 1)[-1]
    suffix = Path(name).suffix.lower()
    if opaque or is_dcp_file(rel, siblings, root):
        return SourceFile(rel, "opaque", path), None, []
    if suffix == ".safetensors":
        tensors, metadata = load_safetensors(path)
        return SourceFile(rel, "safetensors", path, metadata=metadata), tensors, []
    magic = torch_magic(path)
    size = path.stat().st_size
    if suffix in TORCH_SUFFIXES and size == 0:
        raise SourceError("empty file (0 bytes) where a torch.save file was expected: an interrupted write?",
                          where=str(path))
    if magic == "zip":
        if not zipfile.is_zipfile(path):
            if suffix not in TORCH_SUFFIXES:  # some other damaged zip (logs.zip): carried as it is
                return SourceFile(rel, "opaque", path), None, []
            # Let the torch reader name the damage (truncated zip directory, ...).
            load_torch_file(path, mmap=False)
        with zipfile.ZipFile(path) as zf:
            is_torch = any(n.endswith("data.pkl") for n in zf.namelist())
        if not is_torch:
            return SourceFile(rel, "opaque", path), None, _unparsed_note(rel, suffix, "a zip archive, not a torch.save file")
        try:
            obj = load_torch_file(path, allow_numpy=allow_numpy)
        except RefusedPickle as exc:
            return SourceFile(rel, "opaque", path), None, [_opaque_note(rel, exc)]
        return SourceFile(rel, "torch", path), obj, []
    if magic == "pickle":
        try:
            with warnings_mod.catch_warnings():  # "Detected pickle protocol 4": a plain pickle, refused below
                warnings_mod.simplefilter("ignore", UserWarning)
                obj = load_torch_file(path, allow_numpy=allow_numpy, mmap=False)
        except RefusedPickle as exc:
            return SourceFile(rel, "opaque", path), None, [_opaque_note(rel, exc)]
        except SourceError as exc:
            # A plain pickle (not torch.save) or a legacy file torch cannot read: never unpickled.
            return SourceFile(rel, "opaque", path), None, [
                f"{rel}: kept opaque (byte for byte, never loaded): not loadable with "
                f"torch.load(weights_only=True): {exc.message}"]
        return SourceFile(rel, "torch", path), obj, []
    if _is_utf8_text(path):
        return SourceFile(rel, "raw", path), None, []
    return SourceFile(rel, "opaque", path), None, _unparsed_note(rel, suffix, "neither a torch.save nor a pickle file")


def _unparsed_note(rel: str, suffix: str, what: str) -> list[str]:
    """The warning for a file whose name says checkpoint (``.pt``, ``.bin``, ...) but which could not be
    parsed as one: it rides along opaque, and the user is told (issue 11); other binary files ride along
    silently (nothing was expected of them)."""
    if suffix not in TORCH_SUFFIXES:
        return []
    return [f"{rel}: kept opaque (byte for byte, fingerprinted, never loaded): its name says checkpoint but it "
            f"is {what}; its state is not decomposed or checked"]


def _opaque_note(rel: str, exc: RefusedPickle) -> str:
    m = re.search(r"references ([\w.]+)", exc.message)
    what = m.group(1) if m else "a non-data global"
    note = f"{rel}: kept opaque (byte for byte, never loaded): its pickle references {what}"
    if exc.hint:
        note += f"; {exc.hint}"
    return note


def read_folder(root: Path, *, allow_numpy: bool = False, numpy_files: Iterable[str] = (),
                opaque_files: Iterable[str] = ()) -> tuple[dict, list[SourceFile], list[str]]:
    """Walk a folder and classify every file (see the module docstring).

    Args:
        root: the folder.
        allow_numpy: admit NumPy's own types in every ``torch.save`` file.
        numpy_files: relpaths or ``fnmatch`` patterns (one without ``/`` names top-level files
            only) of files whose library writes NumPy RNG state by design and loads it with the
            same NumPy allowlist (HF ``rng_state*.pth``, Accelerate ``random_states_*.pkl``):
            admitted even without ``allow_numpy``.
        opaque_files: relpaths (or patterns) of known foreign pickles, never opened by a loader.

    Returns:
        ``(state, files, warnings)``: ``state`` maps each decomposed file's relpath to its object.

    Raises:
        SourceError: the folder is empty, or a file is damaged.
    """
    from fnmatch import fnmatchcase as _fnmatchcase

    rels, warnings = _walk(root)
    if not rels:
        raise SourceError("empty folder: no files to archive", where=str(root))
    numpy_pats = list(numpy_files)
    opaque_pats = list(opaque_files)

    def fnmatchcase(rel: str, pat: str) -> bool:  # a pattern without "/" names top-level files only
        return ("/" in pat or "/" not in rel) and _fnmatchcase(rel, pat)

    state: dict = {}
    files: list[SourceFile] = []
    inodes: dict[tuple[int, int], SourceFile] = {}
    for rel in rels:
        st = os.lstat(root / rel)
        first = inodes.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        if first is not None:  # a hardlink of an earlier file: kept as a link, not stored twice
            files.append(SourceFile(rel, first.kind, root / rel, metadata=first.metadata, link_of=first.relpath))
            continue
        sf, obj, notes = classify_file(
            root, rel,
            allow_numpy=allow_numpy or any(fnmatchcase(rel, p) for p in numpy_pats),
            opaque=any(fnmatchcase(rel, p) for p in opaque_pats),
            siblings=rels)
        if sf.kind == "torch":
            why = cannot_round_trip(obj)
            if why is not None:
                # torch loaded it, but a value in it cannot come back exactly: the file rides along
                # byte for byte instead of failing the whole folder
                sf, obj = SourceFile(rel, "opaque", sf.path), None
                notes = notes + [f"{rel}: kept opaque (byte for byte, fingerprinted, not decomposed): {why}"]
        files.append(sf)
        if st.st_nlink > 1 and not (root / rel).is_symlink():
            inodes[(st.st_dev, st.st_ino)] = sf
        warnings.extend(notes)
        if sf.kind in ("torch", "safetensors"):
            state[rel] = obj
    return state, files, warnings


def cannot_round_trip(obj) -> str | None:
    """Why ``obj`` (a loaded file's state) cannot be stored exactly as a state tree, or None when it can.

    Runs the state-tree encoder without storing anything (no tensor bytes are read)."""
    from ckpt_archive.format.state_tree import encode

    try:
        encode(obj)
    except SourceError as exc:
        return f"{exc.where}: {exc.message}" if exc.where else exc.message
    return None


def file_sizes(files: Iterable[SourceFile]) -> dict[str, int]:
    """relpath -> size in bytes for files on disk."""
    return {f.relpath: f.path.stat().st_size for f in files if f.path is not None}


__all__ = ["TORCH_SUFFIXES", "torch_magic", "is_dcp_file", "load_safetensors", "classify_file", "read_folder",
           "cannot_round_trip", "file_sizes"]
