"""torch.distributed.checkpoint (DCP) folders: restricted metadata unpickler, shard checks, pack,
verify, restore byte for byte, ``torch.distributed.checkpoint.load`` from the restored copy, and
``restore --consolidate``.

The DCP checkpoint is written by ``torch.distributed.checkpoint.save`` in one process (no process
group) from a small model + AdamW state + plain values, exactly as a single-rank job writes it.
"""
from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckpt_archive  # noqa: E402
from ckpt_archive.errors import RefusedPickle, SourceError  # noqa: E402
from ckpt_archive.sources import read_source  # noqa: E402
from ckpt_archive.sources.dcp import (  # noqa: E402
    check_dcp_folder,
    consolidate_dcp,
    read_dcp_metadata,
)


def _state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": 7, "extra": {"lr": 0.1, "name": "run-a"}}


def _save(state, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=str(path))


def _load_into(state, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dcp") / "ckpt"
    _save(_state(), d)
    return d


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_metadata_unpickler_refuses_foreign_globals_without_running_them(dcp_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(dcp_dir, d)
    canary = tmp_path / "EXECUTED"
    (d / ".metadata").write_bytes(pickle.dumps({"planted": _Boom(canary)}))
    with pytest.raises(RefusedPickle, match=r"io\.open"):
        read_dcp_metadata(d / ".metadata")
    with pytest.raises(RefusedPickle, match=r"\.metadata"):
        ckpt_archive.pack(d, tmp_path / "repo")
    assert not canary.exists()


def test_consolidate_reads_the_metadata_with_the_restricted_unpickler_first(dcp_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(dcp_dir, d)
    canary = tmp_path / "EXECUTED"
    (d / ".metadata").write_bytes(pickle.dumps(_Boom(canary)))
    with pytest.raises(RefusedPickle):
        consolidate_dcp(d, tmp_path / "whole.pt")
    assert not canary.exists() and not (tmp_path / "whole.pt").exists()


def test_metadata_that_is_not_dcp_metadata_is_named(dcp_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(dcp_dir, d)
    (d / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(SourceError, match="not DCP metadata"):
        read_source(d)
    (d / ".metadata").write_bytes((dcp_dir / ".metadata").read_bytes()[:100])
    with pytest.raises(SourceError, match="truncated"):
        read_source(d)


def test_dcp_folder_detected_with_shard_list_and_progress(dcp_dir):
    src = read_source(dcp_dir)
    assert src.format == "dcp" and src.layout == "folder"
    assert {f.relpath: f.kind for f in src.files} == {".metadata": "opaque", "__0_0.distcp": "opaque"}
    assert src.state == {}
    assert src.progress == {"step": 7}
    rec = src.info["dcp"][""]
    json.dumps(src.info, allow_nan=False)  # strict JSON for the manifest
    size = (dcp_dir / "__0_0.distcp").stat().st_size
    assert rec["files"] == {"__0_0.distcp": {"size": size, "entries": len(rec["entries"]), "needed": size}}
    assert ["model.0.weight", [0, 0], "__0_0.distcp"] == rec["entries"][[e[0] for e in rec["entries"]].index(
        "model.0.weight")][:3]
    assert rec["tensors"] == 16 and rec["problems"] == []


def test_check_names_a_missing_and_a_truncated_shard(dcp_dir):
    info = read_source(dcp_dir).info
    size = (dcp_dir / "__0_0.distcp").stat().st_size
    meta = (dcp_dir / ".metadata").stat().st_size
    assert check_dcp_folder({".metadata": meta, "__0_0.distcp": size}, info) == []
    missing = check_dcp_folder({".metadata": meta}, info)
    assert len(missing) == 1 and missing[0].startswith("__0_0.distcp:") and "missing" in missing[0]
    short = check_dcp_folder({".metadata": meta, "__0_0.distcp": size - 10}, info)
    assert len(short) == 1 and "truncated" in short[0] and str(size) in short[0]
    assert "DCP metadata missing" in check_dcp_folder({"__0_0.distcp": size}, info)[0]


def test_pack_refuses_a_dcp_folder_whose_shard_is_truncated(dcp_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(dcp_dir, d)
    shard = d / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(SourceError, match=r"__0_0\.distcp.*truncated"):
        ckpt_archive.pack(d, tmp_path / "repo")
    shard.unlink()
    with pytest.raises(SourceError, match=r"__0_0\.distcp.*missing"):
        read_source(d, fmt="dcp")


def test_dcp_packs_restores_byte_identical_and_dcp_load_reads_it(dcp_dir, tmp_path):
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(dcp_dir, repo)
    assert res.manifest["source"]["format"] == "dcp" and res.manifest["progress"]["step"] == 7
    report = ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True))
    assert report.ok, report.problems
    assert sorted(ckpt_archive.inspect(repo).opaque_members) == [".metadata", "__0_0.distcp"]
    out = tmp_path / "restored"
    ckpt_archive.restore(repo, output=out)
    for name in (".metadata", "__0_0.distcp"):
        assert (out / name).read_bytes() == (dcp_dir / name).read_bytes()

    want = _state()
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0,
           "extra": {"lr": 0.0, "name": ""}}
    _load_into(got, out)
    assert got["step"] == 7 and got["extra"] == {"lr": 0.1, "name": "run-a"}
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])


def test_restore_consolidate_writes_one_torch_file_with_the_whole_state(dcp_dir, tmp_path):
    repo = tmp_path / "repo"
    ckpt_archive.pack(dcp_dir, repo)
    out, pt = tmp_path / "restored", tmp_path / "whole.pt"
    res = ckpt_archive.restore(repo, output=out, options=ckpt_archive.RestoreOptions(consolidate=pt))
    assert res.extra["consolidated"] == str(pt)
    whole = torch.load(pt, weights_only=True)
    want = _state()
    assert whole["step"] == 7 and whole["extra"]["name"] == "run-a"
    assert all(torch.equal(whole["model"][k], want["model"][k]) for k in want["model"])
    # DCP flattens keys to strings: optimizer state 0 comes back under "0".
    assert torch.equal(whole["optim"]["state"]["0"]["exp_avg"], want["optim"]["state"][0]["exp_avg"])
    with pytest.raises(ckpt_archive.errors.OutputExists):
        ckpt_archive.restore(repo, output=tmp_path / "again", options=ckpt_archive.RestoreOptions(consolidate=pt))
    assert not (tmp_path / "again").exists()


def test_consolidate_is_refused_for_a_source_that_is_not_dcp(tmp_path):
    from ckpt_archive.errors import UsageError

    repo = tmp_path / "repo"
    ckpt_archive.pack({"w": torch.ones(2)}, repo)
    with pytest.raises(UsageError, match="DCP"):
        ckpt_archive.restore(repo, output=tmp_path / "o.pt",
                             options=ckpt_archive.RestoreOptions(consolidate=tmp_path / "c.pt"))
    assert not (tmp_path / "o.pt").exists()


def test_verify_names_a_shard_the_manifest_lost(dcp_dir, tmp_path):
    from ckpt_archive.ops.verify import source_layout_problems as _source_layout_problems

    repo = tmp_path / "repo"
    manifest = ckpt_archive.pack(dcp_dir, repo).manifest
    assert _source_layout_problems(manifest) == []
    manifest["source"]["files"] = [f for f in manifest["source"]["files"] if f["relpath"] != "__0_0.distcp"]
    problems = _source_layout_problems(manifest)
    assert [p.member for p in problems] == ["__0_0.distcp"] and "missing" in problems[0].reason


def test_dcp_subfolder_inside_a_trainer_folder_is_recorded_and_checked(dcp_dir, tmp_path):
    d = tmp_path / "checkpoint-7"
    shutil.copytree(dcp_dir, d / "pytorch_model_fsdp_0")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 7, "epoch": 1.0}))
    src = read_source(d)
    assert src.format == "hf-trainer"
    assert set(src.info["dcp"]) == {"pytorch_model_fsdp_0"}
    assert "pytorch_model_fsdp_0/__0_0.distcp" in src.info["model_files"]
    (d / "pytorch_model_fsdp_0" / "__0_0.distcp").unlink()
    with pytest.raises(SourceError, match="pytorch_model_fsdp_0/__0_0.distcp.*missing"):
        read_source(d)


