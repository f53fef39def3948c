"""check-resume: the command contract, the type-preserving negative controls, the comparison, and the
issue-5 cases 4 (LambdaLR) and 5 (mid-epoch data order) end to end, with the archive in the loop.

The end-to-end tests start real training processes (each pays a torch import, ~2 s): they run the
fewest controls that show the behaviour (``--control``), and share nothing between tests.
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_archive.errors import OutputExists, UsageError
from ckpt_archive.resume.compare import TreeDiff, compare_runs, compare_trajectories
from ckpt_archive.resume.controls import control_verdict, perturb
from ckpt_archive.resume.report import validate_report
from ckpt_archive.resume.runner import prepare_output
from ckpt_archive.resume.template import check_template, expand_command
from ckpt_archive.training.parts import rng_streams

from tests.helpers import cli_in_process

SCRIPTS = Path(__file__).parent / "resume_scripts"


def cli(*args: str) -> subprocess.CompletedProcess:
    """``ckpt-archive ARGS`` in this process: check-resume starts its training runs as processes of their own
    (the boundary these tests are about); a second interpreter around it added only ~2 s of start-up."""
    return cli_in_process(*args)


def template(script: str, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / script), *extra, "--steps", "{steps}", "--output", "{output}",
            "{resume:--resume-from {}}"]


# ------------------------------------------------------------------------------------------------
# The command template
# ------------------------------------------------------------------------------------------------
def test_resume_argument_vanishes_entirely_in_runs_that_do_not_resume():
    t = ["python", "train.py", "--steps", "{steps}", "--out={output}", "--resume-from={resume}", "{resume:-r {}}"]
    assert expand_command(t, steps=10, output="/o", resume=None) == ["python", "train.py", "--steps", "10", "--out=/o"]


def test_resume_template_expands_to_separate_arguments_when_resuming():
    t = ["python", "train.py", "{resume:--resume-from {}}", "--steps", "{steps}", "{output}"]
    assert expand_command(t, steps=5, output="/o", resume="/r/c.pt") == [
        "python", "train.py", "--resume-from", "/r/c.pt", "--steps", "5", "/o"]
    assert expand_command(["x", "--ckpt={resume}"], steps=1, output="o", resume="a b.pt") == ["x", "--ckpt=a b.pt"]


@pytest.mark.parametrize("t, missing", [
    (["python", "t.py", "{output}", "{resume}"], "{steps}"),
    (["python", "t.py", "{steps}", "{resume}"], "{output}"),
    (["python", "t.py", "{steps}", "{output}"], "{resume}"),
])
def test_template_missing_a_placeholder_is_refused_naming_it(t, missing):
    with pytest.raises(UsageError, match=re_escape(missing)):
        check_template(t)


def re_escape(s):
    import re

    return re.escape(s)


def test_cli_refuses_missing_placeholder_with_exit_2_and_no_traceback(tmp_path):
    r = cli("check-resume", "--steps", "4", "--interrupt-at", "2", "--output", str(tmp_path / "o"), "--",
            sys.executable, "train.py", "--steps", "{steps}")
    assert r.returncode == 2, r.stderr
    assert "{output}" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_interrupt_not_before_the_end_with_exit_2(tmp_path):
    r = cli("check-resume", "--steps", "4", "--interrupt-at", "4", "--json", "--", "x", "{steps}", "{output}", "{resume}")
    assert r.returncode == 2
    assert json.loads(r.stdout)["ok"] is False


def test_a_run_that_crashes_is_exit_2_naming_the_run_and_its_log(tmp_path):
    r = cli("check-resume", "--steps", "4", "--interrupt-at", "2", "--output", str(tmp_path / "o"), "--",
            sys.executable, "-c", "import sys; print('boom: no data', file=sys.stderr); sys.exit(3)",
            "{steps}", "{output}", "{resume}")
    assert r.returncode == 2, r.stderr
    assert "exited 3" in r.stderr and "boom: no data" in r.stderr and "stderr.log" in r.stderr


def test_output_folder_that_is_not_empty_is_refused(tmp_path):
    (tmp_path / "earlier.json").write_text("{}")
    with pytest.raises(OutputExists):
        prepare_output(tmp_path, default_prefix="x")
    assert (tmp_path / "earlier.json").read_text() == "{}"


def test_default_output_is_a_new_timestamped_folder_each_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = prepare_output(None, default_prefix="ckpt-archive-demo")
    (a / "verification.json").write_text("{}")
    b = prepare_output(None, default_prefix="ckpt-archive-demo")
    assert a != b and a.name.startswith("ckpt-archive-demo-2") and b.is_dir()
    assert (a / "verification.json").read_text() == "{}"


# ------------------------------------------------------------------------------------------------
# Negative controls: type-preserving perturbations found by shape and conventional keys
# ------------------------------------------------------------------------------------------------
def _state():
    model = torch.nn.Linear(2, 1).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _ in range(4):
        opt.zero_grad()
        model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        opt.step()
        sched.step()
    random.seed(1)
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.Generator(np.random.PCG64(3)).bit_generator.state,
                "torch": torch.get_rng_state()},
        "data": {"permutation": list(range(24)), "cursor": 16, "epoch": 0},
        "progress": {"step": 4},
    }


def test_python_rng_control_is_another_valid_tuple_state():
    st = _state()
    new, p = perturb(st, "python")
    old_state, new_state = st["rng"]["python"], new["rng"]["python"]
    assert p.applied and p.changed == ["rng.python"]
    assert type(new_state) is tuple and type(new_state[1]) is tuple and len(new_state[1]) == 625
    assert all(type(x) is int for x in new_state[1]) and new_state[1] != old_state[1]
    r = random.Random()
    r.setstate(new_state)  # valid: accepted by random
    assert st["rng"]["python"] is old_state  # the input is not mutated


def test_numpy_rng_control_keeps_bit_generator_and_int_types():
    st = _state()
    new, p = perturb(st, "numpy")
    old, got = st["rng"]["numpy"], new["rng"]["numpy"]
    assert p.changed == ["rng.numpy"]
    assert got["bit_generator"] == "PCG64" and list(got) == list(old)
    assert type(got["state"]["state"]) is int and got["state"]["state"] != old["state"]["state"]
    g = np.random.Generator(np.random.PCG64())
    g.bit_generator.state = got  # valid


def test_torch_rng_control_is_a_uint8_state_of_the_same_length():
    st = _state()
    new, p = perturb(st, "torch")
    t = new["rng"]["torch"]
    assert p.changed == ["rng.torch"]
    assert t.dtype == torch.uint8 and t.shape == st["rng"]["torch"].shape and not torch.equal(t, st["rng"]["torch"])
    torch.Generator().set_state(t)  # valid


def test_optimizer_control_zeroes_moments_but_keeps_step_and_lr():
    st = _state()
    new, p = perturb(st, "optimizer")
    for pid, ps in new["optimizer"]["state"].items():
        assert torch.count_nonzero(ps["exp_avg"]) == 0 and torch.count_nonzero(ps["exp_avg_sq"]) == 0
        assert torch.equal(ps["step"], st["optimizer"]["state"][pid]["step"])
        assert ps["exp_avg"].dtype == st["optimizer"]["state"][pid]["exp_avg"].dtype
    assert "optimizer.state.0.exp_avg" in p.changed
    assert torch.count_nonzero(st["optimizer"]["state"][0]["exp_avg"]) > 0


def test_scheduler_control_is_one_step_stale_with_the_previous_lr():
    st = _state()  # after 4 scheduler steps: last_epoch 4, lr 0.015; update 4 used 0.015
    new, p = perturb(st, "scheduler", previous_lr=[0.03])
    assert new["scheduler"]["last_epoch"] == 3 and type(new["scheduler"]["last_epoch"]) is int
    assert new["scheduler"]["_step_count"] == st["scheduler"]["_step_count"] - 1
    assert new["scheduler"]["_last_lr"] == [0.03] and new["optimizer"]["param_groups"][0]["lr"] == 0.03
    assert "optimizer.param_groups[0].lr" in p.changed


def test_cursor_control_shifts_the_cursor_by_one_and_keeps_it_an_int():
    st = _state()
    new, p = perturb(st, "data")
    assert new["data"]["cursor"] == 17 and type(new["data"]["cursor"]) is int
    st["data"]["cursor"] = 24
    assert perturb(st, "cursor")[0]["data"]["cursor"] == 23  # never past the end of the permutation


def test_a_part_missing_from_the_state_is_reported_not_invented():
    st = _state()
    del st["rng"]["numpy"]
    same, p = perturb(st, "numpy")
    assert not p.applied and same is st and "NumPy" in p.note
    sgd = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1).state_dict()
    _, p = perturb({"optimizer": sgd}, "optimizer")
    assert not p.applied and "no moment tensors" in p.note


def test_rng_streams_are_found_by_shape_under_any_key():
    random.seed(0)
    st = {"my_rngs": [random.getstate(), {"gen": np.random.default_rng(1).bit_generator.state}],
          "torch_state": torch.get_rng_state()}
    found = rng_streams(st)
    assert set(found) == {"python", "numpy", "torch"}
    new, p = perturb(st, "python")
    assert type(new["my_rngs"]) is list and new["my_rngs"][0] != st["my_rngs"][0]


def _plain(x):
    """A bit_generator.state with its arrays as lists, as a checkpoint loadable with weights_only=True holds it."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x.tolist() if isinstance(x, np.ndarray) else x


