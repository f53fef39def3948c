"""Signing and encryption from inside training (issue 28): the Checkpointer and the integrations take the keys
from the environment (``CKPT_ARCHIVE_KEY_FILE``, ``CKPT_ARCHIVE_SIGN_KEY``) or from a repository object opened
with them (``Repository.open(path, key_file=..., sign_key=...)``), as docs/checkpointer.md and
docs/integrations-*.md say. A key given on the object must survive every place an integration opens the
repository again (forgetting, exporting): a path there loses it.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from ckpt_archive.format import crypto  # noqa: E402
from ckpt_archive.ops.keys import new_key  # noqa: E402
from ckpt_archive.repo.repository import Repository  # noqa: E402

_ENV = ("CKPT_ARCHIVE_KEY_FILE", "CKPT_ARCHIVE_SIGN_KEY", "CKPT_ARCHIVE_TRUST")


@pytest.fixture()
def keys(tmp_path, monkeypatch) -> SimpleNamespace:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(crypto, "SCRYPT_N", 1 << 10)  # recorded in repository.json: each open derives in ~1 ms
    key = tmp_path / "repo.key"
    key.write_bytes(crypto.new_key_file_text())
    signer = new_key(tmp_path / "signer")
    return SimpleNamespace(key_file=key, sign_key=signer.path, trust=signer.public_path, fingerprint=signer.fingerprint)


def _encrypted_and_signed(repo: Path, keys, n: int = 1) -> Repository:
    """Every generation of ``repo`` is encrypted (refused without the key) and signed by the trusted key."""
    assert "encryption" in json.loads((repo / "repository.json").read_text())
    with pytest.raises(crypto.KeyRefused):
        Repository.open(repo, key_file=False)  # no key at all (the environment's not read)
    r = Repository.open(repo, key_file=keys.key_file, trust=keys.trust)
    gens = r.usable()
    assert len(gens) == n and all(g.signer == keys.fingerprint for g in gens)
    assert ckpt_archive.verify(r, options=ckpt_archive.VerifyOptions(deep=True)).ok
    return r


def _state(step: int) -> dict:
    return {"model": {"w": torch.arange(8.0) + step}, "progress": {"step": step}}


@pytest.mark.parametrize("how", ["environment", "repository object"])
def test_the_checkpointer_signs_and_encrypts_with_the_environment_or_an_opened_repository(tmp_path, keys, how,
                                                                                         monkeypatch):
    if how == "environment":
        monkeypatch.setenv("CKPT_ARCHIVE_KEY_FILE", str(keys.key_file))
        monkeypatch.setenv("CKPT_ARCHIVE_SIGN_KEY", str(keys.sign_key))
        repo = tmp_path / "r"
    else:
        repo = Repository.open(tmp_path / "r", create=True, key_file=keys.key_file, sign_key=keys.sign_key)
    with ckpt_archive.Checkpointer(repo) as ck:
        ck.save(1, _state(1), block=True)
        ck.save(2, _state(2), block=True)
    r = _encrypted_and_signed(tmp_path / "r", keys, 2)
    assert ckpt_archive.load(r)["progress"]["step"] == 2
    with ckpt_archive.Checkpointer(Repository.open(tmp_path / "r", key_file=keys.key_file, trust=keys.trust)) as ck:
        assert ck.restore().step == 2  # resumes from the encrypted, signed repository


@pytest.mark.parametrize("how", ["environment", "repository object"])
def test_the_folder_publisher_of_accelerate_and_transformers_signs_and_encrypts(tmp_path, keys, how, monkeypatch):
    from ckpt_archive.integrations.folder import FolderPublisher

    if how == "environment":
        monkeypatch.setenv("CKPT_ARCHIVE_KEY_FILE", str(keys.key_file))
        monkeypatch.setenv("CKPT_ARCHIVE_SIGN_KEY", str(keys.sign_key))
        repo = tmp_path / "r"
    else:
        repo = Repository.open(tmp_path / "r", create=True, key_file=keys.key_file, sign_key=keys.sign_key)
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    torch.save(_state(1), folder / "model.pt")
    pub = FolderPublisher(repo)
    pub.publish(folder, step=1, block=True)
    pub.close()
    _encrypted_and_signed(tmp_path / "r", keys)


def test_the_transformers_export_keeps_the_key_of_the_repository_object(tmp_path, keys):
    """ArchiveCallback(export_to=...) exported from the repository's *path*: a key given on the repository object
    was lost there (KeyRefused at the end of training). It now exports the object; the copy is encrypted with
    export_options' to_key_file, and without a key for it the export is refused rather than written in the
    clear."""
    pytest.importorskip("transformers")
    from ckpt_archive.integrations.transformers import ArchiveCallback

    repo = Repository.open(tmp_path / "r", create=True, key_file=keys.key_file, sign_key=keys.sign_key)
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    torch.save(_state(1), out / "checkpoint-1" / "model.pt")
    args = SimpleNamespace(output_dir=str(out))
    state = SimpleNamespace(global_step=1, is_world_process_zero=True, log_history=[], trial_name=None)
    cb = ArchiveCallback(repo, export_to=tmp_path / "offsite", config={}, export_options={"to_key_file": keys.key_file},
                         report=tmp_path / "proof.md")
    cb.on_save(args, state, None)
    cb.on_train_end(args, state, None)
    cb.close()
    assert cb.export_result.ok
    _encrypted_and_signed(tmp_path / "offsite", keys)
    cb = ArchiveCallback(repo, export_to=tmp_path / "clear", config={}, report=tmp_path / "proof2.md")
    cb.on_save(args, SimpleNamespace(**{**vars(state), "global_step": 1}), None)
    with pytest.raises(ckpt_archive.errors.UsageError, match="to_plain"):
        cb.on_train_end(args, state, None)
    cb.close()
    assert not (tmp_path / "clear" / "generations").exists()


def test_lightning_forgets_through_the_repository_object_it_was_given(tmp_path, keys):
    """ArchiveCheckpointIO's removals (ModelCheckpoint's top-k) reopened the repository by its path, without the
    key of the object it was given: every removal of an encrypted repository failed."""
    pytest.importorskip("lightning")
    from ckpt_archive.integrations.lightning import ArchiveCheckpointIO

    repo = Repository.open(tmp_path / "r", create=True, key_file=keys.key_file, sign_key=keys.sign_key)
    io = ArchiveCheckpointIO(repo)
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "c.ckpt")
    io.teardown()
    assert io.forgotten == [1]
    _encrypted_and_signed(tmp_path / "r", keys, 2)
