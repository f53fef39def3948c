"""Retention that cannot leave nothing restorable (issue 24 item 1, docs/retention.md "The guarantees").

The fault, as found: generation 1 was packed without sharing and is intact; generation 2 created shared
objects, and one of them then rotted (a same-size change of its stored bytes, here in the first zstd frame's
header, which every decode reads past). ``pack --keep-last 1`` reused the rotted object on trust, published
generation 3, and retention removed 1 and 2: verify and restore of 3 then exited 1, nothing restored, and
every command had exited 0.

Here the same rot is followed by every command that deletes -- pack with retention (given, and the
repository's default), backup with retention, the Checkpointer's retention, prune, forget, gc -- and each
must leave a generation that restores bit for bit (exit 0). The CLI runs in-process (Typer's CliRunner) on
tiny states: two 1 MiB bf16 tensors shared, one small one of each step.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ckpt_archive
from ckpt_archive.cli.app import app
from ckpt_archive.format.objects import object_key, refs
from ckpt_archive.repo.repository import Repository

torch = pytest.importorskip("torch")

runner = CliRunner()
_g = torch.Generator().manual_seed(7)
FROZEN = {f"frozen.{i}": (torch.randn(512, 1024, generator=_g) * 0.02).to(torch.bfloat16) for i in range(2)}


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def cli_json(*args):
    res = cli(*args, "--json")
    return res, json.loads(res.stdout)


def state(step: int) -> dict:
    return {"model": {**FROZEN, "head": torch.full((8,), float(step))}, "step": step}


def save(path: Path, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state(step), path)
    return path


def usable(repo: Path) -> list[int]:
    return [g.number for g in Repository.open(repo).usable()]


def rot(repo: Path, oid: str) -> bytes:
    """A same-size change of a shared object's stored bytes that decoding reads past (the first frame
    header's unused bit); returns the good bytes."""
    obj = repo / object_key(oid)
    good = obj.read_bytes()
    bad = bytearray(good)
    bad[4] ^= 0x10
    obj.write_bytes(bytes(bad))
    return good


def restores_bit_identical(repo: Path, gen: int | str, source: Path, tmp: Path) -> None:
    """``restore REPO@GEN`` exits 0 and writes the very bytes of the file that was packed."""
    out = tmp / f"restored-{gen}-{len(list(tmp.iterdir()))}.pt"
    res = cli("restore", f"{repo}@{gen}", "--output", out)
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes() == source.read_bytes()


@pytest.fixture
def rotted(tmp_path):
    """Generation 1 without sharing (intact), 2 and 3 sharing the frozen tensors; then one object rots.

    Returns ``(repo, sources {generation: .pt}, the rotted object's name, its good bytes)``.
    """
    repo = tmp_path / "repo"
    src = {n: save(tmp_path / "src" / f"s{n}.pt", n) for n in (1, 2, 3)}
    assert cli("pack", src[1], "--repo", repo, "--no-share").exit_code == 0
    for n in (2, 3):
        assert cli("pack", src[n], "--repo", repo).exit_code == 0
    m2 = Repository.open(repo).generation(2).manifest
    oid = sorted(refs(m2))[0]
    good = rot(repo, oid)
    # The rot is not yet discovered (the case): the setup checks record nothing, so 2 and 3 are still
    # listed usable and each command below must find the rot itself.
    unrecorded = ckpt_archive.VerifyOptions(record=False)
    assert [ckpt_archive.verify(repo, n, unrecorded).ok for n in (1, 2, 3)] == [True, False, False]
    assert usable(repo) == [1, 2, 3]
    return repo, src, oid, good


def test_rot_after_proof_then_pack_keep_last_1_keeps_a_generation_that_restores(tmp_path):
    """The issue's sequence exactly: 1 unshared, 2 creates the objects, one rots, ``pack --keep-last 1`` of
    a state that reuses it. The pack's reuse check finds the rot and writes the object again (a warning
    names it); retention removes 1 and 2; generation 3 verifies and restores bit for bit."""
    repo = tmp_path / "repo"
    src = {n: save(tmp_path / "src" / f"s{n}.pt", n) for n in (1, 2, 3)}
    assert cli("pack", src[1], "--repo", repo, "--no-share").exit_code == 0
    assert cli("pack", src[2], "--repo", repo).exit_code == 0
    oid = sorted(refs(Repository.open(repo).generation(2).manifest))[0]
    good = rot(repo, oid)
    res, out = cli_json("pack", src[3], "--repo", repo, "--keep-last", 1)
    assert res.exit_code == 0, res.stderr
    assert out["generation"] == 3 and out["retention"]["removed"] == [1, 2]
    assert any(object_key(oid) in w and "failed its check" in w for w in out["warnings"]), out["warnings"]
    assert (repo / object_key(oid)).read_bytes() == good
    assert usable(repo) == [3]
    assert cli("verify", f"{repo}@3", "--deep").exit_code == 0
    restores_bit_identical(repo, 3, src[3], tmp_path)


