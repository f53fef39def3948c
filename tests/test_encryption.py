"""Encrypted repositories end to end (issue 28): nothing from the source lies in the clear, every reader needs
the key, tampering is damage naming the member, and dedup / verify --deep / retention / export keep working.

The format pieces on their own are in tests/test_crypto_format.py.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import EXIT_CANNOT_CHECK, EXIT_CHECK_FAILED
from ckpt_archive.format import crypto
from ckpt_archive.repo.repository import Repository
from tests.helpers import assert_same

SECRET_CONFIG = "lr-schedule-SECRETCONFIG-7f3a"
SECRET_ID = "sample-SECRETDATAID-99"


@pytest.fixture()
def keyfile(tmp_path) -> Path:
    p = tmp_path / "repo.key"
    p.write_bytes(crypto.new_key_file_text())
    return p


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(512, 512, generator=g), "frozen": torch.ones(700, 700),
                      "b": torch.arange(5, dtype=torch.bfloat16)},
            "progress": {"step": 10 + seed}, "note": "SECRETSTRING-in-state"}


def _pack(repo, keyfile, state, **kw):
    r = repo if isinstance(repo, Repository) else Repository.open(repo, create=True, key_file=keyfile)
    return ckpt_archive.pack(state, r, annotations=ckpt_archive.Annotations(
        config={"schedule": SECRET_CONFIG}, data_ids=[SECRET_ID, "x"]),
        options=ckpt_archive.PackOptions(share_min_bytes=64 << 10), **kw)


def _every_stored_byte(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_no_config_value_tensor_byte_or_data_id_lies_in_any_stored_file(tmp_path, keyfile):
    """The founding promise of encryption: the bucket holds nothing of the source in the clear."""
    state = _state()
    _pack(tmp_path / "r", keyfile, state)
    blob = _every_stored_byte(tmp_path / "r")
    w = state["model"]["w"].numpy().tobytes()
    for needle in (SECRET_CONFIG.encode(), SECRET_ID.encode(), b"SECRETSTRING-in-state", w[:32], w[-32:],
                   b"archive_id", b"\"step\""):
        assert needle not in blob, needle
    # object names are keyed: the raw fingerprint of a tensor does not name its file
    from ckpt_archive.format.fingerprint import digest
    raw_hex = digest(torch.ones(700, 700).numpy().tobytes()).partition(":")[2]
    names = " ".join(str(p) for p in (tmp_path / "r").rglob("*"))
    assert raw_hex not in names and raw_hex[:16] not in names


def test_restore_with_the_key_is_byte_identical_and_without_it_exits_2(tmp_path, keyfile):
    src = tmp_path / "ckpt.pt"
    torch.save(_state(), src)
    r = Repository.open(tmp_path / "r", create=True, key_file=keyfile)
    ckpt_archive.pack(src, r)
    out = tmp_path / "back.pt"
    ckpt_archive.restore(Repository.open(tmp_path / "r", key_file=keyfile), "latest", out)
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    with pytest.raises(crypto.KeyRefused, match="encrypted; give --key-file") as ei:
        Repository.open(tmp_path / "r")
    assert ei.value.exit_code == EXIT_CANNOT_CHECK
    other = tmp_path / "other.key"
    other.write_bytes(crypto.new_key_file_text())
    with pytest.raises(crypto.KeyRefused, match="does not open"):
        Repository.open(tmp_path / "r", key_file=other)


def test_the_key_comes_from_the_environment_too(tmp_path, keyfile, monkeypatch):
    monkeypatch.setenv("CKPT_ARCHIVE_KEY_FILE", str(keyfile))
    _pack(tmp_path / "r", None, _state())
    assert ckpt_archive.verify(tmp_path / "r", options=ckpt_archive.VerifyOptions(deep=True)).ok
    assert "encryption" in (tmp_path / "r" / "repository.json").read_text()


@pytest.mark.parametrize("victim", ["manifest.json", "USABLE.json", "tree.json.ckz", "tensors-00000.safetensors.ckz",
                                    "object"])
def test_a_tampered_ciphertext_is_damage_naming_the_member(tmp_path, keyfile, victim):
    _pack(tmp_path / "r", keyfile, _state())
    gen = tmp_path / "r" / "generations" / "00000001"
    path = next((tmp_path / "r" / "objects").rglob("*.ckz")) if victim == "object" else gen / victim
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    r = Repository.open(tmp_path / "r", key_file=keyfile)
    if victim in ("manifest.json", "USABLE.json"):
        g = r.generation(1)
        assert g.status == "damaged" and "authentication tag" in g.reason
        return
    rep = ckpt_archive.verify(r, "1", options=ckpt_archive.VerifyOptions(deep=True))
    assert not rep.ok
    text = " ".join(f"{p.member or p.field}: {p.reason}" for p in rep.problems)
    assert "authentication tag" in text or "sha256" in text, text
    with pytest.raises(ckpt_archive.errors.CheckFailed) as ei:
        ckpt_archive.load(r, "1")
    assert ei.value.exit_code == EXIT_CHECK_FAILED


def test_dedup_verify_deep_and_retention_keep_working_with_the_key(tmp_path, keyfile):
    r = Repository.open(tmp_path / "r", create=True, key_file=keyfile)
    for seed in range(3):
        st = _state(seed)
        _pack(r, keyfile, st, retention=ckpt_archive.RetentionPolicy(keep_last=2))
    gens = ckpt_archive.list_generations(r)
    assert [g.number for g in gens] == [2, 3]
    objects = list((tmp_path / "r" / "objects").rglob("*.ckz"))
    # "frozen" is the same in every generation: one object for it, plus one "w" per kept generation
    assert len(objects) == 3, objects
    for g in (2, 3):
        assert ckpt_archive.verify(r, str(g), options=ckpt_archive.VerifyOptions(deep=True)).ok
        assert_same(_state(g - 1), ckpt_archive.load(r, str(g)))


def test_changing_the_key_rewraps_the_data_key_and_re_encrypts_nothing(tmp_path, keyfile):
    from ckpt_archive.ops.keys import change_repository_key

    _pack(tmp_path / "r", keyfile, _state())
    before = {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file() and p.name != "repository.json"}
    new = tmp_path / "new.key"
    new.write_bytes(crypto.new_key_file_text())
    change_repository_key(tmp_path / "r", keyfile, new)
    assert {p: p.read_bytes() for p in before} == before
    assert ckpt_archive.verify(Repository.open(tmp_path / "r", key_file=new),
                               options=ckpt_archive.VerifyOptions(deep=True)).ok
    with pytest.raises(crypto.KeyRefused):
        Repository.open(tmp_path / "r", key_file=keyfile)


def test_a_key_file_for_a_plain_repository_is_refused_not_ignored(tmp_path, keyfile):
    """pack --key-file into an existing plain repository must not write plaintext the user believes encrypted."""
    ckpt_archive.pack(_state(), tmp_path / "r")
    with pytest.raises(ckpt_archive.errors.UsageError, match="not encrypted"):
        Repository.open(tmp_path / "r", key_file=keyfile)


def test_key_material_never_reaches_output_json_the_proof_the_manifest_or_an_error(tmp_path, keyfile):
    """Keys and passwords never reach logs, --json, the proof report, the manifest or a traceback (issue 28)."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    runner = CliRunner()
    sign = tmp_path / "signer"
    assert runner.invoke(app, ["key", "new", str(sign)]).exit_code == 0
    secrets_ = [keyfile.read_bytes().strip(), b"".join(sign.read_bytes().splitlines()[1:-1])[:40]]
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    repo, dest = tmp_path / "r", tmp_path / "dest"
    outputs = []
    for args in (["pack", src, "--repo", repo, "--key-file", keyfile, "--sign-key", sign, "--json"],
                 ["list", repo, "--key-file", keyfile, "--json"],
                 ["verify", repo, "--deep", "--key-file", keyfile, "--trust", f"{sign}.pub", "--json"],
                 ["inspect", repo, "--key-file", keyfile],
                 ["export", repo, "--to", dest, "--key-file", keyfile, "--to-key-file", keyfile, "--report",
                  tmp_path / "proof.md"],
                 ["restore", repo, "--output", tmp_path / "o.pt", "--key-file", keyfile, "--json"],
                 ["verify", repo, "--key-file", tmp_path / "proof.md"],  # a wrong key: an error, exit 2
                 ["verify", repo]):  # no key: exit 2
        res = runner.invoke(app, [str(a) for a in args])
        outputs.append(res.stdout + (res.stderr or ""))
        assert "Traceback" not in outputs[-1]
        assert res.exit_code == (2 if args[0] == "verify" and "--deep" not in args else 0), outputs[-1]
    stored = _every_stored_byte(repo) + _every_stored_byte(dest) + (tmp_path / "proof.md").read_bytes()
    for secret in secrets_:
        assert secret and secret not in stored
        for text in outputs:
            assert secret.decode() not in text


