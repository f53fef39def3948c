"""Checkpointer under torch.distributed (gloo on CPU): one generation from every rank, exact restores to the
same and other world sizes and to one process, and a rank killed mid-save leaving nothing usable.

The multi-process tests start real process groups (torchrun, or the same environment by hand for the
killed rank, since torchrun tears every rank down when one dies): each takes 5-20 s, so they are ``slow``.
The writer assignment and the piece assembly are tested here without processes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import IntegrityError
from ckpt_archive.training.dist_restore import assemble
from ckpt_archive.training.distributed import assign_writers

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    env.pop("CKPT_ARCHIVE_INJECT", None)
    return env


def _torchrun(n: int, *args) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={_port()}",
           str(WORKER), *map(str, args)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _results(out: Path, scenario: str, n: int) -> list[dict]:
    res = [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(n)]
    for r in res:
        assert "crash" not in r, r["crash"]
    return res


# -- without processes ---------------------------------------------------------------------------------------
def _fp(sha, nbytes, leaves=None):
    return {"sha256": sha, "nbytes": nbytes, "leaves": leaves or {"x": {"entry": "x"}}}


def test_replicated_entries_are_written_once_and_spread_over_ranks():
    # DDP: the same three tensors on both ranks; a per-rank RNG state that differs
    ranks = [{"a": _fp("A", 100), "b": _fp("B", 60), "c": _fp("C", 50), "rng": _fp("R0", 8)},
             {"a": _fp("A", 100), "b": _fp("B", 60), "c": _fp("C", 50), "rng": _fp("R1", 8)}]
    w = assign_writers(ranks)
    assert w[(0, "a")] == w[(1, "a")] and w[(0, "b")] == w[(1, "b")] and w[(0, "c")] == w[(1, "c")]
    assert {w[(0, "a")], w[(0, "b")]} == {0, 1}, "both big replicated tensors went to one rank"
    assert w[(0, "rng")] == 0 and w[(1, "rng")] == 1, "a per-rank value was deduplicated across ranks"


def test_same_bytes_at_other_shard_offsets_are_not_merged():
    a = _fp("S", 16, {"w": {"entry": "w", "shard": {"offsets": [0]}}})
    b = _fp("S", 16, {"w": {"entry": "w", "shard": {"offsets": [4]}}})
    w = assign_writers([{"w": a}, {"w": b}])
    assert w[(0, "w")] == 0 and w[(1, "w")] == 1


def test_assemble_cuts_any_box_from_the_pieces_and_refuses_a_gap():
    full = torch.arange(48.0).reshape(8, 6)
    rec = {"shape": [8, 6], "dtype": "float32",
           "pieces": [{"key": "p0", "offsets": [0, 0], "sizes": [3, 6]}, {"key": "p1", "offsets": [3, 0], "sizes": [5, 6]}]}
    pieces = {"p0": full[:3].clone(), "p1": full[3:].clone()}
    assert torch.equal(assemble(rec, pieces, [0, 0], [8, 6]), full)
    assert torch.equal(assemble(rec, pieces, [2, 0], [4, 6]), full[2:6])
    with pytest.raises(IntegrityError):
        assemble(rec, {"p0": pieces["p0"]}, [0, 0], [8, 6])


# -- with processes ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ddp_two_ranks_write_one_generation_that_restores_exactly(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    _torchrun(2, "save", "ddp", repo, out)
    saved = _results(out, "save", 2)
    assert [r["generation"] for r in saved] == [2, 2]
    gens = ckpt_archive.list_generations(repo)
    assert [g.number for g in gens] == [1, 2]
    assert ckpt_archive.verify(repo, 2, options=ckpt_archive.VerifyOptions(deep=True)).ok
    manifest = gens[-1].manifest
    paths = [m["path"] for m in manifest["members"]]
    assert any(p.startswith("rank00000/") for p in paths) and any(p.startswith("rank00001/") for p in paths)
    _torchrun(2, "restore", "ddp", repo, out, 2)
    for r in _results(out, "restore", 2):
        assert r["step"] == 4 and r["missing"] == [] and r["mismatch"] == [], r


@pytest.mark.slow
def test_fsdp_four_ranks_restore_on_four_two_and_one_process(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    _torchrun(4, "save", "fsdp", repo, out)
    assert [r["generation"] for r in _results(out, "save", 4)] == [2, 2, 2, 2]
    manifest = ckpt_archive.list_generations(repo)[-1].manifest
    assert manifest["source"]["info"]["distributed"]["world_size"] == 4
    for n in (4, 2):
        for f in out.glob("restore-rank*.json"):
            f.unlink()
        _torchrun(n, "restore", "fsdp", repo, out, 4)
        for r in _results(out, "restore", n):
            assert r["step"] == 4 and r["missing"] == [] and r["mismatch"] == [], (n, r)
            if n != 4:
                assert any("resharded exactly" in w for w in r["warnings"])
    # one process, no process group: consolidated (full tensors), rank 0's per-rank values
    from ckpt_archive.training.dist_restore import load_consolidated

    state = load_consolidated(repo)
    expected = torch.load(out / "expected-4-0.pt", weights_only=True)
    for key, value in expected.items():
        if key.startswith("model/"):
            node = state["model"][key[len("model/"):]]
        elif key.startswith("optimizer/state/"):
            fqn, field = key[len("optimizer/state/"):].rsplit("/", 1)
            node = state["optimizer"]["state"][fqn][field]
        else:
            node = state["rng"]["torch"]
        assert torch.equal(node, value), key
    # and into plain (unsharded) objects in this process through the Checkpointer
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ckpt_archive.Checkpointer(repo, distributed=False) as ckpt:
        got = ckpt.restore(model=model, optimizer=opt, policy="checkpoint")
    assert got.step == 4 and any("consolidated" in w for w in got.report.warnings)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected[f"model/{name}"]), name


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_a_partial_generation_no_reader_lists(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    out.mkdir()
    from ckpt_archive.repo.repository import Repository

    Repository.open(repo, create=True)  # rank 1 opens it with its fault plan before the group exists
    port = _port()
    procs = []
    for rank in range(2):
        env = dict(_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "kill", "ddp", str(repo), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert procs[1].returncode == -9, logs[1][-2000:]  # SIGKILLed at its second save's member write
    r0 = json.loads((out / "kill-rank0.json").read_text())
    assert "crash" not in r0, r0["crash"]
    assert "error" in r0 and "stopped answering" in r0["error"], r0
    listed = ckpt_archive.list_generations(repo)
    assert [g.number for g in listed] == [1], "the generation a dead rank left was listed"
    every = ckpt_archive.list_generations(repo, all=True)
    assert [(g.number, g.status) for g in every] == [(1, "usable"), (2, "partial")]
    from ckpt_archive.training.dist_restore import load_consolidated

    assert load_consolidated(repo)["progress"] == {"step": 2}


DESYNC_CASES = ["at-save", "at-waiting", "at-copy-acquired", "at-submitted", "at-handed-over", "bad-metrics",
                "rank0-fails-after-publish"]


@pytest.mark.slow
def test_a_save_that_fails_on_one_rank_only_never_makes_a_mixed_step_generation(tmp_path):
    """One rank's save(2) raises before its copy is handed over (an interrupt in its wait, in its copy, as it
    hands over; bad metrics), or one rank's previous save failed alone (so its next save raised before
    copying). That rank sat save 2 out while the others made it, and the exchanges pair up by order only:
    rank 0's step 2 met rank 1's step 3, and generations were published usable holding step 2 on one rank
    and step 3 on the other (and 3 with 4), then rank 0 hung at close until the timeout. Now every save call
    takes part in its save's exchanges (with nothing, if it handed no copy over), exchanges are labelled and
    checked, and a failure is raised after the next save's hand-over: step 2 is published by no rank (or by
    all), steps 3 and 4 are, and every usable generation holds its step on every rank."""
    from ckpt_archive.training.dist_restore import load_consolidated

    repo, out = tmp_path / "repos", tmp_path / "out"
    out.mkdir()
    repo.mkdir()
    _torchrun(2, "desync", ",".join(DESYNC_CASES), repo, out)
    logs = [json.loads((out / f"desync-rank{r}.json").read_text()) for r in range(2)]
    for case in DESYNC_CASES:
        usable = {}
        for g in ckpt_archive.list_generations(repo / case):
            step = g.manifest["progress"]["step"]
            for r in range(2):
                got = load_consolidated(repo / case, g.number, rank=r)
                assert (got["step"], got["model"]["w"][0].item(), got["mine"][0].item()) == \
                    (step, float(step), float(10 * step + r)), f"{case}: generation {g.number} mixes steps on rank {r}"
            usable[step] = usable.get(step, 0) + 1
        r0, r1 = logs[0][case]["log"], logs[1][case]["log"]
        assert r0[-1][:2] == ["close", "ok"] and r1[-1][:2] == ["close", "ok"], (case, r0, r1)
        if case in ("at-handed-over", "rank0-fails-after-publish"):
            assert usable == {1: 1, 2: 1, 3: 1, 4: 1}, (case, usable)
        else:
            assert usable == {1: 1, 3: 1, 4: 1}, (case, usable)
            assert r1[1][1] != "ok", (case, r1)
            # rank 0 learns that step 2 was not saved, from its next save (which saved step 3 all the same)
            assert r0[2][1] == "CannotCheck" and "rank 1" in r0[2][2] and "step 2" in r0[2][2], (case, r0)
        if case == "rank0-fails-after-publish":
            assert r0[2][1] == "RuntimeError" and "injected" in r0[2][2], r0
            assert [e[1] for e in r1] == ["ok"] * 5, r1
