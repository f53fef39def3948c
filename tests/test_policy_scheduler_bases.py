"""Issue 12 break test: `--policy session` and the config-vs-state check must know which config keys each
torch scheduler takes its LRs from, and must never treat schedule progress (warmup, decay, plateau
reductions) as a policy difference.

Faults guarded against (each found by a real run):
* CyclicLR: the run's own config {"lr", "max_lr"} made `--policy session` rewrite base_lrs/initial_lr from the
  optimizer constructor's lr (which CyclicLR overrides) and scale the current lr 10x; verify warned falsely.
* ReduceLROnPlateau: the run's own config made `--policy session` undo the plateau reductions (lr reset to
  the configured lr); verify warned that the state does not follow its config.

For every scheduler the audit supports: a few real steps, pack, restore with the run's own config (nothing
rewritten, the next LRs those of the uninterrupted run) and with a config whose LR keys are x10 (the next
real torch steps are those of a fresh run built with the session's values), and no config-vs-state warning.
"""
from __future__ import annotations

import io
import json
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as L

from ckpt_archive.training.completeness import config_disagreements
from ckpt_archive.training.restore import restore_training_state
from ckpt_archive.training.session import apply_session_policy, compare_with_session

from tests.helpers import cli_in_process

TRAINED, NEXT = 5, 4