# --- export between plain and encrypted repositories, through the CLI (issue 28) ------------------------------
def _cli_ok(*args, code: int = 0):
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    text = res.stdout + (res.stderr or "")
    assert "Traceback" not in text and res.exit_code == code, text
    return text


def _plain_dest_holds_the_state(dest: Path, src: Path) -> None:
    assert "encryption" not in (dest / "repository.json").read_text()
    assert ckpt_archive.verify(dest, options=ckpt_archive.VerifyOptions(deep=True)).ok
    out = dest.parent / "back.pt"
    ckpt_archive.restore(dest, "latest", out)
    assert out.read_bytes() == src.read_bytes()


def test_export_key_file_encrypts_the_copy_of_a_plain_source(tmp_path, keyfile, monkeypatch):
    """`export --key-file K` from a plain source writes an encrypted destination (the issue's wording); it was
    refused ("not encrypted") and needed --to-key-file."""
    monkeypatch.delenv("CKPT_ARCHIVE_KEY_FILE", raising=False)
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    ckpt_archive.pack(src, tmp_path / "plain")
    _cli_ok("export", tmp_path / "plain", "--to", tmp_path / "enc", "--key-file", keyfile)
    assert "encryption" in (tmp_path / "enc" / "repository.json").read_text()
    assert _every_stored_byte(tmp_path / "enc").find(b"SECRETSTRING-in-state") < 0
    with pytest.raises(crypto.KeyRefused):
        Repository.open(tmp_path / "enc")
    r = Repository.open(tmp_path / "enc", key_file=keyfile)
    assert ckpt_archive.verify(r, options=ckpt_archive.VerifyOptions(deep=True)).ok
    ckpt_archive.restore(r, "latest", tmp_path / "back.pt")
    assert (tmp_path / "back.pt").read_bytes() == src.read_bytes()


