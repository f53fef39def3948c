"""One status rule (issue 24, items 4, 5 and 8; docs/FORMAT.md, "One status rule"): a generation any of whose
members or objects fails a check is damaged for every reader -- list, restore, load, inspect -- whether or
not they read that member; what a reader finds damaged is recorded, so ``list`` and ``@latest`` say so
afterwards; and ``--fallback`` passes over a generation whatever way one of its files fails (a folder, a
FIFO, a link, truncated, unreadable), never stopping there.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive
from ckpt_archive.cli.app import app
from ckpt_archive.errors import CkptArchiveError, IntegrityError
from ckpt_archive.format.objects import object_key, refs
from ckpt_archive.repo.repository import CHECK_FAILED, Repository

from hostile_archive import edit_manifest, forget_notes, gen_dir, member, read_manifest

runner = CliRunner()


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    text = res.stdout + (res.stderr or "")
    assert "Traceback" not in text and "internal error" not in text, text
    return res


def _status(repo: Path, n: int = 1) -> str:
    return Repository.open(repo).generation(n).status


@pytest.fixture()
def exact_repo(tmp_path):
    """A ``torch.save`` file packed with its exact bytes kept: restore rebuilds it from the skeleton and the
    tensor entries, never reading the state tree."""
    p = tmp_path / "ck.pt"
    torch.save({"model": {"w": torch.randn(16, 16), "b": torch.randn(16)}, "step": 3}, p)
    repo = tmp_path / "repo"
    assert cli("pack", p, "--repo", repo).exit_code == 0
    assert read_manifest(repo)["source"]["files"][0].get("exact")
    return repo


def _flip(path: Path, at: float = 0.5) -> bytes:
    good = path.read_bytes()
    data = bytearray(good)
    data[int(len(data) * at)] ^= 0x20
    path.write_bytes(bytes(data))
    return good


# --- item 4: damaged for every reader, whatever it reads --------------------------------------------------
def test_a_flipped_byte_in_the_tree_fails_restore_of_exact_bytes_and_list_says_damaged_afterwards(exact_repo, tmp_path):
    """Fault (issue 24, item 4): one flipped byte in tree.json.ckz of a file-source generation made verify exit
    1 while list still said usable and restore exited 0 -- the exact-bytes path never reads the tree. Restore
    now checks every stored file it did not decode (as a shallow verify) before handing out its output, records
    the failed check, and list says damaged."""
    tree = gen_dir(exact_repo) / member(read_manifest(exact_repo), "tree")["stored_path"]
    _flip(tree)
    assert cli("verify", f"{exact_repo}@1").exit_code == 1
    forget_notes(exact_repo)
    res = cli("restore", f"{exact_repo}@1", "-o", tmp_path / "out.pt")
    assert res.exit_code == 1 and "tree.json" in res.stderr, res.stderr
    assert not (tmp_path / "out.pt").exists() and not list(tmp_path.glob(".out.pt.tmp-*"))
    rows = json.loads(cli("list", exact_repo, "--all", "--json").stdout)["generations"]
    assert rows[0]["status"] == "damaged" and "tree.json" in rows[0]["reason"], rows
    note = json.loads((gen_dir(exact_repo) / CHECK_FAILED).read_text())
    assert note["by"] == "restore" and note["manifest_sha256"] == hashlib.sha256(
        (gen_dir(exact_repo) / "manifest.json").read_bytes()).hexdigest()


@pytest.mark.parametrize("role", ["tensors", "skeleton"])
def test_stored_bytes_that_decode_the_same_fail_restore_of_exact_bytes_as_they_fail_verify(exact_repo, tmp_path, role):
    """Fault (issue 24 item 4, after issue 29): the exact-bytes restore relied on the rebuilt file's sha256
    alone, so a same-size change of a member it reads that decoding reads past (a zstd frame header's
    unused bit) restored the right bytes with exit 0 while verify exited 1 on the same generation. Restore
    checks every stored chunk's sha256 of what it reads, as verify does: exit 1, nothing written."""
    m = read_manifest(exact_repo)
    stored = gen_dir(exact_repo) / member(m, m["source"]["files"][0]["exact"]["member"] if role == "skeleton"
                                           else role)["stored_path"]
    data = bytearray(stored.read_bytes())
    data[4] ^= 0x10  # the first frame header's unused bit: the chunk still decodes to the same bytes
    stored.write_bytes(bytes(data))
    assert cli("verify", f"{exact_repo}@1").exit_code == 1
    forget_notes(exact_repo)
    res = cli("restore", f"{exact_repo}@1", "-o", tmp_path / "out.pt")
    assert res.exit_code == 1 and not (tmp_path / "out.pt").exists(), res.stderr
    assert _status(exact_repo) == "damaged"


