"""``load``: rebuild an archived state in memory, every chunk and tensor checked on the way; and the
``latest``-falls-back rule that ``load`` and ``restore`` share."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

from ckpt_archive.errors import IntegrityError, Unreadable
from ckpt_archive.ops.common import RepoLike, check_present, open_repo, refuse_unusable, require_readable
from ckpt_archive.ops.verify import find_fallback
from ckpt_archive.repo.reader import ArchiveReader
from ckpt_archive.repo.repository import Generation, Repository

T = TypeVar("T")


def with_fallback(r: Repository, generation: str | int, fallback: bool,
                  fn: Callable[[Generation], T], *, unverified: bool = False, action: str = "load",
                  override: str = "unverified=True", notes: list | None = None) -> tuple[Generation, T]:
    """Run ``fn`` on the picked generation; when ``latest`` fails its checks, name (or with ``fallback``
    use) the newest older generation that verifies.

    A ``partial`` or ``damaged`` generation is refused (:func:`~ckpt_archive.ops.common.refuse_unusable`)
    unless ``unverified``; then the loud note is appended to ``notes``.

    Returns:
        ``(generation used, fn's result)``.

    Raises:
        IntegrityError: the generation fails (and, for ``latest``, says which older one verifies).
        NotUsable: partial or damaged without ``unverified`` (exit 2).
    """
    gen = r.resolve(generation, copied=True)  # parses (and validates) the manifests once
    note = refuse_unusable(r, gen, unverified=unverified, action=action, override=override)
    if note is not None and notes is not None:
        notes.append(note)
    gen = require_readable(r, gen)

    def checked(g: Generation):
        check_present(r, g)
        try:
            return fn(g)
        except (KeyError, TypeError, IndexError) as exc:
            # [issue 17] a schema-valid but hand-made manifest lacking what the reader needs: refuse it
            # in one line rather than an "internal error"
            raise IntegrityError(f"generation {g.number}: the manifest is malformed where it is read "
                                 f"({type(exc).__name__}: {exc})", where="manifest.json") from None

    try:
        return gen, checked(gen)
    except (IntegrityError, Unreadable) as exc:  # found wrong, or a file of it cannot be read here
        if str(generation) != "latest":
            raise
        fb = find_fallback(r, gen.number, deep=False)
        if fallback and fb is not None:
            return r.generation(fb), checked(r.generation(fb))
        hint = (f"the newest generation that verifies is {fb}: use --fallback or @{fb}" if fb is not None
                else "no older usable generation verifies either")
        raise type(exc)(f"generation {gen.number} (latest) does not verify: {exc.message}; {hint}",
                        where=exc.where) from None


def load(repo: RepoLike, generation: str | int = "latest", *, only: str | None = None, fallback: bool = False,
         map_location=None, jobs: int | None = None, allow=(), unverified: bool = False, **store_options) -> Any:
    """Rebuild the archived state in memory, checking every chunk and tensor on the way.

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        only: a ``/``-separated path into the state (``"model"``) to load just that part.
        fallback: when ``latest`` fails its checks, use the newest older generation that verifies.
        map_location: move torch tensors there (default: CPU).
        jobs: decoder threads (default: cores).
        allow: plain-data classes to rebuild (``"module.Class"`` names or classes); ``argparse.Namespace``
            needs none (see :mod:`ckpt_archive.format.allowlist`).
        unverified: load a ``partial`` or ``damaged`` generation anyway (refused otherwise, exit 2);
            every byte is still checked against its manifest, and a ``UserWarning`` says so loudly.
        **store_options: for URL repositories (``endpoint_url=``, ``storage_options=``).

    Returns:
        the nested state, equal to what was packed in structure, types, dtypes, shapes and bits.

    Raises:
        IntegrityError (exit 1) -- never returns wrong data; NotFound / NoUsableGeneration (exit 2);
        NotUsable (exit 2): a partial or damaged generation without ``unverified``.

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"model": {"w": torch.arange(3.0)}, "step": 7}, repo)
        >>> state = ckpt_archive.load(repo)
        >>> state["step"], state["model"]["w"].tolist()
        (7, [0.0, 1.0, 2.0])
    """
    from ckpt_archive.format.allowlist import allowing

    if only is not None:
        from ckpt_archive.repo.reader import check_only

        check_only(only)  # "" or "model//w" would select the whole state, or another place than written
    r = open_repo(repo, **store_options)
    notes: list[str] = []
    with allowing(allow):
        _, state = with_fallback(r, generation, fallback,
                                 lambda g: ArchiveReader(r.store, g.key, g.manifest, jobs=jobs).load(
                                     only, map_location=map_location),
                                 unverified=unverified, notes=notes)
    if notes:
        import warnings

        warnings.warn(notes[0], UserWarning, stacklevel=2)
    return state


__all__ = ["load", "with_fallback"]
