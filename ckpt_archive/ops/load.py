"""``load``: rebuild an archived state in memory, every chunk and tensor checked on the way."""
from __future__ import annotations

from typing import Any

from ckpt_archive.ops.common import RepoLike, open_repo, with_fallback
from ckpt_archive.repo.reader import ArchiveReader


def load(repo: RepoLike, generation: str | int = "latest", *, only: str | None = None, fallback: bool = False,
         map_location=None, jobs: int | None = None, **store_options) -> Any:
    """Rebuild the archived state in memory, checking every chunk and tensor on the way.

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        only: a ``/``-separated path into the state (``"model"``) to load just that part.
        fallback: when ``latest`` fails its checks, use the newest older generation that verifies.
        map_location: move torch tensors there (default: CPU).
        jobs: decoder threads (default: cores).
        **store_options: for URL repositories (``endpoint_url=``, ``storage_options=``).

    Returns:
        the nested state, equal to what was packed in structure, types, dtypes, shapes and bits.

    Raises:
        IntegrityError (exit 1) -- never returns wrong data; NotFound / NoUsableGeneration (exit 2).

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"model": {"w": torch.arange(3.0)}, "step": 7}, repo)
        >>> state = ckpt_archive.load(repo)
        >>> state["step"], state["model"]["w"].tolist()
        (7, [0.0, 1.0, 2.0])
    """
    r = open_repo(repo, **store_options)
    _, state = with_fallback(r, generation, fallback,
                             lambda g: ArchiveReader(r.store, g.key, g.manifest, jobs=jobs).load(
                                 only, map_location=map_location))
    return state


__all__ = ["load"]
