"""Format 2 fingerprints (docs/FORMAT.md, "Fingerprints"): each role hashed once, the algorithm recorded
with every fingerprint, derived member fingerprints, and the version rules (format 1 still reads; a
newer format is refused by name)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import IntegrityError, NewerFormatError
from ckpt_archive.format import fingerprint, manifest as manifest_mod

FIXTURES = Path(__file__).parent / "fixtures"
#: written by main at 1ce6fdd (format 1 with exact bytes): tests/fixtures/v1-exact-1ce6fdd; never regenerate
V1_EXACT_SHA256 = "b21c91797525e65f22d50ddc5a7603236aac273534a5255233554536257d0bc4"


def _pack(tmp_path, chunk_bytes=1 << 16):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 256, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16),
             "step": 4}
    res = ckpt_archive.pack(state, tmp_path / "repo", ckpt_archive.PackOptions(chunk_bytes=chunk_bytes))
    return state, res.manifest, tmp_path / "repo" / "generations" / "00000001"


def test_member_fingerprint_derived_from_chunks_equals_sha256_of_the_file(tmp_path):
    _, m, gen = _pack(tmp_path)
    # format 2's fingerprints; the fp32/bf16 chunks are sign-rotated (bg4r/bg2r), which makes the manifest 3
    assert m["format_version"] == 3
    for rec in m["members"]:
        data = (gen / rec["stored_path"]).read_bytes()
        # the chunk table tiles the file: each chunk's sha256 is `sha256sum` of its byte range
        pos = 0
        for c in rec["chunks"]:
            assert c["stored_offset"] == pos
            assert c["stored_sha256"] == hashlib.sha256(data[pos:pos + c["stored_bytes"]]).hexdigest()
            pos += c["stored_bytes"]
        assert pos == len(data) == rec["stored_bytes"]
        # the member's fingerprint is derived from those, by the documented recipe
        recipe = hashlib.sha256(b"".join(hashlib.sha256(data[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]])
                                         .digest() for c in rec["chunks"])).hexdigest()
        assert rec["stored_fp"] == f"sha256-chunks:{recipe}"
        if len(rec["chunks"]) == 1:  # one chunk: the chunk's sha256 is the file's
            assert rec["chunks"][0]["stored_sha256"] == hashlib.sha256(data).hexdigest()
    assert any(len(r["chunks"]) > 1 for r in m["members"])


def test_tensor_and_member_raw_fingerprints_are_blake3_and_derived(tmp_path):
    import blake3

    state, m, _ = _pack(tmp_path)
    rec = m["tensors"]["w"]
    assert rec["raw_fp"] == "blake3:" + blake3.blake3(state["w"].numpy().tobytes()).hexdigest()
    shard = next(r for r in m["members"] if r["role"] == "tensors")
    r = ckpt_archive.ops.common.open_repo(tmp_path / "repo")
    from ckpt_archive.repo.reader import ArchiveReader

    raw = ArchiveReader(r.store, "generations/00000001", m).read_member_bytes(shard["path"], limit=1 << 30)
    base = shard["header_bytes"]
    parts = [blake3.blake3(raw[:base]).digest()]
    for _, e in sorted(shard["entries"].items(), key=lambda kv: kv[1]["data_offsets"][0]):
        parts.append(blake3.blake3(raw[base + e["data_offsets"][0]:base + e["data_offsets"][1]]).digest())
    assert shard["raw_fp"] == "blake3-entries:" + blake3.blake3(b"".join(parts)).hexdigest()


def test_a_tampered_chunk_is_caught_once_and_named(tmp_path):
    _, m, gen = _pack(tmp_path)
    shard = next(r for r in m["members"] if r["role"] == "tensors")
    c = shard["chunks"][2]
    path = gen / shard["stored_path"]
    data = bytearray(path.read_bytes())
    data[c["stored_offset"] + 5] ^= 0x10
    path.write_bytes(bytes(data))
    for deep in (False, True):
        rep = ckpt_archive.verify(tmp_path / "repo", "1", options=ckpt_archive.VerifyOptions(deep=deep))
        assert not rep.ok
        mine = [p for p in rep.problems if p.member == shard["path"]]
        assert len(mine) == 1, (deep, rep.problems)  # one report, not one per pass over the bytes
        assert "chunk 2" in mine[0].reason and c["stored_sha256"] in mine[0].reason
    with pytest.raises(IntegrityError):
        ckpt_archive.load(tmp_path / "repo", "1")


def test_a_changed_entry_fingerprint_names_the_tensor(tmp_path):
    """A raw fingerprint that differs (manifest edited and re-sealed elsewhere) names the entry."""
    from ckpt_archive.format.member_writer import MemberWriter  # noqa: F401  (module under test is the reader)

    _, m, gen = _pack(tmp_path)
    shard = next(r for r in m["members"] if r["role"] == "tensors")
    check = fingerprint.MemberRawCheck({**shard, "entries": {**shard["entries"], "w": {
        **shard["entries"]["w"], "raw_fp": "blake3:" + "0" * 64}}})
    r = ckpt_archive.ops.common.open_repo(tmp_path / "repo")
    from ckpt_archive.repo.reader import ArchiveReader

    check.update(ArchiveReader(r.store, "generations/00000001", m).read_member_bytes(shard["path"], limit=1 << 30))
    assert "entry w" in (check.problem() or "")


@pytest.mark.parametrize("name", ["v1-basic", "v1-exact-1ce6fdd"])
def test_format_1_archives_still_verify_and_load(tmp_path, name):
    repo = tmp_path / name
    shutil.copytree(FIXTURES / name, repo)
    rep = ckpt_archive.verify(repo, "1", options=ckpt_archive.VerifyOptions(deep=True))
    assert rep.ok, rep.problems
    assert ckpt_archive.verify(repo, "1").ok
    state = ckpt_archive.load(repo, "1")
    assert isinstance(state, dict)
    if name == "v1-exact-1ce6fdd":
        out = tmp_path / "restored.pt"
        ckpt_archive.restore(repo, "1", out)
        assert hashlib.sha256(out.read_bytes()).hexdigest() == V1_EXACT_SHA256
        back = torch.load(out, weights_only=True)
        assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == state["step"] == 3
        assert back["model"]["w_t"].untyped_storage().data_ptr() == back["model"]["w"].untyped_storage().data_ptr()


def test_a_newer_format_is_refused_by_name(tmp_path):
    _, m, gen = _pack(tmp_path)
    doc = json.loads((gen / "manifest.json").read_text())
    doc["format_version"] = 4
    with pytest.raises(NewerFormatError, match="written by format 4, this reader knows up to 3"):
        manifest_mod.parse(json.dumps(doc).encode())


def test_a_format_1_reader_refuses_format_2_by_name(monkeypatch, tmp_path):
    """What a reader that knows only format 1 (as main before this change) does with our manifests."""
    from ckpt_archive.format import codec

    monkeypatch.setattr(codec, "ROTATE_SIZES", frozenset())  # no format-3 codec: a format-2 manifest
    _, m, gen = _pack(tmp_path)
    assert m["format_version"] == 2
    monkeypatch.setattr(manifest_mod, "KNOWN_VERSIONS", (1,))
    with pytest.raises(NewerFormatError, match="written by format 2, this reader knows up to 1"):
        manifest_mod.parse((gen / "manifest.json").read_bytes())


def test_a_format_2_reader_refuses_sign_rotated_chunks_by_name(monkeypatch, tmp_path):
    """A reader that knows up to format 2 must refuse an archive with bg2r/bg4r chunks by name, never
    decode them as plain byte-grouped chunks (that would return bit-rotated floats)."""
    _, m, gen = _pack(tmp_path)
    codecs = {c["codec"] for r in m["members"] for c in r["chunks"]}
    assert {"bg2r+zstd", "bg4r+zstd"} <= codecs and m["format_version"] == 3
    monkeypatch.setattr(manifest_mod, "KNOWN_VERSIONS", (1, 2))
    with pytest.raises(NewerFormatError, match="written by format 3, this reader knows up to 2"):
        manifest_mod.parse((gen / "manifest.json").read_bytes())


def test_a_format_2_manifest_naming_a_rotated_codec_breaks_its_schema(tmp_path):
    """A manifest that claims format 2 but names a format-3 codec is refused, not read by format-2 rules."""
    from ckpt_archive.errors import ManifestInvalid

    _, _, gen = _pack(tmp_path)
    doc = json.loads((gen / "manifest.json").read_text())
    doc["format_version"] = 2
    with pytest.raises(ManifestInvalid, match="codec"):
        manifest_mod.validate(doc)


# --- pack hashes each stored chunk once; its trial reload decodes every chunk it wrote ----------------------
class _CountingHashlib:
    """Stands in for ``hashlib`` in format/codec.py: counts the sha256 objects made there."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        return getattr(hashlib, name)

    def sha256(self, *a):
        self.calls += 1
        return hashlib.sha256(*a)


