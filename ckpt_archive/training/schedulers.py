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


def scheduler_kind(sd: dict) -> str:
    """Name the torch scheduler class a state_dict comes from, by its keys (no class name is saved).

    Args:
        sd: a scheduler's ``state_dict()``.

    Returns:
        one of ``SequentialLR``, ``ChainedScheduler``, ``OneCycleLR``, ``CyclicLR``,
        ``ReduceLROnPlateau``, ``CosineAnnealingWarmRestarts``, ``CosineAnnealingLR``, ``StepLR``,
        ``MultiStepLR``, ``LinearLR``, ``PolynomialLR``, ``ConstantLR``, ``ExponentialLR``,
        ``LambdaLR`` (also ``MultiplicativeLR``: the same keys), or ``unknown``.
    """
    k = set(sd)
    if "_schedulers" in k:
        return "SequentialLR" if "_milestones" in k else "ChainedScheduler"
    if "_schedule_phases" in k and "total_steps" in k:
        return "OneCycleLR"
    if "max_lrs" in k or "step_ratio" in k:
        return "CyclicLR"
    if "patience" in k and "factor" in k:
        return "ReduceLROnPlateau"
    if {"T_0", "T_i", "T_cur"} <= k:
        return "CosineAnnealingWarmRestarts"
    if "T_max" in k:
        return "CosineAnnealingLR"
    if "step_size" in k and "gamma" in k:
        return "StepLR"
    if "milestones" in k and "gamma" in k:
        return "MultiStepLR"
    if "start_factor" in k and "end_factor" in k:
        return "LinearLR"
    if "power" in k and "total_iters" in k:
        return "PolynomialLR"
    if "factor" in k and "total_iters" in k:
        return "ConstantLR"
    if "gamma" in k:
        return "ExponentialLR"
    if "lr_lambdas" in k:
        return "LambdaLR"
    return "unknown"


def _milestones(m: Any) -> list[int]:
    """MultiStepLR milestones: a Counter/dict {epoch: count} or a list; returned sorted with multiplicity."""
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
            ms = [int(as_number(m)) for m in sd.get("_milestones") or []]
            subs = sd.get("_schedulers") or []
            idx = bisect.bisect_right(ms, int(e))
            if idx >= len(subs):
                return kind, None, f"milestone index {idx} has no sub-scheduler"
            sub = subs[idx]
            sub_kind, lrs, note = derive_lrs(sub, groups)
            return f"SequentialLR[{idx}:{sub_kind}]", lrs, note
        if e is None:
            return kind, None, "no last_epoch"
        e = int(e)
        if kind == "OneCycleLR":
            if groups is None:
                return kind, None, "needs the optimizer's initial_lr/max_lr/min_lr"
            if e > int(as_number(sd["total_steps"])):
                return kind, None, f"last_epoch {e} exceeds total_steps {sd['total_steps']}"
            lrs = []
            for g in groups:
                start = 0.0
                phases = sd["_schedule_phases"]
                for i, ph in enumerate(phases):
                    end = float(as_number(ph["end_step"]))
                    if e <= end or i == len(phases) - 1:
                        pct = (e - start) / (end - start)
                        a, b = float(as_number(g[ph["start_lr"]])), float(as_number(g[ph["end_lr"]]))
                        if sd.get("_anneal_func_type", "cos") == "linear":
                            lrs.append((b - a) * pct + a)
                        else:
                            lrs.append(b + (a - b) / 2.0 * (math.cos(math.pi * pct) + 1))
                        break
                    start = end
            return kind, lrs, ""
        if not bases or any(b is None for b in bases):
            return kind, None, "no base_lrs"
        if kind == "StepLR":
            g, s = float(as_number(sd["gamma"])), int(as_number(sd["step_size"]))
            return kind, [b * g ** (e // s) for b in bases], ""
        if kind == "MultiStepLR":
            g = float(as_number(sd["gamma"]))
            n = bisect.bisect_right(_milestones(sd["milestones"]), e)
            return kind, [b * g ** n for b in bases], ""
        if kind == "ExponentialLR":
            g = float(as_number(sd["gamma"]))
            return kind, [b * g ** e for b in bases], ""
        if kind == "CosineAnnealingLR":
            tm, mn = float(as_number(sd["T_max"])), float(as_number(sd["eta_min"]))
            return kind, [mn + (b - mn) * (1 + math.cos(math.pi * e / tm)) / 2 for b in bases], ""
        if kind == "CosineAnnealingWarmRestarts":
            mn, tc, ti = float(as_number(sd["eta_min"])), float(as_number(sd["T_cur"])), float(as_number(sd["T_i"]))
            return kind, [mn + (b - mn) * (1 + math.cos(math.pi * tc / ti)) / 2 for b in bases], ""
        if kind == "LinearLR":
            s0, s1, n = float(as_number(sd["start_factor"])), float(as_number(sd["end_factor"])), int(as_number(sd["total_iters"]))
            return kind, [b * (s0 + (s1 - s0) * min(n, e) / n) for b in bases], ""
        if kind == "ConstantLR":
            f, n = float(as_number(sd["factor"])), int(as_number(sd["total_iters"]))
            return kind, [b * (f + (e >= n) * (1 - f)) for b in bases], ""
        if kind == "PolynomialLR":
            p, n = float(as_number(sd["power"])), int(as_number(sd["total_iters"]))
            return kind, [b * (1.0 - min(n, e) / n) ** p for b in bases], ""
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return kind, None, f"state incomplete for {kind} ({type(exc).__name__}: {exc})"
    if kind == "LambdaLR":
        return kind, None, "the lambda is code, not state: the next LR cannot be derived; _last_lr reported"
    if kind == "ReduceLROnPlateau":
        return kind, None, "depends on the metric history: the LR stays until the plateau rule fires"
    return kind, None, f"{kind}: no closed form known here"


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
