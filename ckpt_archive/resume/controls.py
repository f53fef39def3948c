"""The negative controls of ``check-resume``: the same resume from a deliberately broken state.

A tool-made control loads the archived state, perturbs one part in a type-preserving way and the
resumed run must then diverge; otherwise the check could not have seen that fault. :data:`_PERTURBERS`
is the table: control name -> a small function that perturbs that part (each RNG stream replaced by
another valid state, optimizer moments zeroed, scheduler one step stale, data cursor shifted).
:func:`control_verdict` judges a control's run.
"""
from __future__ import annotations

import copy
import dataclasses
import random as _random
from typing import Any, Callable, Sequence

from ckpt_archive.errors import CannotCheck, UsageError
from ckpt_archive.format.state_path import StatePath, children, walk
from ckpt_archive.resume.compare import short_value
from ckpt_archive.resume.runner import RunRecord
from ckpt_archive.training.parts import (is_numpy_legacy_rng_state, is_numpy_rng_state, is_python_rng_state, is_tensor,
                                         is_torch_rng_state)

#: Tool-made negative controls, in the order they run.
TOOL_CONTROLS = ("python-rng", "numpy-rng", "torch-rng", "optimizer-moments", "scheduler-stale", "data-cursor")

CONTROL_ALIASES = {
    "python": "python-rng", "random": "python-rng", "numpy": "numpy-rng", "torch": "torch-rng",
    "cuda": "torch-rng", "optimizer": "optimizer-moments", "moments": "optimizer-moments",
    "scheduler": "scheduler-stale", "lr-scheduler": "scheduler-stale", "data": "data-cursor",
    "cursor": "data-cursor",
}

CONTROL_LABELS = {
    "python-rng": "the Python RNG", "numpy-rng": "the NumPy RNG", "torch-rng": "the torch RNG",
    "optimizer-moments": "the optimizer moments (zeroed)", "scheduler-stale": "the LR scheduler (one step stale)",
    "data-cursor": "the data cursor (shifted)",
}

#: Control -> the random stream it perturbs.
STREAMS = {"python-rng": "python", "numpy-rng": "numpy", "torch-rng": "torch"}

_PERTURB_SEEDS = (0x5EED_C0DE, 0xBAD_5EED, 0xFACE_FEED)


def canonical_control(name: str) -> str:
    """Map a control name or alias (``numpy``, ``scheduler``) to its canonical name (``numpy-rng``).

    Raises:
        UsageError: unknown name (the message lists the known ones).
    """
    key = name.strip().lower()
    key = CONTROL_ALIASES.get(key, key)
    if key not in TOOL_CONTROLS:
        raise UsageError(f"unknown negative control {name!r}; known: {', '.join(TOOL_CONTROLS)} "
                         f"(or {', '.join(sorted(CONTROL_ALIASES))})")
    return key


def _like(template, values):
    """Rebuild ``values`` (a list) with the container type of ``template`` (tuple/list)."""
    return type(template)(values) if isinstance(template, (tuple, list)) else values


def _new_python_state(old, salt: int):
    """Another valid ``random.getstate()`` value, with the container and value types of ``old`` (a
    cached Gaussian stays a float, ``None`` stays ``None``)."""
    for seed in _PERTURB_SEEDS:
        r = _random.Random(seed + salt)
        if old[2] is not None:
            r.gauss(0.0, 1.0)  # leaves the second Gaussian of the pair cached: gauss_next a float
        new = r.getstate()
        if list(new[1]) != list(old[1]):
            break
    return _like(old, [new[0], _like(old[1], list(new[1])), _coerce_like(old[2], new[2])])


def _coerce_like(old, new):
    """``new`` converted to the type of ``old`` where both are plain values; containers recursively.

    A NumPy array or scalar in ``new`` (a fresh ``bit_generator.state`` holds arrays: MT19937 ``key``,
    SFC64 ``state``, Philox ``counter``) becomes what ``old`` held there: the list a checkpoint saved
    with ``.tolist()`` stays a list (``torch.load(weights_only=True)`` refuses NumPy arrays), a tensor
    stays a tensor of its dtype.
    """
    if type(new).__module__ == "numpy" and hasattr(new, "tolist") and type(old).__module__ != "numpy":
        new = new.tolist()
    if isinstance(old, dict) and isinstance(new, dict):
        out = type(old)()
        for k in old:
            out[k] = _coerce_like(old[k], new[k]) if k in new else old[k]
        return out
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new):
        return _like(old, [_coerce_like(o, n) for o, n in zip(old, new)])
    if is_tensor(old):
        import torch

        return torch.as_tensor(new, dtype=old.dtype).reshape(old.shape)
    if type(old).__module__ == "numpy":
        import numpy as np

        return np.asarray(new, dtype=getattr(old, "dtype", None)) if hasattr(old, "shape") and old.shape else type(old)(new)
    if isinstance(old, bool) or isinstance(new, bool):
        return type(old)(new)
    if isinstance(old, (int, float, str)) and old is not None:
        return type(old)(new)
    return new


