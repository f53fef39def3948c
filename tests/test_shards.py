"""A state larger than one shard (``repo/writer.py: SHARD_BYTES``, 4 GiB of tensors) packs into several
``tensors-NNNNN.safetensors`` members and comes back exactly by every reader.

The fault: the loop that cut shards reused the name ``prefix`` (the members' path prefix) for each shard's
safetensors header, so every shard after the first got a store key made of header bytes; pack of any state
over 4 GiB of tensors failed at "write members" with exit 1 and a partial generation (found packing the 4 GiB
benchmark state). Nothing tested more than one shard. Here the shard size is made small so a few KiB of
tensors take several shards.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

import ckpt_archive
from ckpt_archive.repo import writer
from tests.helpers import assert_same


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(writer, "SHARD_BYTES", 64 << 10)


def _state():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(96, 128, generator=g)                      # 48 KiB each: a shard holds one of these
    return {"model": {f"layer{i}.weight": torch.rand(96, 128, generator=g) for i in range(5)},
            "tied": {"a": w, "b": w, "row": w[3]},             # one storage, a view of it
            "bf16": torch.rand(200, 100, generator=g).to(torch.bfloat16),
            "step": 7}


def _tensor_members(repo) -> list[str]:
    gen = ckpt_archive.list_generations(repo)[-1]
    return sorted(m["path"] for m in gen.manifest["members"] if m["role"] == "tensors")


def test_a_state_over_one_shard_packs_loads_and_verifies(tmp_path, small_shards):
    state = _state()
    repo = tmp_path / "repo"
    ckpt_archive.pack(state, repo)
    members = _tensor_members(repo)
    assert len(members) >= 4 and members == [f"tensors-{i:05d}.safetensors" for i in range(len(members))], members
    assert ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True)).ok
    back = ckpt_archive.load(repo)
    assert_same(back, state)
    assert back["tied"]["a"].untyped_storage().data_ptr() == back["tied"]["b"].untyped_storage().data_ptr()
    out = tmp_path / "restored.pt"  # no source file: restore writes a torch.save file of the state, one pass
    ckpt_archive.restore(repo, "latest", out)
    assert_same(torch.load(out, weights_only=True), state)
    part = ckpt_archive.load(repo, options=ckpt_archive.LoadOptions(only="model/layer3.weight"))
    assert torch.equal(part, state["model"]["layer3.weight"])


def test_a_torch_save_file_over_one_shard_restores_byte_exact(tmp_path, small_shards):
    src = tmp_path / "ckpt.pt"
    torch.save(_state(), src)
    repo = tmp_path / "repo"
    ckpt_archive.pack(str(src), repo)
    assert len(_tensor_members(repo)) >= 4
    assert ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True)).ok
    out = tmp_path / "restored.pt"
    ckpt_archive.restore(repo, "latest", out)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == hashlib.sha256(src.read_bytes()).hexdigest()
    assert_same(torch.load(out, weights_only=True), torch.load(src, weights_only=True))


def test_an_incremental_pack_over_several_shards_reuses_and_restores(tmp_path, small_shards):
    """The second generation changes one tensor: the others are shared objects across shards."""
    state = _state()
    repo = tmp_path / "repo"
    opts = ckpt_archive.PackOptions(share_min_bytes=1 << 10)
    ckpt_archive.pack(state, repo, options=opts)
    state["model"]["layer2.weight"] = state["model"]["layer2.weight"] + 1
    ckpt_archive.pack(state, repo, options=opts)
    assert ckpt_archive.verify(repo, 2, options=ckpt_archive.VerifyOptions(deep=True)).ok
    assert_same(ckpt_archive.load(repo, 2), state)
