"""Break-test faults in the session policy: an archived policy must never silently override the session's,
and a correct resume must not raise a false alarm. Real torch schedulers, tiny models.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.optim import lr_scheduler as L

import ckpt_archive
from ckpt_archive.training.restore import restore_training_state


def _rt(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _cli(*args):
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


# --- ReduceLROnPlateau under policy="session" ----------------------------------------------------------------

def _plateau(lr, steps=6, **kw):
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)
    o = torch.optim.AdamW(m.parameters(), lr=lr)
    s = L.ReduceLROnPlateau(o, patience=0, **kw)
    for _ in range(steps):
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        o.zero_grad()
        s.step(1.0)
    return m, o, s


@pytest.mark.parametrize("lr,kw", [(1e-3, {"factor": 0.5}), (1e-3, {"factor": 0.1}),
                                   (1e-3, {"factor": 0.5, "min_lr": 3e-4}), (0.3, {"factor": 0.7}),
                                   (1e-4, {"factor": 0.1, "eps": 0})])
def test_plateau_session_resume_with_the_same_lr_is_not_refused(lr, kw):
    """Fault: restore_training_state(policy="session") raised UsageError on every ReduceLROnPlateau run once its
    LR was reduced ("0.00025 is not the session's lr 0.001 after whole reductions", though 0.00025 = 1e-3 *
    0.5**2): the scheduler's factor and min_lrs were not passed to the check. The same session restores as
    saved, reductions kept."""
    m, o, s = _plateau(lr, **kw)
    st = _rt({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": s.state_dict()})
    archived_lr = o.param_groups[0]["lr"]
    assert archived_lr < lr
    before = copy.deepcopy(st["scheduler"])
    m2, o2, s2 = _plateau(lr, steps=0, **kw)
    rep = restore_training_state(st, model=m2, optimizer=o2, scheduler=s2, policy="session", rng=False)
    assert rep.next_lrs == [archived_lr]
    assert rep.changes == []
    assert st["scheduler"] == before  # the dry run did not touch the archived state


def test_checkpointer_restore_of_a_reduced_plateau_run(tmp_path):
    """Fault: Checkpointer.restore() (policy "session" by default) refused every ReduceLROnPlateau run after its
    first reduction, so a loop could not resume from its own checkpoints."""
    m, o, s = _plateau(1e-3, steps=3, factor=0.5)
    with ckpt_archive.Checkpointer(tmp_path / "repo") as ck:
        ck.save(2, {"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": s.state_dict()}, block=True)
    m2, o2, s2 = _plateau(1e-3, steps=0, factor=0.5)
    with ckpt_archive.Checkpointer(tmp_path / "repo") as ck:
        r = ck.restore(model=m2, optimizer=o2, scheduler=s2, rng=False)
    assert r.step == 2
    assert r.report.next_lrs == [o.param_groups[0]["lr"]] == [2.5e-4]


# --- scheduler base_lrs from an older run next to a fresh optimizer --------------------------------------------

def _warmup(lr, steps=2):
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)
    o = torch.optim.AdamW(m.parameters(), lr=lr)
    s = L.LambdaLR(o, lambda e: min(1.0, (e + 1) / 5))
    for _ in range(steps):
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        s.step()
    return m, o, s


def _founding_state():
    """The founding story: optimizer built with 1e-4, scheduler state from an older run (base_lrs 1e-6)."""
    m, o, s = _warmup(1e-4)
    sd = s.state_dict()
    sd["base_lrs"] = [1e-6]
    return _rt({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": sd})


def _lr_after_next_scheduler_step(state):
    m, o, s = _warmup(1e-4, steps=0)
    m.load_state_dict(state["model"])
    o.load_state_dict(state["optimizer"])
    s.load_state_dict(state["scheduler"])
    m(torch.ones(1, 2)).sum().backward()
    o.step()
    s.step()
    return o.param_groups[0]["lr"]


def test_session_config_reports_and_rewrites_archived_scheduler_base_lrs(tmp_path):
    """Fault: with initial_lr 1e-4 (= the session's optimizer.lr) but scheduler.base_lrs [1e-6] from an older
    run, `restore --session-config --policy session` said "nothing rewritten" and kept base_lrs 1e-6, so the
    next scheduler.step() went 6e-5 -> 8e-7; without --policy no warning either (only initial_lr was compared).
    Now scheduler.base_lrs[0] is a difference, and --policy session rewrites it: the resumed run steps to 8e-5."""
    state = _founding_state()
    assert _lr_after_next_scheduler_step(state) == pytest.approx(8e-7)
    src, cfg, repo = tmp_path / "s.pt", tmp_path / "sess.yaml", tmp_path / "repo"
    torch.save(state, src)
    cfg.write_text("optimizer:\n  lr: 1.0e-4\n")
    assert _cli("pack", src, "--repo", repo).exit_code == 0
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "a.pt", "--session-config", cfg)
    assert r.exit_code == 0, r.stderr
    assert "scheduler.base_lrs[0]: archived 1e-06, session 0.0001" in r.stderr
    assert "scheduler.load_state_dict restores it" in r.stderr
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "b.pt", "--session-config", cfg, "--policy", "session")
    assert r.exit_code == 0, r.stderr
    assert "nothing rewritten" not in r.stderr
    out = torch.load(tmp_path / "b.pt", weights_only=True)
    assert out["scheduler"]["base_lrs"] == [1e-4]
    assert out["optimizer"]["param_groups"][0]["lr"] == state["optimizer"]["param_groups"][0]["lr"]
    assert _lr_after_next_scheduler_step(out) == pytest.approx(8e-5)


def test_session_config_equal_to_a_consistent_state_says_nothing():
    """Guard against crying wolf: a consistent warmup state (base_lrs == initial_lr == config lr) and the
    same config give no difference and rewrite nothing."""
    from ckpt_archive.training.session import apply_session_policy, compare_with_session

    m, o, s = _warmup(1e-4)
    state = _rt({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": s.state_dict()})
    assert compare_with_session(state, session_config={"optimizer": {"lr": 1e-4}}) == []
    assert apply_session_policy(state, session_config={"optimizer": {"lr": 1e-4}})[1] == []


# --- several param groups with different LRs and a single config lr -------------------------------------------

def _two_groups(steps=3):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    o = torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[1].parameters(), "lr": 5e-5}], lr=1e-4)
    s = L.CosineAnnealingLR(o, T_max=10)
    for _ in range(steps):
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        s.step()
    return m, o, s


def test_single_config_lr_with_a_head_group_at_another_lr_is_a_no_op_for_the_same_config(tmp_path):
    """Fault: group 0 at 1e-4, a head group 1 at 5e-5, the run's config `optimizer.lr: 1e-4`: inspect warned
    "config says 1e-4 but the state holds 5e-05" for group 1, and `restore --session-config run.yaml --policy
    session` rewrote group 1 to 1e-4 (the very config the run was trained with must be a no-op). The rule: one
    lr sets the reference base (the archived config's lr, else group 0's) and every group keeps its ratio."""
    m, o, s = _two_groups()
    src, cfg, repo = tmp_path / "mg.pt", tmp_path / "run.yaml", tmp_path / "repo"
    torch.save({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": s.state_dict()}, src)
    cfg.write_text("optimizer:\n  lr: 1.0e-4\n")
    assert _cli("pack", src, "--repo", repo, "--config", cfg).exit_code == 0
    r = _cli("inspect", f"{repo}@latest")
    assert r.exit_code == 0
    assert "but the state holds" not in r.stderr, r.stderr
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "o.pt", "--session-config", cfg, "--policy", "session")
    assert r.exit_code == 0, r.stderr
    assert "nothing rewritten" in r.stdout
    assert (tmp_path / "o.pt").read_bytes() == src.read_bytes()


def test_single_session_lr_keeps_every_groups_ratio_in_library_and_cli_alike():
    """Fault: apply_session_policy with a scalar lr collapsed every group to one base (head 5e-5 -> the body's
    LR). Now a new scalar moves the reference and every group keeps its ratio, said in the difference;
    restore_training_state(session_lr=) follows the same rule."""
    from ckpt_archive.training.session import apply_session_policy, compare_with_session

    m, o, s = _two_groups()
    state = _rt({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": s.state_dict()})
    assert apply_session_policy(state, lr=1e-4)[1] == []
    assert apply_session_policy(state, session_config={"lr": 1e-4})[1] == []
    new, changes = apply_session_policy(state, session_config={"optimizer": {"lr": 1e-3}})
    assert [g["initial_lr"] for g in new["optimizer"]["param_groups"]] == pytest.approx([1e-3, 5e-4])
    assert new["scheduler"]["base_lrs"] == pytest.approx([1e-3, 5e-4])
    diffs = compare_with_session(state, session_config={"optimizer": {"lr": 1e-3}})
    assert [d.session for d in diffs] == pytest.approx([1e-3, 5e-4])
    assert all("keeps its ratio" in d.message and "param_groups: [{lr" in d.message for d in diffs)
    # per-group LRs set each group
    new, _ = apply_session_policy(state, session_config={"optimizer": {"param_groups": [{"lr": 1e-3}, {"lr": 1e-3}]}})
    assert [g["initial_lr"] for g in new["optimizer"]["param_groups"]] == pytest.approx([1e-3, 1e-3])
    m2, o2, s2 = _two_groups(steps=0)
    rep = restore_training_state(state, model=m2, optimizer=o2, scheduler=s2, policy="session", session_lr=1e-4,
                                 rng=False)
    assert rep.changes == []
    assert rep.next_lrs == [g["lr"] for g in o.param_groups]


# --- --expect-lr ------------------------------------------------------------------------------------------------

def test_expect_lr_warns_on_a_scheduler_only_state_whose_base_lrs_take_over(tmp_path):
    """Fault: `restore --expect-lr 1e-4` on a state with only a scheduler (base_lrs 1e-6, no optimizer) printed
    no warning and `differences: []`, although the next scheduler.step() sets the LR to ~1e-6's schedule
    whatever the session's. Now compared with the archived _last_lr; a matching value stays quiet."""
    import json

    m, o, s = _warmup(1e-6)
    src, repo = tmp_path / "s3.pt", tmp_path / "repo"
    torch.save({"model": m.state_dict(), "scheduler": s.state_dict()}, src)
    assert _cli("pack", src, "--repo", repo).exit_code == 0
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "x.pt", "--expect-lr", "1e-4", "--json")
    assert r.exit_code == 0, r.stdout
    diffs = json.loads(r.stdout)["policy"]["differences"]
    assert [d["field"] for d in diffs] == ["scheduler._last_lr[0]"]
    assert "whatever the session's LR" in diffs[0]["message"]
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "y.pt", "--expect-lr", str(s.get_last_lr()[0]), "--json")
    assert json.loads(r.stdout)["policy"]["differences"] == []


