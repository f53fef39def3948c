"""The session's policy against the checkpoint's: every field that differs, which value wins, and when it
takes effect.

``optimizer.load_state_dict`` restores the archived ``lr`` (and ``initial_lr``, the scheduler's ``base_lrs``),
so a session that lowered its LR in its config silently trains with the archived one.
:func:`compare_with_session` names every field that differs, from the one :mod:`.plan` the ``--policy session``
rewrite (:func:`~ckpt_archive.training.impose.apply_session_policy`) uses, and says when each takes effect from
the next-step model (:mod:`.nextstep`): the first of the next optimizer steps whose LR differs between the two
policies, computed by the real torch scheduler. ``--expect-lr`` is compared with the next step of that model.

Reading configs is :mod:`.session_config`; the rewrite is :mod:`.impose` (both re-exported here, where they
were first defined).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Sequence

from ckpt_archive.errors import UsageError
from ckpt_archive.training import sched_settings
from ckpt_archive.training.changes import PolicyChange
from ckpt_archive.training.impose import apply_session_policy, impose_lrs
from ckpt_archive.training.lr_bases import cyclic_slots, plateau_reductions
from ckpt_archive.training.nextstep import GroupSteps, PolicyModel, build_model
from ckpt_archive.training.plan import PairPlan
from ckpt_archive.training.schedulers import nested_base_lrs, primary_base_lrs, scheduler_kind
from ckpt_archive.training.session_config import (HYPER_NAMES, lr_base_field, per_group, session_bases, session_values,
                                                  spread_scalar_lr)
from ckpt_archive.training.values import as_float, coerce_float, fmt_pair, fmt_value, jsonable, nearly_equal

#: relative tolerance of ``expect_lr``: accepts an LR copied from ``inspect``'s 7 significant digits
EXPECT_RTOL = 1e-6


@dataclasses.dataclass
class PolicyDifference:
    """One archived-vs-session difference (:func:`compare_with_session`).

    Attributes:
        field: path in the state, e.g. ``"optimizer.param_groups[0].lr"``.
        archived: the value in the checkpoint (for ``--expect-lr``: the LR the next step runs at under the policy).
        session: the value the session asks for (for ``--expect-lr``: the expected LR).
        wins: ``"checkpoint"`` or ``"session"``: which value the next step uses under the policy; ``"script"``
            where the training script sets the LR itself every step.
        switch: what selects the other one (``"--policy session"`` / ``"--policy checkpoint"``; for
            ``--expect-lr``: ``"--session-config with --policy session"``).
        message: one line with all of the above, and the next steps under each policy.
        when: when the archived value takes effect, from the next-step model: ``"now"`` (the next optimizer step
            runs at another LR), ``"at the next scheduler.step()"`` (the step after it does), ``"at optimizer step
            k"``, or ``"at a later scheduler.step() ..."``.
        config_key: the session config's key path the session value comes from (``optimizer.lr``).
        lr_set_by: for an LR field, who sets the group's LR: ``"scheduler"``, ``"state"`` (no scheduler: the
            archived lr stays) or ``"script"``; ``""`` for other fields.
    """

    field: str
    archived: Any
    session: Any
    wins: str
    switch: str
    message: str
    when: str = "now"
    config_key: str = ""
    lr_set_by: str = ""

    def to_json(self) -> dict:
        """The fields as strict JSON."""
        return jsonable(dataclasses.asdict(self))

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass
class _Diff:
    """A field whose archived value differs from the session's, before its message is made from the model."""

    field: str
    archived: Any
    session: Any
    what: str
    pair: int
    group: int | None
    rule: str  # "lr" (an LR or LR base), "hyper" (read by the next optimizer step), "setting" (scheduler's)
    loader: str = ""


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
            optimizer) or one per group; compared with the next step of the model under ``policy`` (field
            ``...param_groups[i].lr``) within :data:`EXPECT_RTOL`; without optimizer state with the scheduler's
            ``_last_lr``.
        policy: ``"checkpoint"`` (default: ``optimizer.load_state_dict`` overrides the session's values) or
            ``"session"``; decides ``wins`` and the switch named for the other choice.
        keys: part -> path overrides (see :func:`find_parts`).
        archived_config: the run's own config (packed with ``--config``; default: the copy inside the
            state): tells the base LR of a ReduceLROnPlateau group, which the state does not keep, the
            reference a single LR or hyperparameter replaces, and whether the script schedules the LR itself.

    Each scheduler kind is compared on the config keys it takes its LRs from (:mod:`.lr_bases`): OneCycleLR
    ``max_lr`` with the group's ``max_lr``; CyclicLR ``base_lr``/``max_lr`` with ``base_lrs``/``max_lrs``;
    ReduceLROnPlateau ``lr`` with its base (the current ``lr`` is the base after whole reductions by
    ``factor``); others ``lr`` with ``initial_lr``. A current LR that differs from the base by warmup,
    decay or reductions is progress, never a difference; so is the ``lr`` of a group without scheduler state
    whose config names a hand-written schedule (the script sets it every step), and a hyperparameter of a
    group the script set apart (``weight_decay = 0`` on norms and biases).

    Returns:
        One :class:`PolicyDifference` per field whose values differ (relative tolerance
        :data:`LR_RTOL`); equal values give nothing.

    Raises:
        UsageError: bad ``policy``, or as many LRs as neither 1 nor the number of groups.
        SourceError: unreadable config file.
    """
    if policy not in ("checkpoint", "session"):
        raise UsageError(f"policy must be 'checkpoint' or 'session', not {policy!r}")
    model = build_model(state, session_config=session_config, keys=keys, archived_config=archived_config,
                        drivers=expect_lr is not None)  # only --expect-lr's message names what drives the steps
    return differences(model, expect_lr=expect_lr, policy=policy, state=state, keys=keys,
                       archived_config=archived_config)


def differences(model: PolicyModel, *, expect_lr: float | Sequence[float] | None = None,
                policy: str = "checkpoint", state: Any = None, keys: dict | None = None,
                archived_config: Any = None) -> list[PolicyDifference]:
    """The differences of :func:`compare_with_session`, from a built :class:`PolicyModel`.

    ``state`` (with the ``keys`` and ``archived_config`` the model was built with): the checkpoint, so that an
    ``expect_lr`` difference names the session config ``lr`` that gives the expected next-step LR under
    ``--policy session`` (found with real torch; the config's ``lr`` is the schedule's base LR, not the next
    step's). Without it the advice names no value it has not checked.

    Raises:
        UsageError: ``expect_lr`` gives as many LRs as neither 1 nor the number of groups.
    """
    sess = model.sess
    raw: list[_Diff] = []
    for p in model.plans:
        if p.groups:
            raw += list(_lr_diffs(p, sess)) + list(_hyper_diffs(p, sess))
    for p in model.plans:
        raw += list(_setting_diffs(p, sess))
    if not any(p.opt is not None for p in model.plans) and "lr" in sess:
        for p in model.plans:
            raw += list(_scheduler_only_diffs(p, sess))
    out = [_difference(d, model, policy) for d in raw]
    if expect_lr is not None:
        out += _expect_diffs(model, expect_lr, policy, _SessionLrFinder(state, keys, archived_config, sess))
    return out


# -- which fields differ (from the plan) ---------------------------------------------------------------

def _src(sess: dict, key: str) -> str:
    return (sess.get("source") or {}).get(key, key)


def _lr_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    if p.kind == "cyclic" and isinstance(p.sch, dict):
        yield from _cyclic_diffs(p, sess)
    elif p.bases is None:
        return
    elif p.kind == "plateau":
        yield from _plateau_diffs(p, sess)
    else:
        yield from _plain_diffs(p, sess)
        if p.kind == "plain" and isinstance(p.sch, dict):
            yield from _sched_base_diffs(p, sess)


def _cyclic_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    """CyclicLR: config ``base_lr`` against ``base_lrs`` (= ``initial_lr``), ``max_lr`` against ``max_lrs``;
    the config's ``lr`` is the optimizer constructor's, which CyclicLR overrides, and is not compared."""
    slots = cyclic_slots(p.groups, p.sch)
    for key, pos, name, wants in (("base_lr", 0, "base_lrs", p.bases), ("max_lr", 1, "max_lrs", p.base_max)):
        if key not in sess or wants is None:
            continue
        for i, slot in enumerate(slots):
            have, want = slot[pos], coerce_float(wants[i]) if i < len(wants) else None
            if have is not None and want is not None and not nearly_equal(have, want):
                yield _Diff(f"{p.sch_field}.{name}[{i}]", have, want,
                            f"config {_src(sess, key)}; CyclicLR cycles between base_lrs and max_lrs", p.index, i, "lr")


def _plateau_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    """ReduceLROnPlateau: the archived base (``initial_lr``, or the archived config's ``lr`` the group's ``lr`` is
    after whole reductions) against the session's; where the base cannot be told, the ``lr`` that is not the
    session's after whole reductions by ``factor``."""
    factor = as_float(p.sch.get("factor"))
    mins = list(p.sch.get("min_lrs") or [])
    for i, g in enumerate(p.groups):
        cur, old = as_float(g.get("lr")), p.archived_bases[i]
        want = coerce_float(p.bases[i]) if i < len(p.bases) else None
        if want is None or cur is None:
            continue
        if old is not None and not nearly_equal(old, want):
            fname = "initial_lr" if "initial_lr" in g else "lr"
            yield _Diff(f"{p.opt_field}.param_groups[{i}].{fname}", old, want,
                        f"config {_src(sess, 'lr')}; the ReduceLROnPlateau base LR"
                        + ("" if fname == "initial_lr" else f" (the current lr {fmt_value(cur)} is it after the "
                           f"plateau reductions)"), p.index, i, "lr")
        elif old is None and plateau_reductions(cur, want, factor, mins[i] if i < len(mins) else None) is None:
            yield _Diff(f"{p.opt_field}.param_groups[{i}].lr", cur, want,
                        f"config {_src(sess, 'lr')}; ReduceLROnPlateau keeps no base LR and the lr is not this one "
                        f"after whole reductions by factor {fmt_value(factor)}", p.index, i, "lr")


def _plain_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    """The group's base field (``max_lr`` for OneCycleLR, ``initial_lr`` once a scheduler was attached, else
    ``lr``) against the session's base."""
    for i, g in enumerate(p.groups):
        fname = lr_base_field(g)
        have = as_float(g.get(fname))
        want = coerce_float(p.bases[i]) if i < len(p.bases) else None
        if want is None or have is None or nearly_equal(have, want):
            continue
        what = f"config {_src(sess, 'max_lr' if fname == 'max_lr' and 'max_lr' in sess else 'lr')}"
        if fname != "lr":
            what += f"; {fname} is the schedule's base LR"
        if p.notes:
            what += f"; {p.notes[0]}"
        yield _Diff(f"{p.opt_field}.param_groups[{i}].{fname}", have, want, what, p.index, i, "lr")


def _sched_base_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    """The scheduler's own ``base_lrs`` (also of SequentialLR/ChainedScheduler sub-schedulers) against the
    session's base, where they disagree with the group's base field (which is compared already).

    ``scheduler.load_state_dict`` restores ``base_lrs`` and the next ``scheduler.step()`` computes the LR from
    them, whatever the group's ``initial_lr`` says: a scheduler state from an older run (``base_lrs`` 1e-6)
    next to an optimizer built with 1e-4 runs the next day at 1e-6's schedule."""
    subs = [(p.sch_field, p.sch)] + [(f"{p.sch_field}._schedulers[{j}]", s)
                                     for j, s in enumerate(p.sch.get("_schedulers") or []) if isinstance(s, dict)]
    for field, sd in subs:
        if scheduler_kind(sd) == "OneCycleLR":
            continue  # its base_lrs are max_lr / div_factor, not the configured LR
        for i, b in enumerate(sd.get("base_lrs") or []):
            have = as_float(b)
            want = coerce_float(p.bases[i]) if i < len(p.bases) else None
            g = p.groups[i] if i < len(p.groups) else None
            gbase = as_float(g.get(lr_base_field(g))) if g is not None else None
            if have is None or want is None or nearly_equal(have, want):
                continue
            if gbase is not None and nearly_equal(gbase, have) and not nearly_equal(gbase, want):
                continue  # the same value as the group's base field, reported there
            yield _Diff(f"{field}.base_lrs[{i}]", have, want,
                        f"config {_src(sess, 'lr')}; the scheduler computes the LR from its restored base_lrs, not "
                        f"from the group's {lr_base_field(g) if g is not None else 'lr'}", p.index,
                        i if g is not None else None, "lr")


def _hyper_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    """``weight_decay``, ``momentum``, ``eps``, ``betas`` against the group's; a group the script set apart keeps
    its own and is not compared (said in the message of the others)."""
    for name, wants in p.hypers.items():
        apart = p.apart.get(name, [])
        note = (f"; group(s) {', '.join(map(str, apart))} keep their own {name} (set apart by the script, e.g. no "
                f"decay on norms and biases)" if apart else "")
        for i, (g, want) in enumerate(zip(p.groups, wants)):
            have = g.get(name)
            if want is None or have is None:
                continue
            if name == "betas":
                if not isinstance(have, (list, tuple)) or len(have) != 2:
                    continue
                have = tuple(as_float(x) for x in have)
                if all(nearly_equal(x, y) for x, y in zip(have, want)):
                    continue
                want = tuple(want)
            elif as_float(have) is None or nearly_equal(as_float(have), want):
                continue
            else:
                have = as_float(have)
            yield _Diff(f"{p.opt_field}.param_groups[{i}].{name}", have, want, f"config {_src(sess, name)}{note}",
                        p.index, i, "hyper")


def _setting_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    """The scheduler's own settings: ``scheduler.load_state_dict`` restores them over the session's constructor."""
    if "scheduler" not in sess or p.sch is None:
        return
    for key, have, want, src in sched_settings.differences(p.sch, sess["scheduler"]):
        yield _Diff(f"{p.sch_field}.{key}", have, want,
                    f"config {src}; a scheduler setting, restored by scheduler.load_state_dict over the session's",
                    p.index, None, "setting", loader="scheduler")


def _scheduler_only_diffs(p: PairPlan, sess: dict) -> Iterable[_Diff]:
    """No optimizer state: the session's optimizer keeps its LR for the next step, then the archived scheduler's
    ``base_lrs`` (every one it restores, also SequentialLR/ChainedScheduler sub-schedulers') take over at the next
    ``scheduler.step()`` (scripts that restore only the scheduler). OneCycleLR reads the session's groups
    (``max_lr``), ReduceLROnPlateau keeps no ``base_lrs``."""
    if not isinstance(p.sch, dict):
        return
    if p.kind == "cyclic":
        yield from _cyclic_diffs(p, sess)
        return
    if p.kind != "plain" or p.bases is None:
        return
    for bfield, bs in nested_base_lrs(p.sch, p.sch_field):
        for i, (b, want) in enumerate(zip(bs, p.bases)):
            have, want = as_float(b), coerce_float(want)
            if have is not None and want is not None and not nearly_equal(have, want):
                yield _Diff(f"{bfield}.base_lrs[{i}]", have, want,
                            f"config {_src(sess, 'lr')}; the checkpoint holds no optimizer state, so the next step "
                            f"runs at the session's LR, then scheduler.step() switches to the archived base_lrs",
                            p.index, i, "lr")


# -- the message of each, from the next-step model -------------------------------------------------------

def _difference(d: _Diff, model: PolicyModel, policy: str) -> PolicyDifference:
    when, effect = _when(d, model)
    a, s = fmt_pair(d.archived, d.session)
    switch = "--policy session" if policy == "checkpoint" else "--policy checkpoint"
    if policy == "checkpoint":
        loader = d.loader or ("scheduler" if d.field.rsplit(".", 1)[-1].startswith(("base_lrs", "_last_lr", "max_lrs"))
                              else "optimizer")
        tail = f"the checkpoint's value wins ({loader}.load_state_dict restores it); {switch} keeps the session's"
    else:
        tail = f"the session's value wins (--policy session rewrites it); {switch} keeps the checkpoint's"
    gs = model.group(d.pair, d.group) if d.group is not None else None
    return PolicyDifference(d.field, d.archived, d.session, policy, switch,
                            f"{d.field}: archived {a}, session {s} ({d.what}; takes effect {when}{effect}); {tail}",
                            when, d.what.split(";", 1)[0].removeprefix("config "),
                            gs.lr_set_by if gs is not None and d.rule == "lr" else "")


def _when(d: _Diff, model: PolicyModel) -> tuple[str, str]:
    """When the archived value takes effect, and the next steps under each policy: the first step whose LR differs
    between the checkpoint's and the session's (real torch); a hyperparameter is read by the next step."""
    if d.rule == "hyper":
        return "now", ""
    cands = [model.group(d.pair, d.group)] if d.group is not None else (
        model.groups[d.pair] if d.pair < len(model.groups) else [])
    cands = [g for g in cands if g is not None and g.session is not None]
    firsts = [(k, g) for g in cands if (k := g.first_difference()) is not None]
    if firsts:
        k, g = min(firsts, key=lambda kg: kg[0])
        when = "now" if k == 1 else "at the next scheduler.step()" if k == 2 else f"at optimizer step {k}"
        return when, (f": the next optimizer steps run at {_values(g.checkpoint)} (archived) instead of "
                      f"{_values(g.session)}")
    if cands:
        return ("now", "") if d.field.endswith(".lr") else (
            f"at a later scheduler.step() (torch's scheduler arithmetic: not in the next {model.steps} steps)", "")
    return ("now" if d.field.endswith(".lr") else "at the next scheduler.step()"), ""


def _values(vals: list) -> str:
    return ", ".join("the session's LR" if v is None else fmt_value(v) for v in vals)


# -- --expect-lr ---------------------------------------------------------------------------------------------

class _SessionLrFinder:
    """The session config ``lr`` under which the next step of one param group runs at a wanted LR.

    ``--policy session`` treats the config's ``lr`` as the schedule's base LR (``initial_lr``, ``base_lrs``), so the
    next step runs at what the schedule makes of it (StepLR after 10 updates with gamma 0.5 every 3: an eighth).
    Advice to restore with ``lr: <expected>`` then gave another LR and a second warning [issue 26]. The value is
    found with real torch (the same model ``--policy session`` is checked with): the next-step LR for ``lr: 1``,
    scaled, then confirmed; a schedule for which no such value holds (not proportional to its base) gives None.
    """

    def __init__(self, state: Any, keys: dict | None, archived_config: Any, sess: dict | None = None):
        self.state, self.keys, self.archived_config = state, keys, archived_config
        self.sess = dict(sess or {})  # the session's other values (scheduler settings among them) hold

    def _next(self, lr: float, flat_index: int) -> float | None:
        sess = {**self.sess, "lr": lr, "source": {**(self.sess.get("source") or {}), "lr": "lr"}}
        model = build_model(self.state, sess=sess, keys=self.keys, archived_config=self.archived_config,
                            drivers=False)
        flat = model.flat()
        if flat_index >= len(flat):
            return None
        vals = flat[flat_index][1].values("session")
        return as_float(vals[0]) if vals else None

    def __call__(self, want: float, flat_index: int) -> float | None:
        if self.state is None or not want or want != want:
            return None
        try:
            unit = self._next(1.0, flat_index)
            if not unit:
                return None
            lr = float(f"{want / unit:.7g}")
            got = self._next(lr, flat_index)
        except Exception:  # noqa: BLE001 - advice only: a state this cannot rebuild gets no value
            return None
        return lr if got is not None and nearly_equal(got, want, EXPECT_RTOL) else None


def _expect_diffs(model: PolicyModel, expect_lr: Any, policy: str,
                  finder: "_SessionLrFinder | None" = None) -> list[PolicyDifference]:
    """``expect_lr`` against the LR the next step runs at under ``policy``: a float means group 0 of each optimizer
    (a head group at another LR is not what it means), a list one LR per param group in the audit's order. A
    difference names where the next step's LR comes from and what drives the steps after it.

    Raises:
        UsageError: as many LRs as neither 1 nor the number of groups.
    """
    flat = model.flat()
    if isinstance(expect_lr, (list, tuple)):
        if len(expect_lr) not in (1, len(flat)):
            raise UsageError(f"--expect-lr gives {len(expect_lr)} LRs for {len(flat)} param groups")
        wants = list(expect_lr) * (len(flat) if len(expect_lr) == 1 else 1)
    else:
        wants = [expect_lr if g.index == 0 else None for _, g in flat]
    out = []
    for k, ((p, g), want) in enumerate(zip(flat, wants)):
        want = coerce_float(want)
        now = g.values(policy)[0] if g.values(policy) else None
        if want is None:
            continue
        if g.lr_set_by == "script":
            out += _expect_script(p, g, want)
        elif now is None:
            out += _expect_without_optimizer(p, g, want, policy)
        elif not nearly_equal(now, want, EXPECT_RTOL):
            # only a lone expected LR (or one per group) has one config lr to name; a per-group list needs per-group
            # config values, which the message leaves to the user
            config_lr = finder(want, k) if finder is not None and not isinstance(expect_lr, (list, tuple)) else None
            out.append(_expect_difference(p, g, now, want, policy, config_lr))
    return out


def _expect_difference(p: PairPlan, g: GroupSteps, now: float, want: float, policy: str,
                       config_lr: float | None = None) -> PolicyDifference:
    a, s = fmt_pair(now, want)
    field = f"{g.field}.lr"
    steps = g.describe(policy)
    if config_lr is None:
        how = ("the session config's lr is the schedule's base LR, not the next step's: set the one that gives "
               f"{s} at the next step")
    elif nearly_equal(config_lr, want, EXPECT_RTOL):
        how = f"--session-config (lr: {fmt_value(config_lr)})"
    else:
        how = (f"--session-config (lr: {fmt_value(config_lr)}; the config's lr is the schedule's base LR, which "
               f"the schedule makes {s} at the next step)")
    if policy == "checkpoint":
        where, switch = "archived", "--session-config with --policy session"
        tail = (f"to train at {s}, restore with {how} and --policy session, or set the LR in the script"
                if config_lr is not None else
                f"to train at {s}, restore with --session-config and --policy session ({how}), or set the LR in "
                f"the script")
    else:
        where, switch = "after --policy session", ""
        tail = (f"--policy session gives {a} from the session config's lr; to train at {s}, "
                + (f"restore with {how}" if config_lr is not None else "set the LR in the script"))
    return PolicyDifference(field, now, want, policy, switch, (
        f"{field}: the next step runs at {a} ({where}), expected {s} (--expect-lr): the next optimizer steps run at "
        f"{steps}; {tail}"), "now", "--expect-lr", g.lr_set_by)


def _expect_script(p: PairPlan, g: GroupSteps, want: float) -> list[PolicyDifference]:
    """A group whose LR the training script sets every step: the next step runs at what the script sets; the
    archived ``lr`` (the last step's) is named where it is not the expected one."""
    have = as_float(p.groups[g.index].get("lr")) if g.index < len(p.groups) else None
    if have is None or nearly_equal(have, want, EXPECT_RTOL):
        return []
    a, s = fmt_pair(have, want)
    field = f"{g.field}.lr"
    return [PolicyDifference(field, have, want, "script", "", (
        f"{field}: archived {a}, expected {s} (--expect-lr): the training script sets the LR every step "
        f"({', '.join(p.code_keys)}), so the next step runs at what it sets; {a} is the archived last step's, "
        f"and --expect-lr cannot be checked against the archive"), "now", "--expect-lr", g.lr_set_by)]


def _expect_without_optimizer(p: PairPlan, g: GroupSteps, want: float, policy: str) -> list[PolicyDifference]:
    """No optimizer state and no session LR known: the next step runs at the session's LR, but the archived scheduler
    is at ``_last_lr`` and its next step computes from the archived ``base_lrs``, whatever the session's LR."""
    if not isinstance(p.sch, dict):
        return []
    last, bases = list(p.sch.get("_last_lr") or []), primary_base_lrs(p.sch)
    have = as_float(last[g.index]) if g.index < len(last) else None
    if have is None or nearly_equal(have, want, EXPECT_RTOL):
        return []
    base = as_float(bases[g.index]) if g.index < len(bases) else None
    after = (f"; the next scheduler.step() sets {fmt_value(g.after_step)} whatever the session's LR"
             if g.after_step is not None and g.session_independent else "")
    field = f"{p.sch_field}._last_lr[{g.index}]"
    a, s = fmt_pair(have, want)
    return [PolicyDifference(field, have, want, policy, "--session-config with --policy session", (
        f"{field}: archived {a}, expected {s} (--expect-lr: no optimizer state, so the next step runs at the session's "
        f"LR, but the archived scheduler's LR is this one (base_lrs {fmt_value(base)}){after}; takes effect at the "
        f"next scheduler.step()); to train at {s}, restore with --session-config (lr: {s}) and --policy session"),
        "at the next scheduler.step()", "--expect-lr", g.lr_set_by)]


__all__ = ["PolicyDifference", "PolicyChange", "compare_with_session", "differences", "apply_session_policy",
           "impose_lrs", "session_values", "session_bases", "spread_scalar_lr", "per_group", "lr_base_field",
           "HYPER_NAMES", "EXPECT_RTOL"]