def _new_numpy_state(old: dict, salt: int) -> dict:
    """Another valid state of the same NumPy bit generator, with the value types of ``old``."""
    import numpy as np

    cls = getattr(np.random, old["bit_generator"], None)
    if cls is None:
        raise CannotCheck(f"unknown NumPy bit generator {old['bit_generator']!r}")
    for seed in _PERTURB_SEEDS:
        new = cls(seed + salt).state
        if repr(new["state"]) != repr(old["state"]):
            break
    return _coerce_like(old, new)


def _new_numpy_legacy_state(old, salt: int):
    """Another valid legacy ``np.random.get_state()`` tuple, with the value types of ``old``."""
    import numpy as np

    new = np.random.RandomState(_PERTURB_SEEDS[0] + salt).get_state()
    return _like(old, [old[0], _coerce_like(old[1], new[1]), type(old[2])(new[2]), type(old[3])(new[3]),
                       type(old[4])(new[4])])


def _new_torch_state(old, salt: int):
    """Another valid torch generator state of the same length (CPU mt19937, or a CUDA seed and offset)."""
    import torch

    if old.numel() == 5056:
        for seed in _PERTURB_SEEDS:
            new = torch.Generator().manual_seed(seed + salt).get_state()
            if not torch.equal(new, old):
                return new.to(old.device)
    seed_and_offset = torch.tensor([_PERTURB_SEEDS[0] + salt, 0], dtype=torch.int64).view(torch.uint8)
    return seed_and_offset.clone().to(old.device)


def _show(path: StatePath) -> str:
    return str(path) or "<root>"


def _find_optimizer_states(state) -> list[StatePath]:
    return [path for path, node in walk(state, skip_top=("model",))
            if isinstance(node, dict) and "state" in node and "param_groups" in node
            and isinstance(node["param_groups"], (list, tuple))]


def _find_scheduler_states(state) -> list[StatePath]:
    return [path for path, node in walk(state, skip_top=("model", "optimizer", "rng", "data"))
            if isinstance(node, dict) and type(node.get("last_epoch")) is int
            and ("_step_count" in node or "base_lrs" in node or "_last_lr" in node)]


def _find_cursors(state) -> list[StatePath]:
    if isinstance(state, dict) and isinstance(state.get("data"), dict) and type(state["data"].get("cursor")) is int:
        return [StatePath(("data", "cursor"))]
    return [p for p, n in walk(state, skip_top=("model", "optimizer", "scheduler", "rng"))
            if p and p[-1] == "cursor" and type(n) is int]


def _replace_rng(st, salt: int, replacements: list[tuple[Callable, Callable]]) -> tuple[Any, list[str]]:
    """Replace every RNG state that a test of ``replacements`` accepts with its new state."""
    hits = []
    for path, node in walk(st, skip_top=("model", "optimizer", "scheduler")):
        for accepts, new_state in replacements:
            if accepts(path, node):
                hits.append((path, new_state(node, salt)))
                break
    # outermost first and no nested duplicates (a legacy tuple holds an array, not another state)
    for path, new in hits:
        st = path.set(st, new)
    return st, [_show(path) for path, _ in hits]


def _perturb_python_rng(st, salt: int, previous_lr):
    return _replace_rng(st, salt, [(lambda p, x: is_python_rng_state(x), _new_python_state)])


def _perturb_numpy_rng(st, salt: int, previous_lr):
    return _replace_rng(st, salt, [(lambda p, x: is_numpy_rng_state(x), _new_numpy_state),
                                   (lambda p, x: is_numpy_legacy_rng_state(x), _new_numpy_legacy_state)])


def _perturb_torch_rng(st, salt: int, previous_lr):
    return _replace_rng(st, salt, [(is_torch_rng_state, _new_torch_state)])


def _zero_moments(st, salt: int, previous_lr):
    """Every floating optimizer state tensor but ``step`` zeroed (``torch.zeros_like``)."""
    changed = []
    for opath in _find_optimizer_states(st):
        opt = opath.get(st)
        for pid, pstate in children(opt["state"]):
            if not isinstance(pstate, dict):
                continue
            for k, v in list(pstate.items()):
                if k != "step" and is_tensor(v) and (v.is_floating_point() or v.is_complex()):
                    import torch

                    pstate[k] = torch.zeros_like(v)
                    changed.append(_show(StatePath((*opath, "state", pid, k))))
    return st, changed


