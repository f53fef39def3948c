"""Progress versus policy: what a checkpoint will really do to the next optimizer step.

A checkpoint carries *progress* (moments, counters, RNG, data cursor) and, hidden inside the optimizer's
``param_groups``, a *policy* (learning rate, weight decay, ...). ``optimizer.load_state_dict`` restores
both, so a session that lowered its LR in its config silently trains with the archived one; an optimizer
loaded before its scheduler was built silently trains with the scheduler's warm-up value. This module
makes those facts visible and gives a restore that does them in the right order:

* :func:`audit` -> :class:`PolicyAudit`: per param group ``lr``, ``initial_lr``, the scheduler's
  ``base_lrs`` and ``_last_lr``, the LR derived from the scheduler's closed form, and the LR the next
  step will use; the counters (optimizer step, scheduler ``last_epoch``, progress step/epoch); findings.
* :func:`compare_with_session` -> list of :class:`PolicyDifference` (archived vs session values).
* :func:`apply_session_policy`: rewrite ``lr``/``initial_lr``/``base_lrs``/``_last_lr`` in a copy.
* :func:`restore_training_state`: restore model, optimizer, scheduler, scaler, RNG (last) into live
  objects after checking the structure, under the ``"checkpoint"`` or ``"session"`` policy.
* :func:`lint_completeness`: what a resume from this state will lose ("not bitwise-resumable: ...").

Everything here works on the plain nested state (as returned by ``torch.load(weights_only=True)`` or
:func:`ckpt_archive.load`); nothing is unpickled and no scheduler object is rebuilt.

The rule for "the LR the next step will use" (see :func:`audit`): ``optimizer.step()`` reads
``param_groups[i]["lr"]``; ``Optimizer.load_state_dict`` restores that value from the checkpoint and
``LRScheduler.load_state_dict`` only restores the scheduler's own ``__dict__`` without writing any
group (torch/optim/lr_scheduler.py, ``LRScheduler.load_state_dict``). So after a restore in any order
the next step uses the *archived optimizer group's* ``lr``; the scheduler first writes a new LR at the
``scheduler.step()`` that follows that optimizer step. When the scheduler was stepped consistently the
group's ``lr`` equals the scheduler's ``_last_lr`` (``LRScheduler._update_lr`` writes both from the same
list) and, for schedulers with a closed form, the value derived from ``base_lrs`` and ``last_epoch``.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from ckpt_archive.errors import IncoherentState, SourceError, UsageError

LOGGER_NAME = "ckpt_archive.training.policy"
_LOG = logging.getLogger(LOGGER_NAME)

#: Relative tolerance for "the same LR" between optimizer, scheduler ``_last_lr`` and session values.
#: torch writes the very same float in both places, so any real difference is far above this.
LR_RTOL = 1e-9
#: Relative tolerance between ``_last_lr`` and the closed-form LR: chainable (recursive) forms such as
#: ``CosineAnnealingLR.get_lr`` accumulate rounding over many steps.
DERIVED_RTOL = 1e-6

# ---------------------------------------------------------------------------------------------------
# Data classes
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Finding:
    """One observation about a state.

    Attributes:
        severity: ``"warning"`` (a resume may be wrong or lossy) or ``"error"`` (a resume from this state
            is wrong or will raise).
        field: path of the field in the state, e.g. ``"optimizer.param_groups[0].lr"``.
        message: one line saying what is wrong and what it costs.
    """

    severity: str
    field: str
    message: str

    def to_json(self) -> dict:
        return {"severity": self.severity, "field": self.field, "message": self.message}

    def __str__(self) -> str:
        return f"{self.severity}: {self.field}: {self.message}"


@dataclasses.dataclass
class GroupPolicy:
    """The LR facts of one optimizer param group (all LRs are floats, in the optimizer's LR unit).

    Attributes:
        index: param group index.
        field: path of the group, e.g. ``"optimizer.param_groups[0]"``.
        n_params: number of parameters (tensors) in the group, or None when unknown.
        lr: the group's ``lr`` as archived (what the next ``optimizer.step()`` uses).
        initial_lr: the group's ``initial_lr`` (present once a scheduler was attached), else None.
        base_lr: the scheduler's ``base_lrs[index]``, else None.
        last_lr: the scheduler's ``_last_lr[index]``, else None.
        derived_lr: the scheduler's closed form at its ``last_epoch`` (None where not derivable).
        next_lr: the LR the next optimizer step will use (see the module docstring), or None.
        next_lr_basis: where ``next_lr`` comes from, in words.
        hyper: other group hyperparameters (weight_decay, momentum, betas, eps) as archived.
    """

    index: int
    field: str
    n_params: int | None = None
    lr: float | None = None
    initial_lr: float | None = None
    base_lr: float | None = None
    last_lr: float | None = None
    derived_lr: float | None = None
    next_lr: float | None = None
    next_lr_basis: str = ""
    hyper: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return _jsonable(d)


@dataclasses.dataclass
class PolicyAudit:
    """Result of :func:`audit`.

    Attributes:
        parts: part name (``model``, ``optimizer``, ``scheduler``, ``scaler``, ``rng``, ``data``,
            ``progress``) -> path in the state where it was found (absent parts are not listed).
        groups: one :class:`GroupPolicy` per param group of the (first) optimizer.
        scheduler: ``kind`` (e.g. ``"CosineAnnealingLR"``, ``"unknown"``, ``None`` when absent),
            ``field``, ``last_epoch``, ``derivable`` (bool) and ``note``.
        counters: ``optimizer_step`` (int|None, Adam-like ``state[*]["step"]``, the max over parameters),
            ``optimizer_step_min``, ``scheduler_last_epoch``, ``progress_step``, ``progress_epoch``.
        findings: list of :class:`Finding`.
    """

    parts: dict
    groups: list[GroupPolicy]
    scheduler: dict
    counters: dict
    findings: list[Finding]

    @property
    def next_lrs(self) -> list[float | None]:
        """The LR the next optimizer step uses, per param group."""
        return [g.next_lr for g in self.groups]

    def to_json(self) -> dict:
        """Strict JSON (RFC 8259): non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
        return _jsonable({
            "parts": dict(self.parts),
            "groups": [g.to_json() for g in self.groups],
            "scheduler": dict(self.scheduler),
            "counters": dict(self.counters),
            "findings": [f.to_json() for f in self.findings],
        })

    def rows(self) -> list[dict]:
        """One row per param group, values formatted for a table (strings, ``"-"`` where absent)."""
        out = []
        several = len({g.field.rsplit(".param_groups", 1)[0] for g in self.groups}) > 1
        for g in self.groups:
            out.append({
                "group": g.field.replace(".param_groups", "") if several else str(g.index),
                "params": "-" if g.n_params is None else str(g.n_params),
                "lr": fmt_value(g.lr),
                "initial_lr": fmt_value(g.initial_lr),
                "base_lr": fmt_value(g.base_lr),
                "last_lr": fmt_value(g.last_lr),
                "derived_lr": fmt_value(g.derived_lr),
                "next_lr": fmt_value(g.next_lr),
            })
        return out

    def counter_rows(self) -> list[tuple[str, str]]:
        names = [("optimizer step", "optimizer_step"), ("scheduler last_epoch", "scheduler_last_epoch"),
                 ("progress step", "progress_step"), ("progress epoch", "progress_epoch")]
        return [(label, fmt_value(self.counters.get(key))) for label, key in names]

    def table(self):
        """A :class:`rich.table.Table` of :meth:`rows` (rich imported lazily)."""
        from rich import box
        from rich.table import Table

        kind = self.scheduler.get("kind") or "none"
        t = Table(title=f"LR policy (scheduler: {kind})", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
        for col in ("group", "params", "lr", "initial_lr", "base_lr", "last_lr", "derived_lr", "next_lr"):
            t.add_column(col, justify="right" if col != "group" else "left")
        for r in self.rows():
            t.add_row(*r.values())
        return t

    def __rich__(self):
        from rich.console import Group
        from rich.text import Text

        counters = ", ".join(f"{k} {v}" for k, v in self.counter_rows())
        items: list = [self.table(), Text(f"counters: {counters}")]
        for f in self.findings:
            items.append(Text(str(f), style="red" if f.severity == "error" else "yellow"))
        return Group(*items)

    def lines(self) -> list[str]:
        """Plain text lines (a fixed-width table, counters, findings) for logs and non-rich output."""
        rows = self.rows()
        out = [f"LR policy (scheduler: {self.scheduler.get('kind') or 'none'})"]
        if rows:
            cols = list(rows[0])
            widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
            out.append("  ".join(c.rjust(widths[c]) for c in cols))
            for r in rows:
                out.append("  ".join(r[c].rjust(widths[c]) for c in cols))
        out.append("counters: " + ", ".join(f"{k} {v}" for k, v in self.counter_rows()))
        out.extend(str(f) for f in self.findings)
        return out


@dataclasses.dataclass
class PolicyDifference:
    """One archived-vs-session difference (:func:`compare_with_session`).

    Attributes:
        field: path in the state, e.g. ``"optimizer.param_groups[0].lr"``.
        archived: the value in the checkpoint.
        session: the value the session asks for.
        wins: ``"checkpoint"`` or ``"session"``: which value the next step uses under the policy.
        switch: the CLI switch that selects the other one (``"--policy session"`` / ``"--policy
            checkpoint"``).
        message: one line with all of the above.
    """

    field: str
    archived: Any
    session: Any
    wins: str
    switch: str
    message: str

    def to_json(self) -> dict:
        return _jsonable(dataclasses.asdict(self))

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass
class PolicyChange:
    """One field rewritten by :func:`apply_session_policy` (``old`` -> ``new``)."""

    field: str
    old: Any
    new: Any

    def to_json(self) -> dict:
        return _jsonable(dataclasses.asdict(self))

    def __str__(self) -> str:
        return f"{self.field}: {fmt_value(self.old)} -> {fmt_value(self.new)}"


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
        return _jsonable({
            "restored": self.restored, "skipped": self.skipped, "policy": self.policy,
            "next_lrs": self.next_lrs, "changes": [c.to_json() for c in self.changes], "rng": self.rng,
            "bitwise_resumable": self.bitwise_resumable, "warnings": self.warnings,
        })


# ---------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------


def fmt_value(v: Any) -> str:
    """Format a value for messages: floats with 7 significant digits (``0.001``, ``1e-05``); ``"-"`` for None."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.7g}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(fmt_value(x) for x in v)
        return f"({inner})" if isinstance(v, tuple) else f"[{inner}]"
    return str(v)


def _fmt_pair(a: Any, b: Any) -> tuple[str, str]:
    """Format two values so that different values never print the same (falls back to ``repr``)."""
    fa, fb = fmt_value(a), fmt_value(b)
    if fa == fb and a != b:
        return repr(a), repr(b)
    return fa, fb


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    num = _num(obj)
    if num is not None:
        return _jsonable(num)
    return str(obj)


def _num(v: Any) -> float | int | None:
    """A Python number from an int/float/0-d tensor/numpy scalar; None otherwise (bools excluded)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v
    numel = getattr(v, "numel", None)
    if callable(numel):  # torch tensor
        try:
            if numel() == 1:
                return v.item()
        except Exception:
            return None
        return None
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "shape", None) in ((), None):
        try:
            x = item()
        except Exception:
            return None
        return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None
    return None


def _float(v: Any) -> float | None:
    n = _num(v)
    return None if n is None else float(n)


def _close(a: float | None, b: float | None, rtol: float = LR_RTOL) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return False
    return a == b or math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def _fmt_path(path: Sequence) -> str:
    out = ""
    for k in path:
        if isinstance(k, int):
            out += f"[{k}]"
        else:
            out += ("." if out else "") + str(k)
    return out


def _parse_path(text: str | Sequence) -> tuple:
    if not isinstance(text, str):
        return tuple(text)
    parts: list = []
    for tok in re.findall(r"[^.\[\]]+|\[\d+\]", text):
        parts.append(int(tok[1:-1]) if tok.startswith("[") else tok)
    return tuple(parts)


def _get(state: Any, path: Sequence) -> Any:
    cur = state
    for k in path:
        if isinstance(k, int) and isinstance(cur, (list, tuple)):
            cur = cur[k]
        elif isinstance(cur, dict):
            cur = cur[k]
        else:
            raise KeyError(k)
    return cur


def _is_tensor(v: Any) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype")


# ---------------------------------------------------------------------------------------------------
# Finding the parts of a checkpoint
# ---------------------------------------------------------------------------------------------------

PARTS = ("model", "optimizer", "scheduler", "scaler", "rng", "data", "progress")

#: Conventional names (normalised: lowercase, file extension and ``_<rank>`` suffix removed).
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("model", "model_state_dict", "model_state", "state_dict", "net", "network", "module",
              "pytorch_model", "weights", "params"),
    "optimizer": ("optimizer", "optimizer_state_dict", "optimizer_state", "optim", "optim_state_dict", "opt",
                  "optimizer_states", "optimizers"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict", "lr_scheduler_state_dict",
                  "scheduler_state", "sched", "lr_schedulers", "schedulers"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict", "amp_scaler", "amp", "native_amp_scaling_state",
               "gradscaler"),
    "rng": ("rng", "rng_state", "rng_states", "random_states", "rngs", "random"),
    "data": ("data", "data_state", "dataloader", "dataloader_state", "sampler", "sampler_state", "data_cursor",
             "loader", "loader_state", "data_loader"),
    "progress": ("progress", "trainer_state", "training_state", "train_state", "loop_state"),
}

