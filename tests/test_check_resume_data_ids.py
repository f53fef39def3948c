"""check-resume names what differs between its own control runs (issue 27): the data ids each run recorded with
``Trajectory(data_ids=...)`` (a label map built in set order), or the sample ids of the first batch that differs,
instead of only "not deterministic ... update 1 (loss)".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ckpt_archive.resume.check import _not_deterministic, check_resume
from ckpt_archive.resume.compare import data_ids_differences
from ckpt_archive.resume.report import validate_report
from ckpt_archive.resume.trajectory import Trajectory, load_trajectory

SCRIPT = Path(__file__).parent / "resume_scripts" / "label_map.py"


def _template(*extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), *extra, "--steps", "{steps}", "--output", "{output}",
            "{resume:--resume-from {}}"]


@pytest.mark.slow
def test_a_label_map_that_differs_between_the_control_runs_is_named_entry_by_entry(tmp_path):
    """The label map comes out in another order in each process: the sample ids agree, the loss differs at update 1.
    The problem must name the labels that differ, not only 'update 1 (loss)'."""
    report = check_resume(_template("--record-ids"), steps=4, interrupt_at=2, output=tmp_path / "out", controls=[],
                          jobs=2)
    validate_report(json.loads((tmp_path / "out" / "verification.json").read_text()))
    assert not report["all_checks_passed"]
    det = report["determinism"]
    assert det["matched"] is False and det["first_divergence"]["field"] == "loss"
    cont = load_trajectory(tmp_path / "out" / "runs" / "continuous")["data_ids"]
    intr = load_trajectory(tmp_path / "out" / "runs" / "interrupted")["data_ids"]
    differing = sorted(k for k in cont if cont[k] != intr[k])
    assert differing and det["data_ids"]["same"] is False
    assert [line.split(":")[0] for line in det["data_ids"]["differences"]] == differing
    (problem,) = [p for p in report["problems"] if "not deterministic" in p]
    k = differing[0]
    assert f"{k}: {cont[k]} in the continuous run, {intr[k]} in the interrupted run" in problem
    assert "update 1 (loss)" in problem and "sorted(" in problem


@pytest.mark.slow
def test_a_label_map_built_in_sorted_order_passes_the_determinism_check(tmp_path):
    report = check_resume(_template("--record-ids", "--sorted"), steps=4, interrupt_at=2, output=tmp_path / "out",
                          controls=[], jobs=2)
    assert report["determinism"]["matched"] and report["determinism"]["data_ids"] == {"same": True, "differences": []}
    assert report["positive"] is True
    assert not [p for p in report["problems"] if "data ids" in p]


def test_without_recorded_data_ids_the_problem_says_how_to_have_them_compared():
    det = {"matched": False, "first_divergence": {"step": 1, "field": "loss", "expected": 1.0, "got": 4.0}}
    text = _not_deterministic(det, "random")
    assert "update 1 (loss)" in text
    assert "Trajectory(output, data_ids=...)" in text and "PYTHONHASHSEED is 'random'" in text
    assert "PYTHONHASHSEED" not in _not_deterministic(det, "0")


def test_differing_sample_ids_are_named_with_the_ids_only_one_run_consumed():
    det = {"matched": False, "first_divergence": {"step": 3, "field": "sample_ids", "expected": [4, 9, 1],
                                                  "got": [4, 2, 1]}}
    text = _not_deterministic(det, None)
    assert "update 3 (sample_ids)" in text
    assert "ids [4, 9, 1] in the continuous run, [4, 2, 1] in the interrupted run" in text
    assert "only in the continuous run: 9; only in the interrupted run: 2" in text


def test_data_ids_differences_names_changed_added_and_removed_entries_key_order_aside():
    a = {"cat": 0, "dog": 1, "owl": 2}
    b = {"dog": 1, "cat": 2, "fox": 3}
    assert data_ids_differences(a, dict(reversed(list(a.items()))), "continuous", "interrupted") == []
    assert data_ids_differences(a, b, "continuous", "resumed") == [
        "cat: 0 in the continuous run, 2 in the resumed run", "owl: only in the continuous run (2)",
        "fox: only in the resumed run (3)"]
    assert data_ids_differences(a, None, "continuous", "interrupted") is None
    many_a = {f"c{i:02d}": i for i in range(25)}
    many_b = {f"c{i:02d}": i + 1 for i in range(25)}
    lines = data_ids_differences(many_a, many_b, "continuous", "interrupted")
    assert len(lines) == 11 and lines[-1] == "... and 15 more"


def test_trajectory_refuses_data_ids_that_are_not_plain_json(tmp_path):
    with pytest.raises(ValueError, match="plain JSON"):
        Trajectory(tmp_path, data_ids={"cat": float("nan")})
    t = Trajectory(tmp_path, data_ids=["a.jpg", "b.jpg"])
    t.record(step=1, sample_ids=[0], loss=0.5, lr=[0.1])
    t.finish()
    assert load_trajectory(tmp_path)["data_ids"] == ["a.jpg", "b.jpg"]
