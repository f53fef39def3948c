"""Hugging Face Trainer ``checkpoint-N/`` folders: detect, pack, verify, restore, resume with Trainer.

A tiny GPT-2 (2 layers, 16 wide, vocab 64, dropout on) is built from a config (no hub download) and
trained for 4 steps on synthetic token ids, saving at steps 2 and 4. The checkpoint at step 2 is
packed, restored to a new folder and resumed with ``Trainer.train(resume_from_checkpoint=...)``: the
weights at step 4 must equal, bit for bit, those of the uninterrupted run (dropout makes the RNG
files matter).
"""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from ckpt_archive.errors import SourceError  # noqa: E402
from ckpt_archive.sources import read_source  # noqa: E402


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _args(out: Path):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=4, save_steps=2, save_strategy="steps", per_device_train_batch_size=4,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1, dataloader_num_workers=0)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Path:
    """The uninterrupted run's output folder (checkpoint-2/ and checkpoint-4/)."""
    out = tmp_path_factory.mktemp("hf") / "run"
    transformers.Trainer(model=_model(), args=_args(out), train_dataset=_Tokens()).train()
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    return out


def _tensors_of(path: Path) -> dict:
    """Every tensor of a folder's decomposable files, by (relpath, key path), loaded independently."""
    from safetensors.torch import load_file

    from ckpt_archive.sources.torchfile import load_torch_file

    out = {}

    import numpy as np

    def walk(prefix, obj):
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)

    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.suffix == ".safetensors":
            walk(rel, load_file(p))
        elif p.suffix in (".pt", ".pth"):
            walk(rel, load_torch_file(p, allow_numpy=True))
    return out


def _bit_equal(a, b) -> bool:
    """Same dtype, shape and bytes (NumPy arrays too: the RNG file's uint32 key array)."""
    if not isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    flat = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


def test_trainer_folder_detected_with_progress_lr_and_rng_facts(hf_run):
    src = read_source(hf_run / "checkpoint-2")
    assert src.format == "hf-trainer" and src.layout == "folder"
    assert src.progress == {"step": 2, "epoch": 0}
    kinds = {f.relpath: f.kind for f in src.files}
    assert kinds["training_args.bin"] == "opaque"
    assert kinds["trainer_state.json"] == "raw" and kinds["config.json"] == "raw"
    assert kinds["model.safetensors"] == "safetensors" and kinds["optimizer.pt"] == "torch"
    # Trainer writes NumPy's legacy RNG tuple here by design; decomposed with NumPy's own types only.
    assert kinds["rng_state.pth"] == "torch"
    assert src.state["rng_state.pth"]["numpy"][1].dtype.name == "uint32"
    assert set(src.state) == {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"}
    assert src.info["trainer"]["global_step"] == 2 and src.info["trainer"]["epoch"] == 0.25
    assert src.info["optimizer"]["optimizer.pt"]["steps"] == [2]
    assert src.info["scheduler"]["scheduler.pt"]["last_epoch"] == 2
    assert src.info["rng"] == [{"file": "rng_state.pth", "python": True, "numpy": "MT19937", "cpu": True}]
    assert src.info["model"]["model_type"] == "gpt2"
    assert src.files[[f.relpath for f in src.files].index("model.safetensors")].metadata == {"format": "pt"}


def test_trainer_folder_packs_restores_byte_identical_and_resumes_bitwise(hf_run, tmp_path):
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(hf_run / "checkpoint-2", repo)
    assert res.status == "usable" and res.manifest["progress"]["step"] == 2
    assert res.manifest["source"]["format"] == "hf-trainer"
    report = ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True))
    assert report.ok, report.problems
    assert ckpt_archive.inspect(repo).opaque_members == ["training_args.bin"]

    resumed_root = tmp_path / "resumed"
    restored = resumed_root / "checkpoint-2"
    ckpt_archive.restore(repo, output=restored)
    orig = hf_run / "checkpoint-2"
    assert sorted(p.name for p in restored.iterdir()) == sorted(p.name for p in orig.iterdir())
    for name in ("training_args.bin", "trainer_state.json", "config.json", "generation_config.json"):
        assert (restored / name).read_bytes() == (orig / name).read_bytes(), name
    a, b = _tensors_of(orig), _tensors_of(restored)
    assert a.keys() == b.keys() and len(a) > 30
    assert all(_bit_equal(a[k], b[k]) for k in a), [k for k in a if not _bit_equal(a[k], b[k])]

    trainer = transformers.Trainer(model=_model(), args=_args(resumed_root), train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=str(restored))
    from safetensors.torch import load_file

    cont = load_file(hf_run / "checkpoint-4" / "model.safetensors")
    again = load_file(resumed_root / "checkpoint-4" / "model.safetensors")
    assert cont.keys() == again.keys()
    assert all(torch.equal(cont[k], again[k]) for k in cont), "resumed run diverged from the continuous one"


