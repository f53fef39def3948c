"""Which checkpoint a scheduled backup packs: the newest one in SOURCE (``ckpt-archive backup``'s rule).

SOURCE is a checkpoint file, a checkpoint folder, or a training output folder. In a training output folder
the newest checkpoint is the ``checkpoint-N/`` folder with the highest N (Hugging Face Trainer), else the
``*.pt``/``*.pth``/``*.ckpt`` file (top level or ``checkpoints/``) holding the highest step -- read from the
file under a read lease, never unpickled -- not the one written last: a stray older-step file copied in later
must not become ``@latest``. Used by :mod:`ckpt_archive.ops.backup`, which decides whether it is settled,
complete and new.
"""
from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

from ckpt_archive.errors import NotFound, SourceError

#: A Hugging Face Trainer checkpoint folder's name (``checkpoint-500``); group 1 is its step.
CKPT_DIR = re.compile(r"^checkpoint[-_](\d+)$")
_CKPT_SUFFIXES = (".pt", ".pth", ".ckpt")
#: A file name a writer uses while it is still writing (``.tmp``, ``.part``, ``tmp-...``): never a checkpoint.
TEMP_NAME = re.compile(r"(\.tmp|\.temp|\.part|\.partial|\.incomplete|\.lock|~)$|^(tmp[-_.]|\.tmp)", re.I)


