"""Prune: apply a retention decision to a repository, never leaving nothing restorable.

The decision itself is pure (:func:`ckpt_archive.retention.policy.apply_policy`); this module adds the
I/O around it, under the repository's writer lock. The rule (docs/retention.md, "The guarantees"): a
generation is removed only when the generations that remain include one whose every stored byte (its
members and the shared objects it references) was checked in this operation.

* :func:`check_restorable` checks the kept usable generations newest first (shallow ``verify``: the size
  and sha256 of every stored chunk, members and shared objects) and stops at the first that passes; a
  generation pack published moments ago under the same lock counts as checked without being read again
  (pack checked every stored byte it references: what it wrote, re-read against the CRC-32 of the bytes
  it wrote, and every object it reused, hashed before publishing). When no kept generation passes, the
  generations slated for removal are checked newest first and the newest that passes is kept as well
  (``rescued``), and the result says so; when none passes at all, nothing is removed;
* :func:`check_kept` is that check for a retention :class:`Decision`;
* :func:`refuse_unless_verified` refuses the whole prune (:class:`IntegrityError`, exit 1) when no
  generation passes, naming each one checked and what failed; nothing is removed;
* :func:`execute_prune` removes what the decision removes (less a rescued generation), oldest first,
  marker first;
* :func:`prune` is ``ckpt-archive prune``: decide, check, (save the default policy), remove;
* :func:`apply_after_pack` is the hook ``pack`` and ``backup`` call once a new generation is usable.

``forget`` applies the same check (:func:`check_restorable` with the remaining generations kept and the
one forgotten as the only candidate).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Mapping

from ckpt_archive.errors import CkptArchiveError, IntegrityError, UsageError
from ckpt_archive.retention.policy import Decision, GenerationFacts, RetentionPolicy, apply_policy
from ckpt_archive.ops.common import RepoLike

__all__ = ["KeptCheck", "PruneResult", "prune", "check_kept", "check_restorable", "refuse_unless_verified",
           "execute_prune", "apply_after_pack"]


@dataclass
class KeptCheck:
    """Whether a generation that stays after a removal verifies, established before anything is removed.

    Attributes:
        needed: False when nothing is to be removed (then nothing is read and nothing is refused).
        verified: the kept generation that passed (the newest kept one that did), or ``None``.
        trusted: True when the generation that passed was counted as checked without being read again
            (pack checked every stored byte it references moments ago, under the same lock).
        failed: kept generations newer than ``verified`` (or all of them when none passed) that
            failed the check, newest first, each with one line per problem (member: reason).
        rescued: when no kept generation passed: the newest generation slated for removal that passed,
            kept as well (the removal goes on without it), or ``None``.
        rescue_failed: generations slated for removal checked for the rescue that failed, newest first.
    """

    needed: bool
    verified: int | None = None
    trusted: bool = False
    failed: list[tuple[int, list[str]]] = field(default_factory=list)
    rescued: int | None = None
    rescue_failed: list[tuple[int, list[str]]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when removing is allowed: nothing to remove, or a generation that stays verifies."""
        return not self.needed or self.verified is not None or self.rescued is not None

    def warnings(self) -> list[str]:
        """One line per kept generation that failed while another generation that stays passed, and one
        saying which generation was kept although it was to be removed (never silent)."""
        if self.verified is not None:
            return [f"kept generation {n} does not verify ({'; '.join(problems)}); generation {self.verified} is "
                    f"the newest kept generation that does" for n, problems in self.failed]
        if self.rescued is None:
            return []
        failures = "; ".join(f"generation {n}: {', '.join(p)}" for n, p in self.failed + self.rescue_failed)
        return [f"no kept generation verifies ({failures}); generation {self.rescued}, the newest that does, "
                f"is kept as well although the policy removes it, so that a generation that restores remains"]

    def describe(self) -> str:
        """One line for humans: what the check found."""
        if not self.needed:
            return "nothing to remove: kept generations not checked"
        if self.verified is None and self.rescued is None:
            return ("no generation verifies: " +
                    "; ".join(f"generation {n}: {', '.join(p)}" for n, p in self.failed + self.rescue_failed))
        if self.verified is None:
            how = "checked by this pack" if self.trusted else "verified (stored sizes + sha256)"
            return (f"no kept generation verifies ({', '.join(str(n) for n, _ in self.failed)} FAIL verify); "
                    f"generation {self.rescued} {how} and kept as well")
        how = "checked by this pack" if self.trusted else "verified (stored sizes + sha256)"
        text = f"kept generation {self.verified} {how}"
        if self.failed:
            text += "; newer kept generation(s) " + ", ".join(str(n) for n, _ in self.failed) + " FAIL verify"
        return text

    def to_json(self) -> dict[str, Any]:
        """``{"needed", "ok", "verified_generation", "trusted", "failed": [{"generation", "problems"}],
        "rescued_generation", "rescue_failed": [{"generation", "problems"}]}``."""
        return {"needed": self.needed, "ok": self.ok, "verified_generation": self.verified, "trusted": self.trusted,
                "failed": [{"generation": n, "problems": list(p)} for n, p in self.failed],
                "rescued_generation": self.rescued,
                "rescue_failed": [{"generation": n, "problems": list(p)} for n, p in self.rescue_failed]}


