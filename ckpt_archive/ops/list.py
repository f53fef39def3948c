"""``list_generations``: the generations of a repository, oldest first, with their status."""
from __future__ import annotations

from typing import Any

from ckpt_archive.ops.common import RepoLike, open_repo
from ckpt_archive.repo.repository import Generation


def list_generations(repo: RepoLike, all: bool = False, **store_options: Any) -> list[Generation]:
    """Generations oldest first: usable ones, or with ``all=True`` every one with its status and why.

    Args:
        repo: repository path/URL or Repository.
        all: include generations that are not usable (``partial``, ``copied``, ``damaged``).
        **store_options: for URL repositories.

    Returns:
        :class:`~ckpt_archive.repo.repository.Generation` objects (``number``, ``status``, ``reason``,
        ``manifest``, ``metrics`` as plain JSON values, ...).

    Raises:
        NotFound: not a repository. StoreError: the store refused access.

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"w": torch.ones(2)}, repo)
        >>> [(g.number, g.status) for g in ckpt_archive.list_generations(repo)]
        [(1, 'usable')]
    """
    r = open_repo(repo, **store_options)
    gens = r.generations()
    return gens if all else [g for g in gens if g.usable]


__all__ = ["list_generations"]