_PROGRESS_STEP_KEYS = ("step", "global_step", "iteration", "iter", "steps", "optimizer_step", "update")
_PROGRESS_EPOCH_KEYS = ("epoch", "epochs", "current_epoch")


def _norm_key(key: Any) -> str:
    k = str(key).lower().rsplit("/", 1)[-1]
    k = re.sub(r"\.(pt|pth|bin|pkl|safetensors|ckpt|json)$", "", k)
    k = re.sub(r"_\d+$", "", k)
    return k


def _looks_like(part: str, obj: Any) -> bool:
    if part == "optimizer":
        return isinstance(obj, dict) and "param_groups" in obj and "state" in obj
    if part == "scheduler":
        return isinstance(obj, dict) and "last_epoch" in obj and (
            "base_lrs" in obj or "_last_lr" in obj or "_schedulers" in obj or "patience" in obj)
    if part == "scaler":
        return isinstance(obj, dict) and "scale" in obj and "growth_factor" in obj
    return False


def find_parts(state: Any, keys: dict | None = None) -> dict[str, list[tuple[tuple, Any]]]:
    """Locate the parts of a resume point in a nested state.

    Args:
        state: the nested checkpoint (a dict; for a folder source, a dict of relpath -> object).
        keys: part name -> path in ``state`` (``"opt"``, ``"train.optimizer"``, ``("a", 0)``) overriding
            the conventional names.

    Returns:
        part name -> list of ``(path, object)``; a list because Lightning keeps ``optimizer_states`` and
        ``lr_schedulers`` as lists (one entry per optimizer). ``progress`` holds a synthetic dict
        ``{"step": int|None, "epoch": int|None}`` gathered from ``progress`` or top-level counters.

    Raises:
        UsageError: a path given in ``keys`` does not exist in ``state``.
    """
    found: dict[str, list[tuple[tuple, Any]]] = {}
    keys = dict(keys or {})
    for part, spec in keys.items():
        if part not in PARTS:
            raise UsageError(f"unknown part {part!r} in keys (known: {', '.join(PARTS)})")
        path = _parse_path(spec)
        try:
            obj = _get(state, path)
        except (KeyError, IndexError, TypeError):
            raise UsageError(f"keys[{part!r}]: no {_fmt_path(path)!r} in the checkpoint") from None
        found[part] = _expand(part, path, obj)
    if not isinstance(state, dict):
        return found
    # 1. conventional names at the top level, then one level down (e.g. {"checkpoint": {...}}).
    for depth_state, prefix in _containers(state):
        for key, obj in depth_state.items():
            nk = _norm_key(key)
            for part, names in ALIASES.items():
                if part in found or nk not in names:
                    continue
                if part == "model" and not isinstance(obj, dict):
                    continue
                if part in ("optimizer", "scheduler") and not (
                        _looks_like(part, obj) or (isinstance(obj, (list, tuple)) and obj
                                                   and all(_looks_like(part, x) for x in obj))):
                    continue
                if part == "scaler" and not isinstance(obj, dict):
                    continue
                found[part] = _expand(part, prefix + (key,), obj)
    # 2. by shape, anywhere within three levels (an optimizer nested under an unusual key).
    for part in ("optimizer", "scheduler", "scaler"):
        if part not in found:
            hits = list(_scan(state, part, (), 3))
            if hits:
                found[part] = hits
    # A bare model state_dict (every value a tensor) is the model itself.
    if "model" not in found and state and all(_is_tensor(v) or isinstance(v, TensorStub) for v in state.values()):
        found["model"] = [((), state)]
    prog = _progress_of(state, found.get("progress"))
    if prog is not None:
        found["progress"] = [prog]
    return found


def _containers(state: dict) -> Iterable[tuple[dict, tuple]]:
    yield state, ()
    for key, obj in state.items():
        if isinstance(obj, dict) and _norm_key(key) not in ALIASES["model"] and not _looks_like("optimizer", obj):
            if any(_norm_key(k) in ALIASES["optimizer"] + ALIASES["scheduler"] for k in obj):
                yield obj, (key,)


def _expand(part: str, path: tuple, obj: Any) -> list[tuple[tuple, Any]]:
    if part in ("optimizer", "scheduler") and isinstance(obj, (list, tuple)):
        return [(path + (i,), x) for i, x in enumerate(obj)]
    return [(path, obj)]


def _scan(obj: Any, part: str, path: tuple, depth: int):
    if depth < 0:
        return
    if _looks_like(part, obj):
        yield path, obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)):
                yield from _scan(v, part, path + (k,), depth - 1)
    elif isinstance(obj, list) and len(obj) <= 16:
        for i, v in enumerate(obj):
            if isinstance(v, dict):
                yield from _scan(v, part, path + (i,), depth - 1)


def _progress_of(state: dict, given: list | None) -> tuple[tuple, dict] | None:
    step = epoch = None
    where: tuple = ()
    sources: list[tuple[tuple, dict]] = []
    if given:
        sources.extend((p, o) for p, o in given if isinstance(o, dict))
    else:
        for key, obj in state.items():
            if _norm_key(key) in ALIASES["progress"] and isinstance(obj, dict):
                sources.append(((key,), obj))
    sources.append(((), state))
    for path, obj in sources:
        for k in _PROGRESS_STEP_KEYS:
            if step is None and k in obj and isinstance(_num(obj[k]), int):
                step, where = int(_num(obj[k])), path
        for k in _PROGRESS_EPOCH_KEYS:
            if epoch is None and k in obj and isinstance(_num(obj[k]), int):
                epoch = int(_num(obj[k]))
                where = where or path
    if step is None and epoch is None:
        return None
    return where, {"step": step, "epoch": epoch}


# ---------------------------------------------------------------------------------------------------
# Schedulers: identify the kind from the state_dict's keys, derive the LR from the closed form
# ---------------------------------------------------------------------------------------------------


