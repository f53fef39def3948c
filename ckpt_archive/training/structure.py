"""Does a checkpoint fit the live training objects? Checked before any of them is touched.

:func:`check_structure` compares the model's keys and shapes, the optimizer's param-group count,
group sizes (naming the parameters where it can) and moment shapes, and the scheduler's group count,
and raises :class:`~ckpt_archive.errors.IncoherentState` on the first mismatch: a restore that fails
here has changed nothing.
"""
from __future__ import annotations

from typing import Any

from ckpt_archive.errors import IncoherentState
from ckpt_archive.training.parts import ALIASES, is_tensor

#: Per-parameter optimizer state entries that have the parameter's shape.
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                "acc_delta", "sum", "exp_inf", "ax", "prev", "eta_prev")


def _param_names(model: Any) -> dict[int, str]:
    """``id(parameter)`` -> its name in ``model`` (``{}`` without a model)."""
    if model is None or not hasattr(model, "named_parameters"):
        return {}
    return {id(p): n for n, p in model.named_parameters()}


def _shape(t: Any) -> list[int] | None:
    """A tensor's shape as a list of ints (None for something without a shape)."""
    s = getattr(t, "shape", None)
    return None if s is None else [int(x) for x in s]


def _check_model(sd: Any, model: Any, field: str) -> None:
    """The saved model state has the live model's keys and shapes."""
    if not isinstance(sd, dict):
        raise IncoherentState(f"{field} is not a state_dict (a {type(sd).__name__})", where=field)
    live = model.state_dict()
    missing = [k for k in live if k not in sd]
    unexpected = [k for k in sd if k not in live]
    bad = [(k, _shape(sd[k]), _shape(live[k])) for k in live if k in sd and is_tensor(sd[k])
           and is_tensor(live[k]) and _shape(sd[k]) != _shape(live[k])]
    problems = []
    if missing:
        problems.append(f"missing in the checkpoint: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    for k, a, b in bad[:8]:
        problems.append(f"{k}: saved shape {a}, current {b}")
    if problems:
        raise IncoherentState("model state does not match the live model (nothing was restored): "
                              + "; ".join(problems), where=field)


def _check_optimizer(sd: Any, optimizer: Any, model: Any, field: str) -> None:
    """The saved optimizer state has the live optimizer's groups, group sizes and moment shapes."""
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), (list, tuple)):
        raise IncoherentState(f"{field} is not an optimizer state_dict (no param_groups)", where=field)
    saved = list(sd["param_groups"])
    live = optimizer.param_groups
    names = _param_names(model)
    state = sd.get("state") or {}
    if len(saved) != len(live):
        raise IncoherentState(
            f"optimizer param groups do not match (nothing was restored): saved {len(saved)} group(s), current "
            f"{len(live)}", where=f"{field}.param_groups")
    problems = []
    for i, (sg, lg) in enumerate(zip(saved, live)):
        sp = list(sg.get("params") or [])
        lp = list(lg["params"])
        if len(sp) != len(lp):
            problems.append(f"group {i}: saved {len(sp)}, current {len(lp)}"
                            + _describe_params(sg, sp, state, lp, names, model))
            continue
        for j, (sid, p) in enumerate(zip(sp, lp)):
            st = state.get(sid)
            if st is None and isinstance(sid, int):
                st = state.get(str(sid))
            if not isinstance(st, dict):
                continue
            for key in _MOMENT_KEYS:
                if key in st and is_tensor(st[key]) and st[key].dim() > 0 and _shape(st[key]) != _shape(p):
                    who = names.get(id(p), f"param {j}")
                    problems.append(f"group {i}: {who}: saved {key} shape {_shape(st[key])}, current parameter "
                                    f"shape {_shape(p)}")
                    break
    if problems:
        raise IncoherentState("optimizer param groups do not match (nothing was restored): " + "; ".join(problems),
                              where=f"{field}.param_groups")


def _describe_params(sg: dict, sp: list, state: dict, lp: list, names: dict, model: Any) -> str:
    """`` (saved: names; current: names)`` for a group whose size differs (saved names by shape if needed)."""
    cur = [names.get(id(p), f"<unnamed {_shape(p)}>") for p in lp]
    saved_names = sg.get("param_names")
    if isinstance(saved_names, (list, tuple)) and len(saved_names) == len(sp):
        saved = [str(n) for n in saved_names]
    else:
        by_shape: dict[tuple, list[str]] = {}
        if model is not None:
            for n, p in model.named_parameters():
                by_shape.setdefault(tuple(_shape(p)), []).append(n)
        saved = []
        for sid in sp:
            st = state.get(sid) if isinstance(state, dict) else None
            shape = None
            if isinstance(st, dict):
                for key in _MOMENT_KEYS:
                    if key in st and is_tensor(st[key]):
                        shape = _shape(st[key])
                        break
            cands = by_shape.get(tuple(shape), []) if shape is not None else []
            if len(cands) == 1:
                saved.append(f"{cands[0]} {shape} (by shape)")
            else:
                saved.append(f"param {sid} {shape if shape is not None else '?'}")
    return f" (saved: {', '.join(saved)}; current: {', '.join(cur)})"


def check_structure(parts: dict[str, tuple[str | None, Any]], *, model: Any, optimizer: Any, scheduler: Any) -> None:
    """Check that the saved parts fit the live objects given (a part or object that is absent is not checked).

    Args:
        parts: part name (``model``, ``optimizer``, ``scheduler``) -> ``(field, saved state)``, both None
            when the checkpoint lacks the part; ``field`` names it in messages.
        model / optimizer / scheduler: the live objects, or None.

    Raises:
        IncoherentState: a model is given but the checkpoint holds none, or a saved part does not fit
            (the message says what differs and that nothing was restored).
    """
    mfield, msd = parts["model"]
    ofield, osd = parts["optimizer"]
    sfield, ssd = parts["scheduler"]
    if model is not None:
        if msd is None:
            raise IncoherentState("a model was given but the checkpoint holds no model state (looked for "
                                  f"{', '.join(ALIASES['model'][:4])}, ...; pass keys={{'model': PATH}})")
        _check_model(msd, model, mfield)
    if optimizer is not None and osd is not None:
        _check_optimizer(osd, optimizer, model, ofield)
    if scheduler is not None and ssd is not None and optimizer is not None:
        n = len(ssd.get("_last_lr") or ssd.get("base_lrs") or [])
        if n and n != len(optimizer.param_groups):
            raise IncoherentState(f"scheduler state has {n} param group(s), the optimizer {len(optimizer.param_groups)} "
                                  "(nothing was restored)", where=sfield)


__all__ = ["check_structure"]
