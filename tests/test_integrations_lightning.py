"""``ArchiveCheckpointIO`` with the real Lightning Trainer and ``ModelCheckpoint``, synchronous and wrapped by
Lightning's ``AsyncCheckpointIO``: each checkpoint is a generation tagged with its file name, top-k removals
forget generations, and ``trainer.fit(ckpt_path="REPO@latest")`` resumes bit for bit.

A tiny LightningModule (MLP, AdamW + StepLR) on 32 fixed rows, 4 batches per epoch, no dropout and no shuffling:
Lightning keeps no RNG state in a checkpoint, so everything the next update depends on is in the dict.
"""
from __future__ import annotations

from pathlib import Path

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from ckpt_archive.errors import LockError, UsageError  # noqa: E402
from ckpt_archive.integrations.lightning import ArchiveCheckpointIO  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))

    def training_step(self, batch, _i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def _loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


def _trainer(root, epochs, plugin):
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpts"), save_top_k=2, monitor="train_loss", save_last=True)
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(root), deterministic=True,
                     plugins=[plugin], callbacks=[ckpt])


def _state(trainer) -> dict:
    opt = trainer.optimizers[0]
    return {"params": {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()},
            "optimizer": opt.state_dict(), "lr": [g["lr"] for g in opt.param_groups],
            "last_lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()}


def _assert_bit_equal(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), "parameters differ"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) == 4
    for i in sa:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)
    assert a["lr"] == b["lr"] and a["last_lr"] == b["last_lr"]


def _tags(repo) -> list:
    return [(g.number, g.manifest["progress"]["step"], g.tags) for g in ckpt_archive.list_generations(repo)]


@pytest.fixture(scope="module", params=["sync", "async"])
def l_run(request, tmp_path_factory):
    """4 uninterrupted epochs with the plugin (sync, or wrapped by AsyncCheckpointIO), and 2 epochs in another
    repository to resume from."""
    root = tmp_path_factory.mktemp(f"lightning-{request.param}")
    wrap = AsyncCheckpointIO if request.param == "async" else (lambda io: io)
    L.seed_everything(0, verbose=False)
    io = ArchiveCheckpointIO(root / "repo")
    t = _trainer(root / "full", 4, wrap(io))
    t.fit(Tiny(), _loader())
    L.seed_everything(0, verbose=False)
    io2 = ArchiveCheckpointIO(root / "half")
    _trainer(root / "half-run", 2, wrap(io2)).fit(Tiny(), _loader())
    return root, wrap, io, _state(t), t


def test_each_checkpoint_is_a_generation_tagged_with_its_file_name_and_topk_removals_forget(l_run):
    """ModelCheckpoint(save_top_k=2, save_last=True) over 4 epochs: epochs 0 and 1 fall out of the top 2 and their
    generations are forgotten (under AsyncCheckpointIO the removal comes before the save it follows has even
    started); last.ckpt is saved every epoch and kept; no file is written in the checkpoint folder."""
    root, _, io, _, _ = l_run
    assert _tags(root / "repo") == [
        (2, 4, ["last.ckpt"]), (4, 8, ["last.ckpt"]), (5, 12, ["epoch=2-step=12.ckpt"]), (6, 12, ["last.ckpt"]),
        (7, 16, ["epoch=3-step=16.ckpt"]), (8, 16, ["last.ckpt"])]
    assert sorted(io.forgotten) == [1, 3] and io._to_forget == []
    # what ModelCheckpoint keeps is there as pointer files (its file checks need them); the removed ones are gone
    assert sorted(p.name for p in (root / "full" / "ckpts").iterdir()) == [
        "epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"]
    assert (root / "full" / "ckpts" / "last.ckpt").stat().st_size < 1024
    g = ckpt_archive.list_generations(root / "repo")[-1]
    assert set(g.manifest["metrics"]) == {"train_loss"} and g.manifest["progress"]["epoch"] == 3
    assert ckpt_archive.verify(root / "repo", options=ckpt_archive.VerifyOptions(deep=True)).ok


