"""``FolderPublisher``: a folder a trainer has written, snapshot by hard links, packed in the background.

Folders here are small Accelerate-style ``save_state`` folders (``model.safetensors``, ``optimizer.bin``) built
with torch and safetensors directly: what is tested is the snapshot and its checks, not a trainer.
"""
from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ckpt_archive  # noqa: E402
from ckpt_archive.errors import SourceError, UsageError  # noqa: E402
from ckpt_archive.integrations.folder import STAGING_NAME, FolderPublisher, default_staging  # noqa: E402
from ckpt_archive.repo.publish import Withdrawn  # noqa: E402


def _save_state(folder: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 4, generator=g)
    save_file({"weight": w}, str(folder / "model.safetensors"))
    opt = torch.optim.AdamW([torch.nn.Parameter(w.clone())], lr=1e-3)
    opt.param_groups[0]["params"][0].grad = torch.ones_like(w)
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.bin")
    return folder


def _digests(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class _Gate:
    """Holds the background pack until the test says go (patched over ``ckpt_archive.ops.pack.pack``)."""

    def __init__(self, monkeypatch, before=None):
        import ckpt_archive.ops.pack as pack_mod

        self.go = threading.Event()
        self.entered = threading.Event()
        real = pack_mod.pack

        def gated(source, *a, **kw):
            self.entered.set()
            assert self.go.wait(60)
            return real(source, *a, **kw)

        monkeypatch.setattr(pack_mod, "pack", gated)


def test_publish_returns_before_the_pack_and_the_trainer_may_delete_the_folder(tmp_path, monkeypatch):
    """Guards the rotation race (save_total_limit / total_limit): the folder is deleted after publish() returned
    and before the pack read it; the generation must hold every file exactly as it was."""
    folder = _save_state(tmp_path / "out" / "step_3")
    before = _digests(folder)
    gate = _Gate(monkeypatch)
    with FolderPublisher(tmp_path / "repo") as pub:
        handle = pub.publish(folder, step=3)
        assert gate.entered.wait(60) and not handle.done()  # publish() returned while the pack waits
        assert handle.linked == 2 and handle.copied == 0
        import shutil

        shutil.rmtree(folder)  # the trainer's rotation
        gate.go.set()
        res = handle.result()
    assert res.status == "usable" and res.manifest["progress"]["step"] == 3
    ckpt_archive.restore(tmp_path / "repo", output=tmp_path / "back")
    assert _digests(tmp_path / "back") == before
    assert not (tmp_path / "out" / STAGING_NAME).exists()


def test_a_file_rewritten_in_place_during_the_pack_is_withdrawn_not_published(tmp_path, monkeypatch):
    """A hard link cannot keep a file rewritten in place (same inode): what was packed could mix two versions.
    The stat check before the marker withdraws the generation; the failure is raised at the next call."""
    folder = _save_state(tmp_path / "out" / "step_3")
    gate = _Gate(monkeypatch)
    pub = FolderPublisher(tmp_path / "repo")
    pub.publish(folder, step=3)
    assert gate.entered.wait(60)
    with open(folder / "optimizer.bin", "r+b") as fh:  # same inode, new bytes
        fh.seek(0, os.SEEK_END)
        fh.write(b"\0" * 16)
    gate.go.set()
    with pytest.raises(Withdrawn, match="optimizer.bin changed in place") as info:
        pub.wait()
    assert "step_3" in "".join(getattr(info.value, "__notes__", []))
    assert ckpt_archive.list_generations(tmp_path / "repo", all=True) == []
    pub.close()
    assert not (tmp_path / "out" / STAGING_NAME).exists()


def test_where_links_fail_the_files_are_copied(tmp_path, monkeypatch):
    """A file system without hard links (some FUSE or network mounts): the snapshot copies, never fails."""
    folder = _save_state(tmp_path / "out" / "step_1")
    before = _digests(folder)

    def no_links(*a, **k):
        raise OSError(errno.EPERM, "hard links not supported here")

    from ckpt_archive.store import fs

    # the snapshot's links only: the repository's own writes link too (a temporary file to its name), and a file
    # system without links under the trainer's folder may well hold a repository that has them
    monkeypatch.setattr(fs.Dir, "link_from", no_links)
    with FolderPublisher(tmp_path / "repo") as pub:
        handle = pub.publish(folder, step=1, block=True)
    assert (handle.linked, handle.copied) == (0, 2)
    ckpt_archive.restore(tmp_path / "repo", output=tmp_path / "back")
    assert _digests(tmp_path / "back") == before


def test_staging_stays_out_of_the_folders_trainers_rotate(tmp_path):
    """Accelerate's total_limit lists every entry of checkpoints/ and reads a number from each name: a staging
    folder there would crash its next save_state; the Trainer globs checkpoint-* in output_dir."""
    acc = tmp_path / "proj" / "checkpoints" / "checkpoint_3"
    assert default_staging(acc) == tmp_path / "proj" / STAGING_NAME
    hf = tmp_path / "out" / "checkpoint-20"
    assert default_staging(hf) == tmp_path / "out" / STAGING_NAME
    assert default_staging(tmp_path / "out" / "step_3") == tmp_path / "out" / STAGING_NAME


def test_a_background_failure_is_raised_once_at_the_next_call_and_logged(tmp_path, caplog):
    folder = tmp_path / "out" / "step_1"
    folder.mkdir(parents=True)
    (folder / "optimizer.bin").write_bytes(b"")  # an interrupted write
    (folder / "model.safetensors").write_bytes(b"")
    pub = FolderPublisher(tmp_path / "repo")
    pub.publish(folder, step=1)
    with pytest.raises(SourceError):
        pub.publish(_save_state(tmp_path / "out" / "step_2"), step=2)
    assert any("archiving step_1 failed" in r.getMessage() for r in caplog.records)
    assert pub.wait() is None  # raised once; the second publish was not started
    assert pub.publish(tmp_path / "out" / "step_2", step=2, block=True).result().generation == 1
    pub.close()


def test_bad_arguments_fail_in_the_caller_before_anything_is_written(tmp_path):
    pub = FolderPublisher(tmp_path / "repo")
    with pytest.raises(SourceError, match="no such checkpoint folder"):
        pub.publish(tmp_path / "missing", step=1)
    with pytest.raises(UsageError):
        pub.publish(tmp_path, step=-1)
    with pytest.raises(UsageError):
        FolderPublisher(tmp_path / "repo", retention={"keep_last": 2})
    pub.close()
    with pytest.raises(UsageError, match="closed"):
        pub.publish(tmp_path, step=1)
    assert not (tmp_path / STAGING_NAME).exists()


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_snapshot_left_by_a_killed_publisher_is_removed_by_the_next_publish(tmp_path):
    """Guards the leak a kill -9 mid-publish left: its hard-linked snapshot stayed in _ckpt-archive-staging/ for
    ever, holding the space of a checkpoint folder the trainer's rotation deleted later. The next publish on this
    host removes snapshots of processes that are gone, and only those (a live process's, another host's, a name
    that is not ours stay)."""
    from ckpt_archive.integrations.folder import _host

    out = tmp_path / "out"
    staging = out / STAGING_NAME
    dead = staging / f"{_host()}-{_dead_pid()}-{'a' * 32}" / "step_1"
    live = staging / f"{_host()}-{os.getppid()}-{'b' * 32}" / "step_1"
    other_host = staging / f"elsewhere-{_dead_pid()}-{'c' * 32}" / "step_1"
    foreign = staging / "notes"
    for d in (dead, live, other_host, foreign):
        d.mkdir(parents=True)
        (d / "optimizer.bin").write_bytes(b"x")
    with FolderPublisher(tmp_path / "repo") as pub:
        pub.publish(_save_state(out / "step_2"), step=2, block=True)
    assert sorted(p.name for p in staging.iterdir()) == sorted(
        [live.parent.name, other_host.parent.name, foreign.name])


def test_ctrl_c_while_waiting_for_the_previous_publish_keeps_it_in_flight_and_says_so(tmp_path, monkeypatch):
    """Guards two wrong outcomes of a Ctrl-C that lands while publish() waits for the previous publish: the note
    said that publish 'was not archived' (it goes on and becomes usable), and the publisher forgot it, so wait()
    and close() returned before it ended."""
    from ckpt_archive.integrations.folder import PublishHandle

    gate = _Gate(monkeypatch)
    pub = FolderPublisher(tmp_path / "repo")
    first = pub.publish(_save_state(tmp_path / "out" / "step_1"), step=1)
    assert gate.entered.wait(60)
    real_result = PublishHandle.result
    calls = []

    def interrupted(self, timeout=None):
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt  # what a Ctrl-C does to a thread blocked in Future.result()
        return real_result(self, timeout)

    monkeypatch.setattr(PublishHandle, "result", interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        pub.publish(_save_state(tmp_path / "out" / "step_2"), step=2)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "goes on" in notes and "was not archived" not in notes
    assert not first.done()
    gate.go.set()
    assert pub.close().generation == 1  # close() waited for the publish the Ctrl-C interrupted the wait for
    assert [(g.number, g.status) for g in ckpt_archive.list_generations(tmp_path / "repo")] == [(1, "usable")]
