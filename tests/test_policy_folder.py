"""``restore --session-config CFG --policy session`` on folder sources (issue 12).

It used to refuse every folder source ("rewrites a single-file state"), so an HF Trainer or Accelerate
folder could only be restored with the archived LR. Real folders are built with transformers'
``Trainer`` (``optimizer.pt`` + ``scheduler.pt``) and Accelerate's ``save_state`` with two optimizers
and two schedulers (``optimizer.bin``/``optimizer_1.bin``, ``scheduler.bin``/``scheduler_1.bin``, one
of them OneCycleLR); the rewritten files are loaded into fresh objects and a real ``optimizer.step()``
+ ``scheduler.step()`` must run at the session's schedule. A session config equal to the archived one
must leave every restored file byte-identical to the source.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402


def _cli(*args):
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _sha(folder) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- Hugging Face Trainer: optimizer.pt + scheduler.pt --------------------------------------------------

@pytest.fixture(scope="module")
def hf_repo(tmp_path_factory):
    pytest.importorskip("transformers")
    import transformers

    from tests.test_sources_hf import _Tokens, _args, _model

    root = tmp_path_factory.mktemp("hf_policy")
    transformers.Trainer(model=_model(), args=_args(root / "run"), train_dataset=_Tokens()).train()
    src = root / "run" / "checkpoint-2"
    repo = root / "repo"
    ckpt_archive.pack(src, repo)
    return src, repo


def test_hf_folder_policy_session_was_refused_now_the_next_step_runs_at_the_session_lr(hf_repo, tmp_path):
    import transformers

    src, repo = hf_repo
    cfg = tmp_path / "session.json"
    cfg.write_text(json.dumps({"learning_rate": 1e-5}))
    out = tmp_path / "restored"
    res = _cli("restore", repo, "-o", out, "--session-config", cfg, "--policy", "session", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rewritten = {r["file"]: r["fields"] for r in doc["policy"]["rewritten"]}
    assert set(rewritten) == {"optimizer.pt", "scheduler.pt"}
    assert "param_groups[0].initial_lr" in rewritten["optimizer.pt"] and "base_lrs[0]" in rewritten["scheduler.pt"]
    assert any("optimizer.pt: rewritten with torch.save" in w and "no longer byte-identical" in w
               for w in doc["warnings"])
    assert all(c["field"].startswith(('["optimizer.pt"]', '["scheduler.pt"]')) for c in doc["policy"]["changes"])
    # every other file exactly as packed
    before, after = _sha(src), _sha(out)
    assert set(before) == set(after)
    assert {k for k in before if before[k] != after[k]} == {"optimizer.pt", "scheduler.pt"}

    # the rewritten files load into a fresh AdamW + linear schedule (4 steps, no warmup) and run at 1e-5
    opt_sd = torch.load(out / "optimizer.pt", weights_only=True)
    sch_sd = torch.load(out / "scheduler.pt", weights_only=True)
    arch_opt = torch.load(src / "optimizer.pt", weights_only=True)
    # moments and step counters carried, not rebuilt (checked before a step updates them in place)
    assert arch_opt["state"].keys() == opt_sd["state"].keys()
    for k, st in arch_opt["state"].items():
        assert all(torch.equal(opt_sd["state"][k][m], st[m]) for m in ("exp_avg", "exp_avg_sq", "step"))
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64,
                                                                 n_positions=16))
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "ln" not in n]
    rest = [p for n, p in model.named_parameters() if not ("bias" not in n and "ln" not in n)]
    groups = [{"params": decay}, {"params": rest}][:len(opt_sd["param_groups"])]
    opt = torch.optim.AdamW(groups, lr=1e-5)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, 4)
    try:
        opt.load_state_dict(opt_sd)
    except ValueError:
        pytest.skip("parameter grouping of this transformers version differs")
    sched.load_state_dict(sch_sd)
    assert sched.last_epoch == 2
    assert all(math.isclose(g["lr"], 1e-5 * 2 / 4, rel_tol=1e-9) for g in opt.param_groups)
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    opt.step()
    sched.step()
    assert all(math.isclose(g["lr"], 1e-5 * 1 / 4, rel_tol=1e-9) for g in opt.param_groups), \
        [g["lr"] for g in opt.param_groups]


def test_hf_folder_policy_session_with_the_archived_config_leaves_every_file_byte_identical(hf_repo, tmp_path):
    src, repo = hf_repo
    lr = torch.load(src / "optimizer.pt", weights_only=True)["param_groups"][0]["initial_lr"]
    cfg = tmp_path / "same.json"
    cfg.write_text(json.dumps({"learning_rate": lr}))
    out = tmp_path / "restored"
    res = _cli("restore", repo, "-o", out, "--session-config", cfg, "--policy", "session", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["policy"]["changes"] == [] and doc["policy"]["rewritten"] == []
    assert _sha(out) == _sha(src)


# -- Accelerate: two optimizers, two schedulers (StepLR and OneCycleLR) --------------------------------

def _acc_setup(lr1=1e-2, max_lr2=1e-3):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    m1, m2 = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    o1 = torch.optim.AdamW(m1.parameters(), lr=lr1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.5, momentum=0.9)  # OneCycleLR overrides this lr
    s1 = torch.optim.lr_scheduler.StepLR(o1, 1, 0.9)
    s2 = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=max_lr2, total_steps=10)
    m1, m2, o1, o2, s1, s2 = acc.prepare(m1, m2, o1, o2, s1, s2)
    return acc, (m1, m2), (o1, o2), (s1, s2)


def _acc_steps(models, opts, scheds, n):
    for _ in range(n):
        x = torch.randn(8, 4)
        for m, o, s in zip(models, opts, scheds):
            torch.nn.functional.mse_loss(m(x), x[:, :2]).backward()
            o.step()
            s.step()
            o.zero_grad()


@pytest.fixture(scope="module")
def acc_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc_policy")
    acc, models, opts, scheds = _acc_setup()
    _acc_steps(models, opts, scheds, 3)
    acc.save_state(str(root / "state"))
    names = {p.name for p in (root / "state").iterdir()}
    assert {"optimizer.bin", "optimizer_1.bin", "scheduler.bin", "scheduler_1.bin"} <= names
    repo = root / "repo"
    ckpt_archive.pack(root / "state", repo)
    return root / "state", repo


def _session_lrs(lr1, max_lr2, steps):
    """The LRs a run started with the session's config has after ``steps`` steps (the reference)."""
    o1 = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters(), lr=lr1)
    o2 = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.5, momentum=0.9)
    s1 = torch.optim.lr_scheduler.StepLR(o1, 1, 0.9)
    s2 = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=max_lr2, total_steps=10)
    for _ in range(steps):
        o1.step()
        o2.step()
        s1.step()
        s2.step()
    return o1.param_groups[0]["lr"], o2.param_groups[0]["lr"]