def test_fit_resumes_from_repo_at_latest_bitwise_params_optimizer_and_lr(l_run, tmp_path):
    """An uninterrupted 4-epoch run against 2 epochs + a resume from REPO@latest (the generation restored and
    checked by the plugin): parameters, AdamW moments and LR equal bit for bit."""
    root, wrap, _, uninterrupted, _ = l_run
    L.seed_everything(123, verbose=False)  # the resume must not depend on the new process's seed
    t = _trainer(tmp_path, 4, wrap(ArchiveCheckpointIO(tmp_path / "repo")))
    t.fit(Tiny(), _loader(), ckpt_path=f"{root / 'half'}@latest")
    _assert_bit_equal(uninterrupted, _state(t))


def test_resume_without_the_archived_optimizer_diverges_so_the_comparison_has_teeth(l_run, tmp_path):
    root, _, _, uninterrupted, _ = l_run
    io = ArchiveCheckpointIO(root / "half")
    state = io.load_checkpoint(f"{root / 'half'}@latest")
    for s in state["optimizer_states"][0]["state"].values():
        s["exp_avg"].zero_()
    broken = ArchiveCheckpointIO(tmp_path / "broken")
    broken.save_checkpoint(state, tmp_path / "broken.ckpt")
    t = _trainer(tmp_path, 4, ArchiveCheckpointIO(tmp_path / "repo"))
    t.fit(Tiny(), _loader(), ckpt_path=f"{tmp_path / 'broken'}@latest")
    with pytest.raises(AssertionError):
        _assert_bit_equal(uninterrupted, _state(t))


def test_load_checkpoint_accepts_every_form_and_refuses_a_file(l_run, tmp_path):
    root, _, io, _, _ = l_run
    repo = root / "repo"
    by_number = io.load_checkpoint(f"{repo}@5")
    assert by_number["global_step"] == 12 and by_number["epoch"] == 2
    assert io.load_checkpoint(f"{repo}@tag:epoch=3-step=16.ckpt")["global_step"] == 16
    assert io.load_checkpoint(str(repo))["global_step"] == 16  # a repository: its newest usable generation
    # the pointer file ModelCheckpoint's path names; where none is (a new machine: only the repository came along,
    # best_model_path restored from the checkpoint), the name is a tag of the plugin's repository
    assert io.load_checkpoint(root / "full" / "ckpts" / "epoch=2-step=12.ckpt")["global_step"] == 12
    assert io.load_checkpoint(tmp_path / "elsewhere" / "epoch=2-step=12.ckpt")["global_step"] == 12
    assert torch.equal(by_number["state_dict"]["net.0.weight"],
                       ckpt_archive.load(repo, 5)["state_dict"]["net.0.weight"])
    with pytest.raises(FileNotFoundError, match="@latest"):
        io.load_checkpoint(root / "full" / "ckpts" / "epoch=0-step=4.ckpt")  # forgotten
    f = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, f)
    with pytest.raises(UsageError, match="pack the file first"):
        io.load_checkpoint(f)
    with pytest.raises(TypeError):
        io.save_checkpoint({"state_dict": {}}, "x.ckpt", storage_options={"a": 1})


class TinyVal(Tiny):
    def validation_step(self, batch, _i):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_ckpt_path_best_loads_the_generation_model_checkpoint_names(l_run):
    """ModelCheckpoint.best_model_path names the pointer file the plugin wrote; Lightning hands it to load_checkpoint,
    which loads the generation it names."""
    import os

    root, _, _, _, t = l_run
    best = t.checkpoint_callback.best_model_path
    assert best.endswith("epoch=3-step=16.ckpt") and os.path.getsize(best) < 1024  # a pointer file
    model = TinyVal()
    t.validate(model, dataloaders=_loader(), ckpt_path="best", verbose=False)
    assert t.ckpt_path == best
    want = ckpt_archive.load(root / "repo", "tag:epoch=3-step=16.ckpt")["state_dict"]
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())


