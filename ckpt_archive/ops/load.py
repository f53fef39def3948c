"""``load``: rebuild an archived state in memory, every chunk and tensor checked on the way; and the
``latest``-falls-back rule that ``load`` and ``restore`` share."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence, TypeVar

from ckpt_archive.errors import CkptArchiveError, IntegrityError, Unreadable, first_line
from ckpt_archive.ops.common import (RepoLike, check_present, fails_generation, is_damage, note_damage, open_repo,
                                     refuse_unusable, require_readable, take_options, vouch)
from ckpt_archive.ops.verify import find_fallback
from ckpt_archive.repo.reader import ArchiveReader
from ckpt_archive.repo.repository import Generation, Repository

T = TypeVar("T")


def with_fallback(r: Repository, generation: str | int, fallback: bool,
                  fn: Callable[[Generation, ArchiveReader], T], *, unverified: bool = False, action: str = "load",
                  override: str = "LoadOptions(unverified=True)", notes: list | None = None,
                  warnings: list | None = None, jobs: int | None = None) -> tuple[Generation, T]:
    """Run ``fn`` on the picked generation and vouch for the rest of it; when ``latest`` fails its checks,
    name (or with ``fallback`` use) the newest older generation that verifies.

    ``fn(generation, reader)`` reads what it needs through ``reader``; then every stored file it did not check
    and the index are checked too (:func:`~ckpt_archive.ops.common.vouch`): a generation with one damaged
    member is damaged for every reader, whatever part it reads (docs/FORMAT.md, "One status rule"). What a
    reader finds damaged is recorded (``CHECK-FAILED.json``), so ``list`` and ``@latest`` say so afterwards.
    Any failure that is the generation's own (:func:`~ckpt_archive.ops.common.fails_generation`: damage, a
    member or object that is a folder, FIFO, device or link, one that cannot be read here) makes ``fallback``
    go on to an older generation; only a failure of the store, the arguments or the output stops it.

    A ``partial`` or ``damaged`` generation is refused (:func:`~ckpt_archive.ops.common.refuse_unusable`)
    unless ``unverified``; then the loud note is appended to ``notes``. ``warnings`` receives the other lines
    to show (``latest`` passing over newer damaged generations, a failed check that could not be recorded).

    Returns:
        ``(generation used, fn's result)``.

    Raises:
        IntegrityError (or the generation's own error): the generation fails (and, for ``latest``, says which
            older one verifies).
        NotUsable: partial (or a newer format) without ``unverified`` (exit 2); IntegrityError: damaged (its
            manifest or marker found wrong) without it (exit 1).
    """
    gen = r.resolve(generation, copied=True)  # parses (and validates) the manifests once
    recorded = None  # a failed check recorded earlier: for latest, the fallback rule below, as a new finding
    try:
        note = refuse_unusable(r, gen, unverified=unverified, action=action, override=override)
    except IntegrityError as exc:
        if not (gen.found_damaged_here and str(generation) == "latest"):
            raise
        recorded, note = exc, None
    if note is not None and notes is not None:
        notes.append(note)
    gen = require_readable(r, gen, allow_noted=unverified or recorded is not None)
    if str(generation) == "latest" and warnings is not None:
        warnings.extend(passed_over(r, gen))

    def checked(g: Generation):
        check_present(r, g)
        reader = ArchiveReader(r.store, g.key, g.manifest, jobs=jobs)
        try:
            result = fn(g, reader)
        except (KeyError, TypeError, IndexError) as exc:
            # [issue 17] a schema-valid but hand-made manifest lacking what the reader needs: refuse it
            # in one line rather than an "internal error"
            raise IntegrityError(f"generation {g.number}: the manifest is malformed where it is read "
                                 f"({type(exc).__name__}: {exc})", where="manifest.json") from None
        vouch(r, g, reader, by=action)  # [issue 24] the rest of the generation, before anything is handed out
        return result

    try:
        if recorded is not None:
            raise recorded
        return gen, checked(gen)
    except Exception as exc:  # noqa: BLE001 - sorted by fails_generation; anything else goes on unchanged
        if not fails_generation(exc, r):
            raise
        from ckpt_archive.repo.reader import Problem

        unrecorded = note_damage(r, gen, [Problem.of(exc)], by=action) if is_damage(exc) else None
        if str(generation) != "latest":
            _add_hint(exc, unrecorded)
            raise
        fb = find_fallback(r, gen.number, deep=False)
        if fallback and fb is not None:
            if warnings is not None:
                warnings.append(f"generation {gen.number} (latest) does not verify ({_one_line(exc)}); "
                                f"generation {fb}, the newest that verifies, was used instead (--fallback)")
                if unrecorded:
                    warnings.append(unrecorded)
            return r.generation(fb), checked(r.generation(fb))
        hint = (f"the newest generation that verifies is {fb}: use --fallback or @{fb}" if fb is not None
                else "no older usable generation verifies either")
        text = f"generation {gen.number} (latest) does not verify: {_one_line(exc)}; {hint}"
        err = (type(exc)(text, where=exc.where) if isinstance(exc, CkptArchiveError)
               else Unreadable(text, where=getattr(exc, "filename", None)))
        _add_hint(err, unrecorded)
        raise err from None


def passed_over(r: Repository, gen: Generation) -> list[str]:
    """Lines naming the generations newer than ``gen`` (picked as ``latest``) that are ``damaged``: ``latest``
    never picks one, and a reader must not pass over them silently (a failed check recorded by an earlier
    reader moves ``latest`` back)."""
    out = []
    for n in r.numbers():
        if n <= gen.number:
            continue
        try:
            g = r.generation(n)
        except CkptArchiveError:
            continue
        if g.status == "damaged" and not g.found_damaged_here:
            out.append(f"generation {n} is newer but damaged ({g.reason}); generation {gen.number} is the newest "
                       f"readable one and was used")
    return out


def _one_line(exc: BaseException) -> str:
    return exc.message if isinstance(exc, CkptArchiveError) else first_line(exc, 300)


def _add_hint(exc: BaseException, line: str | None) -> None:
    if line and isinstance(exc, CkptArchiveError):
        exc.hint = f"{exc.hint}; {line}" if exc.hint else line


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How :func:`load` rebuilds a generation in memory (the names :class:`~ckpt_archive.ops.restore.RestoreOptions`
    gives the same options).

    Attributes:
        only: a ``/``-separated path into the state (``"model"``) to load just that part.
        fallback: when ``latest`` fails its checks, use the newest older generation that verifies (a
            ``UserWarning`` names both).
        unverified: load a ``partial`` or ``damaged`` generation anyway (refused otherwise, exit 2); every byte
            is still checked against its manifest, and a ``UserWarning`` says loudly what was loaded.
        map_location: move torch tensors there (default: CPU).
        jobs: decoder threads (default: cores).
        allow: plain-data classes to rebuild (``"module.Class"`` names or classes); ``argparse.Namespace``
            needs none (see :mod:`ckpt_archive.format.allowlist`).

    Example:
        >>> LoadOptions(only="model", map_location="cpu").only
        'model'
    """

    only: str | None = None
    fallback: bool = False
    unverified: bool = False
    map_location: Any = None
    jobs: int | None = None
    allow: Sequence[Any] = ()


def load(repo: RepoLike, generation: str | int = "latest", options: LoadOptions | None = None, *,
         store_options: Mapping[str, Any] | None = None, **legacy: Any) -> Any:
    """Rebuild the archived state in memory, checking every chunk and tensor on the way.

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        options: :class:`LoadOptions` (default: the whole state, on the CPU, no fallback, usable generations
            only).
        store_options: for URL repositories, one mapping (``{"endpoint_url": ..., "storage_options": {...}}``;
            :func:`~ckpt_archive.ops.common.open_repo`).
        legacy: only ``allow=[...]``, with no ``options``: the loading snippet that archives written before the
            options objects store in their manifest (``ckpt_archive.load('REPO', generation='latest',
            allow=[...])``) still runs, with a DeprecationWarning naming today's form (:func:`legacy_options`).

    Returns:
        the nested state, equal to what was packed in structure, types, dtypes, shapes and bits (with
        ``options.only``: the part under that path).

    Whatever part is loaded, the rest of the generation is checked before the state is returned (stored
    bytes of every member and object not decoded, the tensor index: docs/FORMAT.md, "One status rule"); a
    failure is recorded (``CHECK-FAILED.json``), so later readers and ``list`` see the generation damaged.

    Raises:
        IntegrityError (exit 1) -- never returns wrong data; also for a generation whose failed check a
            reader recorded. ImplausibleSize (exit 1): a size no reader accepts. NotFound /
            NoUsableGeneration (exit 2); NotUsable (exit 2): a partial generation (or a newer format)
            without ``unverified``; a damaged one is IntegrityError. UsageError (exit 2): an ``only`` path that selects no single place.
        TypeError: an unknown keyword argument or store option; ``options`` that is not a :class:`LoadOptions`
            (every option of the load itself is one of its fields: ``load(repo, only=...)`` is refused).

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"model": {"w": torch.arange(3.0)}, "step": 7}, repo)
        >>> state = ckpt_archive.load(repo)
        >>> state["step"], state["model"]["w"].tolist()
        (7, [0.0, 1.0, 2.0])
        >>> ckpt_archive.load(repo, "latest", LoadOptions(only="model/w")).tolist()
        [0.0, 1.0, 2.0]
    """
    from ckpt_archive.format.allowlist import allowing

    if legacy:
        options = legacy_options(options, legacy)
    opts = take_options(options, LoadOptions, "load", generation=generation)
    if opts.only is not None:
        from ckpt_archive.format.tree_paths import check_only

        check_only(opts.only)  # "" or "model//w" would select the whole state, or another place than written
    r = open_repo(repo, store_options)
    notes: list[str] = []
    lines: list[str] = []
    with allowing(opts.allow):
        _, state = with_fallback(r, generation, opts.fallback,
                                 lambda g, reader: reader.load(opts.only, map_location=opts.map_location),
                                 unverified=opts.unverified, notes=notes, warnings=lines, jobs=opts.jobs)
    import warnings

    for line in notes + lines:
        warnings.warn(line, UserWarning, stacklevel=2)
    return state


def legacy_options(options: LoadOptions | None, legacy: Mapping[str, Any]) -> LoadOptions:
    """The :class:`LoadOptions` of a call in the form archives' stored loading snippets used before the options
    objects (``load(repo, generation='latest', allow=[...])``; ops/meta.py writes today's form).

    Raises:
        TypeError: any other keyword (every option of the load is a field of :class:`LoadOptions`, and the message
            says so), or ``allow=`` together with ``options``.
    """
    extra = sorted(set(legacy) - {"allow"})
    if extra:
        k = extra[0]
        field = k in {f.name for f in dataclasses.fields(LoadOptions)}
        raise TypeError(f"load() got an unexpected keyword argument {k!r}"
                        + (f": it is an option of the load, pass options=LoadOptions({k}=...)" if field else ""))
    if options is not None:
        raise TypeError("load() got allow= beside options: pass options=LoadOptions(..., allow=[...])")
    allow = legacy["allow"]
    import warnings

    warnings.warn("load(..., allow=[...]) is the form of loading snippets stored by older archives; "
                  "write load(..., options=ckpt_archive.LoadOptions(allow=[...]))", DeprecationWarning, stacklevel=3)
    return LoadOptions(allow=tuple(allow) if isinstance(allow, (list, tuple)) else allow)


__all__ = ["load", "LoadOptions", "with_fallback", "passed_over", "legacy_options"]
