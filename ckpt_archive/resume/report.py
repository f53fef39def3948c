"""``verification.json``: what the report holds, its schema, and writing it.

The report (``schemas/verification.v1.schema.json``) is assembled by :func:`build_report` from the
runs and comparisons, validated against the schema before it is written (a report that breaks the
schema is a bug here, never a file), and written as strict JSON, atomically.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from ckpt_archive.resume.trajectory import encode_float

REPORT_FORMAT = "ckpt-archive-verification"
REPORT_VERSION = 1
REPORT_FILE = "verification.json"
SCHEMA_FILE = "verification.v1.schema.json"


def utc_now() -> str:
    """The current UTC time, ISO 8601 with microseconds and ``Z``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def tool_version() -> str:
    """The ckpt-archive version that writes the report."""
    from ckpt_archive import __version__

    return __version__


def schema_path() -> Path:
    """Where ``verification.v1.schema.json`` lives (inside the package)."""
    return Path(__file__).parent.parent / "schemas" / SCHEMA_FILE


def validate_report(report: dict) -> None:
    """Validate a report against ``schemas/verification.v1.schema.json``.

    Raises:
        jsonschema.ValidationError: the report breaks the schema (a bug in this module).
    """
    import jsonschema

    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)


def write_report(report: dict, path: Path) -> Path:
    """Validate ``report`` and write it as strict JSON, atomically (the file layer: a fresh ``O_EXCL``
    temporary name, fsync, rename; never through a link planted at a predictable name)."""
    from ckpt_archive.store.fs import write_file_atomic

    validate_report(report)
    text = json.dumps(report, indent=2, allow_nan=False)
    write_file_atomic(path, (text + "\n").encode("utf-8"))
    return path


def draw_picture(report: dict, trajectories: dict, controls: dict, folder: Path) -> str | None:
    """Write the picture of the runs next to ``verification.json`` (:mod:`ckpt_archive.resume.picture`).

    Args:
        report: the report (before it is written).
        trajectories: ``continuous`` and ``resumed`` (the whole interrupted + resumed line).
        controls: each control run's trajectory by control name.
        folder: the check's output folder.

    Returns:
        the picture's file name in ``folder``, or None: matplotlib is not installed (``report["picture_note"]``
        says so, :data:`~ckpt_archive.resume.picture.NO_MATPLOTLIB`; the CLI prints it once), or drawing
        failed (a warning in the report says why: the verdict never depends on the picture).
    """
    from ckpt_archive.resume.picture import NO_MATPLOTLIB, run_lines, write_picture

    try:
        path = write_picture(report, run_lines(report, trajectories, controls), folder)
    except Exception as exc:  # noqa: BLE001 - a picture that cannot be drawn never costs the check its verdict
        report["warnings"].append(f"the picture of the runs could not be drawn: {type(exc).__name__}: {exc}")
        return None
    if path is None:
        report["picture_note"] = NO_MATPLOTLIB
        return None
    return path.name


def record_last_check(repo: str, report: dict) -> None:
    """Remember this check in the repository its interruption checkpoints were archived to
    (:func:`ckpt_archive.ops.export_proof.write_last_check`), so that an export of that repository links its
    picture. A repository that cannot take it (read-only, remote and unreachable) costs the check nothing."""
    from ckpt_archive.ops.export_proof import write_last_check

    out = Path(report["output"])
    try:
        write_last_check(repo, {"kind": report["kind"], "created": report["created"],
                                "passed": bool(report["all_checks_passed"]),
                                "report": str((out / REPORT_FILE).absolute()),
                                "picture": str((out / report["picture"]).absolute()) if report.get("picture") else None,
                                "generation": (report.get("archive") or {}).get("generation")})
    except Exception:  # noqa: BLE001 - the check's result stands in verification.json either way
        pass


def interruption_facts(state, interrupt_at: int) -> dict:
    """Step, epoch, data cursor and samples per epoch of the interruption checkpoint (None where absent)."""
    facts: dict[str, Any] = {"step": None, "epoch": None, "cursor": None, "samples_per_epoch": None,
                             "mid_epoch": None}
    if not isinstance(state, dict):
        return facts
    prog = state.get("progress") if isinstance(state.get("progress"), dict) else {}
    data = state.get("data") if isinstance(state.get("data"), dict) else {}
    if type(prog.get("step")) is int:
        facts["step"] = prog["step"]
    for src in (data, prog):
        if type(src.get("epoch")) is int and facts["epoch"] is None:
            facts["epoch"] = src["epoch"]
    if type(data.get("cursor")) is int:
        facts["cursor"] = data["cursor"]
    for key in ("permutation", "order", "indices", "sample_order"):
        if key in data and hasattr(data[key], "__len__"):
            facts["samples_per_epoch"] = len(data[key])
            break
    if facts["cursor"] is not None and facts["samples_per_epoch"]:
        facts["mid_epoch"] = 0 < facts["cursor"] < facts["samples_per_epoch"]
    return facts


