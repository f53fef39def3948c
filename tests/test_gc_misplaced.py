"""[break] A shared object file moved into another folder of ``objects/`` (a careless copy, a sync tool, an
attacker) was never collected by gc: readers look for object X only in ``objects/<X[:2]>/``, the listing
skipped a name that belongs elsewhere -- an encrypted store's listing dropped it outright -- so it stayed
forever. gc now deletes such a file when no manifest references its object, and leaves it alone (named)
when one does: it may be that object's only copy."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.format import crypto
from ckpt_archive.repo.repository import Repository


def _repo(tmp_path: Path, encrypted: bool) -> Repository:
    key = None
    if encrypted:
        key = tmp_path / "repo.key"
        key.write_bytes(crypto.new_key_file_text())
    return Repository.open(tmp_path / "r", create=True, key_file=key)


def _pack(r: Repository, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ckpt_archive.pack({"model": {"w": torch.randn(256, 256, generator=g), "frozen": torch.ones(300, 300)},
                       "step": seed}, r, options=ckpt_archive.PackOptions(share_min_bytes=64 << 10))


def _objects(root: Path) -> list[Path]:
    return sorted((root / "objects").rglob("*.ckz"))


def _elsewhere(path: Path) -> Path:
    """The same file name in another (existing or new) two-hex-digit folder of objects/."""
    other = next(f"{i:02x}" for i in range(256) if f"{i:02x}" != path.parent.name)
    (path.parent.parent / other).mkdir(exist_ok=True)
    return path.parent.parent / other / path.name


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_an_object_moved_to_another_folder_is_collected_once_nothing_references_it(tmp_path, encrypted):
    """Fault: the copy in the wrong folder survived every gc (an encrypted repository's listing dropped it)."""
    r = _repo(tmp_path, encrypted)
    _pack(r, 1)
    _pack(r, 2)  # the same "frozen" object, another "w"
    victims = _objects(tmp_path / "r")
    assert len(victims) == 3
    strays = {v: _elsewhere(v) for v in victims}
    for v, stray in strays.items():
        shutil.copy2(v, stray)
    res = ckpt_archive.gc(r)  # all referenced: left alone and named
    assert all(s.exists() for s in strays.values())
    assert sum("outside its folder" in s for s in res.objects_skipped) == 3, res.objects_skipped
    assert ckpt_archive.verify(r, "1", options=ckpt_archive.VerifyOptions(deep=True)).ok
    ckpt_archive.forget(r, "1")  # generation 1's "w" is referenced no more: swept from its place
    res = ckpt_archive.gc(r)
    gone = [v for v in victims if not v.exists()]
    assert len(gone) == 1
    assert not strays[gone[0]].exists(), "the misplaced copy of an unreferenced object was not collected"
    assert len(res.removed_objects) == 1 and res.removed_objects[0].endswith(".ckz"), res.removed_objects
    for v in victims:
        if v.exists():  # still generation 2's: its stray copy is kept (referenced), the object untouched
            assert strays[v].exists()
    assert ckpt_archive.verify(r, "2", options=ckpt_archive.VerifyOptions(deep=True)).ok


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_an_object_moved_out_of_its_folder_is_never_deleted_while_a_generation_needs_it(tmp_path, encrypted):
    """The guard on the fix: moved (not copied), the file is that object's only copy; gc must keep it
    so it can be put back, and the generation then verifies again."""
    r = _repo(tmp_path, encrypted)
    _pack(r, 1)
    _pack(r, 2)
    victim = _objects(tmp_path / "r")[0]
    stray = _elsewhere(victim)
    victim.rename(stray)
    res = ckpt_archive.gc(r)
    assert stray.exists() and any("outside its folder" in s for s in res.objects_skipped), res.objects_skipped
    stray.rename(victim)
    for g in ("1", "2"):
        assert ckpt_archive.verify(r, g, options=ckpt_archive.VerifyOptions(deep=True)).ok