def test_pack_takes_each_stored_chunks_sha256_once(tmp_path, monkeypatch):
    """Fault (issue 14, "nothing twice"): pack's trial reload hashed every stored chunk again, a moment after
    the writer hashed the same bytes (~0.5 ns per stored byte, 6 % of pack's CPU). verify still hashes them."""
    from ckpt_archive.format import codec

    counting = _CountingHashlib()
    monkeypatch.setattr(codec, "hashlib", counting)
    _, m, _ = _pack(tmp_path)
    chunks = sum(len(rec["chunks"]) for rec in m["members"])
    assert chunks > 4 and counting.calls == chunks
    from ckpt_archive.ops.verify import VerifyOptions, verify

    counting.calls = 0
    verify(tmp_path / "repo", "1", options=VerifyOptions(deep=True))
    assert counting.calls >= chunks  # a check of bytes already published hashes every chunk


@pytest.mark.parametrize("where,bit", [(4, 0x10), (0.5, 0x01), (0.999, 0x01)])
def test_a_stored_byte_changed_between_write_and_trial_reload_withdraws_the_generation(tmp_path, monkeypatch,
                                                                                      where, bit):
    """The trial reload of a chunk pack wrote compares it, read back, with the CRC-32 of the bytes written,
    then decodes it and checks every raw byte. A changed byte in the body or the last byte of the frame, and
    one that every decoder reads past (byte 4, bit 0x10: the frame header's unused bit; break test, after
    the reload stopped hashing chunks: that pack published a generation that verify and restore refuse),
    must all stop the pack, leaving nothing usable."""
    import zstandard

    from ckpt_archive.ops import pack as pack_mod

    real = pack_mod._PackSteps.verify

    def flip_then_verify(self, repo, number, reader):
        rec = next(r for r in self.manifest["members"] if r["role"] == "tensors")
        c = max((c for c in rec["chunks"] if c["codec"] != "store"), key=lambda c: c["stored_bytes"])
        p = tmp_path / "repo" / "generations" / f"{number:08d}" / rec["stored_path"]
        data = bytearray(p.read_bytes())
        at = where if isinstance(where, int) else min(int(where * c["stored_bytes"]), c["stored_bytes"] - 1)
        data[c["stored_offset"] + at] ^= bit
        if isinstance(where, int):  # the frame still decodes to the same bytes: only the CRC can tell
            frame = bytes(data[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]])
            good = p.read_bytes()[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]]
            dec = zstandard.ZstdDecompressor()
            assert dec.decompress(frame, max_output_size=c["raw_bytes"]) == \
                dec.decompress(good, max_output_size=c["raw_bytes"])
        p.write_bytes(data)
        return real(self, repo, number, reader)

    monkeypatch.setattr(pack_mod._PackSteps, "verify", flip_then_verify)
    with pytest.raises(IntegrityError):
        _pack(tmp_path)
    assert not list((tmp_path / "repo" / "generations").glob("*/USABLE.json"))


def test_bytes_after_a_chunks_zstd_frame_do_not_decode():
    """A chunk is one zstd frame and nothing else: bytes after it (which decoding would never read, so no
    raw fingerprint could notice them) make the chunk fail to decode."""
    from ckpt_archive.format.codec import decode_chunk, encode_chunk

    raw = bytes(range(256)) * 64
    codec, stored, _ = encode_chunk(memoryview(raw), "zstd", 3)
    assert codec == "zstd" and bytes(decode_chunk(stored, codec, len(raw))) == raw
    with pytest.raises(IntegrityError, match="unused data"):
        decode_chunk(bytes(stored) + b"\0", codec, len(raw))
