"""The policy audit in the CLI: ``inspect``, ``verify`` and ``restore`` print and extend their reports.

Rendering only: the analysis is :mod:`ckpt_archive.training` (audit, completeness lint, session
policy), the verdicts of ``verify``/``inspect`` are :mod:`ckpt_archive.ops.policy_check` (run by
:func:`ckpt_archive.verify` and :func:`ckpt_archive.inspect`), and reading a generation for them is
:func:`ckpt_archive.ops.audit_read.state_for_audit`. Rich is imported inside the functions, so importing
this module stays cheap.
"""
from __future__ import annotations

import math
from typing import Any

from ckpt_archive.errors import UsageError
from ckpt_archive.ops.audit_read import state_for_audit
from ckpt_archive.training.audit import PolicyAudit
from ckpt_archive.training.nextstep import build_model
from ckpt_archive.training.session import (HYPER_NAMES, PolicyChange, apply_session_policy, differences,
                                           session_values)


#: The table's columns in display order, and the order they give way in when the terminal is narrow (the
#: first to go first): numbers are never cut, a column is left out instead and the caption says which.
_COLUMNS = ("group", "params", "lr", "initial_lr", "base_lr", "last_lr", "derived_lr", "next_lr",
            "after_sched_step")
_GIVE_WAY = ("params", "derived_lr", "last_lr", "lr", "initial_lr", "base_lr", "after_sched_step")


def audit_table(a: PolicyAudit, width: int | None = None):
    """A :class:`rich.table.Table` of :meth:`PolicyAudit.rows` (one row per param group) that fits ``width``
    columns without cutting a number: a column that is ``-`` in every row is left out, then, while the table
    is too wide, the columns of :data:`_GIVE_WAY` in that order (a column equal to another shown one first,
    e.g. ``lr`` = ``next_lr``); the caption names what was left out (``--json`` has every column).
    ``group`` and ``next_lr`` (the LR the next step uses, what the table is for) always stay."""
    rows = a.rows()
    cols = [c for c in _COLUMNS if c in ("group", "next_lr") or any(r[c] != "-" for r in rows)]
    left_out: list[str] = []
    for col in sorted(_GIVE_WAY, key=lambda c: _equal_to(c, cols, rows) is None):
        if width is None or _measure(a, rows, cols) <= width:
            break
        if col in cols:
            same = _equal_to(col, cols, rows)
            cols.remove(col)
            left_out.append(f"{col} (= {same})" if same else col)
    caption = (f"not shown at {width} columns: {', '.join(left_out)}; --json has every column"
               if left_out else None)
    return _table(a, rows, cols, caption)


def _equal_to(col: str, cols: list[str], rows: list[dict]) -> str | None:
    """Another shown column whose values equal ``col``'s in every row (so leaving ``col`` out loses nothing)."""
    for other in cols:
        if other != col and other != "group" and all(r[col] == r[other] for r in rows):
            return other
    return None


def _table(a: PolicyAudit, rows: list[dict], cols: list[str], caption: str | None = None):
    from rich import box
    from rich.table import Table

    kind = a.scheduler.get("kind") or "none"
    t = Table(title=f"LR policy (scheduler: {kind})", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False, caption=caption, caption_justify="left")
    for col in cols:
        t.add_column(col, justify="right" if col != "group" else "left", no_wrap=True,
                     min_width=max(len(col), *(len(r[col]) for r in rows)) if rows else None)
    for r in rows:
        t.add_row(*(r[c] for c in cols))
    return t


