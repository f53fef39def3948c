"""``verify``: check a generation, shallow (stored bytes) or deep (trial reload); mark a copied one usable.

Reading needs no lock. Marking a ``copied`` generation usable is a publish, so it goes through
:func:`ckpt_archive.repo.publish.adopt` (under the lock, marker last). On a read-only repository the lock
cannot be taken: the deep check still runs, and the report says the generation could not be marked.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ckpt_archive.errors import CannotCheck, CkptArchiveError, IntegrityError, NotUsable, ReadOnlyRepository
from ckpt_archive.ops.common import RepoLike, open_repo, take_options
from ckpt_archive.repo.reader import ArchiveReader, Problem
from ckpt_archive.repo.repository import CHECK_FAILED, MANIFEST, Generation, Repository
from ckpt_archive.repo.trial_reload import trial_reload


@dataclasses.dataclass
class VerifyReport:
    """Result of :func:`verify`.

    Attributes:
        ok: True when nothing is wrong.
        generation: the generation checked.
        status: its status before the check (``usable``, ``copied``, ...).
        deep: whether members were decoded and every tensor rebuilt (trial reload).
        problems: what is wrong, each naming the member and/or field.
        warnings: notes that do not fail the check (completeness lint, policy audit, ...).
        fallback: when ``@latest`` fails: the newest older generation that verifies, else None.
        marked_usable: a ``copied`` generation that passed ``--deep`` and was marked usable here.
        policy: the LR audit and completeness lint of the generation and their verdict
            (:class:`~ckpt_archive.ops.policy_check.PolicyVerdict`; its problems and warnings are in
            ``problems``/``warnings`` too), or None when not asked for (``policy=False``).
    """

    ok: bool
    generation: int
    status: str
    deep: bool
    problems: list[Problem]
    warnings: list[str] = dataclasses.field(default_factory=list)
    fallback: int | None = None
    marked_usable: bool = False
    stats: dict | None = None
    extra: dict = dataclasses.field(default_factory=dict)
    policy: Any = None

    def to_json(self) -> dict:
        policy = {} if self.policy is None else {"policy": self.policy.to_json()}
        return {"ok": self.ok, "generation": self.generation, "status": self.status, "deep": self.deep,
                "problems": [p.to_json() for p in self.problems], "warnings": self.warnings,
                "fallback_generation": self.fallback, "marked_usable": self.marked_usable, "stats": self.stats,
                **self.extra, **policy}


def check_generation(r: Repository, gen: Generation, deep: bool, jobs: int | None = None,
                     on_bytes=None) -> tuple[list[Problem], dict | None]:
    """Check one generation: shallow (stored sizes and sha256) or deep (the trial reload), plus the
    source layout (DCP shards).

    Returns:
        ``(problems, trial-reload counts or None)``.

    Raises:
        the generation's own read error when it could not be checked at all (exit 2).
    """
    problems: list[Problem] = []
    if gen.manifest is None:
        if gen.error is not None and not isinstance(gen.error, IntegrityError) and gen.error.exit_code == 2:
            raise gen.error
        problems.append(Problem(f"not usable: {gen.reason}", member=MANIFEST))
        return problems, None
    noted = gen.check_failed is not None  # a failed check recorded here: this check speaks first (below)
    if gen.status == "damaged" and not noted:
        problems.append(Problem(gen.reason or "damaged", member="USABLE.json"))
    elif gen.status == "partial":
        problems.append(Problem(f"not usable: {gen.reason}", member="USABLE.json"))
    if r.trust is not None and gen.status != "damaged":  # a bad signature is already the damage named above
        from ckpt_archive.format.signature import SignatureProblem
        from ckpt_archive.ops.common import check_trust

        try:
            check_trust(r, gen)
        except SignatureProblem as exc:
            # the reader's trust, not the generation's damage: reported (exit 1), never recorded as a failed
            # check (a CHECK-FAILED note would make a good generation damaged for every other reader)
            problems.append(Problem(exc.message, member="USABLE.json", local=True))
    from ckpt_archive.repo.publish import phase

    reader = ArchiveReader(r.store, gen.key, gen.manifest, jobs=jobs)
    stats = None
    summary = gen.manifest.get("summary") or {}
    if deep:
        phase(on_bytes, f"trial reload of generation {gen.number}", summary.get("raw_bytes"))
        stats = trial_reload(reader, problems, on_bytes=on_bytes)
    else:
        phase(on_bytes, f"re-read of generation {gen.number}", summary.get("stored_bytes"))
        reader.check_stored(problems, on_bytes=on_bytes)
    name_shared_object_users(r, gen, reader, problems, deep)
    problems.extend(source_layout_problems(gen.manifest))
    if noted and not deep and not problems:  # a shallow pass cannot clear what a check recorded: a deep one can
        problems.append(Problem(f"{gen.reason}", member=CHECK_FAILED))
    return problems, stats


def _object_fp(p: Problem) -> str | None:
    """The name (oid) of the shared object a problem names (``member`` = ``objects/<hh>/<oid>.ckz``), or None."""
    from ckpt_archive.format.objects import OBJECT_DIR, oid_of_name

    parts = (p.member or "").split("/")
    if len(parts) != 3 or parts[0] != OBJECT_DIR:
        return None
    return oid_of_name(parts[1], parts[2])


def name_shared_object_users(r: Repository, gen: Generation, reader: ArchiveReader, problems: list[Problem],
                             deep: bool) -> None:
    """Report a damaged or missing shared object on the object, naming every generation it breaks.

    A shallow check already names the object (``member`` = its key). The trial reload names the member
    that decodes through it; then, and only on a failure, the generation's stored files are re-read to
    find which object is at fault, and its problem is added. Each object problem's reason then lists
    every generation whose manifest references the object (:func:`ckpt_archive.repo.objects.users_of`).

    Args:
        r: the repository. gen: the generation checked. reader: its reader. problems: updated in place.
        deep: the problems come from the trial reload.
    """
    from ckpt_archive.format.objects import refs

    if not problems or not refs(gen.manifest):
        return
    if deep and not any(_object_fp(p) for p in problems):
        located: list[Problem] = []
        reader.check_stored(located)  # which file is at fault: read only when something failed
        problems.extend(p for p in located if _object_fp(p))
    if not any(_object_fp(p) for p in problems):
        return
    from ckpt_archive.repo.objects import users_of

    users = users_of(r)
    for p in problems:
        fp = _object_fp(p)
        if fp is None:
            continue
        gens = sorted(set(users.get(fp, [])) | {gen.number})
        p.reason += (f" (shared object {fp}: it breaks generation(s) {', '.join(map(str, gens))}, every one that "
                     f"references it)")


def shared_object_report(r: Repository, number: int, problems: list[Problem]) -> list[dict]:
    """``[{"key", "fp", "generations", "reason"}]`` for each problem on a shared object (for ``--json``):
    ``generations`` are every generation whose manifest references it (``number`` included)."""
    if not any(_object_fp(p) for p in problems):
        return []
    from ckpt_archive.repo.objects import users_of

    users = users_of(r)
    return [{"key": p.member, "fp": _object_fp(p), "generations": sorted(set(users.get(_object_fp(p), [])) | {number}),
             "reason": p.reason} for p in problems if _object_fp(p)]


def source_layout_problems(manifest: dict) -> list[Problem]:
    """DCP folders in a folder source: every shard the ``.metadata`` references is among the archived
    files and long enough for the byte ranges it reads (``sources/dcp.py: check_dcp_folder``)."""
    src = manifest.get("source") or {}
    info = src.get("info") or {}
    if not info.get("dcp"):
        return []
    from ckpt_archive.sources.dcp import check_dcp_folder

    present = {f["relpath"]: f["raw_bytes"] for f in src.get("files", []) if f.get("raw_bytes") is not None}
    return [Problem(line, member=line.split(":", 1)[0], field="source.info.dcp")
            for line in check_dcp_folder(present, info)]


def find_fallback(r: Repository, newer_than_bad: int, deep: bool, jobs=None) -> int | None:
    """The newest usable generation older than ``newer_than_bad`` that passes :func:`check_generation`.

    Whatever fails while one generation is checked -- a member or object that is a folder, a FIFO, a device,
    a link, truncated, unreadable here (:func:`~ckpt_archive.ops.common.fails_generation`), or anything else
    that keeps it from being checked -- passes that generation over: it is not one that verifies. Never the
    end of the search.
    """
    from ckpt_archive.ops.common import fails_generation

    for g in reversed(r.usable()):
        if g.number >= newer_than_bad:
            continue
        try:
            problems, _ = check_generation(r, g, deep, jobs)
        except Exception as exc:  # noqa: BLE001 - sorted by fails_generation
            if fails_generation(exc, r) or isinstance(exc, (CannotCheck, OSError)):
                continue  # (an older generation that cannot be checked here is not one that verifies)
            raise
        if not problems:
            return g.number
    return None


def record_failure(r: Repository, gen: Generation, problems: list[Problem], *, by: str) -> list[str]:
    """[issue 24: one status rule] Record a failed check found by ``verify`` (without the lock: the note is
    only ever created, :meth:`Repository.note_check_failed`) on the generation checked and, for a damaged
    shared object, on every other generation that references it (it breaks them all). Returns the lines
    to show for notes that could not be written (a read-only repository)."""
    from ckpt_archive.ops.common import note_damage

    out = []
    line = note_damage(r, gen, problems, by=by)
    if line:
        out.append(line)
    users: dict[str, list[int]] | None = None
    for p in problems:
        fp = _object_fp(p)
        if fp is None or p.local:
            continue
        if users is None:
            from ckpt_archive.repo.objects import users_of

            users = users_of(r)
        for n in users.get(fp, []):
            if n == gen.number:
                continue
            try:
                other = r.generation(n)
            except CkptArchiveError:
                continue
            line = note_damage(r, other, [Problem(f"{p.reason} (found while checking generation {gen.number})",
                                                  member=p.member, field=p.field)], by=by)
            if line and line not in out:
                out.append(line)
    return out


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """What :func:`verify` checks (``ckpt-archive verify``'s options, one name each).

    Attributes:
        deep: decode everything (the trial reload: every chunk decoded, raw sha256 of every member and tensor,
            dtype and shape, the tree rebuilt) rather than hash the stored bytes (``--deep``). A ``copied``
            generation that passes is marked usable here.
        strict: completeness warnings (what a resume from it loses: no optimizer state, no RNG, ...) fail the
            check (``--strict``).
        fallback: when ``latest`` fails, check and report the newest older generation that verifies instead
            (``--fallback``).
        jobs: decoder threads (default: cores; ``--jobs``).
        policy: audit the LR policy and completeness (default, as the CLI does); False checks the stored
            bytes only (``ok`` then says nothing about whether the state can be resumed).
        record: record a failed check of a ``usable`` or ``copied`` generation (``CHECK-FAILED.json``, created
            without the lock, never replacing anything: :func:`record_failure`), so that ``list``, ``@latest``,
            restore and load treat it as damaged from then on (docs/FORMAT.md, "One status rule"). A shared
            object's damage is recorded on every generation that references it. ``prune`` and retention pass
            False (their own refusal reports it).

    Example:
        >>> VerifyOptions(deep=True, strict=True).deep
        True
    """

    deep: bool = False
    strict: bool = False
    fallback: bool = False
    jobs: int | None = None
    policy: bool = True
    record: bool = True


def verify(repo: RepoLike, generation: str | int = "latest", options: VerifyOptions | None = None, *,
           wait: float = 0.0, on_bytes=None, store_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check a generation.

    Shallow: manifest (schema, version), marker, every stored member's size and sha256. Deep
    (``VerifyOptions(deep=True)``): the trial reload as well -- every chunk decoded, raw sha256 of every member
    and tensor, dtype and shape, the tree rebuilt and every tensor reference resolved. A ``copied``
    generation that passes a deep check is marked usable at this location: that check and the marker
    run under the repository lock, through the publish lifecycle (:func:`ckpt_archive.repo.publish.adopt`).

    When ``generation`` is ``"latest"`` and it fails, the report names the newest older generation
    that verifies (``report.fallback``); with ``fallback=True`` that one is checked and reported instead.

    A generation that passes its byte checks is then audited (``policy=True``, as ``ckpt-archive verify``
    does; :mod:`ckpt_archive.ops.policy_check`, docs/policy.md): its state tree and small tensors are read,
    audit findings of severity ``error`` (the state cannot be resumed as saved) and a state tree that cannot
    be read are problems; audit and completeness warnings are warnings, and with ``strict=True`` the
    completeness warnings are problems too. The verdict is the CLI's:
    ``verify(repo, options=VerifyOptions(strict=True)).ok`` is False exactly where ``ckpt-archive verify
    --strict`` exits 1.

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        options: :class:`VerifyOptions` (default: shallow, not strict, no fallback, policy audit on, a failed
            check recorded).
        wait: seconds to wait for the writer lock when a ``copied`` generation is to be marked usable (0: fail
            at once with LockError).
        on_bytes: progress callback, called with bytes re-read (shallow) or decoded (deep); one with a
            ``phase(name, total)`` method is told each phase, with the stored or raw size as total.
        store_options: for URL repositories, one mapping (``{"endpoint_url": ..., "storage_options": {...}}``;
            :func:`~ckpt_archive.ops.common.open_repo`).

    Returns:
        :class:`VerifyReport` (``ok`` False: exit 1).

    Raises:
        NotFound / NoUsableGeneration / NewerFormatError: could not check (exit 2). NotUsable: the generation
            named is ``partial`` (never published: nothing to check as a generation; exit 2, as ``restore``,
            ``load`` and ``export`` of it). AllGenerationsDamaged: ``latest`` when every published generation is
            damaged (exit 1).
        LockError: marking a copied generation usable, another writer held the lock longer than ``wait``
            (exit 2). A read-only repository is no error: the generation is checked, ``marked_usable`` stays
            False and a warning (and ``extra["not_marked"]``) says it could not be marked here.
        TypeError: an unknown keyword argument or store option; ``options`` that is not a
            :class:`VerifyOptions` (every option of the check is one of its fields: ``verify(repo, deep=True)``
            is refused).

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"w": torch.ones(2)}, repo)
        >>> report = ckpt_archive.verify(repo, options=VerifyOptions(deep=True))
        >>> report.ok, report.generation, report.problems
        (True, 1, [])
    """
    opts = take_options(options, VerifyOptions, "verify", generation=generation)
    deep, jobs, fallback = opts.deep, opts.jobs, opts.fallback
    r = open_repo(repo, store_options)
    gen = r.resolve(generation)
    _refuse_partial(r, gen)
    marked = False
    not_marked = None
    if deep and (gen.status == "copied" or gen.check_failed is not None):
        from ckpt_archive.repo.publish import adopt

        try:
            gen, problems, stats, marked = adopt(
                r, gen.number, lambda g: check_generation(r, g, deep, jobs, on_bytes), wait=wait)
        except ReadOnlyRepository as exc:
            # the check is what was asked for; the marker is only its record here: check without the lock
            problems, stats = check_generation(r, gen, deep, jobs, on_bytes)
            not_marked = (f"generation {gen.number} could not be marked usable here: the repository is read-only "
                          f"({exc.message}); the check ran without the writer lock and recorded nothing")
    else:
        problems, stats = check_generation(r, gen, deep, jobs, on_bytes)
    report = VerifyReport(not problems, gen.number, gen.status, deep, problems, stats=stats, marked_usable=marked,
                          extra={"shared_objects": shared_object_report(r, gen.number, problems)})
    if not_marked is not None:
        report.warnings.append(not_marked)
        report.extra["not_marked"] = not_marked
    if opts.record and problems and gen.status in ("usable", "copied") and gen.check_failed is None:
        # [issue 24] damaged for every reader from now on: list, @latest, restore and load say so
        report.warnings.extend(record_failure(r, gen, problems, by="verify --deep" if deep else "verify"))
    if problems and str(generation) == "latest":
        fb = find_fallback(r, gen.number, deep, jobs)
        report.fallback = fb
        if fb is not None:
            report.warnings.append(f"generation {gen.number} (latest) does not verify; the newest generation "
                                   f"that verifies is {fb} (use --fallback)")
            if fallback:
                fb_gen = r.generation(fb)
                fb_problems, fb_stats = check_generation(r, fb_gen, deep, jobs)
                report = VerifyReport(not fb_problems, fb, fb_gen.status, deep, fb_problems,
                                      warnings=report.warnings, fallback=fb, stats=fb_stats,
                                      extra={"shared_objects": shared_object_report(r, fb, fb_problems)})
    if opts.policy:
        _add_policy(report, r, opts.strict)
    return report


def _refuse_partial(r: Repository, gen: Generation) -> None:
    """[break] A ``partial`` generation (never published) is not checked as a generation: exit 2, as ``restore``,
    ``load`` and ``export`` of it (nothing was found wrong; ``verify`` exited 1 here before).

    Raises:
        NotUsable: ``gen`` is partial, naming why and what ``gc`` and ``list --all`` do.
    """
    if gen.status == "partial":
        raise NotUsable(f"generation {gen.number} is partial ({gen.reason}): it was never published, so it cannot "
                        f"be checked as a generation and nothing was found wrong (an interrupted write, or one still "
                        f"running or being deleted; `ckpt-archive gc {r.location}` removes what an interrupted write "
                        f"left, `ckpt-archive list --all {r.location}` shows every generation)", where=r.location)


def _add_policy(report: VerifyReport, r: Repository, strict: bool) -> None:
    """The policy verdict of the reported generation (:func:`ckpt_archive.ops.policy_check.policy_verdict`) joins
    the report; a generation that failed its byte checks is not audited (its state cannot be trusted)."""
    from ckpt_archive.ops import policy_check

    if not report.ok:
        report.policy = policy_check.skipped("the generation failed its checks")
        return
    report.policy = policy_check.policy_verdict(r, report.generation, strict=strict)
    report.problems.extend(report.policy.problems)
    report.warnings.extend(report.policy.warnings)
    report.ok = not report.problems


@dataclasses.dataclass
class AdoptReport:
    """Result of :func:`adopt`.

    Attributes:
        location: the repository's place (resolved real path or normalised URL).
        adopted: generations checked deeply here and marked usable here now.
        already_usable: generations that were usable here before (not read).
        failed: ``{generation: [problem, ...]}`` for copied generations whose deep check failed (now
            ``damaged``: the failure is recorded, ``@latest`` never picks them).
        skipped: ``{generation: status}`` for generations neither usable nor copied (partial, damaged).
        bytes: raw bytes decoded by the trial reloads.
    """

    location: str
    adopted: list[int] = dataclasses.field(default_factory=list)
    already_usable: list[int] = dataclasses.field(default_factory=list)
    failed: dict[int, list[Problem]] = dataclasses.field(default_factory=dict)
    skipped: dict[int, str] = dataclasses.field(default_factory=dict)
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict:
        return {"ok": self.ok, "location": self.location, "adopted": self.adopted,
                "already_usable": self.already_usable,
                "failed": {str(n): [p.to_json() for p in ps] for n, ps in self.failed.items()},
                "skipped": {str(n): s for n, s in self.skipped.items()}, "bytes": self.bytes}


def adopt(repo: RepoLike, *, jobs: int | None = None, wait: float = 0.0, on_bytes=None,
          on_generation=None, store_options: Mapping[str, Any] | None = None) -> AdoptReport:
    """Make every ``copied`` generation of a repository usable at its new place, in one run.

    A repository moved or copied by another tool (``cp -a``, ``rsync``, ``aws s3 sync``) holds
    generations whose markers name the old place. Holding the writer lock for the whole run, each
    copied generation gets the deep check here (the trial reload: every chunk decoded, every tensor
    rebuilt and compared) and, when nothing is wrong, a marker naming this place, through the one
    publish path (:func:`ckpt_archive.repo.publish.adopt`). Usable generations are not read again.

    Args:
        repo: repository path/URL or Repository.
        jobs: decoder threads. wait: seconds to wait for the writer lock.
        on_bytes: progress callback (raw bytes decoded).
        on_generation: called ``(generation, index, count)`` as each copied generation starts.
        store_options: for URL repositories, one mapping (``{"endpoint_url": ..., "storage_options": {...}}``;
            :func:`~ckpt_archive.ops.common.open_repo`).

    Returns:
        :class:`AdoptReport` (``ok`` False when a copied generation failed its check: exit 1).

    Raises:
        NotFound: not a repository. LockError: another writer holds the lock (exit 2). TypeError: an unknown
            keyword argument or store option.

    Example:
        >>> import shutil, torch, ckpt_archive, tempfile, os
        >>> repo = tempfile.mkdtemp(); moved = os.path.join(tempfile.mkdtemp(), "moved")
        >>> _ = ckpt_archive.pack({"w": torch.ones(2)}, repo)
        >>> _ = shutil.copytree(repo, moved)
        >>> adopt(moved).adopted
        [1]
    """
    from ckpt_archive.repo.publish import adopt as publish_adopt

    r = open_repo(repo, store_options)
    report = AdoptReport(r.location)
    with r.lock(wait):
        gens = r.generations()
        # copied ones, and those an earlier run here found damaged (checked again: the copy may be repaired)
        copied = [g for g in gens if g.status == "copied" or g.check_failed is not None]
        for g in gens:
            if g.usable:
                report.already_usable.append(g.number)
            elif g not in copied:
                report.skipped[g.number] = g.status
        for i, g in enumerate(copied):
            if on_generation:
                on_generation(g.number, i, len(copied))
            gen, problems, stats, marked = publish_adopt(
                r, g.number, lambda x: check_generation(r, x, True, jobs, on_bytes), wait=wait)
            report.bytes += int((stats or {}).get("bytes") or 0)
            if problems:
                report.failed[g.number] = problems
            elif marked:
                report.adopted.append(g.number)
            elif gen.usable:
                report.already_usable.append(g.number)
    report.already_usable.sort()
    return report


__all__ = ["verify", "VerifyOptions", "VerifyReport", "adopt", "AdoptReport", "check_generation", "find_fallback",
           "record_failure", "source_layout_problems", "name_shared_object_users", "shared_object_report"]