def test_a_resealed_dtype_fails_restore_of_exact_bytes_as_it_fails_verify_deep(exact_repo, tmp_path):
    """Fault (issue 24, item 4): a resealed manifest changing a tensor's dtype made verify --deep exit 1 and
    restore 0 (the exact bytes do not depend on the record). Restore now checks the tensor index as the trial
    reload does (dtype and shape against the entry and the tree) before writing."""
    edit_manifest(exact_repo, lambda m: m["tensors"]["model/w"].update(dtype="int32"))
    assert cli("verify", f"{exact_repo}@1", "--deep").exit_code == 1
    forget_notes(exact_repo)
    res = cli("restore", f"{exact_repo}@1", "-o", tmp_path / "out.pt")
    assert res.exit_code == 1 and "model/w" in res.stderr and not (tmp_path / "out.pt").exists(), res.stderr


def test_load_of_one_part_refuses_a_generation_whose_other_member_is_damaged(exact_repo):
    """load(only="model") decodes the tensors and the tree, never the skeleton of the exact bytes: a flipped
    byte there passed. The rest of the generation is now checked (stored bytes) before load returns."""
    m = read_manifest(exact_repo)
    skeleton = gen_dir(exact_repo) / member(m, m["source"]["files"][0]["exact"]["member"])["stored_path"]
    _flip(skeleton)
    with pytest.raises(IntegrityError, match="exact"):
        ckpt_archive.load(exact_repo, 1, options=ckpt_archive.LoadOptions(only="model"))
    assert _status(exact_repo) == "damaged"


def test_a_recorded_failure_is_refused_unread_and_a_passing_deep_check_clears_it(exact_repo, tmp_path):
    tree = gen_dir(exact_repo) / member(read_manifest(exact_repo), "tree")["stored_path"]
    good = _flip(tree)
    assert cli("restore", f"{exact_repo}@1", "-o", tmp_path / "a.pt").exit_code == 1
    res = cli("restore", f"{exact_repo}@1", "-o", tmp_path / "b.pt")  # refused from the record, exit 1
    assert res.exit_code == 1 and "check by `restore`" in res.stderr and "verify --deep" in res.stderr, res.stderr
    assert cli("verify", f"{exact_repo}@1", "--deep").exit_code == 1  # still damaged: the note stays
    assert _status(exact_repo) == "damaged"
    tree.write_bytes(good)  # repaired: the next deep check passes and removes the note
    assert cli("verify", f"{exact_repo}@1", "--deep").exit_code == 0
    assert _status(exact_repo) == "usable" and not (gen_dir(exact_repo) / CHECK_FAILED).exists()
    assert cli("restore", f"{exact_repo}@1", "-o", tmp_path / "c.pt").exit_code == 0


def test_restore_unverified_reads_a_recorded_generation_and_still_checks_every_byte(exact_repo, tmp_path):
    tree = gen_dir(exact_repo) / member(read_manifest(exact_repo), "tree")["stored_path"]
    good = _flip(tree)
    assert cli("verify", f"{exact_repo}@1").exit_code == 1
    assert cli("restore", f"{exact_repo}@1", "-o", tmp_path / "a.pt", "--restore-unverified").exit_code == 1
    tree.write_bytes(good)
    res = cli("restore", f"{exact_repo}@1", "-o", tmp_path / "b.pt", "--restore-unverified")
    assert res.exit_code == 0 and "UNVERIFIED" in res.stderr, res.stderr


