"""What the next optimizer step and the next ``scheduler.step()`` will really do, by running real torch.

A closed form says what a schedule *should* give; what a resumed run *does* depends on the order of the
restore and on chainable ``get_lr`` forms that multiply the group's current ``lr`` (StepLR, LinearLR,
the recursive CosineAnnealingLR, ...). So :func:`simulate` rebuilds the torch scheduler class from its
``state_dict`` (the class is told by :func:`~ckpt_archive.training.schedulers.scheduler_kind`) on a dummy
optimizer with one scalar parameter per group, performs the restore as a resuming script does, and calls
``optimizer.step()`` (a no-op here) and ``scheduler.step()``:

* with optimizer state: the session builds optimizer and scheduler, then ``optimizer.load_state_dict``
  restores every group field (``lr``, ``initial_lr``, ``max_lr``, ...), then ``scheduler.load_state_dict``;
* without optimizer state (scripts that restore only the scheduler): the groups keep what the session's
  optimizer and its freshly built scheduler set, and ``scheduler.load_state_dict`` brings the archived
  ``base_lrs`` and position.

Nothing is unpickled: only plain values of the state are read. Functions of LambdaLR/MultiplicativeLR are
code, not state: the factor is *guessed* constant (``_last_lr / base_lrs`` as archived) and said so.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from ckpt_archive.training.schedulers import scheduler_kind, _milestones
from ckpt_archive.training.values import as_float, as_number

#: Group fields a restore copies into the live groups (``Optimizer.load_state_dict`` restores them all).
LR_FIELDS = ("lr", "initial_lr", "max_lr", "min_lr")
_COPIED = LR_FIELDS + ("momentum", "betas", "base_momentum", "max_momentum")


@dataclasses.dataclass
class Simulation:
    """Result of :func:`simulate` (LRs per param group).

    Attributes:
        now: the LR the next ``optimizer.step()`` uses (the group's ``lr`` after the restore).
        after_step: the group's ``lr`` after the next ``scheduler.step()`` (None where it raises or
            cannot be told).
        raises: the exception the next ``scheduler.step()`` raises (``"ValueError: Tried to step ..."``), or None.
        note: how ``after_step`` was obtained, or why it is missing (a guess is said to be one).
    """

    now: list[float | None]
    after_step: list[float | None] | None
    raises: str | None = None
    note: str = ""


class _Dummy:  # built lazily (torch is imported inside functions only)
    cls = None


def _dummy_optimizer(groups: list[dict]):
    """A ``torch.optim.Optimizer`` whose ``step()`` does nothing, one scalar parameter per group."""
    import torch

    if _Dummy.cls is None:
        class DummyOptimizer(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, {"lr": 1.0, "momentum": 0.9, "betas": (0.9, 0.999)})

            def step(self, closure=None):  # noqa: D401 - nothing to update
                return None

        _Dummy.cls = DummyOptimizer
    return _Dummy.cls([{"params": [torch.zeros((), requires_grad=True)], **g} for g in groups])


def _plain_group(g: dict) -> dict:
    """The fields of an archived group a restore writes into a live group (numbers as Python floats)."""
    out = {}
    for k in _COPIED:
        if k in g:
            v = g[k]
            out[k] = tuple(float(as_float(x)) for x in v) if isinstance(v, (list, tuple)) else as_float(v)
            if out[k] is None:
                del out[k]
    return out


def _construct(L, kind: str, sd: dict, opt, lambda_factors: list[float] | None):
    """A scheduler of class ``kind`` on ``opt`` (constructor arguments taken from ``sd``; every attribute is
    then overwritten by ``load_state_dict``)."""
    n = len(opt.param_groups)
    if kind == "StepLR":
        return L.StepLR(opt, step_size=int(as_number(sd["step_size"])), gamma=float(as_number(sd["gamma"])))
    if kind == "MultiStepLR":
        return L.MultiStepLR(opt, milestones=_milestones(sd["milestones"]), gamma=float(as_number(sd["gamma"])))
    if kind == "ExponentialLR":
        return L.ExponentialLR(opt, gamma=float(as_number(sd["gamma"])))
    if kind == "CosineAnnealingLR":
        return L.CosineAnnealingLR(opt, T_max=int(as_number(sd["T_max"])), eta_min=float(as_number(sd["eta_min"])))
    if kind == "CosineAnnealingWarmRestarts":
        return L.CosineAnnealingWarmRestarts(opt, T_0=int(as_number(sd["T_0"])), T_mult=int(as_number(sd.get("T_mult", 1))),
                                             eta_min=float(as_number(sd["eta_min"])))
    if kind == "LinearLR":
        return L.LinearLR(opt, start_factor=float(as_number(sd["start_factor"])),
                          end_factor=float(as_number(sd["end_factor"])), total_iters=int(as_number(sd["total_iters"])))
    if kind == "ConstantLR":
        return L.ConstantLR(opt, factor=float(as_number(sd["factor"])), total_iters=int(as_number(sd["total_iters"])))
    if kind == "PolynomialLR":
        return L.PolynomialLR(opt, total_iters=int(as_number(sd["total_iters"])), power=float(as_number(sd["power"])))
    if kind == "LambdaLR":
        factors = lambda_factors or [1.0] * n
        return L.LambdaLR(opt, [(lambda e, c=c: c) for c in factors])
    if kind == "OneCycleLR":
        max_lrs = [float(g.get("max_lr", g["lr"])) for g in opt.param_groups]
        return L.OneCycleLR(opt, max_lr=max_lrs, total_steps=int(as_number(sd["total_steps"])))
    if kind == "CyclicLR":
        bases = [float(as_float(b)) for b in sd["base_lrs"]]
        return L.CyclicLR(opt, base_lr=bases, max_lr=[float(as_float(m)) for m in sd["max_lrs"]],
                          cycle_momentum=False)
    if kind == "ReduceLROnPlateau":
        return L.ReduceLROnPlateau(opt)
    if kind in ("SequentialLR", "ChainedScheduler"):
        subs = [_construct(L, scheduler_kind(s), s, opt, lambda_factors) for s in sd["_schedulers"]]
        if kind == "SequentialLR":
            return L.SequentialLR(opt, schedulers=subs, milestones=[int(as_number(m)) for m in sd["_milestones"]])
        return L.ChainedScheduler(subs, optimizer=opt)
    raise KeyError(f"no constructor known for {kind}")


def _lambda_factors(sd: dict) -> list[float] | None:
    """LambdaLR: the constant factor per group that explains the archived state (``_last_lr / base_lrs``)."""
    bases, last = sd.get("base_lrs") or [], sd.get("_last_lr") or []
    if not bases or len(bases) != len(last):
        return None
    out = []
    for b, v in zip(bases, last):
        b, v = as_float(b), as_float(v)
        if b is None or v is None or b == 0:
            return None
        out.append(v / b)
    return out


def _sub_lambda_factors(sd: dict) -> list[float] | None:
    for s in [sd] + list(sd.get("_schedulers") or []):
        if isinstance(s, dict) and scheduler_kind(s) == "LambdaLR":
            return _lambda_factors(s)
    return None


def simulate(sch_sd: dict, *, archived_groups: list[dict] | None, session_lrs: list[float] | None = None,
             session_groups: list[dict] | None = None) -> Simulation:
    """Restore ``sch_sd`` (and ``archived_groups`` when the state holds the optimizer) into real torch
    objects as a resuming script does, then take the next optimizer and scheduler step.

    Args:
        sch_sd: the archived scheduler ``state_dict``.
        archived_groups: the archived optimizer's ``param_groups`` (dicts), or None for a state without
            optimizer state.
        session_lrs: the LR per group the session builds its optimizer with (default: the archived groups'
            ``lr``, else the scheduler's ``base_lrs``).
        session_groups: extra fields of the session's groups (``max_lr`` for a OneCycle session, ...).

    Returns:
        :class:`Simulation`. Never raises for a bad state: the reason is in ``note``.
    """
    import torch.optim.lr_scheduler as L

    kind = scheduler_kind(sch_sd)
    bases = [as_float(b) for b in (sch_sd.get("base_lrs") or [])]
    n = len(archived_groups) if archived_groups else (len(bases) or len(sch_sd.get("_last_lr") or []) or 1)
    if session_lrs is None:
        if archived_groups:
            session_lrs = [as_float(g.get("initial_lr", g.get("lr"))) or 0.0 for g in archived_groups]
        else:
            session_lrs = [b if b is not None else 0.0 for b in bases] or [0.0] * n
    groups = []
    for i in range(n):
        g = {"lr": float(session_lrs[i] if i < len(session_lrs) else session_lrs[-1])}
        if session_groups and i < len(session_groups):
            g.update(_plain_group(session_groups[i]))
            g["lr"] = float(session_lrs[i] if i < len(session_lrs) else session_lrs[-1])
        elif archived_groups and i < len(archived_groups):
            extra = _plain_group(archived_groups[i])
            extra.pop("lr", None)
            extra.pop("initial_lr", None)
            g.update(extra)
        groups.append(g)
    factors = _sub_lambda_factors(sch_sd)
    basis = "_last_lr / base_lrs"
    if factors is not None and kind == "LambdaLR" and archived_groups and len(archived_groups) == len(factors):
        # _last_lr / base_lrs is the factor only while base_lrs are what _last_lr was computed from; a base_lrs
        # from another run (1e-6 next to initial_lr 1e-4) makes it 60 instead of 0.6. The group's own lr /
        # initial_lr is the factor the lambda last applied to this optimizer: prefer it where they disagree.
        own = []
        for g, f in zip(archived_groups, factors):
            lr, ini = as_float(g.get("lr")), as_float(g.get("initial_lr"))
            own.append(lr / ini if lr is not None and ini else None)
        if None not in own and any(abs(a - b) > 1e-6 * max(abs(a), abs(b)) for a, b in zip(own, factors)):
            factors, basis = own, "the group's lr / initial_lr; _last_lr / base_lrs disagrees"
    note = ""
    if kind == "LambdaLR" or (kind in ("SequentialLR", "ChainedScheduler") and factors is not None):
        note = ("a guess: the lambda is code, not state; assumed constant at the archived factor "
                + ", ".join(f"{f:.7g}" for f in (factors or [1.0])) + f" ({basis})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = _dummy_optimizer(groups)
            sched = _construct(L, kind, sch_sd, opt, factors)
            if archived_groups:
                for live, saved in zip(opt.param_groups, archived_groups):  # optimizer.load_state_dict
                    live.update(_plain_group(saved))
            sched.load_state_dict(_plain_state(sch_sd))
            now = [float(g["lr"]) for g in opt.param_groups]
            opt.step()
            try:
                if kind == "ReduceLROnPlateau":
                    worse = math.inf if getattr(sched, "mode", "min") == "min" else -math.inf
                    sched.step(worse)
                    note = ("if the next metric does not improve on the best so far; an improving metric "
                            "keeps the LR")
                else:
                    sched.step()
            except Exception as exc:  # noqa: BLE001 - the point: what the next step does
                return Simulation(now, None, f"{type(exc).__name__}: {exc}", note)
            return Simulation(now, [float(g["lr"]) for g in opt.param_groups], None, note)
    except Exception as exc:  # noqa: BLE001 - an odd state is reported, never a crash
        return Simulation([as_float(g.get("lr")) for g in (archived_groups or groups)], None, None,
                          f"{kind} could not be rebuilt from its state ({type(exc).__name__}: {exc})")


def _plain_state(sd: Any) -> Any:
    """A scheduler state with tensors as Python numbers (fused optimizers keep LRs as 0-d tensors)."""
    if isinstance(sd, dict):
        return {k: _plain_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_plain_state(v) for v in sd]
    n = as_number(sd)
    if n is not None and not isinstance(sd, (int, float)):
        return n
    return sd


def depends_on_session(sch_sd: dict, n_groups: int) -> tuple[list[float | None] | None, bool, str | None]:
    """For a state without optimizer state: the LR after the next ``scheduler.step()``, and whether it
    depends on the LR the session built its optimizer with (two sessions with different LRs are run).

    Returns:
        ``(after_step LRs of the first session or None, depends, raises)``.
    """
    a = simulate(sch_sd, archived_groups=None, session_lrs=[0.0123456789] * n_groups)
    b = simulate(sch_sd, archived_groups=None, session_lrs=[0.987654321] * n_groups)
    if a.after_step is None or b.after_step is None:
        return None, False, a.raises or b.raises
    same = all(x == y or math.isclose(x, y, rel_tol=1e-12) for x, y in zip(a.after_step, b.after_step))
    return a.after_step, not same, None