def _measure(a: PolicyAudit, rows: list[dict], cols: list[str]) -> int:
    """The width the table needs to show every cell whole."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000, emoji=False)  # as the consoles the table goes to (cli/common.py)
    return Measurement.get(console, console.options, _table(a, rows, cols)).maximum


def _width(out: Any) -> int:
    """The width of the console the tables go to (80 when it cannot be told)."""
    for name in ("console", "out", "err"):
        width = getattr(getattr(out, name, None), "width", None)
        if isinstance(width, int):
            return width
    import shutil

    return shutil.get_terminal_size((80, 24)).columns


def audit_renderable(a: PolicyAudit):
    """The whole audit for a rich console: the table, the counters, the findings (errors red)."""
    from rich.console import Group
    from rich.text import Text

    counters = ", ".join(f"{k} {v}" for k, v in a.counter_rows())
    items: list = [audit_table(a), Text(f"counters: {counters}")]
    for f in a.findings:
        items.append(Text(str(f), style="red" if f.severity == "error" else "yellow"))
    return Group(*items)


#: Param groups whose next steps are listed in words (``--json`` has every one).
_SHOWN = 8


def _say_counters(a: PolicyAudit, out: Any) -> None:
    """The counters line, the partial-decoding note, what was audited, and what overrides the session."""
    out.say("  counters: " + ", ".join(f"{k} {v}" for k, v in a.counter_rows()))
    if a.counters.get("partial"):
        out.say(f"  ({a.counters['partial']})")
    for note in a.notes:
        out.say(f"  {note}")
    described = [g for g in a.groups if g.next_steps_from]
    if described:
        out.say(f"  the next {len(described[0].next_steps)} optimizer steps:")
        for g in described[:_SHOWN]:
            out.say(f"    {g.field}: {g.next_steps_from}")
        if len(described) > _SHOWN:
            out.say(f"    ... {len(described) - _SHOWN} more group(s) (--json lists every one)")
    if a.overrides:
        out.say("  archived fields that override the session's:")
        for o in a.overrides:
            out.say(f"    {o}")


def cli_inspect(info: Any, out: Any) -> None:
    """``inspect``: print the audit table, counters and findings of ``info.policy`` (the
    :class:`~ckpt_archive.ops.policy_check.PolicyVerdict` that :func:`ckpt_archive.inspect` computed; ``--json``
    prints it with the rest of the result). An archive whose state cannot be read for the audit still inspects
    (the reason is printed)."""
    verdict = info.policy
    if verdict is None:
        return
    if verdict.skipped is not None:
        out.warn(f"policy audit skipped: {verdict.skipped}")
        return
    a = verdict.audit
    if a.groups:
        out.table(audit_table(a, _width(out)))
    else:  # no optimizer param groups: an empty table says nothing
        out.say(f"LR policy: no optimizer param groups in this state (scheduler: {a.scheduler.get('kind') or 'none'})")
    _say_counters(a, out)
    for f in verdict.findings:
        if f.severity == "info":
            out.say(f"  info: {f.field}: {f.message}")
        else:
            out.warn(f"{f.field}: {f.message}")


def cli_verify(report: Any, out: Any) -> None:
    """``verify``: print the audit table and counters of ``report.policy`` (the verdict itself, its problems and
    warnings, was computed by :func:`ckpt_archive.verify`; they are printed with the report's own)."""
    verdict = getattr(report, "policy", None)
    if verdict is None or verdict.audit is None or getattr(out, "json_mode", False):
        return  # --json: the report carries the audit; nothing is printed, so no table (nor rich) is built
    out.table(audit_table(verdict.audit, _width(out)))
    _say_counters(verdict.audit, out)


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
    if policy == "session" and not _imposes(session_config):
        # refused before anything is compared or printed: no advice that --policy session cannot follow
        raise UsageError("--policy session needs --session-config with an lr (or weight_decay, momentum, eps, "
                         "betas, scheduler settings) to impose; --expect-lr only checks")
    state, manifest, _ = state_for_audit(repo, generation)
    packed_cfg = manifest.get("config") or None
    model = build_model(state, session_config=session_config, archived_config=packed_cfg)
    diffs = differences(model, expect_lr=expect_lr, policy=policy, state=state, archived_config=packed_cfg)
    for d in diffs:
        out.warn(d.message)
    section: dict = {"mode": policy, "differences": [d.to_json() for d in diffs], "changes": []}
    if policy == "checkpoint":
        return None, section
    if model.refused:
        raise UsageError(model.refused)
    if not model.changes:  # the archive already holds the session's values: restore it as packed (byte for byte)
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


def _imposes(session_config: Any) -> bool:
    """Whether a session config gives something ``--policy session`` can impose."""
    if session_config is None:
        return False
    sess = session_values(session_config)
    return any(k in sess for k in ("lr", *HYPER_NAMES, "betas", "scheduler"))


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


__all__ = ["audit_table", "audit_renderable", "cli_inspect", "cli_verify", "cli_restore_prepare", "cli_restore_finish"]