def _next_lr(traj: dict, state) -> list[float] | None:
    """The LR per group after a run's last update: from its trajectory, else from its optimizer state."""
    nl = (traj.get("final") or {}).get("next_lr")
    if nl:
        return [float(x) for x in nl]
    try:
        return [float(g["lr"]) for g in state["optimizer"]["param_groups"]]
    except (KeyError, TypeError, IndexError):
        return None


def _data_summary(traj: dict) -> dict:
    """Updates, samples consumed and distinct, epochs, and where a new epoch's permutation starts."""
    ups = traj["updates"]
    epochs = [u.get("epoch") for u in ups]
    new_perm = None
    if all(e is not None for e in epochs):
        for u, prev in zip(ups[1:], ups):
            if u["epoch"] != prev["epoch"]:
                new_perm = u["step"]
                break
    return {"updates": len(ups), "samples_consumed": sum(len(u["sample_ids"]) for u in ups),
            "distinct_samples": len({i for u in ups for i in u["sample_ids"]}),
            "epochs": sorted({e for e in epochs if e is not None}),
            "new_epoch_at_step": new_perm}

_RUN_ORDER = {"continuous": 0, "interrupted": 1, **{f"resumed-{k}": 1 + k / 1000 for k in range(1, 1000)},
              "resumed": 2}


def build_report(*, kind: str, command: list[str], steps: int, interrupt_at: int, atol: float, rtol: float,
                 verdict: dict, positive: dict, determinism: dict, entries: list[dict], facts: dict,
                 trajectories: dict, states: dict, archive: dict, records: list, seconds: float,
                 output: Path) -> dict[str, Any]:
    """The ``verification.json`` document (see ``schemas/verification.v1.schema.json``).

    Args:
        verdict: ``all_ok``, ``negative_detected``, ``problems``, ``warnings``.
        trajectories: ``continuous``, ``interrupted``, ``resumed`` (loaded trajectories).
        states: ``continuous``, ``resumed`` (final checkpoints).
        records: the :class:`~ckpt_archive.resume.runner.RunRecord` of every run.
    """
    cont_traj, int_traj, res_traj = trajectories["continuous"], trajectories["interrupted"], trajectories["resumed"]
    line = int_traj["updates"] + res_traj["updates"]
    return {
        "format": REPORT_FORMAT, "version": REPORT_VERSION, "tool_version": tool_version(), "kind": kind,
        "created": utc_now(), "command": command, "steps": steps, "interrupt_at": interrupt_at,
        "tolerance": {"atol": atol, "rtol": rtol},
        "all_checks_passed": bool(verdict["all_ok"]),
        # the protocol's three booleans; the details go beside them
        "positive": bool(positive["matched"]),
        "positive_comparison": positive,
        "determinism": determinism,
        "negative_divergence_detected": bool(verdict["negative_detected"]),
        "negative_controls": entries,
        "cursor_at_interruption": facts["cursor"],
        "samples_per_epoch": facts["samples_per_epoch"],
        "interruption": facts,
        "next_lr_after_final_step": {"continuous": _next_lr(cont_traj, states["continuous"]),
                                     "resumed": _next_lr(res_traj, states["resumed"])},
        "max_param_abs_diff": positive["max_param_abs_diff"],
        "data": {"continuous": _data_summary(cont_traj), "resumed_line": _data_summary({"updates": line})},
        "lr_per_step": {"continuous": [[u["step"], [encode_float(x) for x in u["lr"]]] for u in cont_traj["updates"]],
                        "resumed_line": [[u["step"], [encode_float(x) for x in u["lr"]]] for u in line]},
        "archive": archive,
        "runs": [r.to_json() for r in sorted(records, key=lambda r: _RUN_ORDER.get(r.name, 9))],
        "problems": verdict["problems"],
        "warnings": verdict["warnings"],
        "seconds": round(seconds, 3),
        "output": str(output),
    }
