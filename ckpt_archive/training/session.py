"""The session's policy against the checkpoint's: read it from a config, compare, re-impose it.

``optimizer.load_state_dict`` restores the archived ``lr`` (and ``initial_lr``, the scheduler's
``base_lrs``), so a session that lowered its LR in its config silently trains with the archived one.
:func:`session_values` reads what a config asks for, :func:`compare_with_session` names every field
that differs and which value wins, :func:`apply_session_policy` rewrites them in a copy of the state
(moments and step counters untouched); :func:`impose_lrs` is the rule, shared with the live restore.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Sequence

from ckpt_archive.errors import UsageError
from ckpt_archive.format.config_file import load_config
from ckpt_archive.training.audit import audit
from ckpt_archive.training.lr_bases import (base_kind, compare_cyclic, cyclic_wants, impose_cyclic, impose_plateau,
                                            plateau_bases, plateau_reductions)
from ckpt_archive.training.parts import find_parts, is_tensor
from ckpt_archive.training import sched_settings
from ckpt_archive.training.schedulers import derive_lrs, nested_base_lrs, primary_base_lrs, scheduler_kind
from ckpt_archive.training.values import as_float, coerce_float, flatten, fmt_pair, fmt_value, jsonable, nearly_equal

_LR_NAMES = ("lr", "learning_rate", "base_lr")
#: relative tolerance of ``expect_lr``: accepts an LR copied from ``inspect``'s 7 significant digits
EXPECT_RTOL = 1e-6
#: Config keys of a OneCycleLR/CyclicLR peak LR: the base a OneCycle schedule takes its LRs from (the
#: optimizer constructor's ``lr`` is overridden by OneCycleLR and must not be compared with ``max_lr``).
_MAX_LR_NAMES = ("max_lr", "peak_lr")

HYPER_NAMES = {
    "weight_decay": ("weight_decay", "wd"),
    "momentum": ("momentum",),
    "eps": ("eps", "adam_epsilon", "epsilon"),
}


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
        config_key: the session config's key path the session value comes from (``optimizer.lr``).
        when: when the archived value takes effect: ``"now"`` (the next optimizer step reads it) or
            ``"at the next scheduler.step()"``.
    """

    field: str
    archived: Any
    session: Any
    wins: str
    switch: str
    message: str
    when: str = "now"
    config_key: str = ""

    def to_json(self) -> dict:
        """The fields as strict JSON."""
        return jsonable(dataclasses.asdict(self))

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass
class PolicyChange:
    """One field rewritten by :func:`apply_session_policy` (``old`` -> ``new``; ``note``: why, where the
    rule is not a plain replacement, e.g. a ReduceLROnPlateau rescale that keeps the reductions)."""

    field: str
    old: Any
    new: Any
    note: str = ""

    def to_json(self) -> dict:
        """The fields as strict JSON (``note`` only where there is one)."""
        d = dataclasses.asdict(self)
        if not d["note"]:
            del d["note"]
        return jsonable(d)

    def __str__(self) -> str:
        tail = f" ({self.note})" if self.note else ""
        return f"{self.field}: {fmt_value(self.old)} -> {fmt_value(self.new)}{tail}"


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
        "scheduler": ...}`` with absent values left out, and ``"source"``: field -> config key path used.

    Raises:
        SourceError: unreadable config file.
    """
    cfg = load_config(session_config)
    flat = list(flatten(cfg))

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
        lrs = [coerce_float(g.get("lr")) if isinstance(g, dict) else None for g in pg]
        if all(x is not None for x in lrs):
            out["lr"] = lrs
            out["source"]["lr"] = "param_groups[*].lr"
    for name, names in (("lr", _LR_NAMES), ("max_lr", _MAX_LR_NAMES)):
        if name in out:
            continue
        hit = (pick(("lr", "learning_rate")) or pick(names)) if name == "lr" else pick(names)
        if hit is not None:
            v = hit[1]
            val = [coerce_float(x) for x in v] if isinstance(v, (list, tuple)) else coerce_float(v)
            if val is not None and not (isinstance(val, list) and None in val):
                out[name] = val
                out["source"][name] = hit[0]
    hit = pick(("base_lr",))  # CyclicLR's lower bound, when named as such (it is also an alias of lr)
    if hit is not None and coerce_float(hit[1]) is not None and not isinstance(hit[1], (list, tuple)):
        out["base_lr"], out["source"]["base_lr"] = coerce_float(hit[1]), hit[0]
    elif hit is not None and isinstance(hit[1], (list, tuple)) and None not in [coerce_float(x) for x in hit[1]]:
        out["base_lr"], out["source"]["base_lr"] = [coerce_float(x) for x in hit[1]], hit[0]
    if "lr" not in out and "max_lr" in out:  # a config that names only a peak LR: that is its LR
        out["lr"], out["source"]["lr"] = out["max_lr"], out["source"]["max_lr"]
    for name, aliases in HYPER_NAMES.items():
        hit = pick(aliases)
        if hit is not None and coerce_float(hit[1]) is not None:
            out[name] = coerce_float(hit[1])
            out["source"][name] = hit[0]
    hit = pick(("betas",))
    if hit is not None and isinstance(hit[1], (list, tuple)) and len(hit[1]) == 2:
        out["betas"] = tuple(coerce_float(x) for x in hit[1])
        out["source"]["betas"] = hit[0]
    else:
        b1, b2 = pick(("adam_beta1", "beta1")), pick(("adam_beta2", "beta2"))
        if b1 and b2 and coerce_float(b1[1]) is not None and coerce_float(b2[1]) is not None:
            out["betas"] = (coerce_float(b1[1]), coerce_float(b2[1]))
            out["source"]["betas"] = f"{b1[0]}, {b2[0]}"
    sched = sched_settings.config_settings(cfg)
    if sched:  # the scheduler's own settings (T_max, eta_min, ...), by the archived state's key names
        out["scheduler"] = sched
    return out


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
    ref = None if isinstance(reference, (list, tuple)) else coerce_float(reference)
    whom = "the archived config's lr"
    if ref is None or not any(nearly_equal(ref, b) for b in known):
        ref = archived[0] if archived[0] is not None else known[0]
        whom = "group 0's archived base"
    if not ref:
        return [value] * n
    out = [s if b is None or nearly_equal(b, ref) else b / ref * s for b in archived]
    if notes is not None and not nearly_equal(s, ref):
        notes.append(f"one lr for {n} param groups with different base LRs ({', '.join(fmt_value(b) for b in archived)}):"
                     f" each group keeps its ratio to {whom} {fmt_value(ref)}; to set each group, give one LR per "
                     f"group (optimizer.param_groups: [{{lr: ...}}, ...] or a list lr)")
    return out


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
    n = len(groups)
    fields = [lr_base_field(g) if isinstance(g, dict) else "lr" for g in groups]
    archived = [as_float(g.get(f)) if isinstance(g, dict) else None for g, f in zip(groups, fields)]
    one_cycle = any(f == "max_lr" for f in fields)
    key = "max_lr" if one_cycle and "max_lr" in sess else "lr"
    return spread_scalar_lr(sess[key], archived, archived_lr if key == "lr" else None, notes)


def compare_with_session(state: Any, *, session_config: dict | str | Path | None = None,
                         expect_lr: float | Sequence[float] | None = None, policy: str = "checkpoint",
                         keys: dict | None = None, archived_config: Any = None) -> list[PolicyDifference]:
    """Compare the archived policy with the session's.

    Args:
        state: nested checkpoint.
        session_config: the session's config (dict or JSON/YAML/TOML path): ``lr`` is the *base* LR
            (compared with the group's ``initial_lr`` when a scheduler was attached, with ``max_lr`` for
            OneCycleLR, else with ``lr``); ``weight_decay``, ``momentum``, ``eps``, ``betas`` with the
            group's fields. See :func:`session_values`.
        expect_lr: the LR the session expects the *next step* to use: a float (compared with group 0 of each
            optimizer) or one per group; compared with the audit's ``next_lr`` (field ``...param_groups[i].lr``)
            within :data:`EXPECT_RTOL`; without optimizer state with the scheduler's ``_last_lr``.
        policy: ``"checkpoint"`` (default: ``optimizer.load_state_dict`` overrides the session's values) or
            ``"session"``; decides ``wins`` and the switch named for the other choice.
        keys: part -> path overrides (see :func:`find_parts`).
        archived_config: the run's own config (packed with ``--config``; default: the copy inside the
            state): tells the base LR of a ReduceLROnPlateau group, which the state does not keep.

    Each scheduler kind is compared on the config keys it takes its LRs from (:mod:`.lr_bases`): OneCycleLR
    ``max_lr`` with the group's ``max_lr``; CyclicLR ``base_lr``/``max_lr`` with ``base_lrs``/``max_lrs``;
    ReduceLROnPlateau ``lr`` with its base (the current ``lr`` is the base after whole reductions by
    ``factor``); others ``lr`` with ``initial_lr``. A current LR that differs from the base by warmup,
    decay or reductions is progress, never a difference.

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

    def add(field: str, archived: Any, session: Any, what: str, when: str = "now", loader: str = "") -> None:
        a, s = fmt_pair(archived, session)
        if wins == "checkpoint":
            loader = loader or ("scheduler" if field.rsplit(".", 1)[-1].startswith(("base_lrs", "_last_lr", "max_lrs"))
                                else "optimizer")
            tail = (f"the checkpoint's value wins ({loader}.load_state_dict restores it); {switch} keeps the "
                    f"session's")
        else:
            tail = f"the session's value wins (--policy session rewrites it); {switch} keeps the checkpoint's"
        diffs.append(PolicyDifference(field, archived, session, wins, switch,
                                      f"{field}: archived {a}, session {s} ({what}; takes effect {when}); {tail}",
                                      when, what.split(";", 1)[0].removeprefix("config ")))

    sch_entries = find_parts(state, keys).get("scheduler", [])
    arch_lr = _archived_lr(state, archived_config)
    for n, (opt_path, opt) in enumerate(entries):
        opt_field = str(opt_path) or "optimizer"
        groups = [g for g in (opt.get("param_groups") or []) if isinstance(g, dict)]
        sch_field, sch = (str(sch_entries[n][0]) or "scheduler", sch_entries[n][1]) if n < len(sch_entries) \
            else ("scheduler", None)
        kind = base_kind(sch)
        if kind == "cyclic" and isinstance(sch, dict):
            compare_cyclic(groups, sch, sess, opt_field, sch_field, add)
        elif kind == "plateau" and "lr" in sess:
            olds = plateau_bases(groups, sch, arch_lr)
            for i, (g, want) in enumerate(zip(groups, per_group(sess["lr"], len(groups)))):
                cur, old = as_float(g.get("lr")), olds[i]
                want = coerce_float(want)
                if want is None or cur is None:
                    continue
                if old is not None and not nearly_equal(old, want):
                    fname = "initial_lr" if "initial_lr" in g else "lr"
                    add(f"{opt_field}.param_groups[{i}].{fname}", old, want,
                        f"config {sess['source']['lr']}; the ReduceLROnPlateau base LR"
                        + ("" if fname == "initial_lr" else f" (the current lr {fmt_value(cur)} is it after "
                           f"the plateau reductions)"))
                elif old is None and plateau_reductions(cur, want, sch.get("factor"),
                                                        (sch.get("min_lrs") or [None] * (i + 1))[i]) is None:
                    add(f"{opt_field}.param_groups[{i}].lr", cur, want,
                        f"config {sess['source']['lr']}; ReduceLROnPlateau keeps no base LR and the lr is not "
                        f"this one after whole reductions by factor {fmt_value(as_float(sch.get('factor')))}")
        elif "lr" in sess:
            spread: list = []
            bases_wanted = session_bases(groups, sess, arch_lr, spread)
            for i, (g, want) in enumerate(zip(groups, bases_wanted)):
                fname = lr_base_field(g)
                have = as_float(g.get(fname))
                if want is not None and have is not None and not nearly_equal(have, want):
                    src = sess["source"]["max_lr" if fname == "max_lr" and "max_lr" in sess else "lr"]
                    what = f"config {src}"
                    if fname != "lr":
                        what += f"; {fname} is the schedule's base LR"
                    if spread:
                        what += f"; {spread[0]}"
                    when = "now" if fname == "lr" else "at the next scheduler.step()"
                    add(f"{opt_field}.param_groups[{i}].{fname}", have, want, what, when)
            if kind == "plain" and isinstance(sch, dict):
                _compare_sched_bases(groups, sch, sch_field, bases_wanted, sess, add)
        for name in ("weight_decay", "momentum", "eps"):
            if name in sess:
                for i, g in enumerate(groups):
                    have = as_float(g.get(name))
                    if have is not None and not nearly_equal(have, sess[name]):
                        add(f"{opt_field}.param_groups[{i}].{name}", have, sess[name],
                            f"config {sess['source'][name]}")
        if "betas" in sess:
            for i, g in enumerate(groups):
                b = g.get("betas")
                if isinstance(b, (list, tuple)) and len(b) == 2:
                    have = tuple(as_float(x) for x in b)
                    if not all(nearly_equal(x, y) for x, y in zip(have, sess["betas"])):
                        add(f"{opt_field}.param_groups[{i}].betas", have, tuple(sess["betas"]),
                            f"config {sess['source']['betas']}")
    for sch_path, sch in sch_entries if "scheduler" in sess else []:
        # The scheduler's own settings: scheduler.load_state_dict restores them over the session's constructor
        for key, have, want, src in sched_settings.differences(sch, sess["scheduler"]):
            add(f"{str(sch_path) or 'scheduler'}.{key}", have, want,
                f"config {src}; a scheduler setting, restored by scheduler.load_state_dict over the session's",
                "at the next scheduler.step()", loader="scheduler")
    if not entries and "lr" in sess:
        # No optimizer state: the session's optimizer keeps its LR for the next step, then the archived
        # scheduler's base_lrs take over at the next scheduler.step() (scripts that restore only the scheduler).
        for sch_path, sch in find_parts(state, keys).get("scheduler", []):
            sfield = str(sch_path) or "scheduler"
            if base_kind(sch) == "cyclic" and isinstance(sch, dict):
                compare_cyclic([], sch, sess, "optimizer", sfield, add)
                continue
            if base_kind(sch) in ("one_cycle", "plateau"):
                continue  # OneCycleLR reads the session's groups (max_lr), Plateau keeps no base_lrs
            primary = [as_float(b) for b in primary_base_lrs(sch)]
            wanted = spread_scalar_lr(sess["lr"], primary, arch_lr)
            # every base_lrs the scheduler restores, also SequentialLR/ChainedScheduler sub-schedulers'
            for bfield, bs in nested_base_lrs(sch, sfield):
                for i, (have, want) in enumerate(zip([as_float(b) for b in bs], wanted)):
                    want = coerce_float(want)
                    if have is not None and want is not None and not nearly_equal(have, want):
                        add(f"{bfield}.base_lrs[{i}]", have, want,
                            f"config {sess['source']['lr']}; the checkpoint holds no optimizer state, so the next "
                            f"step runs at the session's LR, then scheduler.step() switches to the archived base_lrs",
                            "at the next scheduler.step()")
    if expect_lr is not None:
        a = audit(state, keys=keys)
        if isinstance(expect_lr, (list, tuple)):
            if len(expect_lr) not in (1, len(a.groups)):
                raise UsageError(f"--expect-lr gives {len(expect_lr)} LRs for {len(a.groups)} param groups")
            wants = list(expect_lr) * (len(a.groups) if len(expect_lr) == 1 else 1)
        else:  # one LR: each optimizer's group 0 (other groups, e.g. a head at another LR, are not meant)
            wants = [expect_lr if gp.index == 0 else None for gp in a.groups]
        for i, (gp, want) in enumerate(zip(a.groups, wants)):
            want = coerce_float(want)
            if want is None:
                continue
            if gp.next_lr is not None:
                if not nearly_equal(gp.next_lr, want, EXPECT_RTOL):
                    field = f"{gp.field}.lr" if gp.lr is not None else f"{a.scheduler.get('field')}._last_lr[{i}]"
                    add(field, gp.next_lr, want, "--expect-lr: the LR of the next step")
            elif gp.lr is None and gp.last_lr is not None and not nearly_equal(gp.last_lr, want, EXPECT_RTOL):
                # no optimizer state: the next step runs at the session's LR, but the archived scheduler is at
                # _last_lr and its next step computes from the archived base_lrs, whatever the session's LR
                after = (f"; the next scheduler.step() sets {fmt_value(gp.after_step_lr)} whatever the session's LR"
                         if gp.after_step_lr is not None and "whatever" in (gp.after_step_basis or "") else "")
                add(f"{a.scheduler.get('field') or 'scheduler'}._last_lr[{gp.index}]", gp.last_lr, want,
                    f"--expect-lr: no optimizer state, so the next step runs at the session's LR, but the archived "
                    f"scheduler's LR is this one (base_lrs {fmt_value(gp.base_lr)}){after}",
                    "at the next scheduler.step()")
    return diffs


