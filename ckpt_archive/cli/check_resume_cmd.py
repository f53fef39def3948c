"""``ckpt-archive check-resume``: prove that a training script resumes exactly, with the archive in the loop."""
from __future__ import annotations

import typer

from ckpt_archive.cli.common import JSON_OPTION, Output, command, exit_codes_help, exit_with, seconds_callback

HELP = (
    "Run a training command continuous, interrupted, archived + restored + resumed, and under negative "
    "controls, in fresh processes; compare per update (sample ids, LR, loss) and the final state; write "
    "verification.json and a picture of loss and LR per update (with the plot extra). The command template "
    "after '--' uses {steps} (updates this run adds) or {total_steps} (the update this run ends at, for a "
    "script whose --steps is the total), {output} (folder for checkpoint.pt and trajectory.json) and "
    "'{resume:--resume-from {}}' (two arguments, --resume-from PATH, when the run resumes; gone when it "
    "does not; an argument holding {resume} is filled or dropped the same way), e.g. "
    "-- python train.py --steps {steps} --output {output} '{resume:--resume-from {}}'. "
    "See docs/check-resume.md."
)
EXIT_CODES = exit_codes_help({0: "the resume is exact and every negative control diverged",
                              1: "a divergence: the resume differs from the continuous run, or a control had no "
                                 "effect (the report names the update and field)",
                              2: "could not check (a run failed, timed out or ran another number of updates than "
                                 "asked, the template is incomplete, the output folder is not empty)"})


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.7g}"
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], float):
        return f"{v[0]:.7g}"
    return str(v)


class _Rows:
    """Rows of the proof table (``add_row`` as a rich Table has it)."""

    def __init__(self):
        self.rows: list[list] = []

    def add_row(self, check: str, result: str, mark="") -> None:
        from rich.text import Text

        self.rows.append([check, result, mark if isinstance(mark, Text) else Text(mark)])


def proof_table(report: dict, title: str = "resume check", width: int = 200):
    """A short table of what the report shows (the command's result, on stdout), fitted to ``width`` columns:
    the checks and results wrap in their columns, nothing is cut (:func:`ckpt_archive.cli.tables.fit`)."""
    from rich.text import Text

    from ckpt_archive.cli.tables import Col, fit

    ok, bad = Text("yes", style="green"), Text("NO", style="red")
    pos = report["positive_comparison"]
    t = _Rows()
    a = report["archive"]
    t.add_row("interruption checkpoint archived",
              f"{a['repository']} generation {a['generation']}: packed, deep-verified, restored"
              + (", bit-exact" if a.get("round_trip_exact") else ""), ok if a.get("verified") else bad)
    det = report["determinism"]
    t.add_row(f"runs deterministic (updates 1..{report['interrupt_at']})",
              "continuous = interrupted" if det["matched"] else
              f"differ at update {det['first_divergence']['step']} ({det['first_divergence']['field']})",
              ok if det["matched"] else bad)
    for it in report.get("interruptions") or [dict(report["interruption"], at=report["interrupt_at"])]:
        if it.get("cursor") is None:
            continue
        where = f"{it['cursor']} of {it['samples_per_epoch']}" if it.get("samples_per_epoch") else str(it["cursor"])
        if it.get("mid_epoch"):
            where += " (mid-epoch)"
        exp = it.get("expected_cursor")
        mark = "" if exp is None else (ok if exp == it["cursor"] else bad)
        if exp is not None and exp != it["cursor"]:
            where += f"; the continuous run was {exp} samples into the epoch"
        t.add_row(f"data cursor at interruption (update {it['at']})", where, mark)
    data = report.get("data") or {}
    if data.get("continuous"):
        c, r = data["continuous"], data.get("resumed_line") or {}
        line = f"continuous {c['samples_consumed']}, interrupted+resumed {r.get('samples_consumed')}"
        if c.get("new_epoch_at_step"):
            line += f"; new permutation at update {c['new_epoch_at_step']}"
        t.add_row(f"samples consumed in {report['steps']} updates", line, "")
    steps = pos["steps_compared"]
    span = f"{steps[0]}..{steps[-1]}" if steps else "none"
    for label, key, field in (("sample ids per update", "data_order", None), ("LR per update", "lr_divergence", None),
                              ("loss per update", "loss_divergence", None)):
        d = pos.get(key)
        if d is None:
            t.add_row(f"{label} ({span})", "identical", ok)
        elif key == "data_order":
            ids = "".join(f"; {what} ids {', '.join(map(str, d[k]))}" for what, k in
                          (("duplicated", "duplicated_ids"), ("never-seen", "never_seen_ids")) if d.get(k))
            t.add_row(f"{label} ({span})", f"first divergent batch: update {d['first_divergent_step']}; "
                                           f"{d['duplicated']} duplicated, {d['never_seen']} never seen{ids}", bad)
        else:
            t.add_row(f"{label} ({span})", f"update {d['step']}: expected {_fmt(d['expected'])}, got {_fmt(d['got'])}", bad)
    fs = pos["final_state"]
    t.add_row("final state (" + ", ".join(fs["compared"]) + ")",
              "identical" if fs["matched"] else f"{fs['differences_total']} differences, first {fs['first_divergent_field']}",
              ok if fs["matched"] else bad)
    if pos.get("max_param_abs_diff") is not None:
        t.add_row("max parameter abs diff", _fmt(pos["max_param_abs_diff"]),
                  ok if fs["matched"] else bad)
    t.add_row("next draws of every RNG stream", "identical" if pos["next_draws"]["matched"] else
              "differ: " + ", ".join(d["stream"] for d in pos["next_draws"]["differences"]),
              ok if pos["next_draws"]["matched"] else bad)
    nl = report["next_lr_after_final_step"]
    if nl["continuous"] is not None or nl["resumed"] is not None:
        t.add_row(f"LR after update {report['steps']}", f"continuous {_fmt(nl['continuous'])}, resumed {_fmt(nl['resumed'])}",
                  ok if nl["continuous"] == nl["resumed"] else bad)
    if pos.get("non_finite"):
        t.add_row("non-finite values", ", ".join(pos["non_finite"][:4]), bad)
    for e in report["negative_controls"]:
        mark = {"diverged": ok, "no-effect-expected": Text("declared", style="yellow"),
                "skipped": Text("n/a", style="yellow"), "no-effect": bad, "not-run": Text("-"),
                "could-not-check": Text("could not check", style="red")}[e["status"]]
        text = e["message"]
        if e["status"] == "diverged" and e.get("first_divergent_step") is not None:
            text = f"diverged at update {e['first_divergent_step']} ({e['field']})"
        t.add_row(f"negative control: {e['name']}", text, mark)
    cols = (Col("check", "check", kind="prose", min_width=20), Col("result", "result", kind="prose", min_width=24),
            Col("ok", "ok"))
    return fit(cols, t.rows, width, title=title)


