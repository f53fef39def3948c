"""Break test: the scheduler's own hyperparameters are policy too.

Fault: a session resumed with a longer schedule (config ``scheduler.T_max: 200``) from an archive whose
CosineAnnealingLR state holds ``T_max: 100`` silently ran the archived schedule (scheduler.load_state_dict
restores T_max), without a word, even under ``restore --policy session``: only the LR bases were compared.
Now ``scheduler.T_max`` is a difference (archived vs session, what wins), ``--policy session`` rewrites it
(and the current LR to the schedule's value at the archived position), and the resumed run's next
scheduler.step() is that of a fresh T_max 200 run; the config as packed stays a no-op.
"""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch.optim import lr_scheduler as L

from ckpt_archive.training.session import apply_session_policy, compare_with_session

STEPS = 30


def _run(t_max, steps=STEPS, eta_min=0.0):
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = L.CosineAnnealingLR(o, T_max=t_max, eta_min=eta_min)
    for _ in range(steps):
        o.step()
        s.step()
    return m, o, s


def _state(t_max=100):
    m, o, s = _run(t_max)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": s.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _next_lr(state, t_max_built=100):
    m, o, s = _run(t_max_built, steps=0)
    o.load_state_dict(state["optimizer"])
    s.load_state_dict(state["scheduler"])
    o.step()
    s.step()
    return o.param_groups[0]["lr"]


def _cli(*args):
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_longer_schedule_in_session_config_is_reported_and_imposed():
    state = _state(100)
    cfg = {"optimizer": {"lr": 0.1}, "scheduler": {"T_max": 200, "last_epoch": 0}}
    diffs = compare_with_session(state, session_config=cfg)
    assert [d.field for d in diffs] == ["scheduler.T_max"]
    d = diffs[0]
    assert (d.archived, d.session, d.wins, d.config_key) == (100, 200, "checkpoint", "scheduler.T_max")
    assert "scheduler.load_state_dict restores it" in d.message and "--policy session" in d.message
    sdiffs = compare_with_session(state, session_config=cfg, policy="session")
    assert sdiffs[0].wins == "session"

    new, changes = apply_session_policy(state, session_config=cfg)
    assert state["scheduler"]["T_max"] == 100  # the input untouched
    assert new["scheduler"]["T_max"] == 200 and type(new["scheduler"]["T_max"]) is int
    assert new["scheduler"]["last_epoch"] == STEPS  # progress untouched
    assert "scheduler.T_max" in [c.field for c in changes]
    # the next scheduler.step() follows T_max 200 (the session builds its scheduler with T_max 200)
    _, o_ref, s_ref = _run(200, STEPS + 1)
    assert _next_lr(new, 200) == pytest.approx(o_ref.param_groups[0]["lr"], rel=1e-9)
    # without the rewrite it follows the archived T_max 100
    _, o_old, _ = _run(100, STEPS + 1)
    assert _next_lr(state, 200) == pytest.approx(o_old.param_groups[0]["lr"], rel=1e-9)
    assert not math.isclose(o_old.param_groups[0]["lr"], o_ref.param_groups[0]["lr"], rel_tol=1e-6)


def test_same_config_is_a_no_op():
    state = _state(100)
    cfg = {"optimizer": {"lr": 0.1}, "scheduler": {"T_max": 100, "eta_min": 0.0}}
    assert compare_with_session(state, session_config=cfg) == []
    new, changes = apply_session_policy(state, session_config=cfg)
    assert changes == [] and new["scheduler"]["T_max"] == 100


def test_cli_warns_and_rewrites(tmp_path):
    state = _state(100)
    src, cfg, repo = tmp_path / "s.pt", tmp_path / "sess.yaml", tmp_path / "repo"
    torch.save(state, src)
    cfg.write_text("scheduler:\n  T_max: 200\n  eta_min: 1.0e-5\n")
    assert _cli("pack", src, "--repo", repo).exit_code == 0
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "a.pt", "--session-config", cfg)
    assert r.exit_code == 0, r.stderr
    assert "scheduler.T_max: archived 100, session 200" in r.stderr
    assert "scheduler.eta_min" in r.stderr
    assert torch.load(tmp_path / "a.pt", weights_only=True)["scheduler"]["T_max"] == 100
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "b.pt", "--session-config", cfg, "--policy", "session")
    assert r.exit_code == 0, r.stderr
    assert "scheduler.T_max: 100 -> 200" in r.stderr + r.stdout
    out = torch.load(tmp_path / "b.pt", weights_only=True)
    assert out["scheduler"]["T_max"] == 200 and out["scheduler"]["eta_min"] == pytest.approx(1e-5)
    _, o_ref, _ = _run(200, STEPS + 1, eta_min=1e-5)
    assert _next_lr(out, 200) == pytest.approx(o_ref.param_groups[0]["lr"], rel=1e-9)
    cfg.write_text("scheduler:\n  T_max: 100\n")
    r = _cli("restore", f"{repo}@latest", "-o", tmp_path / "c.pt", "--session-config", cfg)
    assert r.exit_code == 0 and "T_max" not in r.stderr
