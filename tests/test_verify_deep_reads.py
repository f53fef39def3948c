"""verify --deep reads and hashes each stored byte once (issue 29: it had regressed to ~2x its time).

The fault: issue 24's check that an exact-bytes source file rebuilds to ``source.files[].sha256`` re-read
every segment's entry after the trial reload had read it: every stored chunk was read, sha256-hashed and
decoded twice and every raw tensor byte BLAKE3-hashed twice (1 GiB: 6.8-9.0 s against 3.0-3.3 s before).
The file's sha256 is now taken from the trial reload's own read (``repo/exact_stream.py``). These tests count
bytes -- no timing: every ``os.pread``/``os.preadv`` byte, every byte given to ``hashlib.sha256`` and to
``blake3`` -- and fail when any role comes back a second time. They also prove the faster path checks what
the rebuild checked: a resealed ``source.files[].sha256`` fails, whichever path computed it.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive import VerifyOptions
from ckpt_archive.repo import exact_stream, trial_reload

from hostile_archive import edit_manifest, forget_notes, read_manifest

#: bytes read or hashed besides the members' (manifest, marker, repository.json, small documents)
SLACK = 256 << 10


class _Counts:
    """Bytes read with ``os.pread``/``os.preadv`` and given to sha256 and BLAKE3, from every thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.n = {"read": 0, "sha256": 0, "blake3": 0}

    def add(self, what: str, data) -> None:
        n = memoryview(data).nbytes if not isinstance(data, int) else data
        with self.lock:
            self.n[what] += n


def _install(monkeypatch) -> _Counts:
    import blake3

    counts = _Counts()
    real_sha, real_b3, real_pread, real_preadv = hashlib.sha256, blake3.blake3, os.pread, os.preadv

    class Sha:
        def __init__(self, data=b"", **kw):
            self._h = real_sha(**kw)
            if data:
                self.update(data)

        def update(self, data):
            counts.add("sha256", data)
            self._h.update(data)

        def __getattr__(self, name):
            return getattr(self._h, name)

    class B3:
        AUTO = real_b3.AUTO

        def __init__(self, data=None, **kw):
            self._h = real_b3(**kw)
            if data is not None:
                self.update(data)

        def update(self, data):
            counts.add("blake3", data)
            self._h.update(data)
            return self

        def __getattr__(self, name):
            return getattr(self._h, name)

    def pread(fd, n, off):
        out = real_pread(fd, n, off)
        counts.add("read", len(out))
        return out

    def preadv(fd, bufs, off, *a):
        got = real_preadv(fd, bufs, off, *a)
        counts.add("read", got)
        return got

    monkeypatch.setattr(hashlib, "sha256", Sha)
    monkeypatch.setattr(blake3, "blake3", B3)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    return counts


def _state() -> dict:
    """A trainer-like state kept as exact bytes: a bf16 model (compressible), fp32 moments, an incompressible
    block (stored raw), equal storages deduplicated (repeated segments: a later segment names an earlier entry),
    a view, entries of shared objects (>= 1 MiB) and small ones. No tensor of <= 8 elements: the policy audit
    then reads the state tree only (its small tensors would be decoded again, within its 256 MiB budget)."""
    g = torch.Generator().manual_seed(0)
    model = {}
    for i in range(3):
        model[f"l{i}.w"] = (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16)
        model[f"l{i}.ln"] = torch.ones(256)  # equal bytes in every layer: one entry, three segments
        model[f"l{i}.b"] = torch.zeros(300)
    big = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=g)  # 4 MiB of random bytes: stored raw
    return {"model": model, "moments": {"m": torch.randn(300_000, generator=g), "v": torch.rand(300_000, generator=g)},
            "rand": big, "view": big[10:2000]}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepreads")
    src = tmp / "ckpt.pt"
    torch.save(_state(), src)
    repo = tmp / "repo"
    ckpt_archive.pack(str(src), repo)
    return src, repo


def _sizes(repo: Path, src: Path) -> tuple[int, int, int]:
    """(stored bytes of every member and object, raw bytes of tensors members and tree, the source file's size)."""
    m = read_manifest(repo)
    stored = sum(rec["stored_bytes"] for rec in m["members"])
    raw = sum(rec["raw_bytes"] for rec in m["members"] if rec["role"] in ("tensors", "tree"))
    return stored, raw, src.stat().st_size


