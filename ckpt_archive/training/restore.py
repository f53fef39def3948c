"""Restore a checkpoint into live training objects, in the right order, with the structure checked first.

The rule for "the LR the next step will use" (see :func:`ckpt_archive.training.audit.audit`):
``optimizer.step()`` reads ``param_groups[i]["lr"]``; ``Optimizer.load_state_dict`` restores that value
from the checkpoint and ``LRScheduler.load_state_dict`` only restores the scheduler's own ``__dict__``
without writing any group. So after a restore in any order the next step uses the *archived optimizer
group's* ``lr``, unless the session policy re-imposes the session's (:func:`restore_training_state`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from ckpt_archive.errors import UsageError
from ckpt_archive.training.audit import PolicyAudit, audit, missing_scheduler_message
from ckpt_archive.training.parts import find_parts
from ckpt_archive.training.rng_restore import restore_rng
from ckpt_archive.training.changes import PolicyChange
from ckpt_archive.training.impose import impose_lrs
from ckpt_archive.training.session_config import archived_lr, lr_base_field, per_group, spread_scalar_lr
from ckpt_archive.training.structure import check_structure
from ckpt_archive.training.values import as_float, fmt_value, jsonable

#: The logger of :func:`restore_training_state`. Its name predates the split of the policy module and is
#: kept: it is documented (docs/policy.md) and users filter on it.
LOGGER_NAME = "ckpt_archive.training.policy"
_LOG = logging.getLogger(LOGGER_NAME)


@dataclasses.dataclass
class RestoreReport:
    """Result of :func:`restore_training_state`.

    Attributes:
        restored: parts loaded into live objects, in order (``model``, ``optimizer``, ``scheduler``,
            ``scaler``, ``rng``).
        skipped: part -> reason (no live object given, or no state for it).
        policy: ``"checkpoint"`` or ``"session"``.
        next_lrs: the LR the next optimizer step uses, per param group (read back from the live
            optimizer after the restore; from the audit when no optimizer was given).
        changes: fields rewritten under the session policy.
        rng: stream (``python``, ``numpy``, ``torch``, ``cuda``) -> what happened.
        bitwise_resumable: False when some saved state could not be restored (e.g. CUDA RNG states of
            devices that are not visible), or some part of a resume point is absent.
        warnings: human-readable lines (also logged).
        numpy_generator: a ``numpy.random.Generator`` holding a saved non-legacy NumPy bit generator
            state when no live generator was given for it, else None.
        audit: the :class:`PolicyAudit` of the state.
    """

    restored: list[str]
    skipped: dict
    policy: str
    next_lrs: list[float]
    changes: list[PolicyChange]
    rng: dict
    bitwise_resumable: bool
    warnings: list[str]
    numpy_generator: Any = None
    audit: PolicyAudit | None = None

    def to_json(self) -> dict:
        """The report as strict JSON (without ``numpy_generator`` and ``audit``)."""
        return jsonable({
            "restored": self.restored, "skipped": self.skipped, "policy": self.policy,
            "next_lrs": self.next_lrs, "changes": [c.to_json() for c in self.changes], "rng": self.rng,
            "bitwise_resumable": self.bitwise_resumable, "warnings": self.warnings,
        })


def restore_training_state(state: Any, *, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                           scaler: Any = None, rng: bool | dict = True, policy: str = "checkpoint",
                           session_lr: float | Sequence[float] | None = None, keys: dict | None = None,
                           logger: logging.Logger | None = None) -> RestoreReport:
    """Restore a checkpoint into live training objects, in the right order, structure checked first.

    Order: model, optimizer, scheduler, scaler, then the RNG streams last (so nothing that runs during the
    restore draws from a restored stream). Before any live object is touched: the model's keys and shapes,
    the optimizer's param-group count, group sizes ("group 0: saved 4, current 2" with the parameter names
    where ``model`` is given) and moment shapes, and the scheduler's group count are checked; on a
    mismatch :class:`IncoherentState` is raised and nothing has changed.

    Policy:
        * ``"checkpoint"``: the archived ``lr``/``initial_lr``/``base_lrs`` win (plain ``load_state_dict``).
        * ``"session"``: the session's base LR (``session_lr``, else each live group's ``lr`` read *before*
          the restore, i.e. what the session built its optimizer with) is re-imposed with the rule of
          :func:`~ckpt_archive.training.session.apply_session_policy`; moments and step counters stay exactly as archived.

    RNG (``rng=True``; ``False`` skips; a dict ``{"numpy": generator}`` restores a NumPy ``Generator`` in
    place): Python ``random.setstate``; NumPy legacy ``get_state()`` tuples and MT19937 dicts into
    ``np.random``, other bit generators (PCG64 ``bit_generator.state`` dicts) into the given generator or
    into ``report.numpy_generator``; torch CPU ``set_rng_state``; CUDA: one state per device, restored
    for the devices that are visible; fewer visible than saved gives a warning with both counts ("2 saved,
    0 visible") and ``bitwise_resumable=False``. RNG problems never raise.

    One line is logged (logger ``ckpt_archive.training.policy`` unless ``logger`` is given) with the LR the next
    step uses per group.

    Like ``Optimizer.load_state_dict`` itself, the live optimizer may keep the very tensors of ``state``
    (its ``step`` counters and, when dtype and device already match, its moments): training afterwards
    updates them in place. Pass ``copy.deepcopy(state)`` to keep an untouched copy.

    Args:
        state: nested checkpoint (see :func:`~ckpt_archive.training.parts.find_parts` for where parts are found).
        model: ``torch.nn.Module`` or None. optimizer: ``torch.optim.Optimizer`` or None.
        scheduler: an ``LRScheduler`` / ``ReduceLROnPlateau`` or None. scaler: ``GradScaler`` or None.
        rng: see above. policy: ``"checkpoint"`` or ``"session"``.
        session_lr: session base LR (float or one per group) for ``policy="session"``.
        keys: part -> path in ``state`` for non-conventional names (e.g. ``{"model": "net"}``).
        logger: where the one line goes.

    Returns:
        :class:`RestoreReport`.

    Raises:
        IncoherentState: structure mismatch (nothing restored), or a live object is given whose part the
            checkpoint lacks for ``model``.
        UsageError: bad ``policy`` or ``keys``; ``policy="session"`` without an optimizer.
    """
    log = logger or _LOG
    if policy not in ("checkpoint", "session"):
        raise UsageError(f"policy must be 'checkpoint' or 'session', not {policy!r}")
    if policy == "session" and optimizer is None:
        raise UsageError("policy='session' needs the live optimizer")
    found = find_parts(state, keys)
    a = audit(state, keys=keys)
    parts = {name: ((str(e[0][0]) or name, e[0][1]) if (e := found.get(name)) else (None, None))
             for name in ("model", "optimizer", "scheduler", "scaler")}
    check_structure(parts, model=model, optimizer=optimizer, scheduler=scheduler)
    session_bases = _session_bases(optimizer, session_lr, state, parts["optimizer"][1]) if policy == "session" else None
    policy_kw = _session_policy_kw(state, parts, scheduler, session_bases, session_lr) if policy == "session" else {}

    stale = _stale_scheduler_bases(state, parts, optimizer, keys) if policy == "checkpoint" else []
    live = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    restored, skipped, warnings = _load_in_order(parts, live, a)
    warnings.extend(stale)
    changes: list[PolicyChange] = []
    if policy == "session":
        changes = impose_lrs(optimizer.param_groups, scheduler, session_bases, parts["optimizer"][0] or "optimizer",
                             parts["scheduler"][0] or "scheduler", **policy_kw)

    # The RNG streams last: nothing that runs during the restore draws from a restored stream.
    rng_report, numpy_gen, bitwise = _restore_rng_last(found.get("rng"), rng, restored, skipped, warnings)
    next_lrs = ([float(as_float(g["lr"])) for g in optimizer.param_groups] if optimizer is not None
                else [g.next_lr for g in a.groups if g.next_lr is not None])
    # a live object given for a part the checkpoint lacks
    bitwise = bitwise and not any(skipped.get(p, f"no live {p} given") != f"no live {p} given"
                                  for p in ("optimizer", "scheduler", "scaler"))
    _log_summary(log, warnings, restored, a, policy, next_lrs)
    return RestoreReport(restored=restored, skipped=skipped, policy=policy, next_lrs=next_lrs, changes=changes,
                         rng=rng_report, bitwise_resumable=bitwise, warnings=warnings, numpy_generator=numpy_gen,
                         audit=a)


def _restore_rng_last(rng_part: list | None, rng: bool | dict, restored: list[str], skipped: dict,
                      warnings: list[str]) -> tuple[dict, Any, bool]:
    """Restore the RNG streams (after every other part); ``(report, numpy generator, bitwise)``."""
    if rng is False:
        skipped["rng"] = "rng=False"
        return {}, None, True
    if not rng_part:
        skipped["rng"] = "no RNG state in the checkpoint"
        warnings.append("no RNG state in the checkpoint: the random streams continue from this process's "
                        "seeds: not bitwise-resumable")
        return {}, None, False
    done = restore_rng(rng_part[0][1], rng)
    warnings.extend(done.warnings)
    restored.append("rng")
    return done.report, done.numpy_generator, done.bitwise


def _stale_scheduler_bases(state: Any, parts: dict, optimizer: Any, keys: dict | None) -> list[str]:
    """Under policy "checkpoint", a scheduler-only state whose ``base_lrs`` (also SequentialLR sub-schedulers')
    differ from the live optimizer's base LRs (read before the restore): the next step runs at the session's
    LR, then the next ``scheduler.step()`` switches to the archived bases. A warning, as the CLI's is."""
    if optimizer is None or parts["optimizer"][1] is not None or not isinstance(parts["scheduler"][1], dict):
        return []
    from ckpt_archive.training.session import compare_with_session

    bases = [as_float(g.get(lr_base_field(g))) for g in optimizer.param_groups]
    if None in bases:
        return []
    diffs = compare_with_session(state, session_config={"optimizer": {"param_groups": [{"lr": b} for b in bases]}},
                                 keys=keys)
    return [f"{d.field}: archived {fmt_value(d.archived)}, session {fmt_value(d.session)} (the live optimizer's base "
            f"LR): the checkpoint holds no optimizer state, so the next step runs at the session's LR, then the next "
            f"scheduler.step() computes from the archived base_lrs (takes effect {d.when}); policy='session' keeps "
            f"the session's"
            for d in diffs if ".base_lrs[" in d.field]


def _session_bases(optimizer: Any, session_lr: float | Sequence[float] | None, state: Any = None,
                   saved_optimizer: Any = None) -> list:
    """The session's base LR per group: ``session_lr``, else what the live optimizer was built with. A single
    ``session_lr`` for archived groups with different base LRs keeps each group's ratio
    (:func:`~ckpt_archive.training.session.spread_scalar_lr`, as ``apply_session_policy`` and the CLI do)."""
    if session_lr is not None:
        saved = [g for g in ((saved_optimizer or {}).get("param_groups") or []) if isinstance(g, dict)] \
            if isinstance(saved_optimizer, dict) else []
        if isinstance(session_lr, (list, tuple)) or len(saved) != len(optimizer.param_groups):
            return per_group(session_lr, len(optimizer.param_groups))
        return spread_scalar_lr(session_lr, [as_float(g.get(lr_base_field(g))) for g in saved],
                                archived_lr(state, None) if state is not None else None)
    return [as_float(g.get("max_lr", g.get("initial_lr", g["lr"]))) for g in optimizer.param_groups]


def _session_policy_kw(state: Any, parts: dict, scheduler: Any, session_bases: list,
                       session_lr: Any) -> dict:
    """What :func:`impose_lrs` needs besides the session bases, read before anything is loaded: a CyclicLR
    session's ``max_lrs`` (from the live scheduler as the session built it); a ReduceLROnPlateau's archived
    base per group (checked now, so a refusal comes before the live objects are touched).

    Raises:
        UsageError: a ReduceLROnPlateau state whose base cannot be told while the session's differs.
    """
    from ckpt_archive.training.lr_bases import base_kind, impose_plateau, plateau_bases

    kind = base_kind(scheduler)
    if kind == "cyclic":
        return {"want_max": None if session_lr is not None else list(getattr(scheduler, "max_lrs", []) or []) or None}
    saved = parts["optimizer"][1]
    if kind != "plateau" or not isinstance(saved, dict):
        return {}
    groups = [dict(g) for g in saved.get("param_groups") or [] if isinstance(g, dict)]
    ssd = parts["scheduler"][1] if isinstance(parts["scheduler"][1], dict) else {}
    olds = plateau_bases(groups, ssd, archived_lr(state, None))
    # The archived factor and min_lrs decide whether the lr is the session's base after whole reductions (a
    # dry run on copies: the archived state is not touched here).
    facts = {"factor": ssd.get("factor"), "min_lrs": list(ssd.get("min_lrs") or [])}
    impose_plateau(groups, facts, session_bases, olds, parts["optimizer"][0] or "optimizer", "scheduler", [])
    return {"archived_bases": olds}


def _load_in_order(parts: dict, live: dict, a: PolicyAudit) -> tuple[list[str], dict, list[str]]:
    """``load_state_dict`` of model, optimizer, scheduler, scaler (in that order) where both sides exist.

    Returns:
        ``(restored, skipped, warnings)``: a live object without saved state is skipped with a warning.
    """
    missing = {
        "model": "",  # a model given without model state was refused by check_structure
        "optimizer": "no optimizer state in the checkpoint: the optimizer keeps its fresh state (moments restart)",
        "scheduler": (missing_scheduler_message(a.counters) if any(f.field == "scheduler" for f in a.findings)
                      else "scheduler state missing: the scheduler stays at its freshly built position"),
        "scaler": "no GradScaler state in the checkpoint: the loss scale restarts at its initial value",
    }
    restored: list[str] = []
    skipped: dict = {}
    warnings: list[str] = []
    for name in ("model", "optimizer", "scheduler", "scaler"):
        obj, sd = live[name], parts[name][1]
        if obj is not None and sd is not None:
            obj.load_state_dict(sd)
            restored.append(name)
        elif obj is not None:
            warnings.append(missing[name])
            skipped[name] = missing[name]
        elif sd is not None:
            skipped[name] = f"no live {name} given"
    return restored, skipped, warnings


def _log_summary(log: logging.Logger, warnings: list[str], restored: list[str], a: PolicyAudit, policy: str,
                 next_lrs: list) -> None:
    """Each warning, then the one INFO line with the LR the next step uses per group."""
    for w in warnings:
        log.warning(w)
    pos = a.counters.get("progress_step") or a.counters.get("optimizer_step")
    where = f" at step {pos}" if pos is not None else ""
    log.info("restored %s%s (policy %s): next step LR %s", ", ".join(restored) or "nothing", where, policy,
             ", ".join(f"group {i}={fmt_value(v)}" for i, v in enumerate(next_lrs)) or "unknown")
