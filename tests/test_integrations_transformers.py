"""``ArchiveCallback`` with the real Hugging Face Trainer: every saved ``checkpoint-N/`` becomes a generation in the
background, survives the Trainer's own rotation, and restores so that ``trainer.train(resume_from_checkpoint=...)``
continues bit for bit.

The model is a tiny GPT-2 (2 layers, 16 wide, vocab 64, dropout on, so the RNG files matter) built from a config (no
hub download), trained 4 steps on synthetic ids, saving at steps 2 and 4 with ``save_total_limit=1``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from ckpt_archive.errors import OutputExists, UsageError  # noqa: E402
from ckpt_archive.integrations.transformers import ArchiveCallback, restore_checkpoint  # noqa: E402


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


def _args(out: Path, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=4, save_steps=2, save_strategy="steps", per_device_train_batch_size=4,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1, dataloader_num_workers=0, **kw)


def _training_state(trainer) -> dict:
    """What the next update depends on, as the live Trainer holds it after train()."""
    return {"params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "lr": [g["lr"] for g in trainer.optimizer.param_groups],
            "last_lr": trainer.lr_scheduler.get_last_lr()}


def _assert_bit_equal(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    diff = [k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    assert not diff, f"parameters differ: {diff[:5]}"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 10
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for name in sa[i]:
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)
    assert a["lr"] == b["lr"] and a["last_lr"] == b["last_lr"]


@pytest.fixture(scope="module")
def hf_archived(tmp_path_factory):
    """The uninterrupted run with the callback: save_total_limit=1 deletes checkpoint-2/ at the step-4 save. The
    background pack of checkpoint-2 is held until that deletion happened, so it reads the snapshot of a folder
    the Trainer has removed (and the Trainer trained steps 3-4 meanwhile: on_save returned at once)."""
    root = tmp_path_factory.mktemp("hf-callback")
    import ckpt_archive.ops.pack as pack_mod

    real_pack = pack_mod.pack
    seen: dict = {"deleted_before_pack": None, "calls": 0}

    def gated_pack(source, *a, **kw):
        seen["calls"] += 1
        if seen["calls"] == 1:  # checkpoint-2's publish: wait for the Trainer's rotation to delete the folder
            gone = threading.Event()
            for _ in range(600):
                if not (root / "run" / "checkpoint-2").exists():
                    gone.set()
                    break
                gone.wait(0.1)
            seen["deleted_before_pack"] = gone.is_set()
        return real_pack(source, *a, **kw)

    pack_mod.pack = gated_pack
    try:
        cb = ArchiveCallback(root / "repo", export_to=root / "offsite", report=root / "proof.md",
                             tags=("nightly",))
        trainer = transformers.Trainer(model=_model(), args=_args(root / "run", save_total_limit=1),
                                       train_dataset=_Tokens(), callbacks=[cb])
        trainer.train()
    finally:
        pack_mod.pack = real_pack
    return root, cb, _training_state(trainer), seen


def test_checkpoint_deleted_by_save_total_limit_while_packed_is_still_archived_whole(hf_archived):
    """Guards the race the Trainer's own rotation creates: the pack of checkpoint-2 ran only after the Trainer had
    deleted that folder; the generation must still hold every file, byte for byte as the Trainer wrote them."""
    root, cb, _, seen = hf_archived
    assert seen["deleted_before_pack"] is True, "the test did not force the deletion before the pack"
    assert not (root / "run" / "checkpoint-2").exists()
    gens = ckpt_archive.list_generations(root / "repo")
    assert [(g.number, g.status, g.manifest["progress"]["step"]) for g in gens] == [(1, "usable", 2), (2, "usable", 4)]
    files = {f["relpath"] for f in gens[0].manifest["source"]["files"]}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "training_args.bin", "config.json"} <= files
    assert ckpt_archive.verify(root / "repo", 1, options=ckpt_archive.VerifyOptions(deep=True)).ok
    # the staging snapshots are gone, the Trainer's folder is what it left
    assert sorted(p.name for p in (root / "run").iterdir() if p.is_dir()) == ["checkpoint-4"]


def test_callback_generations_carry_metrics_config_tags_and_the_trainer_folder(hf_archived):
    root, _, _, _ = hf_archived
    g1, g2 = ckpt_archive.list_generations(root / "repo")
    m = g1.manifest
    assert m["source"]["format"] == "hf-trainer" and m["tags"] == ["nightly"]
    assert m["source"]["path"].endswith("/checkpoint-2")
    assert set(m["metrics"]) == {"loss", "grad_norm", "learning_rate"}
    assert m["metrics"]["learning_rate"] == pytest.approx(3.75e-05)
    # the TrainingArguments as transformers serialises them, tokens masked
    config = m["config"]  # plain JSON values are stored as themselves
    assert config["save_steps"] == 2 and config["learning_rate"] == 5e-05 and config["hub_token"] == "<HUB_TOKEN>"
    assert g2.manifest["metrics"]["learning_rate"] == pytest.approx(1.25e-05)


def test_restored_generation_resumes_bitwise_params_optimizer_and_lr(hf_archived, tmp_path):
    """An uninterrupted run against a run resumed from the restored step-2 generation: parameters, every optimizer
    moment and the LR must be equal bit for bit."""
    root, _, uninterrupted, _ = hf_archived
    folder = restore_checkpoint(root / "repo", tmp_path / "resumed", generation=1)
    assert folder == tmp_path / "resumed" / "checkpoint-2"
    trainer = transformers.Trainer(model=_model(), args=_args(tmp_path / "resumed"), train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=str(folder))
    _assert_bit_equal(uninterrupted, _training_state(trainer))


def test_restore_checkpoint_latest_names_the_folder_and_refuses_to_overwrite_another(hf_archived, tmp_path):
    """An existing checkpoint-N/ that is not this generation's untouched restore is refused (a file changed since
    the restore, or a folder restore_checkpoint never wrote); force replaces it."""
    root, _, _, _ = hf_archived
    out = restore_checkpoint(root / "repo", tmp_path)
    assert out == tmp_path / "checkpoint-4" and (out / "trainer_state.json").is_file()
    (out / "trainer_state.json").write_text("{}")  # edited since the restore
    with pytest.raises(OutputExists):
        restore_checkpoint(root / "repo", tmp_path)
    assert restore_checkpoint(root / "repo", tmp_path, force=True) == out
    assert (out / "trainer_state.json").read_text() != "{}"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "checkpoint-4").mkdir()  # the Trainer's own folder, never restored
    with pytest.raises(OutputExists):
        restore_checkpoint(root / "repo", tmp_path / "other")


def _restore_in_child(repo, out, conn):
    try:
        conn.send(("ok", str(restore_checkpoint(repo, out, generation=1))))
    except BaseException as exc:  # noqa: BLE001 - sent to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def test_restore_checkpoint_on_every_process_restores_once_and_each_gets_the_folder(hf_archived, tmp_path):
    """Guards the multi-process resume: under torchrun every rank runs
    trainer.train(resume_from_checkpoint=restore_checkpoint(...)) into the same output_dir. A later rank got
    OutputExists (its job died) or replaced the folder while rank 0 was loading it. Now the first restores under a
    file lock and every other call returns that folder, untouched."""
    import multiprocessing

    root, _, _, _ = hf_archived
    first = restore_checkpoint(root / "repo", tmp_path / "seq", generation=1)
    inode = (first / "optimizer.pt").stat().st_ino
    assert restore_checkpoint(root / "repo", tmp_path / "seq", generation=1) == first  # the second rank, later
    assert (first / "optimizer.pt").stat().st_ino == inode  # not rewritten under a rank that reads it
    ctx = multiprocessing.get_context("fork")
    for attempt in range(2):  # the ranks at once
        out = tmp_path / f"par{attempt}"
        pipes = [ctx.Pipe(duplex=False) for _ in range(3)]
        procs = [ctx.Process(target=_restore_in_child, args=(root / "repo", out, w)) for _, w in pipes]
        for p in procs:
            p.start()
        answers = [r.recv() for r, _ in pipes]
        for p in procs:
            p.join(60)
        assert answers == [("ok", str(out / "checkpoint-2"))] * 3, answers
    assert ckpt_archive.verify(root / "repo", 1).ok


def test_restore_checkpoint_refuses_a_generation_not_packed_from_a_trainer_folder(tmp_path):
    ckpt_archive.pack({"model": {"w": torch.ones(2)}, "step": 3}, tmp_path / "repo")
    with pytest.raises(UsageError, match="not a Hugging Face Trainer checkpoint-N/ folder"):
        restore_checkpoint(tmp_path / "repo", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_train_end_exports_the_usable_generations_and_writes_the_proof(hf_archived):
    root, cb, _, _ = hf_archived
    res = cb.export_result
    assert res is not None and res.ok and [g.generation for g in res.generations] == [1, 2]
    assert (root / "proof.md").is_file() and "checkpoint" in (root / "proof.md").read_text()
    dest = ckpt_archive.list_generations(root / "offsite")
    assert [(g.number, g.status) for g in dest] == [(1, "usable"), (2, "usable")]
    assert ckpt_archive.verify(root / "offsite", options=ckpt_archive.VerifyOptions(deep=True)).ok


def test_end_of_rental_backup_of_the_trainer_folder_adds_no_duplicate(hf_archived):
    """scripts/end-of-rental.sh runs `backup` on the output folder: what the callback archived is recognised."""
    root, _, _, _ = hf_archived
    res = ckpt_archive.backup(root / "run", str(root / "repo"), options=ckpt_archive.BackupOptions(settle=0))
    assert res.action == "unchanged" and res.generation == 2, res


def test_only_the_main_process_archives_and_every_rank_meets_at_the_barrier(tmp_path, monkeypatch):
    """Guards two multi-process faults: a non-main rank writing generations, and rank 0 snapshotting before the
    other ranks wrote their files (rng_state_1.pth): on_save meets every rank at a barrier first."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    ckpt = tmp_path / "run" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"global_step": 2}')
    cb = ArchiveCallback(tmp_path / "repo")
    state = transformers.TrainerState(global_step=2, is_world_process_zero=False)
    cb.on_save(_args(tmp_path / "run"), state, transformers.TrainerControl())
    cb.on_train_end(_args(tmp_path / "run"), state, transformers.TrainerControl())
    assert calls == ["barrier"]
    assert not (tmp_path / "repo").exists() and not (tmp_path / "run" / "_ckpt-archive-staging").exists()


