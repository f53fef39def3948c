"""What every operation needs: open the repository it is given, pick a generation, check it is whole.

Each public operation accepts a repository path/URL or an open
:class:`~ckpt_archive.repo.repository.Repository`; errors are :mod:`ckpt_archive.errors` classes, each
carrying its CLI exit code.
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, TypeVar, Union

from ckpt_archive.errors import (EXIT_CHECK_FAILED, CheckFailed, IntegrityError, NewerFormatError, NotUsable,
                                 NoUsableGeneration, UsageError)
from ckpt_archive.repo.repository import Generation, Repository

#: A repository argument: a local path, a URL (``s3://bucket/prefix``) or an open Repository.
RepoLike = Union[str, os.PathLike, Repository]


#: The keys a ``store_options`` mapping may hold (:class:`~ckpt_archive.store.fsspec_store.FsspecStore`).
STORE_OPTION_KEYS = ("endpoint_url", "storage_options")


def checked_store_options(store_options: Mapping[str, Any] | None) -> dict:
    """``store_options`` as a dict, every key one of :data:`STORE_OPTION_KEYS`.

    Raises:
        TypeError: a key that is not a store option (a misspelt one would otherwise be dropped, and the store
            reached without it).
    """
    options = dict(store_options or {})
    unknown = sorted(set(options) - set(STORE_OPTION_KEYS))
    if unknown:
        raise TypeError(f"unknown store option(s) {', '.join(map(repr, unknown))}; store_options takes "
                        f"{' and '.join(STORE_OPTION_KEYS)}")
    return options


_O = TypeVar("_O")


def take_options(options: Any, cls: type[_O], op: str, *, generation: Any = None) -> _O:
    """An operation's options object: ``options`` itself, or ``cls()`` (every option off) for None.

    Every operation with options takes them as one frozen object (``PackOptions``, ``LoadOptions``,
    ``VerifyOptions``, ``RestoreOptions``, ``BackupOptions``; docs/api.md); this refuses anything else rather
    than guess (a dict's misspelt key would otherwise be an option silently left off).

    Raises:
        TypeError: ``options`` is not a ``cls`` (a dict of option names included: ``cls(**d)`` builds one), or
            the options object was passed where the generation goes (``verify(repo, VerifyOptions(...))``).
    """
    if isinstance(generation, cls):
        raise TypeError(f"{op}() got a {cls.__name__} where the generation goes: pass it as "
                        f"options={cls.__name__}(...) (the generation, \"latest\" by default, comes first)")
    if options is None:
        return cls()
    if not isinstance(options, cls):
        hint = f" (a mapping of option names: {cls.__name__}(**options))" if isinstance(options, Mapping) else ""
        raise TypeError(f"{op}'s options must be a {cls.__name__}, not {type(options).__name__}{hint}")
    check_option_values(options)
    return options


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_option_values(options: Any) -> None:
    """Refuse an options object whose shared fields hold what no run can use, naming the field, before any work
    (``LoadOptions(jobs="2")`` was reported as a malformed manifest; ``jobs=-1`` as an internal error).

    Checked by field name, across every options class: a field whose default is a bool holds a bool; ``jobs``
    is None or an int >= 1 (threads); ``only`` is None or a str; ``wait``, ``settle`` and ``stale_after``
    (seconds) are finite numbers >= 0 (``stale_after`` may be None); ``map_location``: :func:`check_map_location`.

    Raises:
        TypeError: a field of the wrong type. UsageError (exit 2): a value out of range.
    """
    import dataclasses
    import math

    cls = type(options).__name__
    for f in dataclasses.fields(options):
        v = getattr(options, f.name)
        if isinstance(f.default, bool) and not isinstance(v, bool):
            raise TypeError(f"{cls}.{f.name} must be True or False, not {v!r}")
        if f.name == "jobs" and v is not None:
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{cls}.jobs must be an int (threads) or None, not {v!r}")
            if v < 1:
                raise UsageError(f"--jobs must be at least 1, not {v}")
        if f.name == "only" and v is not None and not isinstance(v, str):
            raise TypeError(f"{cls}.only must be a '/'-separated path into the state (str) or None, not {v!r}")
        if f.name in ("wait", "settle", "stale_after") and not (v is None and f.name == "stale_after"):
            if not _is_number(v):
                raise TypeError(f"{cls}.{f.name} must be a number of seconds, not {v!r}")
            if not math.isfinite(v) or v < 0:
                raise UsageError(f"--{f.name.replace('_', '-')} must be a finite number of seconds >= 0, not {v}")
        if f.name == "map_location":
            check_map_location(v)


def check_map_location(where: Any) -> None:
    """Refuse a ``map_location`` torch cannot move tensors to on this machine, before anything is read: a
    name torch does not know (``"bogus"``), or a device this machine lacks (``"cuda:0"`` without CUDA,
    ``"cuda:9"`` with two GPUs). None, ``"cpu"``, callables and mappings pass (torch.load's forms).

    Raises:
        UsageError (exit 2): naming the value and what this machine has.
    """
    if where is None or callable(where) or isinstance(where, Mapping) or str(where) == "cpu":
        return
    import torch

    try:
        dev = torch.device(where)
    except (RuntimeError, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"map_location {where!r} is not a device torch knows ({first}); use 'cpu', 'cuda', "
                         f"'cuda:N' or another device of this machine") from None
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if dev.type in ("cpu", "meta") or available is None:
        return
    if not available():
        raise UsageError(f"map_location {where!r}: this machine has no {dev.type} device (torch "
                         f"{torch.__version__}); use 'cpu', or restore on a machine that has one")
    count = getattr(backend, "device_count", None)
    n = count() if callable(count) else None
    if dev.index is not None and n is not None and dev.index >= n:
        raise UsageError(f"map_location {where!r}: this machine has {n} {dev.type} device(s), "
                         f"{dev.type}:0 to {dev.type}:{n - 1}")


def open_repo(repo: RepoLike, store_options: Mapping[str, Any] | None = None, *, create: bool = False) -> Repository:
    """The open repository for a path, URL or Repository (returned as is).

    Args:
        repo: a path, URL or open Repository.
        store_options: for URL stores, one mapping with the keys of :data:`STORE_OPTION_KEYS`
            (``{"endpoint_url": "http://minio:9000", "storage_options": {...fsspec options}}``); the same
            ``store_options=`` every public operation takes.
        create: create ``repository.json`` when absent.

    Raises:
        TypeError: ``store_options`` holds a key that is not a store option (a misspelt one would otherwise
            be dropped, and the store reached without it).
        UsageError: ``store_options`` given with an open Repository (its store is open already).
        NotFound: not a repository (and ``create`` is false). StoreError: the store refused access.
    """
    options = checked_store_options(store_options)
    if isinstance(repo, Repository):
        if options:
            raise UsageError("store_options apply to a repository path or URL; this Repository is open already "
                             "(pass them to Repository.open instead)")
        return repo
    return Repository.open(repo, create=create, **options)


def pick(r: Repository, generation: str | int, fallback: bool = False) -> Generation:
    """Resolve ``generation`` and require a readable manifest.

    ``latest`` and ``tag:`` pick among usable *and* ``copied`` generations: every reader of members
    (load, restore) decodes and checks every byte anyway, so reading a copied generation is its trial
    reload here (:func:`copied_note` says so).

    Args:
        r: the repository. generation: ``"latest"``, a number, or ``"tag:NAME"``.
        fallback: unused here (kept for callers that pass it; see :func:`with_fallback`).

    Raises:
        NotFound / NoUsableGeneration / the generation's own read error (ManifestInvalid,
        NewerFormatError): nothing to read. IntegrityError: its deep check here failed (recorded by
        ``adopt``; the message names the failure).
    """
    return require_readable(r, r.resolve(generation, copied=True))


def open_reader(r: Repository, gen: Generation, *, jobs: int | None = None):
    """The :class:`~ckpt_archive.repo.reader.ArchiveReader` of a picked generation (for callers above ops,
    which import no repo: the Checkpointer's restore). Every read through it is checked as ``load``'s.

    Args:
        r: the repository. gen: a generation from :func:`pick` (or ``r.generation(n)``). jobs: decoder threads.

    Returns:
        the reader (``tree()``, ``load_node(tree)``, ``load()``).

    Raises:
        nothing itself; its reads raise IntegrityError (exit 1) on a failed check.
    """
    from ckpt_archive.repo.reader import ArchiveReader

    return ArchiveReader(r.store, gen.key, gen.manifest, jobs=jobs)


def require_readable(r: Repository, gen: Generation, *, allow_noted: bool = False) -> Generation:
    """:func:`pick`'s checks on a generation already resolved (its manifest is parsed and validated once,
    not once per check: ~30 ms for a 1000-tensor manifest). ``allow_noted``: a generation with a recorded
    failed check is read anyway (an explicit override: every byte is checked again).

    Raises:
        as :func:`pick`, except NotFound.
    """
    if gen.check_failed is not None and not allow_noted:
        first = (gen.check_failed.get("problems") or [{}])[0]
        named = first.get("member") or first.get("field") if isinstance(first, dict) else None
        raise IntegrityError(f"generation {gen.number} is damaged: {gen.reason}; "
                             f"{r.existing_summary()}", where=named if isinstance(named, str) else r.location)
    if gen.manifest is None:
        if gen.error is not None:
            raise gen.error
        raise NoUsableGeneration(f"generation {gen.number} is {gen.status}: {gen.reason}", where=r.location)
    check_trust(r, gen)
    return gen


def check_trust(r: Repository, gen: Generation) -> None:
    """A bad signature always refuses the generation; with trusted keys (``--trust``), so does a missing
    signature or one by another key (docs/FORMAT.md, "Signatures").

    Raises:
        SignatureProblem: (exit 1) naming the generation and, where there is one, the signer's fingerprint.
    """
    from ckpt_archive.format.signature import SignatureProblem

    if isinstance(gen.error, SignatureProblem):
        raise SignatureProblem(f"generation {gen.number}: {gen.error.message}", where=gen.error.where)
    if r.trust is None:
        return
    if gen.signer is None and gen.manifest is None:
        return  # its manifest cannot be read: nothing of it can be handed out, and its damage says why
    if gen.signer is None and gen.status == "damaged":  # the signature was never checked: say why, not "unsigned"
        raise SignatureProblem(f"generation {gen.number} is damaged ({gen.reason}), so no signature vouches for "
                               f"it, and --trust requires one by {_names(r.trust)}", where=r.location)
    if gen.signer is None:
        raise SignatureProblem(f"generation {gen.number} is not signed, and --trust requires a signature by "
                               f"{_names(r.trust)}", where=r.location)
    if gen.signer not in r.trust:
        raise SignatureProblem(f"generation {gen.number} is signed by {gen.signer}, not by a trusted key "
                               f"({_names(r.trust)})", where=r.location)


def untrusted_reason(r: Repository, gen: Generation) -> str | None:
    """Why ``--trust`` refuses ``gen`` (a usable or copied one, unsigned or signed by another key), or None:
    the verdict ``list`` and ``status`` show beside the generation's own status (docs/keys.md)."""
    from ckpt_archive.format.signature import SignatureProblem

    if r.trust is None or gen.status not in ("usable", "copied"):
        return None
    try:
        check_trust(r, gen)
    except SignatureProblem as exc:
        return exc.message
    return None


def _names(trust: dict) -> str:
    return ", ".join(sorted(trust)) if len(trust) <= 3 else f"one of {len(trust)} trusted keys"


def copied_note(r: Repository, gen: Generation) -> str | None:
    """For a ``copied`` generation, the line that says what reading it here means; None otherwise."""
    if gen.status != "copied":
        return None
    there = (gen.marker or {}).get("location")
    return (f"generation {gen.number} was proven at {there}, not here: every byte was decoded and checked "
            f"while reading it (this read is its trial reload here); `ckpt-archive adopt {r.location}` "
            f"marks the copied generations usable here")


def check_present(r: Repository, gen: Generation) -> None:
    """Every member present with its recorded size (a stat each, no read): a generation missing any
    member is damaged, even when the part asked for does not need that member.

    Raises:
        IntegrityError: a member is missing, a symbolic link, or has another size (names it).
        Unreadable: a member is there but cannot be read (permissions).
    """
    from ckpt_archive.errors import UnsafePath, Unreadable
    from ckpt_archive.format.objects import stored_files

    for member in gen.manifest["members"]:
        for key, fp, rec in stored_files(member, gen.key):  # format 3: its shared objects too
            what = rec["stored_path"] if fp is None else f"shared object {key}"
            try:
                present = r.store.exists(key)
            except UnsafePath as exc:  # a symbolic link where the file must be: not this repository's bytes
                raise IntegrityError(f"{what} (used by generation {gen.number}): {exc.message}",
                                     where=member["path"] if fp is None else key) from None
            if present and r.store.local_path() is not None:  # a local file: can this process read it?
                try:
                    with r.store.open_read(key):
                        pass
                except PermissionError as exc:
                    raise Unreadable(f"{what} (used by generation {gen.number}) cannot be read here: "
                                     f"{exc.strerror}", where=member["path"] if fp is None else key) from None
            if not present:
                raise IntegrityError(f"missing: {what} is not in generation {gen.number}" if fp is None else
                                     f"missing: {what} (used by generation {gen.number}) is not in the repository",
                                     where=member["path"])
            size = r.store.size(key)
            if size != rec["stored_bytes"]:
                raise IntegrityError(f"{size} bytes stored, manifest says {rec['stored_bytes']}",
                                     where=member["path"] if fp is None else key)


def is_damage(exc: BaseException) -> bool:
    """Whether an error raised while reading a generation is evidence that the generation is damaged (so
    readers record a failed check, :func:`note_damage`): a member or object corrupt, missing, of the wrong
    kind, a manifest that breaks its rules, a size no reader accepts. Not: a buffer larger than *this*
    machine's memory (:class:`~ckpt_archive.errors.TooLargeHere`), a store that cannot be reached, a file
    this process may not read, a user's wrong ``--only``."""
    from ckpt_archive.errors import ImplausibleSize, LinkInRepository, ManifestInvalid, TooLargeHere, UnsafePath

    return (isinstance(exc, (IntegrityError, ManifestInvalid, ImplausibleSize, UnsafePath))
            and not isinstance(exc, (TooLargeHere, LinkInRepository)))


def fails_generation(exc: BaseException, r: Repository | None = None) -> bool:
    """Whether an error raised while reading one generation is that generation's problem, so ``--fallback``
    goes on to an older one (never stops): a member, object or record found wrong (corrupt, missing, a size
    no reader accepts, a manifest it cannot index), a member or object that is a folder, a FIFO, a device, a
    link, or cannot be read here (permissions; an ``OSError`` naming a file inside the repository ``r``).
    Not: a store that cannot be reached, a lock, a user's wrong arguments (``--only`` naming nothing), a state
    a transform or ``torch.save`` refuses, an output that cannot be written."""
    from ckpt_archive.errors import (FormatError, ImplausibleSize, LinkInRepository, ManifestInvalid, Unreadable,
                                     UnsafePath)

    if isinstance(exc, LinkInRepository):
        return False
    if isinstance(exc, (IntegrityError, ManifestInvalid, ImplausibleSize, UnsafePath, Unreadable, FormatError)):
        return True
    if isinstance(exc, OSError) and r is not None and getattr(exc, "filename", None):
        root = r.store.local_path("")
        if root is not None:
            try:
                inside = os.path.realpath(str(exc.filename)).startswith(os.path.realpath(root) + os.sep)
            except (TypeError, ValueError):
                return False
            return inside
    return False


def note_damage(r: Repository, gen: Generation, problems: list, *, by: str) -> str | None:
    """Record a failed check of ``gen`` found by a reader (:meth:`Repository.note_check_failed`), only for
    problems that are the generation's (not this machine's: ``Problem.local``). Returns a line to show when
    the note could not be written (a read-only repository), else None."""
    rows = [p for p in problems if not getattr(p, "local", False)]
    if not rows:
        return None
    return r.note_check_failed(gen, rows, by=by)


def vouch(r: Repository, gen: Generation, reader, *, by: str) -> None:
    """[issue 24: one status rule] What a reader of part of a generation checks of the rest before it hands
    out a result (docs/FORMAT.md, "One status rule"): every stored file it did not check while decoding --
    sizes and every chunk's stored sha256, as a shallow ``verify`` (:meth:`ArchiveReader.check_unread`) -- and
    the index the trial reload checks without bytes: the state tree against the tensor records, every record's
    dtype and shape against its entry, every exact-bytes record against its entries and skeleton
    (:func:`ckpt_archive.repo.trial_reload.index_problems`). A failure is recorded (:func:`note_damage`), so
    ``list`` and ``@latest`` say so afterwards.

    Raises:
        IntegrityError: (exit 1) naming the first problem and how many more.
    """
    from ckpt_archive.repo.reader import Problem
    from ckpt_archive.repo.trial_reload import index_problems

    problems: list[Problem] = []
    reader.check_unread(problems)
    try:
        tree = reader.tree()
    except CheckFailed as exc:
        problems.append(Problem.of(exc, member=gen.manifest["tree_member"]))
    else:
        problems.extend(index_problems(reader, tree))
    if problems:
        note_damage(r, gen, problems, by=by)
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        place = " ".join(x for x in (first.field, first.member) if x) or "-"
        raise IntegrityError(f"generation {gen.number} is damaged: {place}: {first.reason}{more}; nothing was "
                             f"handed out (`ckpt-archive verify {r.location}@{gen.number}` lists every problem)",
                             where=first.member or first.field)


def refuse_unusable(r: Repository, gen: Generation, *, unverified: bool, action: str, override: str) -> str | None:
    """Refuse to read a ``partial`` or ``damaged`` generation for ``restore``/``load`` unless ``unverified``.

    A ``partial`` generation was never published (no marker: interrupted, or being deleted); a
    ``damaged`` one's manifest changed after it was published, or cannot be read. ``verify`` exits 1 on
    both, so restoring them silently would hand out what no check vouched for. ``copied`` generations
    (intact, verified elsewhere) are not refused here.

    Args:
        r: the repository. gen: the generation picked.
        unverified: the caller's explicit override (``--restore-unverified``, ``unverified=True``).
        action: the verb for messages ("restore", "load"). override: the override's name for messages.

    Returns:
        None when the generation is not partial/damaged; else (with ``unverified``) one loud line saying
        what is being read, for the caller to show.

    Raises:
        NotUsable: (exit 2) partial, or damaged in a way this reader cannot judge (a newer format, said as
            such: upgrade ckpt-archive; the override cannot read it either), and no override: says why and what
            to run.
        IntegrityError: (exit 1) damaged -- its manifest or marker was read and found wrong, as ``verify``
            reports it -- and no override.
        IntegrityError: (exit 1) a check of it failed before and was recorded (``CHECK-FAILED.json``, by
            ``adopt`` or any reader) and no override: names the recorded failure (docs/FORMAT.md, "One status
            rule").
        SignatureProblem: (exit 1) a bad signature, or (with trusted keys) none or a foreign one: even
            with ``unverified``.
    """
    from ckpt_archive.format.signature import SignatureProblem

    if gen.status not in ("partial", "damaged") or isinstance(gen.error, SignatureProblem):
        check_trust(r, gen)  # a bad or untrusted signature is never overridden (exit 1, nothing read)
    if gen.status not in ("partial", "damaged"):
        return None
    spec = f"{r.location}@{gen.number}"
    if gen.check_failed is not None and not unverified:  # a check found it wrong: exit 1, as that check did
        require_readable(r, gen)
    if not unverified and isinstance(gen.error, NewerFormatError):  # [break] not "damaged": nothing is wrong
        raise NotUsable(f"refusing to {action} generation {gen.number}: it is {status_words(gen)}; nothing was "
                        f"found wrong with it, this ckpt-archive is older than the one that wrote it: upgrade "
                        f"ckpt-archive (`python -m pip install -U ckpt-archive`) to {action} it "
                        f"(`ckpt-archive list {r.location}` shows the usable ones)", where=r.location)
    if not unverified:  # partial or damaged says so first, --trust or not
        why = (f"refusing to {action} generation {gen.number}: it is {gen.status} ({gen.reason}). Run "
               f"`ckpt-archive verify {spec}` to see what is wrong (`ckpt-archive list {r.location}` shows the "
               f"usable ones); pass {override} to {action} it anyway (every byte is still checked against its "
               f"manifest)")
        if gen.status == "damaged" and getattr(gen.error, "exit_code", EXIT_CHECK_FAILED) == EXIT_CHECK_FAILED:
            # its manifest or marker was read and found wrong: exit 1, as `verify` of it says (a newer format
            # or a manifest this machine cannot read stays exit 2: nothing was found wrong)
            raise IntegrityError(why, where=r.location)
        raise NotUsable(why, where=r.location)
    check_trust(r, gen)  # the override never reads past --trust: unpublished or damaged means no signature vouches
    return (f"{action.upper()} OF AN UNVERIFIED GENERATION: generation {gen.number} is {gen.status} ({gen.reason}); "
            f"every byte was checked against its manifest, but no published marker vouches for that manifest")


def status_words(gen: Generation) -> str:
    """What a generation that is not usable is, for messages: ``partial (why)``, ``damaged (why)``, or, for a
    manifest in a newer format (listed as ``damaged``: nothing of it can be read here), ``in a newer format
    than this ckpt-archive reads (written by format N, ...; upgrade ckpt-archive to read it)``."""
    if isinstance(gen.error, NewerFormatError):
        return f"in a newer format than this ckpt-archive reads ({gen.error.message})"
    return f"{gen.status} ({gen.reason})"


def human_seconds(seconds: float) -> str:
    """``90`` -> ``"90 s"``, ``5400`` -> ``"90 min"``, ``86400`` -> ``"24.0 h"``, longer in days (for messages)."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


__all__ = ["check_map_location", "check_option_values", "RepoLike", "STORE_OPTION_KEYS", "take_options", "open_repo", "checked_store_options", "pick", "check_present",
           "copied_note", "refuse_unusable", "status_words",
           "human_seconds", "is_damage", "fails_generation", "note_damage", "vouch", "check_trust", "untrusted_reason"]


def leftover_note(line: str) -> str:
    """The warning for one non-usable generation ``pack`` found (``"generation N is <status>: <reason>"``):
    a partial one is a leftover of an interrupted write that ``gc`` removes; a damaged one is evidence
    ``gc`` leaves alone (``verify`` says what is wrong, ``forget`` removes it)."""
    if " is damaged:" in line:
        return f"{line} (`ckpt-archive verify` says what is wrong; `ckpt-archive forget` removes it)"
    return f"leftover of an interrupted write: {line} (ckpt-archive gc removes it)"


def refuse_special_output(path: str | os.PathLike, *, option: str = "--force") -> None:
    """Refuse an output path that exists and is not a regular file, a folder or a symbolic link: a FIFO, a
    character or block device, a socket. Replacing it with a file would destroy something that is not
    ours (as root, ``--output /dev/null --force`` would replace ``/dev/null``), so it is refused with or
    without ``option``. Whether a file may replace a folder (or the reverse) is the caller's rule.

    Raises:
        UsageError (exit 2): naming the path and its kind; nothing is changed.
    """
    import stat

    try:
        mode = os.lstat(path).st_mode
    except OSError:  # absent (or unreachable: the write itself reports that)
        return
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
        return
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a special file")
    raise UsageError(f"is {kind}, not a regular file or folder; refusing to replace it (even with {option}); "
                     f"nothing was written", where=str(path))


_GEN_SUFFIX = re.compile(r"^([0-9]+|latest|tag:[^/@]+)$", re.ASCII)


def split_repo_spec(spec: str) -> tuple[str, str]:
    """Split ``REPO[@GEN]`` at the last ``@`` only when what follows is digits, ``latest`` or ``tag:NAME``.

    Paths and URLs may contain ``@`` (``s3://user@host/...``, ``runs/a@b/repo``): those stay whole. A
    folder whose own name ends like a selector (``run@2``) is addressed with one more: ``run@2@latest``.

    Returns:
        (repo, gen) where gen is ``"latest"`` when none was given.

    Raises:
        UsageError: an empty spec; a bad generation after an existing path; ``run@2`` naming a folder
            ``run@2`` while no ``run`` exists (the message says to write ``run@2@latest``).

    Example:
        >>> split_repo_spec("runs/a@b/repo@12")
        ('runs/a@b/repo', '12')
        >>> split_repo_spec("s3://u@bucket/p")
        ('s3://u@bucket/p', 'latest')
    """
    if "@" in spec:
        from ckpt_archive.store.base import has_scheme

        head, _, tail = spec.rpartition("@")
        if head and _GEN_SUFFIX.match(tail):
            if not has_scheme(spec) and not os.path.exists(head) and os.path.isdir(spec):
                # a folder named like a selector (run@2): generation 2 of a `run` that is not there
                raise UsageError(f"{spec!r} reads as generation {tail} of {head!r}, which does not exist; a "
                                 f"repository folder named {spec!r} is addressed as {spec}@latest (or {spec}@N, "
                                 f"{spec}@tag:NAME)", where=spec)
            return head, tail
        if head and not has_scheme(spec) and not os.path.exists(spec) and os.path.exists(head):
            raise UsageError(f"bad generation {tail!r} in {spec!r}: use REPO@N, REPO@latest or REPO@tag:NAME")
    if not spec:
        raise UsageError("empty repository argument")
    return spec, "latest"