def test_rot_then_pack_with_the_repositorys_default_retention_keeps_a_generation_that_restores(rotted, tmp_path):
    """The same rot, then a pack (reusing the object) under the repository's default policy ``keep_last 1``."""
    repo, src, oid, good = rotted
    r = Repository.open(repo)
    with r.lock():
        r.set_default_retention({"keep_last": 1})
    s4 = save(tmp_path / "src" / "s4.pt", 4)
    res, out = cli_json("pack", s4, "--repo", repo)
    assert res.exit_code == 0, res.stderr
    assert out["retention"]["removed"] == [1, 2, 3] and usable(repo) == [4]
    assert any(object_key(oid) in w for w in out["warnings"]), out["warnings"]
    assert (repo / object_key(oid)).read_bytes() == good
    restores_bit_identical(repo, 4, s4, tmp_path)


def test_rot_then_a_pack_that_does_not_reuse_the_object_counts_only_itself_as_checked(rotted, tmp_path):
    """A pack whose state does not hold the rotted tensor: the generation it published is the one whose
    every stored byte was checked in this operation, so retention may remove the damaged ones and 1."""
    repo, src, oid, good = rotted
    other = tmp_path / "src" / "other.pt"
    torch.save({"model": {"w": torch.ones(4)}, "step": 9}, other)
    res, out = cli_json("pack", other, "--repo", repo, "--keep-last", 1)
    assert res.exit_code == 0, res.stderr
    assert out["retention"]["removed"] == [1, 2, 3] and out["retention"]["verify_kept"]["trusted"] is True
    restores_bit_identical(repo, 4, other, tmp_path)


def test_rot_then_backup_keep_last_1_keeps_a_generation_that_restores(rotted, tmp_path):
    """The same rot, then ``backup --keep-last 1`` of a newer checkpoint holding the same frozen tensors."""
    repo, src, oid, good = rotted
    s4 = save(tmp_path / "run" / "last.pt", 4)
    res, out = cli_json("backup", s4, "--repo", repo, "--settle", 0, "--keep-last", 1)
    assert res.exit_code == 0, res.stderr
    assert out["generation"] == 4 and out["retention"]["removed"] == [1, 2, 3]
    assert any(object_key(oid) in w for w in out["warnings"]), out["warnings"]
    restores_bit_identical(repo, 4, s4, tmp_path)


def test_rot_then_the_checkpointers_retention_keeps_a_generation_that_restores(rotted):
    """The same rot, then a Checkpointer with ``keep_last=1`` saving a state that reuses the object."""
    repo, src, oid, good = rotted
    with ckpt_archive.Checkpointer(repo, retention=ckpt_archive.RetentionPolicy(keep_last=1)) as ck:
        ck.save(4, state(4))
    assert usable(repo) == [4] and (repo / object_key(oid)).read_bytes() == good
    assert cli("verify", f"{repo}@4").exit_code == 0
    out = ckpt_archive.load(repo, 4)
    for k, t in FROZEN.items():
        assert torch.equal(out["model"][k], t)


def test_rot_then_prune_keeps_the_newest_generation_that_verifies(rotted, tmp_path):
    """The same rot, then ``prune --keep-last 1`` (and its dry run, which shows the same decision): the kept
    generation 3 is damaged and so is 2; generation 1, the newest that verifies, stays, and the prune says so."""
    repo, src, oid, good = rotted
    res, dry = cli_json("prune", repo, "--keep-last", 1, "--dry-run")
    assert res.exit_code == 0 and dry["to_remove"] == [2] and dry["verify_kept"]["rescued_generation"] == 1
    res, out = cli_json("prune", repo, "--keep-last", 1)
    assert res.exit_code == 0, res.stderr
    assert out["removed"] == [2] and usable(repo) == [1, 3]
    assert out["verify_kept"]["rescued_generation"] == 1
    assert any("generation 1, the newest that does, is kept" in w and object_key(oid) in w for w in out["warnings"])
    restores_bit_identical(repo, 1, src[1], tmp_path)