class _Boom:
    """Unpickling this would create a file: proof that a loader touched it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_foreign_pickle_in_trainer_folder_is_carried_but_never_executed(hf_run, tmp_path):
    src_dir = tmp_path / "checkpoint-2"
    shutil.copytree(hf_run / "checkpoint-2", src_dir)
    canary = tmp_path / "EXECUTED"
    (src_dir / "training_args.bin").write_bytes(pickle.dumps(_Boom(canary)))
    torch.save({"hook": _Boom(canary)}, src_dir / "extra_callback_state.pt")
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(src_dir, repo)
    kinds = {f["relpath"]: f["kind"] for f in res.manifest["source"]["files"]}
    assert kinds["training_args.bin"] == "opaque" and kinds["extra_callback_state.pt"] == "opaque"
    assert any("extra_callback_state.pt" in w and "references io.open" in w for w in res.warnings), res.warnings
    assert ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True)).ok
    out = tmp_path / "out"
    ckpt_archive.restore(repo, output=out)
    for name in ("training_args.bin", "extra_callback_state.pt"):
        assert (out / name).read_bytes() == (src_dir / name).read_bytes()
    assert not canary.exists(), "a foreign pickle was unpickled"


def test_sharded_model_with_a_missing_shard_is_refused_naming_it(hf_run, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    d = tmp_path / "checkpoint-2"
    shutil.copytree(hf_run / "checkpoint-2", d)
    weights = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    keys = sorted(weights)
    half = len(keys) // 2
    parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in parts.items():
        save_file({k: weights[k] for k in ks}, d / name, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, ks in parts.items() for k in ks}}))
    assert read_source(d).info["model_files"][:2] == list(parts)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceError, match="model-00002-of-00002.safetensors"):
        ckpt_archive.pack(d, tmp_path / "repo")
    assert not (tmp_path / "repo").exists() or not ckpt_archive.list_generations(tmp_path / "repo")


def test_truncated_optimizer_file_is_refused_not_archived(hf_run, tmp_path):
    d = tmp_path / "checkpoint-2"
    shutil.copytree(hf_run / "checkpoint-2", d)
    data = (d / "optimizer.pt").read_bytes()
    (d / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceError, match=r"optimizer\.pt.*truncated"):
        read_source(d)


def test_trainer_state_with_a_non_integer_global_step_is_named(hf_run, tmp_path):
    import json

    d = tmp_path / "checkpoint-2"
    shutil.copytree(hf_run / "checkpoint-2", d)
    ts = json.loads((d / "trainer_state.json").read_text())
    ts["global_step"] = "two"
    (d / "trainer_state.json").write_text(json.dumps(ts))
    with pytest.raises(SourceError, match="trainer_state.json.*global_step"):
        read_source(d)


def test_folder_name_disagreeing_with_global_step_is_warned(hf_run, tmp_path):
    d = tmp_path / "checkpoint-9"
    shutil.copytree(hf_run / "checkpoint-2", d)
    src = read_source(d)
    assert src.progress["step"] == 2
    assert any("checkpoint-9" in w and "global_step 2" in w for w in src.warnings)


def test_cli_pack_list_inspect_show_trainer_progress_lr_rng_and_opaque_members(hf_run, tmp_path):
    import json

    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    runner = CliRunner()
    repo = tmp_path / "repo"
    res = runner.invoke(app, ["pack", str(hf_run / "checkpoint-2"), "--repo", str(repo), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["source_format"] == "hf-trainer"
    res = runner.invoke(app, ["list", str(repo), "--json"])
    assert res.exit_code == 0 and '"step": 2' in res.stdout
    res = runner.invoke(app, ["inspect", str(repo), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["opaque_members"] == ["training_args.bin"]
    src = info["manifest"]["source"]
    assert src["info"]["trainer"]["last_logged"]["learning_rate"] > 0
    assert src["info"]["rng"][0]["numpy"] == "MT19937"
    assert info["manifest"]["progress"]["step"] == 2


def test_resume_without_the_rng_file_diverges_so_the_bitwise_check_has_teeth(hf_run, tmp_path):
    """Negative control for the resume test above: dropping rng_state.pth (dropout masks and data
    order then come from a fresh seed) must change the weights at step 4."""
    from safetensors.torch import load_file

    root = tmp_path / "resumed"
    shutil.copytree(hf_run / "checkpoint-2", root / "checkpoint-2")
    (root / "checkpoint-2" / "rng_state.pth").unlink()
    trainer = transformers.Trainer(model=_model(), args=_args(root), train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=str(root / "checkpoint-2"))
    cont = load_file(hf_run / "checkpoint-4" / "model.safetensors")
    again = load_file(root / "checkpoint-4" / "model.safetensors")
    assert not all(torch.equal(cont[k], again[k]) for k in cont)
