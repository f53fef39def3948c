"""Pack refuses a state tree no reader would read back, before it claims a generation (break test).

The fault: a valid state holding a long Python list (a shuffled data permutation of 5M ints) packed
everything, then failed at 'trial reload' ("state tree is not valid JSON (not parsed: its 38888973 bytes
would take about 316668327 bytes of memory to parse...)"), exit 1, and left a generation listed damaged
(10M items: "declares 78888973 raw bytes; a reader holds at most 67108864"). docs/FORMAT.md promises pack
refuses what no reader would read (exit 2) instead of publishing it. The limits are patched small here
(the real ones need a 5M-item list); ``test_pack_and_the_reader_use_the_same_tree_limits`` shows the patched
names are the very ones the reader applies.
"""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import CkptArchiveError, IntegrityError, SourceError
from ckpt_archive.format import limits
from ckpt_archive.repo.repository import Repository


def _state(n: int) -> dict:
    perm = list(range(n))
    random.Random(0).shuffle(perm)
    return {"model": {"w": torch.randn(10)}, "data": {"permutation": perm, "cursor": 5}}


def _nothing_claimed(repo) -> None:
    gens = repo / "generations"
    assert not gens.exists() or list(gens.iterdir()) == [], list(gens.iterdir())
    if (repo / "repository.json").exists():
        assert ckpt_archive.list_generations(repo, all=True) == []


def _sizes(n: int) -> tuple[int, int]:
    """(raw bytes, parse cost) of the tree pack writes for ``_state(n)``."""
    import json

    from ckpt_archive.format.jsonio import parse_cost
    from ckpt_archive.format.state_tree import encode

    # as the writer spells the tree member (repo/writer.py); the "exactly at" test fails if it differs
    raw = json.dumps(encode(_state(n))[0], allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()
    return len(raw), parse_cost(raw)


@pytest.mark.parametrize("limit", ["MAX_TREE_COST", "MAX_TREE_BYTES"])
def test_a_tree_just_over_the_readers_limits_is_refused_before_a_generation_is_claimed(tmp_path, monkeypatch,
                                                                                       limit):
    size, cost = _sizes(100_000)  # ~600 kB of JSON, ~5 MB to parse
    over = (cost if limit == "MAX_TREE_COST" else size) - 1
    monkeypatch.setattr(limits, limit, over)
    repo = tmp_path / "R"
    with pytest.raises(CkptArchiveError) as info:
        ckpt_archive.pack(_state(100_000), repo)
    err = info.value
    assert isinstance(err, SourceError) and err.exit_code == 2, (type(err), err)  # old code: IntegrityError, exit 1
    msg = str(err)
    assert "state tree" in msg and str(size) in msg and str(over) in msg
    assert "/data/permutation" in msg and "100000 items" in msg and "tensor" in msg and "nothing was written" in msg
    _nothing_claimed(repo)


def test_a_tree_exactly_at_the_limits_still_packs(tmp_path, monkeypatch):
    size, cost = _sizes(100_000)
    monkeypatch.setattr(limits, "MAX_TREE_COST", cost)
    monkeypatch.setattr(limits, "MAX_TREE_BYTES", size)
    monkeypatch.setitem(limits.WHOLE_READ_LIMITS, "tree", size)  # the declared-size check at manifest parse
    res = ckpt_archive.pack(_state(100_000), tmp_path / "R")
    assert res.generation == 1 and res.status == "usable"
    assert ckpt_archive.load(tmp_path / "R")["data"]["permutation"] == _state(100_000)["data"]["permutation"]


def test_pack_and_the_reader_use_the_same_tree_limits(tmp_path, monkeypatch):
    """One rule for both sides: a generation packed under the real limits is refused by the reader once the
    very names pack checks (limits.MAX_TREE_COST) are lowered, and pack then refuses the same state."""
    repo = tmp_path / "R"
    ckpt_archive.pack(_state(100_000), repo)
    monkeypatch.setattr(limits, "MAX_TREE_COST", 200_000)
    from ckpt_archive.ops.common import open_repo
    from ckpt_archive.repo.reader import ArchiveReader

    r = open_repo(repo)
    gen = r.resolve("latest")
    with pytest.raises(IntegrityError, match="200000"):
        ArchiveReader(r.store, gen.key, gen.manifest).tree()
    with pytest.raises(SourceError, match="200000"):
        ckpt_archive.pack(_state(100_000), repo)
    assert [g.number for g in ckpt_archive.list_generations(repo, all=True)] == [1]


def test_the_cli_refuses_with_exit_2_and_no_traceback(tmp_path):
    src = tmp_path / "perm.pt"
    torch.save(_state(100_000), src)
    code = ("import sys; from ckpt_archive.format import limits; limits.MAX_TREE_COST = 200_000; "
            "from ckpt_archive.cli.app import main; sys.exit(main())")
    run = subprocess.run([sys.executable, "-c", code, "pack", str(src), "--repo", str(tmp_path / "RC")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr and "/data/permutation" in run.stderr and "tensor" in run.stderr
    _nothing_claimed(tmp_path / "RC")


def test_the_checkpointer_reports_the_refusal_and_publishes_nothing(tmp_path, monkeypatch):
    from ckpt_archive.training.checkpointer import Checkpointer

    monkeypatch.setattr(limits, "MAX_TREE_COST", 200_000)
    repo = tmp_path / "R"
    Repository.open(repo, create=True)
    ckpt = Checkpointer(Repository.open(repo))
    with pytest.raises(SourceError, match="/data/permutation"):
        ckpt.save(1, _state(100_000), block=True)
    ckpt.close()
    _nothing_claimed(repo)