def test_rot_then_forget_refuses_the_only_generation_that_verifies(rotted, tmp_path):
    """The same rot, then ``forget``: generation 1 is the only one that verifies, so forgetting it is refused
    (exit 1, naming what fails in the others) and nothing is removed; a damaged one may go (with --force
    for the newest) and generation 1 still restores."""
    repo, src, oid, good = rotted
    res, out = cli_json("forget", f"{repo}@1")
    assert res.exit_code == 1 and out["error"] == "IntegrityError", res.stdout
    assert "only generation that verifies" in out["reason"] and object_key(oid) in out["reason"]
    assert usable(repo) == [1, 2, 3]
    res, out = cli_json("forget", f"{repo}@2")
    assert res.exit_code == 0 and out["verify_kept"]["verified_generation"] == 1, res.stdout
    assert any("kept generation 3 does not verify" in w for w in out["warnings"]), out["warnings"]
    assert cli("forget", f"{repo}@3", "--force").exit_code == 0
    assert usable(repo) == [1]
    assert cli("forget", f"{repo}@1", "--force").exit_code == 1  # the last one that restores stays
    restores_bit_identical(repo, 1, src[1], tmp_path)


def test_forget_of_a_generation_that_fails_too_goes_with_a_warning_when_none_verifies(tmp_path):
    """Forgetting a damaged generation when no generation verifies loses nothing that restores: it goes,
    and the result says that none verifies (never silent)."""
    repo = tmp_path / "repo"
    for n in (1, 2):
        ckpt_archive.pack(state(n), repo)
    oid = sorted(refs(Repository.open(repo).generation(1).manifest))[0]
    rot(repo, oid)
    res, out = cli_json("forget", f"{repo}@1")
    assert res.exit_code == 0, res.stdout
    assert any("no generation of the repository verifies" in w for w in out["warnings"]), out["warnings"]
    assert usable(repo) == [2]


def test_rot_then_gc_removes_nothing_a_usable_generation_references(rotted, tmp_path):
    """The same rot, then ``gc`` (with a partial generation and an orphan object to collect): it removes
    only those, never the damaged generations, nor an object a remaining generation references; generation
    1 still restores, and a pack of the same state repairs 2 and 3."""
    repo, src, oid, good = rotted
    (repo / "generations" / "00000003" / "USABLE.json").unlink()  # 3: partial now (sealed, never published)
    before = sorted(p.relative_to(repo) for p in (repo / "objects").rglob("*.ckz"))
    orphan = repo / object_key("ab" * 32 + "-" + "cd" * 32)  # an object no manifest references
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"left by a killed pack")
    res, out = cli_json("gc", repo)
    assert res.exit_code == 0, res.stdout
    assert [x["generation"] for x in out["removed"]] == [3]
    assert out["removed_objects"] == [str(orphan.relative_to(repo))]
    after = sorted(p.relative_to(repo) for p in (repo / "objects").rglob("*.ckz"))
    assert after == before and (repo / object_key(oid)).exists()
    assert usable(repo) == [1, 2]
    restores_bit_identical(repo, 1, src[1], tmp_path)
    res, out = cli_json("pack", src[2], "--repo", repo, "--keep-last", 1)
    assert res.exit_code == 0 and out["retention"]["removed"] == [1, 2], res.stdout
    restores_bit_identical(repo, out["generation"], src[2], tmp_path)


def test_gc_leaves_a_folder_at_an_unreferenced_object_name_alone_and_names_it(tmp_path):
    """Fault guarded: gc crashing (exit 2, "Is a directory") at a folder standing where an unreferenced object
    would be, so nothing after it was swept; it is not ours to delete: named and left alone."""
    repo = tmp_path / "repo"
    ckpt_archive.pack(state(1), repo)
    odd = repo / object_key("ab" * 32 + "-" + "cd" * 32)
    odd.mkdir(parents=True)
    (odd / "inside").write_bytes(b"x")
    orphan = repo / object_key("ef" * 32 + "-" + "01" * 32)
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"left by a killed pack")
    res, out = cli_json("gc", repo)
    assert res.exit_code == 0, res.stdout
    assert out["removed_objects"] == [str(orphan.relative_to(repo))] and not orphan.exists()
    assert any("is a folder" in s for s in out["objects_skipped"]) and (odd / "inside").exists()
    assert cli("verify", f"{repo}@1").exit_code == 0
