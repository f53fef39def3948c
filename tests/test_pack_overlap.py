"""Issue 29: pack's stages overlap -- encoded chunks are written by a writer thread while the feeding thread
goes on (bounded), and a source file's tensor bytes are hashed once, in the read that also checks its CRCs.
Speed is measured by benchmarks/run.py; these tests pin the behaviour the speed comes from and that
nothing is lost on the way (order, errors, fingerprints)."""
from __future__ import annotations

import errno
import io
import threading

import pytest
import torch

import ckpt_archive
from ckpt_archive.format.codec import iter_decoded
from ckpt_archive.format.member_writer import MemberWriter


class _Recorder(io.BytesIO):
    """A member file that records which thread wrote each piece (and can fail)."""

    def __init__(self, fail_after: int | None = None):
        super().__init__()
        self.threads: list[str] = []
        self.fail_after = fail_after

    def write(self, data) -> int:
        self.threads.append(threading.current_thread().name)
        if self.fail_after is not None and len(self.threads) > self.fail_after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_chunks_are_written_off_the_feeding_thread_in_order():
    """Guards against the feeding thread doing every write (it then spends its time in the kernel while the
    encoders wait): every write comes from the writer thread, and the file decodes to what was fed."""
    data = bytes(range(256)) * 4096  # 1 MiB
    fh = _Recorder()
    w = MemberWriter(fh, chunk_bytes=64 << 10, jobs=2)
    for i in range(0, len(data), 100_000):
        w.add(data[i:i + 100_000], "zstd")
    rec = w.finish()
    assert len(fh.threads) == len(rec["chunks"]) > 8
    assert threading.current_thread().name not in fh.threads
    assert all(name.startswith("ckpt-write") for name in fh.threads)
    fh.seek(0)
    assert b"".join(bytes(c) for _, c in iter_decoded(fh, rec, member="m")) == data


def test_a_failed_write_on_the_writer_thread_fails_the_member():
    """Guards against a write error on the writer thread being lost: disk full on the 3rd chunk raises
    OSError(ENOSPC) to the caller (from add or finish), never a member record."""
    fh = _Recorder(fail_after=2)
    w = MemberWriter(fh, chunk_bytes=16 << 10, jobs=2)
    with pytest.raises(OSError) as err:
        for _ in range(64):
            w.add(bytes(16 << 10), "store")
        w.finish()
    assert err.value.errno == errno.ENOSPC
    w.abort()


def test_a_source_files_tensor_bytes_are_hashed_once_in_its_scan(tmp_path, monkeypatch):
    """Guards against reading and hashing a tensor's bytes twice: a file read without torch gives its
    entries the fingerprints its scan took of their records (the CRC read); the writer hashes none of them
    again, and the trial reload proves them (the generation is usable and verifies deeply)."""
    from ckpt_archive.format import fingerprint
    from ckpt_archive.repo import writer

    state = {"a": torch.randn(300, 700), "b": torch.arange(50_000, dtype=torch.int32), "step": 1}
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    hashed = []
    real = fingerprint.digest
    monkeypatch.setattr(writer.fingerprint, "digest",
                        lambda data, alg, **k: hashed.append(len(memoryview(data).cast("B"))) or real(data, alg, **k))
    res = ckpt_archive.pack(src, tmp_path / "r")
    assert [n for n in hashed if n >= 1000] == [], "tensor bytes hashed again by the writer"
    assert res.status == "usable"
    assert ckpt_archive.verify(tmp_path / "r", options=ckpt_archive.VerifyOptions(deep=True)).ok
    back = ckpt_archive.load(tmp_path / "r")
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])
