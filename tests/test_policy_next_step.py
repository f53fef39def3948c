"""Issue 12: the policy audit models what a real resumed run does at the next optimizer step and the next
scheduler.step(), for every optimizer/scheduler pair and for scheduler-only states; the session policy;
the severity model and what the completeness lint could not see.

Each fault that is about what a run does is checked against a real torch run on CPU.
"""
from __future__ import annotations

import copy
import io
import json
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as L

import ckpt_archive
from ckpt_archive.training.audit import audit
from ckpt_archive.training.completeness import lint_completeness, policy_section
from ckpt_archive.training.restore import restore_training_state
from ckpt_archive.training.session import apply_session_policy, compare_with_session

from tests.helpers import cli_in_process


def _rt(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _train(opt, sched, n, plateau=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            opt.step()
            sched.step(1.0) if plateau else sched.step()


def _cli(*args):
    return cli_in_process(*args)  # what the commands say; the process boundary is not what these tests are about


# ---- the next optimizer step and the next scheduler.step(), checked against real torch ----------------
SCHEDULERS = {
    "StepLR": (lambda o: L.StepLR(o, 3, 0.5), {}),
    "OneCycleLR": (lambda o: L.OneCycleLR(o, max_lr=0.5, total_steps=20), {"momentum": 0.9}),
    "CyclicLR": (lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=4), {"momentum": 0.9}),
    "ChainedScheduler": (lambda o: L.ChainedScheduler([L.ConstantLR(o, 0.5, 9), L.ExponentialLR(o, 0.9)]), {}),
    "SequentialLR": (lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 4), L.CosineAnnealingLR(o, 10)], [4]), {}),
    "ReduceLROnPlateau": (lambda o: L.ReduceLROnPlateau(o, patience=1), {}),
    "LambdaLR-constant": (lambda o: L.LambdaLR(o, lambda e: 0.3), {}),
    "CosineAnnealingWarmRestarts": (lambda o: L.CosineAnnealingWarmRestarts(o, 4, 2), {}),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_audit_reports_an_lr_that_the_real_run_does_not_use(name):
    make, kw = SCHEDULERS[name]
    plateau = name == "ReduceLROnPlateau"
    opt = torch.optim.SGD(_net().parameters(), lr=0.1, **kw)
    sched = make(opt)
    _train(opt, sched, 7, plateau)
    state = _rt({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
    a = audit(state)
    # the real run: the next optimizer step, then the next scheduler.step() (a plateau: no improvement)
    real_now = opt.param_groups[0]["lr"]
    _train(opt, sched, 1, plateau) if not plateau else sched.step(float("inf"))
    real_after = opt.param_groups[0]["lr"]
    g = a.groups[0]
    assert g.next_lr == real_now
    assert g.after_step_lr is not None and math.isclose(g.after_step_lr, real_after, rel_tol=1e-12), g.after_step_basis
    if name == "LambdaLR-constant":
        assert "guess" in g.after_step_basis  # the lambda is code: a constant factor is assumed and said so


def test_scheduler_only_state_silently_switches_to_the_archived_base_lrs():
    """A script that restores only the scheduler: the next step runs at the session's LR, then
    scheduler.step() switches to the archived base_lrs. The audit must say so and name scheduler.base_lrs."""
    opt = torch.optim.SGD(_net().parameters(), lr=1e-3)
    sched = L.CosineAnnealingWarmRestarts(opt, T_0=10)
    _train(opt, sched, 4)
    state = _rt({"scheduler": sched.state_dict(), "progress": {"step": 4}})

    # the real resumed session: lr 1e-5 in its config, builds its scheduler, restores only the scheduler
    s_opt = torch.optim.SGD(_net().parameters(), lr=1e-5)
    s_sched = L.CosineAnnealingWarmRestarts(s_opt, T_0=10)
    s_sched.load_state_dict(copy.deepcopy(state["scheduler"]))
    first = s_opt.param_groups[0]["lr"]
    _train(s_opt, s_sched, 1)
    after = s_opt.param_groups[0]["lr"]
    assert first == 1e-5 and after > 1e-4  # the silent switch

    a = audit(state)
    (f,) = [f for f in a.findings if f.field == "scheduler.base_lrs"]
    assert f.severity == "warning" and "session's LR" in f.message and "0.001" in f.message
    assert a.groups[0].next_lr is None  # not the scheduler's _last_lr: the session's LR runs next
    assert math.isclose(a.groups[0].after_step_lr, after, rel_tol=1e-12)
    assert any(o.field == "scheduler.base_lrs[0]" and o.when == "at the next scheduler.step()" for o in a.overrides)
    (d,) = compare_with_session(state, session_config={"lr": 1e-5})
    assert d.field == "scheduler.base_lrs[0]" and d.archived == 1e-3 and d.session == 1e-5
    assert d.when == "at the next scheduler.step()"


def test_policy_session_on_a_scheduler_only_state_keeps_the_old_base_lrs():
    opt = torch.optim.SGD(_net().parameters(), lr=1e-3)
    sched = L.LambdaLR(opt, lambda e: 1.0)
    _train(opt, sched, 3)
    state = _rt({"scheduler": sched.state_dict()})
    new, changes = apply_session_policy(state, session_config={"optimizer": {"lr": 1e-5}})
    assert new["scheduler"]["base_lrs"] == [1e-5] and "scheduler.base_lrs[0]" in {c.field for c in changes}
    # live: the session's optimizer and scheduler, policy session; the LR after the next scheduler.step()
    s_opt = torch.optim.SGD(_net().parameters(), lr=1e-5)
    s_sched = L.LambdaLR(s_opt, lambda e: 1.0)
    rep = restore_training_state(copy.deepcopy(state), optimizer=s_opt, scheduler=s_sched, policy="session")
    assert rep.changes
    _train(s_opt, s_sched, 1)
    assert s_opt.param_groups[0]["lr"] == 1e-5


def _one_cycle_state(cfg):
    opt = torch.optim.SGD(_net().parameters(), lr=cfg["optimizer"]["lr"], momentum=0.9)
    sched = L.OneCycleLR(opt, max_lr=cfg["scheduler"]["max_lr"], total_steps=100)
    _train(opt, sched, 10)
    return _rt({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "config": cfg})


def test_policy_session_with_the_training_config_rescales_one_cycle_10x():
    cfg = {"optimizer": {"lr": 1e-3}, "scheduler": {"max_lr": 1e-2}}
    state = _one_cycle_state(cfg)
    assert compare_with_session(state, session_config=cfg) == []
    new, changes = apply_session_policy(state, session_config=cfg)
    assert changes == []
    assert new["optimizer"]["param_groups"][0]["max_lr"] == 1e-2
    assert new["optimizer"]["param_groups"][0]["lr"] == state["optimizer"]["param_groups"][0]["lr"]
    # live, with the session built from the same config
    opt = torch.optim.SGD(_net().parameters(), lr=1e-3, momentum=0.9)
    sched = L.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    rep = restore_training_state(copy.deepcopy(state), optimizer=opt, scheduler=sched, policy="session")
    assert rep.changes == [] and rep.next_lrs == [state["optimizer"]["param_groups"][0]["lr"]]
    # a session that really changes max_lr rescales the schedule from max_lr, not from the constructor's lr
    new, changes = apply_session_policy(state, session_config={"optimizer": {"lr": 1e-3},
                                                               "scheduler": {"max_lr": 2e-2}})
    g = new["optimizer"]["param_groups"][0]
    assert g["max_lr"] == 2e-2 and math.isclose(g["lr"], 2 * state["optimizer"]["param_groups"][0]["lr"],
                                                 rel_tol=1e-9)


def test_only_the_first_of_two_optimizers_and_schedulers_is_audited():
    """Accelerate's optimizer.bin/optimizer_1.bin and scheduler.bin/scheduler_1.bin: every pair."""
    o0 = torch.optim.SGD(_net().parameters(), lr=0.1)
    o1 = torch.optim.Adam(_net().parameters(), lr=0.01)
    s0, s1 = L.StepLR(o0, 2, 0.5), L.CosineAnnealingLR(o1, 20)
    for _ in range(5):
        _train(o0, s0, 1)
        _train(o1, s1, 1)
    state = _rt({"scheduler_1.bin": s1.state_dict(), "optimizer.bin": o0.state_dict(),
                 "optimizer_1.bin": o1.state_dict(), "scheduler.bin": s0.state_dict()})
    a = audit(state)
    assert [g.field for g in a.groups] == ['["optimizer.bin"].param_groups[0]', '["optimizer_1.bin"].param_groups[0]']
    assert len(a.schedulers) == 2 and a.schedulers[1]["kind"] == "CosineAnnealingLR"
    want = []
    for o, s in ((o0, s0), (o1, s1)):
        _train(o, s, 1)
        want.append(o.param_groups[0]["lr"])
    assert [g.after_step_lr for g in a.groups] == pytest.approx(want, rel=1e-12)
    assert any('["scheduler_1.bin"].base_lrs[0]' == o.field for o in a.overrides)


def test_folder_with_two_epoch_files_reports_the_older_schedulers_counters():
    def epoch_file(n):
        opt = torch.optim.SGD(_net().parameters(), lr=0.1)
        sched = L.StepLR(opt, 1, 0.9)
        _train(opt, sched, n)
        return {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": n}

    for order in (("epoch_9.pt", "epoch_10.pt"), ("epoch_10.pt", "epoch_9.pt")):
        files = {"epoch_9.pt": epoch_file(9), "epoch_10.pt": epoch_file(10)}
        a = audit(_rt({k: files[k] for k in order}))
        assert a.counters["scheduler_last_epoch"] == 10 and a.counters["progress_epoch"] == 10
        assert any("audited the newest, epoch_10.pt" in n for n in a.notes)


def test_archived_config_lr_disagreeing_with_initial_lr_is_not_flagged(tmp_path):
    opt = torch.optim.AdamW(_net().parameters(), lr=1e-6)
    sched = L.CosineAnnealingLR(opt, 50)
    _train(opt, sched, 3)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "config": {"lr": 1e-4}}
    a, _, _ = policy_section(_rt(state), {"progress": {}, "config": {}})
    (f,) = [f for f in a.findings if f.field == "optimizer.param_groups[0].initial_lr"]
    assert "lr = 0.0001" in f.message and "1e-06" in f.message
    # packed with --config instead of inside the state: verify flags it too (a warning, exit 0)
    del state["config"]
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"optimizer": {"lr": 1e-4}}))
    repo = tmp_path / "repo"
    assert _cli("pack", str(src), "--repo", str(repo), "--config", str(cfg)).returncode == 0
    r = _cli("verify", str(repo), "--json")
    assert r.returncode == 0, r.stderr
    assert any("optimizer.lr = 0.0001" in w and "1e-06" in w for w in json.loads(r.stdout)["warnings"])