def test_removing_the_newest_usable_generation_waits_for_the_next_save(tmp_path):
    """ckpt-archive never forgets the newest usable generation: a removal of it is kept and done after the next
    save; a later save of the same name is never forgotten by an earlier removal."""
    io = ArchiveCheckpointIO(tmp_path / "repo")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert _tags(tmp_path / "repo") == [(1, 1, ["a.ckpt"])] and io.forgotten == []
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, tmp_path / "a.ckpt")
    assert _tags(tmp_path / "repo") == [(2, 2, ["a.ckpt"])] and io.forgotten == [1]
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "b.ckpt")
    io.teardown()
    assert [n for n, _, _ in _tags(tmp_path / "repo")] == [2, 3] and io._to_forget == []


def test_a_removal_never_waits_for_a_lock_held_elsewhere(tmp_path):
    """remove_checkpoint runs in the training thread: another writer holding the lock defers it, never blocks."""
    from ckpt_archive.repo.repository import Repository

    io = ArchiveCheckpointIO(tmp_path / "repo")
    for step, name in ((1, "a.ckpt"), (2, "b.ckpt")):
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": step}, tmp_path / name)
    other = Repository.open(tmp_path / "repo")
    with other.lock():
        io.remove_checkpoint(tmp_path / "a.ckpt")  # returns at once
        assert io.forgotten == [] and [t for t, _ in io._to_forget] == ["a.ckpt"]
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "c.ckpt")
    assert io.forgotten == [1]
    with pytest.raises(LockError):  # (the lock really was exclusive)
        with other.lock():
            with Repository.open(tmp_path / "repo").lock():
                pass


def test_an_async_wrapper_that_hands_over_live_tensors_is_refused(tmp_path, monkeypatch):
    """Older Lightning's AsyncCheckpointIO passed the live tensors to its thread: training kept changing them while
    they were packed (a generation mixing two steps). Such a wrapper is refused, never silently archived."""
    import threading

    import ckpt_archive.integrations.lightning as mod

    monkeypatch.setattr(mod, "_async_io_clones", lambda: False)
    io = ArchiveCheckpointIO(tmp_path / "repo")
    errors = []

    def save():
        try:
            io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "a.ckpt")
        except UsageError as exc:
            errors.append(exc)

    t = threading.Thread(target=save)
    t.start()
    t.join(60)
    assert errors and "upgrade lightning" in errors[0].message
    assert ckpt_archive.list_generations(tmp_path / "repo", all=True) == []
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "a.ckpt")  # the caller's thread: fine
    monkeypatch.undo()
    assert mod._async_io_clones() is True  # the installed Lightning clones (the async tests above rely on it)