def test_export_of_an_encrypted_source_stays_encrypted_unless_to_plain(tmp_path, keyfile, monkeypatch):
    """The reverse is asked for, never the default: `export ENC --key-file K` (the key to read it) used to write
    DEST in the clear, so copying an encrypted repository to a bucket silently published it decrypted. The copy
    is now encrypted with K unless --to-plain; --to-key-file names another key."""
    monkeypatch.delenv("CKPT_ARCHIVE_KEY_FILE", raising=False)
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    ckpt_archive.pack(src, Repository.open(tmp_path / "enc", create=True, key_file=keyfile))
    _cli_ok("export", tmp_path / "enc", "--to", tmp_path / "same", "--key-file", keyfile)
    assert ckpt_archive.verify(Repository.open(tmp_path / "same", key_file=keyfile),
                               options=ckpt_archive.VerifyOptions(deep=True)).ok
    assert _every_stored_byte(tmp_path / "same").find(b"SECRETSTRING-in-state") < 0
    other = tmp_path / "other.key"
    other.write_bytes(crypto.new_key_file_text())
    _cli_ok("export", tmp_path / "enc", "--to", tmp_path / "other", "--key-file", keyfile, "--to-key-file", other)
    assert ckpt_archive.verify(Repository.open(tmp_path / "other", key_file=other),
                               options=ckpt_archive.VerifyOptions(deep=True)).ok
    with pytest.raises(crypto.KeyRefused):
        Repository.open(tmp_path / "other", key_file=keyfile)
    _cli_ok("export", tmp_path / "enc", "--to", tmp_path / "plain", "--key-file", keyfile, "--to-plain")
    _plain_dest_holds_the_state(tmp_path / "plain", src)
    # an existing plain destination is not written in the clear by accident; an encrypted one not with a wrong key
    text = _cli_ok("export", tmp_path / "enc", "--to", tmp_path / "plain", "--key-file", keyfile, code=2)
    assert "not encrypted" in text and "--to-plain" in text, text
    text = _cli_ok("export", tmp_path / "enc", "--to", tmp_path / "other", "--key-file", keyfile, code=2)
    assert "--to-key-file" in text, text
    text = _cli_ok("export", tmp_path / "enc", "--to", tmp_path / "x", "--key-file", keyfile, "--to-plain",
                   "--to-key-file", other, code=2)
    assert "--to-plain" in text and not (tmp_path / "x").exists()