def test_a_failed_publish_stops_training_at_the_next_save_naming_the_folder(tmp_path):
    """A checkpoint that could not be archived is never silent: its failure is raised at the next Trainer event."""
    ckpt = tmp_path / "run" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"global_step": 2}')
    (ckpt / "optimizer.pt").write_bytes(b"")  # an interrupted write: refused by the reader
    cb = ArchiveCallback(tmp_path / "repo")
    args, control = _args(tmp_path / "run"), transformers.TrainerControl()
    cb.on_save(args, transformers.TrainerState(global_step=2), control)
    with pytest.raises(ckpt_archive.errors.SourceError) as info:
        cb.on_train_end(args, transformers.TrainerState(global_step=2), control)
    assert "checkpoint-2" in "".join(getattr(info.value, "__notes__", []))
    assert ckpt_archive.list_generations(tmp_path / "repo") == []


def test_import_ckpt_archive_imports_neither_transformers_nor_lightning():
    """The integrations are optional extras: importing the package (and the integrations package, and the folder
    publisher) must not pull in transformers or lightning."""
    code = ("import sys, ckpt_archive, ckpt_archive.integrations\n"
            "ckpt_archive.integrations.FolderPublisher\n"
            "ckpt_archive.Checkpointer\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'lightning', "
            "'pytorch_lightning', 'lightning_fabric', 'accelerate'))\n"
            "print(bad)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