def _verify_problems(repo: Any, number: int) -> list[str]:
    """Shallow-verify one generation (stored sizes and sha256 of every member; ``ckpt_archive.verify``).

    Returns one line per problem (``member: reason``); ``[]`` when it verifies. A generation that could
    not be checked at all (unreadable, vanished) counts as failing, with the reason.
    """
    from ckpt_archive.ops import verify as verify_op  # looked up at call time: tests replace verify_op.verify

    try:
        # stored bytes only; nothing recorded (the refusal to prune reports it)
        report = verify_op.verify(repo, str(number), options=verify_op.VerifyOptions(policy=False, record=False))
    except (CkptArchiveError, OSError) as exc:
        return [f"could not be verified: {exc}"]
    lines = []
    for p in report.problems:
        where = p.member or p.field
        lines.append(f"{where}: {p.reason}" if where else str(p.reason))
    return lines


def check_restorable(repo: Any, keep: Iterable[int], remove: Iterable[int], *,
                     verified: Iterable[int] = ()) -> KeptCheck:
    """Establish that a generation which stays verifies, before any of ``remove`` goes.

    Walks ``keep`` newest first and stops at the first that passes a shallow verify (the size and sha256
    of every stored chunk of its members and of the shared objects it references, as ``ckpt-archive
    verify REPO@N``). A generation in ``verified`` counts as passing without being read again: pack passes
    the generation it has just published under the same lock (every stored byte it references was checked
    by that pack). When none passes, ``remove`` is walked newest first the same way and the first that
    passes is ``rescued``: the caller keeps it. Reads nothing when ``remove`` is empty.

    Args:
        repo: an open :class:`ckpt_archive.repo.repository.Repository` (or its path/URL).
        keep: usable generation numbers that stay. remove: usable generation numbers to be removed.
        verified: generation numbers checked in full moments ago, under the same lock (not re-read).

    Returns:
        A :class:`KeptCheck`; ``.ok`` is False when no generation, kept or to be removed, verifies.
    """
    keep, remove = sorted(set(keep), reverse=True), sorted(set(remove), reverse=True)
    if not remove:
        return KeptCheck(needed=False)
    trusted = {int(n) for n in verified}
    failed: list[tuple[int, list[str]]] = []
    for number in keep:
        if number in trusted:
            return KeptCheck(needed=True, verified=number, trusted=True, failed=failed)
        problems = _verify_problems(repo, number)
        if not problems:
            return KeptCheck(needed=True, verified=number, failed=failed)
        failed.append((number, problems))
    rescue_failed: list[tuple[int, list[str]]] = []
    for number in remove:
        if number in trusted:
            return KeptCheck(needed=True, trusted=True, failed=failed, rescued=number, rescue_failed=rescue_failed)
        problems = _verify_problems(repo, number)
        if not problems:
            return KeptCheck(needed=True, failed=failed, rescued=number, rescue_failed=rescue_failed)
        rescue_failed.append((number, problems))
    return KeptCheck(needed=True, verified=None, failed=failed, rescue_failed=rescue_failed)


def check_kept(repo: Any, decision: Decision, *, verified: Iterable[int] = ()) -> KeptCheck:
    """:func:`check_restorable` for a retention decision: its kept generations, then (when none of them
    verifies) those it removes, newest first.

    Args:
        repo: an open :class:`ckpt_archive.repo.repository.Repository` (or its path/URL).
        decision: from :func:`apply_policy` on this repository's generations.
        verified: generation numbers known to verify right now (not re-read).

    Returns:
        A :class:`KeptCheck`; ``.ok`` is False when no generation verifies.
    """
    return check_restorable(repo, decision.keep_numbers, decision.remove_numbers, verified=verified)


