"""Nothing is usable until it was verified and trial-reloaded; readers never see partial generations."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive
from ckpt_archive.cli.app import app
from ckpt_archive.errors import IntegrityError, OutputExists
from ckpt_archive.repo.repository import Repository

runner = CliRunner()


def state(v=1.0):
    return {"model": {"w": torch.full((8, 8), v)}, "step": int(v)}


def test_generations_are_numbered_and_marker_holds_manifest_sha_and_trial_record(tmp_path):
    import hashlib

    r = tmp_path / "repo"
    a = ckpt_archive.pack(state(1), r)
    b = ckpt_archive.pack(state(2), r)
    assert (a.generation, b.generation) == (1, 2)
    g = r / "generations" / "00000002"
    marker = json.loads((g / "USABLE.json").read_text())
    assert marker["manifest_sha256"] == hashlib.sha256((g / "manifest.json").read_bytes()).hexdigest()
    assert marker["trial_reload"]["result"] == "ok" and marker["trial_reload"]["where"] == str(r)
    assert marker["trial_reload"]["tensors"] == 1


@pytest.mark.parametrize("point", ["after-members", "after-seal", "after-verify", "after-trial-reload", "publish"])
def test_a_failure_at_any_step_leaves_earlier_generations_and_no_usable_partial(tmp_path, monkeypatch, point):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    monkeypatch.setenv("CKPT_ARCHIVE_INJECT", f"{point}=raise")
    with pytest.raises(RuntimeError, match=point):
        ckpt_archive.pack(state(2), r)
    monkeypatch.delenv("CKPT_ARCHIVE_INJECT")
    gens = ckpt_archive.list_generations(r, all=True)
    assert [(g.number, g.status) for g in gens] == [(1, "usable"), (2, "partial")]
    assert ckpt_archive.verify(r).ok and ckpt_archive.verify(r).generation == 1
    nxt = ckpt_archive.pack(state(3), r)
    assert nxt.generation == 3 and any("generation 2 is partial" in x for x in nxt.leftovers)


def test_disk_full_during_write_is_exit_2_with_the_step_named(tmp_path, monkeypatch):
    from ckpt_archive.errors import StoreError

    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    monkeypatch.setenv("CKPT_ARCHIVE_INJECT", "after-members=enospc")
    with pytest.raises(StoreError, match="disk full") as exc:
        ckpt_archive.pack(state(2), r)
    assert "write members" in str(exc.value) and exc.value.exit_code == 2


def test_a_generation_whose_manifest_changed_after_publish_is_damaged_not_usable(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    m = r / "generations" / "00000001" / "manifest.json"
    m.write_text(m.read_text().replace('"tags": []', '"tags": ["x"]'))
    g = Repository.open(r).generation(1)
    assert g.status == "damaged" and "changed after it was published" in g.reason
    assert ckpt_archive.list_generations(r) == []


def test_a_copied_repository_is_copied_until_deep_verify_marks_it_usable_here(tmp_path):
    src = tmp_path / "repo"
    ckpt_archive.pack(state(1), src)
    dst = tmp_path / "moved"
    shutil.copytree(src, dst)
    assert Repository.open(dst).generation(1).status == "copied"
    assert ckpt_archive.list_generations(dst) == []
    shallow = ckpt_archive.verify(dst, "1")
    assert not shallow.marked_usable
    deep = ckpt_archive.verify(dst, "1", options=ckpt_archive.VerifyOptions(deep=True))
    assert deep.ok and deep.marked_usable
    assert Repository.open(dst).generation(1).status == "usable"


def test_latest_that_no_longer_verifies_names_the_newest_that_does_and_fallback_uses_it(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    ckpt_archive.pack(state(2), r)
    (r / "generations" / "00000002" / "tensors-00000.safetensors.ckz").unlink()
    rep = ckpt_archive.verify(r)
    assert not rep.ok and rep.fallback == 1
    with pytest.raises(IntegrityError, match="newest generation that verifies is 1"):
        ckpt_archive.load(r)
    assert ckpt_archive.load(r, options=ckpt_archive.LoadOptions(fallback=True))["step"] == 1
    res = runner.invoke(app, ["restore", str(r), "-o", str(tmp_path / "x.pt")])
    assert res.exit_code == 1 and "--fallback" in res.stderr and not (tmp_path / "x.pt").exists()
    res = runner.invoke(app, ["restore", str(r), "-o", str(tmp_path / "x.pt"), "--fallback"])
    assert res.exit_code == 0 and torch.load(tmp_path / "x.pt", weights_only=True)["step"] == 1


def test_restore_never_overwrites_without_force_and_leaves_no_temporary(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    out = tmp_path / "o.pt"
    out.write_text("precious")
    with pytest.raises(OutputExists):
        ckpt_archive.restore(r, "latest", out)
    assert out.read_text() == "precious"
    ckpt_archive.restore(r, "latest", out, options=ckpt_archive.RestoreOptions(force=True))
    assert torch.load(out, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_restore_of_a_corrupt_generation_writes_nothing(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    f = r / "generations" / "00000001" / "tensors-00000.safetensors.ckz"
    b = bytearray(f.read_bytes())
    b[-5] ^= 1
    f.write_bytes(bytes(b))
    with pytest.raises(IntegrityError):
        ckpt_archive.restore(r, "1", tmp_path / "o.pt")
    assert list(tmp_path.glob("*o.pt*")) == []


def test_tag_selects_the_newest_usable_generation_so_tagged(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r, annotations=ckpt_archive.Annotations(tags=["best"]))
    ckpt_archive.pack(state(2), r)
    assert ckpt_archive.load(r, "tag:best")["step"] == 1
    res = runner.invoke(app, ["list", str(r), "--json"])
    gens = json.loads(res.stdout)["generations"]
    assert [g["generation"] for g in gens] == [1, 2] and gens[0]["tags"] == ["best"]
    assert set(gens[0]) >= {"generation", "status", "step", "created", "raw_bytes", "stored_bytes", "tags"}


def test_pack_json_is_one_object_on_stdout(tmp_path):
    p = tmp_path / "c.pt"
    torch.save(state(4), p)
    res = runner.invoke(app, ["pack", str(p), "--repo", str(tmp_path / "r"), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["generation"] == 1 and doc["status"] == "usable"


def test_second_writer_gets_lock_error_exit_2(tmp_path):
    from ckpt_archive.errors import LockError

    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    repo = Repository.open(r)
    with repo.lock():
        with pytest.raises(LockError, match="locked by another writer") as exc:
            ckpt_archive.pack(state(2), r)
        assert exc.value.exit_code == 2


def test_restore_refuses_a_generation_missing_a_member_it_does_not_need(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r, annotations=ckpt_archive.Annotations(data_ids=[1, 2, 3]))
    (r / "generations" / "00000001" / "data-ids.json.ckz").unlink()
    with pytest.raises(IntegrityError, match="data-ids.json"):
        ckpt_archive.restore(r, "1", tmp_path / "o.pt")
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("target", ["repo_parent", "repo_itself", "inside_repo", "a_folder", "cwd"])
def test_restore_force_never_destroys_the_repository_a_folder_or_the_current_folder(tmp_path, monkeypatch, target):
    from ckpt_archive.errors import UsageError

    box = tmp_path / "box"
    r = box / "repo"
    ckpt_archive.pack(state(1), r)
    other = tmp_path / "work"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    monkeypatch.chdir(other)
    out = {"repo_parent": box, "repo_itself": r, "inside_repo": r / "repository.json",
           "a_folder": other, "cwd": Path(".")}[target]
    with pytest.raises(UsageError):
        ckpt_archive.restore(r, "latest", out, options=ckpt_archive.RestoreOptions(force=True))
    assert ckpt_archive.verify(r).ok
    assert (other / "keep.txt").read_text() == "keep"


def test_generation_numbers_are_never_reused_after_forget(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    ckpt_archive.pack(state(2), r)
    repo = Repository.open(r)
    with repo.lock():
        repo.remove_generation(2)
    assert ckpt_archive.pack(state(3), r).generation == 3
    with repo.lock():
        repo.remove_generation(1)
        repo.remove_generation(3)
    assert ckpt_archive.pack(state(4), r).generation == 4


def test_a_published_generation_that_lost_its_manifest_is_damaged_not_a_leftover(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    (r / "generations" / "00000001" / "manifest.json").unlink()
    g = Repository.open(r).generation(1)
    assert g.status == "damaged" and "USABLE marker present" in g.reason


# --- the one publish lifecycle (ckpt_archive/repo/publish.py) ---------------------------------------------
def test_marking_a_copied_generation_usable_waits_for_the_repository_lock(tmp_path):
    """verify --deep used to write the marker of a copied generation without the writer lock, racing a
    prune or pack; now the check and the marker run under the lock, and a held lock refuses (exit 2)."""
    from ckpt_archive.errors import LockError

    src = tmp_path / "repo"
    ckpt_archive.pack(state(1), src)
    dst = tmp_path / "moved"
    shutil.copytree(src, dst)
    with Repository.open(dst).lock():
        with pytest.raises(LockError):
            ckpt_archive.verify(dst, "1", options=ckpt_archive.VerifyOptions(deep=True))
    assert Repository.open(dst).generation(1).status == "copied"
    assert ckpt_archive.verify(dst, "1", options=ckpt_archive.VerifyOptions(deep=True)).marked_usable


def test_the_marker_is_never_written_without_the_lock(tmp_path):
    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    repo = Repository.open(r)
    g = repo.generation(1)
    with pytest.raises(RuntimeError, match="lock"):
        repo.write_marker(1, g.manifest_sha256, g.manifest["archive_id"], {})


def test_a_before_publish_hook_that_withdraws_leaves_no_generation_that_was_ever_usable(tmp_path):
    """backup used to publish and then retract; a hook decides before the marker exists instead."""
    from ckpt_archive.repo.publish import Withdrawn

    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    seen = []

    def hook(candidate):
        marker = r / "generations" / f"{candidate.number:08d}" / "USABLE.json"
        seen.append((candidate.number, candidate.repo.locked, marker.exists(), candidate.trial_reload["tensors"]))
        return "the source moved"

    with pytest.raises(Withdrawn, match="the source moved") as exc:
        ckpt_archive.pack(state(2), r, before_publish=hook)
    assert exc.value.number == 2 and exc.value.exit_code == 2
    assert seen == [(2, True, False, 1)]
    assert [(g.number, g.status) for g in ckpt_archive.list_generations(r, all=True)] == [(1, "usable")]
    assert ckpt_archive.pack(state(3), r, before_publish=lambda c: None).generation == 3


def test_metrics_are_stored_as_plain_json_numbers_and_non_finite_as_strings(tmp_path):
    """Retention must never decode format tags: NumPy scalars are numbers in the manifest, NaN/inf the
    strings "nan"/"inf"/"-inf"."""
    import numpy as np

    r = tmp_path / "repo"
    res = ckpt_archive.pack(state(1), r, annotations=ckpt_archive.Annotations(metrics={
        "val_loss": np.float64(0.25), "acc": float("nan"), "up": float("inf"), "n": np.int64(3),
        "ok": np.bool_(True), "nested": {"a": (np.float32(0.5), float("-inf"))}}))
    stored = json.loads((r / "generations" / "00000001" / "manifest.json").read_text())["metrics"]
    assert stored == {"val_loss": 0.25, "acc": "nan", "up": "inf", "n": 3, "ok": True,
                      "nested": {"a": [0.5, "-inf"]}}
    assert res.manifest["metrics"] == stored and "$t" not in json.dumps(stored)
    assert ckpt_archive.list_generations(r)[0].metrics == stored


def test_metrics_json_cannot_hold_are_refused_before_anything_is_written(tmp_path):
    from ckpt_archive.errors import UsageError

    r = tmp_path / "repo"
    for bad in ({"blob": b"\x00"}, {1: 0.5}):
        with pytest.raises(UsageError, match="metric"):
            ckpt_archive.pack(state(1), r, annotations=ckpt_archive.Annotations(metrics=bad))
    assert not (r / "generations").exists() or not any((r / "generations").iterdir())


def test_tagged_metrics_of_older_manifests_read_as_plain_values():
    """Manifests written before metrics were plain hold the state tree's tags; they are read in one place
    (Generation.metrics) into the values a new manifest would hold."""
    from ckpt_archive.repo.repository import Generation

    tagged = {"val_loss": {"$t": "npscalar", "dtype": "<f8", "hex": "000000000000d03f"},
              "acc": {"$t": "float", "v": "nan"}, "big": {"$t": "int", "v": str(2**60)},
              "pair": {"$t": "tuple", "v": [1, {"$t": "float", "v": "-inf"}]},
              "flag": {"$t": "npscalar", "dtype": "|b1", "hex": "01"}, "odd": {"$t": "bytes", "b64": "AA=="}}
    g = Generation(1, "usable", manifest={"metrics": tagged})
    assert g.metrics == {"val_loss": 0.25, "acc": "nan", "big": 2**60, "pair": [1, "-inf"], "flag": True,
                         "odd": {"$t": "bytes", "b64": "AA=="}}


def test_a_fault_plan_is_read_once_when_the_repository_is_opened(tmp_path, monkeypatch):
    """Production modules do not read CKPT_ARCHIVE_INJECT: Repository.open builds the hook object once
    and the lifecycle fires it; a repository opened without the variable has no faults."""
    from ckpt_archive.store.faults import NO_FAULTS, Faults

    r = tmp_path / "repo"
    ckpt_archive.pack(state(1), r)
    assert Repository.open(r).faults is NO_FAULTS
    monkeypatch.setenv("CKPT_ARCHIVE_INJECT", "after-seal=raise@2")
    repo = Repository.open(r)
    monkeypatch.delenv("CKPT_ARCHIVE_INJECT")
    assert repo.faults.plan == {"after-seal": ("raise", 2)}
    ckpt_archive.pack(state(2), repo)  # first visit: no fault
    with pytest.raises(RuntimeError, match="after-seal"):
        ckpt_archive.pack(state(3), repo)  # second visit through the same hook object
    assert Faults.parse("claim=kill,publish").plan == {"claim": ("kill", 1), "publish": ("raise", 1)}


def test_the_public_operations_examples_run_as_written():
    """pack, load, verify, restore, inspect, list_generations and export each carry a runnable Example:
    a docstring that no longer matches the API fails here."""
    import doctest

    import ckpt_archive.ops.export
    import ckpt_archive.ops.inspect
    import ckpt_archive.ops.list
    import ckpt_archive.ops.load
    import ckpt_archive.ops.pack
    import ckpt_archive.ops.restore
    import ckpt_archive.ops.verify

    for mod in (ckpt_archive.ops.pack, ckpt_archive.ops.load, ckpt_archive.ops.verify, ckpt_archive.ops.restore,
                ckpt_archive.ops.inspect, ckpt_archive.ops.list, ckpt_archive.ops.export):
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert res.attempted > 0 and res.failed == 0, mod.__name__