def test_a_failed_check_on_a_read_only_repository_is_reported_and_nothing_is_written(exact_repo, monkeypatch):
    """Readers hold no lock and may run where they cannot write: the record then fails, quietly for the
    repository (nothing written, nothing removed) and loudly for the user (the error says it was not recorded)."""
    from ckpt_archive.store.local import LocalStore

    def read_only(self, key):
        raise OSError(30, "Read-only file system", key)

    monkeypatch.setattr(LocalStore, "write_new", read_only)
    tree = gen_dir(exact_repo) / member(read_manifest(exact_repo), "tree")["stored_path"]
    _flip(tree)
    before = sorted(p.name for p in gen_dir(exact_repo).iterdir())
    with pytest.raises(IntegrityError) as err:
        ckpt_archive.load(exact_repo, 1)
    assert "could not be recorded" in (err.value.hint or ""), err.value.hint
    assert sorted(p.name for p in gen_dir(exact_repo).iterdir()) == before
    report = ckpt_archive.verify(exact_repo, 1)
    assert not report.ok and any("could not be recorded" in w for w in report.warnings), report.warnings


def test_a_reader_never_replaces_a_note_another_wrote_meanwhile(exact_repo):
    r = Repository.open(exact_repo)
    gen = r.generation(1)  # read before the other reader's note appeared
    theirs = b'{"problems": [{"member": "x", "field": null, "reason": "theirs"}]}\n'
    (gen_dir(exact_repo) / CHECK_FAILED).write_bytes(theirs)
    assert r.note_check_failed(gen, [{"member": "y", "field": None, "reason": "mine"}], by="restore") is None
    assert (gen_dir(exact_repo) / CHECK_FAILED).read_bytes() == theirs


def test_a_recorded_failure_of_latest_is_refused_naming_the_newest_that_verifies_and_fallback_uses_it(tmp_path):
    """A failed check recorded on the newest generation does not move ``@latest`` back silently: restore and
    load of ``latest`` refuse it (exit 1) naming the newest that verifies, and --fallback uses that one --
    as when nothing was recorded. list shows it damaged meanwhile."""
    repo = tmp_path / "repo"
    for step in (1, 2):
        ckpt_archive.pack({"w": torch.full((8,), float(step)), "step": step}, repo)
    _flip(gen_dir(repo, 2) / member(read_manifest(repo, 2), "tensors")["stored_path"])
    assert not ckpt_archive.verify(repo, 2).ok  # recorded
    assert _status(repo, 2) == "damaged"
    with pytest.raises(IntegrityError, match="newest generation that verifies is 1: use --fallback"):
        ckpt_archive.restore(repo, "latest", tmp_path / "o.pt")
    assert not (tmp_path / "o.pt").exists()
    res = ckpt_archive.restore(repo, "latest", tmp_path / "o.pt", options=ckpt_archive.RestoreOptions(fallback=True))
    assert res.generation == 1 and any("generation 2 (latest) does not verify" in w for w in res.warnings)
    with pytest.raises(IntegrityError, match="use --fallback"):
        ckpt_archive.load(repo)
    assert cli("verify", repo).exit_code == 1  # verify @latest checks the damaged newest, not the older one


# --- item 5: fallback passes over a generation whatever way its files fail --------------------------------
def _three_generations(repo: Path) -> str:
    """Generations 1-3; 2 and 3 share an object generation 1 does not reference. Returns that object's key."""
    g = torch.Generator().manual_seed(0)
    base = {"model": {"base": torch.randn(300_000, generator=g)}, "step": 1}
    ckpt_archive.pack(base, repo)
    later = {"model": {"base": base["model"]["base"], "emb": torch.randn(300_000, generator=g)}, "step": 2}
    ckpt_archive.pack(later, repo)
    ckpt_archive.pack({**later, "step": 3}, repo)
    r = Repository.open(repo)
    new = sorted(set(refs(r.generation(3).manifest)) - set(refs(r.generation(1).manifest)))
    assert new, "generations 2 and 3 share an object generation 1 does not have"
    return object_key(new[0])