# --------------------------------------------------------------------------------------------------
# which checkpoint
def _looks_like_checkpoint_folder(path: Path) -> bool:
    """A folder that is itself one checkpoint (HF/Accelerate/DCP/Lightning layout), not an output folder."""
    names = {p.name for p in path.iterdir()}
    markers = {"trainer_state.json", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json", ".metadata", "optimizer.bin", "random_states_0.pkl"}
    if names & markers:
        return True
    return any(n.endswith(".distcp") or n.endswith(".safetensors") for n in names)


def checkpoint_candidates(source: str | os.PathLike, steps: dict | None = None) -> list[Path]:
    """Every checkpoint SOURCE offers, newest first (the first is what :func:`find_checkpoint` picks).

    Args:
        source: a checkpoint file, a checkpoint folder, or a training output folder.
        steps: a cache of the steps read from files (:func:`file_steps`; updated in place), or None.

    Returns:
        ``[SOURCE]`` when it is a file or a checkpoint folder; else the ``checkpoint-N/`` subfolders
        by N, highest first (``tmp-checkpoint-*`` ignored); else the ``*.pt``/``*.pth``/``*.ckpt`` files
        at the top level or in ``checkpoints/``, by the step each holds, highest first (ties and files
        whose step cannot be read: newest mtime first), and a file whose step cannot be read (one still
        being written) first when it is newer than every file whose step is known. Never empty.

    Raises:
        NotFound: SOURCE does not exist.
        SourceError: a folder holding no checkpoint this rule finds (the message says what was sought).
    """
    src = Path(source)
    if not src.exists():
        raise NotFound("no such file or folder", where=str(src))
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise SourceError("not a regular file or folder", where=str(src))
    numbered = [(int(m.group(1)), p) for p in src.iterdir() for m in [CKPT_DIR.match(p.name)] if m and p.is_dir()]
    if numbered:
        return [p for _, p in sorted(numbered, reverse=True)]
    if _looks_like_checkpoint_folder(src):
        return [src]
    by_mtime = _checkpoint_files(src)
    if len(by_mtime) == 1:
        return by_mtime
    return _by_step(by_mtime, steps if steps is not None else {})


def _checkpoint_files(src: Path) -> list[Path]:
    """The ``*.pt``/``*.pth``/``*.ckpt`` files at the top of ``src`` or in its ``checkpoints/``, newest mtime
    first (temporary names left out).

    Raises:
        SourceError: there is none.
    """
    files = []
    for folder in (src, src / "checkpoints"):
        if folder.is_dir():
            for p in folder.iterdir():
                if p.is_file() and p.suffix.lower() in _CKPT_SUFFIXES and not TEMP_NAME.search(p.name):
                    st = p.stat()
                    files.append((st.st_mtime_ns, p.name, p))
    if not files:
        raise SourceError("no checkpoint found: looked for checkpoint-N/ folders and *.pt, *.pth, *.ckpt files "
                          "(top level and checkpoints/)", where=str(src))
    return [p for _, _, p in sorted(files, reverse=True)]


def _by_step(by_mtime: list[Path], steps: dict) -> list[Path]:
    """[issue 26] Checkpoint files by the step each holds, not by mtime (a stray older-step file written later
    must not become @latest): see :func:`checkpoint_candidates`. ``steps``: the cache of :func:`file_steps`."""
    step_of = file_steps(by_mtime, steps)
    known = [p for p in by_mtime if step_of[p] is not None]
    if not known:
        return by_mtime
    newest_known = max(p.stat().st_mtime_ns for p in known)
    unknown = [p for p in by_mtime if step_of[p] is None]
    ranked = sorted(known, key=lambda p: (step_of[p], p.stat().st_mtime_ns, p.name), reverse=True)
    return ([p for p in unknown if p.stat().st_mtime_ns > newest_known] + ranked
            + [p for p in unknown if p.stat().st_mtime_ns <= newest_known])


def file_steps(paths: list[Path], cache: dict) -> dict[Path, int | None]:
    """The progress step each checkpoint file holds (:func:`~ckpt_archive.format.progress.find_progress`),
    read with ``torch.load(weights_only=True, mmap=True)`` (NumPy's own types admitted, nothing else; the
    tensors' bytes are not read), or None when it cannot be read (still being written, refused, no step).

    Args:
        paths: the files.
        cache: ``{path: [size, mtime_ns, inode, step]}`` from earlier runs (``backup-state.json``): a file
            whose stat facts are unchanged is not read again; updated in place.
    """
    found: dict[Path, int | None] = {}
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            found[p] = None
            continue
        facts = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = cache.get(str(p))
        if isinstance(hit, list) and len(hit) == 4 and hit[:3] == facts and (hit[3] is None or type(hit[3]) is int):
            found[p] = hit[3]
            continue
        found[p] = _read_step(p)
        cache[str(p)] = [*facts, found[p]]
    return found


def _read_step(path: Path) -> int | None:
    """The step a ``torch.save`` file holds, or None (see :func:`file_steps`)."""
    try:
        import torch

        from ckpt_archive.format.progress import find_progress
        from ckpt_archive.format.read_lease import ReadLease
        from ckpt_archive.sources.torchfile import numpy_safe_globals

        # [break] mapped only under a read lease (a trainer truncating the file under the map would end
        # this process with SIGBUS); without one torch reads the file
        lease = ReadLease(path)
        try:
            with torch.serialization.safe_globals(numpy_safe_globals()):
                state = torch.load(path, map_location="cpu", weights_only=True,
                                   mmap=zipfile.is_zipfile(path) and lease.held)
            step = find_progress(state).get("step")
            del state
            if lease.broken():
                return None  # being rewritten: ordered by mtime, read again on the next run
        finally:
            lease.close()
        return step if type(step) is int else None
    except Exception:  # noqa: BLE001 - unreadable now (being written, refused): ordered by mtime instead
        return None


def find_checkpoint(source: str | os.PathLike) -> Path:
    """Pick the checkpoint to back up from SOURCE: the newest of :func:`checkpoint_candidates`.

    Args:
        source: a checkpoint file, a checkpoint folder, or a training output folder.

    Returns:
        The file or folder to pack: SOURCE itself when it is a file or a checkpoint folder; else the
        ``checkpoint-N/`` subfolder with the highest N (``tmp-checkpoint-*`` ignored); else the
        ``*.pt``/``*.pth``/``*.ckpt`` file at the top level or in ``checkpoints/`` holding the highest step
        (see :func:`checkpoint_candidates`).

    Raises:
        NotFound: SOURCE does not exist.
        SourceError: a folder holding no checkpoint this rule finds (the message says what was sought).
    """
    return checkpoint_candidates(source)[0]


__all__ = ["CKPT_DIR", "TEMP_NAME", "checkpoint_candidates", "file_steps", "find_checkpoint"]