@pytest.mark.slow
def test_end_of_rental_export_only_exports_what_the_plugin_archived(l_run, tmp_path):
    """The plugin writes no checkpoint file for `--newest-in` to find: `--export-only REPO DEST` exports the
    newest usable generation as it is, packing nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root, _, _, _, _ = l_run
    script = Path(__file__).resolve().parents[1] / "scripts" / "end-of-rental.sh"
    env = dict(os.environ, CKPT_ARCHIVE=f"{sys.executable} -m ckpt_archive", REPORT=str(tmp_path / "proof.md"),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    before = [n for n, _, _ in _tags(root / "repo")]
    proc = subprocess.run(["bash", str(script), "--export-only", str(root / "repo"), str(tmp_path / "dest")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to pack" in proc.stderr and "recoverable from" in proc.stderr
    assert [n for n, _, _ in _tags(root / "repo")] == before
    (g,) = ckpt_archive.list_generations(tmp_path / "dest")
    assert g.number == before[-1] and g.status == "usable" and g.tags == ["last.ckpt"]


def test_only_the_saving_rank_creates_the_repository_and_early_removals_wait(tmp_path):
    """Under DDP every rank builds the plugin but only global rank 0 saves: constructing it (and a removal before
    any save, as under AsyncCheckpointIO) must not create the repository."""
    io = ArchiveCheckpointIO(tmp_path / "repo")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "repo").exists() and io._to_forget == [("a.ckpt", None)]
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, tmp_path / "b.ckpt")
    assert [n for n, _, _ in _tags(tmp_path / "repo")] == [2] and io.forgotten == [1]


class TinyStep(Tiny):
    def training_step(self, batch, _i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss_step", loss, on_step=True, on_epoch=False)
        return loss


def _fit_with(root, plugins, **mc):
    L.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpts"), **mc)
    t = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=str(root), deterministic=True, plugins=plugins,
                  callbacks=[ckpt])
    t.fit(TinyStep(), _loader())
    return t, ckpt


def test_a_file_name_saved_twice_is_versioned_as_lightning_does_and_best_is_the_best(tmp_path):
    """Guards a silent wrong 'best': ModelCheckpoint gives a name that exists a -v1 suffix, deciding by the files in
    its folder. The plugin wrote none, so with filename="{epoch}" and a save every step every save of an epoch got
    the same name: top-k kept one entry per name, removals forgot the generations it meant to keep, and
    ckpt_path="best" loaded the newest save of that epoch instead of the best. With the pointer files the top k
    are the same names and scores as with Lightning's own files, and "best" loads the best model's state."""
    mc = dict(save_top_k=2, monitor="train_loss_step", every_n_train_steps=1, filename="{epoch}")
    plain, plain_ckpt = _fit_with(tmp_path / "plain", [], **mc)
    ours, our_ckpt = _fit_with(tmp_path / "ours", [ArchiveCheckpointIO(tmp_path / "repo")], **mc)
    names = lambda c: {Path(k).name: float(v) for k, v in c.best_k_models.items()}  # noqa: E731
    assert names(our_ckpt) == names(plain_ckpt) and len(names(plain_ckpt)) == 2
    assert Path(our_ckpt.best_model_path).name == Path(plain_ckpt.best_model_path).name
    want = torch.load(plain_ckpt.best_model_path, weights_only=True)["state_dict"]
    got = ours.strategy.checkpoint_io.load_checkpoint(our_ckpt.best_model_path)["state_dict"]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_ckpt_path_last_finds_the_pointer_and_a_pointer_is_checked_as_hostile(tmp_path):
    """Lightning resolves ckpt_path="last" by looking for last*.ckpt files: the pointer makes it work. A pointer is
    read as hostile input: one naming a forgotten generation, or another archive under the same number, is refused;
    a file that is not a pointer is still refused as a file."""
    import json

    io = ArchiveCheckpointIO(tmp_path / "repo")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "ckpts" / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "global_step": 2}, tmp_path / "ckpts" / "last.ckpt")
    t = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=str(tmp_path), plugins=[io],
                  callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_last=True)])
    from lightning.pytorch.trainer.states import TrainerFn

    last = t._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False)  # what fit() does
    assert last is not None and Path(last).name == "last.ckpt" and io.load_checkpoint(last)["global_step"] == 2
    pointer = json.loads((tmp_path / "ckpts" / "a.ckpt").read_text())
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "ckpts" / "b.ckpt")
    io.remove_checkpoint(tmp_path / "ckpts" / "a.ckpt")
    assert not (tmp_path / "ckpts" / "a.ckpt").exists() and io.forgotten == [1]
    (tmp_path / "stale.ckpt").write_text(json.dumps(pointer))
    with pytest.raises(FileNotFoundError, match="not usable there any more"):
        io.load_checkpoint(tmp_path / "stale.ckpt")
    (tmp_path / "other.ckpt").write_text(json.dumps(dict(pointer, generation=2, archive_id="x" * 26)))
    with pytest.raises(FileNotFoundError, match="another archive"):
        io.load_checkpoint(tmp_path / "other.ckpt")
    (tmp_path / "bad.ckpt").write_text(json.dumps(dict(pointer, generation="../../etc")))
    with pytest.raises(UsageError, match="pack the file first"):
        io.load_checkpoint(tmp_path / "bad.ckpt")
