"""The encryption and signature formats (format/crypto.py, format/signature.py, store/encrypted.py) on their own.

The repository-level behaviour (pack/verify/restore of an encrypted or signed repository) is in
tests/test_encryption.py and tests/test_signatures.py.
"""
from __future__ import annotations

import os

import pytest

from ckpt_archive.errors import IntegrityError
from ckpt_archive.format import crypto, signature

SEG = crypto.SEGMENT_BYTES


@pytest.mark.parametrize("n", [0, 1, SEG - 1, SEG, SEG + 1, 2 * SEG, 3 * SEG + 5])
def test_plaintext_size_inverts_encrypted_size_at_every_segment_edge(n):
    assert crypto.plaintext_size(crypto.encrypted_size(n)) == n


@pytest.mark.parametrize("m", [0, crypto.HEADER_BYTES + 15, crypto.encrypted_size(SEG) + 3,
                               crypto.encrypted_size(SEG) + crypto.TAG_BYTES])
def test_a_ciphertext_size_no_plaintext_gives_is_damage(m):
    """A file cut or extended off a segment boundary must be refused from its size alone."""
    with pytest.raises(IntegrityError):
        crypto.plaintext_size(m)


def _store(tmp_path):
    from ckpt_archive.store.encrypted import EncryptedStore
    from ckpt_archive.store.local import LocalStore

    inner = LocalStore(tmp_path / "repo")
    return EncryptedStore(inner, crypto.RepoKeys(crypto.new_data_key())), inner


