"""``list_generations``: the generations of a repository, oldest first, with their status."""
from __future__ import annotations

from typing import Any, Mapping

from ckpt_archive.ops.common import RepoLike, open_repo
from ckpt_archive.repo.repository import Generation


def list_generations(repo: RepoLike, all: bool = False, *,
                     store_options: Mapping[str, Any] | None = None) -> list[Generation]:
    """Generations oldest first: usable ones, or with ``all=True`` every one with its status and why.

    Args:
        repo: repository path/URL or Repository.
        all: include generations that are not usable (``partial``, ``copied``, ``damaged``).
        store_options: for URL repositories, one mapping (``{"endpoint_url": ..., "storage_options": {...}}``;
            :func:`~ckpt_archive.ops.common.open_repo`).

    Returns:
        :class:`~ckpt_archive.repo.repository.Generation` objects (``number``, ``status``, ``reason``,
        ``manifest``, ``metrics`` as plain JSON values, ...).

    Raises:
        NotFound: not a repository. StoreError: the store refused access. TypeError: an unknown keyword
            argument or store option.

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"w": torch.ones(2)}, repo)
        >>> [(g.number, g.status) for g in ckpt_archive.list_generations(repo)]
        [(1, 'usable')]
    """
    r = open_repo(repo, store_options)
    gens = r.generations()
    return gens if all else [g for g in gens if g.usable]


def generation_row(g: Generation) -> dict:
    """One generation as ``list`` shows it (and ``--json`` prints it): :meth:`Generation.to_json` plus what it
    stores itself and what it references (docs/FORMAT.md, "Shared objects").

    Args:
        g: a generation (any status; without a readable manifest the byte counts are None).

    Returns:
        ``to_json()``'s fields, plus ``new_stored_bytes`` (stored bytes this generation wrote: its own files
        and the shared objects it created; ``summary.new_stored_bytes`` when recorded, else its
        ``stored_bytes``, as a generation without sharing wrote all of it), ``total_stored_bytes`` (its
        whole stored stream, shared objects included: ``stored_bytes``) and ``shared_objects`` (how many
        shared objects it references).
    """
    from ckpt_archive.format.objects import refs

    row = g.to_json()
    summary = (g.manifest or {}).get("summary") or {}
    total = summary.get("stored_bytes")
    new = summary.get("new_stored_bytes", total)
    row.update(new_stored_bytes=new, total_stored_bytes=total,
               shared_objects=len(refs(g.manifest)) if g.manifest else None)
    return row


__all__ = ["list_generations", "generation_row"]
