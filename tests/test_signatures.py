"""Signed generations (issue 28): who wrote a generation is proven by an Ed25519 signature in its marker.

A resealed marker over edited metadata, a missing signature or a foreign key is refused with --trust
(exit 1, nothing restored); a present signature is checked even without --trust; export and adopt carry
the signature, since it covers content, not place.
"""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import EXIT_CHECK_FAILED
from ckpt_archive.format.signature import SignatureProblem
from ckpt_archive.ops.keys import new_key
from ckpt_archive.repo.repository import Repository


@pytest.fixture()
def keypair(tmp_path):
    res = new_key(tmp_path / "signer")
    return res


def _pack(tmp_path, keypair, name="r"):
    r = Repository.open(tmp_path / name, create=True, sign_key=keypair.path)
    ckpt_archive.pack({"model": {"w": torch.arange(12.0)}, "progress": {"step": 3}}, r,
                      annotations=ckpt_archive.Annotations(metrics={"val_loss": 0.5}))
    return tmp_path / name


def _reseal_with_edited_metrics(repo, *, drop_signature: bool = False) -> None:
    """What someone who can write the bucket does: edit the manifest, recompute its sha256 into the marker."""
    gen = repo / "generations" / "00000001"
    doc = json.loads((gen / "manifest.json").read_bytes())
    doc["metrics"] = {"val_loss": 0.01}
    raw = json.dumps(doc, indent=1).encode()
    (gen / "manifest.json").write_bytes(raw)
    marker = json.loads((gen / "USABLE.json").read_bytes())
    marker["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    if drop_signature:
        marker.pop("signature")
    (gen / "USABLE.json").write_bytes(json.dumps(marker).encode())


def test_key_new_writes_a_0600_private_key_and_never_overwrites(tmp_path, keypair):
    assert (tmp_path / "signer").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "signer.pub").read_text().startswith("ssh-ed25519 ")
    with pytest.raises(ckpt_archive.errors.OutputExists):
        new_key(tmp_path / "signer")


def test_a_signed_generation_verifies_with_its_key_trusted_and_shows_the_signer(tmp_path, keypair):
    repo = _pack(tmp_path, keypair)
    r = Repository.open(repo, trust=keypair.public_path)
    g = r.generation(1)
    assert g.status == "usable" and g.signer == keypair.fingerprint
    assert ckpt_archive.verify(r, options=ckpt_archive.VerifyOptions(deep=True)).ok
    assert ckpt_archive.load(r)["progress"]["step"] == 3
    assert ckpt_archive.list_generations(repo)[0].to_json()["signed_by"] == keypair.fingerprint


def test_edited_metrics_under_a_resealed_marker_are_refused(tmp_path, keypair):
    """The marker's manifest sha256 can be recomputed by anyone; the signature cannot."""
    repo = _pack(tmp_path, keypair)
    _reseal_with_edited_metrics(repo)
    r = Repository.open(repo, trust=keypair.public_path)
    assert r.generation(1).status == "damaged"
    with pytest.raises(SignatureProblem) as ei:
        ckpt_archive.load(r, "1")
    assert ei.value.exit_code == EXIT_CHECK_FAILED
    rep = ckpt_archive.verify(r, "1")
    assert not rep.ok and "signature" in " ".join(p.reason for p in rep.problems)
    # without --trust a present signature is still checked
    assert Repository.open(repo).generation(1).status == "damaged"


def test_a_stripped_signature_is_refused_with_trust_and_nothing_is_restored(tmp_path, keypair):
    repo = _pack(tmp_path, keypair)
    _reseal_with_edited_metrics(repo, drop_signature=True)
    out = tmp_path / "out.pt"
    with pytest.raises(SignatureProblem, match="not signed"):
        ckpt_archive.restore(Repository.open(repo, trust=keypair.public_path), "latest", out)
    assert not out.exists()


def test_a_foreign_signer_is_refused_with_trust(tmp_path, keypair):
    repo = _pack(tmp_path, keypair)
    other = new_key(tmp_path / "other")
    with pytest.raises(SignatureProblem, match="not by a trusted key"):
        ckpt_archive.load(Repository.open(repo, trust=other.public_path))
    rep = ckpt_archive.verify(Repository.open(repo, trust=other.public_path),
                              options=ckpt_archive.VerifyOptions(deep=True))
    assert not rep.ok and "not by a trusted key" in rep.problems[0].reason


def test_trust_comes_from_the_environment(tmp_path, keypair, monkeypatch):
    repo = _pack(tmp_path, keypair)
    other = new_key(tmp_path / "other")
    monkeypatch.setenv("CKPT_ARCHIVE_TRUST", other.public_path)
    with pytest.raises(SignatureProblem):
        ckpt_archive.load(repo)


def test_export_and_adopt_carry_the_signature(tmp_path, keypair):
    repo = _pack(tmp_path, keypair)
    ckpt_archive.export(repo, tmp_path / "dest")
    r = Repository.open(tmp_path / "dest", trust=keypair.public_path)
    assert r.generation(1).signer == keypair.fingerprint
    assert ckpt_archive.verify(r, options=ckpt_archive.VerifyOptions(deep=True)).ok
    shutil.copytree(tmp_path / "dest", tmp_path / "moved")
    rep = ckpt_archive.verify(tmp_path / "moved", "1", ckpt_archive.VerifyOptions(deep=True))  # adopts the copy here
    assert rep.ok and rep.marked_usable
    assert Repository.open(tmp_path / "moved").generation(1).signer == keypair.fingerprint
