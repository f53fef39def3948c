"""[issue 29] The next LRs of the common schedulers in plain Python, without ``import torch`` (1-2 s of CPU).

:func:`~ckpt_archive.training.simulate.simulate` rebuilds the torch scheduler from its state and steps it. For
the schedulers a Checkpointer run saves most (StepLR, ExponentialLR, CosineAnnealingLR, OneCycleLR,
LinearLR, ConstantLR), restored with
the archived optimizer groups, what torch does is a few float operations on the restored attributes: ``step()``
adds one to ``_step_count`` and ``last_epoch`` and sets each group's ``lr`` to ``get_lr()``. :func:`plain_lrs`
runs those very expressions (torch's ``get_lr`` of each class, in torch's order of operations, so the floats are
the same bit for bit: tests/test_policy_simulate_plain.py compares it with the torch run over many states).

Anything outside what is certain here answers None and the caller runs real torch, as before: another class,
a value that is not a plain int/float, a setting torch's constructor would refuse or that would divide by zero,
a scheduler that would raise (OneCycleLR past ``total_steps``: torch's own message is reported), a state still
in its initial step, or an optimizer group without a number as its ``lr``.
"""
from __future__ import annotations

import math
from typing import Any, Callable


def _num(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _ints(sd: dict, *keys: str) -> bool:
    return all(type(sd.get(k)) is int for k in keys)


def _step_lr(sd: dict, lrs: list[float], base: list) -> list[float] | None:
    if (sd["last_epoch"] == 0) or (sd["last_epoch"] % sd["step_size"] != 0):
        return list(lrs)
    return [lr * sd["gamma"] for lr in lrs]


def _exponential(sd: dict, lrs: list[float], base: list) -> list[float] | None:
    return [lr * sd["gamma"] for lr in lrs]


def _cosine(sd: dict, lrs: list[float], base: list) -> list[float] | None:
    last, t_max, eta_min = sd["last_epoch"], sd["T_max"], sd["eta_min"]
    if sd["_step_count"] == 1 and last > 0:
        return [eta_min + (b - eta_min) * (1 + math.cos((last) * math.pi / t_max)) / 2 for b in base]
    if (last - 1 - t_max) % (2 * t_max) == 0:
        return [lr + (b - eta_min) * (1 - math.cos(math.pi / t_max)) / 2 for b, lr in zip(base, lrs)]
    den = 1 + math.cos(math.pi * (last - 1) / t_max)
    if den == 0:
        return None  # torch divides by zero here: its own error is reported
    return [(1 + math.cos(math.pi * last / t_max)) / den * (lr - eta_min) + eta_min for lr in lrs]


def _linear(sd: dict, lrs: list[float], base: list) -> list[float] | None:
    last, start, end, total = sd["last_epoch"], sd["start_factor"], sd["end_factor"], sd["total_iters"]
    if last == 0:
        return [lr * start for lr in lrs]
    if last > total:
        return list(lrs)
    return [lr * (1.0 + (end - start) / (total * start + (last - 1) * (end - start))) for lr in lrs]


def _constant(sd: dict, lrs: list[float], base: list) -> list[float] | None:
    if sd["last_epoch"] == 0:
        return [lr * sd["factor"] for lr in lrs]
    if sd["last_epoch"] != sd["total_iters"]:
        return list(lrs)
    return [lr * (1.0 / sd["factor"]) for lr in lrs]


def _one_cycle(sd: dict, lrs: list[float], base: list, groups: list[dict]) -> list[float] | None:
    step_num, phases = sd["last_epoch"], sd["_schedule_phases"]
    if step_num > sd["total_steps"]:
        return None  # torch raises ValueError: its own message is reported
    out = []
    for group in groups:
        start_step = 0.0
        for i, phase in enumerate(phases):
            end_step = phase["end_step"]
            if step_num <= end_step or i == len(phases) - 1:
                if end_step - start_step == 0:
                    return None
                pct = (step_num - start_step) / (end_step - start_step)
                start, end = group[phase["start_lr"]], group[phase["end_lr"]]
                if sd["_anneal_func_type"] == "cos":
                    cos_out = math.cos(math.pi * pct) + 1
                    out.append(end + (start - end) / 2.0 * cos_out)
                else:
                    out.append((end - start) * pct + start)
                break
            start_step = phase["end_step"]
    return out


def _one_cycle_ok(sd: dict, groups: list[dict]) -> bool:
    phases = sd.get("_schedule_phases")
    if not (_ints(sd, "total_steps") and sd["total_steps"] > 0 and sd.get("_anneal_func_type") in ("cos", "linear")
            and isinstance(phases, list) and phases):
        return False
    names = {"initial_lr", "max_lr", "min_lr"}
    for ph in phases:
        if not (isinstance(ph, dict) and _num(ph.get("end_step")) and ph.get("start_lr") in names
                and ph.get("end_lr") in names):
            return False
    return all(_num(g.get(n)) for g in groups for n in names)


#: kind -> (the state's settings it reads, whether they are sane for torch's constructor, get_lr)
_KINDS: dict[str, tuple[Callable[[dict, list[dict]], bool], Callable]] = {
    "StepLR": (lambda sd, g: _ints(sd, "step_size") and sd["step_size"] > 0 and _num(sd.get("gamma")), _step_lr),
    "ExponentialLR": (lambda sd, g: _num(sd.get("gamma")), _exponential),
    "CosineAnnealingLR": (lambda sd, g: _ints(sd, "T_max") and sd["T_max"] > 0 and _num(sd.get("eta_min")),
                          _cosine),
    "OneCycleLR": (_one_cycle_ok, None),
    "LinearLR": (lambda sd, g: _ints(sd, "total_iters") and _num(sd.get("start_factor")) and _num(sd.get("end_factor"))
                 and 0 < sd["start_factor"] <= 1 and 0 <= sd["end_factor"] <= 1, _linear),
    "ConstantLR": (lambda sd, g: _ints(sd, "total_iters") and _num(sd.get("factor")) and 0 <= sd["factor"] <= 1,
                   _constant),
}


def _certain(kind: str, sd: dict, groups: list[dict]) -> bool:
    """Whether ``kind`` restored from ``sd`` over ``groups`` is told here (every value it reads a plain number,
    settings torch's constructor accepts, past its initial step)."""
    entry = _KINDS.get(kind)
    if entry is None or not groups or not all(_num(g.get("lr")) for g in groups):
        return False
    if not (_ints(sd, "last_epoch", "_step_count") and sd.get("_is_initial", False) is False and entry[0](sd, groups)):
        return False
    base = sd.get("base_lrs")
    return kind != "CosineAnnealingLR" or (isinstance(base, list) and len(base) == len(groups)
                                           and all(_num(b) for b in base))


def plain_lrs(kind: str, sch_sd: dict, groups: list[dict], steps: int) -> list[list[float]] | None:
    """The LR of each of the next ``steps`` optimizer steps (``lrs[0]``: the restored groups' ``lr``), as the torch
    scheduler ``kind`` restored from ``sch_sd`` over optimizer groups holding ``groups``' fields gives them; None
    where this cannot be told for certain here (the caller then runs torch).

    Args:
        kind: the scheduler class (:func:`~ckpt_archive.training.schedulers.scheduler_kind`).
        sch_sd: the scheduler state with tensors as Python numbers
            (:func:`~ckpt_archive.training.simulate.plain_state`).
        groups: the archived optimizer groups' restored fields (``lr``, ``initial_lr``, ``max_lr``, ...), as
            ``optimizer.load_state_dict`` writes them into the live groups.
        steps: how many optimizer steps (>= 1).
    """
    if not _certain(kind, sch_sd, groups):
        return None
    sd, base, get_lr = dict(sch_sd), sch_sd.get("base_lrs"), _KINDS[kind][1]
    lrs = [[float(g["lr"]) for g in groups]]
    live = [dict(g) for g in groups]
    try:
        for _ in range(steps - 1):  # LRScheduler.step(): _step_count and last_epoch + 1, then get_lr()
            sd["_step_count"] += 1
            sd["last_epoch"] += 1
            now = [g["lr"] for g in live]
            nxt = _one_cycle(sd, now, base, live) if kind == "OneCycleLR" else get_lr(sd, now, base)
            if nxt is None or not all(_num(x) for x in nxt):
                return None
            for g, lr in zip(live, nxt):
                g["lr"] = lr
            lrs.append([float(x) for x in nxt])
    except (ArithmeticError, TypeError, ValueError, KeyError):  # what torch would raise: its message is told
        return None
    return lrs


__all__ = ["plain_lrs"]
