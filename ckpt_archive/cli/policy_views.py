"""The policy audit in the CLI: ``inspect``, ``verify`` and ``restore`` print and extend their reports.

Rendering only: the analysis is :mod:`ckpt_archive.training` (audit, completeness lint, session
policy) and reading a generation for it is :func:`ckpt_archive.ops.audit_read.state_for_audit`. Rich is
imported inside the functions, so importing this module stays cheap.
"""
from __future__ import annotations

import math
from typing import Any

from ckpt_archive.errors import UsageError
from ckpt_archive.ops.audit_read import state_for_audit
from ckpt_archive.training.audit import Finding, PolicyAudit
from ckpt_archive.training.completeness import policy_section
from ckpt_archive.training.session import HYPER_NAMES, PolicyChange, apply_session_policy, compare_with_session, session_values


def audit_table(a: PolicyAudit):
    """A :class:`rich.table.Table` of :meth:`PolicyAudit.rows` (one row per param group)."""
    from rich import box
    from rich.table import Table

    kind = a.scheduler.get("kind") or "none"
    t = Table(title=f"LR policy (scheduler: {kind})", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for col in ("group", "params", "lr", "initial_lr", "base_lr", "last_lr", "derived_lr", "next_lr",
                "after_sched_step"):
        t.add_column(col, justify="right" if col != "group" else "left")
    for r in a.rows():
        t.add_row(*r.values())
    return t


def audit_renderable(a: PolicyAudit):
    """The whole audit for a rich console: the table, the counters, the findings (errors red)."""
    from rich.console import Group
    from rich.text import Text

    counters = ", ".join(f"{k} {v}" for k, v in a.counter_rows())
    items: list = [audit_table(a), Text(f"counters: {counters}")]
    for f in a.findings:
        items.append(Text(str(f), style="red" if f.severity == "error" else "yellow"))
    return Group(*items)


def _say_counters(a: PolicyAudit, out: Any) -> None:
    """The counters line, the partial-decoding note, what was audited, and what overrides the session."""
    out.say("  counters: " + ", ".join(f"{k} {v}" for k, v in a.counter_rows()))
    if a.counters.get("partial"):
        out.say(f"  ({a.counters['partial']})")
    for note in a.notes:
        out.say(f"  {note}")
    if a.overrides:
        out.say("  archived fields that override the session's:")
        for o in a.overrides:
            out.say(f"    {o}")


def _dedup(a: PolicyAudit, lint: list[Finding]) -> list[Finding]:
    """Audit findings not repeated by the lint (the missing-scheduler line is in both)."""
    texts = [f.message for f in lint]
    return [f for f in a.findings if not any(f.message in t for t in texts)]


def cli_inspect(info: dict, repo: Any, out: Any) -> dict:
    """``inspect``: print the audit table, counters and findings; return ``{"policy": ...}`` for ``--json``.

    An archive whose state cannot be read for the audit still inspects (the reason is printed).
    """
    from ckpt_archive.errors import CkptArchiveError

    try:
        decoded: dict = {}
        state, manifest, _ = state_for_audit(repo, info["generation"], info=decoded)
    except CkptArchiveError as exc:
        out.warn(f"policy audit skipped: {exc}")
        return {"policy": {"skipped": str(exc)}}
    a, lint, section = policy_section(state, manifest, decoded)
    if a.groups:
        out.table(audit_table(a))
    else:  # no optimizer param groups: an empty table says nothing
        out.say(f"LR policy: no optimizer param groups in this state (scheduler: {a.scheduler.get('kind') or 'none'})")
    _say_counters(a, out)
    for f in _dedup(a, lint) + lint:
        if f.severity == "info":
            out.say(f"  info: {f.field}: {f.message}")
        else:
            out.warn(f"{f.field}: {f.message}")
    return {"policy": section}


def cli_verify(report: Any, repo: Any, *, strict: bool, out: Any) -> None:
    """``verify``: add the audit and lint to a :class:`~ckpt_archive.ops.verify.VerifyReport`.

    Semantics: audit findings of severity ``error`` (the state cannot be resumed as saved) are problems
    (exit 1); warnings and ``info`` (a finished schedule, what could not be checked) are warnings;
    completeness warnings are warnings, and problems under ``--strict``; completeness ``info`` (what
    could not be seen, guesses) never fails. A generation that failed its
    byte checks is not audited (its state cannot be trusted). ``report.extra["policy"]`` holds the audit,
    the completeness findings and ``strict``.
    """
    from ckpt_archive.errors import CheckFailed, CkptArchiveError, FormatError
    from ckpt_archive.repo.reader import Problem

    if not report.ok:
        report.extra["policy"] = {"skipped": "the generation failed its checks"}
        return
    try:
        decoded: dict = {}
        state, manifest, _ = state_for_audit(repo, report.generation, info=decoded)
    except CkptArchiveError as exc:
        report.extra["policy"] = {"skipped": str(exc)}
        if isinstance(exc, (CheckFailed, FormatError)):
            # the state tree itself was read and is broken (not valid JSON, too deep, malformed nodes): the
            # generation cannot be restored, so plain verify must not pass it with a warning
            report.problems.append(Problem(f"state tree cannot be read: {exc.message}", member=exc.where))
            report.ok = False
        else:
            report.warnings.append(f"policy audit skipped: {exc}")
        return
    a, lint, section = policy_section(state, manifest, decoded)
    out.table(audit_table(a))
    _say_counters(a, out)
    for f in _dedup(a, lint):
        if f.severity == "error":  # only a state that cannot be resumed as saved fails the check
            report.problems.append(Problem(f"policy: {f.message}", field=f.field))
        else:
            report.warnings.append(f"policy ({f.severity}): {f.field}: {f.message}" if f.severity == "info"
                                   else f"policy: {f.field}: {f.message}")
    for f in lint:
        if strict and f.severity == "warning":
            report.problems.append(Problem(f"completeness (--strict): {f.message}", field=f.field))
        elif f.severity == "info":  # what could not be checked, or a guess: never a failure, even --strict
            report.warnings.append(f"completeness (info): {f.field}: {f.message}")
        else:
            report.warnings.append(f"completeness: {f.field}: {f.message}")
    report.ok = not report.problems
    report.extra["policy"] = {**section, "strict": strict}


def _parse_expect_lr(value: Any) -> float | list[float] | None:
    """``--expect-lr``: one LR (group 0 of each optimizer) or a comma-separated list (one per param group).

    Raises:
        UsageError: not finite non-negative numbers.
    """
    if value is None:
        return None
    items = [value] if isinstance(value, (int, float)) else str(value).split(",")
    out = []
    for item in items:
        try:
            v = float(item)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v >= 0):
            raise UsageError(f"--expect-lr must be finite, non-negative numbers (comma-separated per param group), "
                             f"not {value}")
        out.append(v)
    return out[0] if len(out) == 1 and not (isinstance(value, str) and "," in value) else out


