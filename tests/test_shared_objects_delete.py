"""Shared objects (format 3) are deleted only when no generation's manifest references them any more.

Each test is named after the fault it guards against: an object deleted while a remaining generation
(usable or only partial) still needs it, an object leaked after its last user went, a deletion decided
without knowing what an unreadable manifest references, an orphan of a killed pack trusted by a later
pack or never collected, and an unproven object vouched for by a new generation.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_archive
from ckpt_archive.format.objects import object_key, refs
from ckpt_archive.ops.forget import forget
from ckpt_archive.ops.gc import gc
from ckpt_archive.ops.prune import prune
from ckpt_archive.repo.repository import Repository
from ckpt_archive.retention.policy import RetentionPolicy

torch = pytest.importorskip("torch")

BIG = 300_000  # float32 elements: 1.2 MB raw, above the default share_min_bytes (1 MiB)


def big_state(seed: int = 0, step: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"base": torch.randn(BIG, generator=g), "emb": torch.randn(280_000, generator=g),
                      "bias": torch.randn(16, generator=g)}, "step": step}


def object_files(repo: Path) -> list[str]:
    root = repo / "objects"
    return sorted(str(p.relative_to(repo)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def committed_objects(repo: Path) -> list[str]:
    return [k for k in object_files(repo) if k.endswith(".ckz") and not Path(k).name.startswith(".")]


def referenced(repo: Path) -> set[str]:
    """Object keys referenced by any readable manifest in the repository."""
    out = set()
    for g in Repository.open(repo).generations():
        if g.manifest is not None:
            out |= {object_key(oid) for oid in refs(g.manifest)}
    return out


def manifest_fps(repo: Path, number: int) -> set[str]:
    """The names (oids) of the shared objects generation ``number`` references."""
    g = Repository.open(repo).generation(number)
    return set(refs(g.manifest))


def assert_bit_exact(a: dict, b: dict) -> None:
    for k in ("base", "emb", "bias"):
        x, y = a["model"][k], b["model"][k]
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), k
    assert a["step"] == b["step"]


def cli(*args, inject: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CKPT_ARCHIVE_INJECT"}
    if inject:
        env["CKPT_ARCHIVE_INJECT"] = inject
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "ckpt_archive", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def two_sharing(tmp_path):
    """Generations 1 and 2 of one state: 2 references 1's objects."""
    repo = tmp_path / "repo"
    st = big_state()
    ckpt_archive.pack(st, repo)
    ckpt_archive.pack(st, repo)
    objs = committed_objects(repo)
    assert len(objs) == 2 and manifest_fps(repo, 1) == manifest_fps(repo, 2)
    return repo, st, objs


def test_forget_of_first_sharing_generation_keeps_objects_the_second_needs(two_sharing):
    repo, st, objs = two_sharing
    res = forget(repo, 1)
    assert committed_objects(repo) == objs
    assert res.objects.removed == [] and all(v == [2] for v in res.objects.in_use.values())
    assert len(res.objects.in_use) == 2 and res.to_json()["objects"]["freed_bytes"] == 0
    assert ckpt_archive.verify(repo, 2, options=ckpt_archive.VerifyOptions(deep=True)).ok
    assert_bit_exact(ckpt_archive.load(repo, 2), st)


def test_prune_of_first_sharing_generation_keeps_objects_and_sweeps_once(two_sharing, monkeypatch):
    repo, st, objs = two_sharing
    ckpt_archive.pack(big_state(seed=1, step=3), repo)  # generation 3: its own objects
    all_before = committed_objects(repo)
    assert len(all_before) == 4
    from ckpt_archive.repo import objects as objects_mod

    builds = []
    real_build = objects_mod.ObjectIndex.build.__func__

    def counting_build(cls, *a, **k):
        builds.append(1)
        return real_build(cls, *a, **k)

    monkeypatch.setattr(objects_mod.ObjectIndex, "build", classmethod(counting_build))
    res = prune(str(repo), RetentionPolicy(keep_last=1))
    assert res.removed == [1, 2]
    assert len(builds) == 1, "prune must sweep once after all removals, not once per generation"
    # 1 and 2 were the only users of the first state's objects: freed together, once
    assert sorted(res.objects.removed) == objs and res.objects.freed_bytes > 2 * BIG
    assert committed_objects(repo) == sorted(set(all_before) - set(objs))
    assert res.to_json()["objects"]["removed_count"] == 2


def test_prune_keeps_objects_a_remaining_generation_references(two_sharing):
    repo, st, objs = two_sharing
    res = prune(str(repo), RetentionPolicy(keep_last=1))
    assert res.removed == [1]
    assert res.objects.removed == [] and sorted(object_key(fp) for fp in res.objects.in_use) == objs
    assert_bit_exact(ckpt_archive.load(repo, 2), st)