def _assert_each_byte_once(repo: Path, src: Path, monkeypatch) -> None:
    """verify --deep of generation 1 passes, having read and sha256-hashed each stored byte once, the source file's
    bytes once more by its own sha256, and BLAKE3-hashed each raw byte once (plus :data:`SLACK`)."""
    stored, raw, file_bytes = _sizes(repo, src)
    counts = _install(monkeypatch)
    report = ckpt_archive.verify(repo, 1, VerifyOptions(deep=True))
    assert report.ok, report.problems
    n = counts.n
    assert stored <= n["read"] <= stored + SLACK, n
    assert stored + file_bytes <= n["sha256"] <= stored + file_bytes + SLACK, n
    assert raw <= n["blake3"] <= raw + SLACK, n


def test_the_fixture_streams_every_layout_it_means_to(packed):
    """The state has what the counts must cover: exact bytes, a repeated segment, shared objects, a raw chunk."""
    _, repo = packed
    m = read_manifest(repo)
    f = m["source"]["files"][0]
    keys = [k for _, _, k in f["exact"]["segments"]]
    tensors = next(r for r in m["members"] if r["role"] == "tensors")
    assert len(keys) > len(set(keys)), "no repeated segment"
    assert tensors.get("objects"), "no shared object"
    assert any(c["codec"] == "store" for c in tensors["chunks"]) and any(c["codec"] != "store" for c in tensors["chunks"])


def test_verify_deep_reads_and_hashes_each_stored_byte_once(packed, monkeypatch):
    """Fault (issue 29): verify --deep read, sha256-hashed and decoded every stored chunk twice and BLAKE3-hashed
    every raw byte twice (the exact-bytes file's sha256 was rebuilt by reading each segment's entry again).
    At most: each stored byte read once and sha256-hashed once, plus the source file's one sha256 over its
    bytes; each raw byte BLAKE3-hashed once."""
    src, repo = packed
    _assert_each_byte_once(repo, src, monkeypatch)


def test_the_exact_files_sha256_comes_from_the_trial_reloads_read(packed, monkeypatch):
    """The rebuild (a second read) is not run for a file the stream completed."""
    _, repo = packed

    def no_rebuild(*a, **k):
        raise AssertionError("the exact-bytes file was rebuilt by a second read")

    monkeypatch.setattr(trial_reload, "rebuilt_sha256", no_rebuild)
    report = ckpt_archive.verify(repo, 1, VerifyOptions(deep=True))
    assert report.ok, report.problems