def report_human(out: Output, report: dict, title: str) -> None:
    """The proof for a person: the table, warnings (stderr), problems and the verdict (stdout; a failing
    verdict even with ``--quiet``), where the report and its picture are."""
    out.table(proof_table(report, title, out.width))
    for w in report["warnings"]:
        out.warn(w)
    passed = report["all_checks_passed"]
    for p in report["problems"]:
        out.say(f"problem: {p}", style="red", even_quiet=True)
    verdict = "PASSED" if passed else "FAILED"
    out.say(f"{title} {verdict}; details in {report['output']}/verification.json",
            style="green" if passed else "red", even_quiet=not passed)
    picture = report.get("picture")
    if picture:
        out.say(f"picture (loss and LR per update, every run): {report['output']}/{picture}")
    if report.get("picture_note"):
        out.note(report["picture_note"])


def register(app: typer.Typer) -> None:
    @app.command("check-resume", help=HELP + EXIT_CODES,
                 context_settings={"allow_interspersed_args": False})
    @command
    def check_resume_cmd(
        cmd: list[str] = typer.Argument(None, metavar="-- CMD...", help="the training command template"),
        steps: int = typer.Option(..., "--steps", help="updates of the continuous run"),
        interrupt_at: list[str] = typer.Option(..., "--interrupt-at", metavar="N[,N...]",
                                               help="updates before the interruption; several interruptions as "
                                                    "30,40 (or the option repeated: they accumulate)"),
        atol: float = typer.Option(1e-12, "--atol", help="absolute tolerance for floats"),
        rtol: float = typer.Option(0.0, "--rtol", help="relative tolerance for floats"),
        output: str = typer.Option(None, "--output", "-o",
                                   help="new or empty folder (default ./ckpt-archive-check-resume-<UTC time>)"),
        control: list[str] = typer.Option(None, "--control", metavar="NAME[,NAME...]",
                                          help="run only these tool-made controls (python, numpy, torch, "
                                               "optimizer, scheduler, data); default all"),
        no_controls: bool = typer.Option(False, "--no-controls", help="run no tool-made control"),
        expect_no_effect: list[str] = typer.Option(None, "--expect-no-effect", metavar="NAME[,NAME...]",
                                                   help="a control that may change nothing (an unused stream: "
                                                        "numpy, python, torch, ...); repeatable or comma-separated"),
        script_control: list[str] = typer.Option(None, "--script-control", metavar="ARGS",
                                                 help="extra arguments for a script-side negative control, e.g. "
                                                      "--script-control=--omit-rng-restore; repeatable"),
        jobs: int = typer.Option(1, "--jobs", "-j", help="runs at once (each a separate process)"),
        timeout: float = typer.Option(None, "--timeout", help="seconds per run",
                                      callback=seconds_callback("--timeout", allow_zero=False)),
        data_ids: str = typer.Option(None, "--data-ids", help="the run's data ids (JSON/YAML/TOML, or .txt one id per "
                                                            "line), packed with every interruption checkpoint"),
        resume_data_ids: str = typer.Option(None, "--resume-data-ids",
                                            help="the resuming session's data ids (default: --data-ids), compared "
                                                 "with the archived ones at every restore; a difference is exit 1"),
        allow_data_change: bool = typer.Option(False, "--allow-data-change",
                                               help="resume although the data ids differ (a warning)"),
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.resume.check import check_resume

        out = Output(json_output)
        controls = [] if no_controls else (_split(control) or None)
        report = check_resume(cmd or [], steps=steps, interrupt_at=_points(interrupt_at), output=output, atol=atol,
                              rtol=rtol, controls=controls, expect_no_effect=_split(expect_no_effect),
                              script_controls=list(script_control or []), jobs=jobs, timeout=timeout,
                              on_event=out.note, data_ids=data_ids, resume_data_ids=resume_data_ids,
                              allow_data_change=allow_data_change)
        report_human(out, report, "resume check")
        out.json(report, ok=report["all_checks_passed"])
        exit_with(report)


def _points(values) -> list[int]:
    """``--interrupt-at 30,40`` and ``--interrupt-at 30 --interrupt-at 40`` alike: every point, accumulated."""
    from ckpt_archive.errors import UsageError

    try:
        return [int(v) for v in _split(values)]
    except ValueError:
        raise UsageError(f"--interrupt-at takes whole numbers (30 or 30,40), got {', '.join(values)}") from None


def _split(values) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]
