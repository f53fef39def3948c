"""One model of the next optimizer steps: what each of them will use, under either policy, and why.

For each optimizer/scheduler pair (:class:`~ckpt_archive.training.plan.PairPlan`) and each param group,
:class:`GroupSteps` holds the LR of the next :data:`STEPS` optimizer steps

* under ``--policy checkpoint`` (the archived state restored as a resuming script does:
  ``optimizer.load_state_dict`` then ``scheduler.load_state_dict``, then ``optimizer.step()`` and
  ``scheduler.step()`` in turn), and
* under ``--policy session`` (the same with the state the session policy rewrites,
  :func:`~ckpt_archive.training.impose.impose_pair`), where the session gives values,

computed by the real torch scheduler (:func:`~ckpt_archive.training.simulate.simulate`), and where each value
comes from: step 1 reads the group's ``lr``; which archived fields drive the steps after it (the scheduler's
``base_lrs``, the group's ``lr`` for a chainable scheduler, OneCycleLR's ``max_lr``, ...) is found by real
torch too: a field drives a step when changing it changes that step's LR. A group without a scheduler keeps
its ``lr``, unless the training script sets it every step (a hand-written schedule: ``lr_set_by ==
"script"``).

Every LR message is derived from this model (:func:`build_model`): the audit's ``next_lr`` and
``after_sched_step``, when an archived field that differs from the session's takes effect (the first step
whose LR differs between the two policies), what ``--expect-lr`` is compared with, and the warnings of the
live restore.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Sequence

from ckpt_archive.errors import UsageError
from ckpt_archive.training.changes import PolicyChange
from ckpt_archive.training.plan import PairPlan, plan_pairs
from ckpt_archive.training.session_config import archived_values, session_values
from ckpt_archive.training.simulate import depends_on_session, guessed_factors, simulate
from ckpt_archive.training.values import as_float, fmt_value

#: How many of the next optimizer steps the model follows (the next one and two after it).
STEPS = 3
#: A value differs from another by more than this relative amount: the field changed that step.
_RTOL = 1e-12


@dataclasses.dataclass
class GroupSteps:
    """The next optimizer steps of one param group.

    Attributes:
        index: the group's index in its optimizer (or scheduler, for a scheduler-only state).
        field: ``optimizer.param_groups[i]`` (``scheduler[i]`` for a scheduler-only state).
        checkpoint: the LR of each of the next steps under ``--policy checkpoint`` (None where it cannot be
            told: the session's LR, a step that raises, a state that cannot be rebuilt).
        session: the same under ``--policy session``, or None when no session values were given.
        first_from: where the next step's LR comes from (``optimizer.param_groups[0].lr``, or "the session's
            optimizer" for a state without optimizer state).
        later_from: the archived fields that drive the steps after it (found with real torch).
        sources: the archived value of each field of ``later_from``.
        lr_set_by: ``"scheduler"``, ``"state"`` or ``"script"`` (see :class:`~ckpt_archive.training.plan.PairPlan`).
        basis: how the values were obtained, or why some are missing (a guess is said to be one).
        raises: what the first failing ``scheduler.step()`` raises, or None.
        session_independent: for a state without optimizer state: whether the steps after the next one are the
            same whatever LR the session builds its optimizer with (None: not a scheduler-only state).
    """

    index: int
    field: str
    checkpoint: list[float | None]
    session: list[float | None] | None = None
    first_from: str = ""
    later_from: list[str] = dataclasses.field(default_factory=list)
    sources: dict = dataclasses.field(default_factory=dict)
    lr_set_by: str = "state"
    basis: str = ""
    raises: str | None = None
    session_independent: bool | None = None

    @property
    def next_lr(self) -> float | None:
        """The LR of the next optimizer step under the checkpoint policy."""
        return self.checkpoint[0] if self.checkpoint else None

    @property
    def after_step(self) -> float | None:
        """The LR after the next ``scheduler.step()`` under the checkpoint policy."""
        return self.checkpoint[1] if len(self.checkpoint) > 1 else None

    def first_difference(self) -> int | None:
        """The first step (1-based) whose LR differs between the two policies; None when none of the next steps
        does or there is no session column."""
        if self.session is None:
            return None
        for k, (a, b) in enumerate(zip(self.checkpoint, self.session), start=1):
            if a is None or b is None:
                continue
            if abs(a - b) > _RTOL * max(abs(a), abs(b)):
                return k
        return None

    def values(self, policy: str = "checkpoint") -> list[float | None]:
        """The column of ``policy`` (the checkpoint's where there is no session column)."""
        return self.session if policy == "session" and self.session is not None else self.checkpoint

    def describe(self, policy: str = "checkpoint") -> str:
        """``6e-05 (optimizer.param_groups[0].lr), then 8e-07, 9.6e-07 (from scheduler.base_lrs[0])``."""
        if self.lr_set_by == "script":
            return self.basis
        vals = self.values(policy)
        first = f"{fmt_value(vals[0])} ({self.first_from})" if vals and vals[0] is not None else (
            f"the session's LR ({self.first_from})")
        later = [v for v in vals[1:] if v is not None]
        if not later:
            return first
        src = (" (from " + ", ".join(f"{f} = {fmt_value(self.sources[f])}" if self.sources.get(f) is not None else f
                                     for f in self.later_from) + ")") if self.later_from else ""
        guess = f"; {self.basis}" if self.basis.startswith("a guess") else ""
        return f"{first}, then {', '.join(fmt_value(v) for v in later)}{src}{guess}"

    def to_json(self) -> dict:
        """The fields as plain data."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PolicyModel:
    """The model of a state (:func:`build_model`).

    Attributes:
        plans: one :class:`~ckpt_archive.training.plan.PairPlan` per optimizer/scheduler pair.
        groups: per pair, one :class:`GroupSteps` per param group.
        sess: the session values the model was built with (``{}``: none).
        session_state: the state rewritten under ``--policy session`` (None: no session values, or refused).
        changes: the fields that rewrite changed.
        refused: why ``--policy session`` refuses this state (a ReduceLROnPlateau whose base cannot be told),
            else None.
        steps: how many optimizer steps are followed.
    """

    plans: list[PairPlan]
    groups: list[list[GroupSteps]]
    sess: dict
    session_state: Any = None
    changes: list[PolicyChange] = dataclasses.field(default_factory=list)
    refused: str | None = None
    steps: int = STEPS

    def group(self, pair: int, index: int) -> GroupSteps | None:
        """The steps of group ``index`` of pair ``pair`` (None where there is no such group)."""
        gs = self.groups[pair] if pair < len(self.groups) else []
        return gs[index] if index < len(gs) else None

    def flat(self) -> list[tuple[PairPlan, GroupSteps]]:
        """Every group of every pair, in the audit's order."""
        return [(p, g) for p, gs in zip(self.plans, self.groups) for g in gs]


def build_model(state: Any, *, session_config: dict | str | Path | None = None, sess: dict | None = None,
                lr: float | Sequence[float] | None = None, keys: dict | None = None, archived_config: Any = None,
                steps: int = STEPS, drivers: bool = True) -> PolicyModel:
    """The next-step model of ``state``, under the checkpoint policy and, where the session gives values, under
    the session policy too.

    Args:
        state: nested checkpoint (not modified).
        session_config: the session's config (dict or JSON/YAML/TOML path); or ``sess``: its values, read.
        lr: a session base LR given directly.
        keys: part -> path overrides.
        archived_config: the run's own config (packed with ``--config``; default: the copy inside the state).
        steps: how many optimizer steps to follow.
        drivers: find which archived fields drive each step (``later_from``; a few more real torch runs).

    Returns:
        :class:`PolicyModel`. A ``--policy session`` rewrite that is refused (ReduceLROnPlateau without a known
        base) is said in ``refused``, never raised here.

    Raises:
        UsageError: as many LRs as neither 1 nor the number of groups.
        SourceError: unreadable config file.
    """
    sess = dict(session_values(session_config) if sess is None else sess)
    if lr is not None:
        sess["lr"] = lr
    arch = archived_values(state, archived_config)
    plans = plan_pairs(state, sess, lr=lr, keys=keys, archived=arch)
    model = PolicyModel(plans, [pair_steps(p, steps, drivers=drivers) for p in plans], sess, steps=steps)
    if _asks(sess):
        _session_column(model, state, lr, keys, arch)
    return model


def _asks(sess: dict) -> bool:
    return any(k in sess for k in ("lr", "base_lr", "max_lr", "weight_decay", "momentum", "eps", "betas",
                                   "scheduler"))


def _session_column(model: PolicyModel, state: Any, lr: Any, keys: dict | None, arch: dict) -> None:
    """Rewrite a copy of ``state`` as ``--policy session`` does and follow its steps."""
    from ckpt_archive.training.impose import copy_tree, impose_pair

    new_state = copy_tree(state)
    plans = plan_pairs(new_state, model.sess, lr=lr, keys=keys, archived=arch)
    try:
        for p in plans:
            model.changes += impose_pair(p, model.sess)
    except UsageError as exc:
        model.refused, model.changes = str(exc), []
        return
    model.session_state = new_state
    for p, p_ck, gs in zip(plans, model.plans, model.groups):
        session_lrs = p_ck.bases if not p_ck.groups else None
        for g, s in zip(gs, pair_steps(p, model.steps, session_lrs=session_lrs, drivers=False)):
            g.session = s.checkpoint
    for p, gs in zip(model.plans, model.groups):
        if not p.groups and p.bases:  # scheduler-only: the session's LR runs next under either policy
            for g, s in zip(gs, pair_steps(p, model.steps, session_lrs=p.bases, drivers=False)):
                g.checkpoint = s.checkpoint


def pair_steps(p: PairPlan, steps: int = STEPS, *, session_lrs: list | None = None,
               drivers: bool = True) -> list[GroupSteps]:
    """The next ``steps`` optimizer steps of each group of one pair under the checkpoint policy (of the state the
    plan was made from).

    Args:
        p: the pair's plan.
        steps: how many optimizer steps to follow.
        session_lrs: for a state without optimizer state, the LR the session builds its optimizer with (None:
            not known; the steps after the next one are given where they do not depend on it).
        drivers: find which archived fields drive the steps (a few more real torch runs).
    """
    if isinstance(p.sch, dict) and p.groups:
        return _scheduled(p, steps, drivers)
    if isinstance(p.sch, dict):
        return _scheduler_only(p, steps, session_lrs, drivers)
    return [_unscheduled(p, i, g, steps) for i, g in enumerate(p.groups)]


def _unscheduled(p: PairPlan, i: int, g: dict, steps: int) -> GroupSteps:
    """No scheduler state: the group's ``lr`` stays, unless the script sets it every step."""
    field = p.group_field(i)
    lr = as_float(g.get("lr"))
    if p.lr_set_by[i] == "script":
        return GroupSteps(i, field, [None] * steps, first_from="the training script", lr_set_by="script",
                          basis=f"set by the training script every step (no scheduler state; the config names a "
                                f"hand-written schedule: {', '.join(p.code_keys)}); the archived lr {fmt_value(lr)} "
                                f"is the last step's")
    return GroupSteps(i, field, [lr] * steps, first_from=f"{field}.lr", later_from=[f"{field}.lr"],
                      sources={f"{field}.lr": lr}, lr_set_by=p.lr_set_by[i],
                      basis="no scheduler state: the group's lr stays")


def _sched_groups(sch: dict) -> int:
    return len(sch.get("_last_lr") or []) or len(sch.get("base_lrs") or [])


def _scheduled(p: PairPlan, steps: int, drivers: bool) -> list[GroupSteps]:
    """Optimizer and scheduler state: restored and stepped in real torch."""
    n_sched = _sched_groups(p.sch)
    if n_sched and n_sched != len(p.groups):
        return [GroupSteps(i, p.group_field(i), [as_float(g.get("lr"))] + [None] * (steps - 1),
                           first_from=f"{p.group_field(i)}.lr", lr_set_by="scheduler",
                           basis=f"the scheduler has {n_sched} param group(s), the optimizer {len(p.groups)}")
                for i, g in enumerate(p.groups)]
    sim = simulate(p.sch, archived_groups=p.groups, steps=steps)
    basis = sim.note or "torch's scheduler arithmetic: the scheduler stepped from its archived state"
    out = [GroupSteps(i, p.group_field(i), _column(sim.lrs, i, steps), first_from=f"{p.group_field(i)}.lr",
                      lr_set_by="scheduler", basis=basis, raises=sim.raises) for i in range(len(p.groups))]
    if drivers:
        _find_drivers(p, out, sim.lrs, steps, None)
    return out


def _scheduler_only(p: PairPlan, steps: int, session_lrs: list | None, drivers: bool) -> list[GroupSteps]:
    """A scheduler without optimizer state: the next step runs at the session's LR; the scheduler's restored
    state decides the steps after it, whatever the session's LR, or not (two sessions are run to tell)."""
    n = _sched_groups(p.sch) or 1
    if session_lrs is not None:
        sim = simulate(p.sch, archived_groups=None, session_lrs=[as_float(x) or 0.0 for x in session_lrs],
                       steps=steps)
        lrs, independent, raises, note = sim.lrs, None, sim.raises, sim.note
    else:
        later, depends, raises = depends_on_session(p.sch, n, steps)
        independent = None if later is None else not depends
        lrs = [[None] * n] + (later if later is not None and not depends else [])
        note = ""
    basis = (f"the next scheduler.step() raises {raises}" if raises else
             "depends on the LR the session builds its optimizer with" if independent is False else
             "torch's scheduler arithmetic: from the archived base_lrs, whatever the session's LR" if independent else
             note or "torch's scheduler arithmetic, with the session's LR")
    out = [GroupSteps(i, p.group_field(i), _column(lrs, i, steps), first_from="the session's optimizer",
                      lr_set_by="scheduler", basis=basis, raises=raises, session_independent=independent)
           for i in range(n)]
    if drivers and len(lrs) > 1 and lrs[1][0] is not None:
        _find_drivers(p, out, lrs, steps, session_lrs or [0.0123456789] * n)
    return out


def _column(lrs: list[list], i: int, steps: int) -> list[float | None]:
    col = [row[i] if i < len(row) else None for row in lrs]
    return (col + [None] * steps)[:steps]


def _find_drivers(p: PairPlan, out: list[GroupSteps], base: list[list], steps: int, session_lrs: list | None) -> None:
    """Which archived fields drive each group's steps: each candidate field is changed and the steps rerun in real
    torch; a field drives a step where that step's LR moved."""
    guess = guessed_factors(p.sch, p.groups or None)  # a LambdaLR's assumed factors stay what they were
    for field_of, value_of, groups, sch in _perturbations(p):
        sim = simulate(sch, archived_groups=groups or None, session_lrs=session_lrs, steps=steps, lambda_guess=guess)
        for gs in out:
            moved = [k for k in range(1, min(len(sim.lrs), len(base)))
                     if _moved(base[k][gs.index], sim.lrs[k][gs.index] if gs.index < len(sim.lrs[k]) else None)]
            if moved and field_of(gs.index) not in gs.later_from:
                gs.later_from.append(field_of(gs.index))
                gs.sources[field_of(gs.index)] = value_of(gs.index)


def _moved(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) > 1e-9 * max(abs(a), abs(b))


def _perturbations(p: PairPlan):
    """``(field of group i, its archived value, groups, scheduler state)`` with one LR field scaled by 1.5: the
    group's ``lr``, ``initial_lr``, ``max_lr``, ``min_lr``; the scheduler's ``base_lrs`` and ``max_lrs`` (also
    its sub-schedulers')."""
    for key in ("lr", "initial_lr", "max_lr", "min_lr"):
        if any(as_float(g.get(key)) is not None for g in p.groups):
            groups = [dict(g, **{key: as_float(g[key]) * 1.5}) if as_float(g.get(key)) is not None else g
                      for g in p.groups]
            yield ((lambda i, key=key: f"{p.group_field(i)}.{key}"),
                   (lambda i, key=key: as_float(p.groups[i].get(key))), groups, p.sch)
    for path, key in _sched_lists(p.sch):
        sch = copy.deepcopy(_plain(p.sch))
        target = sch
        for j in path:
            target = target["_schedulers"][j]
        archived = list(target[key])
        target[key] = [(as_float(v) or 0.0) * 1.5 for v in target[key]]
        where = p.sch_field + "".join(f"._schedulers[{j}]" for j in path)
        yield ((lambda i, where=where, key=key: f"{where}.{key}[{i}]"),
               (lambda i, archived=archived: as_float(archived[i]) if i < len(archived) else None), p.groups, sch)


def _sched_lists(sd: Any, path: tuple = ()):
    """``(sub-scheduler path, key)`` of every ``base_lrs``/``max_lrs`` list in a scheduler state."""
    if not isinstance(sd, dict):
        return
    for key in ("base_lrs", "max_lrs"):
        if isinstance(sd.get(key), (list, tuple)) and sd[key]:
            yield path, key
    for j, sub in enumerate(sd.get("_schedulers") or []):
        yield from _sched_lists(sub, path + (j,))


def _plain(sd: Any) -> Any:
    from ckpt_archive.training.simulate import plain_state

    return plain_state(sd)


__all__ = ["STEPS", "GroupSteps", "PolicyModel", "build_model", "pair_steps"]
