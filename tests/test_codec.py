"""The chunked member codec (ckpt_archive/codec.py): exact round trips and clean failures.

Round trips for every float dtype and a few others, sizes that are not multiples of the element size,
empty members, chunk boundaries; corruption of stored bytes, truncation, trailing bytes, a tampered
chunk table. Speed is measured in benchmarks/, never here.
"""
from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_archive.format import codec as codec
from ckpt_archive.format.member_writer import MemberWriter
from ckpt_archive.format import member_writer, planes
from ckpt_archive.errors import IntegrityError

CHUNK = 64 << 10  # small chunks so that a few hundred KiB cross many boundaries


def _trained_like(n: int, dtype, seed: int = 0) -> bytes:
    """Weights with realistic exponents: normal, per-row scale spread, like an early checkpoint."""
    rng = np.random.default_rng(seed)
    rows = max(1, n // 256)
    scale = np.exp(rng.normal(0, 0.3, size=(rows, 1))) * 0.02
    a = (rng.normal(size=(rows, 256)) * scale).reshape(-1)[:n]
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return a.astype(dtype).tobytes()


def _write(pieces, *, chunk_bytes=CHUNK, jobs=2, level=codec.DEFAULT_LEVEL):
    buf = io.BytesIO()
    w = MemberWriter(buf, chunk_bytes=chunk_bytes, jobs=jobs, level=level)
    for data, hint in pieces:
        w.add(data, hint)
    rec = w.finish()
    return buf.getvalue(), rec


def _read(stored: bytes, rec: dict, jobs=2) -> bytes:
    return b"".join(bytes(c) for _, c in codec.iter_decoded(io.BytesIO(stored), rec, member="m", jobs=jobs))


@pytest.fixture(params=["stream", "file"])
def read_any(request, tmp_path):
    """Read through a stream (sequential reads) or a local file (workers pread their chunks)."""
    def read(stored: bytes, rec: dict, jobs=2) -> bytes:
        if request.param == "stream":
            return _read(stored, rec, jobs)
        path = tmp_path / "member.ckz"
        path.write_bytes(stored)
        with open(path, "rb") as fh:
            return b"".join(bytes(c) for _, c in codec.iter_decoded(fh, rec, member="m", jobs=jobs))
    return read


@pytest.mark.parametrize("dtype,hint,codec_name", [
    ("bfloat16", "bg2", "bg2r+zstd"), ("float16", "bg2", "bg2r+zstd"), ("float32", "bg4", "bg4r+zstd"),
    ("float64", "bg8", "bg8+zstd"),
])
def test_float_member_round_trips_bit_exact_with_byte_grouping(dtype, hint, codec_name):
    raw = _trained_like(100_003, dtype)
    stored, rec = _write([(raw, hint)])
    assert _read(stored, rec) == raw
    assert rec["raw_fp"] == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert [c["stored_sha256"] for c in rec["chunks"]] == [
        hashlib.sha256(stored[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]]).hexdigest() for c in rec["chunks"]]
    assert rec["stored_fp"] == "sha256-chunks:" + hashlib.sha256(
        b"".join(bytes.fromhex(c["stored_sha256"]) for c in rec["chunks"])).hexdigest()
    assert rec["raw_bytes"] == len(raw) and rec["stored_bytes"] == len(stored)
    assert codec_name in rec["chunk_codecs"]
    assert len(rec["chunks"]) == -(-len(raw) // (CHUNK - CHUNK % int(hint[2:])))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_byte_grouping_beats_plain_zstd_on_trained_floats(dtype):
    """Guards the float-aware codec's reason to exist: planes must compress clearly better."""
    raw = _trained_like(400_000, dtype)
    n = 2 if dtype == "bfloat16" else 4
    _, grouped = _write([(raw, f"bg{n}")], chunk_bytes=1 << 20)
    _, plain = _write([(raw, "zstd")], chunk_bytes=1 << 20)
    assert grouped["stored_bytes"] < 0.93 * plain["stored_bytes"]


def test_float_parameters_compress_exponent_planes_better_than_level_3():
    raw = _trained_like(400_000, "bfloat16")
    planes = codec.byte_group(raw, 2)
    tuned = codec._compressor(3, floats=True).compress(planes)
    level3 = codec._compressor(3).compress(planes)
    assert len(tuned) < len(level3)


@pytest.mark.parametrize("hint", ["bg2", "bg4", "bg8"])
@pytest.mark.parametrize("size", [1, 3, 7, 9, 1001])
def test_sizes_not_a_multiple_of_the_element_size_fall_back_and_round_trip(hint, size):
    raw = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    stored, rec = _write([(raw, hint)])
    assert _read(stored, rec) == raw
    n = int(hint[2:])
    if size % n:
        assert all(not c["codec"].startswith("bg") for c in rec["chunks"])


def test_empty_member_has_no_chunks_and_the_sha256_of_nothing():
    stored, rec = _write([(b"", "bg4"), (b"", "zstd")])
    assert stored == b"" and rec["chunks"] == [] and rec["raw_bytes"] == 0
    assert rec["raw_fp"] == "sha256:" + hashlib.sha256(b"").hexdigest()
    assert _read(stored, rec) == b""


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_chunk_boundaries_are_exact_and_hints_never_mix(delta):
    f32 = _trained_like(CHUNK // 4 + delta, "float32")
    bf = _trained_like(CHUNK // 2 + delta, "bfloat16")
    tail = b"\x00\x01" * 1000 + b"z"
    pieces = [(b"header" * 10, "zstd"), (f32, "bg4"), (bf, "bg2"), (tail, "zstd"), (f32[:4], "bg4")]
    stored, rec = _write(pieces)
    raw = b"".join(p for p, _ in pieces)
    assert _read(stored, rec) == raw
    offsets = [0]
    for c in rec["chunks"]:
        assert c["raw_offset"] == offsets[-1]
        assert 0 < c["raw_bytes"] <= CHUNK
        offsets.append(c["raw_offset"] + c["raw_bytes"])
    # every piece boundary is a chunk boundary (pieces with different hints never share a chunk)
    pos, boundaries = 0, set()
    for p, _ in pieces:
        pos += len(p)
        boundaries.add(pos)
    assert boundaries <= set(offsets)


def test_a_chunk_size_that_is_not_a_multiple_of_the_element_size_keeps_elements_whole():
    raw = _trained_like(10_000, "float64")
    stored, rec = _write([(raw, "bg8")], chunk_bytes=1001)
    assert all(c["raw_bytes"] % 8 == 0 for c in rec["chunks"])
    assert all(c["codec"] in ("bg8+zstd", "store") for c in rec["chunks"])
    assert _read(stored, rec) == raw


def test_incompressible_chunks_are_stored_raw():
    raw = np.random.default_rng(1).integers(0, 256, size=300_000, dtype=np.uint8).tobytes()
    stored, rec = _write([(raw, "zstd")])
    assert rec["chunk_codecs"] == ["store"] and stored == raw
    assert _read(stored, rec) == raw


@pytest.mark.parametrize("kind", ["int64", "uint8", "bool"])
def test_non_float_tensors_round_trip_with_plain_zstd(kind):
    rng = np.random.default_rng(2)
    a = {"int64": rng.integers(0, 50_000, 70_001), "uint8": rng.integers(0, 4, 70_001).astype(np.uint8),
         "bool": rng.integers(0, 2, 70_001).astype(bool)}[kind]
    raw = a.tobytes()
    stored, rec = _write([(raw, "zstd")])
    assert _read(stored, rec) == raw and "zstd" in rec["chunk_codecs"]


def test_output_is_in_order_with_more_chunks_than_threads():
    raw = b"".join(i.to_bytes(4, "little") for i in range(200_000))
    stored, rec = _write([(raw, "bg4")], chunk_bytes=4096, jobs=3)
    assert len(rec["chunks"]) > 100
    assert _read(stored, rec, jobs=3) == raw


def test_an_explicit_high_level_uses_that_zstd_level_for_floats():
    raw = _trained_like(50_000, "float32")
    stored, rec = _write([(raw, "bg4")], level=9)
    assert _read(stored, rec) == raw


def test_a_chunk_written_by_the_first_codec_version_still_decodes():
    """v1 wrote byte-grouped chunks as plain level-3 frames; archives people keep must stay readable."""
    import zstandard

    raw = _trained_like(5000, "float32")
    v1 = zstandard.ZstdCompressor(level=3).compress(np.frombuffer(raw, np.uint8).reshape(-1, 4).T.tobytes())
    assert bytes(codec.decode_chunk(v1, "bg4+zstd", len(raw))) == raw


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([2, 4, 8]), data=st.binary(max_size=512))
def test_byte_ungroup_inverts_byte_group(n, data):
    data = data[: len(data) - len(data) % n]
    grouped = codec.byte_group(data, n)
    assert bytes(grouped) == np.frombuffer(data, np.uint8).reshape(-1, n).T.tobytes()
    assert bytes(codec.byte_ungroup(bytes(grouped), n)) == data


# -- corruption -------------------------------------------------------------------------------------

def _sample():
    raw = _trained_like(60_000, "float32") + b"tail" * 100
    stored, rec = _write([(raw[:240_000], "bg4"), (raw[240_000:], "zstd")])
    return raw, stored, rec


def test_a_flipped_stored_byte_names_the_member_and_the_chunk(read_any):
    _, stored, rec = _sample()
    bad = bytearray(stored)
    victim = rec["chunks"][2]
    bad[victim["stored_offset"] + victim["stored_bytes"] // 2] ^= 0x10
    with pytest.raises(IntegrityError) as ei:
        read_any(bytes(bad), rec)
    assert "chunk 2" in ei.value.message and "fails its sha256" in ei.value.message
    assert ei.value.where == "m"


def test_a_truncated_member_says_truncated_and_names_the_chunk(read_any):
    _, stored, rec = _sample()
    last = len(rec["chunks"]) - 1
    with pytest.raises(IntegrityError, match=f"truncated: chunk {last} has"):
        read_any(stored[:-5], rec)


def test_trailing_bytes_after_the_last_chunk_are_reported(read_any):
    _, stored, rec = _sample()
    with pytest.raises(IntegrityError, match="longer than its chunks"):
        read_any(stored + b"x", rec)


def test_reading_a_local_file_and_a_stream_give_the_same_bytes(read_any):
    raw, stored, rec = _sample()
    assert read_any(stored, rec, jobs=3) == raw


def test_a_chunk_table_with_a_gap_is_refused_before_reading():
    _, stored, rec = _sample()
    rec["chunks"][1]["stored_offset"] += 1
    with pytest.raises(IntegrityError, match="chunk table inconsistent at chunk 1"):
        _read(stored, rec)


def test_a_chunk_table_that_does_not_cover_the_member_is_refused():
    _, stored, rec = _sample()
    rec["raw_bytes"] += 1
    with pytest.raises(IntegrityError, match="chunk table covers"):
        _read(stored, rec)


def test_decode_refuses_a_wrong_raw_size_an_unknown_codec_and_garbage():
    raw = _trained_like(1000, "float32")
    codec_name, stored, _ = codec.encode_chunk(raw, "bg4", codec.DEFAULT_LEVEL)
    with pytest.raises(IntegrityError, match="decodes to|does not decode"):
        codec.decode_chunk(stored, codec_name, len(raw) - 4)
    with pytest.raises(IntegrityError, match="unknown chunk codec"):
        codec.decode_chunk(stored, "lz4", len(raw))
    with pytest.raises(IntegrityError, match="does not decode"):
        codec.decode_chunk(b"\x00" * 64, "zstd", 100)
    with pytest.raises(IntegrityError):
        codec.decode_chunk(b"abc", "store", 4)


def test_a_writer_abort_leaves_no_thread_running():
    import threading

    before = threading.active_count()
    w = MemberWriter(io.BytesIO(), chunk_bytes=CHUNK, jobs=2)
    w.add(_trained_like(50_000, "float32"), "bg4")
    w.abort()
    assert threading.active_count() <= before


def test_parallel_chunk_check_accepts_a_good_file_and_rejects_a_flip(tmp_path):
    _, stored, rec = _sample()
    path = tmp_path / "member.ckz"
    path.write_bytes(stored)
    seen = []
    with open(path, "rb") as fh:
        assert codec.chunks_match(fh, rec, member="m", jobs=3, on_bytes=seen.append) is True
    assert sum(seen) == len(stored)
    bad = bytearray(stored)
    bad[-1] ^= 1
    path.write_bytes(bytes(bad))
    with open(path, "rb") as fh:
        assert codec.chunks_match(fh, rec, member="m") is False
    path.write_bytes(stored + b"x")
    with open(path, "rb") as fh:
        assert codec.chunks_match(fh, rec, member="m") is False


def test_parallel_chunk_check_defers_to_a_sequential_hash_for_streams():
    _, stored, rec = _sample()
    assert codec.chunks_match(io.BytesIO(stored), rec, member="m") is None


# -- through the archive: load checks every returned tensor's bytes, not chunk hashes ---------------

@pytest.mark.parametrize("where", ["stored-chunk", "compressed-chunk"])
def test_load_never_returns_a_damaged_tensor(tmp_path, where):
    """load() skips per-chunk stored hashes for speed; per-tensor raw sha256 must still catch a flip."""
    import json

    import torch

    import ckpt_archive

    g = torch.Generator().manual_seed(0)
    state = {"noise": torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=g),  # stored raw
             "w": (torch.randn(200_000, generator=g) * 0.02)}                              # bg4r+zstd
    repo = tmp_path / "repo"
    ckpt_archive.pack(state, repo)
    gen = repo / "generations" / "00000001"
    manifest = json.loads((gen / "manifest.json").read_text())
    rec = next(m for m in manifest["members"] if m["role"] == "tensors")
    want = "store" if where == "stored-chunk" else "bg4r+zstd"
    chunk = next(c for c in rec["chunks"] if c["codec"] == want)
    path = gen / rec["stored_path"]
    data = bytearray(path.read_bytes())
    data[chunk["stored_offset"] + chunk["stored_bytes"] // 2] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        ckpt_archive.load(repo, "1")


def test_decoding_into_a_member_buffer_gives_the_same_bytes_and_views_it():
    raw, stored, rec = _sample()
    dest = bytearray(len(raw))
    views = list(codec.iter_decoded(io.BytesIO(stored), rec, member="m", into=dest))
    assert bytes(dest) == raw
    assert all(bytes(c) == raw[off:off + len(c)] for off, c in views)
    with pytest.raises(ValueError):
        list(codec.iter_decoded(io.BytesIO(stored), rec, member="m", into=bytearray(len(raw) - 1)))


def test_writing_a_local_file_starts_writeback_and_round_trips(tmp_path, monkeypatch):
    synced = []
    import os as _os

    real = _os.fdatasync
    monkeypatch.setattr(member_writer, "SYNC_EVERY_BYTES", 100_000)
    monkeypatch.setattr(codec.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    raw = np.random.default_rng(3).integers(0, 256, size=1_000_000, dtype=np.uint8).tobytes()
    path = tmp_path / "m.ckz"
    with open(path, "xb") as fh:
        w = MemberWriter(fh, chunk_bytes=CHUNK, jobs=2)
        w.add(raw, "zstd")
        rec = w.finish()
    assert synced, "no writeback was started while writing a 1 MB member"
    with open(path, "rb") as fh:
        assert b"".join(bytes(c) for _, c in codec.iter_decoded(fh, rec, member="m")) == raw


# -- sign-rotated float chunks (format 3: bg2r / bg4r / bg8r + zstd) ----------------------------------

_SPECIAL = {  # IEEE bit patterns a rotation must carry through unchanged, as unsigned integers
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F,  # bf16
        0x7C00, 0xFC00, 0x7E00, 0x03FF, 0x8400, 0xFFFF],                                                 # fp16
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
        0x80000001, 0x007FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0xFFFFFFFF],
    8: [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8 << 48, (0xFFF8 << 48) | 1, (0x7FF0 << 48) | 1, 1,
        (1 << 63) | 1, (1 << 52) - 1, 0x7FEF_FFFF_FFFF_FFFF, (1 << 64) - 1],
}


def _special_chunk(n: int, count: int = 5003) -> bytes:
    """Trained-like floats with every special bit pattern (NaN payloads, +-inf, denormals, -0.0) mixed in."""
    dtype = {2: "bfloat16", 4: "float32", 8: "float64"}[n]
    base = np.frombuffer(_trained_like(count, dtype), dtype=f"<u{n}").copy()
    specials = np.array(_SPECIAL[n], dtype=f"<u{n}")
    base[::7][: len(specials) * 50] = np.tile(specials, 50)[: len(base[::7])]
    return base.tobytes()


def _rotl_reference(raw: bytes, n: int) -> bytes:
    """docs/FORMAT.md's definition, element by element in pure Python (what a third party would write)."""
    bits = 8 * n
    out = bytearray()
    for i in range(0, len(raw), n):
        u = int.from_bytes(raw[i:i + n], "little")
        out += (((u << 1) | (u >> (bits - 1))) & ((1 << bits) - 1)).to_bytes(n, "little")
    return bytes(out)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sign_rotated_grouping_is_exactly_the_documented_rotation(n):
    raw = _special_chunk(n, 999)
    want = np.frombuffer(_rotl_reference(raw, n), np.uint8).reshape(-1, n).T.tobytes()
    assert bytes(codec.byte_group(raw, n, rotate=True)) == want
    assert bytes(codec.byte_ungroup(want, n, rotate=True)) == raw
    if n == 2:  # the worked example in docs/FORMAT.md: bf16 -1.5 = 0xBFC0 -> r = 0x7F81
        assert bytes(codec.byte_group(b"\xc0\xbf", 2, rotate=True)) == b"\x81\x7f"


def test_sign_rotation_puts_the_whole_bf16_and_fp32_exponent_in_the_top_plane():
    for n, dtype, exp_shift in [(2, "bfloat16", 7), (4, "float32", 23)]:
        raw = _trained_like(4096, dtype)
        u = np.frombuffer(raw, f"<u{n}")
        planes = np.asarray(codec.byte_group(raw, n, rotate=True)).reshape(n, -1)
        assert np.array_equal(planes[n - 1], ((u >> exp_shift) & 0xFF).astype(np.uint8))  # the 8 exponent bits
        assert np.array_equal(planes[0] & 1, (u >> (8 * n - 1)).astype(np.uint8))       # the sign, at bit 0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sign_rotated_chunks_round_trip_nan_inf_denormals_and_negative_zero(n):
    raw = _special_chunk(n)
    name = f"bg{n}r+zstd"
    if n in codec.ROTATE_SIZES:
        got_name, stored, sha = codec.encode_chunk(raw, f"bg{n}", codec.DEFAULT_LEVEL)
        assert got_name == name and sha == hashlib.sha256(stored).hexdigest()
    else:  # the writer keeps fp64 unrotated; a reader still decodes bg8r written by anyone else
        stored = codec._compressor(3, floats=True).compress(codec.byte_group(raw, n, rotate=True))
    assert bytes(codec.decode_chunk(stored, name, len(raw))) == raw
    dest = bytearray(len(raw))
    assert bytes(codec.decode_chunk(stored, name, len(raw), dest)) == raw and bytes(dest) == raw
    # decoding as the unrotated codec gives other bytes: the codec name is what makes it right
    assert bytes(codec.decode_chunk(stored, f"bg{n}+zstd", len(raw))) != raw


@pytest.mark.parametrize("dtype,n", [("bfloat16", 2), ("float32", 4)])
def test_sign_rotation_stores_bf16_and_fp32_smaller_than_plain_grouping(dtype, n):
    """Guards the rotated codecs' reason to exist (the writer picks them for these element sizes)."""
    raw = _trained_like(1 << 20, dtype)
    cctx = codec._compressor(3, floats=True)
    rotated = sum(len(cctx.compress(codec.byte_group(raw[o:o + CHUNK * 16], n, rotate=True)))
                  for o in range(0, len(raw), CHUNK * 16))
    plain = sum(len(cctx.compress(codec.byte_group(raw[o:o + CHUNK * 16], n)))
                for o in range(0, len(raw), CHUNK * 16))
    assert rotated < plain


def test_a_hostile_rotated_chunk_with_wrong_sizes_is_refused():
    import zstandard

    raw = _special_chunk(4, 1000)
    _, stored, _ = codec.encode_chunk(raw, "bg4", codec.DEFAULT_LEVEL)
    for wrong in (len(raw) - 4, len(raw) + 4, len(raw) - 1):
        with pytest.raises(IntegrityError, match="decodes to|does not decode|not a multiple"):
            codec.decode_chunk(stored, "bg4r+zstd", wrong)
    six = zstandard.ZstdCompressor().compress(b"abcdef")  # 6 bytes: not whole 4-byte elements
    with pytest.raises(IntegrityError, match="not a multiple of 4"):
        codec.decode_chunk(six, "bg4r+zstd", 6)
    with pytest.raises(IntegrityError, match="unknown chunk codec"):
        codec.decode_chunk(stored, "bg3r+zstd", len(raw))
    with pytest.raises(IntegrityError, match="does not decode"):
        codec.decode_chunk(stored[:-7], "bg4r+zstd", len(raw))


def test_a_state_without_rotated_chunks_stays_format_2(tmp_path):
    """Only archives that need format 3 get it: fp64 and integer tensors keep format-2 readers working."""
    import torch

    import ckpt_archive

    g = torch.Generator().manual_seed(0)
    state = {"w64": torch.randn(50_000, generator=g, dtype=torch.float64), "ids": torch.arange(40_000)}
    res = ckpt_archive.pack(state, tmp_path / "repo")
    codecs = {c["codec"] for r in res.manifest["members"] for c in r["chunks"]}
    assert "bg8+zstd" in codecs and res.manifest["format_version"] == 2


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping holding ``addr`` (Linux /proc/self/smaps)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux only")
def test_load_buffers_are_not_advised_huge_pages():
    """numpy advises huge pages for arrays >= 4 MiB; on a fragmented machine the first touch of such a
    buffer compacts and zeroes 2 MiB at a time (a fresh 256 MiB buffer: 4-5 s instead of 0.3 s), which
    made load slower than torch.load several times over. Load's member buffer must not carry the advice."""
    buf = planes.anon_buffer(8 << 20)
    assert buf.dtype == np.uint8 and len(buf) == 8 << 20 and not buf[:: 1 << 16].any()
    buf[:] = 7  # writable
    middle = 4 << 20  # numpy advises the 2 MiB-aligned interior of an array: probe there
    assert "hg" not in _vm_flags(buf.ctypes.data + middle)
    probe = np.empty(8 << 20, dtype=np.uint8)
    core = getattr(np, "_core", None) or np.core
    if getattr(core.multiarray, "_get_madvise_hugepage", lambda: False)():  # numpy advises here: the probe sees it
        assert "hg" in _vm_flags(probe.ctypes.data + middle)
    assert len(planes.anon_buffer(0)) == 0


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux only")
def test_populating_a_load_buffer_takes_its_pages_and_never_changes_a_byte():
    """[issue 29] load takes each chunk's pages of its member buffer in one madvise(MADV_POPULATE_WRITE)
    before decoding into them (a fault per 4 KiB page cost ~0.35 ns per byte more). The range is widened down
    to a page, so it covers the end of the chunk before, perhaps being written by another worker: an advice
    that dropped or zeroed pages (MADV_DONTNEED, MADV_FREE, MADV_REMOVE) would lose bytes there."""
    import resource

    n = 1 << 20
    buf = planes.anon_buffer(n)
    buf[: 5000] = 9  # the previous chunk's bytes, on the page the next range starts in
    if planes.populate(buf, 5000, n - 5000):  # Linux 5.14+; else the pages come by faults, as before
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buf[5000:] = 3
        assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 16  # the pages were taken
        assert (buf[5000:] == 3).all()
    assert (buf[:5000] == 9).all()
    assert not planes.populate(bytearray(n), 0, n)  # not an anonymous buffer: left alone, no error
    assert not planes.populate(buf[4096:], 0, 4096)  # a slice: its offsets are not the map's
    assert not planes.populate(buf, n - 10, 20) and not planes.populate(buf, -1, 10)  # outside it
    assert not planes.populate(planes.anon_buffer(0), 0, 0)
    assert (buf[:5000] == 9).all()


def test_decoding_into_a_buffer_from_a_local_file_runs_ahead_and_stops_at_the_first_bad_chunk(tmp_path):
    """[issue 29] With ``into`` on a local file the workers run up to INTO_AHEAD chunks ahead of the consumer
    (their results are views of ``into``): the bytes and their order must be the same as the bounded read's,
    and a damaged chunk must still fail the read, naming it, with no worker left running."""
    import threading

    raw, stored, rec = _sample()
    assert len(rec["chunks"]) > 2 * 2  # more chunks than the 2 * jobs of the bounded read
    path = tmp_path / "member.ckz"
    path.write_bytes(stored)
    dest = planes.anon_buffer(len(raw))
    with open(path, "rb") as fh:
        offs = [off for off, _ in codec.iter_decoded(fh, rec, member="m", jobs=2, into=dest)]
    assert bytes(dest) == raw and offs == [c["raw_offset"] for c in rec["chunks"]]
    bad = bytearray(stored)
    c = rec["chunks"][3]
    bad[c["stored_offset"] + c["stored_bytes"] // 2] ^= 0x10
    path.write_bytes(bytes(bad))
    with open(path, "rb") as fh, pytest.raises(IntegrityError, match="chunk 3"):
        list(codec.iter_decoded(fh, rec, member="m", jobs=2, into=planes.anon_buffer(len(raw))))
    assert not [t for t in threading.enumerate() if t.name.startswith("ckpt-dec")]


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_blocked_grouping_equals_the_whole_chunk_transform_across_block_edges(n, rotate):
    """Fault guarded: the cache-sized blocks of byte_group / byte_ungroup (planes.BLOCK_ELEMS) dropping,
    repeating or misplacing the elements at a block's edge or in the ragged last block. The reference is
    the whole chunk at once in NumPy: rotate (FORMAT.md's definition), then a transposed copy."""
    from ckpt_archive.format.planes import BLOCK_ELEMS

    count = 3 * BLOCK_ELEMS + 17
    u = np.random.default_rng(n).integers(0, 1 << (8 * n), size=count, dtype=np.uint64).astype(f"<u{n}")
    u[BLOCK_ELEMS - 1:BLOCK_ELEMS + 2] = np.array([1 << (8 * n - 1), (1 << (8 * n)) - 1, 1], dtype=f"<u{n}")
    raw = u.tobytes()
    r = ((u << np.array(1, u.dtype)) | (u >> np.array(8 * n - 1, u.dtype))) if rotate else u
    want = r.view(np.uint8).reshape(-1, n).T.tobytes()
    assert bytes(codec.byte_group(raw, n, rotate=rotate)) == want
    out = bytearray(len(raw))
    assert bytes(codec.byte_ungroup(want, n, out=out, rotate=rotate)) == raw and bytes(out) == raw
    assert bytes(codec.byte_ungroup(want, n, rotate=rotate)) == raw


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("rotate", [False, True])
def test_small_planes_are_put_back_without_numpy_exactly_as_with_it(n, rotate, monkeypatch):
    """Guards against the plain-Python ungrouping of small chunks (format/planes.py: it spares the policy
    audit ``import numpy``) disagreeing with the NumPy path in any bit: random bytes of several sizes,
    both sides of the threshold, rotated or not, into a fresh buffer or a caller's."""
    import os

    from ckpt_archive.format import planes

    for size in (0, n, 3 * n, 1000 * n, 20_000 * n):
        raw = os.urandom(size)
        grouped = bytes(planes.byte_group(raw, n, rotate=rotate))
        monkeypatch.setattr(planes, "SMALL_PLANES_BYTES", 1 << 30)
        small = bytes(planes.byte_ungroup(grouped, n, rotate=rotate))
        out = bytearray(size)
        planes.byte_ungroup(grouped, n, out=out, rotate=rotate)
        monkeypatch.setattr(planes, "SMALL_PLANES_BYTES", -1)
        assert small == bytes(out) == bytes(planes.byte_ungroup(grouped, n, rotate=rotate)) == raw


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("rotate", [False, True])
def test_small_chunks_are_grouped_without_numpy_exactly_as_with_it(n, rotate, monkeypatch):
    """Guards against the plain-Python grouping of small chunks (format/planes.py: it spares a pack of a
    small state ``import numpy``) writing other planes than the NumPy path: random bytes of several sizes,
    rotated or not, each compared bit for bit, and each chunk encoded by ``encode_chunk`` the same way."""
    import os

    from ckpt_archive.format import planes

    for size in (0, n, 3 * n, 1000 * n, 8_000 * n):
        raw = os.urandom(size)
        monkeypatch.setattr(planes, "SMALL_PLANES_BYTES", 1 << 30)
        small = bytes(planes.byte_group(raw, n, rotate=rotate))
        small_chunk = codec.encode_chunk(raw, f"bg{n}", 3)
        monkeypatch.setattr(planes, "SMALL_PLANES_BYTES", -1)
        monkeypatch.setattr(codec, "SMALL_PLANES_BYTES", -1)
        big = bytes(planes.byte_group(raw, n, rotate=rotate))
        assert small == big, size
        codec_name, stored, sha = codec.encode_chunk(raw, f"bg{n}", 3)
        assert (small_chunk[0], bytes(small_chunk[1]), small_chunk[2]) == (codec_name, bytes(stored), sha), size
        monkeypatch.undo()
