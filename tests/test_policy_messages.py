"""Issue 25: messages that are wrong, each standing for a kind.

Each test names the fault it guards against and builds the state the way the training code that produced it
does (real torch optimizers and schedulers, tiny models).
"""
from __future__ import annotations

import io
import random
import re
import warnings

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as L

import ckpt_archive
from ckpt_archive.training.audit import audit
from ckpt_archive.training.completeness import lint_completeness


def _rt(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _train(opt, sched, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(n):
            opt.step()
            sched.step()


# ---- which of several per-epoch files is audited ---------------------------------------------------------

def _epoch_file(n, with_epoch=True):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = L.StepLR(opt, 1, 0.9)
    _train(opt, sched, n)
    d = {"model": m.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    if with_epoch:
        d["epoch"] = n
    return d


@pytest.mark.parametrize("names", [("model_0.pth", "model_1.pth"), ("model_1.pth", "model_0.pth"),
                                   ("model_9.pth", "model_10.pth"), ("epoch_10.pt", "epoch_9.pt")])
@pytest.mark.parametrize("with_epoch", [True, False])
def test_per_epoch_model_files_are_audited_as_two_pairs_showing_the_older_counters(names, with_epoch):
    """A folder of per-epoch files named model_0.pth, model_1.pth was audited as two optimizer/scheduler pairs, the
    older one's counters shown (its name reads as the model part), while epoch_9.pt/epoch_10.pt audited the newest.
    One rule for every name: the newest file by progress, else by the number in its name."""
    epochs = {n: int("".join(c for c in n if c.isdigit())) for n in names}
    state = _rt({n: _epoch_file(epochs[n], with_epoch) for n in names})
    newest = max(names, key=epochs.get)
    a = audit(state)
    assert a.counters["scheduler_last_epoch"] == epochs[newest]
    assert len(a.groups) == 1 and a.groups[0].field == f'["{newest}"].optimizer.param_groups[0]'
    assert any(f"audited the newest, {newest}" in n for n in a.notes), a.notes
    assert a.parts["model"] == f'["{newest}"].model'


# ---- --strict on a folder whose manifest holds the step ---------------------------------------------------

def _accelerate_folder(root):
    """An Accelerate save_state folder: model.safetensors, optimizer.bin, scheduler.bin, random_states_0.pkl; no
    step counter in any file (Accelerate derives its position from the optimizer's step)."""
    from safetensors.torch import save_file

    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = L.StepLR(opt, 1, 0.9)
    for _ in range(3):
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    root.mkdir()
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, root / "model.safetensors")
    torch.save(opt.state_dict(), root / "optimizer.bin")
    torch.save(sched.state_dict(), root / "scheduler.bin")
    torch.save({"step": 0, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, root / "random_states_0.pkl")
    return root


def test_strict_verify_fails_an_accelerate_folder_whose_manifest_has_the_step(tmp_path):
    """`verify --strict` failed an Accelerate folder with "no data permutation, cursor or step counter saved" although
    its manifest has progress.step 3 (read from the optimizer state); docs/policy.md says a missing cursor next to
    step counters is only a guess (info), which never fails --strict."""
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(_accelerate_folder(tmp_path / "acc"), repo)
    assert res.manifest["progress"]["step"] == 3
    rep = ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(strict=True))
    assert rep.ok, [p.reason for p in rep.problems]
    (data,) = [f for f in rep.policy.completeness if f.field == "data"]
    assert data.severity == "info" and "step/epoch counters" in data.message
    # the unit: the manifest's progress counts as a counter; without any counter it is still a warning
    state = {"optimizer.bin": {"state": {}, "param_groups": []}}
    assert [f.severity for f in lint_completeness(state, progress={"step": 3}) if f.field == "data"] == ["info"]
    assert [f.severity for f in lint_completeness(state, progress={}) if f.field == "data"] == ["warning"]


# ---- a hand-set LR and a weight decay set apart: policy set by code, not carried by the state ----------------

NANOGPT_CONFIG = {"learning_rate": 6e-4, "max_iters": 20, "weight_decay": 1e-1, "beta1": 0.9, "beta2": 0.95,
                  "grad_clip": 1.0, "decay_lr": True, "warmup_iters": 2, "lr_decay_iters": 20, "min_lr": 6e-5}


def _nanogpt_lr(it, c=NANOGPT_CONFIG):
    """nanoGPT's get_lr: linear warmup, cosine decay to min_lr."""
    import math

    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    ratio = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


def _nanogpt_checkpoint(iters=7, config=NANOGPT_CONFIG):
    """nanoGPT's train.py: two param groups (decay on 2-d weights, none on norms and biases), no scheduler: the
    loop sets every group's lr from get_lr(iter_num) before each step; the checkpoint holds the config."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=config["learning_rate"], betas=(config["beta1"], config["beta2"]))
    for it in range(iters):
        for g in opt.param_groups:
            g["lr"] = _nanogpt_lr(it)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return _rt({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": iters,
                "best_val_loss": 1.0, "config": dict(config)})


def test_hand_set_lr_and_unused_weight_decay_are_warned_as_config_mismatches(tmp_path):
    """nanoGPT sets the LR itself every step (no scheduler) and keeps weight decay off norms and biases on purpose.
    verify/inspect warned "config says learning_rate = 0.0006 but the state holds 0.000..." for both groups and
    "weight_decay = 0.1 but the state holds 0" for the no-decay group. The model knows the lr is set by code each
    step (the config's decay_lr/warmup_iters/lr_decay_iters) and group 1's weight decay was set apart: nothing to
    warn, nothing to rewrite, and the next-step LR is said to be the script's."""
    from ckpt_archive.training.completeness import config_disagreements
    from ckpt_archive.training.session import apply_session_policy, compare_with_session

    state = _nanogpt_checkpoint()
    assert state["optimizer"]["param_groups"][0]["lr"] != NANOGPT_CONFIG["learning_rate"]  # decayed by design
    assert config_disagreements(state) == []
    assert compare_with_session(state, session_config=NANOGPT_CONFIG) == []
    assert apply_session_policy(state, session_config=NANOGPT_CONFIG)[1] == []
    a = audit(state, config=state["config"])
    assert [g.lr_set_by for g in a.groups] == ["script", "script"]
    assert all("set by the training script" in g.next_steps_from and "decay_lr" in g.next_steps_from for g in a.groups)
    assert a.next_lrs == [None, None]  # what the script sets, not the archived last step's lr
    assert {o.when for o in a.overrides if o.field.endswith(".lr")} == {"never: the training script sets lr before "
                                                                         "every step"}
    repo = tmp_path / "repo"
    ckpt_archive.pack(state, repo)
    rep = ckpt_archive.verify(repo)
    assert rep.ok and not [w for w in rep.warnings if "config says" in w or "but the state holds" in w], rep.warnings
    # a session that lowers weight decay changes the decay group only; the no-decay group keeps its 0
    lower = dict(NANOGPT_CONFIG, weight_decay=0.05)
    (d,) = compare_with_session(state, session_config=lower)
    assert d.field == "optimizer.param_groups[0].weight_decay" and "group(s) 1 keep their own" in d.message
    new, changes = apply_session_policy(state, session_config=lower)
    assert [g["weight_decay"] for g in new["optimizer"]["param_groups"]] == [0.05, 0.0]
    # without the schedule's keys the config cannot say who set the lr: information, never a warning
    plain = {k: v for k, v in NANOGPT_CONFIG.items() if k not in ("decay_lr", "warmup_iters", "lr_decay_iters")}
    found = config_disagreements(dict(state, config=plain))
    assert found and all(f.severity == "info" and "set the LR itself" in f.message for f in found)
    # a config whose decay_lr is false says the LR is constant: a different lr is then a real difference
    const = dict(NANOGPT_CONFIG, decay_lr=False)
    assert [d.field for d in compare_with_session(state, session_config=const)] == [
        "optimizer.param_groups[0].lr", "optimizer.param_groups[1].lr"]


# ---- when an archived base takes effect, and what --expect-lr names ------------------------------------------

def _session_steps(state, lr, n=3, policy_state=None):
    """A real session built with ``lr`` that restores ``policy_state or state`` and takes n steps: their LRs."""
    m = _net()
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    sched = L.CosineAnnealingLR(opt, 100)
    st = policy_state or state
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        _train(opt, sched, 1)
    return out


def test_stale_base_on_a_full_state_says_it_takes_effect_at_the_next_scheduler_step():
    """A full state (optimizer and scheduler) whose base LR 1e-3 is not the session's 1e-5: restore said the
    archived value "takes effect at the next scheduler.step()", but the next optimizer step already runs at the
    archived schedule's LR. The difference now says "now", with the next steps under each policy, as real torch
    runs them."""
    from ckpt_archive.training.session import apply_session_policy, compare_with_session

    m = _net()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    sched = L.CosineAnnealingLR(opt, 100)
    _train(opt, sched, 45)
    state = _rt({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
    (d,) = compare_with_session(state, session_config={"optimizer": {"lr": 1e-5}})
    assert d.field == "optimizer.param_groups[0].initial_lr" and d.when == "now", d.message
    archived = _session_steps(state, 1e-5)
    session = _session_steps(state, 1e-5, policy_state=apply_session_policy(state, lr=1e-5)[0])
    want = (f"the next optimizer steps run at {', '.join(f'{x:.7g}' for x in archived)} (archived) instead of "
            f"{', '.join(f'{x:.7g}' for x in session)}")
    assert want in d.message, d.message
    assert "at the next scheduler.step()" not in d.message


def _founding_state():
    """The founding story: optimizer built with 1e-4 (warm-up LambdaLR), scheduler state from an older run (its
    base_lrs 1e-6)."""
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sched = L.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 5))
    _train(opt, sched, 2)
    sd = sched.state_dict()
    sd["base_lrs"] = [1e-6]
    return _rt({"model": m.state_dict(), "optimizer": opt.state_dict(), "scheduler": sd}), m


def test_expect_lr_on_the_founding_case_names_only_the_optimizer_lr(tmp_path):
    """`restore --expect-lr 1e-4` on the founding case named optimizer.param_groups[0].lr only, not the base_lrs
    (1e-6, from an older run) that drive every later step; and it advised "--policy session keeps the session's",
    which then warned "the session's value wins" and exited 2 with "needs --session-config" (issue 26). Now the
    message names the steps after the next one and their source, and the advice is one that works."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app
    from ckpt_archive.training.session import compare_with_session

    state, m = _founding_state()
    # what real torch does after the restore
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    sched = L.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 5))
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    real = []
    for _ in range(2):
        real.append(opt.param_groups[0]["lr"])
        _train(opt, sched, 1)
    (d,) = compare_with_session(state, expect_lr=1e-4)
    assert d.field == "optimizer.param_groups[0].lr" and d.archived == real[0]
    assert "scheduler.base_lrs[0] = 1e-06" in d.message, d.message
    # the step after it: real torch gives 8e-07 from the archived base_lrs; the lambda is code, so the model's
    # value is a constant-factor guess of the same order (6e-07), and says so
    assert real[1] == pytest.approx(8e-7) and "then 6e-07" in d.message and "a guess" in d.message
    assert "--policy session keeps" not in d.message and "--session-config" in d.message
    src, repo = tmp_path / "f.pt", tmp_path / "repo"
    torch.save(state, src)
    run = CliRunner().invoke
    assert run(app, ["pack", str(src), "--repo", str(repo)]).exit_code == 0
    r = run(app, ["restore", str(repo), "-o", str(tmp_path / "a.pt"), "--expect-lr", "1e-4"])
    assert r.exit_code == 0 and "scheduler.base_lrs[0]" in r.stderr and "--policy session keeps" not in r.stderr
    r = run(app, ["restore", str(repo), "-o", str(tmp_path / "b.pt"), "--expect-lr", "1e-4", "--policy", "session"])
    assert r.exit_code == 2 and "needs --session-config" in r.output
    assert "value wins" not in r.output and "warning" not in r.output  # refused before any advice
    assert not (tmp_path / "b.pt").exists()


@pytest.mark.parametrize("sched_kind", ["step", "constant"])
def test_following_expect_lrs_advice_gives_the_expected_next_step_lr_and_no_second_warning(tmp_path, sched_kind):
    """[issue 26] `restore --expect-lr 1e-4` on a StepLR state (base 0.01, an eighth of it after 10 updates) said
    "restore with --session-config (lr: 0.0001) and --policy session"; doing so ran the next step at 1.25e-05 (the
    config's lr is the schedule's base LR) and warned again. The advice now names the config lr that gives the
    expected LR (0.0008 here, found with real torch); following it as printed gives it, with no --expect-lr
    warning. Without a scheduler the config lr is the LR itself."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = L.StepLR(opt, 3, 0.5) if sched_kind == "step" else None
    for _ in range(10):
        m(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    state = {"model": m.state_dict(), "optimizer": opt.state_dict()}
    if sched is not None:
        state["scheduler"] = sched.state_dict()
    repo = tmp_path / "repo"
    ckpt_archive.pack(state, repo)
    run = CliRunner().invoke
    r = run(app, ["restore", str(repo), "-o", str(tmp_path / "a.pt"), "--expect-lr", "1e-4"])
    assert r.exit_code == 0, r.output
    advised = re.search(r"restore with --session-config \(lr: ([0-9.e+-]+)", r.stderr)
    assert advised, r.stderr
    assert float(advised.group(1)) == pytest.approx(8e-4 if sched_kind == "step" else 1e-4), r.stderr
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"lr: {advised.group(1)}\n")
    r = run(app, ["restore", str(repo), "-o", str(tmp_path / "b.pt"), "--expect-lr", "1e-4",
                  "--session-config", str(cfg), "--policy", "session"])
    assert r.exit_code == 0, r.output
    assert "(--expect-lr)" not in r.stderr, r.stderr                      # no second warning
    restored = torch.load(tmp_path / "b.pt", weights_only=True)
    opt2 = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    opt2.load_state_dict(restored["optimizer"])
    if sched is not None:
        sched2 = L.StepLR(opt2, 3, 0.5)
        sched2.load_state_dict(restored["scheduler"])
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-6)  # the next step's LR, as expected


def test_expect_lr_advice_under_policy_session_keeps_the_session_configs_scheduler_settings(tmp_path):
    """[issue 26] The config lr named under --policy session must hold with the rest of that session config: a
    session StepLR step_size of 5 (an archived 3) puts the base at a quarter after 10 updates, not an eighth."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = L.StepLR(opt, 3, 0.5)
    for _ in range(10):
        m(torch.randn(2, 3)).sum().backward()
        opt.step()
        sched.step()
    repo = tmp_path / "repo"
    ckpt_archive.pack({"model": m.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, repo)
    run = CliRunner().invoke
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("lr: 0.0001\nscheduler:\n  step_size: 5\n")
    args = ["--expect-lr", "1e-4", "--session-config", str(cfg), "--policy", "session"]
    r = run(app, ["restore", str(repo), "-o", str(tmp_path / "a.pt"), *args])
    advised = re.search(r"restore with --session-config \(lr: ([0-9.e+-]+)", r.stderr)
    assert r.exit_code == 0 and advised and float(advised.group(1)) == pytest.approx(4e-4), r.output
    cfg.write_text(f"lr: {advised.group(1)}\nscheduler:\n  step_size: 5\n")
    r = run(app, ["restore", str(repo), "-o", str(tmp_path / "b.pt"), *args])
    assert r.exit_code == 0 and "(--expect-lr)" not in r.stderr, r.output
