"""What every operation needs: open the repository it is given, pick a generation, fall back.

Each public operation accepts a repository path/URL or an open
:class:`~ckpt_archive.repo.repository.Repository`; errors are :mod:`ckpt_archive.errors` classes, each
carrying its CLI exit code.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar, Union

from ckpt_archive.errors import IntegrityError, NoUsableGeneration
from ckpt_archive.repo.repository import Generation, Repository

#: A repository argument: a local path, a URL (``s3://bucket/prefix``) or an open Repository.
RepoLike = Union[str, os.PathLike, Repository]
T = TypeVar("T")


def open_repo(repo: RepoLike, *, create: bool = False, **store_options) -> Repository:
    """The open repository for a path, URL or Repository (returned as is).

    Args:
        repo: a path, URL or open Repository.
        create: create ``repository.json`` when absent.
        **store_options: for URL stores (``endpoint_url=``, ``storage_options=``).

    Raises:
        NotFound: not a repository (and ``create`` is false). StoreError: the store refused access.
    """
    if isinstance(repo, Repository):
        return repo
    return Repository.open(repo, create=create, **store_options)


def pick(r: Repository, generation: str | int, fallback: bool = False) -> Generation:
    """Resolve ``generation`` and require a readable manifest.

    Args:
        r: the repository. generation: ``"latest"``, a number, or ``"tag:NAME"``.
        fallback: unused here (kept for callers that pass it; see :func:`with_fallback`).

    Raises:
        NotFound / NoUsableGeneration / the generation's own read error (ManifestInvalid,
        NewerFormatError): nothing to read.
    """
    gen = r.resolve(generation)
    if gen.manifest is None:
        if gen.error is not None:
            raise gen.error
        raise NoUsableGeneration(f"generation {gen.number} is {gen.status}: {gen.reason}", where=r.location)
    return gen


def check_present(r: Repository, gen: Generation) -> None:
    """Every member present with its recorded size (a stat each, no read): a generation missing any
    member is damaged, even when the part asked for does not need that member.

    Raises:
        IntegrityError: a member is missing or has another size (names it).
    """
    for rec in gen.manifest["members"]:
        key = f"{gen.key}/{rec['stored_path']}"
        if not r.store.exists(key):
            raise IntegrityError(f"missing: {rec['stored_path']} is not in generation {gen.number}", where=rec["path"])
        size = r.store.size(key)
        if size != rec["stored_bytes"]:
            raise IntegrityError(f"{size} bytes stored, manifest says {rec['stored_bytes']}", where=rec["path"])


def with_fallback(r: Repository, generation: str | int, fallback: bool,
                  fn: Callable[[Generation], T]) -> tuple[Generation, T]:
    """Run ``fn`` on the picked generation; when ``latest`` fails its checks, name (or with ``fallback``
    use) the newest older generation that verifies.

    Returns:
        ``(generation used, fn's result)``.

    Raises:
        IntegrityError: the generation fails (and, for ``latest``, says which older one verifies).
    """
    from ckpt_archive.ops.verify import find_fallback

    gen = pick(r, generation, fallback)

    def checked(g: Generation):
        check_present(r, g)
        return fn(g)

    try:
        return gen, checked(gen)
    except IntegrityError as exc:
        if str(generation) != "latest":
            raise
        fb = find_fallback(r, gen.number, deep=False)
        if fallback and fb is not None:
            return r.generation(fb), checked(r.generation(fb))
        hint = (f"the newest generation that verifies is {fb}: use --fallback or @{fb}" if fb is not None
                else "no older usable generation verifies either")
        raise IntegrityError(f"generation {gen.number} (latest) does not verify: {exc.message}; {hint}",
                             where=exc.where) from None


__all__ = ["RepoLike", "open_repo", "pick", "check_present", "with_fallback"]
