"""`ckpt-archive demo` end to end: the known facts of the proof, its exit codes, and that a broken
resume is caught (exit 1). The demo runs once per module (10 training processes) and every test
reads its verification.json."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_archive.resume.report import validate_report

SCRIPTS = Path(__file__).parent / "resume_scripts"


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_archive", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "proof"
    r = cli("demo", "--output", str(out), "--json", "--jobs", "2")
    return r, out


@pytest.fixture(scope="module")
def report(demo):
    r, out = demo
    assert r.returncode == 0, r.stderr
    return json.loads((out / "verification.json").read_text())


def test_demo_exits_0_and_prints_exactly_one_json_object_on_stdout(demo, report):
    r, _ = demo
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc.pop("ok") is True and doc == report  # stdout holds the report (and ok) and nothing else
    assert report["all_checks_passed"] is True and report["kind"] == "demo"


def test_demo_verification_json_is_valid_against_the_schema(report):
    validate_report(report)
    assert {"all_checks_passed", "positive", "negative_divergence_detected", "negative_controls",
            "cursor_at_interruption", "next_lr_after_final_step", "max_param_abs_diff"} <= set(report)


def test_demo_interrupts_mid_epoch_at_cursor_20_of_24(report):
    assert report["cursor_at_interruption"] == 20 and report["samples_per_epoch"] == 24
    assert report["interruption"]["mid_epoch"] is True and report["interruption"]["step"] == 5


def test_demo_ten_updates_consume_40_rows_across_a_new_permutation(report):
    for run in ("continuous", "resumed_line"):
        d = report["data"][run]
        assert d["samples_consumed"] == 40 and d["epochs"] == [0, 1] and d["new_epoch_at_step"] == 7
        assert d["distinct_samples"] == 24


def test_demo_lr_after_update_10_is_0_00375_in_both_runs(report):
    assert report["next_lr_after_final_step"] == {"continuous": [0.00375], "resumed": [0.00375]}
    lrs = [lr[0] for _, lr in report["lr_per_step"]["continuous"]]
    assert lrs == [0.03] * 3 + [0.015] * 3 + [0.0075] * 3 + [0.00375]
    assert report["lr_per_step"]["resumed_line"] == report["lr_per_step"]["continuous"]


def test_demo_resume_matches_exactly_with_zero_parameter_deviation(report):
    assert report["positive"] is True and report["negative_divergence_detected"] is True  # the protocol's booleans
    pos = report["positive_comparison"]
    assert pos["matched"] and pos["first_divergence"] is None and report["max_param_abs_diff"] == 0.0
    assert pos["steps_compared"] == [6, 7, 8, 9, 10]
    assert pos["final_state"]["compared"] == ["model", "optimizer", "scheduler", "rng", "data", "progress"]
    assert pos["next_draws"]["compared"] == ["numpy", "python", "torch"] and pos["next_draws"]["matched"]
    assert report["determinism"]["matched"]


def test_demo_every_negative_control_diverges_including_omitted_rng_restore(report):
    controls = {e["name"]: e for e in report["negative_controls"]}
    assert set(controls) == {"python-rng", "numpy-rng", "torch-rng", "optimizer-moments", "scheduler-stale",
                             "data-cursor", "omit-rng-restore"}
    assert all(e["diverged"] and e["status"] == "diverged" for e in controls.values())
    assert report["negative_divergence_detected"] is True
    omit = controls["omit-rng-restore"]
    assert omit["kind"] == "script" and omit["first_divergent_step"] == 6 and omit["field"] == "loss"
    assert controls["scheduler-stale"]["field"] == "lr[0]"  # StepLR: the stale LR shows at update 7
    assert controls["scheduler-stale"]["first_divergent_step"] == 7
    assert controls["numpy-rng"]["field"] == "sample_ids"  # the next epoch's permutation
    assert all(f["ok"] for f in report["demo_facts"])


def test_demo_checkpoint_went_through_a_usable_verified_archive_generation(report):
    import ckpt_archive

    a = report["archive"]
    assert a["verified"] and a["round_trip_exact"] and a["generation"] == 1
    assert ckpt_archive.verify(a["repository"], a["generation"], options=ckpt_archive.VerifyOptions(deep=True)).ok
    state = ckpt_archive.load(a["repository"], a["generation"])
    assert set(state) >= {"model", "optimizer", "scheduler", "rng", "data", "progress", "config"}
    assert state["progress"]["step"] == 5 and state["data"]["cursor"] == 20


def test_demo_prints_a_proof_table_on_stdout(demo, report, capsys):
    r, _ = demo
    assert r.stderr == ""  # the demo ran with --json: nothing but the JSON object
    from ckpt_archive.cli.common import Output
    from ckpt_archive.cli.demo_cmd import render_demo

    render_demo(Output(False), report)  # what a run without --json prints, from the same report
    printed = capsys.readouterr()
    for text in ("20 of 24 (mid-epoch)", "0.00375", "negative control: omit-rng-restore", "PASSED"):
        assert text in printed.out                            # the result goes to stdout (issue 26)
    assert printed.err == ""


def test_the_proof_table_at_80_columns_does_not_split_the_archive_path_across_lines(report):
    """[issue 26] At 80 columns the row "interruption checkpoint archived" wrapped the archive's whole path mid-name
    (".../ckpt-archive-demo-20261202T063" / "808Z/archive generation 1"), which a person cannot copy. The archive
    lies in the proof's folder (named by the verdict line), so the row names it from there."""
    import io

    from rich.console import Console

    from ckpt_archive.cli.check_resume_cmd import proof_table

    buf = io.StringIO()
    Console(file=buf, width=80, color_system=None).print(proof_table(report, "ckpt-archive demo", 80))
    text = buf.getvalue()
    row = text.split("interruption checkpoint", 1)[1].split("runs deterministic", 1)[0]
    assert "archive/ (in the proof's folder)" in row and "generation" in row, row
    assert report["output"] not in text and all(len(line) <= 80 for line in text.splitlines()), text


