"""What a session asks of each optimizer/scheduler pair of a checkpoint, field by field.

For every pair (:func:`plan_pairs`; paired by position as :func:`~ckpt_archive.training.parts.find_parts`
orders them: Accelerate's ``optimizer_1.bin`` with ``scheduler_1.bin``, Lightning's lists), a
:class:`PairPlan` holds the archived groups and scheduler, who sets each group's ``lr`` (the scheduler, the
state, or the training script itself), and, given session values, the base LR each group is to get (read from
the config key its scheduler takes its LRs from: :mod:`.lr_bases`) and each hyperparameter. The session
comparison (:func:`~ckpt_archive.training.session.compare_with_session`), the ``--policy session`` rewrite
(:func:`~ckpt_archive.training.impose.apply_session_policy`) and the next-step model
(:mod:`.nextstep`) all read this one plan, so what is reported is what is rewritten.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ckpt_archive.training.lr_bases import base_kind, cyclic_wants, plateau_bases
from ckpt_archive.training.parts import find_parts
from ckpt_archive.training.schedulers import primary_base_lrs
from ckpt_archive.training.session_config import per_group, session_bases, spread_hyper, spread_scalar_lr
from ckpt_archive.training.values import as_float

#: Group hyperparameters a config sets and the session policy compares and rewrites.
HYPERS = ("weight_decay", "momentum", "eps", "betas")


@dataclasses.dataclass
class PairPlan:
    """One optimizer/scheduler pair of a state and what a session asks of it.

    Attributes:
        index: position of the pair (0 for the first optimizer).
        opt_field / sch_field: paths of the optimizer and scheduler states (``"optimizer"``, ``'["scheduler_1.bin"]'``).
        opt / sch: the archived optimizer and scheduler state dicts (None where absent).
        kind: which config keys the scheduler takes its LRs from: ``"plain"``, ``"one_cycle"``, ``"cyclic"``,
            ``"plateau"`` (:func:`~ckpt_archive.training.lr_bases.base_kind`).
        groups: the archived param groups (dicts).
        lr_set_by: per group, who sets the ``lr`` the steps use: ``"scheduler"`` (a scheduler state is saved),
            ``"script"`` (no scheduler state and the config shows a hand-written schedule: progress set by code
            every step, not policy carried by the state), ``"state"`` (no scheduler: the archived ``lr`` stays).
        code_keys: the config keys that show the script schedules the LR itself.
        bases: the session's base LR per group (``max_lr`` for OneCycleLR, ``base_lr`` for CyclicLR, else ``lr``;
            None: not asked, or set by the script), or None when the session gives no LR. A scheduler-only pair:
            per scheduler group.
        base_max: CyclicLR: the session's ``max_lr`` per group (None: kept).
        archived_bases: ReduceLROnPlateau: the archived base per group (None where it cannot be told).
        hypers: hyperparameter -> the session's value per group (None: the group keeps its own: set apart by the
            script, e.g. no weight decay on norms and biases).
        apart: hyperparameter -> indices of the groups set apart.
        notes: how a single session LR was spread over groups with different bases.
    """

    index: int
    opt_field: str
    opt: dict | None
    sch_field: str
    sch: Any
    kind: str
    groups: list[dict]
    lr_set_by: list[str]
    code_keys: list[str]
    bases: list | None = None
    base_max: list | None = None
    archived_bases: list | None = None
    hypers: dict = dataclasses.field(default_factory=dict)
    apart: dict = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def group_field(self, i: int) -> str:
        """``optimizer.param_groups[i]`` (``scheduler[i]`` for a scheduler-only pair)."""
        return f"{self.opt_field}.param_groups[{i}]" if self.opt is not None else f"{self.sch_field}[{i}]"


def pair_entries(state: Any, keys: dict | None = None) -> list[tuple[str, Any, str, Any]]:
    """``(opt_field, opt, sch_field, sch)`` of every optimizer/scheduler pair, paired by position; a scheduler
    without an optimizer of its own (a script that saves only the scheduler) is a pair too."""
    parts = find_parts(state, keys)
    opts, schs = parts.get("optimizer", []), parts.get("scheduler", [])
    out = []
    for n in range(max(len(opts), len(schs))):
        o_path, o = opts[n] if n < len(opts) else ("", None)
        s_path, s = schs[n] if n < len(schs) else ("", None)
        out.append((str(o_path) or "optimizer", o, str(s_path) or "scheduler", s))
    return out


def plan_pairs(state: Any, sess: dict | None = None, *, lr: Any = None, keys: dict | None = None,
               archived: dict | None = None) -> list[PairPlan]:
    """The :class:`PairPlan` of every optimizer/scheduler pair of ``state``.

    Args:
        state: nested checkpoint.
        sess: session values (:func:`~ckpt_archive.training.session_config.session_values`), or None.
        lr: a session base LR given directly (``apply_session_policy(lr=...)``), over the config's.
        keys: part -> path overrides (see :func:`~ckpt_archive.training.parts.find_parts`).
        archived: the run's own config values (:func:`~ckpt_archive.training.session_config.archived_values`):
            the reference a single LR or hyperparameter replaces, a ReduceLROnPlateau base, and the keys of a
            hand-written schedule.

    Raises:
        UsageError: as many LRs as neither 1 nor the number of groups.
    """
    archived = archived or {}
    sess = sess or {}
    # who sets the LR: the session config's word (a schedule named, or the LR said constant), else the archived's
    code = list(sess["code_schedule"] if "code_schedule" in sess else archived.get("code_schedule", []))
    entries = pair_entries(state, keys)
    alone = all(opt is None for _, opt, _, _ in entries)  # no optimizer state at all: the schedulers alone
    plans = []
    for n, (ofield, opt, sfield, sch) in enumerate(entries):
        pg = opt.get("param_groups") if isinstance(opt, dict) else None
        groups = [g for g in pg if isinstance(g, dict)] if isinstance(pg, (list, tuple)) else []
        p = PairPlan(n, ofield, opt if isinstance(opt, dict) else None, sfield, sch, base_kind(sch), groups,
                     [_lr_set_by(g, sch, code) for g in groups], code)
        if groups or alone:
            _plan_lrs(p, sess, lr, archived.get("lr"))
        _plan_hypers(p, sess, archived)
        plans.append(p)
    return plans


def _lr_set_by(g: dict, sch: Any, code: list[str]) -> str:
    if sch is not None:
        return "scheduler"
    if code and "initial_lr" not in g and "max_lr" not in g:
        return "script"
    return "state"


def _plan_lrs(p: PairPlan, sess: dict, lr: Any, arch_lr: Any) -> None:
    """The session's base LR per group, by the config key each scheduler kind takes its LRs from."""
    asked = lr is not None or "lr" in sess
    if p.kind == "cyclic" and isinstance(p.sch, dict) and (p.groups or asked):
        p.bases, p.base_max = cyclic_wants(p.sch, sess, lr, len(p.groups))
        return
    if not asked:
        return
    value = lr if lr is not None else sess["lr"]
    if not p.groups:
        if isinstance(p.sch, dict) and p.kind == "plain":
            # a scheduler alone: its base_lrs take over at the next scheduler.step() (SequentialLR: its subs')
            p.bases = spread_scalar_lr(value, [as_float(b) for b in primary_base_lrs(p.sch)], arch_lr)
        return
    if p.kind == "plateau":
        p.archived_bases = plateau_bases(p.groups, p.sch, arch_lr)
        p.bases = (per_group(value, len(p.groups)) if None in p.archived_bases
                   else spread_scalar_lr(value, p.archived_bases, arch_lr, p.notes))
        return
    bases = session_bases(p.groups, {"lr": lr} if lr is not None else sess, arch_lr, p.notes)
    p.bases = [None if by == "script" else b for b, by in zip(bases, p.lr_set_by)]


def _plan_hypers(p: PairPlan, sess: dict, archived: dict) -> None:
    """The session's ``weight_decay``/``momentum``/``eps``/``betas`` per group (:func:`spread_hyper`)."""
    for name in HYPERS:
        if name not in sess or not p.groups:
            continue
        have = [_hyper(g.get(name)) for g in p.groups]
        p.hypers[name], apart = spread_hyper(sess[name], have, archived.get(name))
        if apart:
            p.apart[name] = apart


def _hyper(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(as_float(x) for x in v)
    return as_float(v)


__all__ = ["PairPlan", "HYPERS", "pair_entries", "plan_pairs"]