@pytest.mark.parametrize("harm", ["folder", "fifo", "truncated", "symlink"])
def test_fallback_passes_over_an_object_that_is_a_folder_or_a_fifo_to_the_older_sound_generation(tmp_path, harm):
    """Fault (issue 24, item 5): a shared object replaced by a folder or a FIFO stopped `restore --fallback`
    (exit 1) and `load(fallback=True)` (UnsafePath), though generation 1 was sound; a truncated or symlinked
    one did fall back. Every way one of a generation's files fails is now that generation's damage."""
    repo = tmp_path / "repo"
    key = _three_generations(repo)
    path = repo / key
    if harm == "folder":
        path.unlink()
        path.mkdir()
    elif harm == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif harm == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    else:
        target = tmp_path / "elsewhere.ckz"
        shutil.move(path, target)
        os.symlink(target, path)
    with pytest.raises(CkptArchiveError) as err:
        ckpt_archive.restore(repo, "latest", tmp_path / "x.pt")
    assert err.value.exit_code == 1 and key in str(err.value) + str(err.value.where), err.value
    forget_notes(repo)
    res = ckpt_archive.restore(repo, "latest", tmp_path / "y.pt", options=ckpt_archive.RestoreOptions(fallback=True))
    assert res.generation == 1 and torch.load(tmp_path / "y.pt", weights_only=True)["step"] == 1
    forget_notes(repo)
    with pytest.warns(UserWarning, match="generation 1, the newest that verifies"):
        assert ckpt_archive.load(repo, options=ckpt_archive.LoadOptions(fallback=True))["step"] == 1
    forget_notes(repo)
    res = cli("restore", f"{repo}@latest", "-o", tmp_path / "z.pt", "--fallback")
    assert res.exit_code == 0 and "generation 1" in res.stderr, res.stderr
    report = ckpt_archive.verify(repo, 3)
    assert not report.ok and any(key in (p.member or "") and "2, 3" in p.reason for p in report.problems), \
        report.problems


# --- item 8: verify --deep checks what restore will check ------------------------------------------------
def test_a_resealed_source_sha256_fails_verify_deep_as_it_fails_restore(exact_repo, tmp_path):
    """Fault (issue 24, item 8): a resealed ``source.files[].sha256`` passed verify --deep while restore exited
    1 (it checks the rebuilt file's sha256). verify --deep now rebuilds that sha256 from the skeleton and the
    segments, in file order, streamed."""
    edit_manifest(exact_repo, lambda m: m["source"]["files"][0].update(sha256="0" * 64))
    res = cli("verify", f"{exact_repo}@1", "--deep")
    assert res.exit_code == 1 and "sha256" in res.stdout + res.stderr and "source.files" in res.stdout + res.stderr
    forget_notes(exact_repo)
    assert cli("restore", f"{exact_repo}@1", "-o", tmp_path / "o.pt").exit_code == 1


def test_the_rebuilt_sha256_matches_for_every_source_layout_the_writer_makes(tmp_path):
    """The check of item 8 on sound archives: a .pt with views and shared storages, a folder of several .pt
    files (entries in another order than the segments), all pass verify --deep."""
    src = tmp_path / "src"
    src.mkdir()
    x = torch.randn(64, 64)
    torch.save({"a": x, "v": x[3:9], "z": torch.zeros(5), "w": torch.randn(300_000)}, src / "one.pt")
    torch.save({"w2": torch.randn(10), "a2": x.t()}, src / "two.pt")
    repo = tmp_path / "repo"
    ckpt_archive.pack(str(src), repo)
    assert any(f.get("exact") for f in read_manifest(repo)["source"]["files"])
    report = ckpt_archive.verify(repo, 1, options=ckpt_archive.VerifyOptions(deep=True))
    assert report.ok, report.problems


# --- inspect: never exit 0 when what it reports cannot be read ----------------------------------------------
def test_inspect_exits_1_when_the_state_tree_is_damaged_and_2_when_it_cannot_be_read_here(exact_repo, monkeypatch):
    """Fault (issue 24, items 3 and 8): inspect exited 0 with a warning ("policy audit skipped") when the state
    tree it reports on could not be read."""
    tree = gen_dir(exact_repo) / member(read_manifest(exact_repo), "tree")["stored_path"]
    good = _flip(tree)
    res = cli("inspect", f"{exact_repo}@1", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and doc["ok"] is False and doc["problems"][0]["member"] == "tree.json", res.stdout
    tree.write_bytes(good)
    forget_notes(exact_repo)
    from ckpt_archive.store.local import LocalStore

    real = LocalStore.open_read

    def deny(self, key):
        if key.endswith(tree.name):
            raise PermissionError(13, "Permission denied", key)
        return real(self, key)

    monkeypatch.setattr(LocalStore, "open_read", deny)
    res = cli("inspect", f"{exact_repo}@1")
    assert res.exit_code == 2 and "Permission denied" in res.stderr, res.stderr
    assert _status(exact_repo) == "usable"  # this machine's permissions are no damage: nothing recorded
