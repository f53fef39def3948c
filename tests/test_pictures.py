"""Pictures where people would rather look than read (issue 26): check-resume and demo write, next to
verification.json, the loss and LR per update of the continuous run, the resumed run and every negative
control, interruptions marked and first divergent updates annotated; the export proof links the picture of
the last check of the repository it exports. Without matplotlib: no picture, said once, no crash."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from ckpt_archive.repo.repository import Repository
from ckpt_archive.resume.picture import NO_MATPLOTLIB, run_lines, write_picture
from ckpt_archive.resume.report import draw_picture, record_last_check


def _traj(steps, loss, lr):
    return {"updates": [{"step": s, "loss": l, "lr": [r], "sample_ids": [s]} for s, l, r in zip(steps, loss, lr)]}


def _check(resume_diverges: bool = False):
    """A 10-update check interrupted after update 5: two controls diverge (at 6 and 7), the resume matches
    unless ``resume_diverges`` (then at update 8, by 1e-9: invisible on a loss axis)."""
    steps = list(range(1, 11))
    loss = [1.0 / s for s in steps]
    lr = [0.03] * 3 + [0.015] * 3 + [0.0075] * 4
    resumed = list(loss)
    if resume_diverges:
        resumed[7] += 1e-9
    report = {"kind": "check-resume", "steps": 10, "interrupt_at": 5, "interrupt_points": [5],
              "positive": not resume_diverges,
              "positive_comparison": {"matched": not resume_diverges,
                                      "first_divergence": {"step": 8, "field": "loss"} if resume_diverges else None},
              "negative_controls": [
                  {"name": "numpy-rng", "diverged": True, "status": "diverged", "first_divergent_step": 6,
                   "field": "sample_ids", "message": "diverged"},
                  {"name": "scheduler-stale", "diverged": True, "status": "diverged", "first_divergent_step": 7,
                   "field": "lr[0]", "message": "diverged"}],
              "warnings": []}
    trajectories = {"continuous": _traj(steps, loss, lr), "resumed": _traj(steps, resumed, lr)}
    controls = {"numpy-rng": _traj(steps[5:], [x + 0.2 for x in loss[5:]], lr[5:]),
                "scheduler-stale": _traj(steps[5:], loss[5:6] + [x + 0.01 for x in loss[6:]], [0.015] * 2 + lr[7:])}
    return report, trajectories, controls


def test_the_picture_is_written_and_names_every_run_and_the_first_divergent_updates(tmp_path):
    pytest.importorskip("matplotlib")
    report, trajectories, controls = _check()
    name = draw_picture(report, trajectories, controls, tmp_path)
    assert name == "verification.svg" and "picture_note" not in report and report["warnings"] == []
    svg = (tmp_path / name).read_text()
    for text in ("continuous (never interrupted)", "interrupted, archived, restored, resumed",
                 "control numpy-rng: first divergent update 6 (sample_ids)",
                 "control scheduler-stale: first divergent update 7 (lr[0])",
                 "interrupted after update 5", "resume: 0 at every update (identical)",
                 "the resume is identical to the continuous run at every update"):
        assert text in svg, text


def test_a_resume_that_diverges_by_1e_9_is_named_on_the_picture(tmp_path):
    """The loss panel cannot show 1e-9; the distance panel's symlog axis and the annotation do."""
    pytest.importorskip("matplotlib")
    report, trajectories, controls = _check(resume_diverges=True)
    lines = run_lines(report, trajectories, {})
    resumed = next(x for x in lines if x["kind"] == "resumed")
    assert resumed["first_divergent_step"] == 8 and resumed["field"] == "loss"
    svg = write_picture(report, lines, tmp_path).read_text()
    assert "the resume diverges here: update 8 (loss)" in svg and "the resume DIVERGES at update 8" in svg


def test_an_lr_only_divergence_is_marked_on_the_lr_panel_not_the_loss_distance(tmp_path):
    """Fault: a run whose first divergence is its LR (loss identical) got its cross on the loss-distance
    panel, at 0 -- the line that means "identical" -- and nothing on the LR panel, where it diverges."""
    pytest.importorskip("matplotlib")
    from ckpt_archive.resume.picture import divergence_marks

    report, trajectories, controls = _check()
    trajectories["resumed"] = _traj(range(1, 11), [1.0 / s for s in range(1, 11)],
                                    [0.03] * 3 + [0.015] * 3 + [0.015] + [0.0075] * 3)  # LR stale at update 7
    report["positive"] = False
    report["positive_comparison"] = {"matched": False, "first_divergence": {"step": 7, "field": "lr[0]"}}
    lines = run_lines(report, trajectories, controls)
    base = dict(zip(lines[0]["steps"], lines[0]["loss"]))
    marks = {m["name"]: m for m in divergence_marks(lines, base)}
    assert marks["resumed"]["panel"] == "lr" and marks["resumed"]["step"] == 7
    assert marks["resumed"]["value"] == 0.015                # on the resumed run's own LR line
    assert marks["scheduler-stale"]["panel"] == "lr"         # a control's LR divergence too
    assert marks["numpy-rng"]["panel"] == "distance"         # a data-order divergence shows in the loss
    svg = write_picture(report, lines, tmp_path).read_text()
    assert "the resume&#39;s LR diverges here: update 7 (lr[0])" in svg or \
        "the resume's LR diverges here: update 7 (lr[0])" in svg


