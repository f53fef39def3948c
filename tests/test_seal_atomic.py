"""A failed seal leaves no manifest.json, and a never-published generation whose manifest cannot be read is a
``partial`` leftover that ``gc`` removes (break test).

The fault: on a 60 MiB tmpfs filled to ~9.85 MB free, pack failed at step 'seal' saying "generation 3 left
partial ... `ckpt-archive gc` ... removes it", but it had left manifest.json at 0 bytes; `list --all` showed
"damaged: empty manifest", gc kept it ("not a leftover") and deleted no shared object, so a later
`pack --keep-last 1` removed generation 1 but kept its object. The full disk is reproduced with the fault
point ``seal-write`` (ENOSPC with half the manifest written), and the state an older seal left (an empty or
cut manifest.json, no marker) is made by hand.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import CkptArchiveError
from ckpt_archive.ops.gc import gc as collect_garbage
from ckpt_archive.repo.repository import Repository
from ckpt_archive.store.faults import Faults

BIG = 300_000  # float32: 1.2 MB, above share_min_bytes: each "head" is a shared object of its own


def _state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"model": {"head": torch.randn(BIG, generator=g), "b": torch.randn(8, generator=g)}, "step": i}


def _objects(repo: Path) -> set[str]:
    root = repo / "objects"
    return {str(p.relative_to(repo)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def _status(repo: Path) -> dict[int, tuple[str, str]]:
    return {g.number: (g.status, g.reason) for g in ckpt_archive.list_generations(repo, all=True)}


def _fail_at(repo: Path, spec: str, i: int) -> Exception:
    r = Repository.open(repo, faults=Faults.parse(spec))
    with pytest.raises((CkptArchiveError, OSError, RuntimeError)) as info:
        ckpt_archive.pack(_state(i), r)
    return info.value


def test_a_full_disk_during_seal_leaves_no_manifest_and_gc_removes_the_generation(tmp_path):
    repo = tmp_path / "R"
    ckpt_archive.pack(_state(1), repo)
    before = _objects(repo)
    err = _fail_at(repo, "seal-write=enospc", 2)  # old code: no such point, the pack succeeds
    assert "left partial" in str(getattr(err, "__notes__", "")) + str(err) or "space" in str(err).lower()
    gen = repo / "generations" / "00000002"
    assert not (gen / "manifest.json").exists(), "a failed seal left a manifest.json"
    assert not [p.name for p in gen.iterdir() if p.name.startswith(".manifest.json")], "temporary name left"
    assert _status(repo)[2][0] == "partial"
    res = collect_garbage(repo)
    assert [x["generation"] for x in res.removed] == [2] and res.kept_not_usable == []
    assert not gen.exists() and _objects(repo) == before  # its own shared object is gone too
    assert [g.number for g in ckpt_archive.list_generations(repo, all=True)] == [1]


@pytest.mark.parametrize("cut", ["empty", "half"])
def test_an_unpublished_generation_with_an_empty_or_cut_manifest_is_a_leftover_gc_removes(tmp_path, cut):
    repo = tmp_path / "R"
    ckpt_archive.pack(_state(1), repo)
    keep = _objects(repo)
    _fail_at(repo, "after-seal=raise", 2)  # sealed, never published: its manifest and its own object
    gen = repo / "generations" / "00000002"
    raw = (gen / "manifest.json").read_bytes()
    assert _objects(repo) != keep
    # what an older seal left on a full disk: the manifest's file, empty or cut short
    (gen / "manifest.json").write_bytes(b"" if cut == "empty" else raw[:len(raw) // 2])
    status, reason = _status(repo)[2]
    assert status == "partial", (status, reason)  # old code: damaged ("empty manifest" / not valid JSON)
    assert "no USABLE marker" in reason and "cannot be read" in reason
    res = collect_garbage(repo)  # old code: "not a leftover, left in place", no object deleted
    assert [x["generation"] for x in res.removed] == [2], res
    assert res.kept_not_usable == [] and not gen.exists()
    assert _objects(repo) == keep, "the leftover's own shared object was not freed"


def test_retention_is_not_blocked_by_an_unreadable_leftover(tmp_path):
    """pack --keep-last 1 with such a leftover present removes generation 1 *and* its object."""
    repo = tmp_path / "R"
    ckpt_archive.pack(_state(1), repo)
    first = _objects(repo)
    _fail_at(repo, "after-seal=raise", 2)
    (repo / "generations" / "00000002" / "manifest.json").write_bytes(b"")
    from ckpt_archive.retention.policy import RetentionPolicy

    ckpt_archive.pack(_state(3), repo, retention=RetentionPolicy(keep_last=1))
    assert 1 not in _status(repo)
    assert not first & _objects(repo), "generation 1's own object was kept"  # old code: kept


def test_a_published_generation_with_an_empty_manifest_stays_damaged_and_is_kept(tmp_path):
    repo = tmp_path / "R"
    ckpt_archive.pack(_state(1), repo)
    ckpt_archive.pack(_state(2), repo)
    (repo / "generations" / "00000001" / "manifest.json").write_bytes(b"")  # marker present: evidence
    assert _status(repo)[1][0] == "damaged"
    res = collect_garbage(repo)
    assert res.removed == [] and [k["generation"] for k in res.kept_not_usable] == [1]
    assert (repo / "generations" / "00000001" / "USABLE.json").exists()
