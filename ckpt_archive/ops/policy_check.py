"""The policy verdict of a generation: the LR audit and the completeness lint, and what of them fails a check.

``verify`` and ``inspect`` read the generation's state tree (small tensors only:
:func:`~ckpt_archive.ops.audit_read.state_for_audit`) and run the pure analysis of
:mod:`ckpt_archive.training` (:func:`~ckpt_archive.training.completeness.policy_section`). This module
turns the findings into a verdict, the one the CLI renders and
``ckpt_archive.verify(..., options=VerifyOptions(strict=True))`` returns alike (docs/policy.md, "Completeness lint and ``--strict``"):

* audit findings of severity ``error`` (the state cannot be resumed as saved) are problems;
* audit warnings and info, and completeness findings, are warnings;
* ``strict``: completeness *warnings* are problems; completeness *info* (what could not be seen, a guess)
  never fails;
* a state tree that cannot be read (not valid JSON, too deep, malformed nodes) is a problem: the generation
  cannot be restored.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ckpt_archive.errors import CheckFailed, CkptArchiveError, FormatError
from ckpt_archive.repo.reader import Problem


@dataclasses.dataclass
class PolicyVerdict:
    """The policy audit and completeness lint of one generation, with their verdict.

    Attributes:
        audit: the :class:`~ckpt_archive.training.audit.PolicyAudit` (None when ``skipped``).
        completeness: the completeness findings (:class:`~ckpt_archive.training.audit.Finding`).
        strict: whether completeness warnings fail the check.
        problems: what fails the check (each a :class:`~ckpt_archive.repo.reader.Problem`).
        warnings: one line per finding that does not fail it (``"policy: FIELD: ..."``,
            ``"completeness (info): FIELD: ..."``, ...).
        skipped: why nothing was audited (the generation failed its byte checks, its state could not be
            read), else None.
    """

    audit: Any = None
    completeness: list = dataclasses.field(default_factory=list)
    strict: bool = False
    problems: list[Problem] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    skipped: str | None = None

    @property
    def findings(self) -> list:
        """Audit findings not repeated by the completeness lint (the missing-scheduler line is in both), then
        the lint's: the list a report shows."""
        if self.audit is None:
            return list(self.completeness)
        texts = [f.message for f in self.completeness]
        return [f for f in self.audit.findings if not any(f.message in t for t in texts)] + list(self.completeness)

    def to_json(self) -> dict:
        """``{"audit", "completeness", "strict"}``, or ``{"skipped": reason}``."""
        if self.skipped is not None:
            return {"skipped": self.skipped}
        return {"audit": self.audit.to_json(), "completeness": [f.to_json() for f in self.completeness],
                "strict": self.strict}


def policy_verdict(repo: Any, generation: str | int, *, strict: bool = False) -> PolicyVerdict:
    """Audit a generation's LR policy and completeness and judge the findings (see the module docstring).

    Args:
        repo: a :class:`~ckpt_archive.repo.repository.Repository` (or its location).
        generation: the generation to audit (its byte checks passed).
        strict: completeness warnings fail the check.

    Returns:
        :class:`PolicyVerdict`. A state tree that is broken gives a problem; a generation whose state could
        not be read for another reason (e.g. refused by the reader) is ``skipped`` with a warning. Never raises
        for what it finds.
    """
    from ckpt_archive.ops.audit_read import state_for_audit
    from ckpt_archive.training.completeness import policy_section

    verdict = PolicyVerdict(strict=strict)
    try:
        decoded: dict = {}
        state, manifest, _ = state_for_audit(repo, generation, info=decoded)
    except CkptArchiveError as exc:
        verdict.skipped = str(exc)
        if isinstance(exc, (CheckFailed, FormatError)):
            # the state tree itself was read and is broken: the generation cannot be restored, so a plain
            # verify must not pass it with a warning
            verdict.problems.append(Problem(f"state tree cannot be read: {exc.message}", member=exc.where))
        else:
            verdict.warnings.append(f"policy audit skipped: {exc}")
        return verdict
    verdict.audit, verdict.completeness, _ = policy_section(state, manifest, decoded)
    _judge(verdict)
    return verdict


def _judge(v: PolicyVerdict) -> None:
    """Sort the findings into problems and warnings by the rule of the module docstring."""
    lint = {id(f) for f in v.completeness}
    for f in v.findings:
        if id(f) not in lint:
            if f.severity == "error":  # only a state that cannot be resumed as saved fails the check
                v.problems.append(Problem(f"policy: {f.message}", field=f.field))
            else:
                v.warnings.append(f"policy ({f.severity}): {f.field}: {f.message}" if f.severity == "info"
                                  else f"policy: {f.field}: {f.message}")
        elif v.strict and f.severity == "warning":
            v.problems.append(Problem(f"completeness (--strict): {f.message}", field=f.field))
        elif f.severity == "info":  # what could not be checked, or a guess: never a failure, even strict
            v.warnings.append(f"completeness (info): {f.field}: {f.message}")
        else:
            v.warnings.append(f"completeness: {f.field}: {f.message}")


def skipped(reason: str) -> PolicyVerdict:
    """The verdict of a generation that was not audited (``reason``: e.g. it failed its byte checks)."""
    return PolicyVerdict(skipped=reason)


__all__ = ["PolicyVerdict", "policy_verdict", "skipped"]
