"""Which config key a scheduler takes its LRs from, where the state keeps that base, and how to move it.

A config's ``lr`` is not what every scheduler runs from:

* ``OneCycleLR`` overrides the optimizer constructor's ``lr``: its base is the group's ``max_lr`` (config
  ``max_lr``);
* ``CyclicLR`` overrides it too: it cycles between ``base_lrs`` (config ``base_lr``; also the group's
  ``initial_lr``) and ``max_lrs`` (config ``max_lr``), both in the scheduler state;
* ``ReduceLROnPlateau`` keeps no base at all: the group's ``lr`` is the configured ``lr`` after ``k``
  reductions by ``factor`` (floored at ``min_lrs``); the base is the group's ``initial_lr`` where another
  scheduler recorded one, else the archived config's ``lr`` where the state is consistent with it;
* every other torch scheduler: the group's ``initial_lr`` (= ``base_lrs``), config ``lr``.

The current ``lr`` of a warmup, a decay or a plateau reduction is progress, not policy: it is never
compared with a config's ``lr``, and a session base is imposed by moving the schedule, not the position.
"""
from __future__ import annotations

import math
from typing import Any

from ckpt_archive.errors import UsageError
from ckpt_archive.training.changes import put
from ckpt_archive.training.schedulers import scheduler_kind
from ckpt_archive.training.session_config import per_group
from ckpt_archive.training.values import as_float, coerce_float, nearly_equal

#: rtol for "the lr is the base reduced k times by factor" (torch multiplies k times: rounding accumulates)
_PLATEAU_RTOL = 1e-6


def base_kind(sch: Any) -> str:
    """``"one_cycle"``, ``"cyclic"``, ``"plateau"`` or ``"plain"`` for a scheduler state dict or live object
    (None: ``"plain"``)."""
    sd = sch if isinstance(sch, dict) else getattr(sch, "__dict__", None)
    if not isinstance(sd, dict):
        return "plain"
    return {"OneCycleLR": "one_cycle", "CyclicLR": "cyclic",
            "ReduceLROnPlateau": "plateau"}.get(scheduler_kind(sd), "plain")


def plateau_reductions(lr: float | None, base: float | None, factor: Any, min_lr: Any = None) -> int | None:
    """How many ReduceLROnPlateau reductions turn ``base`` into ``lr``: ``k >= 0`` with
    ``lr == base * factor ** k`` (rtol 1e-6), ``-1`` when ``lr`` is the ``min_lr`` floor below ``base``,
    None when ``lr`` cannot come from ``base`` (or a value is missing)."""
    f, m = as_float(factor), as_float(min_lr)
    if lr is None or base is None or not (math.isfinite(lr) and math.isfinite(base)):
        return None
    if nearly_equal(lr, base, _PLATEAU_RTOL):
        return 0
    if f is not None and 0 < f < 1 and lr > 0 and base > 0 and lr < base:
        k = round(math.log(lr / base) / math.log(f))
        if k >= 0 and nearly_equal(lr, base * f ** k, _PLATEAU_RTOL):
            return k
    if m is not None and nearly_equal(lr, m, _PLATEAU_RTOL) and lr <= base:
        return -1
    return None


def _min_lr(sd: dict, i: int) -> Any:
    mins = sd.get("min_lrs") or []
    return mins[i] if i < len(mins) else None


def plateau_bases(groups: list[dict], sd: dict, archived_lr: Any = None) -> list[float | None]:
    """The archived base LR of each group under ReduceLROnPlateau: ``initial_lr`` where recorded, else the
    archived config's ``archived_lr`` (one per group) where the group's ``lr`` is that value after whole
    reductions; None where the base cannot be told."""
    out: list[float | None] = []
    cfg = archived_lr if isinstance(archived_lr, (list, tuple)) else [archived_lr] * len(groups)
    for i, g in enumerate(groups):
        base = as_float(g.get("initial_lr"))
        if base is None and i < len(cfg):
            c = coerce_float(cfg[i])
            if plateau_reductions(as_float(g.get("lr")), c, sd.get("factor"), _min_lr(sd, i)) is not None:
                base = c
        out.append(base)
    return out


def cyclic_slots(groups: list[dict], sd: dict) -> list[tuple[float | None, float | None]]:
    """``(base_lr, max_lr)`` per group of a CyclicLR state (its ``base_lrs``/``max_lrs``)."""
    bases, maxs = list(sd.get("base_lrs") or []), list(sd.get("max_lrs") or [])
    n = max(len(bases), len(maxs), len(groups))
    return [(as_float(bases[i]) if i < len(bases) else as_float((groups[i] if i < len(groups) else {}).get("initial_lr")),
             as_float(maxs[i]) if i < len(maxs) else None) for i in range(n)]


