"""Planted symbolic links, one kind per name the tool creates or opens (issue 24 item 2).

Whoever can write in a repository, or in the folder of a restore/export target, can plant a symbolic link
where the tool will write: a temporary file of an atomic replace (``.repository.json.tmp-PID``,
``.USABLE.json.tmp-PID`` were predictable: a link planted for every pid made pack and adopt overwrite a
file outside with exit 0), the lock and its owner file (every command that took the lock overwrote the
target of a ``.lock.owner`` link), markers, CLAIM, manifest, members, objects, generation folders,
``repository.json``, restore's staging names. Each case plants one link pointing outside, runs one
command in-process, and checks that

* the file outside is unchanged (content and mtime), and so is a folder outside (its listing), and
* the command either completed without following the link, or refused it with a clear message and the
  documented exit code (``UnsafePath`` 1 inside a generation, ``LinkInRepository`` 2 for the skeleton).

The temporary names are random now (``.NAME.tmp-PID-<hex>``), so a link at the old predictable name
(this process's pid: in-process, exactly the name the old code used) must simply be ignored.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpt_archive.cli.app import app
from ckpt_archive.repo.repository import Repository

runner = CliRunner()
PRECIOUS = b"precious bytes outside the repository\n"
MTIME = 1_000_000_000  # a fixed past mtime: any write would move it


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    text = res.stdout + (res.stderr or "")
    assert "Traceback" not in text and "internal error" not in text, text
    return res


class Place:
    """A repository with two usable generations, a copy of it (``copied`` generations), and the things
    outside that a planted link points at."""

    def __init__(self, tmp: Path, big: bool = False):
        self.tmp = tmp
        self.outside = tmp / "outside.txt"
        self.outside.write_bytes(PRECIOUS)
        os.utime(self.outside, (MTIME, MTIME))
        self.outside_dir = tmp / "outside-dir"
        self.outside_dir.mkdir()
        (self.outside_dir / "keep.txt").write_bytes(PRECIOUS)
        self.ckpt = tmp / "ck.pt"
        # a tensor of 1 MiB becomes a shared object (objects/<hh>/...); the small one stays in the member
        torch.save({"w": torch.arange(262144, dtype=torch.float32) if big else torch.ones(4), "step": 1}, self.ckpt)
        self.repo = tmp / "repo"
        for _ in range(2):
            assert cli("pack", self.ckpt, "--repo", self.repo).exit_code == 0

    def copy(self) -> Path:
        """The repository copied elsewhere (``cp -a``): its generations are ``copied`` there."""
        dst = self.tmp / "copy"
        shutil.copytree(self.repo, dst, symlinks=True)
        return dst

    def link(self, at: Path, to: Path | None = None) -> Path:
        """Plant a link at ``at`` (replacing the file there) pointing at the file (or ``to``) outside."""
        at.parent.mkdir(parents=True, exist_ok=True)
        if at.is_file() and not at.is_symlink():
            at.unlink()
        at.symlink_to(to or self.outside)
        return at

    def assert_outside_unchanged(self) -> None:
        assert self.outside.read_bytes() == PRECIOUS
        assert os.stat(self.outside).st_mtime == MTIME
        assert sorted(p.name for p in self.outside_dir.iterdir()) == ["keep.txt"]
        assert (self.outside_dir / "keep.txt").read_bytes() == PRECIOUS


def gen(repo: Path, n: int) -> Path:
    return repo / "generations" / f"{n:08d}"


def after_claim(monkeypatch, plant):
    """Plant right after the next claim (a link that appears in the folder of the generation being written)."""
    real = Repository.claim_next

    def claim_next(self):
        n = real(self)
        plant(Path(self.store.local_path(gen_key_of(n))))
        return n

    monkeypatch.setattr(Repository, "claim_next", claim_next)


def gen_key_of(n: int) -> str:
    return f"generations/{n:08d}"


PID = os.getpid()

# --- the repository skeleton: the lock, its owner, repository.json and its old temporary name ---------
LOCKING = {  # command -> (argv builder, exit code when it completes)
    "pack": (lambda p, r: ["pack", p.ckpt, "--repo", r], 0),
    "gc": (lambda p, r: ["gc", r], 0),
    "prune": (lambda p, r: ["prune", r, "--keep-last", 1], 0),
    "forget": (lambda p, r: ["forget", f"{r}@1"], 0),
    "export": (lambda p, r: ["export", p.repo, "--to", r], 0),
}


def _target_repo(p: Place, command: str) -> Path:
    """The repository the command writes: the source, or (export) a destination that already exists."""
    if command != "export":
        return p.repo
    dest = p.tmp / "dest"
    assert cli("export", f"{p.repo}@1", "--to", dest).exit_code == 0
    return dest


@pytest.mark.parametrize("command", sorted(LOCKING))
def test_a_lock_that_is_a_link_is_refused_and_nothing_outside_is_truncated(tmp_path, command):
    """Fault: the lock file was opened following links (filelock 3.x: with O_TRUNC), truncating what it
    pointed to. Now it is opened O_NOFOLLOW relative to the root: LinkInRepository, exit 2."""
    p = Place(tmp_path)
    repo = _target_repo(p, command)
    p.link(repo / ".lock")
    argv, _ = LOCKING[command]
    res = cli(*argv(p, repo))
    assert res.exit_code == 2 and ".lock is a symbolic link" in res.stderr, res.stderr
    p.assert_outside_unchanged()


@pytest.mark.parametrize("command", sorted(LOCKING))
def test_a_lock_owner_file_that_is_a_link_is_replaced_never_written_through(tmp_path, command):
    """Fault: every command that took the lock wrote ``.lock.owner`` through a link planted there. Now the
    owner file is written under a fresh O_EXCL name and renamed over the link (the link itself goes)."""
    p = Place(tmp_path)
    repo = _target_repo(p, command)
    p.link(repo / ".lock.owner")
    argv, code = LOCKING[command]
    res = cli(*argv(p, repo))
    assert res.exit_code == code, res.stderr
    p.assert_outside_unchanged()
    assert not os.path.lexists(repo / ".lock.owner")  # replaced by the real owner file, then removed


def test_a_lock_owner_link_in_the_users_lock_cache_of_a_remote_repository_is_never_followed(tmp_path, monkeypatch):
    """A remote repository's lock lives in the user's cache: the same safe open there."""
    from ckpt_archive.store.fsspec_store import FsspecStore

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    p = Place(tmp_path)
    url = "memory://planted-links/repo"
    lock = Path(FsspecStore(url).lock_file())
    p.link(Path(str(lock) + ".owner"))
    assert cli("export", p.repo, "--to", url).exit_code == 0
    p.assert_outside_unchanged()
    lock.unlink()
    p.link(lock)
    res = cli("export", p.repo, "--to", url)
    assert res.exit_code == 2 and "symbolic link" in res.stderr, res.stderr
    p.assert_outside_unchanged()


@pytest.mark.parametrize("command", ["pack", "export"])
def test_a_link_at_the_old_temporary_name_of_repository_json_is_ignored(tmp_path, command):
    """Fault: ``.repository.json.tmp-PID`` was opened following links on every claim (pack) and at a
    destination's creation (export): a file outside was overwritten with exit 0."""
    p = Place(tmp_path)
    repo = p.repo if command == "pack" else tmp_path / "dest"
    repo.mkdir(exist_ok=True)
    p.link(repo / f".repository.json.tmp-{PID}")
    argv = ["pack", p.ckpt, "--repo", repo] if command == "pack" else ["export", p.repo, "--to", repo]
    assert cli(*argv).exit_code == 0
    p.assert_outside_unchanged()
    assert os.path.islink(repo / f".repository.json.tmp-{PID}")  # not ours: left alone (gc removes it)
    res = cli("gc", repo, "--json")
    assert res.exit_code == 0 and not os.path.lexists(repo / f".repository.json.tmp-{PID}")
    p.assert_outside_unchanged()


