"""The LR policy and counters of a checkpoint: what the next optimizer step will really use.

:func:`audit` -> :class:`PolicyAudit`: per param group ``lr``, ``initial_lr``, the scheduler's
``base_lrs`` and ``_last_lr``, the LR derived from the scheduler's closed form, and the LR the next step
will use; the counters (optimizer step, scheduler ``last_epoch``, progress step/epoch); findings.
Rendering (tables) lives in :mod:`ckpt_archive.cli.policy_views`; here are plain rows and lines.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from ckpt_archive.training.nextstep import STEPS, GroupSteps, pair_steps
from ckpt_archive.training.parts import find_parts, sub_checkpoints
from ckpt_archive.training.plan import PairPlan, plan_pairs
from ckpt_archive.training.schedulers import derive_lrs, nested_base_lrs, primary_base_lrs, scheduler_kind
from ckpt_archive.training.session_config import archived_values
from ckpt_archive.training.values import DERIVED_RTOL, as_float, as_number, fmt_pair, fmt_value, jsonable, nearly_equal


@dataclasses.dataclass
class Finding:
    """One observation about a state.

    Attributes:
        severity: ``"error"`` (the state cannot be resumed as saved: a non-finite LR, optimizer and
            scheduler from different optimizers), ``"warning"`` (a resume may be wrong or lossy) or
            ``"info"`` (a fact worth knowing that is not a problem, e.g. a finished schedule; or what could
            not be checked).
        field: path of the field in the state, e.g. ``"optimizer.param_groups[0].lr"``.
        message: one line saying what is wrong and what it costs.
    """

    severity: str
    field: str
    message: str

    def to_json(self) -> dict:
        """``{"severity", "field", "message"}``."""
        return {"severity": self.severity, "field": self.field, "message": self.message}

    def __str__(self) -> str:
        return f"{self.severity}: {self.field}: {self.message}"


@dataclasses.dataclass
class GroupPolicy:
    """The LR facts of one optimizer param group (all LRs are floats, in the optimizer's LR unit).

    Attributes:
        index: param group index.
        field: path of the group, e.g. ``"optimizer.param_groups[0]"``.
        n_params: number of parameters (tensors) in the group, or None when unknown.
        lr: the group's ``lr`` as archived (what the next ``optimizer.step()`` uses).
        initial_lr: the group's ``initial_lr`` (present once a scheduler was attached), else None.
        base_lr: the scheduler's ``base_lrs[index]``, else None.
        last_lr: the scheduler's ``_last_lr[index]``, else None.
        derived_lr: the scheduler's closed form at its ``last_epoch`` (None where not derivable).
        next_lr: the LR the next optimizer step will use (see the module docstring), or None.
        next_lr_basis: where ``next_lr`` comes from, in words.
        after_step_lr: the group's LR after the next ``scheduler.step()``, from real torch (the scheduler
            rebuilt from its state on a dummy optimizer, restored as a script does, and stepped); None where
            it raises, depends on what the session builds, or there is no scheduler.
        after_step_basis: how ``after_step_lr`` was obtained or why it is missing.
        hyper: other group hyperparameters (weight_decay, momentum, betas, eps) as archived.
        next_steps: the LR of each of the next optimizer steps (:data:`~ckpt_archive.training.nextstep.STEPS`),
            from the next-step model (:class:`~ckpt_archive.training.nextstep.GroupSteps`).
        next_steps_from: the same in words, with where each value comes from (``6e-05
            (optimizer.param_groups[0].lr), then 8e-07, 9.6e-07 (from scheduler.base_lrs[0])``).
        lr_set_by: who sets the ``lr`` the steps use: ``"scheduler"``, ``"state"`` (no scheduler: it stays) or
            ``"script"`` (no scheduler state; the config names a hand-written schedule the script runs).
    """

    index: int
    field: str
    n_params: int | None = None
    lr: float | None = None
    initial_lr: float | None = None
    base_lr: float | None = None
    last_lr: float | None = None
    derived_lr: float | None = None
    next_lr: float | None = None
    next_lr_basis: str = ""
    after_step_lr: float | None = None
    after_step_basis: str = ""
    hyper: dict = dataclasses.field(default_factory=dict)
    next_steps: list = dataclasses.field(default_factory=list)
    next_steps_from: str = ""
    lr_set_by: str = ""

    def to_json(self) -> dict:
        """The fields as strict JSON (non-finite floats as strings)."""
        d = dataclasses.asdict(self)
        return jsonable(d)


@dataclasses.dataclass
class Override:
    """A field of the checkpoint that overrides what the session built, and when it takes effect.

    Attributes:
        field: path in the state (``optimizer.param_groups[0].lr``, ``scheduler.base_lrs[0]``).
        archived: the archived value.
        session: the session's value where known (a session config was given), else None.
        when: ``"now"`` (the next ``optimizer.step()`` reads it), ``"at the next scheduler.step()"``, or
            ``"when a scheduler is built on this optimizer"`` (``initial_lr``).
    """

    field: str
    archived: Any
    session: Any
    when: str

    def to_json(self) -> dict:
        """The fields as strict JSON."""
        return jsonable(dataclasses.asdict(self))

    def __str__(self) -> str:
        sess = "" if self.session is None else f", session {fmt_value(self.session)}"
        return f"{self.field}: archived {fmt_value(self.archived)}{sess}; takes effect {self.when}"


@dataclasses.dataclass
class PolicyAudit:
    """Result of :func:`audit`.

    Attributes:
        parts: part name (``model``, ``optimizer``, ``scheduler``, ``scaler``, ``rng``, ``data``,
            ``progress``) -> path in the state where it was found (absent parts are not listed).
        groups: one :class:`GroupPolicy` per param group of the (first) optimizer.
        scheduler: ``kind`` (e.g. ``"CosineAnnealingLR"``, ``"unknown"``, ``None`` when absent),
            ``field``, ``last_epoch``, ``derivable`` (bool) and ``note``.
        counters: ``optimizer_step`` (int|None, Adam-like ``state[*]["step"]``, the max over parameters),
            ``optimizer_step_min``, ``scheduler_last_epoch``, ``progress_step``, ``progress_epoch``.
        findings: list of :class:`Finding`.
        overrides: every archived field that overrides the session (:class:`Override`), for every
            optimizer/scheduler pair.
        schedulers: the ``scheduler`` dict of every pair (``scheduler`` is the first's).
        notes: lines about what was audited (``audited the newest of 2 sub-checkpoints: ...``).
    """

    parts: dict
    groups: list[GroupPolicy]
    scheduler: dict
    counters: dict
    findings: list[Finding]
    overrides: list[Override] = dataclasses.field(default_factory=list)
    schedulers: list[dict] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def next_lrs(self) -> list[float | None]:
        """The LR the next optimizer step uses, per param group."""
        return [g.next_lr for g in self.groups]

    def to_json(self) -> dict:
        """Strict JSON (RFC 8259): non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
        return jsonable({
            "parts": dict(self.parts),
            "groups": [g.to_json() for g in self.groups],
            "scheduler": dict(self.scheduler),
            "counters": dict(self.counters),
            "findings": [f.to_json() for f in self.findings],
            "overrides": [o.to_json() for o in self.overrides],
            "schedulers": [dict(x) for x in self.schedulers],
            "notes": list(self.notes),
        })

    def rows(self) -> list[dict]:
        """One row per param group, values formatted for a table (strings, ``"-"`` where absent)."""
        out = []
        several = len({g.field.rsplit(".param_groups", 1)[0] for g in self.groups}) > 1
        for g in self.groups:
            out.append({
                "group": g.field.replace(".param_groups", "") if several else str(g.index),
                "params": "-" if g.n_params is None else str(g.n_params),
                "lr": fmt_value(g.lr),
                "initial_lr": fmt_value(g.initial_lr),
                "base_lr": fmt_value(g.base_lr),
                "last_lr": fmt_value(g.last_lr),
                "derived_lr": fmt_value(g.derived_lr),
                "next_lr": fmt_value(g.next_lr),
                "after_sched_step": fmt_value(g.after_step_lr),
            })
        return out

    def counter_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` of the counters, values formatted (``"-"`` where absent)."""
        names = [("optimizer step", "optimizer_step"), ("scheduler last_epoch", "scheduler_last_epoch"),
                 ("progress step", "progress_step"), ("progress epoch", "progress_epoch")]
        return [(label, fmt_value(self.counters.get(key))) for label, key in names]

    def lines(self) -> list[str]:
        """Plain text lines (a fixed-width table, counters, findings) for logs and non-rich output."""
        rows = self.rows()
        out = [f"LR policy (scheduler: {self.scheduler.get('kind') or 'none'})"]
        if rows:
            cols = list(rows[0])
            widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
            out.append("  ".join(c.rjust(widths[c]) for c in cols))
            for r in rows:
                out.append("  ".join(r[c].rjust(widths[c]) for c in cols))
        out.append("counters: " + ", ".join(f"{k} {v}" for k, v in self.counter_rows()))
        out.extend(self.notes)
        out.extend(f"overrides the session: {o}" for o in self.overrides)
        out.extend(str(f) for f in self.findings)
        return out


def _optimizer_steps(opt_sd: dict) -> list[int]:
    """The finite per-parameter ``step`` counters of an optimizer state_dict."""
    steps = []
    st = opt_sd.get("state")
    if isinstance(st, dict):
        for v in st.values():
            if isinstance(v, dict) and "step" in v:
                n = as_number(v["step"])
                if n is not None and math.isfinite(n):
                    steps.append(int(n))
    return steps


def _position_words(counters: dict) -> str:
    """``at epoch 45`` / ``at step 6000`` / ``at the archived position``."""
    if counters.get("progress_epoch") is not None:
        return f"at epoch {counters['progress_epoch']}"
    for key in ("progress_step", "optimizer_step"):
        if counters.get(key) is not None:
            return f"at step {counters[key]}"
    return "at the archived position"


def counters_finding(field: str, opt_step: int, progress_step: int) -> Finding:
    """The finding for an optimizer step counter that differs from the progress step.

    The progress step's convention is the number of optimizer updates completed (what Adam's
    ``state["step"]`` counts, and what ``Checkpointer.save(step=)`` records; docs/checkpointer.md). One
    less is the 0-based index of the last update, a common way to pass it: an info finding. Otherwise the
    difference is named and explained by its sign.
    """
    what = (f"optimizer step {opt_step} vs progress step {progress_step} (optimizer step: the updates the "
            f"optimizer completed, its state['step']; progress step: the step saved with the state)")
    if opt_step == progress_step + 1:
        return Finding("info", field, f"{what}: progress is one behind, as when the step saved is the 0-based "
                                      f"index of the last update rather than the number of updates completed "
                                      f"(the convention: docs/checkpointer.md); consistent with that")
    if opt_step < progress_step:
        return Finding("warning", field, f"counters disagree: {what}: the optimizer completed "
                                         f"{progress_step - opt_step} fewer updates than progress counts; "
                                         f"AMP-skipped steps (GradScaler skips optimizer.step() on inf/NaN "
                                         f"gradients) or gradient accumulation (progress counting micro-batches) "
                                         f"explain that; otherwise the optimizer state is older than the "
                                         f"progress counter (the parts were saved at different instants)")
    return Finding("warning", field, f"counters disagree: {what}: the optimizer completed "
                                     f"{opt_step - progress_step} more updates than progress counts; the optimizer "
                                     f"state is newer than the progress counter (the parts were saved at different "
                                     f"instants), or progress counts something else (epochs, another optimizer)")


def missing_scheduler_message(counters: dict) -> str:
    """The finding for a scheduler state that is missing although ``initial_lr`` shows one was attached."""
    return (f"scheduler state missing: the LR {_position_words(counters)} cannot be rebuilt from counters "
            f"(the optimizer's param groups carry initial_lr, so a scheduler was attached; a rebuilt "
            f"scheduler restarts its schedule)")


def _audit_pair(p: PairPlan, steps: list[GroupSteps], findings: list[Finding],
                overrides: list[Override]) -> tuple[list[GroupPolicy], dict]:
    """Groups of one optimizer (and its scheduler): LR facts from the next-step model, what overrides the
    session, findings."""
    sch = p.sch if isinstance(p.sch, dict) else None
    if isinstance(p.opt, dict) and p.opt.get("param_groups") is not None \
            and not isinstance(p.opt.get("param_groups"), (list, tuple)):
        findings.append(Finding("error", f"{p.opt_field}.param_groups", "param_groups is not a list"))
    sched_info, derived = _scheduler_info(p)
    if sch is not None:
        findings.extend(_scheduler_findings(p, sched_info, steps))
    bases = primary_base_lrs(sch) if sch is not None else []  # SequentialLR/ChainedScheduler: the sub-scheduler's
    last = list(sch.get("_last_lr") or []) if sch is not None else []
    groups = []
    for i in range(max(len(p.groups), len(last), len(bases))):
        g = p.groups[i] if i < len(p.groups) else None
        gp = _group_policy(p, i, g, steps[i] if i < len(steps) else None, sched_info)
        gp.base_lr = as_float(bases[i]) if i < len(bases) else None
        gp.last_lr = as_float(last[i]) if i < len(last) else None
        gp.derived_lr = derived[i] if derived is not None and i < len(derived) else None
        groups.append(gp)
        if g is not None:
            findings.extend(_group_findings(p, i, g, gp, sched_info))
            overrides.extend(_group_overrides(p, i, g, gp, steps[i] if i < len(steps) else None))
    if sch is not None and not p.groups:
        overrides.extend(_scheduler_only_overrides(p, steps))
    return groups, sched_info


def _scheduler_info(p: PairPlan) -> tuple[dict, list[float] | None]:
    """``{kind, field, last_epoch, derivable, note}`` of the pair's scheduler, and its closed-form LRs."""
    info: dict = {"kind": None, "field": None, "last_epoch": None, "derivable": False, "note": ""}
    if not isinstance(p.sch, dict):
        return info, None
    kind, derived, note = derive_lrs(p.sch, p.groups or None)
    info.update(kind=kind, field=p.sch_field, last_epoch=as_number(p.sch.get("last_epoch")),
                derivable=derived is not None, note=note)
    return info, derived


def _group_policy(p: PairPlan, i: int, g: dict | None, gs: GroupSteps | None, sched_info: dict) -> GroupPolicy:
    """One row of the audit: the group's fields as archived and its next steps from the model."""
    gp = GroupPolicy(index=i, field=p.group_field(i) if g is not None or p.groups else f"{p.sch_field}[{i}]")
    if g is not None:
        params = g.get("params")
        gp.n_params = len(params) if isinstance(params, (list, tuple)) else None
        gp.lr, gp.initial_lr = as_float(g.get("lr")), as_float(g.get("initial_lr"))
        for h in ("weight_decay", "momentum", "betas", "eps", "max_lr", "min_lr"):
            if h in g:
                v = g[h]
                gp.hyper[h] = [as_float(x) for x in v] if isinstance(v, (list, tuple)) else as_number(v)
    if gp.lr is not None:
        gp.next_lr = gp.lr
        gp.next_lr_basis = "optimizer group lr (load_state_dict restores it; optimizer.step() reads it)"
    elif not p.groups:
        gp.next_lr_basis = ("the session's LR: the checkpoint holds no optimizer state (the scheduler's "
                            "_last_lr is not written into any group by load_state_dict)")
    if gs is not None:
        gp.next_steps, gp.next_steps_from, gp.lr_set_by = list(gs.checkpoint), gs.describe(), gs.lr_set_by
        if sched_info["kind"] is not None:
            gp.after_step_lr, gp.after_step_basis = gs.after_step, gs.basis
            if gs.raises:
                gp.after_step_basis = f"the next scheduler.step() raises {gs.raises}"
        elif gs.lr_set_by == "script":
            gp.next_lr, gp.next_lr_basis = None, gs.basis
    return gp


def _scheduler_findings(p: PairPlan, info: dict, steps: list[GroupSteps]) -> list[Finding]:
    """A scheduler of another optimizer (group counts differ); a finished schedule (info); a scheduler without
    optimizer state, whose ``base_lrs`` take over after the session's LR ran one step (warning)."""
    sch, out = p.sch, []
    last, bases = list(sch.get("_last_lr") or []), primary_base_lrs(sch)
    n_sched = len(last) or len(bases)
    if p.groups and n_sched and n_sched != len(p.groups):
        return [Finding("error", f"{p.sch_field}._last_lr",
                        f"the scheduler has {n_sched} param group(s), the optimizer {len(p.groups)}: they do not "
                        f"come from the same optimizer")]
    raises = next((gs.raises for gs in steps if gs.raises), None)
    if raises and p.groups:
        le = info["last_epoch"]
        out.append(Finding(
            "info", f"{p.sch_field}.last_epoch",
            f"the schedule is finished ({info['kind']} at last_epoch {int(le) if le is not None else '?'}"
            + (f" of total_steps {int(as_number(sch['total_steps']))}" if "total_steps" in sch else "")
            + f"): the state resumes as saved, but the next scheduler.step() raises {raises}; "
            f"to train on, build a new schedule (not a problem for a final checkpoint)"))
    if not p.groups and p.opt is None:
        out.append(_scheduler_only_finding(p, info, steps, bases))
    return out


def _scheduler_only_finding(p: PairPlan, info: dict, steps: list[GroupSteps], bases: list) -> Finding:
    shown = ", ".join(fmt_value(as_float(b)) for b in bases) or "-"
    after = [gs.after_step for gs in steps]
    basis = steps[0].basis if steps else ""
    if steps and steps[0].session_independent and None not in after:
        then = f"the next scheduler.step() sets the LR to {', '.join(fmt_value(x) for x in after)} whatever the session's LR"
    elif steps and steps[0].session_independent is False:
        then = (f"the next scheduler.step() continues the archived schedule (depends on the LR the session builds "
                f"its optimizer with: the {info['kind']} step multiplies the group's current lr)")
    else:
        then = f"the next scheduler.step() continues the archived schedule ({basis})"
    return Finding("warning", f"{p.sch_field}.base_lrs",
                   f"no optimizer state: the next optimizer step runs at the session's LR, then {p.sch_field}.base_lrs "
                   f"[{shown}] (archived) override it: {then}; --policy session rewrites base_lrs to the session's")


def _group_findings(p: PairPlan, i: int, g: dict, gp: GroupPolicy, info: dict) -> list[Finding]:
    """A non-numeric or non-finite ``lr`` (error); ``lr`` against the scheduler's ``_last_lr``, ``_last_lr``
    against the closed form, ``initial_lr`` against ``base_lrs`` (warnings)."""
    gfield, out = gp.field, []
    if g.get("lr") is not None and gp.lr is None:
        out.append(Finding("error", f"{gfield}.lr", f"lr is not a number: {g.get('lr')!r}"))
    elif gp.lr is not None and not math.isfinite(gp.lr):
        out.append(Finding("error", f"{gfield}.lr", f"lr is {gp.lr}: every update will be non-finite"))
    if gp.lr is not None and gp.last_lr is not None and not nearly_equal(gp.lr, gp.last_lr):
        a, b = fmt_pair(gp.lr, gp.last_lr)
        out.append(Finding(
            "warning", f"{gfield}.lr",
            f"optimizer lr {a} != scheduler last LR {b} ({p.sch_field}._last_lr[{i}]): the optimizer state "
            f"was loaded before its scheduler was built (the scheduler's constructor rewrote lr), or the "
            f"policy was overridden; the next step uses {a}"))
    if gp.derived_lr is not None:
        ref = gp.last_lr if gp.last_lr is not None else gp.lr
        ref_field = f"{p.sch_field}._last_lr[{i}]" if gp.last_lr is not None else f"{gfield}.lr"
        if ref is not None and not nearly_equal(ref, gp.derived_lr, DERIVED_RTOL):
            a, b = fmt_pair(ref, gp.derived_lr)
            out.append(Finding("warning", ref_field,
                               f"{a} differs from {info['kind']} at last_epoch {info['last_epoch']} "
                               f"({b}, from base_lrs): the LR was changed by hand or the scheduler state was edited"))
    if gp.initial_lr is not None and gp.base_lr is not None and not nearly_equal(gp.initial_lr, gp.base_lr):
        a, b = fmt_pair(gp.initial_lr, gp.base_lr)
        out.append(Finding("warning", f"{gfield}.initial_lr",
                           f"initial_lr {a} != scheduler base_lrs[{i}] {b}: the optimizer and scheduler "
                           f"states come from different configurations"))
    return out


def _when(field: str, gs: GroupSteps | None, otherwise: str) -> str:
    """When an archived LR field takes effect, from the model: at the next ``scheduler.step()`` where real torch
    shows it drives the steps after the next one, else ``otherwise``."""
    if gs is not None and field in gs.later_from:
        return "at the next scheduler.step()"
    return otherwise


def _group_overrides(p: PairPlan, i: int, g: dict, gp: GroupPolicy, gs: GroupSteps | None) -> list[Override]:
    """The archived fields of one optimizer group (and its scheduler) that override the session's."""
    gfield, out = gp.field, []
    if gp.lr is not None:
        out.append(Override(f"{gfield}.lr", gp.lr, None, "now" if gp.lr_set_by != "script" else
                            "never: the training script sets lr before every step"))
    for key in ("initial_lr", "max_lr", "min_lr"):
        if as_float(g.get(key)) is not None:
            out.append(Override(f"{gfield}.{key}", as_float(g[key]), None,
                                _when(f"{gfield}.{key}", gs, "when a scheduler is built on this optimizer")))
    if isinstance(p.sch, dict) and gp.base_lr is not None:
        field = f"{p.sch_field}.base_lrs[{i}]"
        out.append(Override(field, gp.base_lr, None, _when(
            field, gs, f"at a later scheduler.step() (torch's scheduler arithmetic: {scheduler_kind(p.sch)} computes the next {STEPS} "
                       f"steps from the group's current lr)")))
    return out


def _scheduler_only_overrides(p: PairPlan, steps: list[GroupSteps]) -> list[Override]:
    """A scheduler without optimizer state: every ``base_lrs`` it restores (also SequentialLR sub-schedulers')."""
    return [Override(f"{bfield}.base_lrs[{i}]", as_float(b), None, "at the next scheduler.step()")
            for bfield, bs in nested_base_lrs(p.sch, p.sch_field) for i, b in enumerate(bs)]


def audit(state: Any, *, config: dict | str | Path | None = None, progress: dict | None = None,
          keys: dict | None = None) -> PolicyAudit:
    """Audit the LR policy and counters of a checkpoint.

    Args:
        state: nested checkpoint dict (``torch.load(weights_only=True)`` or :func:`ckpt_archive.load`).
            Parts are found under conventional keys (see :data:`ALIASES`) or by shape.
        config: the run's own config (dict or path of JSON/YAML/TOML; default: the copy inside the state):
            whether the script schedules the LR itself (a hand-written schedule, no scheduler state).
        progress: ``{"step": int, "epoch": int}`` from the manifest, overriding what the state holds.
        keys: part -> path overrides, as in :func:`find_parts`.

    Returns:
        :class:`PolicyAudit`. The LR the next step will use (``next_lr``) is the archived optimizer
        group's ``lr`` (``Optimizer.load_state_dict`` restores it, ``LRScheduler.load_state_dict`` never
        writes a group, and ``optimizer.step()`` reads ``group["lr"]``); without optimizer state it is the
        session's (None here); where the script sets the LR every step, None. ``next_steps`` /
        ``after_step_lr`` / ``next_steps_from`` come from the next-step model
        (:mod:`~ckpt_archive.training.nextstep`: real torch, with the fields each step comes from). Findings:

        * warning ``optimizer.param_groups[i].lr``: the group's lr differs from the scheduler's
          ``_last_lr`` (the optimizer was loaded before its scheduler was built, or the policy was
          overridden): the next step uses the optimizer's value;
        * warning ``scheduler._last_lr[i]``: ``_last_lr`` differs from the closed-form value;
        * warning ``scheduler.last_epoch``: the scheduler lags (or leads) the progress counters;
        * warning ``optimizer.state``: progress step and optimizer step disagree (info when progress is
          exactly one behind: a 0-based step; see :func:`counters_finding`), or per-parameter step
          counters differ;
        * warning ``scheduler``: scheduler state missing although ``initial_lr`` shows one was attached;
        * warning ``scheduler.base_lrs``: no optimizer state, so the archived base_lrs take over after the
          session's LR ran one step;
        * info ``scheduler.last_epoch``: a finished schedule (the next ``scheduler.step()`` raises);
        * error: non-finite or non-numeric lr, a scheduler with a different number of groups than the
          optimizer.

    Raises:
        UsageError: a ``keys`` path does not exist.

    Example:
        >>> a = audit({"optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}})
        >>> a.next_lrs
        [0.1]
    """
    parts = find_parts(state, keys)
    plans = plan_pairs(state, None, keys=keys, archived=archived_values(state, config))
    counters = _counters(parts, progress)
    findings: list[Finding] = []
    groups: list[GroupPolicy] = []
    overrides: list[Override] = []
    schedulers: list[dict] = []
    # every optimizer with its scheduler (paired by position: optimizer_1.bin with scheduler_1.bin), and
    # schedulers without an optimizer (scripts that save only the scheduler)
    for p in plans:
        g_n, info_n = _audit_pair(p, pair_steps(p), findings, overrides)
        groups.extend(g_n)
        schedulers.append(info_n)
    sched_info = schedulers[0] if schedulers else {"kind": None, "field": None, "last_epoch": None,
                                                   "derivable": False, "note": ""}
    le0 = sched_info.get("last_epoch")
    counters["scheduler_last_epoch"] = None if le0 is None else int(le0)
    first = plans[0] if plans else None
    findings.extend(_counter_findings(counters, first, sched_info))
    if first is not None and first.sch is None and any("initial_lr" in g for g in first.groups):
        findings.append(Finding("warning", "scheduler", missing_scheduler_message(counters)))
        sched_info["note"] = "missing (initial_lr present in param groups)"
    part_paths = {name: str(v[0][0]) or "(top level)" for name, v in parts.items() if v}
    return PolicyAudit(parts=part_paths, groups=groups, scheduler=sched_info, counters=counters,
                       findings=findings, overrides=overrides, schedulers=schedulers,
                       notes=_notes(state, parts, keys))


def _counters(parts: dict, progress: dict | None) -> dict:
    """The optimizer's step counters (max and min over parameters) and the progress step and epoch (the
    manifest's ``progress`` over what the state holds)."""
    prog = dict(parts["progress"][0][1]) if parts.get("progress") else {"step": None, "epoch": None}
    for k in ("step", "epoch"):
        if (progress or {}).get(k) is not None:
            prog[k] = int(progress[k])
    opts = parts.get("optimizer", [])
    steps = _optimizer_steps(opts[0][1]) if opts and isinstance(opts[0][1], dict) else []
    return {"optimizer_step": max(steps) if steps else None, "optimizer_step_min": min(steps) if steps else None,
            "scheduler_last_epoch": None, "progress_step": prog.get("step"), "progress_epoch": prog.get("epoch")}


def _counter_findings(counters: dict, first: PairPlan | None, sched_info: dict) -> list[Finding]:
    """Per-parameter step counters that differ; optimizer and progress steps that disagree; a scheduler that
    lags or leads every progress counter."""
    out: list[Finding] = []
    opt_field = first.opt_field if first is not None else "optimizer"
    os_, lo = counters["optimizer_step"], counters["optimizer_step_min"]
    ps, pe = counters["progress_step"], counters["progress_epoch"]
    if os_ is not None and lo != os_:
        out.append(Finding("warning", f"{opt_field}.state",
                           f"per-parameter step counters differ (min {lo}, max {os_}): parameters were added to the "
                           f"optimizer later (unfrozen), or the state was merged from different runs"))
    if ps is not None and os_ is not None and ps != os_:
        out.append(counters_finding(f"{opt_field}.state", os_, ps))
    le = counters["scheduler_last_epoch"]
    if le is None or sched_info["kind"] == "ReduceLROnPlateau":
        return out
    cands = {k: v for k, v in (("progress step", ps), ("optimizer step", os_), ("progress epoch", pe)) if v is not None}
    # A per-epoch scheduler stepped at the end of epoch E, saved with ``epoch: E`` (the common
    # ``for epoch in ...: train; scheduler.step(); save(epoch=epoch)``, and Lightning on an epoch's
    # last batch) has last_epoch E + 1: in step with progress, not ahead of it.
    accepted = set(cands.values()) | ({pe + 1} if pe is not None else set())
    if cands and le not in accepted:
        name, val = min(cands.items(), key=lambda kv: abs(kv[1] - le))
        what = "lags" if le < val else "is ahead of"
        out.append(Finding("warning", f"{first.sch_field if first else 'scheduler'}.last_epoch",
                           f"scheduler {what} progress: last_epoch {le} vs {name} {val} (a missed or extra "
                           f"scheduler.step(), or scheduler state from another save): the LR schedule "
                           f"is shifted by {abs(val - le)}"))
    return out


def _notes(state: Any, parts: dict, keys: dict | None) -> list[str]:
    """What was audited: the newest of several sub-checkpoints; how several optimizers and schedulers were paired."""
    opt_entries, sch_entries = parts.get("optimizer", []), parts.get("scheduler", [])
    notes = []
    subs = sub_checkpoints(state)
    if subs and not keys:
        where = opt_entries[0][0] if opt_entries else (sch_entries[0][0] if sch_entries else ())
        newest = str(where[0]) if len(where) else "?"
        notes.append(f"{len(subs)} sub-checkpoints ({', '.join(subs)}): audited the newest, {newest}")
    if len(opt_entries) > 1 or len(sch_entries) > 1:
        notes.append(f"{len(opt_entries)} optimizer(s) and {len(sch_entries)} scheduler(s), paired in order: "
                     + "; ".join(f"{str(opt_entries[i][0]) if i < len(opt_entries) else '-'} with "
                                 f"{str(sch_entries[i][0]) if i < len(sch_entries) else '-'}"
                                 for i in range(max(len(opt_entries), len(sch_entries)))))
    return notes


__all__ = ["Finding", "GroupPolicy", "Override", "PolicyAudit", "counters_finding", "missing_scheduler_message", "audit"]
