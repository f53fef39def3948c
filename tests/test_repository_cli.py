"""forget / gc / prune / backup / list --all through the CLI (in-process, Typer's CliRunner), on tiny states.

Every test here builds a throw-away repository with a handful of tiny generations (a few floats each),
so the module runs in seconds.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ckpt_archive
import ckpt_archive.ops.pack
import ckpt_archive.ops.verify
from ckpt_archive.ops import backup as backup_mod
from ckpt_archive.cli.app import app
from ckpt_archive.errors import LockError
from ckpt_archive.repo.repository import Repository
from s3server import s3_env, s3_server, s3_url  # noqa: F401  (pytest fixtures)

from tests.helpers import without_read_leases

torch = pytest.importorskip("torch")

runner = CliRunner()
LOSSES = [0.9, 0.5, 0.7, 0.8, 0.85]


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def cli_json(*args):
    res = cli(*args, "--json")
    assert res.stderr == "", res.stderr  # --json: the JSON object and nothing else, errors included
    return res, json.loads(res.stdout)  # exactly one JSON object on stdout, or this fails


def state(i: int) -> dict:
    return {"model": {"w": torch.full((3,), float(i))}, "step": i * 100}


def make_repo(path: Path, losses=LOSSES, **kw) -> Path:
    for i, v in enumerate(losses, start=1):
        ckpt_archive.pack(state(i), path, annotations=ckpt_archive.Annotations(metrics={"val_loss": v}), **kw)
    return path


def usable(repo: Path) -> list[int]:
    return [g.number for g in Repository.open(repo).usable()]


def statuses(repo: Path) -> dict[int, str]:
    return {g.number: g.status for g in Repository.open(repo).generations()}


def gen_dir(repo: Path, n: int) -> Path:
    return repo / "generations" / f"{n:08d}"


def make_partial(repo: Path, n: int) -> None:
    """What a crash between seal and publish leaves: the generation without its marker."""
    (gen_dir(repo, n) / "USABLE.json").unlink()


@pytest.fixture
def repo5(tmp_path):
    return make_repo(tmp_path / "repo")


# ---------------------------------------------------------------------------------------------- prune
def test_prune_keep_last_and_best_keeps_the_best_and_the_newest(repo5):
    res, out = cli_json("prune", repo5, "--keep-last", 1, "--keep-best", 1, "--best-by", "val_loss:min")
    assert res.exit_code == 0, res.stderr
    assert usable(repo5) == [2, 5]
    assert sorted(out["removed"]) == [1, 3, 4]
    assert [k["generation"] for k in out["keep"]] == [5, 2]
    assert not gen_dir(repo5, 1).exists() and not gen_dir(repo5, 3).exists()
    for n in (2, 5):
        assert ckpt_archive.verify(repo5, n, options=ckpt_archive.VerifyOptions(deep=True)).ok


def test_prune_when_newest_is_best_only_it_stays(tmp_path):
    repo = make_repo(tmp_path / "r", [0.9, 0.5, 0.7, 0.8, 0.3])
    res = cli("prune", repo, "--keep-last", 1, "--keep-best", 1, "--best-by", "val_loss:min")
    assert res.exit_code == 0, res.stderr
    assert usable(repo) == [5]


def test_prune_dry_run_prints_table_with_reasons_and_deletes_nothing(repo5):
    before = sorted(p.name for p in (repo5 / "generations").iterdir())
    res = cli("prune", repo5, "--keep-last", 1, "--keep-best", 1, "--best-by", "val_loss:min", "--dry-run")
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in (repo5 / "generations").iterdir()) == before
    assert usable(repo5) == [1, 2, 3, 4, 5]
    err = " ".join(res.stdout.split())                     # the decision is prune's result: stdout
    assert "REMOVE" in err and "matched no keep rule" in err and "newest usable" in err and "val_loss:min" in err
    assert "would remove 3 generation(s): 1, 3, 4" in err
    assert res.stderr == ""  # the decision is the result: stdout only, nothing to warn about (issue 26)


def test_prune_dry_run_json_is_one_object_and_deletes_nothing(repo5):
    res, out = cli_json("prune", repo5, "--keep-last", 2, "--dry-run")
    assert res.exit_code == 0
    assert out["dry_run"] is True and out["removed"] == []
    assert [e["generation"] for e in out["remove"]] == [3, 2, 1]
    assert usable(repo5) == [1, 2, 3, 4, 5]


def test_prune_refuses_an_empty_policy_and_deletes_nothing(repo5):
    res, out = cli_json("prune", repo5)
    assert res.exit_code == 2
    assert out["ok"] is False and out["error"] == "UsageError" and "empty retention policy" in out["reason"]
    res = cli("prune", repo5)
    assert res.exit_code == 2
    assert "empty retention policy" in res.stderr and "Traceback" not in res.stderr
    assert usable(repo5) == [1, 2, 3, 4, 5]


def test_prune_refuses_a_policy_that_would_remove_every_generation(repo5):
    res = cli("prune", repo5, "--keep-tag", "release")
    assert res.exit_code == 2
    assert "keeps none of the 5 usable" in res.stderr
    assert usable(repo5) == [1, 2, 3, 4, 5]
    res = cli("prune", repo5, "--keep-best", 1, "--best-by", "val_los:min")  # typo in the metric
    assert res.exit_code == 2 and usable(repo5) == [1, 2, 3, 4, 5]


def test_prune_uses_the_repository_default_policy(repo5):
    repo = Repository.open(repo5)
    with repo.lock():
        repo.set_default_retention({"keep_last": 2})
    res = cli("prune", repo5)
    assert res.exit_code == 0, res.stderr
    assert usable(repo5) == [4, 5]


def test_prune_never_counts_or_removes_a_partial_generation(repo5):
    make_partial(repo5, 5)  # the newest is partial: #4 is the newest usable
    make_partial(repo5, 2)  # the best is partial: it must not count as best
    res, out = cli_json("prune", repo5, "--keep-last", 1, "--keep-best", 1, "--best-by", "val_loss:min")
    assert res.exit_code == 0, res.stderr
    assert usable(repo5) == [3, 4]
    st = statuses(repo5)
    assert st[5] == "partial" and st[2] == "partial"  # left for gc
    reasons = {e["generation"]: e["reasons"] for e in out["not_usable"]}
    assert "gc" in reasons[5][0]


def test_prune_dry_run_says_partial_generations_are_left_for_gc(repo5):
    make_partial(repo5, 3)
    res = cli("prune", repo5, "--keep-last", 1, "--dry-run")
    assert "left for gc" in " ".join(res.stdout.split())


@pytest.mark.parametrize("args, message", [
    (("--keep-within", "2x"), "bad duration"),
    (("--keep-best", "1"), "--best-by"),
    (("--keep-best", "1", "--best-by", "val_loss"), "METRIC:min"),
])
def test_prune_bad_flags_exit_2_with_a_one_line_reason(repo5, args, message):
    res = cli("prune", repo5, *args)
    assert res.exit_code == 2
    assert message in res.stderr and "Traceback" not in res.stderr
    assert usable(repo5) == [1, 2, 3, 4, 5]


def test_prune_of_a_missing_repository_is_exit_2(tmp_path):
    res = cli("prune", tmp_path / "nope", "--keep-last", 1)
    assert res.exit_code == 2 and "repository" in res.stderr


def test_prune_fails_with_lock_error_while_another_writer_holds_the_lock(repo5):
    with Repository.open(repo5).lock():
        res, out = _lock_contended_prune(repo5)
    assert res.exit_code == 2 and out["error"] == "LockError"
    assert usable(repo5) == [1, 2, 3, 4, 5]


def _lock_contended_prune(repo):
    # the lock is an OS lock on REPO/.lock: a second FileLock on it conflicts even in-process
    return cli_json("prune", repo, "--keep-last", 1)


def test_pack_with_retention_applies_it_only_after_the_new_generation_is_usable(tmp_path):
    repo = make_repo(tmp_path / "r", [0.5, 0.4, 0.3])
    res = ckpt_archive.pack(state(9), repo, annotations=ckpt_archive.Annotations(metrics={"val_loss": 0.9}), retention=ckpt_archive.RetentionPolicy.from_dict({"keep_last": 1}))
    assert res.retention["removed"] == [1, 2, 3]
    assert usable(repo) == [4]


def test_pack_with_a_policy_that_keeps_nothing_old_still_packs_and_warns(tmp_path):
    repo = make_repo(tmp_path / "r", [0.5])
    res = ckpt_archive.pack(state(2), repo, retention=ckpt_archive.RetentionPolicy.from_dict({"keep_tag": ["release"]}))
    assert res.status == "usable"
    assert usable(repo) == [1, 2]
    assert any("retention not applied" in w for w in res.retention["warnings"])


# ------------------------------------------------------------------ prune never deletes the only verified copy
def flip_byte(repo: Path, n: int, member: str = "tensors-00000.safetensors.ckz") -> Path:
    """Silent corruption of one stored member of generation n (its marker still says usable)."""
    f = gen_dir(repo, n) / member
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    return f


def test_prune_keeps_the_newest_intact_generation_when_the_kept_one_is_corrupt(tmp_path):
    """Fault guarded (issue 24 item 1): a prune that keeps only a damaged generation deleting every one that
    restores. The newest generation the policy removes that verifies stays, and the prune says so."""
    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])
    flip_byte(repo, 3)
    res, out = cli_json("prune", repo, "--keep-last", 1)
    assert res.exit_code == 0, res.stderr
    assert out["removed"] == [1] and usable(repo) == [2, 3]
    assert out["verify_kept"]["rescued_generation"] == 2 and out["verify_kept"]["verified_generation"] is None
    assert [f["generation"] for f in out["verify_kept"]["failed"]] == [3]
    assert any("generation 2, the newest that does, is kept" in w and "tensors-00000.safetensors" in w
               for w in out["warnings"]), out["warnings"]
    assert cli("verify", f"{repo}@2").exit_code == 0  # the intact copy is still there
    human = make_repo(tmp_path / "r2", [0.9, 0.8, 0.7])
    flip_byte(human, 3)
    res = cli("prune", human, "--keep-last", 1)
    text = " ".join((res.stdout + res.stderr).split())  # the table is the result (stdout), the warning stderr
    assert res.exit_code == 0 and "KEPT: no kept generation verifies, this one does" in text, text
    assert "removed 1 generation(s): 1; kept 2" in text and "warning: no kept generation verifies" in text


def test_prune_refuses_to_remove_anything_when_no_generation_verifies(tmp_path):
    """Fault guarded: a prune deleting generations when none of those that would stay verifies, nor any it
    removes (every copy damaged: a pack of the same state may still repair shared objects)."""
    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])
    for n in (1, 2, 3):
        flip_byte(repo, n)
    res, out = cli_json("prune", repo, "--keep-last", 1)
    assert res.exit_code == 1, res.stderr
    assert out["ok"] is False and out["error"] == "IntegrityError"
    assert all(f"generation {n}" in out["reason"] for n in (1, 2, 3)) and "tensors-00000.safetensors" in out["reason"]
    assert "nothing was removed" in out["reason"] and "Traceback" not in res.stderr
    assert usable(repo) == [1, 2, 3]


def test_prune_refuses_when_every_generation_lost_a_member_and_names_it(tmp_path):
    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])
    for n in (1, 2, 3):
        (gen_dir(repo, n) / "tensors-00000.safetensors.ckz").unlink()
    res, out = cli_json("prune", repo, "--keep-last", 1)
    assert res.exit_code == 1 and out["error"] == "IntegrityError", res.stderr
    assert "generation 3" in out["reason"] and "tensors-00000.safetensors" in out["reason"]
    assert usable(repo) == [1, 2, 3]


def test_prune_refusal_does_not_save_the_policy_as_default(tmp_path):
    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])
    for n in (1, 2, 3):
        flip_byte(repo, n)
    assert cli("prune", repo, "--keep-last", 1, "--save-default").exit_code == 1
    assert json.loads((repo / "repository.json").read_text())["retention"] is None


def test_prune_removes_only_after_an_older_kept_generation_verifies_and_warns_about_the_corrupt_newest(tmp_path):
    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])
    flip_byte(repo, 3)
    res, out = cli_json("prune", repo, "--keep-last", 2)
    assert res.exit_code == 0, res.stderr
    assert out["removed"] == [1] and usable(repo) == [2, 3]
    assert out["verify_kept"]["verified_generation"] == 2 and out["verify_kept"]["trusted"] is False
    assert [f["generation"] for f in out["verify_kept"]["failed"]] == [3]
    assert any("kept generation 3 does not verify" in w for w in out["warnings"])
    human = make_repo(tmp_path / "r2", [0.9, 0.8, 0.7])
    flip_byte(human, 3)
    res = cli("prune", human, "--keep-last", 2)
    assert res.exit_code == 0, res.stderr
    assert "warning: kept generation 3 does not verify" in " ".join(res.stderr.split())


def test_prune_dry_run_shows_the_kept_generation_check_and_a_refusal_it_would_meet(tmp_path):
    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])
    res = cli("prune", repo, "--keep-last", 2, "--dry-run")
    text = " ".join(res.stdout.split())
    assert res.exit_code == 0 and "kept generation 3 verified (stored sizes + sha256)" in text, text
    flip_byte(repo, 3)
    res, out = cli_json("prune", repo, "--keep-last", 1, "--dry-run")  # the same decision as the real prune
    assert res.exit_code == 0 and out["dry_run"] is True and out["removed"] == []
    assert out["verify_kept"]["rescued_generation"] == 2 and out["to_remove"] == [1]
    flip_byte(repo, 2)
    flip_byte(repo, 1)
    res, out = cli_json("prune", repo, "--keep-last", 1, "--dry-run")
    assert res.exit_code == 1, res.stderr
    assert out["ok"] is False and out["dry_run"] is True and out["removed"] == []
    assert out["verify_kept"]["ok"] is False and out["verify_kept"]["failed"][0]["generation"] == 3
    assert "refusing to prune" in out["refused"]
    res = cli("prune", repo, "--keep-last", 1, "--dry-run")
    assert "FAILS verify" in " ".join(res.stdout.split())        # the decision table: stdout
    assert "a prune would be refused" in " ".join(res.stderr.split())  # the error: stderr
    assert usable(repo) == [1, 2, 3]


def test_prune_with_nothing_to_remove_reads_no_generation(repo5, monkeypatch):
    def no_reading(*a, **k):
        raise AssertionError("a generation was read although nothing is removed")

    monkeypatch.setattr(ckpt_archive.ops.verify, "verify", no_reading)
    res, out = cli_json("prune", repo5, "--keep-last", 5)
    assert res.exit_code == 0, res.stderr
    assert out["verify_kept"]["needed"] is False and usable(repo5) == [1, 2, 3, 4, 5]


def test_prune_checks_kept_generations_newest_first_and_stops_at_the_first_that_verifies(repo5, monkeypatch):
    read = []
    real_verify = ckpt_archive.ops.verify.verify

    def recording(repo, generation, **kw):
        read.append(int(generation))
        return real_verify(repo, generation, **kw)

    monkeypatch.setattr(ckpt_archive.ops.verify, "verify", recording)
    flip_byte(repo5, 5)
    res, out = cli_json("prune", repo5, "--keep-last", 3)
    assert res.exit_code == 0, res.stderr
    assert read == [5, 4] and out["removed"] == [1, 2]


def test_pack_time_retention_counts_the_just_published_generation_as_verified_without_rereading_it(tmp_path,
                                                                                                   monkeypatch):
    from ckpt_archive.ops import prune as prune_ops

    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])

    def no_reading(*a, **k):
        raise AssertionError("the generation pack just verified was read again")

    monkeypatch.setattr(ckpt_archive.ops.verify, "verify", no_reading)
    r = Repository.open(repo)
    with r.lock():
        ret = prune_ops.apply_after_pack(r, {"keep_last": 1}, verified=(3,))
    assert ret["removed"] == [1, 2] and ret["verify_kept"]["trusted"] is True
    assert usable(repo) == [3]


def test_pack_time_retention_without_a_verified_generation_keeps_one_that_verifies(tmp_path):
    """Fault guarded: retention after a pack removing the only generations that restore when the one it keeps
    is corrupt; and removing anything at all when none verifies."""
    from ckpt_archive.ops import prune as prune_ops

    repo = make_repo(tmp_path / "r", [0.9, 0.8, 0.7])
    flip_byte(repo, 3)
    r = Repository.open(repo)
    with r.lock():
        ret = prune_ops.apply_after_pack(r, {"keep_last": 1})
    assert ret["removed"] == [1] and ret["kept"] == [3, 2] and usable(repo) == [2, 3]
    assert any("generation 2, the newest that does, is kept" in w for w in ret["warnings"]), ret["warnings"]
    flip_byte(repo, 2)
    with r.lock():
        ret = prune_ops.apply_after_pack(r, {"keep_last": 1})
    assert ret["removed"] == []
    assert any("retention not applied, nothing removed" in w and "generation 3" in w for w in ret["warnings"])
    assert usable(repo) == [2, 3]


def test_backup_retention_does_not_reread_the_generation_it_just_packed(tmp_path, monkeypatch):
    src = tmp_path / "run" / "last.pt"
    repo = tmp_path / "repo"
    save_pt(src, 1)
    assert backup_cli(src, repo)[0].exit_code == 0

    def no_reading(*a, **k):
        raise AssertionError("the generation backup just packed was read again")

    monkeypatch.setattr(ckpt_archive.ops.verify, "verify", no_reading)
    save_pt(src, 2)
    res, out = backup_cli(src, repo, "--keep-last", 1)
    assert res.exit_code == 0, res.stderr
    assert out["retention"]["removed"] == [1] and out["retention"]["verify_kept"]["trusted"] is True


# ---------------------------------------------------------------------------------------------- forget
def test_forget_removes_one_generation_and_leaves_the_others_usable(repo5):
    res, out = cli_json("forget", f"{repo5}@3")
    assert res.exit_code == 0, res.stderr
    assert out["generation"] == 3 and out["status"] == "usable" and out["newest_usable"] == 5
    assert usable(repo5) == [1, 2, 4, 5]
    assert not gen_dir(repo5, 3).exists()
    assert ckpt_archive.verify(repo5, 4).ok


def test_forget_refuses_the_newest_usable_generation_without_force(repo5):
    for spec in (f"{repo5}@5", f"{repo5}@latest", str(repo5)):
        res = cli("forget", spec)
        assert res.exit_code == 2
        assert "newest usable" in res.stderr and "--force" in res.stderr
    assert usable(repo5) == [1, 2, 3, 4, 5]
    res = cli("forget", f"{repo5}@5", "--force")
    assert res.exit_code == 0, res.stderr
    assert usable(repo5) == [1, 2, 3, 4]


def test_forget_when_newest_is_partial_protects_the_newest_usable_one(repo5):
    make_partial(repo5, 5)
    assert cli("forget", f"{repo5}@4").exit_code == 2
    assert cli("forget", f"{repo5}@5").exit_code == 0  # a partial one may go
    assert statuses(repo5) == {1: "usable", 2: "usable", 3: "usable", 4: "usable"}


def test_forget_of_a_missing_generation_is_exit_2(repo5):
    res = cli("forget", f"{repo5}@42")
    assert res.exit_code == 2 and "42" in res.stderr


def test_forget_removes_the_marker_before_anything_else(repo5, monkeypatch):
    """Stop the deletion right after the marker went: the generation must read as partial, never usable."""
    monkeypatch.setenv("CKPT_ARCHIVE_INJECT", "prune-after-marker-removal=raise")
    res = cli("forget", f"{repo5}@2")
    assert res.exit_code == 2
    assert statuses(repo5)[2] == "partial"
    assert (gen_dir(repo5, 2) / "manifest.json").exists()  # members and manifest still there, marker gone
    assert usable(repo5) == [1, 3, 4, 5]


# ---------------------------------------------------------------------------------------------- gc
def test_gc_removes_partial_generations_and_says_which(repo5):
    make_partial(repo5, 2)
    (gen_dir(repo5, 6)).mkdir()
    (gen_dir(repo5, 6) / "CLAIM").touch()  # claimed, nothing written
    res, out = cli_json("gc", repo5)
    assert res.exit_code == 0, res.stderr
    assert sorted(x["generation"] for x in out["removed"]) == [2, 6]
    assert not gen_dir(repo5, 2).exists() and not gen_dir(repo5, 6).exists()
    assert usable(repo5) == [1, 3, 4, 5]
    res = cli("gc", repo5)
    assert "nothing to remove" in res.stdout


def test_gc_human_output_names_each_removed_generation(repo5):
    make_partial(repo5, 3)
    res = cli("gc", repo5)
    assert res.exit_code == 0
    assert "removed generation 3: partial" in res.stdout


def test_gc_dry_run_removes_nothing(repo5):
    make_partial(repo5, 2)
    res, out = cli_json("gc", repo5, "--dry-run")
    assert [x["generation"] for x in out["removed"]] == [2]
    assert statuses(repo5)[2] == "partial"


def test_gc_keeps_damaged_generations_as_evidence(repo5):
    m = gen_dir(repo5, 3) / "manifest.json"
    m.write_bytes(m.read_bytes().replace(b'"generation": 3', b'"generation": 3 '))
    assert statuses(repo5)[3] == "damaged"
    res, out = cli_json("gc", repo5)
    assert out["removed"] == []
    assert [x["generation"] for x in out["kept_not_usable"]] == [3]
    assert gen_dir(repo5, 3).exists()


def test_gc_removes_temporary_files_of_an_interrupted_replace(repo5):
    stray = gen_dir(repo5, 4) / ".USABLE.json.tmp-99999"
    stray.write_text("{")
    root_stray = repo5 / ".backup-state.json.tmp-4242"
    root_stray.write_text("{")
    res, out = cli_json("gc", repo5)
    assert res.exit_code == 0
    assert not stray.exists() and not root_stray.exists()
    assert usable(repo5) == [1, 2, 3, 4, 5]


def test_next_pack_reports_leftovers_and_gc_clears_them(repo5):
    make_partial(repo5, 5)
    res = ckpt_archive.pack(state(6), repo5)
    assert any("generation 5" in x for x in res.leftovers)
    cli("gc", repo5)
    assert ckpt_archive.pack(state(7), repo5).leftovers == []


# ---------------------------------------------------------------------------------------------- list --all
def test_list_all_shows_partial_and_damaged_with_why(repo5):
    make_partial(repo5, 2)
    m = gen_dir(repo5, 3) / "manifest.json"
    m.write_bytes(m.read_bytes() + b" ")
    res, out = cli_json("list", repo5, "--all")
    assert res.exit_code == 0, res.stderr
    by = {g["generation"]: g for g in out["generations"]}
    assert by[2]["status"] == "partial" and by[2]["reason"]
    assert by[3]["status"] == "damaged" and "sha256" in by[3]["reason"]
    res, out = cli_json("list", repo5)
    assert [g["generation"] for g in out["generations"]] == [1, 4, 5]


# ---------------------------------------------------------------------------------------------- backup
def save_pt(path: Path, i: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state(i), path)
    return path


def backup_cli(source, repo, *more):
    return cli_json("backup", source, "--repo", repo, "--settle", 0, *more)


def test_backup_packs_a_file_then_a_second_tick_does_nothing(tmp_path):
    src = save_pt(tmp_path / "run" / "last.pt", 1)
    repo = tmp_path / "repo"
    res, out = backup_cli(src, repo)
    assert res.exit_code == 0, res.stderr
    assert out["action"] == "packed" and out["generation"] == 1
    res, out = backup_cli(src, repo)
    assert res.exit_code == 0
    assert out["action"] == "unchanged" and out["generation"] == 1 and out["read_bytes"] == 0
    res = cli("backup", src, "--repo", repo, "--settle", 0)
    assert res.exit_code == 0 and "nothing to do" in res.stdout
    assert usable(repo) == [1]
    state_file = json.loads((repo / "backup-state.json").read_text())
    assert state_file["sources"][str(src.absolute())]["generation"] == 1


def test_backup_tick_with_nothing_new_reads_no_file_content(tmp_path, monkeypatch):
    src = save_pt(tmp_path / "run" / "last.pt", 1)
    repo = tmp_path / "repo"
    assert backup_cli(src, repo)[0].exit_code == 0

    def no_reading(*a, **k):
        raise AssertionError("an unchanged source was read")

    monkeypatch.setattr(backup_mod, "hash_files", no_reading)
    monkeypatch.setattr(ckpt_archive.ops.pack, "pack", no_reading)
    res, out = backup_cli(src, repo)
    assert res.exit_code == 0 and out["action"] == "unchanged"


def test_backup_touched_but_identical_source_is_read_once_and_not_packed_again(tmp_path):
    src = save_pt(tmp_path / "run" / "last.pt", 1)
    repo = tmp_path / "repo"
    backup_cli(src, repo)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    res, out = backup_cli(src, repo)
    assert out["action"] == "unchanged" and out["read_bytes"] == st.st_size
    assert usable(repo) == [1]
    res, out = backup_cli(src, repo)
    assert out["read_bytes"] == 0  # the new stat facts were remembered


def test_backup_changed_source_makes_a_new_generation_and_applies_retention(tmp_path):
    src = tmp_path / "run" / "last.pt"
    repo = tmp_path / "repo"
    for i in range(1, 4):
        save_pt(src, i)
        res, out = backup_cli(src, repo, "--keep-last", 2)
        assert res.exit_code == 0, res.stderr
        assert out["action"] == "packed" and out["generation"] == i
    assert usable(repo) == [2, 3]
    assert out["retention"]["removed"] == [1]
    loaded = ckpt_archive.load(repo)
    assert loaded["step"] == 300


def test_backup_picks_the_highest_checkpoint_n_folder(tmp_path):
    out_dir = tmp_path / "out"
    for n in (500, 1000, 200):
        save_pt(out_dir / f"checkpoint-{n}" / "model.pt", n)
    (out_dir / "tmp-checkpoint-2000").mkdir()  # HF Trainer's in-progress name: ignored
    res, out = backup_cli(out_dir, tmp_path / "repo")
    assert res.exit_code == 0, res.stderr
    assert out["checkpoint"].endswith("checkpoint-1000")
    assert ckpt_archive.load(tmp_path / "repo")["model.pt"]["step"] == 100000


def test_backup_picks_the_newest_pt_file_in_an_output_folder(tmp_path):
    out_dir = tmp_path / "out"
    a = save_pt(out_dir / "epoch1.pt", 1)
    b = save_pt(out_dir / "checkpoints" / "epoch2.ckpt", 2)
    os.utime(a, (time.time() - 100, time.time() - 100))
    res, out = backup_cli(out_dir, tmp_path / "repo")
    assert res.exit_code == 0, res.stderr
    assert out["checkpoint"] == str(b.absolute())


def test_backup_of_a_folder_without_checkpoint_is_exit_2(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("hi")
    res, out = backup_cli(tmp_path / "out", tmp_path / "repo")
    assert res.exit_code == 2 and "no checkpoint found" in out["reason"]
    res = cli("backup", tmp_path / "out", "--repo", tmp_path / "repo", "--settle", 0)
    assert res.exit_code == 2 and "no checkpoint found" in res.stderr


def test_backup_of_a_missing_source_is_exit_2(tmp_path):
    res, out = backup_cli(tmp_path / "nope.pt", tmp_path / "repo")
    assert res.exit_code == 2 and out["error"] == "NotFound"


def test_backup_skips_a_truncated_torch_zip_with_exit_75(tmp_path):
    src = save_pt(tmp_path / "run" / "last.pt", 1)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])  # the zip's central directory (written last) is missing
    res, out = backup_cli(src, tmp_path / "repo")
    assert res.exit_code == 75
    assert out["action"] == "busy" and "zip is not whole" in out["reason"]
    res = cli("backup", src, "--repo", tmp_path / "repo", "--settle", 0)
    assert res.exit_code == 75 and "exit 75" in res.stdout
    assert not (tmp_path / "repo" / "generations").exists() or usable(tmp_path / "repo") == []


def test_backup_skips_a_checkpoint_folder_with_a_temporary_file(tmp_path):
    ck = tmp_path / "out" / "checkpoint-10"
    save_pt(ck / "model.pt", 1)
    (ck / "optimizer.pt.tmp").write_bytes(b"x")
    res, out = backup_cli(tmp_path / "out", tmp_path / "repo")
    assert res.exit_code == 75 and "temporary file" in out["reason"]


def test_backup_skips_a_truncated_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    ck = tmp_path / "out" / "checkpoint-10"
    ck.mkdir(parents=True)
    save_file({"w": torch.ones(16)}, str(ck / "model.safetensors"))
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[:-8])
    res, out = backup_cli(tmp_path / "out", tmp_path / "repo")
    assert res.exit_code == 75 and "safetensors" in out["reason"]


def test_backup_skips_when_an_index_names_a_missing_shard(tmp_path):
    from safetensors.torch import save_file

    ck = tmp_path / "out" / "checkpoint-10"
    ck.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(ck / "model-00001-of-00002.safetensors"))
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    res, out = backup_cli(tmp_path / "out", tmp_path / "repo")
    assert res.exit_code == 75 and "model-00002-of-00002.safetensors" in out["reason"]


def test_backup_skips_a_file_that_changes_within_the_settle_window(tmp_path):
    src = save_pt(tmp_path / "run" / "last.pt", 1)

    def trainer_still_writing(seconds):
        with open(src, "ab") as fh:
            fh.write(b"more")

    result = backup_mod.backup(src, str(tmp_path / "repo"), backup_mod.BackupOptions(settle=5),
                               sleep=trainer_still_writing)
    assert result.action == "busy" and result.exit_code == 75
    assert "still being written" in result.reason


def test_backup_waits_the_settle_window_before_packing(tmp_path):
    src = save_pt(tmp_path / "run" / "last.pt", 1)
    slept = []
    result = backup_mod.backup(src, str(tmp_path / "repo"), backup_mod.BackupOptions(settle=7.5), sleep=slept.append)
    assert result.action == "packed" and slept == [7.5]


def test_backup_forgets_a_generation_whose_source_changed_while_packing(tmp_path, monkeypatch):
    without_read_leases(monkeypatch)  # the rewrite below runs in pack's thread: a lease would make it wait 45 s
    src = save_pt(tmp_path / "run" / "last.pt", 1)
    repo = tmp_path / "repo"
    real_pack = ckpt_archive.ops.pack.pack

    def pack_while_trainer_writes(*a, before_publish=None, **k):
        def trainer_writes_meanwhile(candidate):
            save_pt(src, 2)  # the trainer rewrote the file while it was being packed
            return before_publish(candidate)

        return real_pack(*a, before_publish=trainer_writes_meanwhile, **k)

    monkeypatch.setattr(ckpt_archive.ops.pack, "pack", pack_while_trainer_writes)
    res, out = backup_cli(src, repo)
    assert res.exit_code == 75 and "changed while being packed" in out["reason"]
    assert usable(repo) == []


def test_backup_json_reports_lock_error_when_another_writer_holds_the_lock(tmp_path):
    src = save_pt(tmp_path / "run" / "last.pt", 1)
    repo = tmp_path / "repo"
    backup_cli(src, repo)
    save_pt(src, 2)
    with Repository.open(repo).lock():
        res, out = backup_cli(src, repo)
    assert res.exit_code == 2 and out["error"] == "LockError"
    assert usable(repo) == [1]


def test_backup_help_documents_exit_codes():
    res = cli("backup", "--help")
    text = " ".join(res.stdout.split())
    assert "75" in text and "EX_TEMPFAIL" in text and "Exit codes" in text


def test_lock_is_exclusive_between_two_openers(repo5):
    with Repository.open(repo5).lock():
        with pytest.raises(LockError, match="locked by another writer"):
            with Repository.open(repo5).lock():
                pass


def test_backup_of_a_checkpoint_folder_is_unchanged_on_the_next_tick(tmp_path):
    from safetensors.torch import save_file

    ck = tmp_path / "out" / "checkpoint-10"
    save_pt(ck / "optimizer.pt", 1)
    save_file({"w": torch.ones(4)}, str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    repo = tmp_path / "repo"
    res, out = backup_cli(tmp_path / "out", repo)
    assert res.exit_code == 0 and out["action"] == "packed", res.stderr
    st = (ck / "trainer_state.json").stat()
    os.utime(ck / "trainer_state.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
    res, out = backup_cli(tmp_path / "out", repo)
    assert out["action"] == "unchanged" and out["read_bytes"] > 0, out  # every file's sha256 matched the manifest
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 11}))
    res, out = backup_cli(tmp_path / "out", repo)
    assert out["action"] == "packed" and out["generation"] == 2


def test_pack_applies_the_repository_default_policy_after_publish(tmp_path):
    repo = make_repo(tmp_path / "r", [0.5, 0.4, 0.3])
    r = Repository.open(repo)
    with r.lock():
        r.set_default_retention({"keep_last": 2})
    res = ckpt_archive.pack(state(4), repo)
    assert res.retention["removed"] == [1, 2]
    assert usable(repo) == [3, 4]


# ---------------------------------------------------------------------------------------------- on S3
# One end-to-end pass on an object store (moto's S3 server on loopback): object stores have no rename
# and no directories, so marker-first deletion, gc's listing and the backup state file's replace are
# worth one real run there; the rules themselves are store-independent and tested locally above.
def test_prune_forget_gc_and_backup_work_on_an_s3_repository(s3_url, tmp_path):
    for i, v in enumerate([0.9, 0.5, 0.8], start=1):
        ckpt_archive.pack(state(i), s3_url, annotations=ckpt_archive.Annotations(metrics={"val_loss": v}))
    res, out = cli_json("prune", s3_url, "--keep-last", 1, "--keep-best", 1, "--best-by", "val_loss:min")
    assert res.exit_code == 0, res.stderr
    assert out["removed"] == [1]
    assert [g.number for g in Repository.open(s3_url).usable()] == [2, 3]
    assert cli("forget", f"{s3_url}@3").exit_code == 2  # newest usable
    repo = Repository.open(s3_url)
    repo.store.remove("generations/00000003/USABLE.json")  # as a crash mid-forget leaves it
    res, out = cli_json("gc", s3_url)
    assert [x["generation"] for x in out["removed"]] == [3]
    assert [g.number for g in Repository.open(s3_url).generations()] == [2]
    src = save_pt(tmp_path / "run" / "last.pt", 7)
    assert backup_cli(src, s3_url)[1]["action"] == "packed"
    assert backup_cli(src, s3_url)[1]["action"] == "unchanged"
    assert ckpt_archive.load(s3_url)["step"] == 700


def test_prune_save_default_stores_the_policy_that_pack_then_applies(repo5):
    res, out = cli_json("prune", repo5, "--keep-last", 2, "--save-default")
    assert res.exit_code == 0 and out["saved_default"] is True
    assert json.loads((repo5 / "repository.json").read_text())["retention"] == {"keep_last": 2}
    assert usable(repo5) == [4, 5]
    ckpt_archive.pack(state(6), repo5)
    assert usable(repo5) == [5, 6]
    assert cli("prune", repo5).exit_code == 0  # no flags: the saved default


def test_prune_save_default_with_dry_run_or_without_flags_changes_nothing(repo5):
    assert cli("prune", repo5, "--save-default").exit_code == 2
    res, out = cli_json("prune", repo5, "--keep-last", 1, "--save-default", "--dry-run")
    assert out["saved_default"] is False
    assert json.loads((repo5 / "repository.json").read_text())["retention"] is None


def test_backup_of_a_checkpoint_removed_while_being_read_is_exit_75(tmp_path, monkeypatch):
    ck = tmp_path / "out" / "checkpoint-10"
    save_pt(ck / "model.pt", 1)
    save_pt(ck / "optimizer.pt", 2)
    real_hash = backup_mod.hash_files

    def rotated_meanwhile(checkpoint, on_bytes=None):
        (ck / "optimizer.pt").unlink()  # the trainer's save_total_limit rotation
        return real_hash(checkpoint, on_bytes)

    monkeypatch.setattr(backup_mod, "hash_files", rotated_meanwhile)
    res, out = backup_cli(tmp_path / "out", tmp_path / "repo")
    assert res.exit_code == 75, res.stderr
    assert out["action"] == "busy" and "Traceback" not in res.stderr


# ------------------------------------------------------------------ backup: a stale broken checkpoint is not "being written"
def age(path: Path, seconds: float) -> Path:
    """Set the mtime of path (and, for a folder, of everything under it) to `seconds` ago."""
    t = time.time() - seconds
    for p in ([*path.rglob("*"), path] if path.is_dir() else [path]):
        os.utime(p, (t, t))
    return path


def truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a torch.save killed mid-write: no zip central directory
    return path


def test_backup_skips_a_stale_truncated_newest_checkpoint_and_backs_up_the_newest_complete_one(tmp_path):
    runs = tmp_path / "runs2"
    age(save_pt(runs / "a.pt", 1), 3700)
    z = age(truncate(save_pt(runs / "z.pt", 2)), 3600)
    repo = tmp_path / "rb2"
    res, out = backup_cli(runs, repo)
    assert res.exit_code == 0, res.stderr
    assert out["action"] == "packed" and out["checkpoint"] == str((runs / "a.pt").absolute())
    assert [x["checkpoint"] for x in out["skipped"]] == [str(z.absolute())]
    assert "zip is not whole" in out["skipped"][0]["reason"] and "broken" in out["skipped"][0]["reason"]
    assert ckpt_archive.load(repo)["step"] == 100
    res, out = backup_cli(runs, repo)  # the next tick is not stuck either
    assert res.exit_code == 0 and out["action"] == "unchanged" and out["skipped"], res.stderr
    res = cli("backup", runs, "--repo", repo, "--settle", 0)  # and says why, in words, without --json
    text = " ".join(res.stderr.split())
    assert res.exit_code == 0 and f"warning: skipped {z.absolute()}" in text and "--stale-after 600 s" in text


def test_backup_says_it_skipped_a_stale_truncated_newest_step_whose_mtime_is_older_than_the_complete_ones(tmp_path):
    """ckpt-300.pt truncated (killed mid-save an hour ago) beside complete ckpt-100/200.pt written later: its
    step cannot be read, so it ranked below them by mtime and backup packed ckpt-200 with skipped: [] and
    no warning, exit 0 -- the newest save lost in silence. It is skipped with a warning, as documented."""
    runs = tmp_path / "run"
    save_pt(runs / "ckpt-100.pt", 1)
    save_pt(runs / "ckpt-200.pt", 2)
    z = age(truncate(save_pt(runs / "ckpt-300.pt", 3)), 3600)
    repo = tmp_path / "B2"
    res, out = backup_cli(runs, repo)
    assert res.exit_code == 0, res.stderr
    assert out["action"] == "packed" and out["checkpoint"] == str((runs / "ckpt-200.pt").absolute())
    assert [x["checkpoint"] for x in out["skipped"]] == [str(z.absolute())]
    assert "zip is not whole" in out["skipped"][0]["reason"] and "broken" in out["skipped"][0]["reason"]
    assert any(w.startswith(f"skipped {z.absolute()}") for w in out["warnings"]), out["warnings"]
    res, out = backup_cli(runs, repo)  # every tick says so, also when nothing is packed
    assert res.exit_code == 0 and out["action"] == "unchanged" and out["skipped"], res.stderr
    res = cli("backup", runs, "--repo", repo, "--settle", 0)  # in words too, without --json
    assert res.exit_code == 0 and f"warning: skipped {z.absolute()}" in " ".join(res.stderr.split()), res.stderr


def test_backup_still_exits_75_for_a_recent_incomplete_checkpoint_even_with_an_older_complete_one(tmp_path):
    runs = tmp_path / "runs"
    age(save_pt(runs / "a.pt", 1), 3700)
    truncate(save_pt(runs / "z.pt", 2))  # just written: the trainer may be between two writes
    res, out = backup_cli(runs, tmp_path / "repo")
    # exit 75 for z.pt; meanwhile the complete a.pt, not yet archived, is (see the HF folder test below)
    assert res.exit_code == 75 and out["busy"]["checkpoint"].endswith("z.pt") and not out["ok"]
    assert out["action"] == "packed" and out["checkpoint"].endswith("a.pt") and out["skipped"] == []
    res, out = backup_cli(runs, tmp_path / "repo")  # a.pt archived already: only busy, nothing packed again
    assert res.exit_code == 75 and out["action"] == "busy" and out["checkpoint"].endswith("z.pt")
    assert out["generation"] is None and usable(tmp_path / "repo") == [1]


def test_backup_with_only_a_stale_broken_checkpoint_exits_2_not_75(tmp_path):
    z = age(truncate(save_pt(tmp_path / "runs" / "z.pt", 2)), 3600)
    for source in (tmp_path / "runs", z):
        res, out = backup_cli(source, tmp_path / "repo")
        assert res.exit_code == 2, res.stderr
        assert out["error"] == "SourceError" and "no complete checkpoint" in out["reason"]
        assert str(z.absolute()) in out["reason"] and "broken" in out["reason"] and "Traceback" not in res.stderr


def test_backup_stale_after_sets_when_an_incomplete_checkpoint_counts_as_broken(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    age(save_pt(runs / "a.pt", 1), 3700)
    age(truncate(save_pt(runs / "z.pt", 2)), 120)
    res, out = backup_cli(runs, tmp_path / "repo")  # default max(600, 10 x settle): 2 min is recent
    assert res.exit_code == 75
    res, out = backup_cli(runs, tmp_path / "repo1", "--stale-after", 60)
    assert res.exit_code == 0 and out["action"] == "packed" and out["checkpoint"].endswith("a.pt"), res.stderr
    assert out["skipped"] and out["busy"] is None
    slept = []  # the 20 s settle window is observed with a fake sleep (the file does not change meanwhile)
    real_settled = backup_mod._settled
    monkeypatch.setattr(backup_mod, "_settled", lambda c, settle, sleep: real_settled(c, settle, slept.append))
    res, out = cli_json("backup", runs, "--repo", tmp_path / "repo2", "--settle", 20)  # default 600 s
    assert res.exit_code == 75 and slept and set(slept) == {20.0}, (res.stderr, slept)
    assert backup_mod.default_stale_after(10) == 600 and backup_mod.default_stale_after(120) == 1200


def test_backup_stale_broken_checkpoint_folder_falls_back_to_the_previous_checkpoint_n(tmp_path):
    out_dir = tmp_path / "out"
    save_pt(out_dir / "checkpoint-10" / "model.pt", 10)
    save_pt(out_dir / "checkpoint-20" / "model.pt", 20)
    (out_dir / "checkpoint-20" / "optimizer.pt.tmp").write_bytes(b"half")  # the save was killed here
    age(out_dir, 7200)
    res, out = backup_cli(out_dir, tmp_path / "repo")
    assert res.exit_code == 0, res.stderr
    assert out["checkpoint"].endswith("checkpoint-10") and out["skipped"][0]["checkpoint"].endswith("checkpoint-20")
    assert "temporary file name" in out["skipped"][0]["reason"]


def hf_checkpoint(out_dir: Path, n: int, *, partial: bool = False) -> Path:
    """A Hugging Face Trainer ``checkpoint-N/``: weights and config first; optimizer, scheduler, RNG and
    trainer_state.json (HF writes it last) only when the save got that far (``partial=False``)."""
    from safetensors.torch import save_file

    d = out_dir / f"checkpoint-{n}"
    d.mkdir(parents=True)
    model = torch.nn.Linear(4, 4)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "x"}))
    if not partial:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        torch.save(opt.state_dict(), d / "optimizer.pt")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
        torch.save(sched.state_dict(), d / "scheduler.pt")
        torch.save({"cpu": torch.get_rng_state()}, d / "rng_state.pth")
        (d / "trainer_state.json").write_text(json.dumps({"global_step": n, "log_history": []}))
    return d


def test_backup_never_packs_an_hf_checkpoint_folder_still_lacking_its_training_state(tmp_path):
    """Issue #6: a checkpoint-20/ holding only config.json and model.safetensors (the Trainer still writing
    optimizer.pt, scheduler.pt, rng_state.pth and trainer_state.json) was packed as usable (exit 0) and the
    complete checkpoint-10 never backed up; verify --strict then listed 3 problems. A folder lacking a
    training-state file its complete sibling has is incomplete: exit 75 while recent, the complete sibling
    backed up meanwhile; broken (skipped with a warning) once stale."""
    out_dir, repo = tmp_path / "out", tmp_path / "repo"
    age(hf_checkpoint(out_dir, 10), 3600)
    partial = hf_checkpoint(out_dir, 20, partial=True)
    res, out = backup_cli(out_dir, repo)
    assert res.exit_code == 75, res.stdout
    assert out["busy"]["checkpoint"] == str(partial.absolute())
    assert "trainer_state.json" in out["busy"]["reason"] and "optimizer.pt" in out["busy"]["reason"]
    assert out["action"] == "packed" and out["checkpoint"].endswith("checkpoint-10") and out["generation"] == 1
    assert ckpt_archive.verify(str(repo)).ok and usable(repo) == [1]
    # the Trainer finishes its save: the next tick packs checkpoint-20, exit 0
    shutil.rmtree(partial)
    hf_checkpoint(out_dir, 20)
    res, out = backup_cli(out_dir, repo)
    assert res.exit_code == 0 and out["action"] == "packed" and out["checkpoint"].endswith("checkpoint-20"), res.stdout
    assert out["busy"] is None and usable(repo) == [1, 2]
    # a save killed after the weights: stale, so broken, skipped with a warning; never packed as usable
    age(hf_checkpoint(out_dir, 30, partial=True), 3600)
    res, out = backup_cli(out_dir, repo)
    assert res.exit_code == 0 and out["action"] == "unchanged" and out["checkpoint"].endswith("checkpoint-20")
    assert out["skipped"][0]["checkpoint"].endswith("checkpoint-30") and "broken" in out["skipped"][0]["reason"]
    assert usable(repo) == [1, 2]


def test_sibling_rule_uses_the_part_names_of_the_completeness_lint(tmp_path):
    """The files backup requires of a checkpoint-N/ are those its complete sibling has for a resume part, named
    as the completeness lint (verify --strict) finds parts: Accelerate and per-rank names included, weights and
    extra files (tokenizer, README) not."""
    ref, new = tmp_path / "checkpoint_1", tmp_path / "checkpoint_2"
    for d in (ref, new):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl", "tokenizer.json",
                 "sampler.bin"):
        (ref / name).write_bytes(b"x")
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "sampler.bin"):
        (new / name).write_bytes(b"x")
    assert backup_mod.resume_part_files(ref) == {"optimizer.bin": "optimizer", "scheduler.bin": "scheduler",
                                                 "random_states_0.pkl": "rng", "random_states_1.pkl": "rng",
                                                 "sampler.bin": "data"}
    assert backup_mod.sibling_problem(new, ref) == ("lacks random_states_1.pkl (rng), which checkpoint_1 has: "
                                                     "still being written?")
    (new / "random_states_1.pkl").write_bytes(b"x")
    assert backup_mod.sibling_problem(new, ref) is None and backup_mod.sibling_problem(new, None) is None


def test_backup_help_documents_stale_after_and_exit_2_for_only_broken_checkpoints():
    res = cli("backup", "--help")
    text = " ".join(res.stdout.replace("│", " ").split())  # rich draws option help inside a box
    assert "--stale-after" in text and "max(600, 10 x --settle)" in text
    assert "holding only broken ones" in text


def test_inspect_shows_numpy_metrics_as_numbers_and_unknown_progress_as_dash(tmp_path):
    import numpy as np
    import torch

    repo = tmp_path / "r"
    ckpt_archive.pack({"w": torch.zeros(1)}, repo, annotations=ckpt_archive.Annotations(metrics={"val_loss": np.float64(0.25), "acc": float("nan")}))
    res = CliRunner().invoke(app, ["inspect", str(repo)])
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert 'metrics: {"val_loss": 0.25, "acc": "nan"}' in text
    assert "npscalar" not in text and "None" not in text.split("environment")[0]
    assert "progress: step -  epoch -  cursor -" in text


def test_gc_prune_and_forget_skip_a_stray_unsafe_key_on_an_object_store_and_go_on(s3_url):
    """Fault: a stray key ``generations/00000002/../x`` in an S3 repository made ``gc`` exit 1 (UnsafePath)
    although gc documents only 0 or 2, and it blocked every cleanup. Such a key is skipped with a warning
    naming it (never read or deleted through), and gc / prune / forget go on."""
    for i in (1, 2, 3):
        ckpt_archive.pack(state(i), s3_url)
    repo = Repository.open(s3_url)
    root = s3_url.split("://", 1)[1]
    stray = f"{root}/generations/00000004/../x"
    repo.store.fs.pipe(stray, b"junk")
    repo.store.fs.pipe(f"{root}/generations/00000001/../y", b"junk")
    repo.store.fs.invalidate_cache()
    repo.store.remove("generations/00000003/USABLE.json")  # a partial generation for gc to remove
    res, out = cli_json("gc", s3_url)
    assert res.exit_code == 0, res.stdout
    assert sorted(x["generation"] for x in out["removed"]) == [3, 4]
    assert any("generations/00000004/.." in k for k in out["skipped_keys"]), out
    res = cli("gc", s3_url)
    assert res.exit_code == 0 and "generations/00000004/.." in res.stderr, res.output
    ckpt_archive.pack(state(5), s3_url)
    res, out = cli_json("forget", f"{s3_url}@1")
    assert res.exit_code == 0 and any("generations/00000001/.." in w for w in out["warnings"]), res.stdout
    res, out = cli_json("prune", s3_url, "--keep-last", 1)
    assert res.exit_code == 0 and out["removed"] == [2], res.stdout
    repo.store.fs.invalidate_cache()
    assert repo.store.fs.exists(stray)  # never deleted
    assert [g.number for g in Repository.open(s3_url).usable()] == [5]


def test_a_path_holding_an_emoji_code_is_printed_as_it_is(tmp_path):
    """Guards against rich's emoji codes rewriting what the tool prints: a repository at ``run:x:1`` (a
    plausible name) was listed and reported as ``run❌1``, a place that does not exist."""
    repo = make_repo(tmp_path / "run:x:1:100:", losses=[0.5])
    for args in (["list", repo], ["status", repo, "--no-record"]):
        res = cli(*args)
        assert res.exit_code == 0, res.output
        assert "run:x:1:100:" in res.output and "❌" not in res.output and "💯" not in res.output, res.output