def test_the_library_never_writes_an_encrypted_source_in_the_clear_unasked(tmp_path, keyfile, monkeypatch):
    """ckpt_archive.export(ENC, DEST) wrote DEST in the clear; the transformers integration's export_to did so
    for every encrypted repository. Now: the destination is encrypted with $CKPT_ARCHIVE_KEY_FILE when that
    opened the source, else refused unless to_plain=True or to_key_file= is given."""
    ckpt_archive.pack(_state(), Repository.open(tmp_path / "enc", create=True, key_file=keyfile))
    monkeypatch.delenv("CKPT_ARCHIVE_KEY_FILE", raising=False)
    with pytest.raises(ckpt_archive.errors.UsageError, match="to_plain"):
        ckpt_archive.export(Repository.open(tmp_path / "enc", key_file=keyfile), tmp_path / "d1")
    assert not (tmp_path / "d1" / "generations").exists()
    monkeypatch.setenv("CKPT_ARCHIVE_KEY_FILE", str(keyfile))
    ckpt_archive.export(tmp_path / "enc", tmp_path / "d2")
    assert "encryption" in (tmp_path / "d2" / "repository.json").read_text()
    assert ckpt_archive.verify(tmp_path / "d2", options=ckpt_archive.VerifyOptions(deep=True)).ok
    ckpt_archive.export(tmp_path / "enc", tmp_path / "d3", ckpt_archive.ExportOptions(to_plain=True))
    assert "encryption" not in (tmp_path / "d3" / "repository.json").read_text()


def _forms(secret: bytes) -> list[str]:
    """Every way a secret's bytes could be printed: hex (both cases), base64 (padded or not, url-safe)."""
    import base64

    out = [secret.hex(), secret.hex().upper(), base64.b64encode(secret).decode(),
           base64.b64encode(secret).decode().rstrip("="), base64.urlsafe_b64encode(secret).decode().rstrip("=")]
    return [f for f in out if len(f) >= 16]