def refuse_unless_verified(check: KeptCheck, decision: Decision, where: str | None = None) -> None:
    """Raise when removing ``decision.remove`` could delete the only intact generations.

    Raises:
        IntegrityError: ``check`` found no generation, kept or to be removed, that verifies (exit 1); the
            message names each generation checked and what failed, and says nothing was removed.
    """
    if check.ok:
        return
    failures = "; ".join(f"generation {n}: {', '.join(p)}" for n, p in check.failed + check.rescue_failed)
    raise IntegrityError(
        f"refusing to prune: none of the kept generation(s) {', '.join(map(str, decision.keep_numbers))} verifies, "
        f"nor any of those it would remove ({failures}); nothing was removed",
        where=where,
        hint="a pack of the same state writes damaged shared objects again (which repairs the generations "
             "that reference them); `ckpt-archive verify REPO@N` names what is damaged")


def apply_after_pack(repo: Any, policy: RetentionPolicy | Mapping[str, Any] | None, *,
                     now: datetime | None = None, verified: Iterable[int] = ()) -> dict[str, Any]:
    """Apply a retention policy right after ``pack`` made a new generation usable.

    The caller (``ckpt_archive.ops.pack.pack``) already holds the repository lock. ``policy=None`` uses the
    repository's default policy (``repository.json`` ``retention``); no policy there means nothing
    is removed. A policy the repository refuses (see :func:`apply_policy`) never fails the pack: it
    comes back as a warning. Nothing is removed unless a generation that stays verifies
    (:func:`check_kept`; one the policy removes may be kept for that, with a warning); otherwise that
    comes back as a warning too.

    Args:
        repo: an open :class:`ckpt_archive.repo.repository.Repository` (lock held).
        policy: the policy for this pack, or ``None``.
        now: the decision time (default: now, UTC).
        verified: generation numbers whose every stored byte was checked moments ago under this lock (the
            one pack just published: what it wrote re-read and decoded, every shared object it reused
            hashed before publishing): counted as verified without being read again. Without it the
            newest kept generation is read (shallow verify) before anything is removed.

    Returns:
        ``{"policy": dict, "kept": [numbers], "removed": [numbers], "warnings": [str],
        "verify_kept": dict, "objects": dict}`` (``verify_kept``: :meth:`KeptCheck.to_json`, absent when no
        policy ran; ``objects``: the shared objects freed or kept, :meth:`SweepResult.to_json`, present when
        a generation was removed; a sweep that deleted nothing because a manifest cannot be read is also a
        warning).
    """
    if policy is None:
        cfg = getattr(repo, "config", None) or {}
        policy = cfg.get("retention") if isinstance(cfg, Mapping) else None
    try:
        pol = RetentionPolicy.from_dict(policy)
    except UsageError as exc:
        return {"policy": None, "kept": [], "removed": [], "warnings": [f"retention not applied: {exc}"]}
    if pol.is_empty():
        return {"policy": {}, "kept": [], "removed": [], "warnings": []}
    try:
        decision = apply_policy([GenerationFacts.from_generation(g) for g in repo.generations()], pol, now)
    except UsageError as exc:
        return {"policy": pol.to_dict(), "kept": [], "removed": [], "warnings": [f"retention not applied: {exc}"]}
    removed: list[int] = []
    warnings: list[str] = []
    swept: list = []
    check = check_kept(repo, decision, verified=verified)
    warnings += check.warnings()
    try:
        execute_prune(repo, decision, removed=removed, check=check, objects=swept)
    except IntegrityError as exc:
        warnings.append(f"retention not applied, nothing removed: {exc.message}")
    except (CkptArchiveError, OSError) as exc:
        # the new generation is usable already; a failed removal leaves at worst a partial one for gc
        warnings.append(f"retention stopped after removing {removed or 'nothing'}: {exc}; the new generation is "
                        "usable, run `ckpt-archive gc` to remove any half-removed generation")
    if swept and swept[0].kept:
        warnings.append(swept[0].kept)
    kept = decision.keep_numbers + ([check.rescued] if check.rescued is not None else [])
    out = {"policy": pol.to_dict(), "kept": kept, "removed": removed, "warnings": warnings,
           "verify_kept": check.to_json()}
    if swept:
        out["objects"] = swept[0].to_json()
    return out