@pytest.mark.parametrize("command", ["pack", "gc", "list", "restore", "verify"])
def test_repository_json_that_is_a_link_is_refused_by_every_command(tmp_path, command):
    p = Place(tmp_path)
    (p.repo / "repository.json").unlink()
    shutil.copy(p.tmp / "repo" / "generations" / "00000001" / "manifest.json", p.tmp / "x")  # any file
    p.link(p.repo / "repository.json")
    argv = {"pack": ["pack", p.ckpt, "--repo", p.repo], "gc": ["gc", p.repo], "list": ["list", p.repo],
            "restore": ["restore", p.repo, "-o", tmp_path / "out.pt"], "verify": ["verify", p.repo]}[command]
    res = cli(*argv)
    assert res.exit_code == 2 and "repository.json is a symbolic link" in res.stderr, res.stderr
    p.assert_outside_unchanged()


# --- inside the generation being written (planted right after its claim) ------------------------------
@pytest.mark.parametrize("name, code", [
    (f".USABLE.json.tmp-{PID}", 0),   # the marker's old temporary name: ignored
    ("USABLE.json", 0),               # the marker itself: replaced by rename (the link goes, never followed)
    ("manifest.json", 1),             # write-once: refused, the generation stays partial
    ("tree.json.ckz", 1),             # a member: refused
])
def test_a_link_planted_in_the_generation_being_packed_is_never_written_through(tmp_path, monkeypatch, name, code):
    p = Place(tmp_path)
    after_claim(monkeypatch, lambda folder: p.link(folder / name))
    res = cli("pack", p.ckpt, "--repo", p.repo)
    assert res.exit_code == code, res.stderr
    if code:
        assert "symbolic link" in res.stderr, res.stderr
    p.assert_outside_unchanged()
    assert cli("gc", p.repo).exit_code == 0  # and the cleanup removes the link itself, never its target
    p.assert_outside_unchanged()