@pytest.mark.parametrize("n", [0, 5, SEG, SEG + 1, 2 * SEG + 77])
def test_sealed_file_reads_back_exactly_and_holds_no_plaintext(tmp_path, n):
    store, inner = _store(tmp_path)
    data = (b"config lr=0.000123 " * (n // 19 + 1))[:n]
    with store.write_once("generations/00000001/m.ckz") as fh:
        for i in range(0, n, 300_000):
            fh.write(data[i:i + 300_000])
    assert store.read_bytes("generations/00000001/m.ckz") == data
    assert store.size("generations/00000001/m.ckz") == n
    raw = (tmp_path / "repo" / "generations/00000001/m.ckz").read_bytes()
    assert len(raw) == crypto.encrypted_size(n)
    if n >= 19:
        assert b"config lr=0.000123" not in raw
    with store.open_read("generations/00000001/m.ckz") as fh:
        assert fh.pread(10, max(0, n - 4)) == data[max(0, n - 4):]
        fh.seek(max(0, n // 2))
        assert fh.read(100) == data[n // 2:n // 2 + 100]


@pytest.mark.parametrize("where", ["header", "first segment", "last tag"])
def test_a_flipped_ciphertext_byte_is_damage_naming_the_file(tmp_path, where):
    store, _ = _store(tmp_path)
    data = os.urandom(SEG + 1000)
    store.write_bytes_once("generations/00000001/t.ckz", data)
    p = tmp_path / "repo" / "generations/00000001/t.ckz"
    raw = bytearray(p.read_bytes())
    pos = {"header": 12, "first segment": crypto.HEADER_BYTES + 5, "last tag": len(raw) - 1}[where]
    raw[pos] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as ei:
        store.read_bytes("generations/00000001/t.ckz")
    assert ei.value.where == "generations/00000001/t.ckz"


def test_a_file_cut_at_a_segment_boundary_fails_its_last_segment_flag(tmp_path):
    """STREAM's last-segment flag: dropping whole trailing segments must not give a shorter valid file."""
    store, _ = _store(tmp_path)
    store.write_bytes_once("a.ckz", os.urandom(2 * SEG + 10))
    p = tmp_path / "repo" / "a.ckz"
    raw = p.read_bytes()
    p.write_bytes(raw[:crypto.HEADER_BYTES + 2 * (SEG + crypto.TAG_BYTES)])
    with pytest.raises(IntegrityError, match="authentication tag"):
        store.read_bytes("a.ckz")


def test_segments_swapped_between_positions_fail(tmp_path):
    store, _ = _store(tmp_path)
    store.write_bytes_once("a.ckz", os.urandom(3 * SEG))
    p = tmp_path / "repo" / "a.ckz"
    raw = bytearray(p.read_bytes())
    h, s = crypto.HEADER_BYTES, SEG + crypto.TAG_BYTES
    raw[h:h + s], raw[h + s:h + 2 * s] = raw[h + s:h + 2 * s], raw[h:h + s]
    p.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        store.read_bytes("a.ckz")


def test_the_same_plaintext_never_gives_the_same_ciphertext(tmp_path):
    """A fresh salt (so a fresh segment key) per file: equal content is not visible as equal files."""
    store, _ = _store(tmp_path)
    store.write_bytes_once("a.ckz", b"x" * 1000)
    store.write_bytes_once("b.ckz", b"x" * 1000)
    assert (tmp_path / "repo/a.ckz").read_bytes() != (tmp_path / "repo/b.ckz").read_bytes()


def test_object_names_are_keyed_reversible_and_differ_between_repositories(tmp_path):
    from ckpt_archive.store.encrypted import EncryptedStore
    from ckpt_archive.store.local import LocalStore

    oid = "ab" + "1" * 62 + "-" + "2" * 64
    key = f"objects/ab/{oid}.ckz"
    stored = []
    for name in ("r1", "r2"):
        s = EncryptedStore(LocalStore(tmp_path / name), crypto.RepoKeys(crypto.new_data_key()))
        pend = s.new_object("objects/ab", "hint")
        pend.fh.write(b"tensor bytes")
        assert pend.commit(key)
        assert s.exists(key) and s.read_bytes(key) == b"tensor bytes"
        assert s.listdir("objects") == ["ab"] and s.listdir("objects/ab") == [f"{oid}.ckz"]
        on_disk = [str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*") if p.is_file()]
        assert len(on_disk) == 1 and oid not in on_disk[0] and "1111" not in on_disk[0]
        stored.append(on_disk[0])
    assert stored[0] != stored[1]


def test_a_key_record_opens_only_with_its_key_and_only_in_its_repository():
    dk = crypto.new_data_key()
    rec = crypto.wrap_data_key(dk, b"correct horse", "repo-a")
    assert crypto.unwrap_data_key([rec], b"correct horse", "repo-a")[0] == dk
    with pytest.raises(crypto.KeyRefused):
        crypto.unwrap_data_key([rec], b"wrong", "repo-a")
    with pytest.raises(crypto.KeyRefused):
        crypto.unwrap_data_key([rec], b"correct horse", "repo-b")


def test_hostile_scrypt_parameters_are_refused_before_any_allocation():
    rec = crypto.wrap_data_key(crypto.new_data_key(), b"k", "r")
    rec["kdf"]["n"] = 1 << 30
    with pytest.raises(crypto.KeyRefused, match="out of range"):
        crypto.unwrap_data_key([rec], b"k", "r")


def test_signature_covers_manifest_archive_generation_and_trial_reload():
    key = signature.load_private(signature.new_private_pem(), "k")
    stmt = signature.statement("a" * 64, "arch-1", 3, {"where": "/r", "tensors": 2})
    sig = signature.sign(key, stmt)
    fp = signature.fingerprint(key.public_key())
    assert signature.check(sig, manifest_sha256="a" * 64, archive_id="arch-1", generation=3) == fp
    assert signature.check(sig, manifest_sha256="a" * 64, archive_id="arch-1", generation=3,
                           trusted={fp: key.public_key()}) == fp
    for change in ({"manifest_sha256": "b" * 64}, {"archive_id": "x"}, {"generation": 4}):
        args = {"manifest_sha256": "a" * 64, "archive_id": "arch-1", "generation": 3, **change}
        with pytest.raises(signature.SignatureProblem):
            signature.check(sig, **args)
    forged = {**sig, "statement": {**stmt, "trial_reload": {"where": "/r", "tensors": 3}}}
    with pytest.raises(signature.SignatureProblem, match="does not verify"):
        signature.check(forged, manifest_sha256="a" * 64, archive_id="arch-1", generation=3)
    other = signature.load_private(signature.new_private_pem(), "k2")
    with pytest.raises(signature.SignatureProblem, match="not among the trusted"):
        signature.check(sig, manifest_sha256="a" * 64, archive_id="arch-1", generation=3,
                        trusted={signature.fingerprint(other.public_key()): other.public_key()})


def test_fingerprint_matches_ssh_keygen_format():
    key = signature.load_private(signature.new_private_pem(), "k")
    line = signature.public_line(key.public_key())
    assert line.startswith("ssh-ed25519 AAAA")
    assert signature.fingerprint(signature.load_public(line + " comment", "p")) == signature.fingerprint(key.public_key())
    assert signature.fingerprint(key.public_key()).startswith("SHA256:")