def _types(x):
    """The container and value types of ``x`` all the way down (tensors by dtype and shape)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape))
    if isinstance(x, dict):
        return (type(x), [(k, _types(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x), [_types(v) for v in x])
    return type(x)


def _every_rng_format_state():
    st = _state()
    random.seed(2)
    random.gauss(0.0, 1.0)  # gauss_next cached: the third item of getstate() is a float
    legacy = np.random.RandomState(4).get_state()
    st["rng"] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                 "numpy_legacy": (legacy[0], legacy[1].tolist(), legacy[2], legacy[3], legacy[4]),
                 "numpy": {n: _plain(getattr(np.random, n)(5).state) for n in ("PCG64", "MT19937", "SFC64", "Philox")}}
    return st


@pytest.mark.parametrize("control", ["python-rng", "numpy-rng", "torch-rng", "optimizer-moments", "scheduler-stale",
                                     "data-cursor"])
def test_every_control_keeps_the_saved_types_for_every_rng_format_so_weights_only_loads_it(control, tmp_path):
    """Issue #4: the numpy-rng control turned the legacy get_state() tuple's list (saved with .tolist(), as
    the docs prescribe) into an ndarray, so the script's torch.load(weights_only=True) refused the perturbed
    file and a correct resume exited 2. A perturbed state must hold exactly the types the archived one held."""
    st = _every_rng_format_state()
    new, p = perturb(st, control, previous_lr=[0.03])
    assert p.applied, p.note
    assert _types(new) == _types(st)
    path = tmp_path / "control.pt"
    torch.save(new, path)
    back = torch.load(path, weights_only=True)  # what a script following the contract does
    if control == "numpy-rng":
        assert p.changed == ["rng.numpy_legacy"] + [f"rng.numpy.{n}" for n in ("PCG64", "MT19937", "SFC64", "Philox")]
        s = back["rng"]["numpy_legacy"]
        assert s[1] != st["rng"]["numpy_legacy"][1]
        np.random.RandomState().set_state((s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]))  # valid
        for n, saved in back["rng"]["numpy"].items():
            assert saved["state"] != st["rng"]["numpy"][n]["state"]
    if control == "python-rng":
        assert type(back["rng"]["python"][2]) is float and back["rng"]["python"] != st["rng"]["python"]
        random.Random().setstate(back["rng"]["python"])  # valid


def test_a_perturbation_that_would_change_a_type_is_could_not_check_not_a_run():
    """A control that cannot keep the saved types must not hand the script a file it would refuse (the run
    would then test the loader, not the resume): perturb refuses, naming where (the check reports the
    control as could-not-check, exit 2)."""
    from ckpt_archive.errors import CannotCheck
    from ckpt_archive.resume import controls

    st = _state()
    st["rng"]["numpy"] = {"bit_generator": "MT19937", "state": {"key": [1] * 624, "pos": 624}}
    orig = controls._coerce_like
    try:
        controls._coerce_like = lambda old, new: new  # a perturber that forgets the saved types
        with pytest.raises(CannotCheck, match=r"rng\.numpy\.state\.key: list -> ndarray"):
            perturb(st, "numpy")
    finally:
        controls._coerce_like = orig


def test_correct_resume_with_every_rng_format_passes_the_rng_controls(tmp_path):
    """Issue #4 end to end: a correct script saving every RNG format the docs list (the legacy NumPy tuple and
    MT19937/SFC64/Philox states with their arrays as .tolist(), a Python state with a cached Gaussian) must
    pass with each RNG control diverging, never exit 2 because a control's file could not be loaded."""
    out = tmp_path / "fmt"
    r = cli("check-resume", "--steps", "6", "--interrupt-at", "3", "--jobs", "2", "--output", str(out),
            "--control", "python,numpy,torch", "--json", "--", *template("rng_formats.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    report = _report(out)
    assert {e["name"]: e["status"] for e in report["negative_controls"]} == {
        "python-rng": "diverged", "numpy-rng": "diverged", "torch-rng": "diverged"}


# ------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------
def _u(step, ids, lr, loss, epoch=None):
    d = {"step": step, "sample_ids": ids, "lr": lr, "loss": loss}
    if epoch is not None:
        d["epoch"] = epoch
    return d


def test_lr_divergence_is_reported_apart_from_the_loss_divergence_it_causes():
    exp = [_u(6, [1], [0.015], 0.5), _u(7, [2], [0.0075], 0.4), _u(8, [3], [0.0075], 0.3)]
    got = [_u(6, [1], [0.015], 0.5), _u(7, [2], [0.015], 0.4), _u(8, [3], [0.0075], 0.31)]
    r = compare_trajectories(exp, got, atol=1e-12, rtol=0)
    assert r["first_divergence"] == {"step": 7, "field": "lr[0]", "expected": 0.0075, "got": 0.015}
    assert r["lr_divergence"]["step"] == 7 and r["lr_divergence"]["group"] == 0
    assert r["loss_divergence"]["step"] == 8
    assert r["data_order"] is None


def test_difference_within_tolerance_is_accepted_and_beyond_is_not():
    exp = [_u(2, [1], [0.1], 1.0)]
    assert compare_trajectories(exp, [_u(2, [1], [0.1], 1.0 + 5e-13)], atol=1e-12, rtol=0)["first_divergence"] is None
    assert compare_trajectories(exp, [_u(2, [1], [0.1], 1.0 + 5e-12)], atol=1e-12, rtol=0)["loss_divergence"]
    assert compare_trajectories(exp, [_u(2, [1], [0.1], 1.01)], atol=0, rtol=0.1)["first_divergence"] is None


def test_nan_loss_in_both_runs_is_flagged_never_accepted():
    exp = [_u(2, [1], [0.1], float("nan"))]
    r = compare_trajectories(exp, [_u(2, [1], [0.1], float("nan"))], atol=1e-12, rtol=0)
    assert r["non_finite"] == ["loss at step 2"]
    traj = {"updates": exp, "final": {}}
    cmp = compare_runs({"updates": [_u(1, [0], [0.1], 1.0)] + exp, "final": {}}, traj, {}, {}, interrupt_at=1,
                       atol=1e-12, rtol=0)
    assert cmp["matched"] is False


def test_structure_differences_are_flagged_tuple_vs_list_int_vs_float_missing_keys():
    td = TreeDiff(1e-12, 0)
    td.compare({"a": (1, 2), "b": 3, "c": 1, "t": torch.zeros(2)},
               {"a": [1, 2], "b": 3.0, "t": torch.zeros(3)})
    kinds = {d["field"]: d["kind"] for d in td.diffs}
    assert kinds == {"a": "type", "b": "type", "c": "missing", "t": "structure"}


def test_final_state_difference_names_the_field_and_max_param_diff():
    exp = {"model": OrderedDict(w=torch.tensor([1.0, 2.0], dtype=torch.float64)), "config": {"out": "/a"}}
    got = {"model": OrderedDict(w=torch.tensor([1.0, 2.5], dtype=torch.float64)), "config": {"out": "/b"}}
    t = {"updates": [_u(1, [0], [0.1], 1.0), _u(2, [1], [0.1], 1.0)], "final": {}}
    cmp = compare_runs(t, {"updates": t["updates"][1:], "final": {}}, exp, got, interrupt_at=1, atol=1e-12, rtol=0)
    assert cmp["first_divergence"]["field"] == "final.model.w" and cmp["first_divergence"]["step"] == 2
    assert cmp["max_param_abs_diff"] == 0.5
    assert cmp["final_state"]["not_compared"] == ["config"]  # run-specific paths are not compared


def test_duplicated_and_never_seen_samples_are_counted_per_epoch():
    # epoch 1 restarted with a fresh permutation after 2 of 5 batches (the case-5 bug)
    prefix = [_u(1, [0, 1], [0.1], 0, 0), _u(2, [2, 3], [0.1], 0, 0), _u(3, [4, 5], [0.1], 0, 1)]
    exp = [_u(4, [6, 7], [0.1], 0, 1), _u(5, [8, 9], [0.1], 0, 1)]
    got = [_u(4, [5, 9], [0.1], 0, 1), _u(5, [4, 6], [0.1], 0, 1)]
    r = compare_trajectories(exp, got, atol=1e-12, rtol=0, prefix=prefix)
    d = r["data_order"]
    assert (d["first_divergent_step"], d["batch"], d["expected_ids"], d["got_ids"]) == (4, 1, [6, 7], [5, 9])
    assert (d["duplicated"], d["never_seen"]) == (2, 2)  # 4 and 5 seen twice in epoch 1; 7 and 8 never
    assert d["per_epoch"] == [{"epoch": 1, "duplicated": 2, "never_seen": 2, "duplicated_ids": [4, 5],
                               "never_seen_ids": [7, 8]}]
    assert (d["duplicated_ids"], d["never_seen_ids"]) == ([4, 5], [7, 8])


def test_control_that_changes_nothing_fails_naming_the_stream():
    cmp = {"first_divergence": None, "diverged": False, "structure": []}
    e = control_verdict(cmp, name="numpy-rng", kind="tool", label="the NumPy RNG", expected_no_effect=False)
    assert not e["ok"] and e["status"] == "no-effect"
    assert e["message"].startswith("perturbing the NumPy RNG changed nothing: either it is not restored or not used")
    e = control_verdict(cmp, name="numpy-rng", kind="tool", label="the NumPy RNG", expected_no_effect=True)
    assert e["ok"] and e["status"] == "no-effect-expected"


def test_report_breaking_the_schema_is_rejected():
    import jsonschema

    with pytest.raises(jsonschema.ValidationError):
        validate_report({"format": "ckpt-archive-verification", "version": 1})


# ------------------------------------------------------------------------------------------------
# End to end (real processes, real archive)
# ------------------------------------------------------------------------------------------------
def _report(out: Path) -> dict:
    report = json.loads((out / "verification.json").read_text())
    validate_report(report)
    return report


def _traj(out: Path, run: str) -> list[dict]:
    return json.loads((out / "runs" / run / "trajectory.json").read_text())["updates"]


def test_case4_lambda_lr_resume_passes_and_stale_scheduler_control_names_update_6(tmp_path):
    out = tmp_path / "c4"
    r = cli("check-resume", "--steps", "10", "--interrupt-at", "5", "--jobs", "2", "--output", str(out),
            "--control", "scheduler", "--json", "--", *template("lambda_lr.py"))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report.pop("ok") is True and report == _report(out)  # the printed object adds ok (issue 26)
    assert report["all_checks_passed"] and report["positive"] and report["positive_comparison"]["matched"]
    resumed = _traj(out, "resumed")
    assert [u["step"] for u in resumed] == [6, 7, 8, 9, 10]
    assert [u["lr"][0] for u in resumed] == pytest.approx([5e-6, 4e-6, 3e-6, 2e-6, 1e-6], rel=1e-12, abs=0)
    stale = next(e for e in report["negative_controls"] if e["name"] == "scheduler-stale")
    assert stale["diverged"] and stale["first_divergent_step"] == 6 and stale["field"] == "lr[0]"
    assert stale["expected"] == pytest.approx(5e-6, rel=1e-12) and stale["got"] == pytest.approx(6e-6, rel=1e-12)
    assert "update 6" in stale["message"] and "expected 5e-06, got 6e-06" in stale["message"]
    assert report["archive"]["verified"] and report["archive"]["round_trip_exact"]


def test_case5_resume_yields_the_remaining_six_samples_then_the_same_epoch_2(tmp_path):
    out = tmp_path / "c5"
    r = cli("check-resume", "--steps", "15", "--interrupt-at", "7", "--jobs", "2", "--output", str(out),
            "--control", "numpy", "--control", "data", "--control", "torch", "--expect-no-effect", "torch",
            "--", *template("shuffled_epochs.py"))
    assert r.returncode == 0, r.stderr
    report = _report(out)
    assert report["interruption"] == {"step": 7, "epoch": 1, "cursor": 4, "samples_per_epoch": 10, "mid_epoch": True}
    cont, intr, res = _traj(out, "continuous"), _traj(out, "interrupted"), _traj(out, "resumed")
    epoch1 = [i for u in cont if u["epoch"] == 1 for i in u["sample_ids"]]
    assert [i for u in intr if u["epoch"] == 1 for i in u["sample_ids"]] == epoch1[:4]
    assert [i for u in res if u["epoch"] == 1 for i in u["sample_ids"]] == epoch1[4:]  # the remaining 6
    assert [u["sample_ids"] for u in res if u["epoch"] == 2] == [u["sample_ids"] for u in cont if u["epoch"] == 2]
    status = {e["name"]: e["status"] for e in report["negative_controls"]}
    assert status == {"numpy-rng": "diverged", "data-cursor": "diverged", "torch-rng": "no-effect-expected"}


def test_case5_restoring_the_generator_alone_is_caught_with_first_batch_and_counts(tmp_path):
    out = tmp_path / "c5bug"
    r = cli("check-resume", "--steps", "15", "--interrupt-at", "7", "--output", str(out), "--expect-no-effect",
            "torch", "--", *template("shuffled_epochs.py", "--restore-generator-only"))
    assert r.returncode == 1, r.stderr
    report = _report(out)
    cont = _traj(out, "continuous")
    d = report["positive_comparison"]["data_order"]
    assert d["first_divergent_step"] == 8 and d["batch"] == 1
    assert d["expected_ids"] == cont[7]["sample_ids"] and d["got_ids"] != d["expected_ids"]
    # epoch 1 restarted in full after 4 of its samples: those 4 twice; epoch 2 then cut short by 4
    counts = [{k: e[k] for k in ("epoch", "duplicated", "never_seen")} for e in d["per_epoch"]]
    assert counts == [{"epoch": 1, "duplicated": 4, "never_seen": 0}, {"epoch": 2, "duplicated": 0, "never_seen": 4}]
    # and which samples: the 4 of epoch 1 consumed before the interruption are the ones replayed
    assert d["per_epoch"][0]["duplicated_ids"] == sorted(i for u in cont[:7] if u["epoch"] == 1 for i in u["sample_ids"])
    assert "update 8" in r.stdout and "4 duplicated, 4 never-seen" in r.stdout  # the result: stdout
    assert all(e["status"] == "not-run" for e in report["negative_controls"])


def test_unused_stream_perturbation_fails_the_check_unless_declared(tmp_path):
    out = tmp_path / "unused"
    r = cli("check-resume", "--steps", "4", "--interrupt-at", "2", "--output", str(out), "--control", "torch",
            "--", *template("shuffled_epochs.py"))
    assert r.returncode == 1, r.stderr
    assert "perturbing the torch RNG changed nothing: either it is not restored or not used" in r.stdout
    report = _report(out)
    assert report["positive"] and report["positive_comparison"]["matched"]  # the resume itself is fine: only the control is empty
    assert report["negative_divergence_detected"] is False and not report["all_checks_passed"]


# ------------------------------------------------------------------------------------------------
# The trajectory helper
# ------------------------------------------------------------------------------------------------
def test_trajectory_finish_records_next_draws_without_consuming_any_stream(tmp_path):
    from ckpt_archive.resume.trajectory import Trajectory, load_trajectory

    random.seed(5)
    torch.manual_seed(5)
    g = np.random.Generator(np.random.PCG64(5))
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    traj = Trajectory(tmp_path)
    traj.record(step=1, sample_ids=torch.tensor([3, 1]), loss=torch.tensor(float("nan")), optimizer=opt, epoch=0)
    final = traj.finish(model=model, optimizer=opt, numpy_generator=g)
    # the streams are where they were: the recorded next draws are the real next draws
    assert final["next_draws"]["python"][0] == random.random()
    assert final["next_draws"]["numpy"][0] == g.random()
    assert final["next_draws"]["torch"][0] == torch.rand(1, dtype=torch.float64).item()
    loaded = load_trajectory(tmp_path)
    u = loaded["updates"][0]
    assert u["sample_ids"] == [3, 1] and u["lr"] == [0.5] and math.isnan(u["loss"]) and u["epoch"] == 0
    assert json.loads((tmp_path / "trajectory.json").read_text())["updates"][0]["loss"] == "nan"  # strict JSON
    assert set(loaded["final"]["params"]) == {"weight", "bias"} and len(loaded["final"]["params"]["weight"]["sha256"]) == 64


def test_missing_trajectory_is_a_clear_error_naming_the_file(tmp_path):
    from ckpt_archive.errors import SourceError
    from ckpt_archive.resume.trajectory import load_trajectory

    with pytest.raises(SourceError, match="trajectory.json"):
        load_trajectory(tmp_path)
    (tmp_path / "trajectory.json").write_text('{"format": "other"}')
    with pytest.raises(SourceError, match="format"):
        load_trajectory(tmp_path)


def test_legacy_numpy_rng_tuple_in_checkpoint_is_named_with_the_refused_global_and_a_fix(tmp_path):
    # np.random.get_state() holds an ndarray: torch.load(weights_only=True) refuses it, and torch's
    # first line ("Weights only load failed...") names neither the global nor what to change.
    import numpy as np
    import torch

    from ckpt_archive.errors import RefusedPickle
    from ckpt_archive.resume.runner import load_checkpoint

    path = tmp_path / "checkpoint.pt"
    torch.save({"rng": {"numpy": np.random.RandomState(0).get_state()}}, path)
    with pytest.raises(RefusedPickle) as info:
        load_checkpoint(path)
    text = str(info.value)
    assert "multiarray._reconstruct" in text and str(path) in text
    assert ".tolist()" in text and "Weights only load failed" not in text and "\x1b[" not in text
    assert info.value.exit_code == 2


def test_crashed_run_is_reported_by_its_exception_and_place_not_a_mangled_traceback(tmp_path):
    from ckpt_archive.errors import SourceError
    from ckpt_archive.resume.runner import RunRecord, require_ok

    (tmp_path / "stderr.log").write_text(
        "step 1\nTraceback (most recent call last):\n"
        '  File "/work/my dir/train.py", line 39, in <module>\n'
        '    if step == 3: raise RuntimeError("boom")\n'
        "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "RuntimeError: CUDA out of memory.\nTried to allocate 2 GiB\n")
    rec = RunRecord("continuous", ["python", "train.py"], tmp_path)
    rec.exit_code = 1
    with pytest.raises(SourceError) as info:
        require_ok(rec)
    text = str(info.value)
    assert "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB (at /work/my dir/train.py:39)" in text
    assert "Traceback" not in text and "^^^" not in text and "stderr.log" in text
    assert info.value.exit_code == 2


def test_diverged_resume_names_the_one_rng_stream_that_ends_in_another_state():
    # A script that forgets np_rng.bit_generator.state = ...: the data order diverges at update 6
    # (field sample_ids); the report must point at NumPy, the only stream that ends differently.
    import copy

    exp_state = _state()
    got_state = copy.deepcopy(exp_state)
    got_state["rng"]["numpy"] = np.random.Generator(np.random.PCG64(4)).bit_generator.state
    exp = {"updates": [_u(1, [0], [0.1], 1.0), _u(2, [1, 2], [0.1], 1.0)], "final": {}}
    got = {"updates": [_u(2, [3, 4], [0.1], 1.0)], "final": {}}
    cmp = compare_runs(exp, got, exp_state, got_state, interrupt_at=1, atol=1e-12, rtol=0)
    assert cmp["first_divergence"]["field"] == "sample_ids"
    assert cmp["suspect_streams"] == ["numpy"] and "restores the numpy RNG state" in cmp["hint"]
    # every stream ending differently (or none) blames no stream in particular
    got_state["rng"]["python"] = random.Random(7).getstate()
    got_state["rng"]["torch"] = torch.Generator().manual_seed(7).get_state()
    cmp = compare_runs(exp, got, exp_state, got_state, interrupt_at=1, atol=1e-12, rtol=0)
    assert "suspect_streams" not in cmp
    cmp = compare_runs(exp, got, exp_state, copy.deepcopy(exp_state), interrupt_at=1, atol=1e-12, rtol=0)
    assert "suspect_streams" not in cmp and cmp["first_divergence"]["field"] == "sample_ids"


def test_trajectory_records_next_draws_of_legacy_numpy_global_state(tmp_path):
    # np.random.seed / np.random.permutation scripts have no Generator: finish(numpy_generator=np.random)
    # must record the next draws of the global state (and leave that state untouched)
    from ckpt_archive.resume.trajectory import Trajectory

    np.random.seed(3)
    before = np.random.get_state()
    final = Trajectory(tmp_path, meta={}).finish(numpy_generator=np.random, write=False)
    expected = np.random.RandomState(3).random_sample(len(final["next_draws"]["numpy"])).tolist()
    assert [float(x) for x in final["next_draws"]["numpy"]] == expected
    after = np.random.get_state()
    assert before[2] == after[2] and (before[1] == after[1]).all()
    rs = np.random.RandomState(5)
    assert Trajectory(tmp_path, meta={}).finish(numpy_generator=rs, write=False)["next_draws"]["numpy"]


# ------------------------------------------------------------------------------------------------
# Issue 12: several interruptions, cumulative data cursor, could-not-check, {total_steps}, booleans
# ------------------------------------------------------------------------------------------------
def test_cursor_counting_batches_since_the_last_resume_passes_a_second_interruption(tmp_path, capsys):
    """The faulty script replays data only after a second interruption in one epoch: one interruption
    passes, two (2,4) must fail naming the first divergent batch and the duplicated and skipped ids."""
    one = cli("check-resume", "--steps", "8", "--interrupt-at", "2", "--output", str(tmp_path / "one"),
              "--no-controls", "--script-control=--refuse-odd-cursor", "--json", "--",
              *template("epoch_cursor.py", "--cursor-since-resume"))
    assert json.loads(one.stdout)["positive"] is True, one.stderr  # one resume cannot show the fault
    out = tmp_path / "two"
    r = cli("check-resume", "--steps", "8", "--interrupt-at", "2,4", "--output", str(out), "--no-controls",
            "--json", "--", *template("epoch_cursor.py", "--cursor-since-resume"))
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report.pop("ok") == report["all_checks_passed"] and report == _report(out)
    assert report["interrupt_points"] == [2, 4]
    assert report["positive"] is False and report["all_checks_passed"] is False
    d = report["positive_comparison"]["data_order"]
    assert d["first_divergent_step"] == 5 and d["duplicated"] == 4 and d["never_seen"] == 4
    # the cursor after the second resume: 4 (2 batches since the resume) where the epoch was 8 samples in
    it = report["interruptions"][1]
    assert (it["at"], it["cursor"], it["expected_cursor"]) == (4, 4, 8)
    cont = _traj(out, "continuous")
    perm_e0 = [i for u in cont[:6] for i in u["sample_ids"]]
    # epoch 0: samples 4..7 of its permutation replayed; the 4 samples the continuous run drew from epoch 1's
    # permutation in updates 7 and 8 were never seen (the resumed line was still finishing epoch 0)
    assert d["duplicated_ids"] == sorted(perm_e0[4:8])
    assert d["never_seen_ids"] == sorted(i for u in cont[6:8] for i in u["sample_ids"])
    assert r.stderr == ""  # --json: nothing but the JSON object
    from ckpt_archive.cli.check_resume_cmd import report_human
    from ckpt_archive.cli.common import Output

    report_human(Output(False), report, "check-resume")  # what a run without --json prints
    printed = capsys.readouterr()                             # the table: stdout; warnings: stderr (issue 26)
    assert "duplicated ids" in printed.out and any("data.cursor 4" in w for w in report["warnings"])
    assert "warning: interruption at update 4: data.cursor 4" in printed.err
    # the correct cursor passes the same two interruptions
    ok = cli("check-resume", "--steps", "8", "--interrupt-at", "2", "--interrupt-at", "4", "--output",
             str(tmp_path / "ok"), "--control", "data", "--json", "--", *template("epoch_cursor.py"))
    assert ok.returncode == 0, ok.stderr
    rep = json.loads(ok.stdout)
    assert rep["interrupt_points"] == [2, 4] and rep["positive"] is True  # given twice: accumulated
    assert [r["name"] for r in rep["runs"]][:4] == ["continuous", "interrupted", "resumed-1", "resumed"]


def test_control_whose_run_refuses_the_perturbed_state_counts_as_diverged(tmp_path):
    out = tmp_path / "o"
    r = cli("check-resume", "--steps", "6", "--interrupt-at", "3", "--output", str(out), "--control", "data",
            "--json", "--", *template("epoch_cursor.py", "--refuse-odd-cursor"))
    assert r.returncode == 2, r.stderr
    assert r.stderr == ""  # --json: the error is the JSON object on stdout
    assert "could not check control data-cursor" in r.stdout and "not on a batch boundary" in r.stdout
    assert "Traceback" not in r.stdout
    report = _report(out)  # the report is still written, and says why
    (e,) = report["negative_controls"]
    assert e["status"] == "could-not-check" and e["diverged"] is False and not report["all_checks_passed"]
    assert report["negative_divergence_detected"] is False


def test_interrupt_at_given_twice_silently_keeps_the_last():
    from ckpt_archive.cli.check_resume_cmd import _points
    from ckpt_archive.resume.check import _interruptions

    assert _points(["30", "40"]) == [30, 40] and _points(["30,40"]) == [30, 40]
    with pytest.raises(UsageError, match="repeats"):
        _interruptions([30, 30], 50)
    with pytest.raises(UsageError, match="--interrupt-at"):
        _interruptions([30, 50], 50)


def test_total_steps_placeholder_missing_for_scripts_whose_steps_is_the_total(tmp_path):
    t = ["python", "t.py", "--steps", "{total_steps}", "--output", "{output}", "{resume:--resume-from {}}"]
    check_template(t)  # {total_steps} stands for {steps}
    assert expand_command(t, steps=5, output="o", resume="c.pt", total_steps=10)[3] == "10"
    out = tmp_path / "o"
    r = cli("check-resume", "--steps", "8", "--interrupt-at", "3,5", "--output", str(out), "--control", "data",
            "--json", "--", sys.executable, str(SCRIPTS / "epoch_cursor.py"), "--steps-is-total",
            "--steps", "{total_steps}", "--output", "{output}", "{resume:--resume-from {}}")
    assert r.returncode == 0, r.stderr
    assert [u["step"] for u in _traj(out, "resumed")] == [6, 7, 8]


def test_verification_booleans_are_objects_not_booleans(tmp_path):
    out = tmp_path / "o"
    r = cli("check-resume", "--steps", "6", "--interrupt-at", "3", "--output", str(out), "--control", "data",
            "--json", "--", *template("epoch_cursor.py"))
    assert r.returncode == 0, r.stderr
    report = _report(out)
    for key in ("all_checks_passed", "positive", "negative_divergence_detected"):
        assert report[key] is True, key
    assert report["positive_comparison"]["matched"] is True


def test_check_resume_ignores_a_changed_data_identity(tmp_path):
    ids, now = tmp_path / "ids.json", tmp_path / "now.json"
    ids.write_text(json.dumps({"cat": 0, "person": 3}))
    now.write_text(json.dumps({"person": 3, "cat": 0}))  # the same map in another key order: passes silently
    r = cli("check-resume", "--steps", "6", "--interrupt-at", "3", "--output", str(tmp_path / "a"), "--control",
            "data", "--data-ids", str(ids), "--resume-data-ids", str(now), "--json", "--", *template("epoch_cursor.py"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data_ids"][0]["same"] is True and "data ids" not in r.stderr
    now.write_text(json.dumps({"cat": 0, "person": 1}))
    r = cli("check-resume", "--steps", "6", "--interrupt-at", "3", "--output", str(tmp_path / "b"), "--control",
            "data", "--data-ids", str(ids), "--resume-data-ids", str(now), "--", *template("epoch_cursor.py"))
    assert r.returncode == 1 and "person: archived 3, now 1" in r.stderr, r.stderr


def test_a_resumed_run_that_records_too_few_updates_could_not_check_exit_2(tmp_path):
    """Issue #9: a resumed run that exits 0 after 2 of the 5 updates asked for was judged "diverged" (exit 1)
    while the docs list the wrong number of updates under exit 2: such a run cannot be compared. It must be
    exit 2 naming the run and both counts, never a pass."""
    r = cli("check-resume", "--steps", "8", "--interrupt-at", "3", "--output", str(tmp_path / "o"), "--control", "data",
            "--", *template("epoch_cursor.py", "--short-resume"))
    assert r.returncode == 2, r.stderr
    assert "run 'resumed' recorded 2 updates (steps 4..5) where it was asked for 5 (4..8)" in r.stderr
    assert "Traceback" not in r.stderr
    # the same for a middle segment of several interruptions
    r = cli("check-resume", "--steps", "8", "--interrupt-at", "2,5", "--output", str(tmp_path / "m"), "--no-controls",
            "--", *template("epoch_cursor.py", "--short-resume"))
    assert r.returncode == 2 and "run 'resumed-1' recorded 2 updates" in r.stderr, r.stderr


def test_a_control_run_that_records_too_few_updates_is_could_not_check_not_diverged(tmp_path):
    """A control run cut short (exit 0, 2 of 5 updates) differs from the continuous run, but shows nothing about
    the resume: counting it as "diverged" would pass the check on a run that did not train. Could not check."""
    out = tmp_path / "o"
    r = cli("check-resume", "--steps", "8", "--interrupt-at", "3", "--output", str(out), "--control", "data",
            "--json", "--", *template("epoch_cursor.py", "--short-on-odd-cursor"))
    assert r.returncode == 2, r.stdout + r.stderr
    report = _report(out)
    (e,) = report["negative_controls"]
    assert e["status"] == "could-not-check" and e["diverged"] is False and not report["all_checks_passed"]
    assert "recorded 2 updates" in e["message"] and report["positive"] is True
    assert report["negative_divergence_detected"] is False


# ------------------------------------------------------------------------------------------------
# Issue 25: messages that are wrong although the check passes
# ------------------------------------------------------------------------------------------------
def test_cursor_on_an_epoch_boundary_and_no_controls_get_wrong_messages(tmp_path):
    """Two wrong messages of one run. (1) A script that starts the next epoch right after the last batch saves
    cursor 0 of epoch 1 when interrupted exactly at the end of epoch 0: where the continuous run was. The report
    warned "data.cursor 0, but the continuous run had consumed 12 samples ... replays data" although the resume
    matched. (2) `--no-controls` on a checkpoint holding rng, optimizer, scheduler and data said "no negative
    control could run ... (the checkpoint holds none of rng/optimizer/scheduler/data)": none was asked for."""
    out = tmp_path / "b"
    r = cli("check-resume", "--steps", "8", "--interrupt-at", "6", "--output", str(out), "--no-controls",
            "--json", "--", *template("epoch_cursor.py", "--rollover-at-end"))
    assert r.returncode == 1, r.stderr
    report = _report(out)
    assert report["positive"] is True
    (it,) = report["interruptions"]
    assert (it["at"], it["cursor"], it["epoch"], it["expected_cursor"]) == (6, 0, 1, 0)
    assert not any("data.cursor" in w for w in report["warnings"]), report["warnings"]
    assert any("--no-controls" in p for p in report["problems"]), report["problems"]
    assert not any("holds none" in p for p in report["problems"]), report["problems"]


def test_controls_that_could_not_run_say_why_each_was_skipped():
    from ckpt_archive.resume.check import _verdict

    det = {"matched": True, "first_divergence": None}
    skipped = control_verdict(None, name="data-cursor", kind="tool", label="the data cursor", expected_no_effect=False,
                              applied=False, note="no data cursor ('data': {'cursor': int}) in the checkpoint")
    v = _verdict(det, {"matched": True}, True, [skipped], {"step": 3}, 3)
    (p,) = v["problems"]
    assert "data-cursor: not run: no data cursor" in p and "holds none" not in p
