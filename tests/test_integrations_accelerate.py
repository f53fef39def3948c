"""The Accelerate recipe of docs/integrations-accelerate.md, run as written: ``accelerator.save_state()`` with
automatic checkpoint naming and ``total_limit=1``, each folder published in the background by
``FolderPublisher``; then a generation restored and loaded with ``accelerator.load_state`` continues bit for bit.

A small MLP with dropout, AdamW and StepLR, inputs drawn from torch's global RNG (so the RNG file matters), 6 steps,
a save every 2.
"""
from __future__ import annotations

import threading

import pytest

accelerate = pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from ckpt_archive.integrations.folder import STAGING_NAME, FolderPublisher  # noqa: E402


def _accelerator(project_dir):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=1)
    return accelerate.Accelerator(cpu=True, project_config=config)


def _setup(project_dir):
    torch.manual_seed(0)
    accelerator = _accelerator(project_dir)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _train_step(accelerator, model, optimizer, scheduler):
    x = torch.randn(8, 4)
    loss = torch.nn.functional.mse_loss(model(x), x[:, :2])
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _run(project_dir, repo, start, total_steps, save_every, accelerator, model, optimizer, scheduler):
    # --- the recipe (docs/integrations-accelerate.md), verbatim but for the names -------------------------------
    publisher = FolderPublisher(repo, retention=ckpt_archive.RetentionPolicy(keep_last=3)) \
        if accelerator.is_main_process else None
    for step in range(start, total_steps):
        _train_step(accelerator, model, optimizer, scheduler)
        if (step + 1) % save_every == 0:
            folder = accelerator.save_state()           # <project>/checkpoints/checkpoint_<i>
            accelerator.wait_for_everyone()             # every process wrote its random_states_<rank>.pkl
            if publisher:
                publisher.publish(folder, step=step + 1)    # hard-link snapshot; packed in the background
    if publisher:
        publisher.close()                               # waits for the last publish; raises if it failed
    # ------------------------------------------------------------------------------------------------------------


def _state(model, optimizer, scheduler) -> dict:
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(), "lr": [g["lr"] for g in optimizer.param_groups],
            "last_lr": scheduler.get_last_lr()}


@pytest.fixture(scope="module")
def acc_run(tmp_path_factory, request):
    """6 uninterrupted steps, saved at 2, 4, 6. The publish of checkpoint_0 is held until Accelerate's total_limit
    deleted that folder at the next save_state (and that save_state must not trip over the staging folder)."""
    root = tmp_path_factory.mktemp("acc-recipe")
    import ckpt_archive.ops.pack as pack_mod

    real, seen = pack_mod.pack, {"calls": 0, "deleted_first": None}

    def gated(source, *a, **kw):
        seen["calls"] += 1
        if seen["calls"] == 1:
            first = root / "proj" / "checkpoints" / "checkpoint_0"
            wait = threading.Event()
            for _ in range(600):
                if not first.exists():
                    break
                wait.wait(0.1)
            seen["deleted_first"] = not first.exists()
        return real(source, *a, **kw)

    pack_mod.pack = gated
    try:
        parts = _setup(root / "proj")
        _run(root / "proj", root / "repo", 0, 6, 2, *parts)
    finally:
        pack_mod.pack = real
    return root, _state(*parts[1:]), seen


def test_recipe_publishes_every_save_state_although_total_limit_deletes_the_folders(acc_run):
    root, _, seen = acc_run
    assert seen["deleted_first"] is True, "the test did not force the deletion before the pack"
    assert sorted(p.name for p in (root / "proj" / "checkpoints").iterdir()) == ["checkpoint_2"]
    assert not (root / "proj" / STAGING_NAME).exists()
    gens = ckpt_archive.list_generations(root / "repo")
    assert [(g.number, g.manifest["progress"]["step"], g.manifest["source"]["format"]) for g in gens] == [
        (1, 2, "accelerate"), (2, 4, "accelerate"), (3, 6, "accelerate")]


def test_restored_generation_loads_with_load_state_and_continues_bitwise(acc_run, tmp_path):
    """An uninterrupted run against one resumed from the restored step-4 generation: parameters, AdamW moments and
    LR equal bit for bit (the restored RNG file carries the data draws and the dropout masks)."""
    root, uninterrupted, _ = acc_run
    accelerator, model, optimizer, scheduler = _setup(tmp_path / "proj")
    torch.manual_seed(12345)  # load_state must put the RNG back, whatever it was
    # --- resuming, as docs/integrations-accelerate.md shows ------------------------------------------------------
    res = ckpt_archive.restore(root / "repo", 2, output=tmp_path / "restored")
    accelerator.load_state(res.output)
    start = ckpt_archive.inspect(root / "repo", res.generation)["manifest"]["progress"]["step"]
    # -------------------------------------------------------------------------------------------------------------
    assert start == 4
    _run(tmp_path / "proj", tmp_path / "repo", start, 6, 2, accelerator, model, optimizer, scheduler)
    got = _state(model, optimizer, scheduler)
    assert all(torch.equal(uninterrupted["params"][k], got["params"][k]) for k in got["params"])
    a, b = uninterrupted["optimizer"]["state"], got["optimizer"]["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i][m], b[i][m]) for i in a for m in ("step", "exp_avg",
                                                                                             "exp_avg_sq"))
    assert got["lr"] == uninterrupted["lr"] and got["last_lr"] == uninterrupted["last_lr"]
