"""``ckpt-archive demo``: watch a real training run be interrupted, archived, restored and resumed exactly."""
from __future__ import annotations

import typer

from ckpt_archive.cli.common import JSON_OPTION, Output, command, exit_codes_help, exit_with

HELP = (
    "Prove a resume end to end on a tiny real training run (24 rows, MLP 2->8->1 with dropout, Adam + "
    "StepLR, Python/NumPy/torch RNG): 10 updates continuous; 5 updates, packed into an archive, verified, "
    "restored in a new process and resumed for 5 more; negative controls (RNG restore omitted, and each "
    "part of the state perturbed) must diverge. Writes verification.json and prints a proof table."
)
EXIT_CODES = exit_codes_help({0: "the resume matches exactly and every negative control diverged",
                              1: "a comparison failed: the resume diverged or a negative control changed nothing",
                              2: "the demo could not complete (a run failed; --output exists and is not empty: a "
                                 "proof is never overwritten)"})


def register(app: typer.Typer) -> None:
    @app.command("demo", help=HELP + EXIT_CODES)
    @command
    def demo_cmd(
        output: str = typer.Option(None, "--output", "-o",
                                   help="new or empty folder for the proof (default ./ckpt-archive-demo-<UTC time>)"),
        jobs: int = typer.Option(None, "--jobs", "-j", help="runs at once (default: up to 4, by CPU count)"),
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.demo.run import run_demo
        from ckpt_archive.errors import UsageError

        if jobs is not None and jobs < 1:
            raise UsageError(f"--jobs must be >= 1, got {jobs}")
        out = Output(json_output)
        report = run_demo(output, jobs=jobs, on_event=out.note)
        render_demo(out, report)
        out.json(report, ok=report["all_checks_passed"])
        exit_with(report)


def render_demo(out: Output, report: dict) -> None:
    """The demo's proof for a person: the check-resume table, then each demo fact (not in ``--json`` mode)."""
    from ckpt_archive.cli.check_resume_cmd import report_human

    report_human(out, report, "ckpt-archive demo")
    for f in report["demo_facts"]:
        out.say(("  ok   " if f["ok"] else "  FAIL ") + f"{f['fact']}: {f['observed']}",
                style=None if f["ok"] else "red", even_quiet=not f["ok"])
