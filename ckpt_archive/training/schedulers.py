"""LR schedulers from their state_dict alone: which class it was, and the LR its closed form gives.

No class name is saved in a scheduler's state_dict, so :func:`scheduler_kind` tells the torch class by
its keys, and :func:`derive_lrs` computes the LR after ``last_epoch`` steps from the closed form
(torch/optim/lr_scheduler.py), without rebuilding a scheduler object.
"""
from __future__ import annotations

import bisect
import math
from typing import Any

from ckpt_archive.training.values import as_float, as_number


#: ``(class, keys its state_dict holds)`` in the order they are tried (no class name is saved): the first whose
#: keys are all present names the class. SequentialLR and ChainedScheduler are told by ``_schedulers`` first.
_KINDS = (
    ("OneCycleLR", {"_schedule_phases", "total_steps"}),
    ("CyclicLR", {"max_lrs"}),
    ("CyclicLR", {"step_ratio"}),
    ("ReduceLROnPlateau", {"patience", "factor"}),
    ("CosineAnnealingWarmRestarts", {"T_0", "T_i", "T_cur"}),
    ("CosineAnnealingLR", {"T_max"}),
    ("StepLR", {"step_size", "gamma"}),
    ("MultiStepLR", {"milestones", "gamma"}),
    ("LinearLR", {"start_factor", "end_factor"}),
    ("PolynomialLR", {"power", "total_iters"}),
    ("ConstantLR", {"factor", "total_iters"}),
    ("ExponentialLR", {"gamma"}),
    ("LambdaLR", {"lr_lambdas"}),
)


def scheduler_kind(sd: dict) -> str:
    """Name the torch scheduler class a state_dict comes from, by its keys (no class name is saved).

    Args:
        sd: a scheduler's ``state_dict()``.

    Returns:
        one of ``SequentialLR``, ``ChainedScheduler``, ``OneCycleLR``, ``CyclicLR``,
        ``ReduceLROnPlateau``, ``CosineAnnealingWarmRestarts``, ``CosineAnnealingLR``, ``StepLR``,
        ``MultiStepLR``, ``LinearLR``, ``PolynomialLR``, ``ConstantLR``, ``ExponentialLR``,
        ``LambdaLR`` (also ``MultiplicativeLR``: the same keys), or ``unknown`` (:data:`_KINDS`).
    """
    k = set(sd)
    if "_schedulers" in k:
        return "SequentialLR" if "_milestones" in k else "ChainedScheduler"
    return next((name for name, keys in _KINDS if keys <= k), "unknown")


def milestones(m: Any) -> list[int]:
    """MultiStepLR milestones: a Counter/dict {epoch: count} or a list; returned sorted with multiplicity.

    Raises:
        ValueError / TypeError: an epoch or count that is not a number (the caller's audit names the field).
    """
    out: list[int] = []
    if isinstance(m, dict):
        for e, c in m.items():
            out.extend([int(e)] * int(as_number(c) or 0))
    elif isinstance(m, (list, tuple)):
        out = [int(as_number(x)) for x in m]
    return sorted(out)


def derive_lrs(sd: dict, groups: list[dict] | None = None) -> tuple[str, list[float] | None, str]:
    """The LR per param group after ``last_epoch`` scheduler steps, from the closed form.

    Formulas (torch/optim/lr_scheduler.py, ``_get_closed_form_lr`` and ``get_lr``), with
    ``e = last_epoch`` and ``b = base_lrs[i]``:

    * StepLR ``b * gamma ** (e // step_size)``; MultiStepLR ``b * gamma ** #(milestones <= e)``;
      ExponentialLR ``b * gamma ** e``;
    * CosineAnnealingLR ``eta_min + (b - eta_min) * (1 + cos(pi * e / T_max)) / 2``;
      CosineAnnealingWarmRestarts the same with ``T_cur / T_i``;
    * LinearLR ``b * (start + (end - start) * min(total_iters, e) / total_iters)``;
      ConstantLR ``b * (factor if e < total_iters else 1)``; PolynomialLR
      ``b * (1 - min(total_iters, e) / total_iters) ** power``;
    * SequentialLR: the sub-scheduler ``bisect_right(milestones, e)`` at its own ``last_epoch``;
    * OneCycleLR: the annealing phases over the group's ``initial_lr``/``max_lr``/``min_lr``.

    Not derivable: LambdaLR/MultiplicativeLR (the function is not in the state), ReduceLROnPlateau
    (depends on the metric history), ChainedScheduler, CyclicLR and unknown states.

    Returns:
        ``(kind, lrs or None, note)``; ``note`` says why not derivable.
    """
    kind = scheduler_kind(sd)
    e = as_number(sd.get("last_epoch"))
    bases = [as_float(b) for b in (sd.get("base_lrs") or [])]
    try:
        if kind == "SequentialLR":
            return _sequential(sd, e, groups)
        if e is None:
            return kind, None, "no last_epoch"
        if kind == "OneCycleLR":
            return _one_cycle(sd, int(e), groups)
        if not bases or any(b is None for b in bases):
            return kind, None, "no base_lrs"
        if kind in _CLOSED_FORMS:
            return kind, [_CLOSED_FORMS[kind](sd, int(e), b) for b in bases], ""
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return kind, None, f"state incomplete for {kind} ({type(exc).__name__}: {exc})"
    return kind, None, _NOT_DERIVABLE.get(kind, f"{kind}: no closed form known here")


def _g(sd: dict, key: str) -> float:
    return float(as_number(sd[key]))


def _n(sd: dict, key: str) -> int:
    return int(as_number(sd[key]))


def _cosine(mn: float, b: float, pos: float) -> float:
    return mn + (b - mn) * (1 + math.cos(math.pi * pos)) / 2