def test_expect_lr_accepts_inspects_printed_precision_and_means_group_0(tmp_path):
    """Faults: `--expect-lr 7.938926e-05` (copied from inspect's 7 significant digits) warned "archived
    7.938926261462366e-05, session 7.938926e-05" (tolerance 1e-9); and a single --expect-lr always warned for a
    head group at another LR. Now rtol 1e-6 (said in --help), one value means group 0, a list one per group."""
    import json

    m, o, s = _two_groups()
    src, repo = tmp_path / "mg.pt", tmp_path / "repo"
    torch.save({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": s.state_dict()}, src)
    assert _cli("pack", src, "--repo", repo).exit_code == 0
    lr0, lr1 = (g["lr"] for g in o.param_groups)
    assert f"{lr0:.7g}" == "7.938926e-05" and float(f"{lr0:.7g}") != lr0

    def diffs(arg):
        r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "o.pt", "--force", "--expect-lr", arg, "--json")
        assert r.exit_code == 0, r.stdout
        return [d["field"] for d in json.loads(r.stdout)["policy"]["differences"]]

    assert diffs(f"{lr0:.7g}") == []
    assert diffs(f"{lr0:.7g},{lr1:.7g}") == []
    assert diffs(f"{lr0:.7g},{lr0:.7g}") == ["optimizer.param_groups[1].lr"]
    assert diffs("7.9e-05") == ["optimizer.param_groups[0].lr"]
    assert _cli("restore", f"{repo}@latest", "-o", tmp_path / "p.pt", "--expect-lr", "1e-4,x").exit_code == 2
    r = _cli("restore", "--help")
    assert "1e-6" in r.stdout


def test_after_sched_step_estimate_of_a_lambda_lr_with_a_foreign_base_lrs():
    """Fault: inspect's after_sched_step showed 6e-05 for the founding state (LambdaLR, initial_lr 1e-4,
    base_lrs [1e-6] from an older run) where real torch gives 8e-07: the lambda factor was guessed as
    _last_lr / base_lrs = 60. Now the group's lr / initial_lr (0.6) is used where they disagree, and said."""
    from ckpt_archive.training.audit import audit

    state = _founding_state()
    real = _lr_after_next_scheduler_step(state)
    gp = audit(state).groups[0]
    assert gp.after_step_lr == pytest.approx(6e-7)  # 1e-6 * 0.6: the constant-factor guess, same order as real
    assert real / 2 < gp.after_step_lr < real * 2
    assert "lr / initial_lr" in gp.after_step_basis
    m, o, s = _warmup(1e-4)  # a consistent state keeps the old estimate (= _last_lr)
    gp = audit(_rt({"optimizer": o.state_dict(), "scheduler": s.state_dict()})).groups[0]
    assert gp.after_step_lr == pytest.approx(s.get_last_lr()[0])
    assert "(_last_lr / base_lrs)" in gp.after_step_basis