def test_forgetting_the_last_user_deletes_its_objects_and_reports_the_bytes(two_sharing):
    repo, st, objs = two_sharing
    forget(repo, 1)
    ckpt_archive.pack({"step": 7}, repo)  # 3: what restores once 2 is gone (the only one is never forgotten)
    sizes = sum((repo / k).stat().st_size for k in objs)
    proc = cli("forget", f"{repo}@2", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert sorted(data["objects"]["removed"]) == objs
    assert data["objects"]["freed_bytes"] == sizes
    assert committed_objects(repo) == []


def test_unreadable_manifest_blocks_object_deletion_with_a_clear_message(two_sharing):
    repo, st, objs = two_sharing
    ckpt_archive.pack({"step": 7}, repo)  # generation 3, then its manifest is damaged beyond parsing
    man = repo / Repository.open(repo).generation(3).key / "manifest.json"
    os.chmod(man, 0o644)
    man.write_bytes(b"{not json")
    assert Repository.open(repo).generation(3).status == "damaged"
    ckpt_archive.pack({"step": 8}, repo)  # 4: what restores once 2 is gone (the only one is never forgotten)
    forget(repo, 1)
    proc = cli("forget", f"{repo}@2")
    assert proc.returncode == 0, proc.stderr
    assert "generation 3's manifest cannot be read" in proc.stderr and "no shared object was deleted" in proc.stderr
    assert committed_objects(repo) == objs, "objects deleted although a manifest's references were unknown"
    g = gc(str(repo))
    assert g.removed_objects == [] and "generation 3's manifest cannot be read" in g.objects_kept
    assert committed_objects(repo) == objs
    # the damaged generation forgotten: its references were unknown, so every unreferenced object goes
    res = forget(repo, 3)
    assert sorted(res.objects.removed) == objs and committed_objects(repo) == []


def test_orphans_of_a_pack_killed_after_writing_objects_are_removed_by_gc(tmp_path):
    repo = tmp_path / "repo"
    src = tmp_path / "state.pt"
    torch.save(big_state(), src)
    proc = cli("pack", src, "--repo", repo, inject="object-commit=kill@2")
    assert proc.returncode == -9, proc.stderr[-500:]
    orphans = committed_objects(repo)
    assert len(orphans) == 2 and not referenced(repo)
    res = gc(str(repo), dry_run=True)
    assert sorted(res.removed_objects) == orphans and committed_objects(repo) == orphans
    proc = cli("gc", repo, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert sorted(data["removed_objects"]) == orphans and data["freed_object_bytes"] > 2 * BIG
    assert committed_objects(repo) == [] and Repository.open(repo).generations() == []


def test_temporary_file_of_an_interrupted_object_write_is_removed_by_gc(tmp_path):
    repo = tmp_path / "repo"
    src = tmp_path / "state.pt"
    torch.save(big_state(), src)
    proc = cli("pack", src, "--repo", repo, inject="object-write=kill")
    assert proc.returncode == -9, proc.stderr[-500:]
    tmps = [k for k in object_files(repo) if Path(k).name.startswith(".")]
    assert tmps and all(".tmp-" in k for k in tmps)  # objects being written when the kill came
    res = gc(str(repo))
    assert sorted(res.removed_files) == tmps and object_files(repo) == []


def test_later_pack_replaces_an_orphan_object_rather_than_trusting_it(tmp_path):
    repo = tmp_path / "repo"
    src = tmp_path / "state.pt"
    st = big_state()
    torch.save(st, src)
    proc = cli("pack", src, "--repo", repo, inject="object-commit=kill@2")
    assert proc.returncode == -9, proc.stderr[-500:]
    orphans = committed_objects(repo)
    assert len(orphans) == 2
    for key in orphans:  # the orphan is garbage now: a pack that trusted it would publish garbage
        p = repo / key
        os.chmod(p, 0o644)
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    res = ckpt_archive.pack(st, repo)
    assert res.status == "usable"
    assert {object_key(fp) for fp in manifest_fps(repo, res.generation)} == set(orphans)
    assert ckpt_archive.verify(repo, res.generation, options=ckpt_archive.VerifyOptions(deep=True)).ok
    assert_bit_exact(ckpt_archive.load(repo, res.generation), st)


def test_partial_generation_protects_its_objects_and_a_new_pack_checks_them_in_full(tmp_path):
    repo = tmp_path / "repo"
    src = tmp_path / "state.pt"
    st = big_state()
    torch.save(st, src)
    ckpt_archive.pack(st, repo)                                  # 1: usable, creates the objects
    proc = cli("pack", src, "--repo", repo, inject="after-seal=kill")  # 2: sealed, no marker, references them
    assert proc.returncode == -9, proc.stderr[-500:]
    assert Repository.open(repo).generation(2).status == "partial"
    objs = committed_objects(repo)
    assert {object_key(fp) for fp in manifest_fps(repo, 2)} == set(objs) and len(objs) == 2
    ckpt_archive.pack({"step": 7}, repo)  # 3: what restores once 1 is gone (the only one is never forgotten)
    res = forget(repo, 1)
    assert res.objects.removed == [] and all(v == [2] for v in res.objects.in_use.values())
    assert committed_objects(repo) == objs, "an object a partial generation references was deleted"
    # a new pack of the same state does not take objects only a partial generation references on trust:
    # it names them (same bytes, same names) and its own trial reload checks every chunk of them
    new = ckpt_archive.pack(st, repo)
    assert manifest_fps(repo, new.generation) == manifest_fps(repo, 2)
    assert ckpt_archive.verify(repo, new.generation, options=ckpt_archive.VerifyOptions(deep=True)).ok
    g = gc(str(repo))
    assert [x["generation"] for x in g.removed] == [2] and g.removed_objects == []
    assert committed_objects(repo) == objs
    assert_bit_exact(ckpt_archive.load(repo, new.generation), st)


def test_withdrawn_generation_does_not_leak_the_objects_it_created(tmp_path):
    repo = tmp_path / "repo"
    ckpt_archive.pack({"step": 0}, repo)
    from ckpt_archive.repo.publish import Withdrawn

    with pytest.raises(Withdrawn):
        ckpt_archive.pack(big_state(), repo, before_publish=lambda cand: "source changed while packing")
    assert committed_objects(repo) == [] and object_files(repo) == []
    assert [g.number for g in Repository.open(repo).generations()] == [1]


def test_a_symlinked_object_folder_is_left_alone_and_the_rest_is_swept(tmp_path):
    """Fault guarded: forget reporting "not removed" (exit 2) after it had removed the generation, and gc
    stopping at the first symlinked object folder, because the object sweep raised on a link instead of
    leaving it alone and sweeping the rest."""
    import shutil

    repo = tmp_path / "repo"
    st = big_state()
    ckpt_archive.pack(st, repo)
    objs = committed_objects(repo)
    assert len(objs) >= 1
    folder = repo / Path(objs[0]).parent
    outside = tmp_path / "outside"
    shutil.move(str(folder), str(outside))
    folder.symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in outside.iterdir())
    res = forget(repo, 1, force=True)
    assert res.objects.skipped and "symbolic link" in res.objects.skipped[0]
    assert Repository.open(repo).numbers() == []
    assert sorted(p.name for p in outside.iterdir()) == before  # nothing deleted through the link
    g = gc(str(repo))
    assert sorted(p.name for p in outside.iterdir()) == before
    assert not any(k for k in committed_objects(repo) if not k.startswith(str(Path(objs[0]).parent)))
    assert g.objects_skipped and "symbolic link" in g.objects_skipped[0]


def test_a_file_where_the_objects_folder_should_be_is_a_missing_object_not_an_os_error(tmp_path):
    """Fault guarded: `verify` exiting 2 with a bare "Not a directory" when objects/ (or objects/<hh>)
    is a regular file; it is a missing object (exit 1) naming the generations it breaks."""
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "repo"
    ckpt_archive.pack(big_state(), repo)
    shutil.rmtree(repo / "objects")
    (repo / "objects").write_bytes(b"not a folder")
    for deep in ([], ["--deep"]):
        res = subprocess.run([sys.executable, "-m", "ckpt_archive.cli.app", "verify", f"{repo}@1", *deep],
                             capture_output=True, text=True)
        assert res.returncode == 1, res.stderr
        assert "missing" in res.stdout + res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("harm", ["symlink", "unreadable"])
def test_a_symlinked_or_unreadable_object_lets_fallback_use_the_older_sound_generation(tmp_path, monkeypatch, harm):
    """Fault guarded (shared-objects break test): a shared object replaced by a symbolic link, or made
    unreadable (chmod 000), stopped `restore --fallback` for the whole repository (UnsafePath exit 1, a bare
    PermissionError exit 2) and verify named no generation, while an older generation that does not
    reference the object was sound. Now the object is a problem naming every generation it breaks, and
    --fallback restores the older one; without --fallback restore refuses naming it."""
    from ckpt_archive.errors import CkptArchiveError
    from ckpt_archive.store.local import LocalStore

    repo = tmp_path / "r"
    ckpt_archive.pack(big_state(0, 1), repo)
    later = big_state(0, 2)
    later["model"]["emb"] = torch.randn(280_000, generator=torch.Generator().manual_seed(9))  # a new object
    ckpt_archive.pack(later, repo)
    ckpt_archive.pack({**later, "step": 3}, repo)
    bad = sorted(manifest_fps(repo, 3) - manifest_fps(repo, 1))
    assert bad, "generations 2 and 3 share an object generation 1 does not have"
    path = repo / object_key(bad[0])
    if harm == "symlink":
        target = tmp_path / "moved.ckz"
        os.replace(path, target)
        os.symlink(target, path)
    else:
        real_open = LocalStore.open_read

        def deny(self, key):
            if key == object_key(bad[0]):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(self, key)

        monkeypatch.setattr(LocalStore, "open_read", deny)
    report = ckpt_archive.verify(repo, 3)
    assert not report.ok and any("2, 3" in p.reason for p in report.problems), report.problems
    with pytest.raises(CkptArchiveError):
        ckpt_archive.restore(repo, "latest", tmp_path / "x.pt")
    res = ckpt_archive.restore(repo, "latest", tmp_path / "x.pt", options=ckpt_archive.RestoreOptions(fallback=True))
    assert res.generation == 1
    assert_bit_exact(torch.load(tmp_path / "x.pt", weights_only=True), big_state(0, 1))
