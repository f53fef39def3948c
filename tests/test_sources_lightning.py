"""Lightning ``.ckpt`` files: detect, pack, verify, restore, resume with ``Trainer.fit(ckpt_path=...)``.

A tiny LightningModule (MLP, AdamW + StepLR, saved hyper-parameters) fits one epoch of 4 batches
and saves a checkpoint; the uninterrupted run fits 2 epochs. The checkpoint is packed, restored to a
new file and fit resumes from it to epoch 2: the weights must equal the uninterrupted run's bit for
bit. (Lightning does not save RNG states in a ``.ckpt``, so the model has no dropout and the loader
does not shuffle: everything the next update depends on is in the file.)
"""
from __future__ import annotations

import pytest

L = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from ckpt_archive.errors import RefusedPickle  # noqa: E402
from ckpt_archive.sources import read_source  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))

    def training_step(self, batch, _i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def _loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


def _trainer(root, epochs):
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root),
                     deterministic=True)


@pytest.fixture(scope="module")
def l_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    L.seed_everything(0, verbose=False)
    model = Tiny()
    t = _trainer(root, 1)
    t.fit(model, _loader())
    t.save_checkpoint(root / "epoch1.ckpt")
    L.seed_everything(0, verbose=False)
    cont = Tiny()
    _trainer(root, 2).fit(cont, _loader())
    return root / "epoch1.ckpt", {k: v.detach().clone() for k, v in cont.state_dict().items()}


def test_lightning_ckpt_detected_with_progress_lr_and_hparams(l_run):
    src = read_source(l_run[0])
    assert src.format == "lightning" and src.layout == "file"
    assert src.progress == {"step": 4, "epoch": 1}
    assert src.info["hyper_parameters"] == {"hidden": 8, "lr": 0.01}
    assert src.info["lr_schedulers"][0]["last_epoch"] == 1 and src.info["lr"] == 0.005
    assert src.info["optimizers"][0]["steps"] == [4]
    assert src.info["lightning_version"] == L.__version__


def test_lightning_ckpt_restores_and_fit_resumes_bitwise(l_run, tmp_path):
    ckpt, cont = l_run
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(ckpt, repo)
    assert res.manifest["progress"]["step"] == 4 and res.manifest["progress"]["epoch"] == 1
    assert ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True)).ok
    out = tmp_path / "restored.ckpt"
    ckpt_archive.restore(repo, output=out)
    a = torch.load(ckpt, weights_only=True)
    b = torch.load(out, weights_only=True)
    assert type(b["state_dict"]) is type(a["state_dict"]) and list(b["state_dict"]) == list(a["state_dict"])
    assert b["loops"] == a["loops"] and b["hyper_parameters"] == a["hyper_parameters"]

    L.seed_everything(123, verbose=False)  # resuming must not depend on the seed of the new process
    model = Tiny()
    _trainer(tmp_path, 2).fit(model, _loader(), ckpt_path=str(out))
    got = model.state_dict()
    assert all(torch.equal(cont[k], got[k]) for k in cont), "resumed run diverged from the continuous one"


def test_lightning_ckpt_with_pickled_code_in_hparams_is_refused_naming_the_class(l_run, tmp_path):
    import argparse

    obj = torch.load(l_run[0], weights_only=True)
    obj["hyper_parameters"]["args"] = argparse.Namespace(lr=0.1)
    bad = tmp_path / "bad.ckpt"
    torch.save(obj, bad)
    with pytest.raises(RefusedPickle, match="argparse.Namespace"):
        ckpt_archive.pack(bad, tmp_path / "repo")