def execute_prune(repo: Any, decision: Decision, *, removed: list[int] | None = None,
                  check: KeptCheck | None = None, verified: Iterable[int] = (),
                  objects: list | None = None) -> list[int]:
    """Remove the generations ``decision.remove`` names, oldest first; the caller holds the lock.

    Nothing is removed unless a generation that stays verifies: ``check`` (from :func:`check_kept`), or,
    when not given, a fresh :func:`check_kept` run here (``verified``: numbers that count as verified
    without being read); a generation the check rescued (``check.rescued``) is not removed. Each removal
    goes through ``repo.remove_generation``
    (marker first, then members, then manifest, then the folder), so a kill part-way leaves the
    half-removed generation without its marker, i.e. recognisably not usable, and every kept
    generation untouched. The newest usable generation is checked once more here and never removed,
    whatever the decision says. After the last removal, the shared objects the removed generations
    referenced are deleted once, when no remaining manifest references them
    (:func:`ckpt_archive.repo.objects.sweep`; objects go last, the reverse of the write order); a kill
    before that leaves them for ``gc``.

    Args:
        repo: an open repository whose lock the caller holds.
        decision: from :func:`apply_policy` on this repository's generations.
        removed: a list to append each removed number to as it goes (so a caller sees the progress
            even when a removal fails part-way).
        check: the kept-generation check already made for this decision under the same lock.
        verified: with ``check=None``: generation numbers known to verify right now.
        objects: a list to append the sweep's :class:`~ckpt_archive.repo.objects.SweepResult` to (what
            shared objects went, or why they stayed); the sweep runs whether or not it is given.

    Returns:
        The numbers removed, in the order removed.

    Raises:
        IntegrityError: no kept generation verifies; nothing was removed (exit 1).
        OSError, StoreError: a removal failed; earlier removals stand, the failed generation is left
        without its marker (``partial``) or untouched.
    """
    if check is None:
        check = check_kept(repo, decision, verified=verified)
    refuse_unless_verified(check, decision, where=getattr(repo, "location", None))
    usable = [g.number for g in repo.generations() if getattr(g, "status", None) == "usable"]
    newest = max(usable) if usable else None
    from ckpt_archive.repo.objects import refs_of, sweep

    if removed is None:
        removed = []
    candidates: set[str] | None = set()
    for number in sorted(decision.remove_numbers):
        if number == newest or number == check.rescued:  # never the newest usable (defence in depth:
            continue                                     # apply_policy never puts it there), nor the rescued
        refs = refs_of(repo, number)
        repo.remove_generation(number, sweep=False)
        removed.append(number)
        candidates = None if candidates is None or refs is None else candidates | refs
    if removed:
        # once, after every removal (one index of the remaining manifests): objects go last
        swept = sweep(repo, candidates)
        if objects is not None:
            objects.append(swept)
    return removed


@dataclass
class PruneResult:
    """What :func:`prune` decided, checked and removed.

    Attributes:
        repository: the repository's location.
        dry_run: True when nothing was removed on purpose (decision and check only).
        decision: the retention decision (keep / remove / not usable, with reasons).
        generations: the repository's generations the decision was made from (newest last).
        check: what the kept-generation check found (:class:`KeptCheck`).
        removed: generation numbers removed, in the order removed (``[]`` with ``dry_run``).
        saved_default: True when the policy was stored as the repository's default.
        refused: ``None``, or (dry run only) why a real prune would be refused.
        objects: the shared objects the removal freed (or, with ``dry_run``, would free) and those kept
            and why (:class:`ckpt_archive.repo.objects.SweepResult`); None when nothing is removed.
    """

    repository: str
    dry_run: bool
    decision: Decision
    generations: list
    check: KeptCheck
    removed: list[int] = field(default_factory=list)
    saved_default: bool = False
    refused: str | None = None
    objects: Any = None
    skipped_keys: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """False when the prune is (or, with ``dry_run``, would be) refused: no generation verifies."""
        return self.refused is None

    @property
    def to_remove(self) -> list[int]:
        """The generations this prune removes (or, with ``dry_run``, would remove): the decision's, less one
        the check kept so that a generation that verifies remains (``check.rescued``); oldest first."""
        if self.refused:
            return []
        return sorted(n for n in self.decision.remove_numbers if n != self.check.rescued)

    @property
    def warnings(self) -> list[str]:
        """Kept generations that fail verify while another generation that stays passes (or one the policy
        removes, kept for that); shared objects that were not deleted because a manifest cannot be read."""
        extra = [self.objects.kept] if self.objects is not None and self.objects.kept else []
        return self.check.warnings() + extra + list(self.skipped_keys)  # unsafe store keys left alone

    def to_json(self) -> dict[str, Any]:
        """``{"repository", "dry_run", "policy", "keep", "remove", "not_usable", "to_remove", "removed",
        "saved_default", "verify_kept", "warnings", "refused", "objects"}`` (JSON-ready; ``to_remove``: what
        goes or would go, the decision's ``remove`` less a generation kept by the check; ``objects``:
        :meth:`~ckpt_archive.repo.objects.SweepResult.to_json` or None)."""
        return {"repository": self.repository, "dry_run": self.dry_run, **self.decision.to_json(),
                "to_remove": self.to_remove, "removed": list(self.removed), "saved_default": self.saved_default,
                "verify_kept": self.check.to_json(), "warnings": self.warnings, "refused": self.refused,
                "objects": self.objects.to_json() if self.objects is not None else None}