def test_accelerate_second_optimizer_and_scheduler_get_the_session_lr_too(acc_repo, tmp_path):
    state_dir, repo = acc_repo
    cfg = tmp_path / "session.yaml"
    cfg.write_text("optimizer:\n  lr: 5.0e-3\nmax_lr: 2.0e-4\n")
    out = tmp_path / "restored"
    res = _cli("restore", repo, "-o", out, "--session-config", cfg, "--policy", "session", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rewritten = {r["file"]: r["fields"] for r in doc["policy"]["rewritten"]}
    assert set(rewritten) == {"optimizer.bin", "optimizer_1.bin", "scheduler.bin", "scheduler_1.bin"}
    assert "param_groups[0].max_lr" in rewritten["optimizer_1.bin"]
    before, after = _sha(state_dir), _sha(out)
    assert {k for k in before if before[k] != after[k]} == set(rewritten)
    human = _cli("restore", repo, "-o", tmp_path / "human", "--session-config", cfg, "--policy", "session")
    assert human.exit_code == 0, human.output
    assert "optimizer_1.bin: rewritten with torch.save" in human.stderr  # a warning: stderr
    assert '["optimizer_1.bin"].param_groups[0].max_lr: 0.001 -> 0.0002' in human.stdout  # the result: stdout

    # real objects, real load_state, real steps: both pairs continue at the session's schedule
    acc, models, opts, scheds = _acc_setup()
    acc.load_state(str(out))
    want1, want2 = _session_lrs(5e-3, 2e-4, 3)
    assert math.isclose(opts[0].param_groups[0]["lr"], want1, rel_tol=1e-9)
    assert math.isclose(opts[1].param_groups[0]["lr"], want2, rel_tol=1e-9)
    _acc_steps(models, opts, scheds, 1)
    want1, want2 = _session_lrs(5e-3, 2e-4, 4)
    assert math.isclose(opts[0].param_groups[0]["lr"], want1, rel_tol=1e-9), opts[0].param_groups[0]["lr"]
    assert math.isclose(opts[1].param_groups[0]["lr"], want2, rel_tol=1e-9), opts[1].param_groups[0]["lr"]


def test_accelerate_policy_session_with_the_archived_config_rewrites_nothing(acc_repo, tmp_path):
    state_dir, repo = acc_repo
    cfg = tmp_path / "same.yaml"
    cfg.write_text("optimizer:\n  lr: 1.0e-2\nmax_lr: 1.0e-3\n")
    out = tmp_path / "restored"
    res = _cli("restore", repo, "-o", out, "--session-config", cfg, "--policy", "session", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["policy"]["changes"] == [] and doc["policy"]["rewritten"] == []
    assert _sha(out) == _sha(state_dir)


def test_python_restore_refuses_folder_rewrite_on_a_file_source(tmp_path):
    from ckpt_archive.errors import UsageError
    from ckpt_archive.training.folder_session import session_folder_rewrite

    repo = tmp_path / "repo"
    ckpt_archive.pack({"w": torch.ones(2), "step": 1}, repo)
    with pytest.raises(UsageError, match="folder source"):
        ckpt_archive.restore(repo, output=tmp_path / "o.pt", folder_rewrite=session_folder_rewrite({"lr": 1e-3}))
    assert not (tmp_path / "o.pt").exists()
