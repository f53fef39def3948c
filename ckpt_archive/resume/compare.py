"""Comparing a resumed (or control) run with the continuous one: per update, final state, next draws.

:func:`compare_trajectories` compares the per-update records (sample ids, LR of every param group,
loss); :class:`TreeDiff` compares two final states leaf by leaf; :func:`compare_runs` puts both
together with the next draws of every random stream and says where the runs first diverge. Floats
are equal within ``|expected - got| <= atol + rtol * |expected|``; non-finite values and structure
differences are flagged, never accepted silently.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, Iterable

from ckpt_archive.format.state_path import StatePath
from ckpt_archive.resume.trajectory import encode_float
from ckpt_archive.training.parts import CONVENTIONAL_KEYS, is_tensor, rng_streams

#: Keys whose final-state difference counts as a *training* difference for a negative control.
TRAINING_KEYS = ("model", "optimizer", "scheduler", "scaler")
#: At most this many leaf differences are listed per comparison (all are counted).
MAX_LISTED = 20


def within_tolerance(a: float, b: float, atol: float, rtol: float) -> bool:
    """``|a - b| <= atol + rtol * |a|``; non-finite values are equal only to the same value (NaN to NaN)."""
    if math.isfinite(a) and math.isfinite(b):
        return abs(a - b) <= atol + rtol * abs(a)
    return (math.isnan(a) and math.isnan(b)) or a == b


def _jsonable(v):
    """A value for the report: floats through :func:`encode_float`, other objects as a short repr."""
    if isinstance(v, float):
        return encode_float(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    return repr(v)[:200]


def _show(path: StatePath) -> str:
    return str(path) or "<root>"


class TreeDiff:
    """Leaf-by-leaf comparison of two nested states in depth-first order.

    Args:
        atol / rtol: float tolerance (:func:`within_tolerance`).
        skip: paths not compared (streams declared without effect).

    Attributes:
        diffs: the first :data:`MAX_LISTED` differences as report entries (``field``, ``kind``,
            ``expected``, ``got``, ...); ``paths``: their :class:`StatePath`, in the same order.
        total: how many differences in all.
        non_finite: paths of non-finite values (flagged even where both sides agree).
        max_abs: path -> largest absolute difference of a tensor.
    """

    def __init__(self, atol: float, rtol: float, skip: Iterable[tuple] = ()):
        self.atol, self.rtol = atol, rtol
        self.skip = set(skip)
        self.diffs: list[dict] = []
        self.paths: list[StatePath] = []
        self.total = 0
        self.non_finite: list[StatePath] = []
        self.max_abs: dict[StatePath, float] = {}

    def add(self, path, kind, expected=None, got=None, **extra):
        """Count one difference at ``path`` and list it while fewer than :data:`MAX_LISTED` are."""
        path = StatePath(path)
        self.total += 1
        if len(self.diffs) < MAX_LISTED:
            d = {"field": _show(path), "kind": kind, "expected": _jsonable(expected), "got": _jsonable(got)}
            d.update({k: _jsonable(v) for k, v in extra.items()})
            self.diffs.append(d)
            self.paths.append(path)

    def compare(self, a, b, path=StatePath()):
        """Compare ``a`` (expected) with ``b`` (got) below ``path``, recording every difference."""
        path = StatePath(path)
        if path in self.skip:
            return None
        if is_tensor(a) or is_tensor(b):
            return self._tensors(a, b, path)
        if type(a) is not type(b):
            return self.add(path, "type", type(a).__name__, type(b).__name__)
        if isinstance(a, dict):
            return self._dicts(a, b, path)
        if isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return self.add(path, "length", len(a), len(b))
            for i, (x, y) in enumerate(zip(a, b)):
                self.compare(x, y, path.at(i))
            return None
        if isinstance(a, float):
            return self._floats(a, b, path)
        if type(a).__module__ == "numpy" and hasattr(a, "shape"):
            import torch

            return self._tensors(torch.as_tensor(a), torch.as_tensor(b), path)
        if a != b:
            self.add(path, "value", a, b)
        return None

    def _dicts(self, a: dict, b: dict, path: StatePath) -> None:
        for k in a:
            if k not in b:
                self.add(path.child(k), "missing", "present", "absent")
            else:
                self.compare(a[k], b[k], path.child(k))
        for k in b:
            if k not in a:
                self.add(path.child(k), "extra", "absent", "present")

    def _floats(self, a: float, b: float, path: StatePath) -> None:
        if not (math.isfinite(a) and math.isfinite(b)):
            self.non_finite.append(path)
        if not within_tolerance(a, b, self.atol, self.rtol):
            self.add(path, "value", a, b, abs_diff=abs(a - b) if math.isfinite(a - b) else None)

    def _tensors(self, a, b, path: StatePath):
        import torch

        if not (is_tensor(a) and is_tensor(b)):
            return self.add(path, "type", type(a).__name__, type(b).__name__)
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return self.add(path, "structure", f"{a.dtype} {list(a.shape)}", f"{b.dtype} {list(b.shape)}")
        a, b = a.detach().cpu(), b.detach().cpu()
        name = path
        if a.is_floating_point() or a.is_complex():
            a64 = a.to(torch.complex128) if a.is_complex() else a.to(torch.float64)
            b64 = b.to(torch.complex128) if b.is_complex() else b.to(torch.float64)
            fa, fb = torch.isfinite(a64), torch.isfinite(b64)
            both = fa & fb
            if not bool(both.all()):
                self.non_finite.append(name)
            diff = torch.where(both, (a64 - b64).abs(), torch.zeros((), dtype=torch.float64))
            tol = self.atol + self.rtol * a64.abs()
            bad = (diff > tol) & both
            same_nonfinite = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
            bad |= ~both & ~same_nonfinite
            self.max_abs[name] = float(diff.max()) if diff.numel() else 0.0
        else:
            bad = a != b
            if a.dtype != torch.bool:
                self.max_abs[name] = float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0
        if bool(bad.any()):
            idx = int(bad.reshape(-1).nonzero()[0])
            ea, gb = a.reshape(-1)[idx].item(), b.reshape(-1)[idx].item()
            self.add(path, "value", ea, gb, index=idx, elements_differing=int(bad.sum()),
                     max_abs_diff=self.max_abs.get(name))


def _state_parts(state) -> tuple[list[str], list[str]]:
    """``(compared, not compared)`` top-level keys: the conventional ones, or all when there are none."""
    if not isinstance(state, dict):
        return [], []
    keys = [k for k in state if isinstance(k, str)]
    compared = [k for k in keys if k in CONVENTIONAL_KEYS]
    if not compared:  # no conventional keys: compare everything
        return keys, []
    return compared, [k for k in keys if k not in CONVENTIONAL_KEYS]


def compare_trajectories(expected: list[dict], got: list[dict], *, atol: float, rtol: float,
                         prefix: list[dict] | None = None) -> dict:
    """Compare per-update records (``sample_ids``, ``lr`` per group, ``loss``) step by step.

    Args:
        expected: the continuous run's updates for the compared steps.
        got: the candidate run's updates (compared by position; step numbers are checked too).
        prefix: the updates before the interruption (the interrupted run's), used to count
            duplicated/never-seen samples per epoch over the whole resumed line.

    Returns:
        ``{"steps_compared", "first_divergence", "lr_divergence", "loss_divergence", "data_order",
        "non_finite", "structure"}``; each divergence is ``None`` when that field matched.
    """
    res: dict[str, Any] = {"steps_compared": [u["step"] for u in expected], "first_divergence": None,
                           "lr_divergence": None, "loss_divergence": None, "data_order": None,
                           "non_finite": [], "structure": []}
    exp_steps = [u["step"] for u in expected]
    got_steps = [u["step"] for u in got]
    if got_steps != exp_steps[:len(got_steps)] or len(got) != len(expected):
        res["structure"].append(f"updates recorded: expected steps {span(exp_steps)}, got {span(got_steps)} "
                                "(is the progress counter restored and {steps} honoured?)")
    first: dict | None = None
    data_first: dict | None = None
    for i, (e, g) in enumerate(zip(expected, got)):
        step = e["step"]
        fields: list[dict] = []
        if e["sample_ids"] != g["sample_ids"]:
            d = {"step": step, "field": "sample_ids", "expected": e["sample_ids"], "got": g["sample_ids"]}
            fields.append(d)
            if data_first is None:
                data_first = {"first_divergent_step": step, "batch": i + 1, "expected_ids": e["sample_ids"],
                              "got_ids": g["sample_ids"]}
        if len(e["lr"]) != len(g["lr"]):
            res["structure"].append(f"step {step}: {len(e['lr'])} param groups expected, {len(g['lr'])} got")
            fields.append({"step": step, "field": "lr", "expected": e["lr"], "got": g["lr"]})
        else:
            for gi, (le, lg) in enumerate(zip(e["lr"], g["lr"])):
                if not (math.isfinite(le) and math.isfinite(lg)):
                    res["non_finite"].append(f"lr[{gi}] at step {step}")
                if not within_tolerance(le, lg, atol, rtol):
                    d = {"step": step, "field": f"lr[{gi}]", "expected": le, "got": lg}
                    fields.append(d)
                    if res["lr_divergence"] is None:
                        res["lr_divergence"] = dict(d, group=gi)
        le, lg = e["loss"], g["loss"]
        if not (math.isfinite(le) and math.isfinite(lg)):
            res["non_finite"].append(f"loss at step {step}")
        if not within_tolerance(le, lg, atol, rtol):
            d = {"step": step, "field": "loss", "expected": le, "got": lg}
            fields.append(d)
            if res["loss_divergence"] is None:
                res["loss_divergence"] = dict(d, abs_diff=abs(le - lg) if math.isfinite(le - lg) else None)
        if fields and first is None:
            first = fields[0]
    if first is None and len(got) != len(expected):
        n = min(len(got), len(expected))
        step = expected[n]["step"] if n < len(expected) else got_steps[n]
        first = {"step": step, "field": "updates", "expected": len(expected), "got": len(got)}
    res["first_divergence"] = first
    if data_first is not None or len(got) != len(expected):
        counts = _data_counts(expected, got, prefix or [])
        res["data_order"] = dict(data_first or {"first_divergent_step": first["step"] if first else None,
                                                "batch": None, "expected_ids": None, "got_ids": None}, **counts)
    for key in ("first_divergence", "lr_divergence", "loss_divergence"):
        if res[key] is not None:
            res[key] = {k: _jsonable(v) for k, v in res[key].items()}
    return res


def span(steps: list[int]) -> str:
    """``1..10`` for consecutive steps, else the steps comma-separated (``none`` for none)."""
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return f"{steps[0]}..{steps[-1]}"
    return ",".join(map(str, steps))


def _sorted_ids(ids: Iterable) -> list:
    """Sample ids in numeric order (ints), else by their text."""
    ids = list(ids)
    try:
        return sorted(ids)
    except TypeError:
        return sorted(ids, key=str)


def _data_counts(expected: list[dict], got: list[dict], prefix: list[dict]) -> dict:
    """Duplicated and never-seen samples of the resumed line (prefix + got) against the continuous one.

    Per epoch when every update records ``epoch``: a sample counts as *duplicated* for each extra
    time it is consumed within one epoch, and as *never seen* when the continuous run consumed it in
    that epoch but the resumed line did not. Without epochs the whole compared window is one group.
    """
    cont = prefix + expected
    line = prefix + got
    by_epoch = all("epoch" in u for u in cont + line)

    def groups(updates):
        g: dict[Any, Counter] = {}
        for u in updates:
            g.setdefault(u["epoch"] if by_epoch else "window", Counter()).update(u["sample_ids"])
        return g

    if by_epoch:
        ge, gg = groups(cont), groups(line)
    else:
        ge, gg = groups(expected), groups(got)
    per_epoch = []
    dup_total = miss_total = 0
    dup_ids: list = []
    miss_ids: list = []
    for key in sorted(set(ge) | set(gg), key=str):
        e, g = ge.get(key, Counter()), gg.get(key, Counter())
        dups = _sorted_ids(i for i, c in g.items() if c > max(1, e.get(i, 0)))
        dup = sum(g[i] - max(1, e.get(i, 0)) for i in dups)
        missing = _sorted_ids(i for i in e if g.get(i, 0) == 0)
        dup_total += dup
        miss_total += len(missing)
        dup_ids += dups
        miss_ids += missing
        if dup or missing:
            per_epoch.append({"epoch": key if by_epoch else None, "duplicated": dup, "never_seen": len(missing),
                              "duplicated_ids": dups[:MAX_LISTED], "never_seen_ids": missing[:MAX_LISTED]})
    # the sample ids themselves (at most MAX_LISTED of each): "which samples were replayed or skipped"
    return {"duplicated": dup_total, "never_seen": miss_total, "per_epoch": per_epoch,
            "duplicated_ids": dup_ids[:MAX_LISTED], "never_seen_ids": miss_ids[:MAX_LISTED],
            "counted_by": "epoch" if by_epoch else "window"}


def compare_runs(expected_traj: dict, got_traj: dict, expected_state, got_state, *, interrupt_at: int,
                 atol: float, rtol: float, prefix: list[dict] | None = None, name: str = "resumed",
                 training_only: bool = False, ignore_streams: Iterable[str] = ()) -> dict:
    """Compare a resumed (or control) run with the continuous run: per update, final state, next draws.

    Args:
        expected_traj / got_traj: loaded trajectories (:func:`ckpt_archive.resume.trajectory.load_trajectory`).
        expected_state / got_state: the final ``checkpoint.pt`` of each run (nested state).
        interrupt_at: updates before the resume; steps ``interrupt_at+1..`` are compared.
        atol / rtol: float tolerance (:func:`within_tolerance`).
        prefix: the interrupted run's updates (for the duplicated/never-seen sample counts).
        name: the comparison's name in the report.
        training_only: for negative controls: ignore the ``rng``, ``data`` and ``progress`` parts and
            the next draws (a perturbed stream that is restored but never used shows up only there,
            and that is "changed nothing" for training).
        ignore_streams: random streams (``python``, ``numpy``, ``torch``) declared unused: their
            final state and next draws are not compared (an unused stream is often unseeded).

    Returns:
        the comparison object of ``verification.json`` (``matched``, ``first_divergence``, ...).
    """
    exp_updates = [u for u in expected_traj["updates"] if u["step"] > interrupt_at]
    res = compare_trajectories(exp_updates, got_traj["updates"], atol=atol, rtol=rtol, prefix=prefix)
    res["name"] = name
    streams = rng_streams(expected_state)
    ignore = set(ignore_streams)
    skip_paths = [p for st, paths in streams.items() if st in ignore for p in paths]
    td, final = _compare_final_states(expected_state, got_state, training_only=training_only, skip_paths=skip_paths,
                                      atol=atol, rtol=rtol)
    res["non_finite"] += [f"final {_show(p)}" for p in td.non_finite if p.top in ("model", "optimizer")]
    res["final_state"] = final
    res["max_param_abs_diff"] = _max_param_abs_diff(td)
    draws_compared, draws_diff = ([], []) if training_only else _compare_next_draws(
        expected_traj, got_traj, [st for st in streams if st not in ignore], atol, rtol)
    res["next_draws"] = {"matched": not draws_diff, "compared": draws_compared, "differences": draws_diff}
    if res["first_divergence"] is None:
        _hint_streams_without_effect(res, td, streams, draws_diff)
    elif not training_only:
        _name_suspect_streams(res, expected_state, got_state, streams, ignore, atol, rtol)
    last_step = exp_updates[-1]["step"] if exp_updates else interrupt_at
    _first_divergence_at_the_end(res, td, draws_diff, last_step)
    res["diverged"] = res["first_divergence"] is not None or bool(res["structure"])
    res["matched"] = not res["diverged"] and not res["non_finite"]
    return res


def _compare_final_states(expected_state, got_state, *, training_only: bool, skip_paths: list[StatePath],
                          atol: float, rtol: float) -> tuple[TreeDiff, dict]:
    """The final states leaf by leaf: the :class:`TreeDiff` and the report's ``final_state`` section."""
    compared, not_compared = _state_parts(expected_state)
    _, got_extra = _state_parts(got_state)
    if training_only:
        compared = [k for k in compared if k not in ("rng", "data", "progress")] if any(
            k in CONVENTIONAL_KEYS for k in compared) else compared
    td = TreeDiff(atol, rtol, skip=skip_paths)
    if isinstance(expected_state, dict) and isinstance(got_state, dict):
        for k in compared:
            if k not in got_state:
                td.add((k,), "missing", "present", "absent")
            else:
                td.compare(expected_state[k], got_state[k], StatePath((k,)))
    else:
        td.compare(expected_state, got_state)
    final = {"matched": td.total == 0, "compared": compared,
             "not_compared": sorted(set(not_compared) | set(got_extra))
             + [f"{_show(p)} (declared without effect)" for p in skip_paths],
             "first_divergent_field": td.diffs[0]["field"] if td.diffs else None,
             "differences": td.diffs, "differences_total": td.total}
    return td, final


def _max_param_abs_diff(td: TreeDiff) -> float | None:
    """The largest absolute difference of a model tensor; None without one, or when the model's structure differs."""
    model_diffs = [v for p, v in td.max_abs.items() if p.top == "model"]
    if not model_diffs:
        return None
    if td.total and any(p.top == "model" and d["kind"] != "value" for p, d in zip(td.paths, td.diffs)):
        return None  # structure differs: no meaningful number
    return max(model_diffs)


def _compare_next_draws(expected_traj: dict, got_traj: dict, streams: list[str], atol: float,
                        rtol: float) -> tuple[list[str], list[dict]]:
    """The next draws of each stream the checkpoint carries: ``(streams compared, differences)``."""
    ed = (expected_traj.get("final") or {}).get("next_draws") or {}
    gd = (got_traj.get("final") or {}).get("next_draws") or {}
    # Only streams the checkpoint carries: a stream it does not save cannot be expected to continue.
    compared = [st for st in sorted(set(ed) | set(gd)) if st in streams]
    diffs = []
    for stream in compared:
        if stream not in ed or stream not in gd:
            diffs.append({"stream": stream, "expected": _jsonable(ed.get(stream)),
                          "got": _jsonable(gd.get(stream)), "kind": "missing"})
        elif len(ed[stream]) != len(gd[stream]) or not all(
                within_tolerance(x, y, atol, rtol) for x, y in zip(ed[stream], gd[stream])):
            diffs.append({"stream": stream, "expected": _jsonable(ed[stream]), "got": _jsonable(gd[stream]),
                          "kind": "value"})
    return compared, diffs


def _hint_streams_without_effect(res: dict, td: TreeDiff, streams: dict, draws_diff: list[dict]) -> None:
    """Every update matched but an RNG state (or its next draws) differs at the end: say how to declare it."""
    in_stream = [{st for st, ps in streams.items() for p in ps if dp.startswith(p)} for dp in td.paths]
    rng_only = bool(td.paths) and all(in_stream)
    if rng_only or draws_diff:
        bad = sorted(set().union(*in_stream) | {d["stream"] for d in draws_diff})
        res["hint"] = (f"every update matched but the {', '.join(bad)} RNG state differs at the end: if the "
                       f"script never draws from it (and does not seed it), declare it with "
                       + " ".join(f"--expect-no-effect {b}" for b in bad))


def _name_suspect_streams(res: dict, expected_state, got_state, streams: dict, ignore: set, atol: float,
                          rtol: float) -> None:
    """The updates diverged. A stream the resume forgot to restore usually ends in another state while the
    streams it did restore end alike: name it (the per-update fields cannot)."""
    ended: dict[str, bool] = {}
    for st, ps in streams.items():
        if st in ignore:
            continue
        sd = TreeDiff(atol, rtol)
        for p in ps:
            try:
                sd.compare(p.get(expected_state), p.get(got_state), p)
            except (KeyError, IndexError, TypeError):
                sd.add(p, "missing", "present", "absent")
        ended[st] = sd.total == 0
    differ = sorted(st for st, same in ended.items() if not same)
    if differ and len(differ) < len(ended):
        res["suspect_streams"] = differ
        res["hint"] = (f"of the random streams the checkpoint carries, only {', '.join(differ)} ends in "
                       f"another state than in the continuous run ({', '.join(sorted(set(ended) - set(differ)))} "
                       f"end alike): check that the resume restores the {', '.join(differ)} RNG state")


def _first_divergence_at_the_end(res: dict, td: TreeDiff, draws_diff: list[dict], last_step: int) -> None:
    """Every update matched: the first divergence is then the final state's, else the next draws'."""
    if res["first_divergence"] is None and td.diffs:
        d = td.diffs[0]
        res["first_divergence"] = {"step": last_step, "field": f"final.{d['field']}", "expected": d["expected"],
                                   "got": d["got"]}
    if res["first_divergence"] is None and draws_diff:
        d = draws_diff[0]
        res["first_divergence"] = {"step": last_step, "field": f"next_draws.{d['stream']}",
                                   "expected": d["expected"], "got": d["got"]}


def describe(cmp: dict) -> str:
    """One human line for a comparison: the first divergent update and field, LR and data order apart."""
    parts = []
    fd = cmp.get("first_divergence")
    if fd:
        parts.append(f"first divergence at update {fd['step']}, field {fd['field']}: expected "
                     f"{short_value(fd.get('expected'))}, got {short_value(fd.get('got'))}")
    if cmp.get("lr_divergence"):
        d = cmp["lr_divergence"]
        parts.append(f"LR diverges at update {d['step']} (group {d['group']}: expected {short_value(d['expected'])}, "
                     f"got {short_value(d['got'])})")
    if cmp.get("loss_divergence"):
        d = cmp["loss_divergence"]
        parts.append(f"loss diverges at update {d['step']}")
    if cmp.get("data_order"):
        d = cmp["data_order"]
        ids = ""
        if d.get("duplicated_ids"):
            ids += f"; duplicated ids {', '.join(map(str, d['duplicated_ids']))}"
        if d.get("never_seen_ids"):
            ids += f"; never-seen ids {', '.join(map(str, d['never_seen_ids']))}"
        parts.append(f"data order diverges at update {d['first_divergent_step']} (batch {d['batch']} of the resumed "
                     f"run): {d['duplicated']} duplicated, {d['never_seen']} never-seen samples{ids}")
    if cmp.get("structure"):
        parts.extend(cmp["structure"])
    if cmp.get("non_finite"):
        parts.append("non-finite values: " + ", ".join(cmp["non_finite"][:5]))
    if cmp.get("hint"):
        parts.append(cmp["hint"])
    return "; ".join(parts) or "no difference"


#: At most this many entries of each kind (differing, only in one run) are named by :func:`data_ids_differences`.
MAX_DATA_IDS_LISTED = 10


def data_ids_differences(a: Any, b: Any, first: str, second: str) -> list[str] | None:
    """The entries of two runs' recorded data ids that differ, one line each, key order aside.

    Args:
        a, b: the ``data_ids`` of two trajectories (:class:`~ckpt_archive.resume.trajectory.Trajectory`);
            ``None`` when a run recorded none.
        first, second: the runs' names for the lines (``"continuous"``, ``"interrupted"``).

    Returns:
        None when either run recorded no data ids; else ``[]`` when equal, or lines such as
        ``cat: 0 in the continuous run, 1 in the interrupted run`` / ``bird: only in the interrupted run (2)``
        (at most :data:`MAX_DATA_IDS_LISTED` of each kind, then a count).
    """
    if a is None or b is None:
        return None
    from ckpt_archive.ops.data_identity import compare_data_ids

    diff = compare_data_ids(a, b)
    lines: list[str] = []

    def listed(rows: list, fmt) -> None:
        lines.extend(fmt(*r) for r in rows[:MAX_DATA_IDS_LISTED])
        if len(rows) > MAX_DATA_IDS_LISTED:
            lines.append(f"... and {len(rows) - MAX_DATA_IDS_LISTED} more")

    listed(diff.changed, lambda k, x, y: f"{k}: {short_value(x)} in the {first} run, {short_value(y)} in the {second} run")
    listed(diff.removed, lambda k, x: f"{k}: only in the {first} run ({short_value(x)})")
    listed(diff.added, lambda k, y: f"{k}: only in the {second} run ({short_value(y)})")
    if diff.other:
        lines.append(f"{first} run: {short_value(a)}; {second} run: {short_value(b)}")
    return lines


def ids_named(expected: list, got: list) -> str:
    """Two batches' sample ids, and which are in only one of them (for a message)."""
    only_e = sorted(set(expected) - set(got))[:MAX_DATA_IDS_LISTED]
    only_g = sorted(set(got) - set(expected))[:MAX_DATA_IDS_LISTED]
    text = f"ids {short_value(expected)} in the continuous run, {short_value(got)} in the interrupted run"
    if only_e or only_g:
        text += (f" (only in the continuous run: {', '.join(map(str, only_e)) or 'none'}; only in the interrupted "
                 f"run: {', '.join(map(str, only_g)) or 'none'})")
    else:
        text += " (the same ids, in another order)"
    return text


def short_value(v) -> str:
    """A value in at most 60 characters for a message (floats with 7 significant digits)."""
    if isinstance(v, float):
        return f"{v:.7g}"
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def compact(cmp: dict) -> dict:
    """The fields of a comparison a negative control's report entry keeps."""
    keep = ("first_divergence", "lr_divergence", "loss_divergence", "data_order", "max_param_abs_diff",
            "structure", "non_finite")
    out = {k: cmp.get(k) for k in keep}
    out["final_state_first_divergent_field"] = cmp["final_state"]["first_divergent_field"]
    return out
