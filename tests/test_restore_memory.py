"""Issue 29: restore writes a tensor larger than memory's share chunk by chunk, for any dtype and any
compressibility: no buffer of a whole entry is ever built (a 1 GiB .pt of two random 512 MiB fp32 tensors
peaked at 1.1 GiB of anonymous memory). Memory itself is measured by benchmarks/run.py, never here: these
tests catch the fault -- an entry assembled in one buffer -- at a toy size, and check what streaming must
still refuse.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import IntegrityError
from ckpt_archive.ops.pack import PackOptions

CHUNK = 4096


@contextlib.contextmanager
def no_entry_buffers(monkeypatch):
    """Fail any entry buffer larger than two chunks that the reader asks for (an entry assembled whole; entries
    are assembled by the reader's :class:`~ckpt_archive.repo.entries.EntryCutter`)."""
    from ckpt_archive.format import limits
    from ckpt_archive.repo import entries

    def guard(real):
        def wrapped(nbytes, *a, **k):
            assert nbytes <= 2 * CHUNK, f"a {nbytes}-byte buffer: an entry assembled whole"
            return real(nbytes, *a, **k)
        return wrapped

    with monkeypatch.context() as m:
        m.setattr(entries, "lazy_buffer", guard(limits.lazy_buffer))
        yield


def _state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3000, generator=g)  # incompressible fp32: stored raw, chunk after chunk
    return {"big": torch.randn(40, 100, generator=g), "bf16": torch.randn(5000, generator=g).to(torch.bfloat16),
            "int": torch.arange(6000, dtype=torch.int64), "bool": torch.rand(9000, generator=g) > 0.5,
            "view": base[100:2900:3], "tied": [base, base], "empty": torch.empty(0, 3), "step": 3}


@pytest.mark.parametrize("source", ["file", "object"])
def test_restore_never_assembles_an_entry_and_gives_back_exact_values(tmp_path, source, monkeypatch):
    """Guards against restore building a whole tensor in memory (exact bytes of a .pt, and the one-pass
    torch.save of a Python object alike): the entries span many 4 KiB chunks, and no buffer larger than two
    chunks may be asked for; the output equals what was packed, views and tied storages included."""
    state = _state()
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    ckpt_archive.pack(src if source == "file" else state, tmp_path / "r", PackOptions(chunk_bytes=CHUNK))
    out = tmp_path / "out.pt"
    with no_entry_buffers(monkeypatch):
        ckpt_archive.restore(tmp_path / "r", output=out)
    if source == "file":
        assert out.read_bytes() == src.read_bytes()
    back = torch.load(out, weights_only=True)
    for k in ("big", "bf16", "int", "bool", "view", "empty"):
        assert torch.equal(back[k], state[k]) and back[k].stride() == state[k].stride(), k
    assert back["tied"][0].data_ptr() == back["tied"][1].data_ptr()
    assert back["view"].untyped_storage().data_ptr() == back["tied"][0].untyped_storage().data_ptr()


@pytest.mark.parametrize("source", ["file", "object"])
def test_a_damaged_chunk_late_in_an_entry_fails_restore_and_leaves_no_output(tmp_path, source):
    """Guards against streaming weakening the check: restore writes pieces before the entry's fingerprint
    is known, so a changed byte in a late chunk of an entry must still fail it (IntegrityError) and remove
    what was written."""
    state = _state()
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    ckpt_archive.pack(src if source == "file" else state, tmp_path / "r", PackOptions(chunk_bytes=CHUNK,
                                                                                       share_min_bytes=0))
    gen = tmp_path / "r" / "generations" / sorted(os.listdir(tmp_path / "r" / "generations"))[0]
    member = next(p for p in gen.iterdir() if p.name.startswith("tensors-"))
    data = bytearray(member.read_bytes())
    data[len(data) - 3 * CHUNK] ^= 0x40
    os.chmod(member, 0o644)
    member.write_bytes(bytes(data))
    out = tmp_path / "out.pt"
    with pytest.raises(IntegrityError):
        ckpt_archive.restore(tmp_path / "r", output=out, options=ckpt_archive.RestoreOptions(force=True))
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.pt")]