def _compare_sched_bases(groups: list, sch: dict, sch_field: str, wants: list, sess: dict, add: Any) -> None:
    """The scheduler's own ``base_lrs`` (also of SequentialLR/ChainedScheduler sub-schedulers) against the
    session's base, where they disagree with the group's base field (which is compared already).

    ``scheduler.load_state_dict`` restores ``base_lrs`` and the next ``scheduler.step()`` computes the LR from
    them, whatever the group's ``initial_lr`` says: a scheduler state from an older run (``base_lrs`` 1e-6)
    next to an optimizer built with 1e-4 runs the next day at 1e-6's schedule."""
    subs = [(sch_field, sch)] + [(f"{sch_field}._schedulers[{j}]", s)
                                 for j, s in enumerate(sch.get("_schedulers") or []) if isinstance(s, dict)]
    for field, sd in subs:
        if scheduler_kind(sd) == "OneCycleLR":
            continue  # its base_lrs are max_lr / div_factor, not the configured LR
        for i, b in enumerate(sd.get("base_lrs") or []):
            have = as_float(b)
            want = coerce_float(wants[i]) if i < len(wants) else None
            g = groups[i] if i < len(groups) else None
            gbase = as_float(g.get(lr_base_field(g))) if g is not None else None
            if have is None or want is None or nearly_equal(have, want):
                continue
            if gbase is not None and nearly_equal(gbase, have) and not nearly_equal(gbase, want):
                continue  # the same value as the group's base field, reported there
            add(f"{field}.base_lrs[{i}]", have, want,
                f"config {sess['source']['lr']}; the scheduler computes the LR from its restored base_lrs, not "
                f"from the group's {lr_base_field(g) if g is not None else 'lr'}", "at the next scheduler.step()")