def cyclic_wants(sch: Any, sess: dict, lr: Any, n: int) -> tuple[list | None, list | None]:
    """CyclicLR: the session's ``base_lr`` and ``max_lr`` per group (None where the config names none)."""
    if base_kind(sch) != "cyclic":
        return None, None
    n = n or len(cyclic_slots([], sch))
    base = lr if lr is not None else sess.get("base_lr")
    return (per_group(base, n) if base is not None else None,
            per_group(sess["max_lr"], n) if "max_lr" in sess else None)


def impose_cyclic(groups: list, sd: dict, want_base: list, want_max: list | None, ofield: str, sfield: str,
                  changes: list) -> None:
    """Move a CyclicLR schedule to the session's ``base_lr``/``max_lr`` at the same point of its cycle.

    For each group whose session ``base_lr`` (``want_base[i]``, None: keep) or ``max_lr`` (``want_max[i]``)
    differs from the archived one, ``base_lrs``, ``max_lrs``, the group's ``initial_lr``, and the current
    ``lr``/``_last_lr`` become the session's: ``lr = B' + (M' - B') * (lr - B) / (M - B)`` (the cycle
    position ``(lr - B) / (M - B)`` is what CyclicLR multiplies, whatever its mode). ``sd`` may be a
    state dict or a live scheduler's ``__dict__``; ``groups`` may be empty (scheduler-only state).
    """
    slots = cyclic_slots(groups, sd)
    last = sd.get("_last_lr")
    for i, (ob, om) in enumerate(slots):
        nb, nm = _pick(want_base, i, ob), _pick(want_max, i, om)
        if ob is None or om is None or (nearly_equal(nb, ob) and nearly_equal(nm, om)):
            continue
        g = groups[i] if i < len(groups) else None
        cur = as_float(g.get("lr")) if g is not None else (as_float(last[i]) if isinstance(last, list)
                                                           and i < len(last) else None)
        pos = 0.0 if cur is None or om == ob else (cur - ob) / (om - ob)
        new_lr = nb + (nm - nb) * pos
        for key, v in (("base_lrs", nb), ("max_lrs", nm), ("_last_lr", new_lr)):
            vals = sd.get(key)
            if isinstance(vals, list) and i < len(vals):
                put(vals, i, v, f"{sfield}.{key}[{i}]", changes)
        for key, v in (("initial_lr", nb), ("lr", new_lr)):
            if g is not None and key in g:
                put(g, key, v, f"{ofield}.param_groups[{i}].{key}", changes)


def _pick(wants: list | None, i: int, archived: float | None) -> float | None:
    """The session's value for slot ``i`` (None in ``wants``, or no ``wants``: the archived one is kept)."""
    want = coerce_float(wants[i]) if wants and i < len(wants) else None
    return archived if want is None else want


def impose_plateau(groups: list, sd: dict | None, wants: list, olds: list, ofield: str, sfield: str,
                   changes: list) -> None:
    """Rescale a ReduceLROnPlateau group's current ``lr`` (and ``_last_lr``, ``initial_lr``) by session base /
    archived base, keeping the reductions made so far (floored at ``min_lrs``).

    Raises:
        UsageError: a group whose session base differs from its lr although its archived base is unknown.
    """
    sd = sd or {}
    for i, g in enumerate(groups):
        want = coerce_float(wants[i]) if i < len(wants) else None
        cur = as_float(g.get("lr"))
        if want is None or cur is None:
            continue
        old = olds[i] if i < len(olds) else None
        if old is None:
            if plateau_reductions(cur, want, sd.get("factor"), _min_lr(sd, i)) is not None:
                continue  # the lr is the session's base after whole reductions: the same policy
            raise UsageError(
                f"{ofield}.param_groups[{i}].lr is {cur:g} under ReduceLROnPlateau, which keeps no base LR: "
                f"it is not the session's lr {want:g} after whole reductions, and no initial_lr or archived "
                f"config tells the archived base, so --policy session cannot tell how many reductions to keep; "
                f"pack the run's config (pack --config) or set the LR in the resuming script")
        if nearly_equal(old, want):
            continue
        new = cur / old * want if old else cur
        floor = as_float(_min_lr(sd, i))
        if floor is not None:
            new = max(new, floor)
        note = (f"ReduceLROnPlateau: the current lr rescaled by session base / archived base "
                f"{want:g} / {old:g}, keeping the reductions made so far")
        put(g, "lr", new, f"{ofield}.param_groups[{i}].lr", changes, note)
        if "initial_lr" in g:
            put(g, "initial_lr", want, f"{ofield}.param_groups[{i}].initial_lr", changes)
        last = sd.get("_last_lr")
        if isinstance(last, list) and i < len(last):
            put(last, i, new, f"{sfield}._last_lr[{i}]", changes, note)