# --- a real two-rank sharded checkpoint -------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, path: str, port: int) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
        state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.arange(4.0), "step": 11}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=path)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_sharded_checkpoint_restores_and_loads_resharded_in_one_process(tmp_path):
    """Two gloo ranks save one weight sharded by rows (a DTensor, as FSDP2 does): one shard file per
    rank. The archive must keep both, verify must name a lost one, and the restored folder must load
    into one process (DCP reshards) and consolidate."""
    import torch.multiprocessing as mp
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    src = tmp_path / "ckpt"
    mp.start_processes(_rank_main, args=(2, str(src), _free_port()), nprocs=2, start_method="fork")
    s = read_source(src)
    rec = s.info["dcp"][""]
    assert sorted(rec["files"]) == ["__0_0.distcp", "__1_0.distcp"]
    w_chunks = sorted((e[1], e[2]) for e in rec["entries"] if e[0] == "w")
    assert w_chunks == [([0, 0], "__0_0.distcp"), ([4, 0], "__1_0.distcp")]
    assert s.progress == {"step": 11}
    sizes = {f.relpath: f.path.stat().st_size for f in s.files}
    lost = check_dcp_folder({k: v for k, v in sizes.items() if k != "__0_0.distcp"}, s.info)
    assert len(lost) == 1 and lost[0].startswith("__0_0.distcp:")

    repo = tmp_path / "repo"
    res = CliRunner().invoke(app, ["pack", str(src), "--repo", str(repo), "--json"])
    assert res.exit_code == 0, res.output
    out, whole = tmp_path / "restored", tmp_path / "whole.pt"
    res = CliRunner().invoke(app, ["restore", str(repo), "--output", str(out), "--consolidate", str(whole), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["consolidated"] == str(whole)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        assert (out / name).read_bytes() == (src / name).read_bytes()

    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    got = {"w": torch.zeros(8, 6), "b": torch.zeros(4), "step": 0}
    _load_into(got, out)
    assert torch.equal(got["w"], full) and torch.equal(got["b"], torch.arange(4.0)) and got["step"] == 11
    w = torch.load(whole, weights_only=True)
    assert torch.equal(w["w"], full) and w["step"] == 11