def _archived_lr(state: Any, archived_config: Any) -> Any:
    """The archived config's ``lr`` (the packed config, else the copy inside the state), or None."""
    from ckpt_archive.training.completeness import archived_config as find_config

    try:
        cfg, _ = find_config(state, archived_config)
        return session_values(cfg).get("lr") if cfg else None
    except Exception:  # noqa: BLE001 - an unreadable archived config just tells no base
        return None


def _rescale(value: float, old_base: float, new_base: float) -> float:
    """``value`` at the same point of the schedule with base ``new_base`` (exact when value == old_base)."""
    if value == old_base:
        return new_base
    if old_base == 0:
        return value
    return value / old_base * new_base


def _copy_tree(obj: Any, memo: dict | None = None) -> Any:
    """Copy dicts/lists/tuples (keeping dict subclasses' types); tensors and arrays are shared, not copied.

    A container reached twice (``state["opt_alias"] is state["optimizer"]``, or ``state["pg"]`` the very
    ``param_groups`` list) is copied once (``memo``, by ``id``), so the copy keeps the aliasing and a rewrite
    seen through one path is seen through every other: ``torch.save`` of the result still has one object."""
    if memo is None:
        memo = {}
    if isinstance(obj, (dict, list)) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        hit = memo.get(id(obj))
        if hit is not None:
            return hit[1]
    if isinstance(obj, dict):
        try:
            new = copy.copy(obj)
        except Exception:
            new = dict(obj)
        memo[id(obj)] = (obj, new)  # the original is kept so that its id is not reused while copying
        for k, v in obj.items():
            new[k] = _copy_tree(v, memo)
        return new
    if isinstance(obj, list):
        new_list: list = []
        memo[id(obj)] = (obj, new_list)
        new_list.extend(_copy_tree(v, memo) for v in obj)
        return new_list
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        new_t = tuple(_copy_tree(v, memo) for v in obj)
        memo[id(obj)] = (obj, new_t)
        return new_t
    return obj