@pytest.mark.parametrize("name", ["CLAIM", "manifest.json", "USABLE.json"])
def test_a_generation_folder_planted_ahead_with_a_link_is_skipped_and_cleaned_without_following(tmp_path, name):
    """A folder for the next number holding a link (CLAIM, manifest, marker): pack takes the next number;
    list, gc, prune and forget never follow the link."""
    p = Place(tmp_path)
    p.link(gen(p.repo, 3) / name)
    assert cli("pack", p.ckpt, "--repo", p.repo).exit_code == 0
    assert (gen(p.repo, 4) / "USABLE.json").is_file()
    assert cli("list", p.repo).exit_code == 0
    assert cli("prune", p.repo, "--keep-last", 1).exit_code == 0
    assert cli("gc", p.repo).exit_code == 0
    res = cli("forget", f"{p.repo}@3")
    # removed (its link unlinked), gone already (gc removed a partial one), or refused naming the link
    assert res.exit_code == 0 or "no generation 3" in res.stderr or "symbolic link" in res.stderr, res.stderr
    p.assert_outside_unchanged()


def test_a_generation_folder_that_is_a_link_is_never_listed_written_or_deleted_through(tmp_path):
    p = Place(tmp_path)
    p.link(gen(p.repo, 3), p.outside_dir)
    assert cli("pack", p.ckpt, "--repo", p.repo).exit_code == 0  # takes number 4
    assert cli("gc", p.repo).exit_code == 0
    assert cli("prune", p.repo, "--keep-last", 1).exit_code == 0
    res = cli("forget", f"{p.repo}@3")
    assert res.exit_code == 2 and "not removed" in res.stderr and "symbolic link" in res.stderr, res.stderr
    res = cli("restore", f"{p.repo}@3", "-o", tmp_path / "out.pt")
    assert res.exit_code in (1, 2) and "symbolic link" in res.stderr, res.stderr
    p.assert_outside_unchanged()


# --- adopt and verify --deep of copied generations: the marker and the failed-check note ---------------
@pytest.mark.parametrize("command", ["adopt", "verify --deep"])
@pytest.mark.parametrize("name", [f".USABLE.json.tmp-{PID}", f".CHECK-FAILED.json.tmp-{PID}", ".lock.owner"])
def test_adopt_never_writes_a_marker_or_note_through_a_planted_link(tmp_path, command, name):
    """Fault: adopt wrote ``.USABLE.json.tmp-PID`` through a link (exit 0, a file outside overwritten)."""
    p = Place(tmp_path)
    copy = p.copy()
    p.link((copy if name == ".lock.owner" else gen(copy, 2)) / name)
    argv = ["adopt", copy] if command == "adopt" else ["verify", f"{copy}@2", "--deep"]
    res = cli(*argv)
    assert res.exit_code == 0, res.stderr
    p.assert_outside_unchanged()
    assert Repository.open(copy).generation(2).status == "usable"


