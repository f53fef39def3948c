"""Issue 25: messages that are wrong, each standing for a kind.

Each test names the fault it guards against and builds the state the way the training code that produced it
does (real torch optimizers and schedulers, tiny models).
"""
from __future__ import annotations

import io
import random
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
    rep = ckpt_archive.verify(repo, strict=True)
    assert rep.ok, [p.reason for p in rep.problems]
    (data,) = [f for f in rep.policy.completeness if f.field == "data"]
    assert data.severity == "info" and "step/epoch counters" in data.message
    # the unit: the manifest's progress counts as a counter; without any counter it is still a warning
    state = {"optimizer.bin": {"state": {}, "param_groups": []}}
    assert [f.severity for f in lint_completeness(state, progress={"step": 3}) if f.field == "data"] == ["info"]
    assert [f.severity for f in lint_completeness(state, progress={}) if f.field == "data"] == ["warning"]
