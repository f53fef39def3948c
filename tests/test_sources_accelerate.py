"""Accelerate ``save_state`` folders: detect, pack, verify, restore, ``Accelerator.load_state``, resume.

A small MLP with dropout, AdamW, StepLR and a registered custom object trains 3 steps on inputs
drawn from torch's global RNG, then ``save_state``; the uninterrupted run goes 3 more steps. The
folder is packed, restored elsewhere, loaded into fresh objects with ``load_state`` and trained the
same 3 steps: weights, optimizer moments and the custom object must match the uninterrupted run bit
for bit (the RNG file carries the data draws and the dropout masks).
"""
from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from ckpt_archive.sources import read_source  # noqa: E402


class Counter:
    """A custom object registered for checkpointing (Accelerate writes custom_checkpoint_0.pkl)."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, sd):
        self.seen = sd["seen"]


def _fresh_accelerator():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True)


def _setup():
    torch.manual_seed(0)
    acc = _fresh_accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, counter


def _steps(acc, model, opt, sched, counter, n):
    for _ in range(n):
        x = torch.randn(8, 4)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 8


@pytest.fixture(scope="module")
def acc_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    acc, model, opt, sched, counter = _setup()
    _steps(acc, model, opt, sched, counter, 3)
    acc.save_state(str(root / "state"))
    _steps(acc, model, opt, sched, counter, 3)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return root / "state", final, opt.state_dict(), counter.seen


def test_accelerate_folder_detected_with_step_lr_and_rng(acc_run):
    state_dir = acc_run[0]
    src = read_source(state_dir)
    assert src.format == "accelerate" and src.layout == "folder"
    kinds = {f.relpath: f.kind for f in src.files}
    assert kinds == {"model.safetensors": "safetensors", "optimizer.bin": "torch", "scheduler.bin": "torch",
                     "random_states_0.pkl": "torch", "custom_checkpoint_0.pkl": "torch"}
    assert src.progress == {"step": 3}
    assert src.info["step_source"] == "optimizer state step"
    assert src.info["scheduler"]["scheduler.bin"]["last_epoch"] == 3
    assert src.info["rng"][0]["numpy"] == "MT19937" and src.info["rng"][0]["python"]
    assert src.state["custom_checkpoint_0.pkl"] == {"seen": 24}


def test_accelerate_folder_restores_and_load_state_resumes_bitwise(acc_run, tmp_path):
    state_dir, final, final_opt, seen = acc_run
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(state_dir, repo)
    assert res.manifest["progress"]["step"] == 3
    assert ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True)).ok
    out = tmp_path / "restored"
    ckpt_archive.restore(repo, output=out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in state_dir.iterdir())

    acc, model, opt, sched, counter = _setup()
    torch.manual_seed(12345)  # load_state must put the RNG back, whatever it was
    acc.load_state(str(out))
    assert counter.seen == 24
    _steps(acc, model, opt, sched, counter, 3)
    got = model.state_dict()
    assert all(torch.equal(final[k], got[k]) for k in final), "resumed weights differ from the continuous run"
    a, b = final_opt["state"], opt.state_dict()["state"]
    assert all(torch.equal(a[i][m], b[i][m]) for i in a for m in ("exp_avg", "exp_avg_sq", "step"))
    assert counter.seen == seen


def test_unpicklable_sampler_file_is_kept_opaque_with_a_warning(acc_run, tmp_path):
    import shutil

    d = tmp_path / "state"
    shutil.copytree(acc_run[0], d)
    # Accelerate pickles a SeedableRandomSampler object into sampler.bin: code, never loaded.
    from accelerate.data_loader import SeedableRandomSampler

    torch.save(SeedableRandomSampler(range(8)), d / "sampler.bin")
    src = read_source(d)
    assert {f.relpath: f.kind for f in src.files}["sampler.bin"] == "opaque"
    assert any(w.startswith("sampler.bin: kept opaque") and "SeedableRandomSampler" in w for w in src.warnings)
    assert src.info["opaque"] == ["sampler.bin"]