@pytest.mark.parametrize("command", ["adopt", "verify --deep"])
def test_a_copied_generation_whose_failed_check_note_is_a_link_is_refused_without_following_it(tmp_path, command):
    """A link where the failed-check note goes makes the generation damaged here (never read through)."""
    p = Place(tmp_path)
    copy = p.copy()
    p.link(gen(copy, 2) / "CHECK-FAILED.json")
    argv = ["adopt", copy] if command == "adopt" else ["verify", f"{copy}@2", "--deep"]
    res = cli(*argv)
    if command == "adopt":  # adopt goes on with the others and names the damaged one
        assert res.exit_code == 0 and "generation 2 is damaged: not adopted" in res.stderr, res.stderr
    else:
        assert res.exit_code == 1 and "CHECK-FAILED.json is a symbolic link" in res.stderr, res.stderr
    assert os.path.islink(gen(copy, 2) / "CHECK-FAILED.json")
    p.assert_outside_unchanged()


def test_a_failed_adopt_writes_its_note_under_a_fresh_name_never_through_a_planted_one(tmp_path):
    """A copy whose deep check fails: the note (``CHECK-FAILED.json``) is written atomically too, never
    through a link at its old temporary name."""
    from hostile_archive import member, read_manifest

    p = Place(tmp_path)
    copy = p.copy()
    rec = member(read_manifest(copy, 2), "tree")
    stored = gen(copy, 2) / rec["stored_path"]
    data = bytearray(stored.read_bytes())
    data[-1] ^= 1  # a flipped byte in the last chunk: a problem the deep check finds
    os.chmod(stored, 0o644)
    stored.write_bytes(bytes(data))
    p.link(gen(copy, 2) / f".CHECK-FAILED.json.tmp-{PID}")
    res = cli("adopt", copy)
    assert res.exit_code == 1, res.stderr
    note = gen(copy, 2) / "CHECK-FAILED.json"
    assert note.is_file() and not note.is_symlink()
    p.assert_outside_unchanged()


# --- shared objects --------------------------------------------------------------------------------
def _object_key(tmp_path: Path, p: Place) -> str:
    scratch = tmp_path / "scratch"
    assert cli("pack", p.ckpt, "--repo", scratch).exit_code == 0
    (obj,) = [q for q in (scratch / "objects").rglob("*.ckz")]
    return obj.relative_to(scratch).as_posix()


def test_a_link_at_the_name_of_an_object_being_created_is_replaced_never_followed(tmp_path):
    p = Place(tmp_path, big=True)
    key = _object_key(tmp_path, p)
    shutil.rmtree(p.repo)
    p.repo.mkdir()
    p.link(p.repo / key)
    assert cli("pack", p.ckpt, "--repo", p.repo).exit_code == 0
    assert (p.repo / key).is_file() and not (p.repo / key).is_symlink()
    assert cli("verify", p.repo, "--deep").exit_code == 0
    p.assert_outside_unchanged()


@pytest.mark.parametrize("where, code", [("objects", 2), ("objects/hh", 1)])
def test_an_objects_folder_that_is_a_link_is_never_written_listed_or_swept_through(tmp_path, where, code):
    p = Place(tmp_path, big=True)
    key = _object_key(tmp_path, p)
    shutil.rmtree(p.repo / "objects")
    folder = p.repo / ("objects" if where == "objects" else key.rsplit("/", 1)[0])
    p.link(folder, p.outside_dir)
    res = cli("pack", p.ckpt, "--repo", p.repo)
    assert res.exit_code == code and "symbolic link" in res.stderr, res.stderr
    for argv in (["gc", p.repo], ["prune", p.repo, "--keep-last", 1], ["forget", f"{p.repo}@1", "--force"]):
        cli(*argv)  # whatever each says about the damage, none reaches through the link
    p.assert_outside_unchanged()


