"""A picture of a resume check, written next to ``verification.json``: per update, the loss and the LR of the
continuous run, of the interrupted-and-resumed run and of each negative control, the interruption points
marked and each run's first divergent update annotated.

Three panels share the update axis: the loss, the LR (param group 0), and each run's distance from the
continuous run, ``|loss - continuous loss|`` on a symmetric-log axis whose bottom is exactly 0. An exact
resume lies on that bottom line from end to end; a control that diverges leaves it at its first divergent
update, marked with a cross and its name: the divergence is visible at a glance, even where a loss curve
changes by 1e-6. A divergence of the LR itself is marked on the LR panel, on the run's LR line.

matplotlib is an optional extra (``pip install 'ckpt-archive[plot]'``); without it no picture is written
and the check says so once (:data:`NO_MATPLOTLIB`). The picture is SVG with its text kept as text (the run
names can be searched in the file), drawn through :class:`matplotlib.figure.Figure` (no pyplot state, no
display needed).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

#: The picture's file name, next to ``verification.json``.
PICTURE_FILE = "verification.svg"
#: What a check says (once) when the picture cannot be drawn.
NO_MATPLOTLIB = ("no picture of the runs: matplotlib is not installed "
                 "(pip install 'ckpt-archive[plot]' adds it); verification.json holds everything")

# the continuous run is the wide grey band every other line is read against; the resume is blue
_CONTINUOUS = "#9e9e9e"
_RESUMED = "#1f5fbf"
_RESUMED_DIVERGED = "#c62828"  # a resume that diverges is the failure the picture exists to show: red
_CONTROLS = ("#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def run_lines(report: dict, trajectories: dict[str, dict], controls: dict[str, dict]) -> list[dict]:
    """The lines to draw, from the report and the runs' trajectories.

    Args:
        report: the ``verification.json`` document.
        trajectories: ``continuous`` and ``resumed`` (the whole interrupted + resumed line) trajectories.
        controls: per control name (as in ``negative_controls``), the control run's trajectory (its updates
            after the last interruption); a control that did not run is absent.

    Returns:
        ``[{"name", "label", "kind", "steps", "loss", "lr", "first_divergent_step", "field"}]``: the
        continuous run, the resumed run, then the controls in the report's order.
    """
    def series(updates: Sequence[dict]) -> tuple[list[int], list[float], list[float]]:
        steps = [int(u["step"]) for u in updates]
        loss = [_num(u.get("loss")) for u in updates]
        lr = [_num((u.get("lr") or [None])[0]) for u in updates]
        return steps, loss, lr

    pos = report.get("positive_comparison") or {}
    first = _first_divergence(pos)
    lines = []
    for name, label, kind, traj, div in (
            ("continuous", "continuous (never interrupted)", "continuous", trajectories["continuous"], (None, None)),
            ("resumed", "interrupted, archived, restored, resumed", "resumed", trajectories["resumed"], first)):
        steps, loss, lr = series(traj["updates"])
        lines.append({"name": name, "label": label, "kind": kind, "steps": steps, "loss": loss, "lr": lr,
                      "first_divergent_step": div[0], "field": div[1]})
    for e in report.get("negative_controls") or []:
        traj = controls.get(e["name"])
        if traj is None:
            continue
        steps, loss, lr = series(traj["updates"])
        lines.append({"name": e["name"], "label": f"control {e['name']}", "kind": "control", "steps": steps,
                      "loss": loss, "lr": lr, "status": e.get("status"),
                      "first_divergent_step": e.get("first_divergent_step") if e.get("diverged") else None,
                      "field": e.get("field")})
    return lines


def _first_divergence(pos: dict) -> tuple[int | None, str | None]:
    """The resume's first divergent update and field (None when it matched)."""
    if pos.get("matched", True):
        return None, None
    fd = pos.get("first_divergence")
    if isinstance(fd, dict) and fd.get("step") is not None:
        return fd["step"], fd.get("field")
    found = []
    d = pos.get("data_order")
    if d and d.get("first_divergent_step") is not None:
        found.append((d["first_divergent_step"], "sample ids"))
    for key, field in (("lr_divergence", "lr"), ("loss_divergence", "loss")):
        d = pos.get(key)
        if d and d.get("step") is not None:
            found.append((d["step"], field))
    if not found:
        fs = pos.get("final_state") or {}
        return None, fs.get("first_divergent_field")
    return min(found)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def write_picture(report: dict, lines: list[dict], folder: Path, *, name: str = PICTURE_FILE) -> Path | None:
    """Draw the runs and write the picture into ``folder`` (SVG, or PNG when ``name`` ends in ``.png``).

    Args:
        report: the ``verification.json`` document (steps, interruption points, verdicts).
        lines: :func:`run_lines`.
        folder: where ``verification.json`` lies.
        name: the file name.

    Returns:
        the picture's path, or None when matplotlib is not installed (:data:`NO_MATPLOTLIB` says so).

    Raises:
        OSError: the file cannot be written.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        return None
    cont = next(x for x in lines if x["kind"] == "continuous")
    base = dict(zip(cont["steps"], cont["loss"]))
    points = report.get("interrupt_points") or [report["interrupt_at"]]
    with matplotlib.rc_context({"svg.fonttype": "none", "font.size": 9, "axes.titlesize": 10}):
        fig = Figure(figsize=(11.0, 9.0), layout="constrained")
        ax_loss, ax_lr, ax_dev = fig.subplots(3, 1, sharex=True, height_ratios=[3, 2, 3])
        controls = [x for x in lines if x["kind"] == "control"]
        colours = {x["name"]: _CONTROLS[i % len(_CONTROLS)] for i, x in enumerate(controls)}
        for x in lines:
            style = _style(x, colours)
            ax_loss.plot(x["steps"], x["loss"], label=_legend_label(x), **style)
            ax_lr.plot(x["steps"], x["lr"], **style)
            dev = [abs(v - base[s]) if s in base else math.nan for s, v in zip(x["steps"], x["loss"])]
            if x["kind"] != "continuous":
                ax_dev.plot(x["steps"], dev, **style)
        for p in points:
            for ax in (ax_loss, ax_lr, ax_dev):
                ax.axvline(p + 0.5, color="black", linestyle=":", linewidth=1.0)
            ax_loss.annotate(f"interrupted after update {p}\n(archived, verified, restored)", xy=(p + 0.5, 1.0),
                             xycoords=("data", "axes fraction"), xytext=(4, -4), textcoords="offset points",
                             va="top", ha="left", fontsize=8)
        _annotate_divergences({"distance": ax_dev, "lr": ax_lr}, lines, base, colours)
        steps = report.get("steps") or max(cont["steps"] or [1])
        ax_dev.set_xlim(0.5, steps + 0.5)
        ax_dev.set_xticks(range(1, steps + 1, max(1, steps // 20)))
        ax_dev.set_xlabel("update (optimizer step)")
        ax_loss.set_ylabel("loss")
        ax_lr.set_ylabel("LR (param group 0)")
        ax_dev.set_yscale("symlog", linthresh=_linthresh(lines, base))
        ax_dev.set_ylim(bottom=0)
        ax_dev.set_ylabel("|loss - continuous loss|\n(bottom line: identical)")
        for ax in (ax_loss, ax_lr, ax_dev):
            ax.grid(True, color="#e0e0e0", linewidth=0.6)
        ax_loss.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        fig.suptitle(_title(report, lines), fontsize=10, x=0.01, ha="left")
        path = Path(folder) / name
        fig.savefig(path, format="png" if name.endswith(".png") else "svg", dpi=110)
    return path


def _style(x: dict, colours: dict) -> dict:
    if x["kind"] == "continuous":
        return {"color": _CONTINUOUS, "linewidth": 7.0, "alpha": 0.45, "solid_capstyle": "round", "zorder": 1}
    if x["kind"] == "resumed":
        colour = _RESUMED if x.get("first_divergent_step") is None else _RESUMED_DIVERGED
        return {"color": colour, "linewidth": 1.8, "marker": "o", "markersize": 3.5, "zorder": 4}
    return {"color": colours[x["name"]], "linewidth": 1.2, "marker": ".", "markersize": 4, "zorder": 3,
            "linestyle": "--" if x.get("first_divergent_step") is None else "-"}


def _linthresh(lines: list[dict], base: dict) -> float:
    """The symlog axis' linear range: below the smallest non-zero distance from the continuous run, so every
    divergence, however small, shows above the bottom line."""
    smallest = min((abs(v - base[s]) for x in lines if x["kind"] != "continuous"
                    for s, v in zip(x["steps"], x["loss"]) if s in base and abs(v - base[s]) > 0), default=1e-12)
    return max(smallest / 10, 1e-300)


def is_lr_field(field: str | None) -> bool:
    """A divergent field that is the LR (``lr``, ``lr[<group>]``): drawn on the LR panel, where it shows."""
    return isinstance(field, str) and (field == "lr" or field.startswith("lr["))


def divergence_marks(lines: list[dict], base: dict) -> list[dict]:
    """Where each run's first divergence is marked: ``[{"name", "kind", "panel", "step", "value"}]``.

    ``panel`` is ``"lr"`` for an LR field (:func:`is_lr_field`; ``value``: the run's LR at that update, param
    group 0) and ``"distance"`` for anything else (``value``: ``|loss - continuous loss|`` there, 0 when not
    known). [break] An LR-only divergence was marked on the distance-of-loss panel, at 0, where nothing
    diverges."""
    marks = []
    for x in lines:
        s = x.get("first_divergent_step")
        if s is None or x["kind"] == "continuous":
            continue
        if is_lr_field(x.get("field")):
            panel = "lr"
            v = next((lr for t, lr in zip(x["steps"], x["lr"]) if t == s), math.nan)
        else:
            panel = "distance"
            v = next((abs(v - base[t]) for t, v in zip(x["steps"], x["loss"]) if t == s and t in base), 0.0)
            v = 0.0 if math.isnan(v) else v
        marks.append({"name": x["name"], "kind": x["kind"], "panel": panel, "step": s, "value": v,
                      "field": x.get("field")})
    return marks


def _annotate_divergences(axes: dict, lines: list[dict], base: dict, colours: dict) -> None:
    """A cross at each run's first divergent update, on the panel where that field shows (``axes``: panel ->
    Axes, :func:`divergence_marks`; the legend names the run, the update and the field); a resume that
    diverges is also named on the panel itself, in its colour: it is the failure the check exists to show."""
    for m in divergence_marks(lines, base):
        ax, s, v = axes[m["panel"]], m["step"], m["value"]
        colour = _RESUMED_DIVERGED if m["kind"] == "resumed" else colours[m["name"]]
        if math.isnan(v):
            continue  # no LR recorded at that update: the legend still names it
        ax.plot([s], [v], marker="X", markersize=10, color=colour, zorder=6, markeredgecolor="black",
                markeredgewidth=0.6, linestyle="none", clip_on=False)
        if m["kind"] == "resumed":
            what = "the resume's LR diverges here" if m["panel"] == "lr" else "the resume diverges here"
            ax.annotate(f"{what}: update {s} ({m['field']})", xy=(s, v), xytext=(16, -28),
                        textcoords="offset points", fontsize=9, fontweight="bold", color=colour, va="top",
                        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
                        arrowprops={"arrowstyle": "->", "color": colour, "linewidth": 1.0})
    ax = axes["distance"]
    resumed = next((x for x in lines if x["kind"] == "resumed"), None)
    if resumed is not None and resumed.get("first_divergent_step") is None:
        ax.annotate("resume: 0 at every update (identical)", xy=(0.01, 0.0), xycoords="axes fraction",
                    xytext=(4, 5), textcoords="offset points", fontsize=8, color=_RESUMED, va="bottom")


def _legend_label(x: dict) -> str:
    """A run's name in the legend, with its first divergent update when it has one."""
    if x["kind"] == "continuous" or x.get("first_divergent_step") is None:
        if x["kind"] == "control":
            return f"{x['label']}: no divergence"
        return x["label"]
    field = f" ({x['field']})" if x.get("field") else ""
    return f"{x['label']}: first divergent update {x['first_divergent_step']}{field}"


def _title(report: dict, lines: list[dict]) -> str:
    kind = "ckpt-archive demo" if report.get("kind") == "demo" else "ckpt-archive check-resume"
    points = ", ".join(map(str, report.get("interrupt_points") or [report["interrupt_at"]]))
    resumed = next(x for x in lines if x["kind"] == "resumed")
    if report.get("positive"):
        verdict = "the resume is identical to the continuous run at every update"
    else:
        at = resumed.get("first_divergent_step")
        verdict = (f"the resume DIVERGES at update {at} ({resumed.get('field')})" if at is not None
                   else "the resume DIVERGES (final state)")
    controls = [x for x in lines if x["kind"] == "control"]
    diverged = sum(1 for x in controls if x.get("first_divergent_step") is not None)
    tail = f"; {diverged} of {len(controls)} negative controls diverge (each must)" if controls else ""
    return f"{kind}: {report['steps']} updates, interrupted after update {points}\n{verdict}{tail}"


__all__ = ["PICTURE_FILE", "NO_MATPLOTLIB", "run_lines", "write_picture", "divergence_marks", "is_lr_field"]