@pytest.mark.parametrize("path", ["stream", "rebuild: entries not kept", "rebuild: skeleton too large"])
def test_a_resealed_source_sha256_fails_verify_deep_on_either_path(packed, tmp_path, monkeypatch, path):
    """Fault guarded: the faster path must check what the rebuild checks. A manifest whose
    ``source.files[].sha256`` is not the rebuilt file's fails verify --deep (restore would refuse it), on the
    stream and on the rebuild the stream falls back to (more to keep than allowed, a skeleton too large)."""
    import shutil

    _, repo = packed
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    if path == "rebuild: entries not kept":
        monkeypatch.setattr(exact_stream, "KEPT_BYTES", 0)
    elif path == "rebuild: skeleton too large":
        monkeypatch.setattr(exact_stream, "SKELETON_WHOLE_BYTES", 0)
    calls = []
    real = trial_reload.rebuilt_sha256
    monkeypatch.setattr(trial_reload, "rebuilt_sha256", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert ckpt_archive.verify(copy, 1, VerifyOptions(deep=True)).ok
    assert bool(calls) == (path != "stream")
    forget_notes(copy)
    edit_manifest(copy, lambda m: m["source"]["files"][0].update(sha256="0" * 64))
    report = ckpt_archive.verify(copy, 1, VerifyOptions(deep=True, record=False))
    assert not report.ok
    assert any(p.field == "source.files" and "restore would refuse it" in p.reason for p in report.problems), \
        report.problems


def test_a_damaged_chunk_falls_back_to_the_rebuild_that_names_it(packed, tmp_path):
    """A stream that did not complete (a chunk fails its sha256) gives no sha256: the file is rebuilt, which
    reports it cannot be, as before; the chunk itself is named on its member."""
    import shutil

    _, repo = packed
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    from ckpt_archive.format.objects import object_key, parts

    m = read_manifest(copy)
    rec = next(r for r in m["members"] if r["role"] == "tensors")
    obj = copy / object_key(parts(rec)[1].oid)  # a shared object: bytes of a segment's entry
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    report = ckpt_archive.verify(copy, 1, VerifyOptions(deep=True, record=False))
    assert not report.ok
    assert any(p.member == rec["path"] and "sha256" in p.reason for p in report.problems), report.problems
    assert any(p.field == "source.files" and "cannot be rebuilt" in p.reason for p in report.problems), \
        report.problems


def test_files_of_a_folder_whose_segments_come_in_another_order_than_the_entries(tmp_path, monkeypatch):
    """A folder of two .pt files (one tensors member, entries file by file) and a file whose storages are
    written in another order than their entries: each file's sha256 is still the rebuilt one, from the
    stream (kept entries) or the rebuild -- and a resealed one fails."""
    src = tmp_path / "src"
    src.mkdir()
    x = torch.randn(64, 64)
    torch.save({"a": x, "v": x[3:9], "z": torch.zeros(5), "w": torch.randn(300_000)}, src / "one.pt")
    torch.save({"w2": torch.randn(10), "a2": x.t(), "same": torch.zeros(5)}, src / "two.pt")
    repo = tmp_path / "repo"
    ckpt_archive.pack(str(src), repo)
    m = read_manifest(repo)
    exact = [i for i, f in enumerate(m["source"]["files"]) if f.get("exact")]
    assert len(exact) == 2
    report = ckpt_archive.verify(repo, 1, VerifyOptions(deep=True))
    assert report.ok, report.problems
    edit_manifest(repo, lambda m: m["source"]["files"][exact[1]].update(sha256="0" * 64))
    report = ckpt_archive.verify(repo, 1, VerifyOptions(deep=True, record=False))
    assert [p.reason.split(":")[0] for p in report.problems if p.field == "source.files"] == \
        [m["source"]["files"][exact[1]]["relpath"]]


@pytest.fixture(scope="module")
def packed_in_shards(tmp_path_factory):
    """The same state packed with a 2 MiB shard size: its file's segments span several tensors members, as a
    state over 4 GiB of tensors does (``repo/writer.py: SHARD_BYTES``)."""
    from ckpt_archive.repo import writer

    tmp = tmp_path_factory.mktemp("deepshards")
    src = tmp / "ckpt.pt"
    torch.save(_state(), src)
    repo = tmp / "repo"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer, "SHARD_BYTES", 2 << 20)
        ckpt_archive.pack(str(src), repo)
    m = read_manifest(repo)
    assert sum(rec["role"] == "tensors" for rec in m["members"]) >= 3
    return src, repo


def test_a_file_whose_segments_span_shards_is_hashed_in_the_one_read(packed_in_shards, monkeypatch):
    """Fault: a file whose segments lay in more than one tensors member was always rebuilt by a second read, so
    verify --deep of every state over 4 GiB of tensors (the ones that take longest) read, hashed and decoded
    every stored byte twice. Now the members' streams feed the file in turn: each stored byte read and
    sha256-hashed once, each raw byte BLAKE3-hashed once, no rebuild."""
    src, repo = packed_in_shards

    def no_rebuild(*a, **k):
        raise AssertionError("the exact-bytes file was rebuilt by a second read")

    monkeypatch.setattr(trial_reload, "rebuilt_sha256", no_rebuild)
    _assert_each_byte_once(repo, src, monkeypatch)


@pytest.mark.parametrize("damage", ["resealed sha256", "a chunk of the middle shard"])
def test_a_file_spanning_shards_still_fails_what_the_rebuild_fails(packed_in_shards, tmp_path, damage):
    """The streamed sha256 across shards checks what the rebuild checks: a resealed ``source.files[].sha256``
    fails; a damaged chunk in a middle shard stops the stream and the file goes to the rebuild, which says it
    cannot be rebuilt, and the chunk is named on its member."""
    import shutil

    _, repo = packed_in_shards
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    forget_notes(copy)
    m = read_manifest(copy)
    if damage == "resealed sha256":
        edit_manifest(copy, lambda m: m["source"]["files"][0].update(sha256="0" * 64))
        want = "restore would refuse it"
    else:
        from ckpt_archive.format.objects import object_key, parts

        shards = [r for r in m["members"] if r["role"] == "tensors"]
        rec = shards[len(shards) // 2]
        oids = [p.oid for p in parts(rec) if p.oid]
        path = copy / object_key(oids[0]) if oids else copy / "generations" / "00000001" / rec["stored_path"]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        want = "cannot be rebuilt"
    report = ckpt_archive.verify(copy, 1, VerifyOptions(deep=True, record=False))
    assert not report.ok
    assert any(p.field == "source.files" and want in p.reason for p in report.problems), report.problems
    if damage != "resealed sha256":
        assert any(p.member == rec["path"] and "sha256" in p.reason for p in report.problems), report.problems