def _rt(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _build(name, cfg):
    """The session's optimizer and scheduler, built from a config as a training script does."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(torch.nn.Linear(3, 1).parameters(), lr=cfg["lr"])
    return opt, SCHEDULERS[name][0](opt, cfg)


def _step(name, opt, sched, n):
    """n real training steps; the LR each one ran at."""
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            lrs.append(float(opt.param_groups[0]["lr"]))
            opt.step()
            sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()  # a plateau: no improvement
    return lrs


#: name -> (constructor from config, config of the run, the session's config with every LR key x10)
SCHEDULERS = {
    "StepLR": (lambda o, c: L.StepLR(o, 2, 0.5), {"lr": 1e-4}),
    "MultiStepLR": (lambda o, c: L.MultiStepLR(o, [2, 4], 0.5), {"lr": 1e-4}),
    "ExponentialLR": (lambda o, c: L.ExponentialLR(o, 0.9), {"lr": 1e-4}),
    "CosineAnnealingLR": (lambda o, c: L.CosineAnnealingLR(o, 10, eta_min=1e-6), {"lr": 1e-4}),
    "CosineAnnealingWarmRestarts": (lambda o, c: L.CosineAnnealingWarmRestarts(o, 3, 2, eta_min=1e-6), {"lr": 1e-4}),
    "LinearLR": (lambda o, c: L.LinearLR(o, 0.1, 1.0, 4), {"lr": 1e-4}),
    "ConstantLR": (lambda o, c: L.ConstantLR(o, 0.5, 3), {"lr": 1e-4}),
    "PolynomialLR": (lambda o, c: L.PolynomialLR(o, 8, 2.0), {"lr": 1e-4}),
    "LambdaLR": (lambda o, c: L.LambdaLR(o, lambda e: 0.9 ** e), {"lr": 1e-4}),
    "OneCycleLR": (lambda o, c: L.OneCycleLR(o, max_lr=c["max_lr"], total_steps=20, cycle_momentum=False),
                   {"lr": 1e-4, "max_lr": 1e-3}),
    "CyclicLR": (lambda o, c: L.CyclicLR(o, base_lr=c.get("base_lr", 1e-5), max_lr=c["max_lr"], step_size_up=4,
                                         cycle_momentum=False), {"lr": 1e-4, "max_lr": 1e-3}),
    "SequentialLR": (lambda o, c: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 3), L.CosineAnnealingLR(o, 10)], [3]),
                     {"lr": 1e-4}),
    "ChainedScheduler": (lambda o, c: L.ChainedScheduler([L.ConstantLR(o, 0.5, 3), L.ExponentialLR(o, 0.9)]),
                         {"lr": 1e-4}),
    "ReduceLROnPlateau": (lambda o, c: L.ReduceLROnPlateau(o, factor=0.5, patience=0), {"lr": 1e-4}),
}


def _x10(name):
    cfg = {k: v * 10 for k, v in SCHEDULERS[name][1].items()}
    if name == "CyclicLR":
        cfg["base_lr"] = 1e-4  # the run's base_lr (1e-5, given in code) x10: CyclicLR's own keys
    return cfg


def _archived(name):
    """TRAINED real steps of the run, checkpointed with its config inside; and the run continued NEXT steps."""
    cfg = SCHEDULERS[name][1]
    opt, sched = _build(name, cfg)
    _step(name, opt, sched, TRAINED)
    state = _rt({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "config": dict(cfg)})
    return state, _step(name, opt, sched, NEXT)


def _resume(name, cfg, state):
    """The session built from ``cfg`` loads the (rewritten) state and trains NEXT steps."""
    opt, sched = _build(name, cfg)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return _step(name, opt, sched, NEXT)


def _close(a, b):
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_policy_session_with_the_runs_own_config_rewrites_schedule_progress(name):
    """Fault: the run's own config rewrote CyclicLR's base_lrs and lr 10x / undid plateau reductions."""
    cfg = SCHEDULERS[name][1]
    state, uninterrupted = _archived(name)
    assert compare_with_session(state, session_config=cfg) == []
    new, changes = apply_session_policy(state, session_config=cfg)
    assert changes == [], [str(c) for c in changes]
    assert _resume(name, cfg, new) == uninterrupted
    # live restore into the session's objects built from the same config: the same
    opt, sched = _build(name, cfg)
    rep = restore_training_state(_rt(state), optimizer=opt, scheduler=sched, policy="session", rng=False)
    assert rep.changes == [], [str(c) for c in rep.changes]
    assert _step(name, opt, sched, NEXT) == uninterrupted


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_policy_session_with_a_10x_config_does_not_run_the_sessions_schedule(name):
    """Fault: a session config with different LR keys left part of the schedule archived (CyclicLR max_lrs,
    plateau reductions lost): the next real steps must be those of a fresh run built with the session's
    values and trained as long."""
    cfg10 = _x10(name)
    state, _ = _archived(name)
    new, changes = apply_session_policy(state, session_config=cfg10)
    assert changes, "a 10x session config rewrote nothing"
    opt, sched = _build(name, cfg10)
    _step(name, opt, sched, TRAINED)
    fresh = _step(name, opt, sched, NEXT)
    got = _resume(name, cfg10, new)
    assert _close(got, fresh), (got, fresh)
    # live restore (the session's objects built from the 10x config) runs the same schedule
    opt, sched = _build(name, cfg10)
    restore_training_state(_rt(state), optimizer=opt, scheduler=sched, policy="session", rng=False)
    got = _step(name, opt, sched, NEXT)
    assert _close(got, fresh), (got, fresh)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_config_vs_state_check_flags_a_valid_archived_state(name):
    """Fault: verify/inspect compared the config's lr with the current lr (a plateau-reduced LR, a warmup)
    or with the wrong key (CyclicLR's base from the constructor's lr) and warned on a valid state."""
    cfg = SCHEDULERS[name][1]
    state, _ = _archived(name)
    assert config_disagreements(state) == []
    assert config_disagreements({k: v for k, v in state.items() if k != "config"}, cfg) == []
    # ...while a state that really does not follow its config is still flagged
    wrong = _x10(name)
    assert config_disagreements({k: v for k, v in state.items() if k != "config"}, wrong), name


def test_plateau_policy_session_refuses_when_the_archived_base_is_unknown():
    """Without initial_lr or an archived config the number of reductions cannot be told: refuse, never guess."""
    from ckpt_archive.errors import UsageError

    state, _ = _archived("ReduceLROnPlateau")
    del state["config"]
    new, changes = apply_session_policy(state, session_config={"lr": 1e-4})  # its lr after whole reductions
    assert changes == []
    with pytest.raises(UsageError, match="keeps no base LR"):
        apply_session_policy(state, session_config={"lr": 3e-3})
    new, changes = apply_session_policy(state, session_config={"lr": 1e-3}, archived_config={"lr": 1e-4})
    assert any("keeping the reductions" in str(c) for c in changes)


def _cli(*args):
    return cli_in_process(*args)  # what the commands say; the process boundary is not what these tests are about


@pytest.mark.parametrize("name", ["CyclicLR", "ReduceLROnPlateau"])
def test_end_to_end_policy_session_silently_rewrites_cyclic_and_plateau_schedules(name, tmp_path):
    """The two break-test faults end to end: pack with --config, verify and inspect quiet, restore with the
    run's own config rewrites nothing, restore with a 10x config runs the session's schedule."""
    cfg = SCHEDULERS[name][1]
    state, uninterrupted = _archived(name)
    del state["config"]
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    cfg_file, cfg10_file = tmp_path / "cfg.json", tmp_path / "cfg10.json"
    cfg_file.write_text(json.dumps(cfg))
    cfg10_file.write_text(json.dumps(_x10(name)))
    repo = tmp_path / "repo"
    assert _cli("pack", str(src), "--repo", str(repo), "--config", str(cfg_file)).returncode == 0
    for cmd in ("verify", "inspect"):
        r = _cli(cmd, str(repo), "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "config says" not in r.stdout and "do not follow the config" not in r.stdout, r.stdout
    r = _cli("restore", str(repo), "-o", str(tmp_path / "same.pt"), "--session-config", str(cfg_file),
             "--policy", "session")
    assert r.returncode == 0, r.stderr
    assert "nothing rewritten" in r.stdout
    assert _resume(name, cfg, torch.load(tmp_path / "same.pt", weights_only=True)) == uninterrupted
    r = _cli("restore", str(repo), "-o", str(tmp_path / "x10.pt"), "--session-config", str(cfg10_file),
             "--policy", "session")
    assert r.returncode == 0, r.stderr
    opt, sched = _build(name, _x10(name))
    _step(name, opt, sched, TRAINED)
    fresh = _step(name, opt, sched, NEXT)
    got = _resume(name, _x10(name), torch.load(tmp_path / "x10.pt", weights_only=True))
    assert _close(got, fresh), (got, fresh)
    if name == "ReduceLROnPlateau":
        assert "keeping the reductions" in r.stdout


def test_policy_session_with_the_packed_config_re_saved_the_file_although_nothing_was_rewritten(tmp_path):
    """`restore --session-config SAME --policy session` said 'nothing rewritten' but re-saved the .pt with
    torch.save, so its sha256 no longer matched the packed file: with nothing to impose, restore exactly."""
    import json as _json

    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        opt.step()
        sch.step()
    src = tmp_path / "ck.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sch.state_dict()}, src)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(_json.dumps({"lr": 0.1}))
    run = CliRunner().invoke
    assert run(app, ["pack", str(src), "--repo", str(tmp_path / "r"), "--config", str(cfg)]).exit_code == 0
    res = run(app, ["restore", str(tmp_path / "r"), "-o", str(tmp_path / "o.pt"), "--session-config", str(cfg),
                    "--policy", "session"])
    assert res.exit_code == 0, res.stderr
    assert "nothing rewritten" in res.stdout
    assert (tmp_path / "o.pt").read_bytes() == src.read_bytes()


def _seq(lr):
    p = torch.nn.Parameter(torch.zeros(1))
    o = torch.optim.AdamW([p], lr=lr)
    return o, L.SequentialLR(o, [L.LinearLR(o, 0.1, total_iters=3), L.CosineAnnealingLR(o, 20, eta_min=1e-7)], [3])


def _seq_run(lr, n):
    o, s = _seq(lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            o.step()
            s.step()
    return o, s


def _next_after_step(o, s):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o.step()
        s.step()
    return o.param_groups[0]["lr"]


def test_sequential_sub_scheduler_stale_base_lrs_are_reported_and_rewritten():
    """D2: SequentialLR sub-scheduler base_lrs (1e-6, from an older run) were reported by the comparison but
    not rewritten by --policy session ("nothing rewritten"), and a scheduler-only SequentialLR state was neither
    reported nor rewritten; restore_training_state(policy="session") then ran the next scheduler.step() at
    9.70e-06 where a consistent 1e-4 run is at 9.46e-05. Real torch schedulers: the next LR must match."""
    want = _next_after_step(*_seq_run(1e-4, 5))
    # full state whose sub-scheduler bases are stale
    o, s = _seq_run(1e-4, 5)
    sd = s.state_dict()
    for sub in sd["_schedulers"]:
        sub["base_lrs"] = [1e-6]
    full = _rt({"optimizer": o.state_dict(), "scheduler": sd})
    diffs = {d.field for d in compare_with_session(full, session_config={"lr": 1e-4})}
    new, changes = apply_session_policy(full, lr=1e-4)
    assert diffs and diffs <= {c.field for c in changes}
    o2, s2 = _seq(1e-4)
    o2.load_state_dict(new["optimizer"])
    s2.load_state_dict(new["scheduler"])
    assert math.isclose(_next_after_step(o2, s2), want, rel_tol=1e-9)
    o3, s3 = _seq(1e-4)
    restore_training_state(_rt(full), optimizer=o3, scheduler=s3, policy="session", rng=False)
    assert math.isclose(_next_after_step(o3, s3), want, rel_tol=1e-9)
    # scheduler-only state trained at 1e-6
    o, s = _seq_run(1e-6, 5)
    only = _rt({"scheduler": s.state_dict(), "step": 5})
    diffs = {d.field for d in compare_with_session(only, session_config={"lr": 1e-4})}
    assert "scheduler._schedulers[1].base_lrs[0]" in diffs
    new, changes = apply_session_policy(only, lr=1e-4)
    assert diffs <= {c.field for c in changes}
    assert [x["base_lrs"] for x in new["scheduler"]["_schedulers"]] == [[1e-4], [1e-4]]
    from ckpt_archive.training.audit import audit
    assert audit(only).groups[0].base_lr == 1e-6  # inspect shows the sub-scheduler's base, not "-"
    o4, s4 = _seq(1e-4)
    rep = restore_training_state(_rt(only), optimizer=o4, scheduler=s4, policy="session", rng=False)
    assert math.isclose(_next_after_step(o4, s4), want, rel_tol=1e-9)
    assert rep.changes


def test_scheduler_only_stale_base_lrs_warn_under_policy_checkpoint(caplog):
    """D4: restore_training_state of a scheduler-only state (LambdaLR, base_lrs 1e-6) into a session built at
    1e-4, policy "checkpoint": report.warnings and the log held only "moments restart"; the stale base_lrs
    (next scheduler.step() at 7e-07 instead of 7e-05) was only in report.audit. It must warn, as the CLI does;
    a consistent session must not."""
    def mk(lr):
        p = torch.nn.Parameter(torch.zeros(1))
        o = torch.optim.AdamW([p], lr=lr)
        return o, L.LambdaLR(o, lambda e: min(1.0, (e + 1) / 10))

    o, s = mk(1e-6)
    for _ in range(5):
        o.step()
        s.step()
    state = _rt({"model": {}, "scheduler": s.state_dict(), "step": 5})
    o2, s2 = mk(1e-4)
    with caplog.at_level("WARNING", logger="ckpt_archive.training.policy"):
        rep = restore_training_state(state, optimizer=o2, scheduler=s2, rng=False)
    stale = [w for w in rep.warnings if "scheduler.base_lrs[0]" in w]
    assert stale and "1e-06" in stale[0] and "0.0001" in stale[0]
    assert any("scheduler.base_lrs[0]" in r.getMessage() for r in caplog.records)
    o3, s3 = mk(1e-6)
    rep = restore_training_state(_rt({"scheduler": s.state_dict(), "step": 5}), optimizer=o3, scheduler=s3, rng=False)
    assert not [w for w in rep.warnings if "base_lrs" in w]