def test_verify_fails_the_final_checkpoint_of_a_finished_one_cycle_run(tmp_path):
    opt = torch.optim.SGD(_net().parameters(), lr=1e-3, momentum=0.9)
    sched = L.OneCycleLR(opt, 1e-2, total_steps=6)
    _train(opt, sched, 6)
    src = tmp_path / "final.pt"
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": 6}, src)
    repo = tmp_path / "repo"
    assert _cli("pack", str(src), "--repo", str(repo)).returncode == 0
    r = _cli("verify", str(repo), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and any("schedule is finished" in w and "ValueError" in w for w in doc["warnings"])


def test_strict_lint_asserts_missing_optimizer_that_is_inside_an_opaque_file():
    state = {"model": {"w": torch.ones(2)}, "rng_state": {"python": 1, "numpy": 2, "torch": 3}, "step": 4}
    found = lint_completeness(state, unseen=["optimizer.pt", "training_args.bin"])
    (f,) = [f for f in found if f.field == "optimizer"]
    assert f.severity == "info" and "optimizer state is inside an opaque file (optimizer.pt)" in f.message
    assert not f.message.startswith("not bitwise-resumable")
    dcp = lint_completeness({"progress": {"step": 3}}, dcp=True)
    assert all(f.severity == "info" for f in dcp if f.field in ("optimizer", "rng"))
    assert any("distributed.checkpoint" in f.message for f in dcp if f.field == "optimizer")


def test_data_order_guess_is_phrased_as_a_fact_for_scripts_with_step_and_epoch():
    (f,) = [f for f in lint_completeness({"model": {"w": torch.ones(1)}, "step": 40, "epoch": 2})
            if f.field == "data"]
    assert f.severity == "info" and "if the script derives" in f.message and "probably" in f.message
    (g,) = [f for f in lint_completeness({"model": {"w": torch.ones(1)}}) if f.field == "data"]
    assert g.severity == "warning" and "probably" in g.message


def test_verify_strict_fails_on_what_it_could_not_see(tmp_path):
    """--strict fails on missing parts, never on what the lint could not see or only guesses."""
    src = tmp_path / "c.pt"
    torch.save({"model": {"w": torch.ones(1)}, "step": 3, "epoch": 1,
                "rng": {"python": 1, "numpy": 2, "torch": torch.get_rng_state()},
                "optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1, momentum=0.9).state_dict()},
               src)
    repo = tmp_path / "repo"
    assert _cli("pack", str(src), "--repo", str(repo)).returncode == 0
    r = _cli("verify", str(repo), "--strict", "--json")
    doc = json.loads(r.stdout)
    assert not any("data" == p.get("field") for p in doc["problems"]), doc["problems"]
    assert any(w.startswith("completeness (info): data:") for w in doc["warnings"])


def test_audit_names_every_overriding_field_and_when_it_takes_effect():
    opt = torch.optim.Adam(_net().parameters(), lr=1e-3)
    sched = L.CosineAnnealingLR(opt, 100)
    _train(opt, sched, 5)
    a = audit(_rt({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}))
    got = {o.field: o.when for o in a.overrides}
    # issue 25: when a field takes effect comes from real torch; the recursive CosineAnnealingLR computes the next
    # steps from the group's lr, so its base_lrs do not take effect at the next scheduler.step() (a LambdaLR's do)
    assert got == {"optimizer.param_groups[0].lr": "now",
                   "optimizer.param_groups[0].initial_lr": "when a scheduler is built on this optimizer",
                   "scheduler.base_lrs[0]": "at a later scheduler.step() (torch's scheduler arithmetic: CosineAnnealingLR computes the "
                                            "next 3 steps from the group's current lr)"}
    lam = torch.optim.Adam(_net().parameters(), lr=1e-3)
    lam_s = L.LambdaLR(lam, lambda e: 0.9 ** e)
    _train(lam, lam_s, 5)
    a = audit(_rt({"optimizer": lam.state_dict(), "scheduler": lam_s.state_dict()}))
    assert {o.field: o.when for o in a.overrides}["scheduler.base_lrs[0]"] == "at the next scheduler.step()"
    d = compare_with_session(_rt({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}),
                             session_config={"lr": 1e-5})
    assert [(x.field, x.archived, x.session) for x in d] == [("optimizer.param_groups[0].initial_lr", 1e-3, 1e-5)]
    assert "takes effect" in d[0].message


def test_cli_policy_session_refuses_a_scheduler_only_state(tmp_path):
    """`restore --session-config --policy session` used to exit 2 ("no optimizer state: no policy to rewrite")
    and `restore --session-config` printed nothing for a state holding only the scheduler."""
    opt = torch.optim.SGD(_net().parameters(), lr=1e-3)
    sched = L.LambdaLR(opt, lambda e: 1.0)
    _train(opt, sched, 2)
    src = tmp_path / "sched_only.pt"
    torch.save({"model": _net().state_dict(), "scheduler": sched.state_dict(), "step": 2}, src)
    repo = tmp_path / "repo"
    assert _cli("pack", str(src), "--repo", str(repo)).returncode == 0
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"lr": 1e-5}))
    r = _cli("restore", str(repo), "-o", str(tmp_path / "a.pt"), "--session-config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "scheduler.base_lrs[0]: archived 0.001, session 1e-05" in r.stderr
    assert "at the next scheduler.step()" in r.stderr
    r = _cli("restore", str(repo), "-o", str(tmp_path / "b.pt"), "--session-config", str(cfg), "--policy", "session")
    assert r.returncode == 0, r.stderr
    restored = torch.load(tmp_path / "b.pt", weights_only=True)
    assert restored["scheduler"]["base_lrs"] == [1e-5]
    # the resumed session trains at 1e-5 after its next scheduler.step(), not at the archived 1e-3
    s_opt = torch.optim.SGD(_net().parameters(), lr=1e-5)
    s_sched = L.LambdaLR(s_opt, lambda e: 1.0)
    s_sched.load_state_dict(restored["scheduler"])
    _train(s_opt, s_sched, 1)
    assert s_opt.param_groups[0]["lr"] == 1e-5
