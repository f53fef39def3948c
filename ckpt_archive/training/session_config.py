"""What a config asks of a checkpoint's policy: its LR and hyperparameters, one value per param group, and
whether the training script sets the LR itself.

* :func:`session_values` reads a config (the session's, or the run's own archived one);
* :func:`spread_scalar_lr` / :func:`session_bases` give one base LR per param group, :func:`spread_hyper` one
  ``weight_decay``/``momentum``/... per group, keeping the groups a script sets apart (no decay on norms and
  biases) apart;
* :func:`hand_schedule` tells, from a config, that the script schedules the LR itself (nanoGPT's
  ``decay_lr``/``warmup_iters``/``lr_decay_iters``): without a scheduler state its group ``lr`` is then the
  last step's position, set by code every step, not policy carried by the state;
* :func:`archived_config` / :func:`archived_lr`: the run's own config (packed with ``--config``, else the copy
  inside the state).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_archive.errors import UsageError
from ckpt_archive.format.config_file import load_config
from ckpt_archive.training import sched_settings
from ckpt_archive.training.values import as_float, coerce_float, flatten, fmt_value, nearly_equal

_LR_NAMES = ("lr", "learning_rate", "base_lr")
#: Config keys of a OneCycleLR/CyclicLR peak LR: the base a OneCycle schedule takes its LRs from (the
#: optimizer constructor's ``lr`` is overridden by OneCycleLR and must not be compared with ``max_lr``).
_MAX_LR_NAMES = ("max_lr", "peak_lr")

HYPER_NAMES = {
    "weight_decay": ("weight_decay", "wd"),
    "momentum": ("momentum",),
    "eps": ("eps", "adam_epsilon", "epsilon"),
}

#: Config switches of a hand-written LR schedule (the script sets ``lr`` every step): true turns it on, false
#: says the LR is constant (nanoGPT's ``decay_lr``).
SCHEDULE_SWITCHES = ("decay_lr", "lr_decay", "use_lr_schedule", "cosine_decay", "use_cosine_schedule")
#: Config lengths of a hand-written LR schedule: a non-zero value means the script warms up or decays the LR.
SCHEDULE_LENGTHS = ("warmup_iters", "warmup_steps", "warmup_epochs", "warmup_ratio", "warmup_tokens",
                    "lr_decay_iters", "lr_decay_steps", "lr_decay_epochs", "decay_iters", "decay_steps",
                    "lr_warmup_steps", "lr_warmup_iters")
_ARCHIVED_CONFIG_KEYS = ("config", "hyper_parameters", "hparams", "args", "cfg")


def session_values(session_config: dict | str | Path | None) -> dict:
    """The policy values a session config asks for.

    Looks (case-insensitively) for ``lr`` / ``learning_rate`` / ``base_lr`` / ``max_lr``, preferring keys under
    ``optimizer``/``optim``, then top level, then anywhere; likewise ``weight_decay``, ``momentum``, ``eps``
    (``adam_epsilon``), and ``betas`` (or ``adam_beta1``/``adam_beta2``, as in Hugging Face
    TrainingArguments). Per-group values: ``optimizer.param_groups: [{lr: ...}, ...]``.

    Scheduler settings: every scalar (or list of scalars) under a top-level ``scheduler`` / ``lr_scheduler`` /
    ``sched`` section, kept by its key (``T_max``, ``eta_min``, ...) as ``"scheduler": {key: (value, config
    key path)}`` (see :mod:`.sched_settings`).

    Returns:
        ``{"lr": float | list[float] | None, "weight_decay": ..., "momentum": ..., "eps": ..., "betas": ...,
        "scheduler": ..., "code_schedule": [config keys of a hand-written LR schedule, or [] where the config
        says the LR is constant]}`` with absent values left out, and ``"source"``: field -> config key path used.

    Raises:
        SourceError: unreadable config file.
    """
    cfg = load_config(session_config)
    pick = _Picker(cfg)
    out: dict = {"source": {}}
    _group_lrs(cfg, out)
    _lr_values(pick, out)
    _hypers(pick, out)
    sched = sched_settings.config_settings(cfg)
    if sched:  # the scheduler's own settings (T_max, eta_min, ...), by the archived state's key names
        out["scheduler"] = sched
    code = hand_schedule(cfg)
    if code is None or code:  # a schedule named, or the LR said constant (decay_lr: false): [] then
        out["code_schedule"] = code or []
    return out


class _Picker:
    """The config's value for a name: keys under ``optimizer``/``optim``/``opt`` first, then top level, then
    anywhere (never inside ``param_groups``); ``(key path, value)`` or None."""

    def __init__(self, cfg: Any):
        self.flat = list(flatten(cfg))

    def __call__(self, names: tuple[str, ...]) -> tuple[str, Any] | None:
        best = None
        for path, v in self.flat:
            if not path or path[-1].lower() not in names or "param_groups" in path:
                continue
            rank = 0 if any(p.lower() in ("optimizer", "optim", "opt") for p in path[:-1]) else (
                1 if len(path) == 1 else 2)
            if best is None or rank < best[0]:
                best = (rank, ".".join(path), v)
        return None if best is None else (best[1], best[2])


def _floats(v: Any) -> float | list[float] | None:
    """A number or a list of numbers from a config value (None if any is not one)."""
    if isinstance(v, (list, tuple)):
        vals = [coerce_float(x) for x in v]
        return None if None in vals else vals
    return coerce_float(v)


def _group_lrs(cfg: Any, out: dict) -> None:
    """Per-group LRs: ``optimizer.param_groups: [{lr: ...}, ...]`` (or ``optim.``, or top-level)."""
    pg = None
    for key in ("optimizer", "optim"):
        sub = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(sub, dict) and isinstance(sub.get("param_groups"), list):
            pg = sub["param_groups"]
    if isinstance(cfg, dict) and isinstance(cfg.get("param_groups"), list):
        pg = cfg["param_groups"]
    if pg:
        lrs = [coerce_float(g.get("lr")) if isinstance(g, dict) else None for g in pg]
        if all(x is not None for x in lrs):
            out["lr"], out["source"]["lr"] = lrs, "param_groups[*].lr"


def _lr_values(pick: _Picker, out: dict) -> None:
    """``lr``, ``max_lr`` (OneCycleLR/CyclicLR peak) and ``base_lr`` (CyclicLR's lower bound, also an alias of lr);
    a config that names only a peak LR: that is its LR."""
    for name, names in (("lr", _LR_NAMES), ("max_lr", _MAX_LR_NAMES)):
        if name in out:
            continue
        hit = (pick(("lr", "learning_rate")) or pick(names)) if name == "lr" else pick(names)
        val = _floats(hit[1]) if hit is not None else None
        if val is not None:
            out[name], out["source"][name] = val, hit[0]
    hit = pick(("base_lr",))
    val = _floats(hit[1]) if hit is not None else None
    if val is not None:
        out["base_lr"], out["source"]["base_lr"] = val, hit[0]
    if "lr" not in out and "max_lr" in out:
        out["lr"], out["source"]["lr"] = out["max_lr"], out["source"]["max_lr"]


def _hypers(pick: _Picker, out: dict) -> None:
    """``weight_decay``, ``momentum``, ``eps`` and ``betas`` (a pair, or ``adam_beta1``/``adam_beta2``)."""
    for name, aliases in HYPER_NAMES.items():
        hit = pick(aliases)
        if hit is not None and coerce_float(hit[1]) is not None:
            out[name], out["source"][name] = coerce_float(hit[1]), hit[0]
    hit = pick(("betas",))
    if hit is not None and isinstance(hit[1], (list, tuple)) and len(hit[1]) == 2:
        out["betas"], out["source"]["betas"] = tuple(coerce_float(x) for x in hit[1]), hit[0]
        return
    b1, b2 = pick(("adam_beta1", "beta1")), pick(("adam_beta2", "beta2"))
    if b1 and b2 and coerce_float(b1[1]) is not None and coerce_float(b2[1]) is not None:
        out["betas"] = (coerce_float(b1[1]), coerce_float(b2[1]))
        out["source"]["betas"] = f"{b1[0]}, {b2[0]}"


def hand_schedule(cfg: Any) -> list[str] | None:
    """The config keys that show the training script schedules the LR itself, setting each group's ``lr`` every
    step (nanoGPT: ``decay_lr: true``, ``warmup_iters: 2000``, ``lr_decay_iters``); ``[]`` when the config names
    no schedule; None when it says the LR is constant (a switch of :data:`SCHEDULE_SWITCHES` false).

    Without a scheduler state, such a group's archived ``lr`` is the schedule's position at the last step, not
    the configured LR: it is progress set by code, not policy carried by the state.
    """
    if not isinstance(cfg, dict):
        return []
    keys: list[str] = []
    for path, v in flatten(cfg):
        name = path[-1].lower() if path else ""
        if name in SCHEDULE_SWITCHES and isinstance(v, bool):
            if not v:
                return None
            keys.append(".".join(path))
        elif name in SCHEDULE_LENGTHS and coerce_float(v):
            keys.append(".".join(path))
    return keys


def per_group(value: Any, n: int) -> list:
    """One value per param group: a list of ``n``, a list of one (repeated), or a scalar (repeated).

    Raises:
        UsageError: a list of neither 1 nor ``n`` values.
    """
    if isinstance(value, (list, tuple)):
        if len(value) == n:
            return list(value)
        if len(value) == 1:
            return list(value) * n
        raise UsageError(f"session gives {len(value)} LRs for {n} param groups")
    return [value] * n


def lr_base_field(g: dict) -> str:
    """Which group field holds the *base* LR a config's ``lr`` sets."""
    if "max_lr" in g:  # OneCycleLR: its max_lr is the configured LR
        return "max_lr"
    if "initial_lr" in g:
        return "initial_lr"
    return "lr"


def _reference(value: Any, archived: list, reference: Any) -> tuple[float | None, str]:
    """The archived value a single session value replaces: the archived config's (``reference``) where some
    group has it, else group 0's."""
    known = [b for b in archived if b is not None]
    ref = None if isinstance(reference, (list, tuple)) else coerce_float(reference)
    if ref is not None and any(nearly_equal(ref, b) for b in known):
        return ref, "the archived config's lr"
    return (archived[0] if archived and archived[0] is not None else (known[0] if known else None)), \
        "group 0's archived base"


def spread_scalar_lr(value: Any, archived: list, reference: Any = None, notes: list | None = None) -> list:
    """One session base per param group from a session LR (the rule for several groups with different LRs).

    A list gives one LR per group (:func:`per_group`). A single LR ``S`` is the base of every group when the
    archived groups share one base (or there is one group). When their archived bases ``b_i`` differ (a head
    at half the body's LR), ``S`` is the new value of a *reference* base ``R``: the archived config's ``lr``
    (``reference``) where it equals some group's base, else group 0's base; every group keeps its ratio to
    ``R``: ``b_i / R * S`` (exactly ``S`` where ``b_i == R``). So the very config the run was trained with is
    a no-op and a group's ratio is never changed silently; the rule is said in ``notes`` (when ``S != R``).

    Raises:
        UsageError: a list of neither 1 nor as many LRs as groups.
    """
    n = len(archived)
    if isinstance(value, (list, tuple)) or n <= 1:
        return per_group(value, n)
    s = coerce_float(value)
    known = [b for b in archived if b is not None]
    if s is None or not known or all(nearly_equal(b, known[0]) for b in known):
        return [value] * n
    ref, whom = _reference(value, archived, reference)
    if not ref:
        return [value] * n
    out = [s if b is None or nearly_equal(b, ref) else b / ref * s for b in archived]
    if notes is not None and not nearly_equal(s, ref):
        notes.append(f"one lr for {n} param groups with different base LRs ({', '.join(fmt_value(b) for b in archived)}):"
                     f" each group keeps its ratio to {whom} {fmt_value(ref)}; to set each group, give one LR per "
                     f"group (optimizer.param_groups: [{{lr: ...}}, ...] or a list lr)")
    return out


def spread_hyper(value: Any, archived: list, reference: Any = None) -> tuple[list, list[int]]:
    """One session value per param group for a hyperparameter (``weight_decay``, ``momentum``, ``eps``, ``betas``).

    Groups that share one archived value all get ``value``. Where they differ (nanoGPT: weight decay 0.1 on
    weights, 0 on norms and biases, by design), the single config value replaces the *reference*: the archived
    config's value where some group has it, else group 0's; a group with another value was set apart by the
    script and keeps its own (``None`` in the result: neither compared nor rewritten).

    Returns:
        ``(per-group session value or None, indices of the groups set apart)``.
    """
    known = [a for a in archived if a is not None]
    if len(archived) <= 1 or not known or all(_same_hyper(a, known[0]) for a in known):
        return [value] * len(archived), []
    ref = reference if reference is not None and any(_same_hyper(a, reference) for a in known) else archived[0]
    apart = [i for i, a in enumerate(archived) if a is not None and not _same_hyper(a, ref)]
    return [None if i in apart else value for i in range(len(archived))], apart


def _same_hyper(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(nearly_equal(as_float(x), coerce_float(y)) for x, y in zip(a, b)))
    return nearly_equal(as_float(a), coerce_float(b))


def session_bases(groups: list, sess: dict, archived_lr: Any = None, notes: list | None = None) -> list | None:
    """The session's base LR per param group, each read from the config key its base field takes it from:
    ``max_lr`` for a OneCycleLR group (never the optimizer constructor's ``lr``, which OneCycleLR
    overrides), else ``lr``. None when the config gives no LR. A single LR for groups with different archived
    bases is spread by :func:`spread_scalar_lr` (``archived_lr``: the archived config's lr, the reference).

    Raises:
        UsageError: as many LRs as neither 1 nor the number of groups.
    """
    if "lr" not in sess:
        return None
    fields = [lr_base_field(g) if isinstance(g, dict) else "lr" for g in groups]
    archived = [as_float(g.get(f)) if isinstance(g, dict) else None for g, f in zip(groups, fields)]
    one_cycle = any(f == "max_lr" for f in fields)
    key = "max_lr" if one_cycle and "max_lr" in sess else "lr"
    return spread_scalar_lr(sess[key], archived, archived_lr if key == "lr" else None, notes)


def archived_config(state: Any, config: Any = None) -> tuple[dict, str]:
    """The run's own config: ``config`` (packed with ``--config``) if given, else the copy inside the state
    (``config``, ``hyper_parameters`` (Lightning), ``hparams``, ``args``, ``cfg``). Returns ``(dict, where)``."""
    cfg = load_config(config) if config else {}
    if cfg:
        return cfg, "the packed config"
    if isinstance(state, dict):
        for key in _ARCHIVED_CONFIG_KEYS:
            if isinstance(state.get(key), dict) and state[key]:
                return state[key], f"the state's {key}"
    return {}, ""


def archived_values(state: Any, config: Any = None) -> dict:
    """:func:`session_values` of the run's own config (:func:`archived_config`); ``{}`` where there is none or it
    cannot be read (an unreadable archived config just tells nothing)."""
    try:
        cfg, _ = archived_config(state, config)
        return session_values(cfg) if cfg else {}
    except Exception:  # noqa: BLE001 - a broken archived config tells no reference, it is no error here
        return {}


def archived_lr(state: Any, config: Any = None) -> Any:
    """The archived config's ``lr`` (the packed config, else the copy inside the state), or None."""
    return archived_values(state, config).get("lr")


__all__ = ["HYPER_NAMES", "session_values", "hand_schedule", "per_group", "lr_base_field", "spread_scalar_lr",
           "spread_hyper", "session_bases", "archived_config", "archived_values", "archived_lr"]