def cli_restore_prepare(repo: Any, generation: str | int, *, session_config: str | None,
                        expect_lr: float | str | None,
                        policy: str, out: Any):
    """``restore --session-config F / --expect-lr LR / --policy session``: print the differences first.

    Returns:
        ``(transform, section)``: ``transform`` (or None) rewrites a file source's state under ``--policy
        session`` and records its changes in ``section["changes"]``; for a folder source
        ``section["_folder_rewrite"]`` holds the rewrite to pass to ``restore(folder_rewrite=...)`` (popped by
        the caller); ``section`` goes under ``"policy"`` in the JSON.

    Raises:
        UsageError: a bad ``--policy``; ``--policy session`` with nothing to impose.
    """
    if policy not in ("checkpoint", "session"):
        raise UsageError(f"--policy must be 'checkpoint' or 'session', not {policy!r}")
    expect_lr = _parse_expect_lr(expect_lr)
    if session_config is None and expect_lr is None and policy == "checkpoint":
        return None, {}
    state, manifest, _ = state_for_audit(repo, generation)
    packed_cfg = manifest.get("config") or None
    diffs = compare_with_session(state, session_config=session_config, expect_lr=expect_lr, policy=policy,
                                 archived_config=packed_cfg)
    for d in diffs:
        out.warn(d.message)
    section: dict = {"mode": policy, "differences": [d.to_json() for d in diffs], "changes": []}
    if policy == "checkpoint":
        return None, section
    sess = session_values(session_config)
    if not any(k in sess for k in ("lr", *HYPER_NAMES, "betas", "scheduler")):
        raise UsageError("--policy session needs --session-config with an lr (or weight_decay, momentum, eps, "
                         "betas, scheduler settings) to impose; --expect-lr only checks")
    if not diffs:  # the archive already holds the session's values: restore it as packed (byte for byte)
        if manifest["source"]["layout"] == "folder":
            section["rewritten"] = []
        return None, section
    if manifest["source"]["layout"] == "folder":
        # each optimizer/scheduler file pair of the folder, rewritten while it is restored
        from ckpt_archive.training.folder_session import session_folder_rewrite

        section["_folder_rewrite"] = session_folder_rewrite(session_config)
        return None, section

    def transform(st: Any) -> Any:
        new, changes = apply_session_policy(st, session_config=session_config, archived_config=packed_cfg)
        section["changes"] = [c.to_json() for c in changes]
        section["_changes"] = changes
        return new

    return transform, section


def cli_restore_finish(section: dict, out: Any, folder_report: dict | None = None) -> dict:
    """Say what ``--policy session`` rewrote; return the JSON section (``{}`` when no policy flag).

    ``folder_report``: a folder source's ``RestoreResult.extra["folder_rewrite"]``; its ``changes`` and
    ``rewritten`` files (no longer byte-identical to the packed ones) join the section.
    """
    changes = section.pop("_changes", None)
    section.pop("_folder_rewrite", None)
    if folder_report is not None:
        section["changes"] = folder_report.get("changes", [])
        section["rewritten"] = folder_report.get("rewritten", [])
        changes = [PolicyChange(c["field"], c["old"], c["new"]) for c in section["changes"]]
        for note in folder_report.get("notes", []):
            out.say(f"  {note}")
    if section.get("mode") == "session":
        if changes:
            out.say(f"--policy session: rewrote {len(changes)} field(s) in the restored output (optimizer moments "
                    f"and step counters untouched):")
            for c in changes:
                out.say(f"  {c}")
            for f in section.get("rewritten", []):
                out.say(f"  {f['file']}: re-serialised with torch.save, no longer byte-identical to the packed file")
        else:
            out.say("--policy session: the archived values already equal the session's; nothing rewritten")
    return {"policy": section} if section else {}
