"""Readers for a ``.safetensors`` model file, a folder of per-rank ``.pt`` files, and any other folder.

They read folders with the shared machinery of :mod:`ckpt_archive.sources.files`
(:func:`~ckpt_archive.sources.files.read_folder`): its docstring says which kind each file gets, what is
decomposed, what rides along opaque (with a warning) and what refuses the folder.
"""
from __future__ import annotations

import re
from pathlib import Path

from ckpt_archive.errors import SourceError
from ckpt_archive.sources.base import SourceCheckpoint, SourceFile, register
from ckpt_archive.sources.dcp import attach_dcp_info
from ckpt_archive.sources.files import TORCH_SUFFIXES, load_safetensors, read_folder


def _detect_safetensors(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".safetensors"


def _read_safetensors(path: Path, **_options) -> SourceCheckpoint:
    tensors, metadata = load_safetensors(path)
    info = {"filename": path.name, "tensors": len(tensors),
            "tensor_bytes": int(sum(t.numel() * t.element_size() for t in tensors.values()))}
    if metadata:
        info["metadata"] = dict(metadata)
    return SourceCheckpoint(format="safetensors-file", layout="file", state=tensors, root=path.parent,
                            files=[SourceFile("", "safetensors", path, metadata=metadata)], info=info)


# A folder of per-rank torch.save files: "rank0.pt", "model_rank_1.pt", "rank1-of-4-optimizer.pt" (HF's SageMaker naming); never the
# "-00001-of-00002" numbering of sharded model files, which starts at 1 and is not a rank.
_RANK_RE = re.compile(r"rank[_-]?(\d+)(?:[_-]?of[_-]?(\d+))?", re.IGNORECASE)


def _rank_of(name: str) -> tuple[int, int | None] | None:
    m = _RANK_RE.search(Path(name).stem)
    if m is None:
        return None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


def _detect_rank_files(path: Path) -> bool:
    if not path.is_dir():
        return False
    torchish = [p for p in path.iterdir() if p.is_file() and p.suffix.lower() in TORCH_SUFFIXES]
    if not torchish:
        return False
    if any(p.is_dir() for p in path.iterdir()):
        return False
    return all(_rank_of(p.name) is not None for p in torchish)


def _read_rank_files(path: Path, *, allow_numpy: bool = False, **_options) -> SourceCheckpoint:
    state, files, warnings = read_folder(path, allow_numpy=allow_numpy)
    ranks: dict[int, str] = {}
    world = None
    for f in files:
        if Path(f.relpath).suffix.lower() not in TORCH_SUFFIXES:
            continue
        r = _rank_of(f.relpath)
        if r is None:
            continue
        rank, of = r
        if rank in ranks:
            warnings.append(f"{f.relpath}: rank {rank} also in {ranks[rank]}")
        ranks[rank] = f.relpath
        if of is not None:
            world = of if world is None else max(world, of)
    expected = world if world is not None else (max(ranks) + 1 if ranks else 0)
    missing = [r for r in range(expected) if r not in ranks]
    if missing:
        raise SourceError(f"per-rank files for rank(s) {', '.join(map(str, missing))} are missing "
                          f"(found {len(ranks)} of {expected}); a resume needs every rank",
                          where=str(path))
    progress = _common_progress([state[f] for f in sorted(state) if isinstance(state[f], dict)], warnings)
    info = {"ranks": {str(k): v for k, v in sorted(ranks.items())}, "world_size": expected}
    return SourceCheckpoint(format="rank-files", layout="folder", state=state, files=files, root=path,
                            progress=progress, info=info, warnings=warnings)


def _common_progress(objs: list, warnings: list[str]) -> dict:
    """``step``/``epoch`` found at the top level of each rank's dict; they must agree."""
    progress: dict = {}
    for key, names in (("step", ("global_step", "step", "iteration")), ("epoch", ("epoch",))):
        seen = set()
        for obj in objs:
            for n in names:
                v = obj.get(n)
                if isinstance(v, int) and not isinstance(v, bool):
                    seen.add(v)
                    break
        if len(seen) == 1:
            progress[key] = seen.pop()
        elif len(seen) > 1:
            warnings.append(f"ranks disagree on {key}: {sorted(seen)} (not one resume point?)")
    return progress


def _detect_folder(path: Path) -> bool:
    return path.is_dir()


def _read_folder(path: Path, *, allow_numpy: bool = False, **_options) -> SourceCheckpoint:
    state, files, warnings = read_folder(path, allow_numpy=allow_numpy)
    info: dict = {"files": len(files), "kinds": {k: sum(1 for f in files if f.kind == k)
                                                 for k in ("torch", "safetensors", "raw", "opaque")}}
    attach_dcp_info(info, path, files, warnings)
    return SourceCheckpoint(format="folder", layout="folder", state=state, files=files, root=path,
                            info=info, warnings=warnings)


register("safetensors-file", _detect_safetensors, _read_safetensors, priority=40)
register("rank-files", _detect_rank_files, _read_rank_files, priority=60)
register("folder", _detect_folder, _read_folder, priority=95)


__all__ = []
