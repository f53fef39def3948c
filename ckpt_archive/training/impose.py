"""``--policy session``: the session's LR, hyperparameters and scheduler settings re-imposed on a checkpoint.

:func:`apply_session_policy` rewrites a copy of a state (moments and step counters untouched, shared with the
input) from the :mod:`.plan` that the session comparison reports from, so what is reported is what is
rewritten; :func:`impose_lrs` is the rule, shared with the live restore
(:func:`~ckpt_archive.training.restore.restore_training_state`). The rule for the LR: with archived base ``B``
and session base ``S``, every LR field ``v`` becomes ``S`` where ``v == B`` and ``v / B * S`` otherwise; where
the scheduler has a closed form, the group's ``lr`` and ``_last_lr`` are that closed form at the archived
position with the session's base (docs/policy.md, "Session policy").
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

from ckpt_archive.errors import UsageError
from ckpt_archive.training import sched_settings
from ckpt_archive.training.changes import PolicyChange, replace_change, same_type
from ckpt_archive.training.lr_bases import base_kind, impose_cyclic, impose_plateau, plateau_bases
from ckpt_archive.training.plan import PairPlan, plan_pairs
from ckpt_archive.training.schedulers import derive_lrs, nested_base_lrs, primary_base_lrs, scheduler_kind
from ckpt_archive.training.session_config import HYPER_NAMES, archived_values, lr_base_field, session_values
from ckpt_archive.training.values import as_float, coerce_float, nearly_equal

#: The group fields that hold an LR (rescaled together when the base moves).
GROUP_LR_FIELDS = ("lr", "initial_lr", "max_lr", "min_lr")


def apply_session_policy(state: Any, *, lr: float | Sequence[float] | None = None,
                         session_config: dict | str | Path | None = None,
                         keys: dict | None = None, archived_config: Any = None) -> tuple[Any, list[PolicyChange]]:
    """Re-impose the session's LR (and hyperparameters) on a copy of the checkpoint.

    The session's LR is the *base* LR (what a config's ``lr`` means). For each param group with archived
    base ``B`` (``max_lr`` for OneCycleLR, else ``initial_lr``, else the scheduler's ``base_lrs[i]``, else
    ``lr``) and session base ``S``, every LR field ``v`` of the group (``lr``, ``initial_lr``, ``max_lr``,
    ``min_lr``) and of the scheduler (``base_lrs``, ``_last_lr``, also inside SequentialLR/ChainedScheduler
    sub-schedulers) becomes ``S`` where ``v == B`` and ``v / B * S`` otherwise; where the scheduler has a
    closed form (:func:`derive_lrs`), ``lr`` and ``_last_lr`` are then that closed form at ``last_epoch``
    with the session's base (exact with absolute floors such as ``eta_min``). The schedule continues at the
    same point from the session's base. Without a scheduler the LR is exactly ``S``; a group whose LR the
    training script sets itself every step (no scheduler state, a hand-written schedule in the config:
    :func:`~ckpt_archive.training.session_config.hand_schedule`) is left to the script. Session
    ``weight_decay``/``momentum``/``eps``/``betas`` replace the group's values, except in groups the script set
    apart (:func:`~ckpt_archive.training.session_config.spread_hyper`). Optimizer moments and step counters are
    not touched: the returned state shares those tensor objects with ``state``.

    Args:
        state: nested checkpoint (not modified).
        lr: session base LR (float, or one per param group); overrides the config's.
        session_config: dict or JSON/YAML/TOML path (see :func:`session_values`).
        keys: part -> path overrides.
        archived_config: the run's own config (packed with ``--config``; default: the copy inside the state):
            tells the base of a ReduceLROnPlateau group, which the state does not keep.

    Which config keys a scheduler takes its LRs from (:mod:`.lr_bases`): CyclicLR ``base_lr``/``max_lr``
    (its ``base_lrs``/``max_lrs``/``initial_lr`` and the current ``lr`` at the same point of the cycle are
    rewritten; the config's ``lr``, overridden by CyclicLR, is ignored; ``lr=`` means ``base_lr``);
    ReduceLROnPlateau ``lr`` against its archived base (the current ``lr`` is rescaled by session / archived
    base, keeping the reductions; refused where the archived base cannot be told and differs).

    Returns:
        ``(new_state, changes)``: a structural copy and the list of :class:`PolicyChange`.

    Raises:
        UsageError: neither optimizer nor scheduler state, or as many LRs as neither 1 nor the number of groups;
            a ReduceLROnPlateau state whose base cannot be told while the session's lr is not its lr.
        SourceError: unreadable config file.
    """
    sess = session_values(session_config)
    if lr is not None:
        sess["lr"] = lr
    arch = archived_values(state, archived_config)
    new_state = copy_tree(state)
    plans = plan_pairs(new_state, sess, lr=lr, keys=keys, archived=arch)
    if not plans:
        if "lr" in sess or any(k in sess for k in HYPER_NAMES):
            raise UsageError("the checkpoint has neither optimizer nor scheduler state: there is no policy to "
                             "rewrite")
        return new_state, []
    changes: list[PolicyChange] = []
    for p in plans:
        changes += impose_pair(p, sess)
    return new_state, changes


def impose_pair(p: PairPlan, sess: dict) -> list[PolicyChange]:
    """Rewrite one pair of a (copied) state as its plan says: the LR bases, the hyperparameters, the scheduler's
    settings (in that order)."""
    changes: list[PolicyChange] = []
    if p.kind == "cyclic" and (p.bases is not None or p.base_max is not None):
        changes += impose_lrs(p.groups, p.sch, p.bases or [], p.opt_field, p.sch_field, want_max=p.base_max)
    elif p.bases is not None:
        changes += impose_lrs(p.groups, p.sch, p.bases, p.opt_field, p.sch_field, archived_bases=p.archived_bases)
    changes += _impose_hypers(p)
    if p.sch is not None:
        changes += _impose_sched_settings(p.sch, p.groups, sess, p.sch_field, p.opt_field)
    return changes


def _impose_hypers(p: PairPlan) -> list[PolicyChange]:
    """The session's hyperparameters into the groups (a group set apart by the script keeps its own)."""
    changes = []
    for name, wants in p.hypers.items():
        for i, (g, want) in enumerate(zip(p.groups, wants)):
            field = f"{p.opt_field}.param_groups[{i}].{name}"
            if want is None or name not in g:
                continue
            if name == "betas":
                b = g["betas"]
                if isinstance(b, (list, tuple)) and tuple(as_float(x) for x in b) != tuple(want):
                    changes.append(PolicyChange(field, tuple(as_float(x) for x in b), tuple(want)))
                    g["betas"] = type(b)(want)
            elif as_float(g[name]) is not None and as_float(g[name]) != want:
                changes.append(PolicyChange(field, as_float(g[name]), want))
                g[name] = want
    return changes


def _impose_sched_settings(sch: Any, groups: list, sess: dict, sfield: str, ofield: str) -> list[PolicyChange]:
    """Write the session config's scheduler settings (``T_max``, ``eta_min``, ...) into the copied scheduler
    state; where the schedule has a closed form (:func:`derive_lrs`), the group's ``lr`` and ``_last_lr`` become
    it at the archived ``last_epoch`` with the session's settings, so the next ``scheduler.step()`` (chainable
    schedulers compute from the current LR) continues the session's schedule. Progress is never touched."""
    if "scheduler" not in sess or not isinstance(sch, dict):
        return []
    changes = [PolicyChange(f"{sfield}.{k}", old, new, note)
               for k, old, new, note in sched_settings.impose(sch, sess["scheduler"])]
    if not changes:
        return changes
    _, lrs, _ = derive_lrs(sch, list(groups) or None)
    if lrs is None:
        return changes
    for i, v in enumerate(lrs):
        g = groups[i] if i < len(groups) else None
        if g is not None and as_float(g.get("lr")) is not None and as_float(g["lr"]) != v:
            changes.append(PolicyChange(f"{ofield}.param_groups[{i}].lr", as_float(g["lr"]), v,
                                        "the schedule's LR at the archived last_epoch with the session's settings"))
            g["lr"] = same_type(g["lr"], v)
    last = sch.get("_last_lr")
    if isinstance(last, list) and len(last) == len(lrs):
        for i, v in enumerate(lrs):
            if as_float(last[i]) is not None and as_float(last[i]) != v:
                changes.append(PolicyChange(f"{sfield}._last_lr[{i}]", as_float(last[i]), v))
                last[i] = same_type(last[i], v)
    return changes


def impose_lrs(groups: list, sch: Any, wants: list, ofield: str, sfield: str, *, want_max: list | None = None,
               archived_bases: list | None = None) -> list[PolicyChange]:
    """Re-impose session base LRs on param groups (dicts) and a scheduler (state dict or live object).

    The rule of :func:`apply_session_policy`; used on a copied state and on live objects alike. ``groups``
    may be empty (a state without optimizer state): the scheduler's ``base_lrs`` are then the archived base.
    Nothing changes where every session base equals the archived one.

    Args:
        wants: the session base per group: ``max_lr`` for OneCycleLR, ``base_lr`` for CyclicLR (None: keep),
            else ``lr``.
        want_max: CyclicLR only: the session ``max_lr`` per group (None: keep the archived ``max_lrs``).
        archived_bases: ReduceLROnPlateau only: the archived base LR per group (see
            :func:`~ckpt_archive.training.lr_bases.plateau_bases`); default: the groups' ``initial_lr``.

    Raises:
        UsageError: a ReduceLROnPlateau group whose archived base cannot be told while the session's differs.
    """
    changes: list[PolicyChange] = []
    sd = None if sch is None else (sch if isinstance(sch, dict) else getattr(sch, "__dict__", None))
    kind = base_kind(sch)
    if kind == "cyclic" and isinstance(sd, dict):
        impose_cyclic(groups, sd, wants, want_max, ofield, sfield, changes)
        return changes
    if kind == "plateau":
        olds = archived_bases if archived_bases is not None else plateau_bases(groups, sd or {})
        impose_plateau(groups, sd, wants, olds, ofield, sfield, changes)
        return changes
    olds, sched_olds, news = _base_slots(groups, sd or {}, wants)
    _rescale_groups(groups, olds, news, ofield, changes)
    if not _moves(olds + sched_olds, news + news, sd or {}):
        return changes  # the session asks for what is archived: nothing to rewrite, not even by a closed form
    if isinstance(sd, dict):
        in_place = isinstance(sch, dict)
        if not in_place:  # a live scheduler shares its lists with the state it loaded: never write into them
            for key in ("base_lrs", "_last_lr"):
                if isinstance(sd.get(key), list):
                    sd[key] = list(sd[key])
        _rescale_scheduler(sd, sfield, sched_olds, news, changes, in_place=in_place)
        lrs = _closed_form(sch, groups, olds, news, ofield, changes)
        _sync_last_lr(sd, groups, lrs, news, sfield, changes)
    return changes


def _base_slots(groups: list, sd: dict, wants: list) -> tuple[list, list, list]:
    """Per group (or scheduler group): the archived base of its own fields, the base its scheduler's lists are
    rescaled from, and the session's base. SequentialLR/ChainedScheduler keep no base_lrs of their own: without
    groups, their sub-scheduler's tell."""
    sched_bases = [as_float(b) for b in (sd.get("base_lrs") or (primary_base_lrs(sd) if not groups else []))]
    olds, sched_olds, news = [], [], []
    for i in range(max(len(groups), len(sched_bases))):
        g = groups[i] if i < len(groups) else None
        sb = sched_bases[i] if i < len(sched_bases) else None
        fname = lr_base_field(g) if g is not None else None
        old = as_float(g.get(fname)) if g is not None else sb
        if fname == "lr" and sb is not None:
            old = sb
        olds.append(old)
        news.append(coerce_float(wants[i]) if i < len(wants) else None)
        # OneCycleLR's base_lrs are max_lr / div_factor: rescaled by the group's max_lr ratio
        sched_olds.append(old if fname == "max_lr" or sb is None else sb)
    return olds, sched_olds, news


def _rescale_groups(groups: list, olds: list, news: list, ofield: str, changes: list) -> None:
    """Every LR field of each group whose base moves, at the same point of its schedule."""
    for i, g in enumerate(groups):
        old, want = olds[i], news[i]
        if old is None or want is None or nearly_equal(old, want):
            continue  # the same base (within LR_RTOL): a ratio would only add rounding noise
        for key in GROUP_LR_FIELDS:
            if key in g and as_float(g[key]) is not None:
                fv = as_float(g[key])
                nv = _rescale(fv, old, want)
                if nv != fv:
                    g[key] = same_type(g[key], nv)
                    changes.append(PolicyChange(f"{ofield}.param_groups[{i}].{key}", fv, nv))


def _moves(olds: list, news: list, sd: dict) -> bool:
    """Whether some base moves: a group's, its scheduler's, or a sub-scheduler's own ``base_lrs``."""
    n = len(news) // 2
    nested = [(as_float(b), w) for _, bs in nested_base_lrs(sd) for b, w in zip(bs[:n], news[:n])]
    return any(o is not None and w is not None and not nearly_equal(o, w)
               for o, w in list(zip(olds, news)) + nested)


def _closed_form(sch: Any, groups: list, olds: list, news: list, ofield: str, changes: list) -> list | None:
    """Where the schedule has a closed form, the LR at the archived position is the closed form with the session's
    base (exact also for absolute floors such as eta_min, which a ratio would scale): written into the groups."""
    view = sch if isinstance(sch, dict) else (sch.state_dict() if hasattr(sch, "state_dict") else None)
    _, lrs, _ = derive_lrs(view, list(groups) or None) if isinstance(view, dict) else (None, None, "")
    if lrs is not None and groups and len(lrs) == len(groups):
        for i, (g, v) in enumerate(zip(groups, lrs)):
            if news[i] is None or olds[i] is None or as_float(g.get("lr")) is None:
                continue
            fv = as_float(g["lr"])
            if v != fv:
                g["lr"] = same_type(g["lr"], v)
                replace_change(changes, f"{ofield}.param_groups[{i}].lr", fv, v)
    return lrs


def _sync_last_lr(sd: dict, groups: list, lrs: list | None, news: list, sfield: str, changes: list) -> None:
    """The scheduler's ``_last_lr`` = the groups' ``lr`` (what torch writes to both), else the closed form."""
    want_last = [as_float(g.get("lr")) for g in groups] if groups else list(lrs or [])
    last = sd.get("_last_lr")
    if not (isinstance(last, list) and want_last and len(last) == len(want_last)):
        return
    for i, v in enumerate(want_last):
        if i < len(news) and news[i] is not None and v is not None and as_float(last[i]) != v:
            replace_change(changes, f"{sfield}._last_lr[{i}]", as_float(last[i]), v)
            last[i] = same_type(last[i], v)


def _rescale_scheduler(sd: dict, path: str, olds: list, news: list, changes: list, *, in_place: bool = True,
                       last_olds: list | None = None, seen: dict | None = None) -> None:
    """Rescale ``base_lrs`` and ``_last_lr`` (also of SequentialLR/ChainedScheduler sub-schedulers).

    ``in_place``: write into the lists (a copied state, where a list may be reached by another path too); a
    live scheduler gets new lists (its lists are the very ones of the state dict it loaded, the caller's).
    ``last_olds``: the base ``_last_lr`` is rescaled from (default ``olds``). ``seen`` holds the lists done (by
    ``id``, each kept alive there: a list replaced and freed must not lend its ``id`` to a new one)."""
    seen = {} if seen is None else seen
    for key in ("base_lrs", "_last_lr"):
        vals = sd.get(key)
        if id(vals) in seen:  # SequentialLR's _last_lr is its active sub-scheduler's very list: rescale it once
            continue
        seen[id(vals)] = vals
        if isinstance(vals, (list, tuple)):
            key_olds = olds if key == "base_lrs" or last_olds is None else last_olds
            _rescale_list(sd, key, key_olds, news, f"{path}.{key}", changes, in_place)
    for j, sub in enumerate(sd.get("_schedulers") or []):
        sub_d = sub if isinstance(sub, dict) else getattr(sub, "__dict__", None)
        if isinstance(sub_d, dict):
            if not in_place:
                for key in ("base_lrs", "_last_lr"):
                    if isinstance(sub_d.get(key), list):
                        sub_d[key] = list(sub_d[key])
            # its _last_lr is at the group's scale (the closed form sets the current LR)
            _rescale_scheduler(sub_d, f"{path}._schedulers[{j}]", _sub_olds(sub_d, olds), news, changes,
                               in_place=in_place, last_olds=last_olds if last_olds is not None else olds, seen=seen)


def _sub_olds(sub_d: dict, olds: list) -> list:
    """A sub-scheduler schedules from its own base_lrs (restored by load_state_dict, whatever the group's
    initial_lr says): rescaled from those, so a stale sub-scheduler base gets the session's too."""
    own = [as_float(b) for b in (sub_d.get("base_lrs") or [])]
    if scheduler_kind(sub_d) == "OneCycleLR" or not own:
        return olds
    return [own[i] if i < len(own) and own[i] is not None else o for i, o in enumerate(olds)]


def _rescale_list(sd: dict, key: str, olds: list, news: list, field: str, changes: list, in_place: bool) -> None:
    vals = sd[key]
    new_vals = list(vals)
    for i, v in enumerate(vals):
        fv = as_float(v)
        if fv is None or i >= len(olds) or olds[i] is None or i >= len(news) or news[i] is None:
            continue
        nv = _rescale(fv, olds[i], news[i])
        if nv != fv:
            new_vals[i] = same_type(v, nv)
            changes.append(PolicyChange(f"{field}[{i}]", fv, nv))
    if isinstance(vals, list) and in_place:
        vals[:] = new_vals  # in place: a list reached through another path sees the same values
    else:
        sd[key] = type(vals)(new_vals)


def _rescale(value: float, old_base: float, new_base: float) -> float:
    """``value`` at the same point of the schedule with base ``new_base`` (exact when value == old_base)."""
    if value == old_base:
        return new_base
    if old_base == 0:
        return value
    return value / old_base * new_base


def copy_tree(obj: Any, memo: dict | None = None) -> Any:
    """Copy dicts/lists/tuples (keeping dict subclasses' types); tensors and arrays are shared, not copied.

    A container reached twice (``state["opt_alias"] is state["optimizer"]``, or ``state["pg"]`` the very
    ``param_groups`` list) is copied once (``memo``, by ``id``), so the copy keeps the aliasing and a rewrite
    seen through one path is seen through every other: ``torch.save`` of the result still has one object."""
    if memo is None:
        memo = {}
    if isinstance(obj, (dict, list)) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        hit = memo.get(id(obj))
        if hit is not None:
            return hit[1]
    if isinstance(obj, dict):
        try:
            new = copy.copy(obj)
        except Exception:
            new = dict(obj)
        memo[id(obj)] = (obj, new)  # the original is kept so that its id is not reused while copying
        for k, v in obj.items():
            new[k] = copy_tree(v, memo)
        return new
    if isinstance(obj, list):
        new_list: list = []
        memo[id(obj)] = (obj, new_list)
        new_list.extend(copy_tree(v, memo) for v in obj)
        return new_list
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        new_t = tuple(copy_tree(v, memo) for v in obj)
        memo[id(obj)] = (obj, new_t)
        return new_t
    return obj


__all__ = ["apply_session_policy", "impose_pair", "impose_lrs", "copy_tree", "GROUP_LR_FIELDS"]