def test_without_matplotlib_no_picture_is_written_and_the_check_says_so_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    report, trajectories, controls = _check()
    assert draw_picture(report, trajectories, controls, tmp_path) is None
    assert report["picture_note"] == NO_MATPLOTLIB and not list(tmp_path.iterdir())
    from ckpt_archive.cli.check_resume_cmd import report_human
    from ckpt_archive.cli.common import Output

    report.update(picture=None, all_checks_passed=True, problems=[], output=str(tmp_path),
                  archive={"repository": "r", "generation": 1, "verified": True},
                  determinism={"matched": True}, interruption={}, positive_comparison={
                      "matched": True, "steps_compared": [6], "final_state": {"compared": [], "matched": True},
                      "next_draws": {"matched": True}}, next_lr_after_final_step={"continuous": None, "resumed": None})
    import io

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    report_human(Output(False), report, "resume check")
    assert err.getvalue().count("matplotlib is not installed") == 1 and "PASSED" in out.getvalue()


def test_a_drawing_failure_is_a_warning_never_a_lost_verdict(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import ckpt_archive.resume.picture as picture

    def broken(*a, **k):
        raise ValueError("odd data")

    monkeypatch.setattr(picture, "write_picture", broken)
    report, trajectories, controls = _check()
    assert draw_picture(report, trajectories, controls, tmp_path) is None
    assert report["warnings"] == ["the picture of the runs could not be drawn: ValueError: odd data"]


def _repo_with_a_check(tmp_path, passed=True):
    repo = tmp_path / "archive"
    ca.pack({"model": {"w": torch.ones(2)}, "step": 5}, repo)
    out = tmp_path / "check"
    out.mkdir()
    (out / "verification.svg").write_text("<svg/>")
    record_last_check(str(repo), {"kind": "check-resume", "created": "2026-12-01T10:00:00.000000Z",
                                  "all_checks_passed": passed, "output": str(out), "picture": "verification.svg",
                                  "archive": {"generation": 1}})
    return repo, out


def test_the_export_proof_links_the_picture_of_the_last_check_of_its_repository(tmp_path):
    repo, out = _repo_with_a_check(tmp_path)
    res = CliRunner().invoke(app, ["export", str(repo), "--to", str(tmp_path / "dst"), "--report",
                                   str(tmp_path / "proof.md")])
    assert res.exit_code == 0, res.output
    proof = (tmp_path / "proof.md").read_text()
    assert "## Last resume check of the source repository" in proof and "**PASSED**" in proof
    assert f"]({out / 'verification.svg'})" in proof and str(out / "verification.json") in proof
    doc = json.loads(CliRunner().invoke(app, ["export", str(repo), "--to", str(tmp_path / "dst"), "--json"]).stdout)
    assert doc["resume_check"]["picture"] == str(out / "verification.svg") and doc["resume_check"]["passed"] is True


def test_a_repository_without_a_check_or_with_a_hostile_record_links_nothing(tmp_path):
    from ckpt_archive.ops.export_proof import LAST_CHECK_KEY, read_last_check

    repo = tmp_path / "plain"
    ca.pack({"w": torch.ones(2)}, repo)
    assert read_last_check(Repository.open(repo)) is None
    proof = ca.export(repo, tmp_path / "dst").to_markdown()
    assert "Last resume check" not in proof
    for hostile in (b'{"format": "ckpt-archive-last-check", "kind": "demo", "passed": true, '
                    b'"report": "x`) ![x](javascript:y", "created": "t"}',
                    b'{"format": "ckpt-archive-last-check", "kind": "demo", "passed": "yes", "report": "r"}',
                    b"[" * 100_000, b"not json"):
        (repo / LAST_CHECK_KEY).write_bytes(hostile)
        assert read_last_check(Repository.open(repo)) is None
    repo2, out = _repo_with_a_check(tmp_path / "two")
    (out / "verification.svg").unlink()                   # a picture that is not here is not linked
    rec = read_last_check(Repository.open(repo2))
    assert rec["picture"] is None and rec["report"] == str(out / "verification.json")