def _stale_scheduler(st, salt: int, previous_lr):
    """The scheduler one step back (``last_epoch``, ``_step_count``, ``_last_lr``), and the optimizer's LR
    as of that step: the LR the next update uses."""
    changed = []
    for spath in _find_scheduler_states(st):
        sch = spath.get(st)
        sch["last_epoch"] = sch["last_epoch"] - 1
        changed.append(_show(spath.child("last_epoch")))
        if type(sch.get("_step_count")) is int:
            sch["_step_count"] = sch["_step_count"] - 1
            changed.append(_show(spath.child("_step_count")))
        if previous_lr is not None and isinstance(sch.get("_last_lr"), (list, tuple)) \
                and len(sch["_last_lr"]) == len(previous_lr):
            sch["_last_lr"] = _coerce_like(sch["_last_lr"], list(previous_lr))
            changed.append(_show(spath.child("_last_lr")))
    if changed and previous_lr is not None:
        for opath in _find_optimizer_states(st):
            groups = opath.get(st)["param_groups"]
            if len(groups) == len(previous_lr):
                for i, g in enumerate(groups):
                    if isinstance(g, dict) and "lr" in g:
                        g["lr"] = _coerce_like(g["lr"], previous_lr[i])
                        changed.append(_show(opath.child("param_groups").at(i).child("lr")))
    return st, changed


def _shift_cursor(st, salt: int, previous_lr):
    """The data cursor one sample on (one back at the end of the permutation)."""
    changed = []
    for cpath in _find_cursors(st):
        cur = cpath.get(st)
        parent = cpath.parent.get(st)
        size = None
        if isinstance(parent, dict):
            for key in ("permutation", "order", "indices", "sample_order"):
                if key in parent and hasattr(parent[key], "__len__"):
                    size = len(parent[key])
                    break
        shift = -1 if (size is not None and cur + 1 > size) else 1
        st = cpath.set(st, type(cur)(cur + shift))
        changed.append(f"{_show(cpath)} {cur} -> {cur + shift}")
    return st, changed


#: Control -> ``f(state copy, salt, previous_lr) -> (state, changed paths)``.
_PERTURBERS = {
    "python-rng": _perturb_python_rng, "numpy-rng": _perturb_numpy_rng, "torch-rng": _perturb_torch_rng,
    "optimizer-moments": _zero_moments, "scheduler-stale": _stale_scheduler, "data-cursor": _shift_cursor,
}

_MISSING_NOTES = {
    "python-rng": "no Python random state (a random.getstate() tuple) in the checkpoint",
    "numpy-rng": "no NumPy generator state (a dict with 'bit_generator', or a legacy 'MT19937' tuple) in the checkpoint",
    "torch-rng": "no torch RNG state (a uint8 tensor from torch.get_rng_state()) in the checkpoint",
    "optimizer-moments": "the optimizer state holds no moment tensors (e.g. SGD without momentum)",
    "scheduler-stale": "no LR scheduler state (a dict with 'last_epoch') in the checkpoint",
    "data-cursor": "no data cursor ('data': {'cursor': int}) in the checkpoint",
}


def _type_change(old, new, path: StatePath = StatePath(())) -> str | None:
    """Where ``new`` holds another type than ``old`` (a list become an ndarray, a tuple a list, an int a
    float, a tensor of another dtype or shape), as ``"<path>: list -> ndarray"``; None when the types match
    all the way down. ``None`` and a float are both valid cached Gaussians and are not told apart."""
    if type(old) is not type(new):
        if {type(old), type(new)} <= {type(None), float}:
            return None
        return f"{_show(path)}: {type(old).__name__} -> {type(new).__name__}"
    if is_tensor(old):
        if old.dtype != new.dtype or old.shape != new.shape:
            return f"{_show(path)}: tensor {old.dtype} {tuple(old.shape)} -> {new.dtype} {tuple(new.shape)}"
        return None
    if isinstance(old, dict):
        if list(old) != list(new):
            return f"{_show(path)}: keys {list(old)} -> {list(new)}"
        for k in old:
            hit = _type_change(old[k], new[k], path.child(k))
            if hit:
                return hit
    elif isinstance(old, (list, tuple)):
        if len(old) != len(new):
            return f"{_show(path)}: {len(old)} items -> {len(new)}"
        for i, (o, n) in enumerate(zip(old, new)):
            hit = _type_change(o, n, path.at(i))
            if hit:
                return hit
    return None


@dataclasses.dataclass
class Perturbation:
    """What a tool-made control changed: ``applied`` is False when the part was not in the state."""

    name: str
    applied: bool
    changed: list[str]
    note: str = ""