def test_demo_draws_every_run_next_to_the_report_and_its_archive_remembers_it(demo, report):
    """[issue 26] A picture where people would rather look than read: written next to verification.json,
    naming the continuous, resumed and every control run with its first divergent update; the archive
    repository records the check, so an export of it links the picture."""
    pytest.importorskip("matplotlib")
    from ckpt_archive.ops.export_proof import read_last_check
    from ckpt_archive.repo.repository import Repository

    _, out = demo
    assert report["picture"] == "verification.svg"
    svg = (out / "verification.svg").read_text()
    assert "continuous (never interrupted)" in svg and "interrupted, archived, restored, resumed" in svg
    for e in report["negative_controls"]:
        assert f"control {e['name']}: first divergent update {e['first_divergent_step']}" in svg, e["name"]
    assert "interrupted after update 5" in svg and "resume: 0 at every update (identical)" in svg
    rec = read_last_check(Repository.open(report["archive"]["repository"]))
    assert rec["kind"] == "demo" and rec["passed"] is True and rec["picture"] == str(out / "verification.svg")


def test_demo_never_overwrites_an_earlier_proof(demo):
    _, out = demo
    before = (out / "verification.json").read_bytes()
    r = cli("demo", "--output", str(out))
    assert r.returncode == 2 and "never overwritten" in r.stderr and "Traceback" not in r.stderr
    assert (out / "verification.json").read_bytes() == before


def test_resume_that_forgets_the_scheduler_exits_1_with_lr_apart_from_loss(tmp_path, capsys):
    out = tmp_path / "broken"
    r = cli("check-resume", "--steps", "10", "--interrupt-at", "5", "--output", str(out), "--json", "--",
            sys.executable, str(SCRIPTS / "demo_forgets_scheduler.py"), "--steps", "{steps}", "--output", "{output}",
            "{resume:--resume-from {}}")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["positive"] is False
    pos = report["positive_comparison"]
    assert not report["all_checks_passed"] and not pos["matched"]
    # StepLR restarted its count: update 7 still uses 0.015 instead of 0.0075; the loss follows one update later
    assert pos["first_divergence"] == {"step": 7, "field": "lr[0]", "expected": 0.0075, "got": 0.015}
    assert pos["lr_divergence"]["step"] == 7 and pos["loss_divergence"]["step"] == 8
    assert pos["data_order"] is None
    assert r.stderr == ""  # --json: nothing but the JSON object
    from ckpt_archive.cli.check_resume_cmd import report_human
    from ckpt_archive.cli.common import Output

    report_human(Output(False), report, "check-resume")  # what a run without --json prints
    assert "LR diverges at update 7" in capsys.readouterr().out
    if report.get("picture"):                                 # the failure, named where a person looks
        svg = (out / report["picture"]).read_text()
        # an LR divergence is marked on the LR panel (the loss only follows one update later)
        assert "update 7 (lr[0])" in svg and "LR diverges here" in svg and "the resume DIVERGES at update 7" in svg
