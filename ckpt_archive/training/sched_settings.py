"""The scheduler's own hyperparameters (``T_max``, ``eta_min``, ``gamma``, ``total_steps``, ...) against the
session config's ``scheduler`` / ``lr_scheduler`` / ``sched`` section.

``LRScheduler.load_state_dict`` restores every attribute of the archived scheduler, its *settings* as well as
its position: a session resumed with a longer schedule (config ``scheduler.T_max: 20000``, archive
``T_max: 10000``) silently runs the archived one. A config key is compared with the archived scheduler
state's key of the very same name (case-sensitive); progress fields (``last_epoch``, ``_step_count``,
``_last_lr``, ``best``, ``num_bad_epochs``, ``cooldown_counter``, ``T_cur``, ...) and the LR bases (compared
by :mod:`.session`) never are. Top-level scheduler state only (not SequentialLR/ChainedScheduler sub-schedulers).
"""
from __future__ import annotations

import collections
from typing import Any

from ckpt_archive.training.values import as_float, coerce_float, nearly_equal

#: config section names holding scheduler settings (case-insensitive)
SECTIONS = ("scheduler", "lr_scheduler", "sched")
#: state keys that are progress (or LR bases, compared elsewhere), never compared with a config
PROGRESS = frozenset({
    "last_epoch", "_step_count", "_last_lr", "best", "num_bad_epochs", "cooldown_counter", "T_cur", "T_i",
    "base_lrs", "max_lrs", "verbose", "lr_lambdas", "mode_worse", "_get_lr_called_in_step",
})


def _scalar(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str)) and not isinstance(v, bytes)


def config_settings(cfg: Any) -> dict:
    """``{key: (value, "section.key")}`` for every scalar (or list of scalars) under a scheduler section."""
    out: dict = {}
    if not isinstance(cfg, dict):
        return out
    for sec_name, sec in cfg.items():
        if not isinstance(sec_name, str) or sec_name.lower() not in SECTIONS or not isinstance(sec, dict):
            continue
        for k, v in sec.items():
            if not isinstance(k, str) or k.startswith("_") or k in PROGRESS:
                continue
            if _scalar(v) or (isinstance(v, (list, tuple)) and v and all(_scalar(x) for x in v)):
                out.setdefault(k, (v, f"{sec_name}.{k}"))
    return out


def _milestone_list(v: Any) -> list | None:
    if isinstance(v, dict):  # MultiStepLR keeps a Counter: milestone -> multiplicity
        try:
            return sorted(int(m) for m, c in v.items() for _ in range(int(c)))
        except (TypeError, ValueError):
            return None
    if isinstance(v, (list, tuple)):
        return list(v)
    return None


def _same(archived: Any, session: Any) -> bool:
    if isinstance(archived, bool) or isinstance(session, bool):
        return archived == session
    if isinstance(archived, str):
        return archived == str(session)
    if isinstance(archived, (dict, list, tuple)):
        a, s = _milestone_list(archived), session if isinstance(session, (list, tuple)) else [session]
        if a is None or len(a) != len(s):
            return False
        return all(_same(x, y) for x, y in zip(a, sorted(s) if isinstance(archived, dict) else s))
    a, s = as_float(archived), coerce_float(session)
    return a is not None and s is not None and nearly_equal(a, s)


def _converted(archived: Any, session: Any) -> Any:
    """The session value in the archived value's type (an int stays an int); None if it cannot be."""
    if isinstance(archived, (bool, str)):
        return session if isinstance(session, type(archived)) else None
    if isinstance(archived, dict):
        return _counter(archived, session)
    if isinstance(archived, (list, tuple)):
        s = session if isinstance(session, (list, tuple)) else [session] * len(archived)
        if len(s) != len(archived):
            return None
        vals = [_converted(a, x) for a, x in zip(archived, s)]
        return None if None in vals else type(archived)(vals)
    s = coerce_float(session)
    if s is None or as_float(archived) is None:
        return None
    if isinstance(archived, int):
        return int(s) if s == int(s) else None
    return s


def _counter(archived: dict, session: Any) -> Any:
    """MultiStepLR's milestones (a Counter: milestone -> multiplicity) from a session list of whole numbers."""
    s = session if isinstance(session, (list, tuple)) else [session]
    vals = [coerce_float(x) for x in s]
    if None in vals or any(v != int(v) for v in vals):
        return None
    c = collections.Counter(int(v) for v in vals)
    return c if type(archived) is collections.Counter else type(archived)(c)


def differences(sd: Any, settings: dict) -> list[tuple[str, Any, Any, str]]:
    """``(key, archived, session, config key)`` for each setting the archived scheduler state holds with
    another value."""
    out = []
    if not isinstance(sd, dict):
        return out
    for k, (v, src) in settings.items():
        if k not in sd or k.startswith("_") or k in PROGRESS:
            continue
        arch = sd[k]
        if not (_scalar(arch) or isinstance(arch, (list, tuple, dict))):
            continue
        if not _same(arch, v):
            out.append((k, arch, v, src))
    return out


def impose(sd: dict, settings: dict) -> list[tuple[str, Any, Any, str]]:
    """Write the session's settings into the scheduler state ``sd`` (in place, archived types kept).

    OneCycleLR's ``total_steps`` also moves its phases' ``end_step`` (``pct_start * total_steps - 1``, ...),
    which its constructor derived from it. Returns ``(key, old, new, note)`` per rewritten key."""
    done = []
    for k, arch, want, _src in differences(sd, settings):
        new = _converted(arch, want)
        if new is None:
            continue
        note = ""
        if k == "total_steps" and isinstance(sd.get("_schedule_phases"), list):
            note = _move_phases(sd["_schedule_phases"], as_float(arch), float(new))
        sd[k] = new
        done.append((k, arch, new, note))
    return done


def _move_phases(phases: list, old_total: float | None, new_total: float) -> str:
    if not old_total or not all(isinstance(p, dict) and as_float(p.get("end_step")) is not None for p in phases):
        return ""
    ends = [as_float(p["end_step"]) for p in phases]
    pct = (ends[0] + 1) / old_total
    if len(ends) == 2:
        new_ends = [pct * new_total - 1, new_total - 1]
    elif len(ends) == 3:
        new_ends = [pct * new_total - 1, 2 * pct * new_total - 2, new_total - 1]
    else:
        return ""
    for p, e in zip(phases, new_ends):
        p["end_step"] = type(p["end_step"])(e) if isinstance(p["end_step"], (int, float)) else e
    return f"phase end steps moved to {', '.join(f'{e:g}' for e in new_ends)} (pct_start {pct:g} kept)"