# --- restore, export and status targets ---------------------------------------------------------------
@pytest.mark.parametrize("name", [f".out.pt.tmp-{PID}", f".out.pt.old-{PID}", ".out.pt.tmp-999999999"])
def test_restore_never_writes_through_a_link_at_a_staging_name(tmp_path, name):
    """Fault: restore wrote ``.NAME.tmp-PID`` (and moved the old output to ``.NAME.old-PID``) by path,
    following a link planted there. Its staging folder is now ``O_EXCL``-created under a random name."""
    p = Place(tmp_path)
    out = tmp_path / "out.pt"
    assert cli("restore", p.repo, "-o", out).exit_code == 0
    p.link(tmp_path / name)
    assert cli("restore", p.repo, "-o", out, "--force").exit_code == 0
    assert torch.load(out, weights_only=True)["step"] == 1
    p.assert_outside_unchanged()


def test_restore_force_over_an_output_that_is_a_link_replaces_the_link_not_its_target(tmp_path):
    p = Place(tmp_path)
    out = p.link(tmp_path / "out.pt")
    res = cli("restore", p.repo, "-o", out)
    assert res.exit_code == 2 and "--force" in res.stderr
    assert cli("restore", p.repo, "-o", out, "--force").exit_code == 0
    assert not out.is_symlink() and torch.load(out, weights_only=True)["step"] == 1
    p.assert_outside_unchanged()


def test_a_folder_restore_never_writes_through_a_link_at_its_staging_name(tmp_path):
    from hostile_archive import folder_source

    p = Place(tmp_path)
    src = folder_source(tmp_path)
    repo = tmp_path / "frepo"
    assert cli("pack", src, "--repo", repo).exit_code == 0
    p.link(tmp_path / f".out.tmp-{PID}", p.outside_dir)
    assert cli("restore", repo, "-o", tmp_path / "out").exit_code == 0
    assert sorted(q.name for q in (tmp_path / "out").iterdir()) == sorted(q.name for q in src.iterdir())
    p.assert_outside_unchanged()


def test_export_report_and_status_state_never_write_through_a_link_at_their_old_temporary_names(tmp_path):
    p = Place(tmp_path)
    p.link(tmp_path / f".report.md.tmp-{PID}")
    res = cli("export", p.repo, "--to", tmp_path / "dest", "--report", tmp_path / "report.md")
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "report.md").is_file()
    p.link(tmp_path / f".state.json.tmp-{PID}")
    res = cli("status", p.repo, "--state", tmp_path / "state.json")
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "state.json").is_file()
    p.assert_outside_unchanged()


def test_verify_deep_and_restore_of_a_repository_holding_planted_links_read_and_write_nothing_outside(tmp_path):
    """The readers (verify --deep of a usable generation, restore) take no lock and write nothing in the
    repository: links at the lock, the owner and every old temporary name change nothing for them."""
    p = Place(tmp_path)
    for at in (p.repo / ".lock", p.repo / ".lock.owner", p.repo / f".repository.json.tmp-{PID}",
               gen(p.repo, 2) / f".USABLE.json.tmp-{PID}"):
        p.link(at)
    assert cli("verify", p.repo, "--deep").exit_code == 0
    assert cli("restore", p.repo, "-o", tmp_path / "out.pt").exit_code == 0
    p.assert_outside_unchanged()


# --- trainer integrations: the staging folder, a snapshot name, the Lightning pointer, restore_checkpoint -----
# Their files live in the trainer's output folder, where others may write too (issue 27 met issue 24): each case
# plants a link where an integration creates, writes or deletes, and checks that nothing outside changed.

def _tree(root: Path) -> dict:
    """Everything below ``root`` (links not followed): relpath -> bytes and mtime, "folder", or "-> target"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = f"-> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "folder"
            else:
                out[rel] = (p.read_bytes(), os.stat(p).st_mtime_ns)
    return out


def _victim(tmp: Path, host: str) -> tuple[Path, dict]:
    """A folder outside the trainer's folder holding a precious file and a folder named like a stale snapshot of a
    dead process on this host (what a cleanup through a planted link would delete)."""
    victim = tmp / "victim"
    stale = victim / f"{host}-{_dead_pid()}-{'a' * 32}"
    stale.mkdir(parents=True)
    (stale / "optimizer.bin").write_bytes(PRECIOUS)
    (victim / "keep.txt").write_bytes(PRECIOUS)
    return victim, _tree(victim)


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _trainer_folder(folder: Path, step: int = 1) -> Path:
    """A small Trainer-style checkpoint-N/ folder (weights and trainer_state.json)."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"w": torch.arange(8.0)}, str(folder / "model.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 1.0}))
    return folder