#: kind -> the LR after ``e`` steps from base ``b`` (torch/optim/lr_scheduler.py ``_get_closed_form_lr``).
_CLOSED_FORMS = {
    "StepLR": lambda sd, e, b: b * _g(sd, "gamma") ** (e // _n(sd, "step_size")),
    "MultiStepLR": lambda sd, e, b: b * _g(sd, "gamma") ** bisect.bisect_right(milestones(sd["milestones"]), e),
    "ExponentialLR": lambda sd, e, b: b * _g(sd, "gamma") ** e,
    "CosineAnnealingLR": lambda sd, e, b: _cosine(_g(sd, "eta_min"), b, e / _g(sd, "T_max")),
    "CosineAnnealingWarmRestarts": lambda sd, e, b: _cosine(_g(sd, "eta_min"), b, _g(sd, "T_cur") / _g(sd, "T_i")),
    "LinearLR": lambda sd, e, b: b * (_g(sd, "start_factor") + (_g(sd, "end_factor") - _g(sd, "start_factor"))
                                      * min(_n(sd, "total_iters"), e) / _n(sd, "total_iters")),
    "ConstantLR": lambda sd, e, b: b * (_g(sd, "factor") + (e >= _n(sd, "total_iters")) * (1 - _g(sd, "factor"))),
    "PolynomialLR": lambda sd, e, b: b * (1.0 - min(_n(sd, "total_iters"), e) / _n(sd, "total_iters")) ** _g(sd, "power"),
}

_NOT_DERIVABLE = {
    "LambdaLR": "the lambda is code, not state: the next LR cannot be derived; _last_lr reported",
    "ReduceLROnPlateau": "depends on the metric history: the LR stays until the plateau rule fires",
}


def _sequential(sd: dict, e: Any, groups: list[dict] | None) -> tuple[str, list[float] | None, str]:
    """SequentialLR: the sub-scheduler ``bisect_right(milestones, e)`` at its own ``last_epoch``."""
    ms = [int(as_number(m)) for m in sd.get("_milestones") or []]
    subs = sd.get("_schedulers") or []
    idx = bisect.bisect_right(ms, int(e))
    if idx >= len(subs):
        return "SequentialLR", None, f"milestone index {idx} has no sub-scheduler"
    sub_kind, lrs, note = derive_lrs(subs[idx], groups)
    return f"SequentialLR[{idx}:{sub_kind}]", lrs, note


def _one_cycle(sd: dict, e: int, groups: list[dict] | None) -> tuple[str, list[float] | None, str]:
    """OneCycleLR: the annealing phases over the group's ``initial_lr``/``max_lr``/``min_lr``."""
    if groups is None:
        return "OneCycleLR", None, "needs the optimizer's initial_lr/max_lr/min_lr"
    if e > int(as_number(sd["total_steps"])):
        return "OneCycleLR", None, f"last_epoch {e} exceeds total_steps {sd['total_steps']}"
    linear = sd.get("_anneal_func_type", "cos") == "linear"
    return "OneCycleLR", [_one_cycle_lr(sd["_schedule_phases"], e, g, linear) for g in groups], ""


def _one_cycle_lr(phases: list, e: int, g: dict, linear: bool) -> float:
    start = 0.0
    for i, ph in enumerate(phases):
        end = float(as_number(ph["end_step"]))
        if e <= end or i == len(phases) - 1:
            pct = (e - start) / (end - start)
            a, b = float(as_number(g[ph["start_lr"]])), float(as_number(g[ph["end_lr"]]))
            return (b - a) * pct + a if linear else b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1)
        start = end
    raise ValueError("OneCycleLR state without phases")


def nested_base_lrs(sd: dict, field: str = "scheduler") -> list[tuple[str, list]]:
    """Every ``base_lrs`` a scheduler state holds: its own, and those of its SequentialLR/ChainedScheduler
    sub-schedulers (``scheduler._schedulers[1].base_lrs``), each with its field path; OneCycleLR's are left
    out (``max_lr / div_factor``, not a configured LR). ``scheduler.load_state_dict`` restores all of them and
    the sub-scheduler that steps next computes the LR from its own."""
    out: list[tuple[str, list]] = []
    if not isinstance(sd, dict):
        return out
    if isinstance(sd.get("base_lrs"), (list, tuple)) and scheduler_kind(sd) != "OneCycleLR":
        out.append((field, list(sd["base_lrs"])))
    for j, sub in enumerate(sd.get("_schedulers") or []):
        sub_d = sub if isinstance(sub, dict) else getattr(sub, "__dict__", None)
        if isinstance(sub_d, dict):
            out += nested_base_lrs(sub_d, f"{field}._schedulers[{j}]")
    return out


def primary_base_lrs(sd: dict) -> list:
    """The base LRs a scheduler state schedules from: its own ``base_lrs``, else (SequentialLR/ChainedScheduler,
    which keep none) those of the sub-scheduler active at ``last_epoch`` (SequentialLR), else the first."""
    if not isinstance(sd, dict):
        return []
    if sd.get("base_lrs"):
        return list(sd["base_lrs"])
    subs = [d for s in (sd.get("_schedulers") or [])
            if isinstance(d := (s if isinstance(s, dict) else getattr(s, "__dict__", None)), dict)]
    if not subs:
        return []
    idx = 0
    ms, le = sd.get("_milestones"), as_number(sd.get("last_epoch"))
    if isinstance(ms, (list, tuple)) and le is not None:
        import bisect

        idx = min(bisect.bisect_right(list(ms), le), len(subs) - 1)
    return primary_base_lrs(subs[idx]) or next((b for s in subs if (b := primary_base_lrs(s))), [])


__all__ = ["scheduler_kind", "derive_lrs", "nested_base_lrs", "primary_base_lrs"]