def _same_type(template: Any, value: float) -> Any:
    """Keep a tensor LR a tensor (fused/capturable optimizers store lr as a 0-d tensor)."""
    if is_tensor(template):
        import torch

        return torch.tensor(value, dtype=template.dtype, device=template.device)
    return value


def impose_lrs(groups: list, sch: Any, wants: list, ofield: str, sfield: str, *, want_max: list | None = None,
               archived_bases: list | None = None) -> list[PolicyChange]:
    """Re-impose session base LRs on param groups (dicts) and a scheduler (state dict or live object).

    The rule of :func:`apply_session_policy`; used on a copied state and on live objects alike. ``groups``
    may be empty (a state without optimizer state): the scheduler's ``base_lrs`` are then the archived base.
    Nothing changes where every session base equals the archived one.

    Args:
        wants: the session base per group: ``max_lr`` for OneCycleLR, ``base_lr`` for CyclicLR (None: keep),
            else ``lr``.
        want_max: CyclicLR only: the session ``max_lr`` per group (None: keep the archived ``max_lrs``).
        archived_bases: ReduceLROnPlateau only: the archived base LR per group (see
            :func:`~ckpt_archive.training.lr_bases.plateau_bases`); default: the groups' ``initial_lr``.

    Raises:
        UsageError: a ReduceLROnPlateau group whose archived base cannot be told while the session's differs.
    """
    changes: list[PolicyChange] = []
    sd = None if sch is None else (sch if isinstance(sch, dict) else getattr(sch, "__dict__", None))
    kind = base_kind(sch)
    if kind == "cyclic" and isinstance(sd, dict):
        impose_cyclic(groups, sd, wants, want_max, ofield, sfield, changes)
        return changes
    if kind == "plateau":
        olds = archived_bases if archived_bases is not None else plateau_bases(groups, sd or {})
        impose_plateau(groups, sd, wants, olds, ofield, sfield, changes)
        return changes
    # SequentialLR/ChainedScheduler keep no base_lrs of their own: without groups, their sub-scheduler's tell
    sched_bases = [as_float(b) for b in ((sd or {}).get("base_lrs") or (primary_base_lrs(sd or {}) if not groups
                                                                         else []))]
    olds: list = []      # the archived base of each group's own fields
    sched_olds: list = []  # the base the scheduler's base_lrs/_last_lr are rescaled from
    news: list = []
    for i in range(max(len(groups), len(sched_bases))):
        g = groups[i] if i < len(groups) else None
        sb = sched_bases[i] if i < len(sched_bases) else None
        fname = lr_base_field(g) if g is not None else None
        old = as_float(g.get(fname)) if g is not None else sb
        if fname == "lr" and sb is not None:
            old = sb
        want = coerce_float(wants[i]) if i < len(wants) else None
        olds.append(old)
        news.append(want)
        # OneCycleLR's base_lrs are max_lr / div_factor: rescaled by the group's max_lr ratio
        sched_olds.append(old if fname == "max_lr" or sb is None else sb)
        if g is None or old is None or want is None or nearly_equal(old, want):
            continue  # the same base (within LR_RTOL): a ratio would only add rounding noise
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):
            if key in g and as_float(g[key]) is not None:
                fv = as_float(g[key])
                nv = _rescale(fv, old, want)
                if nv != fv:
                    g[key] = _same_type(g[key], nv)
                    changes.append(PolicyChange(f"{ofield}.param_groups[{i}].{key}", fv, nv))
    nested = [as_float(b) for _, bs in nested_base_lrs(sd or {}) for b in bs[:len(news)]]
    nested_news = [w for _, bs in nested_base_lrs(sd or {}) for w in news[:len(bs)]]
    if not any(o is not None and w is not None and not nearly_equal(o, w)
               for o, w in zip(olds + sched_olds + nested, news + news + nested_news)):
        return changes  # the session asks for what is archived: nothing to rewrite, not even by a closed form
    if isinstance(sd, dict):
        if not isinstance(sch, dict):  # a live scheduler shares its lists with the state it loaded: never write into them
            for key in ("base_lrs", "_last_lr"):
                if isinstance(sd.get(key), list):
                    sd[key] = list(sd[key])
        _rescale_scheduler(sd, sfield, sched_olds, news, changes, in_place=isinstance(sch, dict))
        # Where the schedule has a closed form, the LR at the archived position is the closed form with the
        # session's base (exact also for absolute floors such as eta_min, which a ratio would scale).
        view = sch if isinstance(sch, dict) else (sch.state_dict() if hasattr(sch, "state_dict") else None)
        _, lrs, _ = derive_lrs(view, list(groups) or None) if isinstance(view, dict) else (None, None, "")
        if lrs is not None and groups and len(lrs) == len(groups):
            for i, (g, v) in enumerate(zip(groups, lrs)):
                if news[i] is None or olds[i] is None or as_float(g.get("lr")) is None:
                    continue
                fv = as_float(g["lr"])
                if v != fv:
                    g["lr"] = _same_type(g["lr"], v)
                    _replace_change(changes, f"{ofield}.param_groups[{i}].lr", fv, v)
        want_last = ([as_float(g.get("lr")) for g in groups] if groups else list(lrs or []))
        last = sd.get("_last_lr")
        if isinstance(last, list) and want_last and len(last) == len(want_last):
            for i, v in enumerate(want_last):
                if i < len(news) and news[i] is not None and v is not None and as_float(last[i]) != v:
                    _replace_change(changes, f"{sfield}._last_lr[{i}]", as_float(last[i]), v)
                    last[i] = _same_type(last[i], v)
    return changes