def test_a_staging_folder_that_is_a_link_is_refused_and_nothing_is_linked_written_or_deleted_through_it(tmp_path):
    """Fault: FolderPublisher reached ``_ckpt-archive-staging`` by path. A link planted there made publish() list the
    folder it pointed to and delete what looked like a dead publisher's snapshot in it, then hard-link the trainer's
    files into it. Now the staging folder is opened O_NOFOLLOW in the output folder: the publish is refused, naming
    the link, and the folder it points to is untouched (and so is the link)."""
    from ckpt_archive.errors import UnsafePath
    from ckpt_archive.integrations.folder import STAGING_NAME, FolderPublisher, _host, remove_stale_snapshots

    victim, before = _victim(tmp_path, _host())
    folder = _trainer_folder(tmp_path / "out" / "checkpoint-1")
    (tmp_path / "out" / STAGING_NAME).symlink_to(victim)
    with FolderPublisher(tmp_path / "repo") as pub:
        with pytest.raises(UnsafePath, match=f"{STAGING_NAME} is a symbolic link"):
            pub.publish(folder, step=1)
    with pytest.raises(UnsafePath, match=f"{STAGING_NAME} is a symbolic link"):
        remove_stale_snapshots(tmp_path / "out" / STAGING_NAME)
    assert _tree(victim) == before
    assert os.readlink(tmp_path / "out" / STAGING_NAME) == str(victim)
    assert Repository.open(tmp_path / "repo").generations() == []


def test_a_link_at_a_snapshot_name_is_never_written_through_and_a_stale_one_is_removed_as_a_link(tmp_path, monkeypatch):
    """Fault: the snapshot folder ``<staging>/<host>-<pid>-<random>/`` was made with ``mkdir(parents=True)`` by path: a
    link at that name (guessed, or left) made the snapshot's folder and hard links appear in the folder it pointed
    to, and they stayed there (the cleanup's rmtree refused the link). Now the name is created exclusively in the
    staging folder's descriptor: a name taken by a link is skipped for a fresh one. A link at the name of a dead
    process's snapshot is removed as a link; what it points to stays."""
    import ckpt_archive.integrations.folder as folder_mod
    from ckpt_archive.integrations.folder import STAGING_NAME, FolderPublisher, _host

    victim, before = _victim(tmp_path, _host())
    staging = tmp_path / "out" / STAGING_NAME
    staging.mkdir(parents=True)
    planted = staging / f"{_host()}-{os.getpid()}-{'d' * 32}"  # this process's own name: never cleaned as stale
    planted.symlink_to(victim)
    stale_link = staging / f"{_host()}-{_dead_pid()}-{'e' * 32}"
    stale_link.symlink_to(victim)
    names = iter([planted.name])
    real = folder_mod._snapshot_name
    monkeypatch.setattr(folder_mod, "_snapshot_name", lambda: next(names, None) or real())
    folder = _trainer_folder(tmp_path / "out" / "checkpoint-2", step=2)
    with FolderPublisher(tmp_path / "repo") as pub:
        handle = pub.publish(folder, block=True)
    assert handle.snapshot.parent != planted and handle.result().status == "usable"
    assert _tree(victim) == before
    assert os.readlink(planted) == str(victim) and not os.path.lexists(stale_link)
    assert sorted(p.name for p in staging.iterdir()) == [planted.name]  # the snapshot itself is gone