def test_no_key_or_password_in_any_form_reaches_output_json_logs_reports_manifests_or_errors(tmp_path, keyfile, caplog,
                                                                                              monkeypatch):
    """Issue 28: keys and passwords never reach logs, --json, the proof report, the manifest or a traceback. Every
    command, with --json and without, plus the Checkpointer's log, both proof reports, every stored file, and
    the manifests and markers as a reader decrypts them, are searched for: the key file's line, a passphrase
    key file, the 32 key bytes and the repository's data key (hex, base64), and the signing key's PEM lines
    and raw private bytes."""
    import base64
    import logging

    from cryptography.hazmat.primitives import serialization
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app
    from ckpt_archive.format import signature

    runner = CliRunner()
    monkeypatch.setattr(crypto, "SCRYPT_N", 1 << 10)  # recorded in repository.json: each open derives in ~1 ms
    passphrase = tmp_path / "pass.key"
    passphrase.write_bytes(b"correct horse SECRETPASSPHRASE battery\n")
    sign = tmp_path / "signer"
    assert runner.invoke(app, ["key", "new", str(sign)]).exit_code == 0
    new_key = tmp_path / "new.key"
    outputs = [runner.invoke(app, ["key", "new", "--encryption", str(new_key)]).stdout]
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    repo, dest, plain, proof_md, proof_json = (tmp_path / "r", tmp_path / "dest", tmp_path / "plain",
                                               tmp_path / "proof.md", tmp_path / "proof.json")
    k, p, s = ["--key-file", keyfile], ["--key-file", passphrase], ["--trust", f"{sign}.pub"]
    cases = [(["pack", src, "--repo", repo, *k, "--sign-key", sign], 0),
             (["pack", src, "--repo", repo, *k, "--sign-key", sign, "--json"], 0)]
    for args in (["list", repo, *k, *s], ["verify", repo, *k, *s], ["verify", repo, "--deep", *k, *s],
                 ["inspect", repo, *k], ["status", repo, *k],
                 ["restore", repo, "--output", tmp_path / "o.pt", "--force", *k, *s]):
        cases += [(args, 0), (args + ["--json"], 0)]
    cases += [(["export", repo, "--to", dest, *k, "--to-key-file", passphrase, "--report", proof_md], 0),
              (["export", repo, "--to", dest, *k, "--to-key-file", passphrase, "--report", proof_json, "--json"], 0),
              (["export", repo, "--to", plain, *k, "--to-plain", "--json"], 0),
              (["verify", dest, "--deep", *p, *s, "--json"], 0),
              (["verify", repo, "--key-file", new_key], 2), (["verify", repo, "--key-file", new_key, "--json"], 2),
              (["verify", repo], 2), (["verify", dest, *k, "--json"], 2),
              (["key", "change", dest, "--key-file", new_key, "--new-key-file", keyfile], 2),
              (["key", "change", dest, *p, "--new-key-file", new_key], 0)]
    for args, code in cases:
        res = runner.invoke(app, [str(a) for a in args])
        outputs.append(res.stdout + (res.stderr or ""))
        assert res.exit_code == code and "Traceback" not in outputs[-1], (args, outputs[-1])
    # the Checkpointer (keys from the environment) and its log
    env = {"CKPT_ARCHIVE_KEY_FILE": str(keyfile), "CKPT_ARCHIVE_SIGN_KEY": str(sign)}
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.DEBUG):
        for name, value in env.items():
            mp.setenv(name, value)
        with ckpt_archive.Checkpointer(tmp_path / "ck") as ck:
            ck.save(1, _state(), {"loss": 1.0}, block=True)
    outputs.append(caplog.text)
    # what is stored, raw and as a reader decrypts it
    blobs = [_every_stored_byte(d) for d in (repo, dest, plain, tmp_path / "ck")]
    blobs += [proof_md.read_bytes(), proof_json.read_bytes()]
    for where, key in ((repo, keyfile), (dest, new_key), (tmp_path / "ck", keyfile)):
        r = Repository.open(where, key_file=key)
        for g in r.generations():
            blobs += [r.store.read_bytes(f"{g.key}/manifest.json"), r.store.read_bytes(f"{g.key}/USABLE.json")]
    cfg = json.loads((repo / "repository.json").read_text())
    data_key, _ = crypto.unwrap_data_key(cfg["encryption"]["keys"], crypto.read_key_material(keyfile.read_bytes(), "k"),
                                         cfg["id"])
    key_line = keyfile.read_bytes().strip()
    private = signature.load_private(sign.read_bytes(), "sign")
    raw_private = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                        serialization.NoEncryption())
    materials = [key_line, new_key.read_bytes().strip(), passphrase.read_bytes().strip()]  # what a key file holds
    needles = [key_line.decode(), new_key.read_bytes().strip().decode(), "SECRETPASSPHRASE",
               *(f for m in materials for f in _forms(m)), *_forms(base64.b64decode(key_line)),
               *_forms(base64.b64decode(materials[1])), *_forms(data_key), *_forms(raw_private),
               *(line.decode() for line in sign.read_bytes().splitlines()[1:-1])]
    binary = [key_line, b"SECRETPASSPHRASE", base64.b64decode(key_line), data_key, raw_private]
    for text in outputs:
        for needle in needles:
            assert needle not in text, (needle, text[-400:])
    for blob in blobs:
        for needle in [n.encode() for n in needles] + binary:
            assert needle not in blob, needle
