"""Repositories that move (issue 13): a location is compared by identity, not by spelling.

A local repository's place is its resolved real path plus the device and inode of its root folder; a
remote one's its normalised URL. A repository reached through a symlink or a ``..`` path is the same
repository; one copied by ``cp -a`` is a copy (``copied``) until ``ckpt-archive adopt`` proves it here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from ckpt_archive.errors import NotFound
from ckpt_archive.repo.repository import Place, Repository, canonical_url


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8, generator=g)}, "step": seed * 10}


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def real_repo(tmp_path):
    repo = tmp_path / "disk" / "repo"
    for seed in (1, 2):
        ca.pack(_state(seed), repo)
    return repo


def _statuses(path) -> list[tuple[int, str]]:
    return [(g.number, g.status) for g in Repository.open(path).generations()]


def test_repository_reached_through_a_symlink_is_usable_lists_and_restores_latest(real_repo, tmp_path):
    link = tmp_path / "data"
    link.symlink_to(real_repo.parent)
    through = link / "repo"
    assert _statuses(through) == [(1, "usable"), (2, "usable")]
    res = cli("list", through, "--json")
    assert res.exit_code == 0, res.output
    assert [g["generation"] for g in json.loads(res.stdout)["generations"]] == [1, 2]
    out = tmp_path / "restored.pt"
    res = cli("restore", f"{through}@latest", "--output", out)
    assert res.exit_code == 0, res.output
    assert torch.load(out, weights_only=True)["step"] == 20


def test_verify_deep_through_a_symlink_does_not_break_the_real_paths_view(real_repo, tmp_path):
    link = tmp_path / "scratch"
    link.symlink_to(real_repo)
    before = (real_repo / "generations" / "00000002" / "USABLE.json").read_bytes()
    res = cli("verify", f"{link}@2", "--deep")
    assert res.exit_code == 0, res.output
    assert (real_repo / "generations" / "00000002" / "USABLE.json").read_bytes() == before  # not re-stamped
    assert _statuses(real_repo) == [(1, "usable"), (2, "usable")]
    assert _statuses(link) == [(1, "usable"), (2, "usable")]


def test_repository_reached_through_a_dotdot_path_is_the_same_repository(real_repo, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    dotted = f"{tmp_path}/elsewhere/../disk/./repo"
    assert _statuses(dotted) == [(1, "usable"), (2, "usable")]
    assert Repository.open(dotted).location == os.path.realpath(real_repo)
    out = tmp_path / "r.pt"
    res = cli("restore", f"{dotted}@latest", "--output", out)
    assert res.exit_code == 0, res.output
    res = cli("verify", f"{dotted}@latest", "--deep")
    assert res.exit_code == 0, res.output
    assert _statuses(real_repo) == [(1, "usable"), (2, "usable")]


def test_generations_packed_through_a_symlink_are_usable_through_the_real_path(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "home"
    link.symlink_to(tmp_path / "real")
    ca.pack(_state(1), link / "repo")
    marker = json.loads((tmp_path / "real" / "repo" / "generations" / "00000001" / "USABLE.json").read_text())
    assert marker["location"] == os.path.realpath(tmp_path / "real" / "repo")
    assert isinstance(marker["identity"]["ino"], int)
    assert _statuses(tmp_path / "real" / "repo") == [(1, "usable")]


def test_a_repository_moved_with_mv_stays_usable(real_repo, tmp_path):
    moved = tmp_path / "disk" / "renamed"
    os.rename(real_repo, moved)
    assert _statuses(moved) == [(1, "usable"), (2, "usable")]


def test_a_cp_a_copy_is_copied_restorable_with_a_note_and_adopted_in_one_run(real_repo, tmp_path):
    copy = tmp_path / "new-machine" / "repo"
    copy.parent.mkdir()
    subprocess.run(["cp", "-a", str(real_repo), str(copy)], check=True)
    assert _statuses(copy) == [(1, "copied"), (2, "copied")]

    # restorable as it is: the restore decodes and checks every byte, and says so
    out = tmp_path / "r.pt"
    res = cli("restore", f"{copy}@latest", "--output", out)
    assert res.exit_code == 0, res.output
    assert "proven at" in res.output and "ckpt-archive adopt" in res.output
    assert torch.load(out, weights_only=True)["step"] == 20

    res = cli("adopt", copy, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["adopted"] == [1, 2] and doc["ok"] is True
    assert _statuses(copy) == [(1, "usable"), (2, "usable")]
    assert _statuses(real_repo) == [(1, "usable"), (2, "usable")]      # the original is untouched
    marker = Repository.open(copy).generation(2).marker
    assert marker["copied_from"] == os.path.realpath(real_repo)
    assert [g.number for g in ca.list_generations(copy)] == [1, 2]
    res = cli("restore", f"{copy}@latest", "--output", tmp_path / "again.pt")
    assert res.exit_code == 0 and "proven at" not in res.output


def test_adopt_records_a_copied_generation_that_fails_its_deep_check_as_damaged_and_exits_1(real_repo, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(real_repo, copy)
    victim = copy / "generations" / "00000001" / "tensors-00000.safetensors.ckz"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    res = cli("adopt", copy, "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["adopted"] == [2] and list(doc["failed"]) == ["1"]
    assert _statuses(copy) == [(1, "damaged"), (2, "usable")]


def test_a_generation_that_failed_adopt_is_listed_damaged_never_latest_and_restore_names_the_failure(real_repo,
                                                                                                    tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(real_repo, copy)
    victim = copy / "generations" / "00000002" / "tensors-00000.safetensors.ckz"
    good = victim.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    res = cli("adopt", copy, "--json")
    assert res.exit_code == 1 and list(json.loads(res.stdout)["failed"]) == ["2"]
    gen2 = Repository.open(copy).generation(2)
    assert gen2.status == "damaged" and "tensors-00000" in gen2.reason and "restore reads it" not in gen2.reason
    res = cli("list", copy, "--all", "--json")
    rows = {g["generation"]: g for g in json.loads(res.stdout)["generations"]}
    assert rows[2]["status"] == "damaged" and "deep check" in rows[2]["reason"]
    assert Repository.open(copy).resolve("latest", copied=True).number == 1     # the older usable one
    res = cli("restore", f"{copy}@latest", "--output", tmp_path / "l.pt")
    assert res.exit_code == 0 and torch.load(tmp_path / "l.pt", weights_only=True)["step"] == 10
    res = cli("restore", f"{copy}@2", "--output", tmp_path / "x.pt", "--json")
    assert res.exit_code == 1  # a recorded failed check: refused unread (issue 24: exit 1, as the check did)
    assert "deep check" in json.loads(res.stdout)["reason"] and "tensors-00000" in json.loads(res.stdout)["reason"]
    assert not (tmp_path / "x.pt").exists()
    victim.write_bytes(good)                                    # repaired: adopt checks it again and clears it
    res = cli("adopt", copy, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["adopted"] == [2]
    assert _statuses(copy) == [(1, "usable"), (2, "usable")]


def test_a_copy_put_in_place_of_the_original_is_told_by_its_inode(real_repo, tmp_path):
    old = tmp_path / "disk" / "old"
    os.rename(real_repo, old)
    subprocess.run(["cp", "-a", str(old), str(real_repo)], check=True)   # the same path, another folder
    assert _statuses(real_repo) == [(1, "copied"), (2, "copied")]


def test_a_missing_generation_number_names_the_ones_that_exist(real_repo, tmp_path):
    with pytest.raises(NotFound, match=r"no generation 99; existing generations: usable: 1-2"):
        Repository.open(real_repo).resolve("99")
    res = cli("restore", f"{real_repo}@99", "--output", tmp_path / "x.pt")
    assert res.exit_code == 2
    assert "existing generations: usable: 1-2" in res.output


def test_remote_locations_compare_in_one_spelling():
    assert canonical_url("S3A://bucket//runs/a/") == "s3://bucket/runs/a"
    place = Place("s3://bucket/runs/a", local=False)
    assert place.holds({"location": "s3://bucket/runs/a/"})
    assert place.holds({"location": "s3a://bucket//runs/a"})
    assert not place.holds({"location": "s3://bucket/runs/b"})