def scheduler_kind(sd: dict) -> str:
    """Name the torch scheduler class a state_dict comes from, by its keys (no class name is saved).

    Returns one of ``SequentialLR``, ``ChainedScheduler``, ``OneCycleLR``, ``CyclicLR``,
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
            out.extend([int(e)] * int(_num(c) or 0))
    elif isinstance(m, (list, tuple)):
        out = [int(_num(x)) for x in m]
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
    e = _num(sd.get("last_epoch"))
    bases = [_float(b) for b in (sd.get("base_lrs") or [])]
    try:
        if kind == "SequentialLR":
            ms = [int(_num(m)) for m in sd.get("_milestones") or []]
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
            if e > int(_num(sd["total_steps"])):
                return kind, None, f"last_epoch {e} exceeds total_steps {sd['total_steps']}"
            lrs = []
            for g in groups:
                start = 0.0
                phases = sd["_schedule_phases"]
                for i, ph in enumerate(phases):
                    end = float(_num(ph["end_step"]))
                    if e <= end or i == len(phases) - 1:
                        pct = (e - start) / (end - start)
                        a, b = float(_num(g[ph["start_lr"]])), float(_num(g[ph["end_lr"]]))
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
            g, s = float(_num(sd["gamma"])), int(_num(sd["step_size"]))
            return kind, [b * g ** (e // s) for b in bases], ""
        if kind == "MultiStepLR":
            g = float(_num(sd["gamma"]))
            n = bisect.bisect_right(_milestones(sd["milestones"]), e)
            return kind, [b * g ** n for b in bases], ""
        if kind == "ExponentialLR":
            g = float(_num(sd["gamma"]))
            return kind, [b * g ** e for b in bases], ""
        if kind == "CosineAnnealingLR":
            tm, mn = float(_num(sd["T_max"])), float(_num(sd["eta_min"]))
            return kind, [mn + (b - mn) * (1 + math.cos(math.pi * e / tm)) / 2 for b in bases], ""
        if kind == "CosineAnnealingWarmRestarts":
            mn, tc, ti = float(_num(sd["eta_min"])), float(_num(sd["T_cur"])), float(_num(sd["T_i"]))
            return kind, [mn + (b - mn) * (1 + math.cos(math.pi * tc / ti)) / 2 for b in bases], ""
        if kind == "LinearLR":
            s0, s1, n = float(_num(sd["start_factor"])), float(_num(sd["end_factor"])), int(_num(sd["total_iters"]))
            return kind, [b * (s0 + (s1 - s0) * min(n, e) / n) for b in bases], ""
        if kind == "ConstantLR":
            f, n = float(_num(sd["factor"])), int(_num(sd["total_iters"]))
            return kind, [b * (f + (e >= n) * (1 - f)) for b in bases], ""
        if kind == "PolynomialLR":
            p, n = float(_num(sd["power"])), int(_num(sd["total_iters"]))
            return kind, [b * (1.0 - min(n, e) / n) ** p for b in bases], ""
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return kind, None, f"state incomplete for {kind} ({type(exc).__name__}: {exc})"
    if kind == "LambdaLR":
        return kind, None, "the lambda is code, not state: the next LR cannot be derived; _last_lr reported"
    if kind == "ReduceLROnPlateau":
        return kind, None, "depends on the metric history: the LR stays until the plateau rule fires"
    return kind, None, f"{kind}: no closed form known here"


# ---------------------------------------------------------------------------------------------------
# audit
# ---------------------------------------------------------------------------------------------------


def _optimizer_steps(opt_sd: dict) -> list[int]:
    steps = []
    st = opt_sd.get("state")
    if isinstance(st, dict):
        for v in st.values():
            if isinstance(v, dict) and "step" in v:
                n = _num(v["step"])
                if n is not None and math.isfinite(n):
                    steps.append(int(n))
    return steps


def _position_words(counters: dict) -> str:
    if counters.get("progress_epoch") is not None:
        return f"at epoch {counters['progress_epoch']}"
    for key in ("progress_step", "optimizer_step"):
        if counters.get(key) is not None:
            return f"at step {counters[key]}"
    return "at the archived position"


def _missing_scheduler_message(counters: dict) -> str:
    return (f"scheduler state missing: the LR {_position_words(counters)} cannot be rebuilt from counters "
            f"(the optimizer's param groups carry initial_lr, so a scheduler was attached; a rebuilt "
            f"scheduler restarts its schedule)")


def _audit_pair(opt_field: str, opt: Any, sch_field: str, sch: Any, findings: list[Finding]
                ) -> tuple[list[GroupPolicy], dict, list]:
    """Groups of one optimizer (and its scheduler): LR facts and consistency findings."""
    sched_info: dict = {"kind": None, "field": None, "last_epoch": None, "derivable": False, "note": ""}
    groups_sd = opt.get("param_groups") if isinstance(opt, dict) else None
    if groups_sd is not None and not isinstance(groups_sd, (list, tuple)):
        findings.append(Finding("error", f"{opt_field}.param_groups", "param_groups is not a list"))
        groups_sd = None
    groups_sd = list(groups_sd or [])

    derived: list[float] | None = None
    bases: list = []
    last: list = []
    if isinstance(sch, dict):
        kind, derived, note = derive_lrs(sch, [g for g in groups_sd if isinstance(g, dict)] or None)
        le = _num(sch.get("last_epoch"))
        sched_info.update(kind=kind, field=sch_field, last_epoch=le, derivable=derived is not None, note=note)
        bases = list(sch.get("base_lrs") or [])
        last = list(sch.get("_last_lr") or [])
        if sched_info["kind"] == "OneCycleLR" and le is not None and "total_steps" in sch:
            total = int(_num(sch["total_steps"]))
            if int(le) >= total:
                findings.append(Finding("error", f"{sch_field}.last_epoch",
                                        f"OneCycleLR at last_epoch {int(le)} of total_steps {total}: the next "
                                        f"scheduler.step() raises ValueError (\"Tried to step {int(le) + 1} "
                                        f"times\"); resume with a new schedule"))
        n_sched = len(last) or len(bases)
        if groups_sd and n_sched and n_sched != len(groups_sd):
            findings.append(Finding("error", f"{sch_field}._last_lr",
                                    f"the scheduler has {n_sched} param group(s), the optimizer "
                                    f"{len(groups_sd)}: they do not come from the same optimizer"))

    groups: list[GroupPolicy] = []
    n = max(len(groups_sd), len(last), len(bases))
    for i in range(n):
        g = groups_sd[i] if i < len(groups_sd) and isinstance(groups_sd[i], dict) else None
        gfield = f"{opt_field}.param_groups[{i}]"
        gp = GroupPolicy(index=i, field=gfield)
        if g is not None:
            params = g.get("params")
            gp.n_params = len(params) if isinstance(params, (list, tuple)) else None
            raw_lr = g.get("lr")
            gp.lr = _float(raw_lr)
            if raw_lr is not None and gp.lr is None:
                findings.append(Finding("error", f"{gfield}.lr", f"lr is not a number: {raw_lr!r}"))
            elif gp.lr is not None and not math.isfinite(gp.lr):
                findings.append(Finding("error", f"{gfield}.lr", f"lr is {gp.lr}: every update will be non-finite"))
            gp.initial_lr = _float(g.get("initial_lr"))
            for h in ("weight_decay", "momentum", "betas", "eps", "max_lr", "min_lr"):
                if h in g:
                    v = g[h]
                    gp.hyper[h] = [_float(x) for x in v] if isinstance(v, (list, tuple)) else _num(v)
        gp.base_lr = _float(bases[i]) if i < len(bases) else None
        gp.last_lr = _float(last[i]) if i < len(last) else None
        gp.derived_lr = derived[i] if derived is not None and i < len(derived) else None
        if gp.lr is not None:
            gp.next_lr = gp.lr
            gp.next_lr_basis = "optimizer group lr (load_state_dict restores it; optimizer.step() reads it)"
        elif gp.last_lr is not None:
            gp.next_lr = gp.last_lr
            gp.next_lr_basis = "scheduler _last_lr (no optimizer state)"
        groups.append(gp)

        # -- consistency --------------------------------------------------------------------------
        if gp.lr is not None and gp.last_lr is not None and not _close(gp.lr, gp.last_lr):
            a, b = _fmt_pair(gp.lr, gp.last_lr)
            findings.append(Finding(
                "warning", f"{gfield}.lr",
                f"optimizer lr {a} != scheduler last LR {b} ({sch_field}._last_lr[{i}]): the optimizer state "
                f"was loaded before its scheduler was built (the scheduler's constructor rewrote lr), or the "
                f"policy was overridden; the next step uses {a}"))
        if gp.derived_lr is not None:
            ref = gp.last_lr if gp.last_lr is not None else gp.lr
            ref_field = f"{sch_field}._last_lr[{i}]" if gp.last_lr is not None else f"{gfield}.lr"
            if ref is not None and not _close(ref, gp.derived_lr, DERIVED_RTOL):
                a, b = _fmt_pair(ref, gp.derived_lr)
                findings.append(Finding(
                    "warning", ref_field,
                    f"{a} differs from {sched_info['kind']} at last_epoch {sched_info['last_epoch']} "
                    f"({b}, from base_lrs): the LR was changed by hand or the scheduler state was edited"))
        if gp.initial_lr is not None and gp.base_lr is not None and not _close(gp.initial_lr, gp.base_lr):
            a, b = _fmt_pair(gp.initial_lr, gp.base_lr)
            findings.append(Finding("warning", f"{gfield}.initial_lr",
                                    f"initial_lr {a} != scheduler base_lrs[{i}] {b}: the optimizer and scheduler "
                                    f"states come from different configurations"))

    return groups, sched_info, groups_sd


def audit(state: Any, *, config: dict | str | Path | None = None, progress: dict | None = None,
          keys: dict | None = None) -> PolicyAudit:
    """Audit the LR policy and counters of a checkpoint.

    Args:
        state: nested checkpoint dict (``torch.load(weights_only=True)`` or :func:`ckpt_archive.load`).
            Parts are found under conventional keys (see :data:`ALIASES`) or by shape.
        config: the experiment's config (dict or path of JSON/YAML/TOML); not needed for the audit
            itself, accepted so callers can pass one object to audit and lint.
        progress: ``{"step": int, "epoch": int}`` from the manifest, overriding what the state holds.
        keys: part -> path overrides, as in :func:`find_parts`.

    Returns:
        :class:`PolicyAudit`. The LR the next step will use (``next_lr``) is the archived optimizer
        group's ``lr`` (``Optimizer.load_state_dict`` restores it, ``LRScheduler.load_state_dict`` never
        writes a group, and ``optimizer.step()`` reads ``group["lr"]``); without an optimizer it is the
        scheduler's ``_last_lr``. Findings:

        * warning ``optimizer.param_groups[i].lr``: the group's lr differs from the scheduler's
          ``_last_lr`` (the optimizer was loaded before its scheduler was built, or the policy was
          overridden): the next step uses the optimizer's value;
        * warning ``scheduler._last_lr[i]``: ``_last_lr`` differs from the closed-form value;
        * warning ``scheduler.last_epoch``: the scheduler lags (or leads) the progress counters;
        * warning ``optimizer.state``: progress step and optimizer step disagree, or per-parameter
          step counters differ;
        * warning ``scheduler``: scheduler state missing although ``initial_lr`` shows one was attached;
        * error: non-finite or non-numeric lr, a scheduler with a different number of groups than the
          optimizer, a OneCycleLR whose next step raises (``last_epoch >= total_steps``).

    Raises:
        UsageError: a ``keys`` path does not exist.

    Example:
        >>> a = audit({"optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}})
        >>> a.next_lrs
        [0.1]
    """
    parts = find_parts(state, keys)
    findings: list[Finding] = []
    opt_entries = parts.get("optimizer", [])
    sch_entries = parts.get("scheduler", [])
    opt_path, opt = opt_entries[0] if opt_entries else ((), None)
    sch_path, sch = sch_entries[0] if sch_entries else ((), None)
    opt_field = _fmt_path(opt_path) or "optimizer"
    sch_field = _fmt_path(sch_path) or "scheduler"

    prog = dict(parts["progress"][0][1]) if parts.get("progress") else {"step": None, "epoch": None}
    if progress:
        for k in ("step", "epoch"):
            if progress.get(k) is not None:
                prog[k] = int(progress[k])

    steps = _optimizer_steps(opt) if isinstance(opt, dict) else []
    counters = {
        "optimizer_step": max(steps) if steps else None,
        "optimizer_step_min": min(steps) if steps else None,
        "scheduler_last_epoch": None,
        "progress_step": prog.get("step"),
        "progress_epoch": prog.get("epoch"),
    }

    sched_info: dict = {"kind": None, "field": None, "last_epoch": None, "derivable": False, "note": ""}
    groups: list[GroupPolicy] = []
    groups_sd: list = []
    for n, (o_path, o) in enumerate(opt_entries or [((), None)]):
        s_path, s = sch_entries[n] if n < len(sch_entries) else ((), None)
        if o is None and n == 0 and s is None:
            break
        g_n, info_n, gsd_n = _audit_pair(_fmt_path(o_path) or "optimizer", o, _fmt_path(s_path) or "scheduler", s,
                                         findings)
        groups.extend(g_n)
        if n == 0:
            sched_info, groups_sd = info_n, gsd_n
    le0 = sched_info.get("last_epoch")
    counters["scheduler_last_epoch"] = None if le0 is None else int(le0)

    # -- counters --------------------------------------------------------------------------------------
    if steps and min(steps) != max(steps):
        findings.append(Finding("warning", f"{opt_field}.state",
                                f"per-parameter step counters differ (min {min(steps)}, max {max(steps)}): "
                                f"parameters were added to the optimizer later (unfrozen), or the state was "
                                f"merged from different runs"))
    ps, pe = counters["progress_step"], counters["progress_epoch"]
    os_ = counters["optimizer_step"]
    if ps is not None and os_ is not None and ps != os_:
        findings.append(Finding("warning", f"{opt_field}.state",
                                f"counters disagree: optimizer step {os_} vs progress step {ps} (AMP-skipped "
                                f"steps or gradient accumulation can explain optimizer < progress; otherwise the "
                                f"parts were saved at different instants)"))
    le = counters["scheduler_last_epoch"]
    if le is not None and sched_info["kind"] != "ReduceLROnPlateau":
        cands = {k: v for k, v in (("progress step", ps), ("optimizer step", os_), ("progress epoch", pe))
                 if v is not None}
        # A per-epoch scheduler stepped at the end of epoch E, saved with ``epoch: E`` (the common
        # ``for epoch in ...: train; scheduler.step(); save(epoch=epoch)``, and Lightning on an epoch's
        # last batch) has last_epoch E + 1: in step with progress, not ahead of it.
        accepted = set(cands.values()) | ({pe + 1} if pe is not None else set())
        if cands and le not in accepted:
            name, val = min(cands.items(), key=lambda kv: abs(kv[1] - le))
            what = "lags" if le < val else "is ahead of"
            findings.append(Finding("warning", f"{sch_field}.last_epoch",
                                    f"scheduler {what} progress: last_epoch {le} vs {name} {val} (a missed or extra "
                                    f"scheduler.step(), or scheduler state from another save): the LR schedule "
                                    f"is shifted by {abs(val - le)}"))
    if sch is None and groups_sd and any(isinstance(g, dict) and "initial_lr" in g for g in groups_sd):
        findings.append(Finding("warning", "scheduler", _missing_scheduler_message(counters)))
        sched_info["note"] = "missing (initial_lr present in param groups)"

    part_paths = {p: _fmt_path(v[0][0]) or "(top level)" for p, v in parts.items() if v}
    return PolicyAudit(parts=part_paths, groups=groups, scheduler=sched_info, counters=counters,
                       findings=findings)


# ---------------------------------------------------------------------------------------------------
# Session config
# ---------------------------------------------------------------------------------------------------

_LR_NAMES = ("lr", "learning_rate", "base_lr", "max_lr")
_HYPER_NAMES = {
    "weight_decay": ("weight_decay", "wd"),
    "momentum": ("momentum",),
    "eps": ("eps", "adam_epsilon", "epsilon"),
}


def load_config(config: dict | str | Path | None) -> dict:
    """Read a config: a dict as is, or a JSON / YAML / TOML file (by extension; JSON when unknown).

    Raises:
        SourceError: the file is missing or cannot be parsed (the message names the file).
    """
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    p = Path(config)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SourceError(f"cannot read config: {exc.strerror or exc}", where=str(p)) from None
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            from ruamel.yaml import YAML

            data = YAML(typ="safe").load(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise SourceError(f"cannot parse config ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                          where=str(p)) from None
    if not isinstance(data, dict):
        raise SourceError("config is not a mapping", where=str(p))
    return data


def _flatten(d: Any, prefix: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flatten(v, prefix + (str(k),))
    else:
        yield prefix, d


def _coerce_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return _float(v)


def session_values(session_config: dict | str | Path | None) -> dict:
    """The policy values a session config asks for.

    Looks (case-insensitively) for ``lr`` / ``learning_rate`` / ``base_lr`` / ``max_lr``, preferring keys under
    ``optimizer``/``optim``, then top level, then anywhere; likewise ``weight_decay``, ``momentum``, ``eps``
    (``adam_epsilon``), and ``betas`` (or ``adam_beta1``/``adam_beta2``, as in Hugging Face
    TrainingArguments). Per-group values: ``optimizer.param_groups: [{lr: ...}, ...]``.

    Returns:
        ``{"lr": float | list[float] | None, "weight_decay": ..., "momentum": ..., "eps": ..., "betas": ...}``
        with absent values left out, and ``"source"``: field -> config key path used.

    Raises:
        SourceError: unreadable config file.
    """
    cfg = load_config(session_config)
    flat = list(_flatten(cfg))

    def pick(names: tuple[str, ...]) -> tuple[str, Any] | None:
        best = None
        for path, v in flat:
            if not path or path[-1].lower() not in names:
                continue
            if "param_groups" in path:
                continue
            rank = 0 if any(p.lower() in ("optimizer", "optim", "opt") for p in path[:-1]) else (
                1 if len(path) == 1 else 2)
            if best is None or rank < best[0]:
                best = (rank, ".".join(path), v)
        return None if best is None else (best[1], best[2])

    out: dict = {"source": {}}
    pg = None
    for key in ("optimizer", "optim"):
        sub = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(sub, dict) and isinstance(sub.get("param_groups"), list):
            pg = sub["param_groups"]
    if isinstance(cfg.get("param_groups"), list):
        pg = cfg["param_groups"]
    if pg:
        lrs = [_coerce_float(g.get("lr")) if isinstance(g, dict) else None for g in pg]
        if all(x is not None for x in lrs):
            out["lr"] = lrs
            out["source"]["lr"] = "param_groups[*].lr"
    if "lr" not in out:
        hit = pick(_LR_NAMES)
        if hit is not None:
            v = hit[1]
            val = [_coerce_float(x) for x in v] if isinstance(v, (list, tuple)) else _coerce_float(v)
            if val is not None and not (isinstance(val, list) and None in val):
                out["lr"] = val
                out["source"]["lr"] = hit[0]
    for name, aliases in _HYPER_NAMES.items():
        hit = pick(aliases)
        if hit is not None and _coerce_float(hit[1]) is not None:
            out[name] = _coerce_float(hit[1])
            out["source"][name] = hit[0]
    hit = pick(("betas",))
    if hit is not None and isinstance(hit[1], (list, tuple)) and len(hit[1]) == 2:
        out["betas"] = tuple(_coerce_float(x) for x in hit[1])
        out["source"]["betas"] = hit[0]
    else:
        b1, b2 = pick(("adam_beta1", "beta1")), pick(("adam_beta2", "beta2"))
        if b1 and b2 and _coerce_float(b1[1]) is not None and _coerce_float(b2[1]) is not None:
            out["betas"] = (_coerce_float(b1[1]), _coerce_float(b2[1]))
            out["source"]["betas"] = f"{b1[0]}, {b2[0]}"
    return out


# ---------------------------------------------------------------------------------------------------
# compare_with_session
# ---------------------------------------------------------------------------------------------------


def _per_group(value: Any, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) == n:
            return list(value)
        if len(value) == 1:
            return list(value) * n
        raise UsageError(f"session gives {len(value)} LRs for {n} param groups")
    return [value] * n


def _lr_base_field(g: dict) -> str:
    """Which group field holds the *base* LR a config's ``lr`` sets."""
    if "max_lr" in g:  # OneCycleLR: its max_lr is the configured LR
        return "max_lr"
    if "initial_lr" in g:
        return "initial_lr"
    return "lr"


def compare_with_session(state: Any, *, session_config: dict | str | Path | None = None,
                         expect_lr: float | Sequence[float] | None = None, policy: str = "checkpoint",
                         keys: dict | None = None) -> list[PolicyDifference]:
    """Compare the archived policy with the session's.

    Args:
        state: nested checkpoint.
        session_config: the session's config (dict or JSON/YAML/TOML path): ``lr`` is the *base* LR
            (compared with the group's ``initial_lr`` when a scheduler was attached, with ``max_lr`` for
            OneCycleLR, else with ``lr``); ``weight_decay``, ``momentum``, ``eps``, ``betas`` with the
            group's fields. See :func:`session_values`.
        expect_lr: the LR the session expects the *next step* to use (float, or one per group); compared
            with the audit's ``next_lr`` (field ``...param_groups[i].lr``).
        policy: ``"checkpoint"`` (default: ``optimizer.load_state_dict`` overrides the session's values) or
            ``"session"``; decides ``wins`` and the switch named for the other choice.
        keys: part -> path overrides (see :func:`find_parts`).

    Returns:
        One :class:`PolicyDifference` per field whose values differ (relative tolerance
        :data:`LR_RTOL`); equal values give nothing.

    Raises:
        UsageError: bad ``policy``, or as many LRs as neither 1 nor the number of groups.
        SourceError: unreadable config file.
    """
    if policy not in ("checkpoint", "session"):
        raise UsageError(f"policy must be 'checkpoint' or 'session', not {policy!r}")
    wins = policy
    switch = "--policy session" if policy == "checkpoint" else "--policy checkpoint"
    entries = find_parts(state, keys).get("optimizer", [])
    sess = session_values(session_config)
    diffs: list[PolicyDifference] = []

    def add(field: str, archived: Any, session: Any, what: str) -> None:
        a, s = _fmt_pair(archived, session)
        if wins == "checkpoint":
            tail = (f"the checkpoint's value wins (optimizer.load_state_dict restores it); {switch} keeps the "
                    f"session's")
        else:
            tail = f"the session's value wins (--policy session rewrites it); {switch} keeps the checkpoint's"
        diffs.append(PolicyDifference(field, archived, session, wins, switch,
                                      f"{field}: archived {a}, session {s} ({what}); {tail}"))

    for opt_path, opt in entries:
        opt_field = _fmt_path(opt_path) or "optimizer"
        groups = [g for g in (opt.get("param_groups") or []) if isinstance(g, dict)]
        if "lr" in sess:
            for i, (g, want) in enumerate(zip(groups, _per_group(sess["lr"], len(groups)))):
                fname = _lr_base_field(g)
                have = _float(g.get(fname))
                if want is not None and have is not None and not _close(have, want):
                    what = f"config {sess['source']['lr']}"
                    if fname != "lr":
                        what += f"; {fname} is the schedule's base LR"
                    add(f"{opt_field}.param_groups[{i}].{fname}", have, want, what)
        for name in ("weight_decay", "momentum", "eps"):
            if name in sess:
                for i, g in enumerate(groups):
                    have = _float(g.get(name))
                    if have is not None and not _close(have, sess[name]):
                        add(f"{opt_field}.param_groups[{i}].{name}", have, sess[name],
                            f"config {sess['source'][name]}")
        if "betas" in sess:
            for i, g in enumerate(groups):
                b = g.get("betas")
                if isinstance(b, (list, tuple)) and len(b) == 2:
                    have = tuple(_float(x) for x in b)
                    if not all(_close(x, y) for x, y in zip(have, sess["betas"])):
                        add(f"{opt_field}.param_groups[{i}].betas", have, tuple(sess["betas"]),
                            f"config {sess['source']['betas']}")
    if expect_lr is not None:
        a = audit(state, keys=keys)
        for i, (gp, want) in enumerate(zip(a.groups, _per_group(expect_lr, len(a.groups)))):
            want = _coerce_float(want)
            if gp.next_lr is not None and want is not None and not _close(gp.next_lr, want):
                field = f"{gp.field}.lr" if gp.lr is not None else f"{a.scheduler.get('field')}._last_lr[{i}]"
                add(field, gp.next_lr, want, "--expect-lr: the LR of the next step")
    return diffs


# ---------------------------------------------------------------------------------------------------
# apply_session_policy
# ---------------------------------------------------------------------------------------------------


def _rescale(value: float, old_base: float, new_base: float) -> float:
    """``value`` at the same point of the schedule with base ``new_base`` (exact when value == old_base)."""
    if value == old_base:
        return new_base
    if old_base == 0:
        return value
    return value / old_base * new_base


def _copy_tree(obj: Any) -> Any:
    """Copy dicts/lists/tuples (keeping dict subclasses' types); tensors and arrays are shared, not copied."""
    if isinstance(obj, dict):
        try:
            new = copy.copy(obj)
        except Exception:
            new = dict(obj)
        for k, v in obj.items():
            new[k] = _copy_tree(v)
        return new
    if isinstance(obj, list):
        return [_copy_tree(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_copy_tree(v) for v in obj)
    return obj


def _same_type(template: Any, value: float) -> Any:
    """Keep a tensor LR a tensor (fused/capturable optimizers store lr as a 0-d tensor)."""
    if _is_tensor(template):
        import torch

        return torch.tensor(value, dtype=template.dtype, device=template.device)
    return value


def _impose_lrs(groups: list, sch: Any, wants: list, ofield: str, sfield: str) -> list[PolicyChange]:
    """Re-impose session base LRs on param groups (dicts) and a scheduler (state dict or live object).

    The rule of :func:`apply_session_policy`; used on a copied state and on live objects alike.
    """
    changes: list[PolicyChange] = []
    sd = None if sch is None else (sch if isinstance(sch, dict) else getattr(sch, "__dict__", None))
    sched_bases = list((sd or {}).get("base_lrs") or [])
    olds: list = []
    news: list = []
    for i, g in enumerate(groups):
        fname = _lr_base_field(g)
        old = _float(g.get(fname))
        if fname == "lr" and i < len(sched_bases) and _float(sched_bases[i]) is not None:
            old = _float(sched_bases[i])
        want = _coerce_float(wants[i]) if i < len(wants) else None
        olds.append(old)
        news.append(want)
        if old is None or want is None:
            continue
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):
            if key in g and _float(g[key]) is not None:
                fv = _float(g[key])
                nv = _rescale(fv, old, want)
                if nv != fv:
                    g[key] = _same_type(g[key], nv)
                    changes.append(PolicyChange(f"{ofield}.param_groups[{i}].{key}", fv, nv))
    if isinstance(sd, dict):
        _rescale_scheduler(sd, sfield, olds, news, changes)
        # Where the schedule has a closed form, the LR at the archived position is the closed form with the
        # session's base (exact also for absolute floors such as eta_min, which a ratio would scale).
        view = sch if isinstance(sch, dict) else (sch.state_dict() if hasattr(sch, "state_dict") else None)
        _, lrs, _ = derive_lrs(view, list(groups)) if isinstance(view, dict) else (None, None, "")
        if lrs is not None and len(lrs) == len(groups):
            for i, (g, v) in enumerate(zip(groups, lrs)):
                if news[i] is None or olds[i] is None or _float(g.get("lr")) is None:
                    continue
                fv = _float(g["lr"])
                if v != fv:
                    g["lr"] = _same_type(g["lr"], v)
                    _replace_change(changes, f"{ofield}.param_groups[{i}].lr", fv, v)
            last = sd.get("_last_lr")
            if isinstance(last, list) and len(last) == len(groups):
                for i, g in enumerate(groups):
                    if news[i] is not None and _float(g.get("lr")) is not None and _float(last[i]) != _float(g["lr"]):
                        _replace_change(changes, f"{sfield}._last_lr[{i}]", _float(last[i]), _float(g["lr"]))
                        last[i] = _same_type(last[i], _float(g["lr"]))
    return changes


def _replace_change(changes: list[PolicyChange], field: str, old: float, new: float) -> None:
    """Record ``field: old -> new``, merging with an earlier change of the same field (keeps its ``old``)."""
    for c in changes:
        if c.field == field:
            c.new = new
            return
    changes.append(PolicyChange(field, old, new))


def _rescale_scheduler(sd: dict, path: str, olds: list, news: list, changes: list) -> None:
    for key in ("base_lrs", "_last_lr"):
        vals = sd.get(key)
        if isinstance(vals, (list, tuple)):
            new_vals = list(vals)
            for i, v in enumerate(vals):
                fv = _float(v)
                if fv is None or i >= len(olds) or olds[i] is None or news[i] is None:
                    continue
                nv = _rescale(fv, olds[i], news[i])
                if nv != fv:
                    new_vals[i] = _same_type(v, nv)
                    changes.append(PolicyChange(f"{path}.{key}[{i}]", fv, nv))
            sd[key] = type(vals)(new_vals) if isinstance(vals, tuple) else new_vals
    for j, sub in enumerate(sd.get("_schedulers") or []):
        sub_d = sub if isinstance(sub, dict) else getattr(sub, "__dict__", None)
        if isinstance(sub_d, dict):
            _rescale_scheduler(sub_d, f"{path}._schedulers[{j}]", olds, news, changes)


def apply_session_policy(state: Any, *, lr: float | Sequence[float] | None = None,
                         session_config: dict | str | Path | None = None,
                         keys: dict | None = None) -> tuple[Any, list[PolicyChange]]:
    """Re-impose the session's LR (and hyperparameters) on a copy of the checkpoint.

    The session's LR is the *base* LR (what a config's ``lr`` means). For each param group with archived
    base ``B`` (``max_lr`` for OneCycleLR, else ``initial_lr``, else the scheduler's ``base_lrs[i]``, else
    ``lr``) and session base ``S``, every LR field ``v`` of the group (``lr``, ``initial_lr``, ``max_lr``,
    ``min_lr``) and of the scheduler (``base_lrs``, ``_last_lr``, also inside SequentialLR/ChainedScheduler
    sub-schedulers) becomes ``S`` where ``v == B`` and ``v / B * S`` otherwise; where the scheduler has a
    closed form (:func:`derive_lrs`), ``lr`` and ``_last_lr`` are then that closed form at ``last_epoch``
    with the session's base (exact with absolute floors such as ``eta_min``). The schedule continues at the
    same point from the session's base. Without a scheduler the LR is exactly ``S``. Session
    ``weight_decay``/``momentum``/``eps``/``betas`` replace the group's values. Optimizer moments and
    step counters are not touched: the returned state shares those tensor objects with ``state``.

    Args:
        state: nested checkpoint (not modified).
        lr: session base LR (float, or one per param group); overrides the config's.
        session_config: dict or JSON/YAML/TOML path (see :func:`session_values`).
        keys: part -> path overrides.

    Returns:
        ``(new_state, changes)``: a structural copy and the list of :class:`PolicyChange`.

    Raises:
        UsageError: no optimizer state, or as many LRs as neither 1 nor the number of groups.
        SourceError: unreadable config file.
    """
    sess = session_values(session_config)
    if lr is not None:
        sess["lr"] = lr
    new_state = _copy_tree(state)
    parts = find_parts(new_state, keys)
    changes: list[PolicyChange] = []
    opt_entries = parts.get("optimizer", [])
    if not opt_entries:
        if "lr" in sess or any(k in sess for k in _HYPER_NAMES):
            raise UsageError("the checkpoint has no optimizer state: there is no policy to rewrite")
        return new_state, changes
    sch_entries = parts.get("scheduler", [])
    for n, (opt_path, opt) in enumerate(opt_entries):
        opt_field = _fmt_path(opt_path) or "optimizer"
        groups = [g for g in (opt.get("param_groups") or []) if isinstance(g, dict)]
        sch = sch_entries[n][1] if n < len(sch_entries) else None
        sch_field = _fmt_path(sch_entries[n][0]) if n < len(sch_entries) else "scheduler"
        if "lr" in sess:
            changes += _impose_lrs(groups, sch, _per_group(sess["lr"], len(groups)), opt_field, sch_field)
        for name in ("weight_decay", "momentum", "eps"):
            if name in sess:
                for i, g in enumerate(groups):
                    if name in g and _float(g[name]) is not None and _float(g[name]) != sess[name]:
                        changes.append(PolicyChange(f"{opt_field}.param_groups[{i}].{name}", _float(g[name]),
                                                    sess[name]))
                        g[name] = sess[name]
        if "betas" in sess:
            for i, g in enumerate(groups):
                b = g.get("betas")
                if isinstance(b, (list, tuple)) and tuple(_float(x) for x in b) != tuple(sess["betas"]):
                    changes.append(PolicyChange(f"{opt_field}.param_groups[{i}].betas",
                                                tuple(_float(x) for x in b), tuple(sess["betas"])))
                    g["betas"] = type(b)(sess["betas"])
    return new_state, changes


# ---------------------------------------------------------------------------------------------------
# lint_completeness
# ---------------------------------------------------------------------------------------------------

_RNG_STREAMS = ("python", "numpy", "torch")


def _rng_streams(rng: Any) -> dict[str, Any]:
    """Classify the entries of an RNG part into ``python``, ``numpy``, ``torch`` (CPU), ``cuda``."""
    out: dict[str, Any] = {}
    if not isinstance(rng, dict):
        return out
    for key, val in rng.items():
        k = str(key).lower()
        if "cuda" in k or "gpu" in k:
            out.setdefault("cuda", val)
        elif "numpy" in k or k.startswith("np") or k in ("numpy_random_seed",):
            out.setdefault("numpy", val)
        elif "python" in k or k in ("py", "random", "random_state", "py_rng", "python_rng"):
            out.setdefault("python", val)
        elif "torch" in k or "cpu" in k:
            out.setdefault("torch", val)
        elif "xla" in k or "mps" in k or "npu" in k or "xpu" in k:
            out.setdefault(k, val)
    return out


def _amp_configured(cfg: dict) -> str | None:
    for path, v in _flatten(cfg):
        if not path:
            continue
        k = path[-1].lower()
        name = ".".join(path)
        if k in ("fp16", "amp", "use_amp", "half", "use_fp16", "mixed_precision_fp16") and v is True:
            return f"{name}={v!r}"
        if k in ("mixed_precision", "precision", "amp_dtype", "autocast_dtype") and v is not None:
            s = str(v).lower()
            if ("16" in s and "bf16" not in s and "bfloat" not in s) or s == "fp16":
                return f"{name}={v!r}"
    return None


def lint_completeness(state: Any, *, config: dict | str | Path | None = None, progress: dict | None = None,
                      keys: dict | None = None) -> list[Finding]:
    """What a resume from this state will lose. All findings are warnings ("not bitwise-resumable: ...").

    Checked: RNG state (Python, NumPy, torch CPU; missing streams named), data order (a permutation /
    cursor / sampler state, or a ``cursor`` in ``progress``), optimizer state (missing or with empty
    ``state``: the moments restart), scheduler (missing although the param groups carry ``initial_lr``),
    AMP configured (config ``fp16: true``, ``mixed_precision: fp16``, ``precision: 16-mixed``, ...) without
    GradScaler state.

    ``verify --strict`` turns each of these into a failure (exit 1); without ``--strict`` they are printed
    and the exit code is unaffected.

    Args:
        state: nested checkpoint.
        config: the experiment's config (dict or JSON/YAML/TOML path), used for the AMP check.
        progress: manifest progress (``step``, ``epoch``, ``cursor``).
        keys: part -> path overrides.

    Returns:
        list of :class:`Finding` (severity ``"warning"``).
    """
    cfg = load_config(config)
    if not cfg and isinstance(state, dict):  # the trainer's own copy (demo: "config"; Lightning: "hyper_parameters")
        for key in ("config", "hyper_parameters", "hparams", "args", "cfg"):
            if isinstance(state.get(key), dict):
                cfg = state[key]
                break
    parts = find_parts(state, keys)
    out: list[Finding] = []
    nb = "not bitwise-resumable: "
    rng_entries = parts.get("rng")
    if not rng_entries:
        out.append(Finding("warning", "rng", nb + "no RNG state saved (Python, NumPy, torch): dropout masks, "
                           "augmentations and shuffles draw different numbers after the resume"))
    else:
        streams = _rng_streams(rng_entries[0][1])
        if not streams and _is_tensor(rng_entries[0][1]):
            streams = {"torch": rng_entries[0][1]}
        missing = [s for s in _RNG_STREAMS if s not in streams]
        if missing:
            out.append(Finding("warning", _fmt_path(rng_entries[0][0]),
                               nb + f"RNG streams missing: {', '.join(missing)}: those draw different numbers "
                               f"after the resume"))
    prog_cursor = (progress or {}).get("cursor")
    data = parts.get("data")
    if not data and prog_cursor is None and not _has_data_order(state):
        out.append(Finding("warning", "data", nb + "no data permutation or cursor saved: the resumed run "
                           "restarts the epoch's sample order, replaying some samples and never seeing others"))
    opt = parts.get("optimizer")
    if not opt:
        out.append(Finding("warning", "optimizer", nb + "no optimizer state: moments and step counters restart "
                           "from zero (Adam's bias correction starts over)"))
    else:
        for path, o in opt:
            st = o.get("state") if isinstance(o, dict) else None
            if not st:
                out.append(Finding("warning", f"{_fmt_path(path)}.state",
                                   nb + "optimizer state is empty: no moments saved, the resumed run restarts "
                                   "them from zero"))
    if not parts.get("scheduler") and opt and any(
            isinstance(g, dict) and "initial_lr" in g for _, o in opt for g in (o.get("param_groups") or [])):
        a = audit(state, progress=progress, keys=keys)
        out.append(Finding("warning", "scheduler", nb + _missing_scheduler_message(a.counters)))
    amp = _amp_configured(cfg)
    if amp and not parts.get("scaler"):
        out.append(Finding("warning", "scaler", nb + f"AMP configured ({amp}) but no GradScaler state: the loss "
                           f"scale restarts at its initial value, so the first steps after the resume are "
                           f"skipped or scaled differently"))
    return out


def _has_data_order(state: Any) -> bool:
    if not isinstance(state, dict):
        return False
    for key in state:
        k = _norm_key(key)
        if any(w in k for w in ("permutation", "perm", "cursor", "sampler", "sample_order", "data_order",
                                 "batch_idx", "samples_seen", "consumed_samples")):
            return True
    for key, v in state.items():
        if isinstance(v, dict) and _norm_key(key) in ALIASES["progress"]:
            if any(k in v for k in ("cursor", "permutation", "batch_idx", "samples_seen", "consumed_samples")):
                return True
    return False


# ---------------------------------------------------------------------------------------------------
# restore_training_state
# ---------------------------------------------------------------------------------------------------

#: Per-parameter optimizer state entries that have the parameter's shape.
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                "acc_delta", "sum", "exp_inf", "ax", "prev", "eta_prev")


def _param_names(model: Any) -> dict[int, str]:
    if model is None or not hasattr(model, "named_parameters"):
        return {}
    return {id(p): n for n, p in model.named_parameters()}


def _shape(t: Any) -> list[int] | None:
    s = getattr(t, "shape", None)
    return None if s is None else [int(x) for x in s]


def _check_model(sd: Any, model: Any, field: str) -> None:
    if not isinstance(sd, dict):
        raise IncoherentState(f"{field} is not a state_dict (a {type(sd).__name__})", where=field)
    live = model.state_dict()
    missing = [k for k in live if k not in sd]
    unexpected = [k for k in sd if k not in live]
    bad = [(k, _shape(sd[k]), _shape(live[k])) for k in live if k in sd and _is_tensor(sd[k])
           and _is_tensor(live[k]) and _shape(sd[k]) != _shape(live[k])]
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
                if key in st and _is_tensor(st[key]) and st[key].dim() > 0 and _shape(st[key]) != _shape(p):
                    who = names.get(id(p), f"param {j}")
                    problems.append(f"group {i}: {who}: saved {key} shape {_shape(st[key])}, current parameter "
                                    f"shape {_shape(p)}")
                    break
    if problems:
        raise IncoherentState("optimizer param groups do not match (nothing was restored): " + "; ".join(problems),
                              where=f"{field}.param_groups")


def _describe_params(sg: dict, sp: list, state: dict, lp: list, names: dict, model: Any) -> str:
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
                    if key in st and _is_tensor(st[key]):
                        shape = _shape(st[key])
                        break
            cands = by_shape.get(tuple(shape), []) if shape is not None else []
            if len(cands) == 1:
                saved.append(f"{cands[0]} {shape} (by shape)")
            else:
                saved.append(f"param {sid} {shape if shape is not None else '?'}")
    return f" (saved: {', '.join(saved)}; current: {', '.join(cur)})"


def _set_python_rng(val: Any) -> None:
    import random

    if isinstance(val, (list, tuple)) and len(val) == 3:
        version, internal, gauss = val
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    else:
        raise ValueError(f"not a random.getstate() tuple ({type(val).__name__})")


def _set_numpy_rng(val: Any, target: Any) -> tuple[str, Any]:
    """Returns (status, generator_or_None)."""
    import numpy as np

    if isinstance(val, dict) and "bit_generator" in val:
        if target is not None:
            bg = getattr(target, "bit_generator", target)
            bg.state = val
            return "restored into the given generator", None
        if val["bit_generator"] == "MT19937":
            np.random.set_state(val)
            return "restored (np.random global state)", None
        bg_cls = getattr(np.random, str(val["bit_generator"]), None)
        if bg_cls is None:
            raise ValueError(f"unknown NumPy bit generator {val['bit_generator']!r}")
        gen = np.random.Generator(bg_cls())
        gen.bit_generator.state = val
        return (f"{val['bit_generator']} state not restored in place (no generator given: pass "
                f"rng={{'numpy': generator}}); returned as report.numpy_generator"), gen
    if isinstance(val, (list, tuple)) and len(val) >= 3 and val[0] == "MT19937":
        st = (str(val[0]), np.asarray(val[1], dtype=np.uint32), int(val[2]), *val[3:])
        if target is not None and hasattr(target, "set_state"):
            target.set_state(st)
            return "restored into the given RandomState", None
        np.random.set_state(st)
        return "restored (np.random global state)", None
    raise ValueError(f"not a NumPy RNG state ({type(val).__name__})")


def _cuda_states(val: Any) -> list:
    if isinstance(val, (list, tuple)):
        return list(val)
    if isinstance(val, dict):
        return [val[k] for k in sorted(val, key=lambda x: int(re.sub(r"\D", "", str(x)) or 0))]
    if _is_tensor(val):
        return [val]
    return []


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
          :func:`apply_session_policy`; moments and step counters stay exactly as archived.

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
        state: nested checkpoint (see :func:`find_parts` for where parts are found).
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
    parts = find_parts(state, keys)
    a = audit(state, keys=keys)
    warnings: list[str] = []
    skipped: dict = {}
    restored: list[str] = []

    def part(name: str) -> tuple[str, Any] | tuple[None, None]:
        e = parts.get(name)
        return (_fmt_path(e[0][0]) or name, e[0][1]) if e else (None, None)

    mfield, msd = part("model")
    ofield, osd = part("optimizer")
    sfield, ssd = part("scheduler")
    cfield, csd = part("scaler")

    # --- checks before touching anything ----------------------------------------------------------------
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
    session_bases: list | None = None
    if policy == "session":
        if session_lr is not None:
            session_bases = _per_group(session_lr, len(optimizer.param_groups))
        else:
            session_bases = [_float(g.get("max_lr", g.get("initial_lr", g["lr"]))) for g in optimizer.param_groups]

    # --- restore in order --------------------------------------------------------------------------------
    missing = {
        "model": "",  # a model given without model state was refused above
        "optimizer": "no optimizer state in the checkpoint: the optimizer keeps its fresh state (moments restart)",
        "scheduler": (_missing_scheduler_message(a.counters) if any(f.field == "scheduler" for f in a.findings)
                      else "scheduler state missing: the scheduler stays at its freshly built position"),
        "scaler": "no GradScaler state in the checkpoint: the loss scale restarts at its initial value",
    }
    for name, live, sd in (("model", model, msd), ("optimizer", optimizer, osd), ("scheduler", scheduler, ssd),
                           ("scaler", scaler, csd)):
        if live is not None and sd is not None:
            live.load_state_dict(sd)
            restored.append(name)
        elif live is not None:
            warnings.append(missing[name])
            skipped[name] = missing[name]
        elif sd is not None:
            skipped[name] = f"no live {name} given"

    changes: list[PolicyChange] = []
    if policy == "session":
        changes = _impose_lrs(optimizer.param_groups, scheduler, session_bases, ofield or "optimizer",
                              sfield or "scheduler")

    # --- RNG last ----------------------------------------------------------------------------------------
    rng_report: dict = {}
    numpy_gen = None
    bitwise = True
    rng_part = parts.get("rng")
    if rng is False:
        skipped["rng"] = "rng=False"
    elif not rng_part:
        skipped["rng"] = "no RNG state in the checkpoint"
        warnings.append("no RNG state in the checkpoint: the random streams continue from this process's "
                        "seeds: not bitwise-resumable")
        bitwise = False
    else:
        targets = rng if isinstance(rng, dict) else {}
        raw = rng_part[0][1]
        streams = _rng_streams(raw) if isinstance(raw, dict) else ({"torch": raw} if _is_tensor(raw) else {})
        for name, val in streams.items():
            try:
                if name == "python":
                    _set_python_rng(val)
                    rng_report[name] = "restored"
                elif name == "numpy":
                    rng_report[name], gen = _set_numpy_rng(val, targets.get("numpy"))
                    if gen is not None:
                        numpy_gen = gen
                        bitwise = False
                        warnings.append(f"NumPy RNG: {rng_report[name]}")
                elif name == "torch":
                    import torch

                    if not _is_tensor(val):
                        raise ValueError(f"not a torch RNG state tensor ({type(val).__name__})")
                    torch.set_rng_state(val.to(torch.uint8) if val.dtype != torch.uint8 else val)
                    rng_report[name] = "restored"
                elif name == "cuda":
                    import torch

                    saved = _cuda_states(val)
                    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
                    k = min(len(saved), visible)
                    for dev in range(k):
                        torch.cuda.set_rng_state(saved[dev], device=dev)
                    if len(saved) > visible:
                        msg = (f"CUDA RNG: {len(saved)} saved, {visible} visible: restored {k}; "
                               f"not bitwise-resumable on this machine")
                        warnings.append(msg)
                        bitwise = False
                        rng_report[name] = msg
                    else:
                        rng_report[name] = f"restored {k} device(s)"
                else:
                    rng_report[name] = "not restored (no restorer for this device type)"
                    warnings.append(f"{name} RNG state saved but not restored: not bitwise-resumable")
                    bitwise = False
            except Exception as exc:  # never crash on RNG
                msg = f"{name} RNG state not restored ({type(exc).__name__}: {exc}): not bitwise-resumable"
                warnings.append(msg)
                rng_report[name] = msg
                bitwise = False
        absent = [s for s in _RNG_STREAMS if s not in streams]
        if absent:
            bitwise = False
            rng_report["missing"] = absent
            warnings.append(f"RNG streams not in the checkpoint: {', '.join(absent)}: they continue from this "
                            f"process's seeds: not bitwise-resumable")
        restored.append("rng")

    if optimizer is not None:
        next_lrs = [float(_float(g["lr"])) for g in optimizer.param_groups]
    else:
        next_lrs = [g.next_lr for g in a.groups if g.next_lr is not None]
    if any(p in skipped and skipped[p] != f"no live {p} given" for p in ("optimizer", "scheduler", "scaler")):
        bitwise = False  # a live object was given for a part the checkpoint lacks
    for w in warnings:
        log.warning(w)
    pos = a.counters.get("progress_step") or a.counters.get("optimizer_step")
    where = f" at step {pos}" if pos is not None else ""
    log.info("restored %s%s (policy %s): next step LR %s", ", ".join(restored) or "nothing", where, policy,
             ", ".join(f"group {i}={fmt_value(v)}" for i, v in enumerate(next_lrs)) or "unknown")
    return RestoreReport(restored=restored, skipped=skipped, policy=policy, next_lrs=next_lrs, changes=changes,
                         rng=rng_report, bitwise_resumable=bitwise, warnings=warnings, numpy_generator=numpy_gen,
                         audit=a)


# ---------------------------------------------------------------------------------------------------
# The CLI's view: inspect / verify / restore (called from ckpt_archive/commands/*.py)
# ---------------------------------------------------------------------------------------------------


class TensorStub:
    """Stands for an archived tensor that was not decoded (only its manifest record: shape, dtype)."""

    def __init__(self, rec: dict):
        self.shape = tuple(int(x) for x in rec.get("shape", ()))
        self.dtype = rec.get("dtype")
        self.kind = rec.get("kind")

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"TensorStub(shape={list(self.shape)}, dtype={self.dtype})"


#: Tensors up to this many elements are decoded for the audit (optimizer ``step`` scalars, tensor LRs).
SMALL_TENSOR_ELEMENTS = 8
#: At most this many raw bytes of tensor members are decoded to reach those small tensors (smallest
#: members first). Step scalars of a large optimizer are spread over its multi-GiB shards: past the
#: budget they stay :class:`TensorStub` and the counters say how many were read.
AUDIT_DECODE_BUDGET = 256 << 20


def _tree_refs(node: Any, out: list) -> list:
    if isinstance(node, dict):
        if node.get("$t") in ("tensor", "ndarray") and "key" in node:
            out.append(node["key"])
        else:
            for v in node.values():
                _tree_refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _tree_refs(v, out)
    return out


def state_for_audit(repo: Any, generation: str | int = "latest", *, budget: int = AUDIT_DECODE_BUDGET,
                    info: dict | None = None) -> tuple[Any, dict, int]:
    """The archived state with only small tensors decoded (others are :class:`TensorStub`).

    Reads the state tree member and the tensors of at most :data:`SMALL_TENSOR_ELEMENTS` elements from
    the smallest tensor members whose raw sizes add up to at most ``budget`` bytes (every chunk checked on
    the way). Enough for :func:`audit`, :func:`lint_completeness` and :func:`compare_with_session`.

    Args:
        budget: raw bytes of tensor members that may be decoded.
        info: if given, receives ``small_tensors`` (found) and ``small_tensors_decoded``.

    Returns:
        ``(state, manifest, generation_number)``.

    Raises:
        IntegrityError (exit 1), NotFound / NoUsableGeneration (exit 2): as :func:`ckpt_archive.load`.
    """
    from ckpt_archive.ops.common import open_repo as _repo, pick as _pick
    from ckpt_archive.repo.reader import ArchiveReader
    from ckpt_archive.format.state_tree import decode

    r = _repo(repo)
    gen = _pick(r, generation, False)
    reader = ArchiveReader(r.store, gen.key, gen.manifest)
    tree = reader.tree()
    recs = gen.manifest["tensors"]
    small = sorted({k for k in _tree_refs(tree, []) if k in recs
                    and math.prod(int(x) for x in recs[k].get("shape", ())) <= SMALL_TENSOR_ELEMENTS})
    by_member: dict[str, list[str]] = {}
    for k in small:
        by_member.setdefault(recs[k]["member"], []).append(k)
    chosen: list[str] = []
    spent = 0
    for member in sorted(by_member, key=lambda m: reader.by_path.get(m, {}).get("raw_bytes", 0)):
        size = int(reader.by_path.get(member, {}).get("raw_bytes", 0))
        if spent + size > budget:
            break
        spent += size
        chosen.extend(by_member[member])
    loaded = dict(zip(chosen, reader.load_node([{"$t": "tensor", "key": k} for k in chosen]))) if chosen else {}
    if info is not None:
        info.update(small_tensors=len(small), small_tensors_decoded=len(loaded))

    def get(key: str) -> Any:
        return loaded[key] if key in loaded else TensorStub(recs.get(key, {}))

    return decode(tree, get), gen.manifest, gen.number


def policy_section(state: Any, manifest: dict | None = None, decoded: dict | None = None
                   ) -> tuple[PolicyAudit, list[Finding], dict]:
    """Audit + completeness lint of a state, with the manifest's progress and config; and their JSON.

    ``decoded`` is the ``info`` of :func:`state_for_audit`; when some small tensors were left undecoded
    (budget), the audit's counters say so in ``counters["partial"]``.
    """
    progress = (manifest or {}).get("progress") or {}
    config = (manifest or {}).get("config") or {}
    a = audit(state, progress=progress)
    if decoded and decoded.get("small_tensors_decoded", 0) < decoded.get("small_tensors", 0):
        a.counters["partial"] = (f"{decoded['small_tensors_decoded']} of {decoded['small_tensors']} small tensors "
                                 f"decoded (budget {AUDIT_DECODE_BUDGET >> 20} MiB): step counters may be "
                                 f"incomplete; audit ckpt_archive.load(...) for all")
    lint = lint_completeness(state, config=config, progress=progress)
    if (manifest or {}).get("source", {}).get("format") in _REBUILDS_DATA_ORDER:
        lint = [f for f in lint if f.field != "data"]
    return a, lint, {"audit": a.to_json(), "completeness": [f.to_json() for f in lint]}


#: Source formats whose trainer rebuilds the data order from its seed and saved step on resume (the HF
#: Trainer re-seeds its sampler and skips ``global_step`` batches), so no saved permutation/cursor is
#: expected; the completeness lint's data-order warning would be a false alarm there.
_REBUILDS_DATA_ORDER = ("hf-trainer",)


def _say_counters(a: PolicyAudit, out: Any) -> None:
    out.say("  counters: " + ", ".join(f"{k} {v}" for k, v in a.counter_rows()))
    if a.counters.get("partial"):
        out.say(f"  ({a.counters['partial']})")


def _dedup(a: PolicyAudit, lint: list[Finding]) -> list[Finding]:
    """Audit findings not repeated by the lint (the missing-scheduler line is in both)."""
    texts = [f.message for f in lint]
    return [f for f in a.findings if not any(f.message in t for t in texts)]


def cli_inspect(info: dict, repo: Any, out: Any) -> dict:
    """``inspect``: print the audit table, counters and findings; return ``{"policy": ...}`` for ``--json``.

    An archive whose state cannot be read for the audit still inspects (the reason is printed).
    """
    from ckpt_archive.errors import CkptArchiveError

    try:
        decoded: dict = {}
        state, manifest, _ = state_for_audit(repo, info["generation"], info=decoded)
    except CkptArchiveError as exc:
        out.warn(f"policy audit skipped: {exc}")
        return {"policy": {"skipped": str(exc)}}
    a, lint, section = policy_section(state, manifest, decoded)
    out.table(a.table())
    _say_counters(a, out)
    for f in _dedup(a, lint) + lint:
        out.warn(f"{f.field}: {f.message}")
    return {"policy": section}


def cli_verify(report: Any, repo: Any, *, strict: bool, out: Any) -> None:
    """``verify``: add the audit and lint to a :class:`~ckpt_archive.ops.verify.VerifyReport`.

    Semantics: audit findings of severity ``error`` are problems (exit 1); audit warnings are warnings;
    completeness findings are warnings, and problems under ``--strict``. A generation that failed its
    byte checks is not audited (its state cannot be trusted). ``report.extra["policy"]`` holds the audit,
    the completeness findings and ``strict``.
    """
    from ckpt_archive.repo.reader import Problem
    from ckpt_archive.errors import CkptArchiveError

    if not report.ok:
        report.extra["policy"] = {"skipped": "the generation failed its checks"}
        return
    try:
        decoded: dict = {}
        state, manifest, _ = state_for_audit(repo, report.generation, info=decoded)
    except CkptArchiveError as exc:
        report.extra["policy"] = {"skipped": str(exc)}
        report.warnings.append(f"policy audit skipped: {exc}")
        return
    a, lint, section = policy_section(state, manifest, decoded)
    out.table(a.table())
    _say_counters(a, out)
    for f in _dedup(a, lint):
        if f.severity == "error":
            report.problems.append(Problem(f"policy: {f.message}", field=f.field))
        else:
            report.warnings.append(f"policy: {f.field}: {f.message}")
    for f in lint:
        if strict:
            report.problems.append(Problem(f"completeness (--strict): {f.message}", field=f.field))
        else:
            report.warnings.append(f"completeness: {f.field}: {f.message}")
    report.ok = not report.problems
    report.extra["policy"] = {**section, "strict": strict}


def cli_restore_prepare(repo: Any, generation: str | int, *, session_config: str | None, expect_lr: float | None,
                        policy: str, out: Any):
    """``restore --session-config F / --expect-lr LR / --policy session``: print the differences first.

    Returns:
        ``(transform, section)``: ``transform`` (or None) rewrites the state under ``--policy session``
        and records its changes in ``section["changes"]``; ``section`` goes under ``"policy"`` in the JSON.

    Raises:
        UsageError: a bad ``--policy``; ``--policy session`` on a folder source or with nothing to impose.
    """
    if policy not in ("checkpoint", "session"):
        raise UsageError(f"--policy must be 'checkpoint' or 'session', not {policy!r}")
    if expect_lr is not None and not (math.isfinite(expect_lr) and expect_lr >= 0):
        raise UsageError(f"--expect-lr must be a finite, non-negative number, not {expect_lr}")
    if session_config is None and expect_lr is None and policy == "checkpoint":
        return None, {}
    state, manifest, _ = state_for_audit(repo, generation)
    diffs = compare_with_session(state, session_config=session_config, expect_lr=expect_lr, policy=policy)
    for d in diffs:
        out.warn(d.message)
    section: dict = {"mode": policy, "differences": [d.to_json() for d in diffs], "changes": []}
    if policy == "checkpoint":
        return None, section
    if manifest["source"]["layout"] == "folder":
        raise UsageError("--policy session rewrites a single-file state; this generation is a folder source "
                         f"({manifest['source']['format']}): restore it, then use "
                         "ckpt_archive.restore_training_state(..., policy='session')")
    sess = session_values(session_config)
    if not any(k in sess for k in ("lr", *_HYPER_NAMES, "betas")):
        raise UsageError("--policy session needs --session-config with an lr (or weight_decay, momentum, eps, "
                         "betas) to impose; --expect-lr only checks")

    def transform(st: Any) -> Any:
        new, changes = apply_session_policy(st, session_config=session_config)
        section["changes"] = [c.to_json() for c in changes]
        section["_changes"] = changes
        return new

    return transform, section


def cli_restore_finish(section: dict, out: Any) -> dict:
    """Say what ``--policy session`` rewrote; return the JSON section (``{}`` when no policy flag)."""
    changes = section.pop("_changes", None)
    if section.get("mode") == "session":
        if changes:
            out.say(f"--policy session: rewrote {len(changes)} field(s) in the restored output (optimizer moments "
                    f"and step counters untouched):")
            for c in changes:
                out.say(f"  {c}")
        else:
            out.say("--policy session: the archived values already equal the session's; nothing rewritten")
    return {"policy": section} if section else {}
