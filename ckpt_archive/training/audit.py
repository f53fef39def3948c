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

from ckpt_archive.training.parts import find_parts, sub_checkpoints
from ckpt_archive.training.schedulers import derive_lrs, nested_base_lrs, primary_base_lrs
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


def _audit_pair(opt_field: str, opt: Any, sch_field: str, sch: Any, findings: list[Finding],
                overrides: list[Override]) -> tuple[list[GroupPolicy], dict, list]:
    """Groups of one optimizer (and its scheduler): LR facts, what overrides the session, findings."""
    from ckpt_archive.training.simulate import depends_on_session, simulate

    sched_info: dict = {"kind": None, "field": None, "last_epoch": None, "derivable": False, "note": ""}
    groups_sd = opt.get("param_groups") if isinstance(opt, dict) else None
    if groups_sd is not None and not isinstance(groups_sd, (list, tuple)):
        findings.append(Finding("error", f"{opt_field}.param_groups", "param_groups is not a list"))
        groups_sd = None
    groups_sd = list(groups_sd or [])
    dict_groups = [g for g in groups_sd if isinstance(g, dict)]

    derived: list[float] | None = None
    bases: list = []
    last: list = []
    after: list | None = None
    after_basis = ""
    if isinstance(sch, dict):
        kind, derived, note = derive_lrs(sch, dict_groups or None)
        le = as_number(sch.get("last_epoch"))
        sched_info.update(kind=kind, field=sch_field, last_epoch=le, derivable=derived is not None, note=note)
        bases = primary_base_lrs(sch)  # SequentialLR/ChainedScheduler: the sub-scheduler's
        last = list(sch.get("_last_lr") or [])
        n_sched = len(last) or len(bases)
        mismatch = bool(groups_sd and n_sched and n_sched != len(groups_sd))
        if mismatch:
            findings.append(Finding("error", f"{sch_field}._last_lr",
                                    f"the scheduler has {n_sched} param group(s), the optimizer "
                                    f"{len(groups_sd)}: they do not come from the same optimizer"))
        elif dict_groups:
            sim = simulate(sch, archived_groups=dict_groups)
            after, after_basis = sim.after_step, sim.note or "real torch: the scheduler rebuilt from its state and stepped"
            if sim.raises:
                after_basis = f"the next scheduler.step() raises {sim.raises}"
                findings.append(Finding(
                    "info", f"{sch_field}.last_epoch",
                    f"the schedule is finished ({kind} at last_epoch {int(le) if le is not None else '?'}"
                    + (f" of total_steps {int(as_number(sch['total_steps']))}" if "total_steps" in sch else "")
                    + f"): the state resumes as saved, but the next scheduler.step() raises {sim.raises}; "
                    f"to train on, build a new schedule (not a problem for a final checkpoint)"))
        elif not groups_sd:
            n = n_sched or 1
            after, depends, raises = depends_on_session(sch, n)
            if raises:
                after_basis = f"the next scheduler.step() raises {raises}"
            elif depends:
                after, after_basis = None, ("depends on the LR the session builds its optimizer with (the "
                                            f"{kind} step multiplies the group's current lr)")
            else:
                after_basis = "real torch: from the archived base_lrs, whatever the session's LR"
            shown = ", ".join(fmt_value(as_float(b)) for b in bases) or "-"
            then = (f"the next scheduler.step() sets the LR to {', '.join(fmt_value(x) for x in after)} "
                    f"whatever the session's LR" if after is not None else
                    f"the next scheduler.step() continues the archived schedule ({after_basis})")
            findings.append(Finding(
                "warning", f"{sch_field}.base_lrs",
                f"no optimizer state: the next optimizer step runs at the session's LR, then {sch_field}.base_lrs "
                f"[{shown}] (archived) override it: {then}; --policy session rewrites base_lrs to the session's"))
            for bfield, bs in nested_base_lrs(sch, sch_field):  # also SequentialLR sub-schedulers'
                for i, b in enumerate(bs):
                    overrides.append(Override(f"{bfield}.base_lrs[{i}]", as_float(b), None,
                                              "at the next scheduler.step()"))

    groups: list[GroupPolicy] = []
    n = max(len(groups_sd), len(last), len(bases))
    for i in range(n):
        g = groups_sd[i] if i < len(groups_sd) and isinstance(groups_sd[i], dict) else None
        gfield = f"{opt_field}.param_groups[{i}]" if g is not None or groups_sd else f"{sch_field}[{i}]"
        gp = GroupPolicy(index=i, field=gfield)
        if g is not None:
            params = g.get("params")
            gp.n_params = len(params) if isinstance(params, (list, tuple)) else None
            raw_lr = g.get("lr")
            gp.lr = as_float(raw_lr)
            if raw_lr is not None and gp.lr is None:
                findings.append(Finding("error", f"{gfield}.lr", f"lr is not a number: {raw_lr!r}"))
            elif gp.lr is not None and not math.isfinite(gp.lr):
                findings.append(Finding("error", f"{gfield}.lr", f"lr is {gp.lr}: every update will be non-finite"))
            gp.initial_lr = as_float(g.get("initial_lr"))
            for h in ("weight_decay", "momentum", "betas", "eps", "max_lr", "min_lr"):
                if h in g:
                    v = g[h]
                    gp.hyper[h] = [as_float(x) for x in v] if isinstance(v, (list, tuple)) else as_number(v)
        gp.base_lr = as_float(bases[i]) if i < len(bases) else None
        gp.last_lr = as_float(last[i]) if i < len(last) else None
        gp.derived_lr = derived[i] if derived is not None and i < len(derived) else None
        if gp.lr is not None:
            gp.next_lr = gp.lr
            gp.next_lr_basis = "optimizer group lr (load_state_dict restores it; optimizer.step() reads it)"
        elif not groups_sd:
            gp.next_lr_basis = ("the session's LR: the checkpoint holds no optimizer state (the scheduler's "
                                "_last_lr is not written into any group by load_state_dict)")
        if after is not None and i < len(after):
            gp.after_step_lr = after[i]
        gp.after_step_basis = after_basis
        groups.append(gp)
        if g is not None:
            _group_overrides(g, gfield, sched_info["kind"], sch_field if isinstance(sch, dict) else None,
                             gp, i, overrides)

        # -- consistency --------------------------------------------------------------------------
        if gp.lr is not None and gp.last_lr is not None and not nearly_equal(gp.lr, gp.last_lr):
            a, b = fmt_pair(gp.lr, gp.last_lr)
            findings.append(Finding(
                "warning", f"{gfield}.lr",
                f"optimizer lr {a} != scheduler last LR {b} ({sch_field}._last_lr[{i}]): the optimizer state "
                f"was loaded before its scheduler was built (the scheduler's constructor rewrote lr), or the "
                f"policy was overridden; the next step uses {a}"))
        if gp.derived_lr is not None:
            ref = gp.last_lr if gp.last_lr is not None else gp.lr
            ref_field = f"{sch_field}._last_lr[{i}]" if gp.last_lr is not None else f"{gfield}.lr"
            if ref is not None and not nearly_equal(ref, gp.derived_lr, DERIVED_RTOL):
                a, b = fmt_pair(ref, gp.derived_lr)
                findings.append(Finding(
                    "warning", ref_field,
                    f"{a} differs from {sched_info['kind']} at last_epoch {sched_info['last_epoch']} "
                    f"({b}, from base_lrs): the LR was changed by hand or the scheduler state was edited"))
        if gp.initial_lr is not None and gp.base_lr is not None and not nearly_equal(gp.initial_lr, gp.base_lr):
            a, b = fmt_pair(gp.initial_lr, gp.base_lr)
            findings.append(Finding("warning", f"{gfield}.initial_lr",
                                    f"initial_lr {a} != scheduler base_lrs[{i}] {b}: the optimizer and scheduler "
                                    f"states come from different configurations"))

    return groups, sched_info, groups_sd