def perturb(state, control: str, *, previous_lr: Sequence[float] | None = None) -> tuple[Any, Perturbation]:
    """Return a perturbed deep copy of ``state`` for the tool-made negative control ``control``.

    Every replacement keeps the type of what it replaces (tuple stays tuple, int stays int, a uint8
    tensor stays a uint8 tensor of the same length), so a correct restore code path accepts it.

    Args:
        state: the archived state (nested dict; conventional keys ``rng``, ``optimizer``,
            ``scheduler``, ``data``, ``progress``; parts are also found by their shape).
        control: one of :data:`TOOL_CONTROLS`.
        previous_lr: the LR of every param group in the last update before the interruption (the
            LR a one-step-stale scheduler would still hand out); used by ``scheduler-stale``.

    Returns:
        (new_state, Perturbation). ``Perturbation.applied`` is False (and the state unchanged) when
        the part is not in the state.

    Raises:
        CannotCheck: the perturbation would change a type somewhere (a list saved with ``.tolist()``
            become an array, which ``torch.load(weights_only=True)`` refuses): a control run from it
            would test the script's loader, not its resume.
    """
    control = canonical_control(control)
    st, changed = _PERTURBERS[control](copy.deepcopy(state), TOOL_CONTROLS.index(control), previous_lr)
    if changed:
        hit = _type_change(state, st)
        if hit:
            raise CannotCheck(f"control {control} could not perturb the state without changing a type ({hit})")
    applied = bool(changed)
    note = "" if applied else _MISSING_NOTES[control]
    if control == "optimizer-moments" and not applied and not _find_optimizer_states(st):
        note = "no optimizer state (a dict with 'state' and 'param_groups') in the checkpoint"
    return (st if applied else state), Perturbation(control, applied, changed, note)


def control_verdict(cmp: dict | None, *, name: str, kind: str, label: str, expected_no_effect: bool,
                     applied: bool = True, note: str = "", crashed: RunRecord | None = None) -> dict:
    """The ``negative_controls`` entry for one control, and whether it is acceptable (``ok``)."""
    entry: dict[str, Any] = {"name": name, "kind": kind, "diverged": False, "first_divergent_step": None,
                             "field": None, "expected": None, "got": None, "status": "", "ok": False,
                             "message": "", "changed": []}
    if not applied:
        entry.update(status="skipped", ok=True, message=f"not run: {note}")
        return entry
    if crashed is not None:
        # A run that failed tested nothing: "could not check", never "diverged" (a control that passes
        # because its script refused the perturbed file would show nothing about the resume).
        what = (f"exited {crashed.exit_code}" if crashed.exit_code not in (0, None)
                else "wrote no checkpoint.pt/trajectory.json")
        tail = crashed.stderr_tail(2)
        entry.update(status="could-not-check", ok=False, field="exit_code", expected=0, got=crashed.exit_code,
                     message=f"could not check control {name}: its run {what}"
                             + (f": {tail}" if tail else "") + f" (log: {crashed.output / 'stderr.log'})")
        return entry
    assert cmp is not None
    fd = cmp["first_divergence"]
    if cmp["diverged"]:
        entry.update(diverged=True, status="diverged", ok=True)
        if fd:
            entry.update(first_divergent_step=fd["step"], field=fd["field"], expected=fd.get("expected"),
                         got=fd.get("got"))
            entry["message"] = (f"diverged at update {fd['step']}, field {fd['field']}: expected "
                                f"{short_value(fd.get('expected'))}, got {short_value(fd.get('got'))}")
        else:
            entry["message"] = "diverged: " + "; ".join(cmp["structure"])
        if expected_no_effect:
            entry["message"] += " (declared --expect-no-effect, but perturbing it did change the run)"
    elif expected_no_effect:
        entry.update(status="no-effect-expected", ok=True,
                     message=f"perturbing {label} changed nothing, as declared with --expect-no-effect")
    else:
        entry.update(status="no-effect", ok=False,
                     message=f"perturbing {label} changed nothing: either it is not restored or not used"
                             + (" (declare an unused stream with --expect-no-effect)" if kind == "tool" else ""))
    return entry


def script_control_name(args: Sequence[str]) -> str:
    """``["--omit-rng-restore"]`` -> ``"omit-rng-restore"`` (the name in ``negative_controls``)."""
    return " ".join(args).lstrip("-") or "script"


__all__ = ["TOOL_CONTROLS", "CONTROL_ALIASES", "CONTROL_LABELS", "STREAMS", "canonical_control", "Perturbation",
           "perturb", "control_verdict", "script_control_name"]
