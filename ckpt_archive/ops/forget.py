"""Forget: remove one generation, marker first, under the repository lock, never leaving nothing restorable."""
from __future__ import annotations

from ckpt_archive.ops.common import RepoLike
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ForgetResult", "forget"]


@dataclass
class ForgetResult:
    """What :func:`forget` removed.

    Attributes:
        repository: the repository's location.
        generation: the number of the generation removed.
        status: its status before removal (``usable``, ``partial``, ``copied``, ``damaged``).
        newest_usable: the newest usable generation afterwards, or ``None`` when none is left.
        objects: the shared objects the removal freed, those kept and why
            (:class:`ckpt_archive.repo.objects.SweepResult`).
    """

    repository: str
    generation: int
    status: str
    newest_usable: int | None
    objects: Any = None
    skipped_keys: list[str] = field(default_factory=list)
    check: Any = None

    @property
    def ok(self) -> bool:
        """Always True: a refused or failed forget raises instead."""
        return True

    @property
    def warnings(self) -> list[str]:
        """Remaining generations that do not verify (or that none does, the forgotten one included); why
        shared objects were not deleted (a manifest that cannot be read), if so."""
        out = []
        if self.check is not None and self.check.needed:
            if self.check.verified is not None:
                out += self.check.warnings()
            else:
                failures = "; ".join(f"generation {n}: {', '.join(p)}"
                                     for n, p in self.check.failed + self.check.rescue_failed)
                out.append(f"no generation of the repository verifies ({failures}): generation {self.generation} "
                           f"did not either, so forgetting it left nothing that restores behind; a pack of the "
                           f"same state writes damaged shared objects again")
        kept = [self.objects.kept] if self.objects is not None and self.objects.kept else []
        return out + kept + list(self.skipped_keys)  # unsafe store keys left alone (never deleted through)

    def to_json(self) -> dict[str, Any]:
        """``{"repository", "generation", "status", "newest_usable", "objects", "verify_kept", "warnings"}``
        (JSON-ready; ``objects``: :meth:`~ckpt_archive.repo.objects.SweepResult.to_json`; ``verify_kept``:
        what the check of the remaining generations found, :meth:`~ckpt_archive.ops.prune.KeptCheck.to_json`,
        or None when the generation forgotten was not one that could restore)."""
        return {"repository": self.repository, "generation": self.generation, "status": self.status,
                "newest_usable": self.newest_usable,
                "objects": self.objects.to_json() if self.objects is not None else None,
                "verify_kept": self.check.to_json() if self.check is not None else None,
                "warnings": self.warnings}


def forget(repo: RepoLike, generation: str | int, *, force: bool = False,
           wait: float = 0.0) -> ForgetResult:
    """Remove one generation (any status) in reverse publish order, holding the lock.

    Never leave nothing restorable (docs/retention.md): before a generation that could restore (``usable``
    or ``copied``) is removed, the remaining usable generations are checked newest first (shallow verify:
    the size and sha256 of every stored chunk, members and shared objects) until one passes. If none
    passes and the generation to forget does, it is the only one that restores: refused (exit 1). If it
    fails too, it goes, with a warning. A ``partial`` or ``damaged`` generation restores nothing and goes
    unchecked.

    The ``USABLE.json`` marker goes first (from that instant the generation is not usable), then its
    members, manifest and folder; a kill part-way leaves a ``partial`` generation for ``gc``. Last, the
    shared objects it referenced go when no remaining generation's manifest references them; none goes
    while some generation's manifest cannot be read (``objects.kept`` says so).

    Args:
        repo: repository path or URL.
        generation: a generation number, ``latest`` or ``tag:NAME``.
        force: allow removing the newest usable generation.
        wait: seconds to wait for the writer lock.

    Returns:
        A :class:`ForgetResult` (``status`` before removal; ``newest_usable`` afterwards; ``objects``: the
        shared objects freed or kept).

    Raises:
        NotFound: no such repository or generation. UsageError: it is the newest usable one and
            ``force`` is false. LockError: another writer holds the lock. LinkInRepository: the generation
            (or a part of it) is a symbolic link: nothing is deleted through it (exit 2).
        IntegrityError: it is the only generation that verifies; nothing removed (exit 1, naming what
            failed in the others).

    Example:
        >>> import ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp() + "/repo"
        >>> for step in range(2):
        ...     _ = ckpt_archive.pack({"step": step}, repo)
        >>> ckpt_archive.forget(repo, 1).newest_usable
        2
    """
    from ckpt_archive.errors import IntegrityError, LinkInRepository, UnsafePath, UsageError
    from ckpt_archive.ops.prune import check_restorable
    from ckpt_archive.ops.common import open_repo

    r = open_repo(repo)
    with r.lock(wait=wait):
        gen = r.resolve(str(generation))
        usable = [g.number for g in r.usable()]
        if usable and gen.number == usable[-1] and not force:
            older = f" (the next newest usable would be {usable[-2]})" if len(usable) > 1 else \
                " (it is the only usable generation)"
            raise UsageError(f"refusing to forget generation {gen.number}: it is the newest usable generation"
                             f"{older}; pass --force to remove it anyway", where=r.location)
        status = gen.status
        check = None
        if status in ("usable", "copied"):
            check = check_restorable(r, [n for n in usable if n != gen.number], [gen.number])
            if check.rescued == gen.number:
                failures = "; ".join(f"generation {n}: {', '.join(p)}" for n, p in check.failed)
                others = f" (none of the others does: {failures})" if failures else " (there is no other)"
                raise IntegrityError(
                    f"refusing to forget generation {gen.number}: it is the only generation that verifies"
                    f"{others}; forgetting it would leave nothing that restores, so nothing was removed",
                    where=r.location,
                    hint=("a pack of the same state writes damaged shared objects again (which repairs the "
                          "generations that reference them); `ckpt-archive verify REPO@N` names what is damaged"
                          if failures else "pack a newer generation first; to discard every generation, remove "
                          "the repository itself"))
        try:
            swept = r.remove_generation(gen.number)
        except UnsafePath as exc:  # a generation that is a link: nothing is deleted through it
            raise LinkInRepository(f"not removed: {exc.message}", where=exc.where) from None
        remaining = [g.number for g in r.usable()]
    return ForgetResult(repository=r.location, generation=gen.number, status=status,
                        newest_usable=remaining[-1] if remaining else None, objects=swept,
                        skipped_keys=list(r.unsafe_keys), check=check)