def _group_overrides(g: dict, gfield: str, kind: str | None, sch_field: str | None, gp: GroupPolicy, i: int,
                     overrides: list[Override]) -> None:
    """The archived fields of one optimizer group (and its scheduler) that override the session's."""
    one_cycle = kind == "OneCycleLR"
    if gp.lr is not None:
        overrides.append(Override(f"{gfield}.lr", gp.lr, None, "now"))
    if gp.initial_lr is not None:
        overrides.append(Override(f"{gfield}.initial_lr", gp.initial_lr, None,
                                  "at the next scheduler.step()" if one_cycle
                                  else "when a scheduler is built on this optimizer"))
    for key in ("max_lr", "min_lr"):
        if as_float(g.get(key)) is not None:
            overrides.append(Override(f"{gfield}.{key}", as_float(g[key]), None,
                                      "at the next scheduler.step()" if one_cycle
                                      else "when a scheduler is built on this optimizer"))
    if sch_field is not None and gp.base_lr is not None:
        overrides.append(Override(f"{sch_field}.base_lrs[{i}]", gp.base_lr, None, "at the next scheduler.step()"))


def audit(state: Any, *, config: dict | str | Path | None = None, progress: dict | None = None,
          keys: dict | None = None) -> PolicyAudit:
    """Audit the LR policy and counters of a checkpoint.

    Args:
        state: nested checkpoint dict (``torch.load(weights_only=True)`` or :func:`ckpt_archive.load`).
            Parts are found under conventional keys (see :data:`ALIASES`) or by shape.
        config: the experiment's config (dict or path of JSON/YAML/TOML); not needed for the audit
            itself, accepted so callers can pass one object to audit and lint.
        progress: ``{"step": int, "epoch": int}`` from the manifest, overriding what the state holds.
        keys: part -> path overrides, as in :func:`find_parts`.

    Returns:
        :class:`PolicyAudit`. The LR the next step will use (``next_lr``) is the archived optimizer
        group's ``lr`` (``Optimizer.load_state_dict`` restores it, ``LRScheduler.load_state_dict`` never
        writes a group, and ``optimizer.step()`` reads ``group["lr"]``); without an optimizer it is the
        scheduler's ``_last_lr``. Findings:

        * warning ``optimizer.param_groups[i].lr``: the group's lr differs from the scheduler's
          ``_last_lr`` (the optimizer was loaded before its scheduler was built, or the policy was
          overridden): the next step uses the optimizer's value;
        * warning ``scheduler._last_lr[i]``: ``_last_lr`` differs from the closed-form value;
        * warning ``scheduler.last_epoch``: the scheduler lags (or leads) the progress counters;
        * warning ``optimizer.state``: progress step and optimizer step disagree (info when progress is
          exactly one behind: a 0-based step; see :func:`counters_finding`), or per-parameter step
          counters differ;
        * warning ``scheduler``: scheduler state missing although ``initial_lr`` shows one was attached;
        * error: non-finite or non-numeric lr, a scheduler with a different number of groups than the
          optimizer, a OneCycleLR whose next step raises (``last_epoch >= total_steps``).

    Raises:
        UsageError: a ``keys`` path does not exist.

    Example:
        >>> a = audit({"optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}})
        >>> a.next_lrs
        [0.1]
    """
    parts = find_parts(state, keys)
    findings: list[Finding] = []
    opt_entries = parts.get("optimizer", [])
    sch_entries = parts.get("scheduler", [])
    opt_path, opt = opt_entries[0] if opt_entries else ("", None)
    sch_path, sch = sch_entries[0] if sch_entries else ("", None)
    opt_field = str(opt_path) or "optimizer"
    sch_field = str(sch_path) or "scheduler"

    prog = dict(parts["progress"][0][1]) if parts.get("progress") else {"step": None, "epoch": None}
    if progress:
        for k in ("step", "epoch"):
            if progress.get(k) is not None:
                prog[k] = int(progress[k])

    steps = _optimizer_steps(opt) if isinstance(opt, dict) else []
    counters = {
        "optimizer_step": max(steps) if steps else None,
        "optimizer_step_min": min(steps) if steps else None,
        "scheduler_last_epoch": None,
        "progress_step": prog.get("step"),
        "progress_epoch": prog.get("epoch"),
    }

    sched_info: dict = {"kind": None, "field": None, "last_epoch": None, "derivable": False, "note": ""}
    groups: list[GroupPolicy] = []
    groups_sd: list = []
    overrides: list[Override] = []
    schedulers: list[dict] = []
    # every optimizer with its scheduler (paired by position: optimizer_1.bin with scheduler_1.bin), and
    # schedulers without an optimizer (scripts that save only the scheduler)
    for n in range(max(len(opt_entries), len(sch_entries), 1)):
        o_path, o = opt_entries[n] if n < len(opt_entries) else ("", None)
        s_path, s = sch_entries[n] if n < len(sch_entries) else ("", None)
        if o is None and s is None:
            break
        g_n, info_n, gsd_n = _audit_pair(str(o_path) or "optimizer", o, str(s_path) or "scheduler", s,
                                         findings, overrides)
        groups.extend(g_n)
        schedulers.append(info_n)
        if n == 0:
            sched_info, groups_sd = info_n, gsd_n
    le0 = sched_info.get("last_epoch")
    counters["scheduler_last_epoch"] = None if le0 is None else int(le0)

    # -- counters --------------------------------------------------------------------------------------
    if steps and min(steps) != max(steps):
        findings.append(Finding("warning", f"{opt_field}.state",
                                f"per-parameter step counters differ (min {min(steps)}, max {max(steps)}): "
                                f"parameters were added to the optimizer later (unfrozen), or the state was "
                                f"merged from different runs"))
    ps, pe = counters["progress_step"], counters["progress_epoch"]
    os_ = counters["optimizer_step"]
    if ps is not None and os_ is not None and ps != os_:
        findings.append(counters_finding(f"{opt_field}.state", os_, ps))
    le = counters["scheduler_last_epoch"]
    if le is not None and sched_info["kind"] != "ReduceLROnPlateau":
        cands = {k: v for k, v in (("progress step", ps), ("optimizer step", os_), ("progress epoch", pe))
                 if v is not None}
        # A per-epoch scheduler stepped at the end of epoch E, saved with ``epoch: E`` (the common
        # ``for epoch in ...: train; scheduler.step(); save(epoch=epoch)``, and Lightning on an epoch's
        # last batch) has last_epoch E + 1: in step with progress, not ahead of it.
        accepted = set(cands.values()) | ({pe + 1} if pe is not None else set())
        if cands and le not in accepted:
            name, val = min(cands.items(), key=lambda kv: abs(kv[1] - le))
            what = "lags" if le < val else "is ahead of"
            findings.append(Finding("warning", f"{sch_field}.last_epoch",
                                    f"scheduler {what} progress: last_epoch {le} vs {name} {val} (a missed or extra "
                                    f"scheduler.step(), or scheduler state from another save): the LR schedule "
                                    f"is shifted by {abs(val - le)}"))
    if sch is None and groups_sd and any(isinstance(g, dict) and "initial_lr" in g for g in groups_sd):
        findings.append(Finding("warning", "scheduler", missing_scheduler_message(counters)))
        sched_info["note"] = "missing (initial_lr present in param groups)"

    part_paths = {p: str(v[0][0]) or "(top level)" for p, v in parts.items() if v}
    notes = []
    subs = sub_checkpoints(state)
    if subs and not keys:
        where = opt_path if opt_entries else sch_path
        newest = str(where[0]) if len(where) else "?"
        notes.append(f"{len(subs)} sub-checkpoints ({', '.join(subs)}): audited the newest, {newest}")
    if len(opt_entries) > 1 or len(sch_entries) > 1:
        notes.append(f"{len(opt_entries)} optimizer(s) and {len(sch_entries)} scheduler(s), paired in order: "
                     + "; ".join(f"{str(opt_entries[i][0]) if i < len(opt_entries) else '-'} with "
                                 f"{str(sch_entries[i][0]) if i < len(sch_entries) else '-'}"
                                 for i in range(max(len(opt_entries), len(sch_entries)))))
    return PolicyAudit(parts=part_paths, groups=groups, scheduler=sched_info, counters=counters,
                       findings=findings, overrides=overrides, schedulers=schedulers, notes=notes)