def test_a_link_at_a_lightning_pointer_is_replaced_on_save_and_never_deleted_or_followed_on_removal(tmp_path):
    """The pointer files ArchiveCheckpointIO writes at the paths Lightning chooses: a link planted at a pointer's
    name is replaced by the pointer (its target untouched); a link there at removal is not a pointer of ours and
    stays, as does the pointer file elsewhere it points to."""
    pytest.importorskip("lightning")
    from ckpt_archive.integrations.lightning import ArchiveCheckpointIO

    p = Place(tmp_path)
    ckpts = tmp_path / "ckpts"
    io = ArchiveCheckpointIO(tmp_path / "lrepo")
    p.link(ckpts / "a.ckpt")
    p.link(ckpts / "b.ckpt", p.outside_dir)
    for step, name in ((1, "a.ckpt"), (2, "b.ckpt")):
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": step}, ckpts / name)
        assert not (ckpts / name).is_symlink() and io.load_checkpoint(ckpts / name)["global_step"] == step
    p.assert_outside_unchanged()
    elsewhere = tmp_path / "other-run"
    elsewhere.mkdir()
    pointer = (ckpts / "a.ckpt").read_bytes()
    (elsewhere / "a.ckpt").write_bytes(pointer)  # another run's pointer (the same generation, even)
    (ckpts / "a.ckpt").unlink()
    (ckpts / "a.ckpt").symlink_to(elsewhere / "a.ckpt")
    assert io.load_checkpoint(ckpts / "a.ckpt")["global_step"] == 1  # loading reads through the user's link
    io.remove_checkpoint(ckpts / "a.ckpt")
    assert (elsewhere / "a.ckpt").read_bytes() == pointer and (ckpts / "a.ckpt").is_symlink()


def test_a_pointer_folder_swapped_for_a_link_between_the_read_and_the_delete_deletes_nothing_outside(tmp_path,
                                                                                                monkeypatch):
    """Fault: remove_checkpoint read the pointer by its path, then unlinked that path: a folder on the way replaced
    by a link in between made it delete the file of that name in the folder the link points to (there, another
    run's checkpoint). Now the read and the delete go through one folder descriptor: the pointer read is the file
    deleted."""
    pytest.importorskip("lightning")
    import json

    from ckpt_archive.integrations.lightning import _POINTER_KEY, ArchiveCheckpointIO

    ckpts = tmp_path / "ckpts"
    io = ArchiveCheckpointIO(tmp_path / "lrepo")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, ckpts / "a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, ckpts / "b.ckpt")
    elsewhere = tmp_path / "other-run"
    elsewhere.mkdir()
    (elsewhere / "a.ckpt").write_bytes((ckpts / "a.ckpt").read_bytes())  # looks like a pointer too
    real_loads, swapped = json.loads, []

    def loads(raw, *a, **k):
        key = _POINTER_KEY.encode() if isinstance(raw, bytes) else _POINTER_KEY
        if not swapped and key in raw:  # the pointer has just been read: swap its folder for a link
            swapped.append(1)
            ckpts.rename(tmp_path / "ckpts-moved")
            ckpts.symlink_to(elsewhere)
        return real_loads(raw, *a, **k)

    monkeypatch.setattr(json, "loads", loads)
    io.remove_checkpoint(ckpts / "a.ckpt")
    monkeypatch.undo()
    assert swapped and (elsewhere / "a.ckpt").is_file()
    assert not (tmp_path / "ckpts-moved" / "a.ckpt").exists()  # the pointer it read is the one removed
    assert io.forgotten == [1]


@pytest.mark.parametrize("name", ["lock", "json"])
def test_restore_checkpoint_never_writes_through_a_link_at_its_lock_or_record(tmp_path, name):
    """restore_checkpoint's lock and record files in output_dir: the lock was a ``filelock.FileLock`` by path (3.x
    opened it following links, with O_TRUNC), the record reached by path. Now both go through the file layer: a
    link at the lock is refused (UnsafePath, nothing written), a link at the record is replaced."""
    pytest.importorskip("transformers")
    from ckpt_archive.errors import UnsafePath
    from ckpt_archive.integrations.transformers import restore_checkpoint

    p = Place(tmp_path)
    src = _trainer_folder(tmp_path / "run" / "checkpoint-3", step=3)
    assert cli("pack", src, "--repo", tmp_path / "hrepo").exit_code == 0
    out = tmp_path / "out"
    p.link(out / f".checkpoint-3.ckpt-archive-restore.{name}")
    if name == "lock":
        with pytest.raises(UnsafePath, match="is a symbolic link"):
            restore_checkpoint(tmp_path / "hrepo", out)
        assert not (out / "checkpoint-3").exists()
    else:
        assert restore_checkpoint(tmp_path / "hrepo", out) == out / "checkpoint-3"
        assert not (out / ".checkpoint-3.ckpt-archive-restore.json").is_symlink()
        assert restore_checkpoint(tmp_path / "hrepo", out) == out / "checkpoint-3"  # the record vouches for it
    p.assert_outside_unchanged()