def _replace_change(changes: list[PolicyChange], field: str, old: float, new: float) -> None:
    """Record ``field: old -> new``, merging with an earlier change of the same field (keeps its ``old``)."""
    for c in changes:
        if c.field == field:
            c.new = new
            if c.new == c.old:  # rescaled, then set back by the closed form / the group's lr: no change
                changes.remove(c)
            return
    changes.append(PolicyChange(field, old, new))


def _rescale_scheduler(sd: dict, path: str, olds: list, news: list, changes: list, *, in_place: bool = True,
                       last_olds: list | None = None, seen: set | None = None) -> None:
    """Rescale ``base_lrs`` and ``_last_lr`` (also of SequentialLR/ChainedScheduler sub-schedulers).

    ``in_place``: write into the lists (a copied state, where a list may be reached by another path too); a
    live scheduler gets new lists (its lists are the very ones of the state dict it loaded, the caller's).
    ``last_olds``: the base ``_last_lr`` is rescaled from (default ``olds``)."""
    seen = set() if seen is None else seen
    for key in ("base_lrs", "_last_lr"):
        vals = sd.get(key)
        if id(vals) in seen:  # SequentialLR's _last_lr is its active sub-scheduler's very list: rescale it once
            continue
        seen.add(id(vals))
        key_olds = olds if key == "base_lrs" or last_olds is None else last_olds
        if isinstance(vals, (list, tuple)):
            new_vals = list(vals)
            for i, v in enumerate(vals):
                fv = as_float(v)
                if fv is None or i >= len(key_olds) or key_olds[i] is None or i >= len(news) or news[i] is None:
                    continue
                nv = _rescale(fv, key_olds[i], news[i])
                if nv != fv:
                    new_vals[i] = _same_type(v, nv)
                    changes.append(PolicyChange(f"{path}.{key}[{i}]", fv, nv))
            if isinstance(vals, list) and in_place:
                vals[:] = new_vals  # in place: a list reached through another path sees the same values
            else:
                sd[key] = type(vals)(new_vals)
    for j, sub in enumerate(sd.get("_schedulers") or []):
        sub_d = sub if isinstance(sub, dict) else getattr(sub, "__dict__", None)
        if isinstance(sub_d, dict):
            # A sub-scheduler schedules from its own base_lrs (restored by load_state_dict, whatever the group's
            # initial_lr says): rescale from those, so a stale sub-scheduler base gets the session's too.
            own = [as_float(b) for b in (sub_d.get("base_lrs") or [])]
            sub_olds = ([own[i] if i < len(own) and own[i] is not None else o for i, o in enumerate(olds)]
                        if scheduler_kind(sub_d) != "OneCycleLR" and own else olds)
            if not in_place:
                for key in ("base_lrs", "_last_lr"):
                    if isinstance(sub_d.get(key), list):
                        sub_d[key] = list(sub_d[key])
            # its _last_lr is at the group's scale (the closed form below sets the current LR)
            _rescale_scheduler(sub_d, f"{path}._schedulers[{j}]", sub_olds, news, changes, in_place=in_place,
                               last_olds=last_olds if last_olds is not None else olds, seen=seen)