def prune(repo: RepoLike, policy: RetentionPolicy | None = None, *, dry_run: bool = False,
          wait: float = 0.0, now: datetime | None = None, save_default: bool = False) -> PruneResult:
    """Apply ``policy`` (or the repository's default when ``None``) to the repository.

    Before anything is removed, a generation that stays must verify (newest kept first, shallow verify:
    stored sizes and sha256 of its members and shared objects; :func:`check_kept`): when no kept one does,
    the newest generation the policy removes that does is kept as well (a warning says so); when none
    does, nothing is removed. Never leave nothing restorable. ``dry_run`` makes the same check and reports
    the same decision.

    Args:
        repo: repository path or URL.
        policy: a :class:`~ckpt_archive.retention.policy.RetentionPolicy`, or ``None`` for the
            repository's default (``repository.json`` ``retention``).
        dry_run: decide, check the kept generations and report only; take no lock, delete nothing.
        wait: seconds to wait for the writer lock.
        now: decision time, timezone-aware (default now, UTC).
        save_default: also store ``policy`` as the repository's default (``repository.json``), once
            the decision has been accepted (not with ``dry_run``, not when the prune is refused).

    Returns:
        A :class:`PruneResult`; ``refused`` is ``None`` or (dry run only) the reason the prune would
        be refused (``ok`` is then False).

    Raises:
        NotFound: no repository there. UsageError: empty or refused policy, a policy that is not a
            ``RetentionPolicy``, or ``save_default`` without a policy. LockError: another writer.
        IntegrityError: (not with ``dry_run``) no generation verifies; nothing removed (exit 1).

    Example:
        >>> import ckpt_archive, tempfile
        >>> from ckpt_archive.retention.policy import RetentionPolicy
        >>> repo = tempfile.mkdtemp() + "/repo"
        >>> for step in range(3):
        ...     _ = ckpt_archive.pack({"step": step}, repo)
        >>> ckpt_archive.prune(repo, RetentionPolicy(keep_last=1)).removed
        [1, 2]
    """
    from ckpt_archive.ops.common import open_repo

    r = open_repo(repo)
    if policy is None:
        if save_default:
            raise UsageError("--save-default needs policy flags (the policy to store)")
        policy = RetentionPolicy.from_dict(r.config.get("retention"), where=f"{r.location}/repository.json")
    elif not isinstance(policy, RetentionPolicy):
        raise UsageError(f"a retention policy must be a RetentionPolicy or None, got {type(policy).__name__}",
                         where="retention")

    def decide():
        gens = r.generations()
        return gens, apply_policy([GenerationFacts.from_generation(g) for g in gens], policy, now)

    saved = False
    refused = None
    if dry_run:
        gens, decision = decide()
        check = check_kept(r, decision)
        try:
            refuse_unless_verified(check, decision, where=r.location)
        except IntegrityError as exc:
            refused = str(exc)
        removed: list[int] = []
        going = [n for n in decision.remove_numbers if n != check.rescued]
        swept = [_forecast_sweep(r, going)] if going and refused is None else []
    else:
        swept = []
        with r.lock(wait=wait):
            gens, decision = decide()
            check = check_kept(r, decision)
            refuse_unless_verified(check, decision, where=r.location)  # before saving or removing anything
            if save_default:
                r.set_default_retention(policy.to_dict())
                saved = True
            removed = execute_prune(r, decision, check=check, objects=swept)
    return PruneResult(repository=r.location, dry_run=dry_run, decision=decision, generations=gens, check=check,
                       removed=removed, saved_default=saved, refused=refused, objects=swept[0] if swept else None,
                       skipped_keys=list(r.unsafe_keys))


def _forecast_sweep(repo: Any, going: list[int]):
    """What removing generations ``going`` would free (a dry run: nothing is deleted, no lock needed)."""
    from ckpt_archive.repo.objects import refs_of, sweep

    candidates: set[str] | None = set()
    for number in going:
        refs = refs_of(repo, number)
        candidates = None if candidates is None or refs is None else candidates | refs
    return sweep(repo, candidates, dry_run=True, exclude=going)
