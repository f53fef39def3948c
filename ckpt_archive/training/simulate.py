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

[issue 29] StepLR, ExponentialLR, CosineAnnealingLR, OneCycleLR, LinearLR and ConstantLR restored with their
optimizer groups (the audit's case) are told without importing torch by
:mod:`~ckpt_archive.training.simulate_plain`, which runs torch's own ``get_lr`` arithmetic; anything it is not
certain of comes here as before.

Nothing is unpickled: only plain values of the state are read. Functions of LambdaLR/MultiplicativeLR are
code, not state: the factor is *guessed* constant (``_last_lr / base_lrs`` as archived) and said so.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

from ckpt_archive.training.schedulers import scheduler_kind, milestones
from ckpt_archive.training.values import as_float, as_number

#: Group fields a restore copies into the live groups (``Optimizer.load_state_dict`` restores them all).
LR_FIELDS = ("lr", "initial_lr", "max_lr", "min_lr")
_COPIED = LR_FIELDS + ("momentum", "betas", "base_momentum", "max_momentum")


@dataclasses.dataclass
class Simulation:
    """Result of :func:`simulate` (LRs per param group).

    Attributes:
        lrs: the LR of each of the next optimizer steps, one list per step (one value per group): ``lrs[0]`` is
            what the next ``optimizer.step()`` uses (the group's ``lr`` after the restore), ``lrs[k]`` what the
            step after the ``k``-th ``scheduler.step()`` uses. Shorter than asked where a ``scheduler.step()``
            raises.
        raises: the exception the first failing ``scheduler.step()`` raises (``"ValueError: Tried to step ..."``),
            or None.
        note: how the values were obtained, or why they are missing (a guess is said to be one).
    """

    lrs: list[list[float | None]]
    raises: str | None = None
    note: str = ""

    @property
    def now(self) -> list[float | None]:
        """The LR the next ``optimizer.step()`` uses, per group."""
        return self.lrs[0] if self.lrs else []

    @property
    def after_step(self) -> list[float | None] | None:
        """The group's ``lr`` after the next ``scheduler.step()`` (None where it raises or cannot be told)."""
        return self.lrs[1] if len(self.lrs) > 1 else None


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


def _i(sd: dict, key: str, default: Any = None) -> int:
    return int(as_number(sd[key] if default is None else sd.get(key, default)))


def _f(sd: dict, key: str) -> float:
    return float(as_number(sd[key]))


#: kind -> the scheduler of that class on ``opt``, its constructor arguments taken from the state (every
#: attribute is then overwritten by ``load_state_dict``); ``c`` holds torch's lr_scheduler module (``c.L``) and
#: the constant LambdaLR factors (``c.factors``).
_CONSTRUCTORS: dict[str, Callable] = {
    "StepLR": lambda c, sd, o: c.L.StepLR(o, step_size=_i(sd, "step_size"), gamma=_f(sd, "gamma")),
    "MultiStepLR": lambda c, sd, o: c.L.MultiStepLR(o, milestones=milestones(sd["milestones"]), gamma=_f(sd, "gamma")),
    "ExponentialLR": lambda c, sd, o: c.L.ExponentialLR(o, gamma=_f(sd, "gamma")),
    "CosineAnnealingLR": lambda c, sd, o: c.L.CosineAnnealingLR(o, T_max=_i(sd, "T_max"), eta_min=_f(sd, "eta_min")),
    "CosineAnnealingWarmRestarts": lambda c, sd, o: c.L.CosineAnnealingWarmRestarts(
        o, T_0=_i(sd, "T_0"), T_mult=_i(sd, "T_mult", 1), eta_min=_f(sd, "eta_min")),
    "LinearLR": lambda c, sd, o: c.L.LinearLR(o, start_factor=_f(sd, "start_factor"), end_factor=_f(sd, "end_factor"),
                                              total_iters=_i(sd, "total_iters")),
    "ConstantLR": lambda c, sd, o: c.L.ConstantLR(o, factor=_f(sd, "factor"), total_iters=_i(sd, "total_iters")),
    "PolynomialLR": lambda c, sd, o: c.L.PolynomialLR(o, total_iters=_i(sd, "total_iters"), power=_f(sd, "power")),
    "LambdaLR": lambda c, sd, o: c.L.LambdaLR(o, [(lambda e, k=k: k) for k in c.factors or [1.0] * len(o.param_groups)]),
    "OneCycleLR": lambda c, sd, o: c.L.OneCycleLR(o, max_lr=[float(g.get("max_lr", g["lr"])) for g in o.param_groups],
                                                  total_steps=_i(sd, "total_steps")),
    "CyclicLR": lambda c, sd, o: c.L.CyclicLR(o, base_lr=[float(as_float(b)) for b in sd["base_lrs"]],
                                              max_lr=[float(as_float(m)) for m in sd["max_lrs"]], cycle_momentum=False),
    "ReduceLROnPlateau": lambda c, sd, o: c.L.ReduceLROnPlateau(o),
    "SequentialLR": lambda c, sd, o: c.L.SequentialLR(o, schedulers=_subs(c, sd, o),
                                                      milestones=[int(as_number(m)) for m in sd["_milestones"]]),
    "ChainedScheduler": lambda c, sd, o: c.L.ChainedScheduler(_subs(c, sd, o), optimizer=o),
}


def _subs(c: Any, sd: dict, opt: Any) -> list:
    return [_construct(c, s, opt) for s in sd["_schedulers"]]


def _construct(c: Any, sd: dict, opt: Any):
    """A scheduler of the class ``sd`` comes from (:data:`_CONSTRUCTORS`) on ``opt``.

    Raises:
        KeyError: no constructor known for its kind (or a setting missing from the state).
    """
    kind = scheduler_kind(sd)
    if kind not in _CONSTRUCTORS:
        raise KeyError(f"no constructor known for {kind}")
    return _CONSTRUCTORS[kind](c, sd, opt)


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


def guessed_factors(sch_sd: dict, archived_groups: list[dict] | None) -> tuple[list[float] | None, str]:
    """The constant LambdaLR factors assumed (the lambda is code, not state), and the note saying so.

    ``_last_lr / base_lrs`` is the factor only while ``base_lrs`` are what ``_last_lr`` was computed from; a
    ``base_lrs`` from another run (1e-6 next to initial_lr 1e-4) makes it 60 instead of 0.6. The group's own
    ``lr / initial_lr`` is the factor the lambda last applied to this optimizer: preferred where they disagree.
    """
    kind = scheduler_kind(sch_sd)
    factors = _sub_lambda_factors(sch_sd)
    basis = "_last_lr / base_lrs"
    if factors is not None and kind == "LambdaLR" and archived_groups and len(archived_groups) == len(factors):
        own = [_own_factor(g) for g in archived_groups]
        if None not in own and any(abs(a - b) > 1e-6 * max(abs(a), abs(b)) for a, b in zip(own, factors)):
            factors, basis = own, "the group's lr / initial_lr; _last_lr / base_lrs disagrees"
    if kind == "LambdaLR" or (kind in ("SequentialLR", "ChainedScheduler") and factors is not None):
        return factors, ("a guess: the lambda is code, not state; assumed constant at the archived factor "
                         + ", ".join(f"{f:.7g}" for f in (factors or [1.0])) + f" ({basis})")
    return factors, ""


def _own_factor(g: dict) -> float | None:
    lr, ini = as_float(g.get("lr")), as_float(g.get("initial_lr"))
    return lr / ini if lr is not None and ini else None


def _session_groups(n: int, session_lrs: list, archived_groups: list[dict] | None,
                    session_groups: list[dict] | None) -> list[dict]:
    """The groups the session builds its optimizer with: its LR, and the other fields a scheduler's constructor
    reads (the session's where given, else the archived ones except ``lr``/``initial_lr``)."""
    groups = []
    for i in range(n):
        g = {}
        if session_groups and i < len(session_groups):
            g.update(_plain_group(session_groups[i]))
        elif archived_groups and i < len(archived_groups):
            g.update({k: v for k, v in _plain_group(archived_groups[i]).items() if k not in ("lr", "initial_lr")})
        g["lr"] = float(session_lrs[i] if i < len(session_lrs) else session_lrs[-1])
        groups.append(g)
    return groups


def _default_session_lrs(sch_sd: dict, archived_groups: list[dict] | None, n: int) -> list[float]:
    if archived_groups:
        return [as_float(g.get("initial_lr", g.get("lr"))) or 0.0 for g in archived_groups]
    bases = [as_float(b) for b in (sch_sd.get("base_lrs") or [])]
    return [b if b is not None else 0.0 for b in bases] or [0.0] * n


def simulate(sch_sd: dict, *, archived_groups: list[dict] | None, session_lrs: list[float] | None = None,
             session_groups: list[dict] | None = None, steps: int = 2,
             lambda_guess: tuple[list[float] | None, str] | None = None) -> Simulation:
    """Restore ``sch_sd`` (and ``archived_groups`` when the state holds the optimizer) into real torch
    objects as a resuming script does, then take the next ``steps`` optimizer steps, each followed by its
    ``scheduler.step()`` (a ReduceLROnPlateau sees a metric that does not improve).

    Args:
        sch_sd: the archived scheduler ``state_dict``.
        archived_groups: the archived optimizer's ``param_groups`` (dicts), or None for a state without
            optimizer state.
        session_lrs: the LR per group the session builds its optimizer with (default: the archived groups'
            ``initial_lr``/``lr``, else the scheduler's ``base_lrs``).
        session_groups: extra fields of the session's groups (``max_lr`` for a OneCycle session, ...).
        steps: how many optimizer steps to follow (>= 1).
        lambda_guess: the constant LambdaLR factors to assume and their note (default: guessed from this state,
            :func:`guessed_factors`); given to hold the guess fixed while other fields change.

    Returns:
        :class:`Simulation`. Never raises for a bad state: the reason is in ``note``.
    """
    kind = scheduler_kind(sch_sd)
    if archived_groups and session_lrs is None and session_groups is None:  # the audit's case: no torch if it can
        fast = _without_torch(kind, sch_sd, archived_groups, steps, lambda_guess)
        if fast is not None:
            return fast
    import torch.optim.lr_scheduler as L

    n = len(archived_groups) if archived_groups else (
        len(sch_sd.get("base_lrs") or []) or len(sch_sd.get("_last_lr") or []) or 1)
    if session_lrs is None:
        session_lrs = _default_session_lrs(sch_sd, archived_groups, n)
    groups = _session_groups(n, session_lrs, archived_groups, session_groups)
    factors, note = lambda_guess if lambda_guess is not None else guessed_factors(sch_sd, archived_groups)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = _dummy_optimizer(groups)
            sched = _construct(_Ctx(L, factors), sch_sd, opt)
            for live, saved in zip(opt.param_groups, archived_groups or []):  # optimizer.load_state_dict
                live.update(_plain_group(saved))
            sched.load_state_dict(plain_state(sch_sd))
            return _run(opt, sched, kind, steps, note)
    except Exception as exc:  # noqa: BLE001 - an odd state is reported, never a crash
        return Simulation([[as_float(g.get("lr")) for g in (archived_groups or groups)]], None,
                          f"{kind} could not be rebuilt from its state ({type(exc).__name__}: {exc})")


def _without_torch(kind: str, sch_sd: dict, archived_groups: list[dict], steps: int,
                   lambda_guess: tuple[list[float] | None, str] | None) -> Simulation | None:
    """[issue 29] The common schedulers restored with their optimizer groups, told in plain Python
    (:mod:`~ckpt_archive.training.simulate_plain`) with torch's own arithmetic; None: run torch. (Their classes
    take no LambdaLR factor: the note is the one the torch run gives.)"""
    from ckpt_archive.training.simulate_plain import plain_lrs

    try:
        groups = [_plain_group(g) for g in archived_groups]
        note = (lambda_guess if lambda_guess is not None else guessed_factors(sch_sd, archived_groups))[1]
    except Exception:  # noqa: BLE001 - the torch path meets it and says what it says
        return None
    lrs = plain_lrs(kind, plain_state(sch_sd), groups, steps)
    return None if lrs is None else Simulation(lrs, None, note)


class _Ctx:
    def __init__(self, L: Any, factors: list[float] | None):
        self.L, self.factors = L, factors


def _run(opt: Any, sched: Any, kind: str, steps: int, note: str) -> Simulation:
    """``steps`` optimizer steps, each followed by ``scheduler.step()``; the LR of each step."""
    lrs = [[float(g["lr"]) for g in opt.param_groups]]
    plateau = kind == "ReduceLROnPlateau"
    if plateau:
        note = "if the next metric does not improve on the best so far; an improving metric keeps the LR"
    for _ in range(steps - 1):
        opt.step()
        try:
            if plateau:
                sched.step(math.inf if getattr(sched, "mode", "min") == "min" else -math.inf)
            else:
                sched.step()
        except Exception as exc:  # noqa: BLE001 - the point: what the next step does
            return Simulation(lrs, f"{type(exc).__name__}: {exc}", note)
        lrs.append([float(g["lr"]) for g in opt.param_groups])
    return Simulation(lrs, None, note)


def plain_state(sd: Any) -> Any:
    """A scheduler state with tensors as Python numbers (fused optimizers keep LRs as 0-d tensors); dicts and
    lists are copied, anything that is not a number is kept as is. Never raises."""
    if isinstance(sd, dict):
        return {k: plain_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [plain_state(v) for v in sd]
    n = as_number(sd)
    if n is not None and not isinstance(sd, (int, float)):
        return n
    return sd


def depends_on_session(sch_sd: dict, n_groups: int, steps: int = 2
                       ) -> tuple[list[list[float | None]] | None, bool, str | None]:
    """For a state without optimizer state: the LRs of the steps after the next one (each after a
    ``scheduler.step()``), and whether they depend on the LR the session built its optimizer with (two sessions
    with different LRs are run).

    Returns:
        ``(LRs of steps 2..steps of the first session, or None; depends; raises)``.
    """
    a = simulate(sch_sd, archived_groups=None, session_lrs=[0.0123456789] * n_groups, steps=steps)
    b = simulate(sch_sd, archived_groups=None, session_lrs=[0.987654321] * n_groups, steps=steps)
    if a.raises or b.raises or len(a.lrs) < 2 or len(b.lrs) < 2:
        return None, False, a.raises or b.raises
    same = all(x == y or math.isclose(x, y, rel_tol=1e-12)
               for sa, sb in zip(a.lrs[1:], b.lrs[1:]) for x, y in zip(sa, sb))
    return a.lrs[1:], not same, None


__all__ = ["LR_FIELDS", "Simulation", "guessed_factors", "simulate", "depends_on_session"]