def apply_session_policy(state: Any, *, lr: float | Sequence[float] | None = None,
                         session_config: dict | str | Path | None = None,
                         keys: dict | None = None, archived_config: Any = None) -> tuple[Any, list[PolicyChange]]:
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
        archived_config: the run's own config (packed with ``--config``; default: the copy inside the state):
            tells the base of a ReduceLROnPlateau group, which the state does not keep.

    Which config keys a scheduler takes its LRs from (:mod:`.lr_bases`): CyclicLR ``base_lr``/``max_lr``
    (its ``base_lrs``/``max_lrs``/``initial_lr`` and the current ``lr`` at the same point of the cycle are
    rewritten; the config's ``lr``, overridden by CyclicLR, is ignored; ``lr=`` means ``base_lr``);
    ReduceLROnPlateau ``lr`` against its archived base (the current ``lr`` is rescaled by session / archived
    base, keeping the reductions; refused where the archived base cannot be told and differs).

    Returns:
        ``(new_state, changes)``: a structural copy and the list of :class:`PolicyChange`.

    Raises:
        UsageError: neither optimizer nor scheduler state, or as many LRs as neither 1 nor the number of groups;
            a ReduceLROnPlateau state whose base cannot be told while the session's lr is not its lr.
        SourceError: unreadable config file.
    """
    sess = session_values(session_config)
    if lr is not None:
        sess["lr"] = lr
    arch_lr = _archived_lr(state, archived_config)
    new_state = _copy_tree(state)
    parts = find_parts(new_state, keys)
    changes: list[PolicyChange] = []
    opt_entries = parts.get("optimizer", [])
    sch_entries = parts.get("scheduler", [])
    if not opt_entries:
        # A scheduler alone: its base_lrs take over at the next scheduler.step(); rewrite them (and _last_lr).
        if ("lr" in sess or "scheduler" in sess) and sch_entries:
            for sch_path, sch in sch_entries:
                if "lr" in sess:
                    bases = [as_float(b) for b in primary_base_lrs(sch)]  # SequentialLR: its sub-schedulers'
                    wants, want_max = cyclic_wants(sch, sess, lr, len(bases))
                    changes += impose_lrs([], sch, wants if wants is not None else
                                          spread_scalar_lr(sess["lr"], bases, arch_lr),
                                          "optimizer", str(sch_path) or "scheduler", want_max=want_max)
                changes += _impose_sched_settings(sch, [], sess, str(sch_path) or "scheduler", "optimizer")
            return new_state, changes
        if "lr" in sess or any(k in sess for k in HYPER_NAMES):
            raise UsageError("the checkpoint has neither optimizer nor scheduler state: there is no policy to "
                             "rewrite")
        return new_state, changes
    for n, (opt_path, opt) in enumerate(opt_entries):
        opt_field = str(opt_path) or "optimizer"
        groups = [g for g in (opt.get("param_groups") or []) if isinstance(g, dict)]
        sch = sch_entries[n][1] if n < len(sch_entries) else None
        sch_field = str(sch_entries[n][0]) if n < len(sch_entries) else "scheduler"
        kind = base_kind(sch)
        if kind == "cyclic":
            wants, want_max = cyclic_wants(sch, sess, lr, len(groups))
            changes += impose_lrs(groups, sch, wants or [], opt_field, sch_field, want_max=want_max)
        elif "lr" in sess:
            olds = plateau_bases(groups, sch, arch_lr) if kind == "plateau" else None
            if kind == "plateau":
                wants = per_group(sess["lr"], len(groups)) if None in olds else spread_scalar_lr(sess["lr"], olds,
                                                                                                arch_lr)
            else:
                wants = session_bases(groups, {"lr": lr} if lr is not None else sess, arch_lr)
            changes += impose_lrs(groups, sch, wants, opt_field, sch_field, archived_bases=olds)
        for name in ("weight_decay", "momentum", "eps"):
            if name in sess:
                for i, g in enumerate(groups):
                    if name in g and as_float(g[name]) is not None and as_float(g[name]) != sess[name]:
                        changes.append(PolicyChange(f"{opt_field}.param_groups[{i}].{name}", as_float(g[name]),
                                                    sess[name]))
                        g[name] = sess[name]
        if "betas" in sess:
            for i, g in enumerate(groups):
                b = g.get("betas")
                if isinstance(b, (list, tuple)) and tuple(as_float(x) for x in b) != tuple(sess["betas"]):
                    changes.append(PolicyChange(f"{opt_field}.param_groups[{i}].betas",
                                                tuple(as_float(x) for x in b), tuple(sess["betas"])))
                    g["betas"] = type(b)(sess["betas"])
        if sch is not None:
            changes += _impose_sched_settings(sch, groups, sess, sch_field or "scheduler", opt_field)
    for sch_path, sch in sch_entries[len(opt_entries):]:  # schedulers without an optimizer of their own
        changes += _impose_sched_settings(sch, [], sess, str(sch_path) or "scheduler", "optimizer")
    return new_state, changes


def _impose_sched_settings(sch: Any, groups: list, sess: dict, sfield: str, ofield: str) -> list[PolicyChange]:
    """Write the session config's scheduler settings (``T_max``, ``eta_min``, ...) into the copied scheduler
    state; where the schedule has a closed form (:func:`derive_lrs`), the group's ``lr`` and ``_last_lr`` become
    it at the archived ``last_epoch`` with the session's settings, so the next ``scheduler.step()`` (chainable
    schedulers compute from the current LR) continues the session's schedule. Progress is never touched."""
    if "scheduler" not in sess or not isinstance(sch, dict):
        return []
    changes = [PolicyChange(f"{sfield}.{k}", old, new, note)
               for k, old, new, note in sched_settings.impose(sch, sess["scheduler"])]
    if not changes:
        return changes
    _, lrs, _ = derive_lrs(sch, list(groups) or None)
    if lrs is None:
        return changes
    for i, v in enumerate(lrs):
        g = groups[i] if i < len(groups) else None
        if g is not None and as_float(g.get("lr")) is not None and as_float(g["lr"]) != v:
            changes.append(PolicyChange(f"{ofield}.param_groups[{i}].lr", as_float(g["lr"]), v,
                                        "the schedule's LR at the archived last_epoch with the session's settings"))
            g["lr"] = _same_type(g["lr"], v)
    last = sch.get("_last_lr")
    if isinstance(last, list) and len(last) == len(lrs):
        for i, v in enumerate(lrs):
            if as_float(last[i]) is not None and as_float(last[i]) != v:
                changes.append(PolicyChange(f"{sfield}._last_lr[{i}]", as_float(last[i]), v))
                last[i] = _same_type(last[i], v)
    return changes
