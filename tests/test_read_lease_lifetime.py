"""[break] How long pack holds the read leases on its source (format/read_lease.py).

pack maps a ``torch.save`` file only under a Linux read lease; another process's open for writing or
truncation of the file waits until the lease is given back (at most ``/proc/sys/fs/lease-break-time``, 45 s
by default). The leases were given back only when pack returned: a trainer's in-place save (``torch.save``
opens the file with ``O_TRUNC``) over a file being packed stalled the training loop through the verify,
trial reload, publish and retention, which never read the source -- up to 45 s. Now pack gives them back as
soon as it has written the members (its last read of the source); its retry (a damaged shared object found
by the trial reload: the generation is written again from the state) takes the file again and proves it is
the one first read, or refuses with SourceChanged naming it.

The writer here is another *process* (a lease broken by its own holder's process would not show the wait),
and pack runs in this one, hooked where it waits for that writer with a timeout well under the
lease-break-time: "the writer finished before pack went on", never a 45 s sleep.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import SourceChanged
from ckpt_archive.format.objects import object_key, refs
from ckpt_archive.ops.pack import PackOptions
from tests.helpers import cli_in_process, without_read_leases

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="read leases as Linux has them")

#: How long the hooks wait for the writer: generous on a loaded machine, far under the lease-break-time.
WAIT_S = 15.0


def _lease_break_time() -> float:
    try:
        return float(Path("/proc/sys/fs/lease-break-time").read_text())
    except (OSError, ValueError):
        return 0.0


def _needs_leases(src: Path) -> None:
    """Skip where a writer would not wait for pack at all, or not long enough to tell the two apart."""
    from ckpt_archive.format.read_lease import ReadLease

    lease = ReadLease(src)
    try:
        if not lease.held:
            pytest.skip("this file system grants no read lease")
    finally:
        lease.release()
    if _lease_break_time() < 2 * WAIT_S:
        pytest.skip("lease-break-time too short here to tell a held lease from a given-back one")


def _state(parameter: bool = False) -> dict:
    """Three bf16 tensors of 1 MiB (shared objects) and two small ones; Parameters force torch.load(mmap)."""
    g = torch.Generator().manual_seed(0)
    make = (lambda t: torch.nn.Parameter(t, requires_grad=False)) if parameter else (lambda t: t)
    return {"model": {**{f"base.{i}": make((torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16))
                         for i in range(3)},
                      "lora.A": make(torch.randn(8, 1024, generator=g))}, "step": 7}


#: A trainer's in-place save, as torch.save opens the file: O_TRUNC.
_TRUNCATE_AND_WRITE = ("import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC); os.write(fd, b'new'); "
                       "os.close(fd)")


class _Writer:
    """A trainer's save over the source, in another process, started from a hook inside pack: ``done`` says
    whether it finished within :data:`WAIT_S` (measured from its start) while pack waited for it."""

    def __init__(self, code: str, src: Path):
        self.code, self.src = code, src
        self.proc: subprocess.Popen | None = None
        self.done: bool | None = None
        self.seconds: float | None = None

    def run_and_wait(self) -> None:
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-c", self.code, str(self.src)])
        try:
            self.proc.wait(timeout=WAIT_S)
            self.done = self.proc.returncode == 0
        except subprocess.TimeoutExpired:
            self.done = False
        self.seconds = time.monotonic() - t0

    def finish(self) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=120)  # held back by a lease at most lease-break-time


def _hook_trial_reload(monkeypatch, writer: _Writer, *, calls: list | None = None) -> None:
    """The first trial reload of the pack first has ``writer`` save over the source and waits for it."""
    from ckpt_archive.repo import trial_reload as tr

    real = tr.trial_reload
    calls = [] if calls is None else calls

    def hooked(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            writer.run_and_wait()
        return real(*a, **kw)

    monkeypatch.setattr(tr, "trial_reload", hooked)


@pytest.mark.parametrize("parameter", [False, True], ids=["read-without-torch", "torch.load-mmap"])
def test_a_trainer_saving_over_the_source_during_the_trial_reload_does_not_wait_for_pack(tmp_path, monkeypatch,
                                                                                          parameter):
    """Fault: pack held its source's read leases until it returned, so a trainer's in-place save over the file
    (open with O_TRUNC) during pack's trial reload waited for the trial reload, publish and retention -- up to
    the 45 s lease-break-time -- in the training loop. Now the leases go back once the members are written:
    the save goes through at once, and the generation is still usable and holds the old file's state, bytes
    and all."""
    import hashlib

    state = _state(parameter)
    src = tmp_path / "ck.pt"
    torch.save(state, src)
    old_sha = hashlib.sha256(src.read_bytes()).hexdigest()
    _needs_leases(src)
    writer = _Writer(_TRUNCATE_AND_WRITE, src)
    _hook_trial_reload(monkeypatch, writer)
    try:
        res = ckpt_archive.pack(str(src), tmp_path / "r")
    finally:
        writer.finish()
    assert writer.done, (f"the trainer's save over the source waited {writer.seconds:.1f} s for pack's read lease "
                         f"(pack was in its trial reload, long done reading the source)")
    assert src.read_bytes() == b"new"
    assert res.status == "usable"
    out = ckpt_archive.load(tmp_path / "r", res.generation)
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k], v.detach()), k
    assert out["step"] == 7
    ckpt_archive.restore(tmp_path / "r", res.generation, tmp_path / "back.pt")
    assert hashlib.sha256((tmp_path / "back.pt").read_bytes()).hexdigest() == old_sha


def test_a_broken_lease_is_given_back_before_the_generation_is_withdrawn(tmp_path, monkeypatch):
    """Fault: pack noticed a broken lease between entries (a trainer truncating the file) and refused with
    SourceChanged, but kept the lease until it returned -- through withdrawing the claimed generation and the
    rest of its unwinding -- so the trainer's truncation still waited on pack. Now the leases go back as soon
    as the writer's threads have stopped, before the withdrawal."""
    from ckpt_archive.format import read_lease
    from ckpt_archive.ops import pack as pack_mod
    from ckpt_archive.repo import writer as writer_mod

    src = tmp_path / "ck.pt"
    torch.save(_state(), src)
    _needs_leases(src)
    truncator = _Writer("import os, sys; os.truncate(sys.argv[1], 0)", src)
    real_fp, started = writer_mod._entry_fp, []

    def truncate_then(*a, **kw):  # the first entry: another process truncates; pack sees the lease broken
        if not started:
            truncator.proc = subprocess.Popen([sys.executable, "-c", truncator.code, str(src)])
            started.append(time.monotonic())
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and not any(x.broken() for x in list(read_lease._ACTIVE)):
                time.sleep(0.02)
        return real_fp(*a, **kw)

    real_withdraw, waited = pack_mod._withdraw_refused_source, []

    def withdraw_after_the_truncation(*a, **kw):
        try:
            truncator.proc.wait(timeout=WAIT_S)
            waited.append(True)
        except subprocess.TimeoutExpired:
            waited.append(False)
        return real_withdraw(*a, **kw)

    monkeypatch.setattr(writer_mod, "_entry_fp", truncate_then)
    monkeypatch.setattr(pack_mod, "_withdraw_refused_source", withdraw_after_the_truncation)
    try:
        with pytest.raises(SourceChanged) as err:
            ckpt_archive.pack(str(src), tmp_path / "r", PackOptions(share_min_bytes=0))
    finally:
        truncator.finish()
    assert str(src) in str(err.value)
    assert waited == [True], "the truncation waited for pack's lease while pack withdrew its generation"
    assert src.stat().st_size == 0
    gens = tmp_path / "r" / "generations"
    assert not (sorted(p.name for p in gens.iterdir()) if gens.exists() else [])


def _repo_needing_a_retry(tmp_path: Path, src: Path) -> tuple[Path, str]:
    """A repository where the next pack of ``src`` references a shared object the trial reload finds damaged:
    generation 1 left unpublished (its objects kept, not vouched for) and one of its objects rotted. The next
    pack fails its first trial reload and writes the generation again from the state (pack's retry)."""
    repo = tmp_path / "r"
    r1 = ckpt_archive.pack(str(src), repo)
    (repo / "generations" / f"{r1.generation:08d}" / "USABLE.json").unlink()
    oid = sorted(refs(r1.manifest))[0]
    obj = repo / object_key(oid)
    bad = bytearray(obj.read_bytes())
    bad[len(bad) // 3] ^= 0x10
    obj.write_bytes(bytes(bad))
    return repo, oid


def _usable(repo: Path) -> list[int]:
    return sorted(int(p.parent.name) for p in (repo / "generations").glob("*/USABLE.json"))


def _left(repo: Path) -> list[str]:
    return sorted(p.name for p in (repo / "generations").iterdir())


@pytest.mark.parametrize("parameter", [False, True], ids=["read-without-torch", "torch.load-mmap"])
def test_the_retry_reads_an_unchanged_source_again_and_publishes(tmp_path, monkeypatch, parameter):
    """Fault guarded: the retry reading a source whose leases went back after the first read -- a map dropped
    (the read without torch) or unprotected (torch.load's) -- without taking it again, or refusing a file that
    did not change. Taken again and proven the same, it is written again, published, and repairs the object."""
    state = _state(parameter)
    src = tmp_path / "ck.pt"
    torch.save(state, src)
    repo, oid = _repo_needing_a_retry(tmp_path, src)
    damaged = (repo / object_key(oid)).read_bytes()
    calls: list = []
    _hook_trial_reload(monkeypatch, _Writer("pass", src), calls=calls)
    res = ckpt_archive.pack(str(src), repo)
    assert len(calls) == 2 and res.status == "usable"
    assert any(object_key(oid) in w for w in res.warnings), res.warnings
    assert (repo / object_key(oid)).read_bytes() != damaged
    out = ckpt_archive.load(repo, res.generation)
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k], v.detach()), k


@pytest.mark.parametrize("parameter", [False, True], ids=["read-without-torch", "torch.load-mmap"])
def test_the_retry_refuses_a_source_rewritten_after_its_leases_went_back(tmp_path, monkeypatch, parameter):
    """Fault guarded (the retry path, now that the leases go back before the trial reload): a trainer
    rewrites the source while pack's first trial reload runs; that trial reload finds a damaged shared
    object and pack writes the generation again from the state -- reading the source a second time. It must
    take the file again and see it is not the one it read: SourceChanged naming it (exit 2), the generation
    withdrawn, nothing published -- never a generation of old and new bytes. The save itself went through
    at once."""
    src = tmp_path / "ck.pt"
    torch.save(_state(parameter), src)
    _needs_leases(src)
    repo, _ = _repo_needing_a_retry(tmp_path, src)
    writer = _Writer(_TRUNCATE_AND_WRITE, src)
    calls: list = []
    _hook_trial_reload(monkeypatch, writer, calls=calls)
    try:
        with pytest.raises(SourceChanged) as err:
            ckpt_archive.pack(str(src), repo)
    finally:
        writer.finish()
    assert writer.done, f"the trainer's save waited {writer.seconds:.1f} s for pack's read lease"
    assert len(calls) == 1, "the retry must be refused before it writes, let alone trial-reloads"
    assert str(src) in str(err.value) and "retry" in str(err.value)
    assert _usable(repo) == [] and _left(repo) == ["00000001"], _left(repo)


def test_the_retry_refusing_a_rewritten_source_exits_2_at_the_cli(tmp_path, monkeypatch):
    """The same refusal through the CLI: exit 2, the file named, no traceback, nothing published."""
    src = tmp_path / "ck.pt"
    torch.save(_state(), src)
    _needs_leases(src)
    repo, _ = _repo_needing_a_retry(tmp_path, src)
    writer = _Writer(_TRUNCATE_AND_WRITE, src)
    _hook_trial_reload(monkeypatch, writer)
    try:
        res = cli_in_process("pack", src, "--repo", repo)
    finally:
        writer.finish()
    assert writer.done
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert str(src) in res.stderr and "changed" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert _usable(repo) == [] and _left(repo) == ["00000001"]


def test_the_retry_checks_the_bytes_it_reads_again_where_the_stat_cannot_tell(tmp_path, monkeypatch):
    """Fault guarded: a rewrite of the source the stat cannot see (same size, timestamps within one clock tick;
    simulated by an identity blind to them) between pack's first read and its retry, where no lease is had
    (the source read with pread). The retry stored the new bytes under the first read's fingerprint -- a new
    shared object whose name promised the old bytes, left in the repository -- and failed only at its second
    trial reload (exit 1, the generation left partial). Now each entry read again is compared with its first
    fingerprint before it is stored: SourceChanged naming the file, the generation withdrawn, no object made."""
    from ckpt_archive.format import exact_bytes, read_lease

    without_read_leases(monkeypatch)
    src = tmp_path / "ck.pt"
    torch.save(_state(), src)
    repo, oid = _repo_needing_a_retry(tmp_path, src)
    from ckpt_archive.format import fingerprint

    data = src.read_bytes()
    # a byte inside the record of the very tensor whose shared object is damaged (the retry writes it again)
    (start, length), = [(r[0], r[1]) for r in exact_bytes.zip_records(src) if "/data/" in r[3] and
                        fingerprint.digest(data[r[0]:r[0] + r[1]]) == f"blake3:{oid.split('-')[0]}"]
    at = start + length // 2

    def blind(path):
        st = os.stat(path)
        return (st.st_dev, st.st_ino, st.st_size)

    monkeypatch.setattr(exact_bytes, "file_identity", blind)
    monkeypatch.setattr(read_lease, "_identity", lambda st: (st.st_dev, st.st_ino, st.st_size), raising=False)
    flip = ("import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); b = os.pread(fd, 1, {at}); "
            "os.pwrite(fd, bytes([b[0] ^ 0x20]), {at}); os.close(fd)").format(at=at)
    writer = _Writer(flip, src)
    _hook_trial_reload(monkeypatch, writer)
    damaged = (repo / object_key(oid)).read_bytes()
    objects = sorted(p.name for p in (repo / "objects").rglob("*.ckz"))
    try:
        with pytest.raises(SourceChanged) as err:
            ckpt_archive.pack(str(src), repo)
    finally:
        writer.finish()
    assert writer.done
    assert str(src) in str(err.value)
    assert _usable(repo) == [] and _left(repo) == ["00000001"]
    assert sorted(p.name for p in (repo / "objects").rglob("*.ckz")) == objects, "an object of the new bytes"
    assert (repo / object_key(oid)).read_bytes() == damaged  # left for a pack of the same state to write again


# -- one scope per pack ---------------------------------------------------------------------------------------


def _held(lease) -> bool:
    return lease.fd >= 0 and fcntl.fcntl(lease.fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK


def _two_files(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.write_bytes(b"a" * 4096)
    b.write_bytes(b"b" * 4096)
    return a, b


def test_a_scope_inside_another_gives_back_only_its_own_leases(tmp_path):
    """Fault guarded: leases tracked per process, so a scope inside another (a pack run from inside another
    pack's scope) kept its leases until the outer one ended -- its file's writer waited for someone else's
    pack -- or, released early, would have dropped the outer scope's too."""
    from ckpt_archive.format.read_lease import ReadLease, lease_scope

    a, b = _two_files(tmp_path)
    with lease_scope():
        outer = ReadLease(a)
        if not outer.held:
            pytest.skip("this file system grants no read lease")
        with lease_scope():
            inner = ReadLease(b)
            assert _held(inner)
        assert not _held(inner), "the inner scope ended but its lease was kept"
        assert _held(outer), "the inner scope gave back the outer scope's lease"
    assert not _held(outer)


@contextlib.contextmanager
def _other_packs_lease(path: Path):
    """A read lease on ``path`` taken in a lease scope of another thread (another pack), held until the block
    ends; yields that lease."""
    from ckpt_archive.format.read_lease import ReadLease, lease_scope

    taken, release, seen = threading.Event(), threading.Event(), {}

    def other_pack():
        with lease_scope():
            seen["lease"] = ReadLease(path)
            taken.set()
            release.wait(60)

    t = threading.Thread(target=other_pack)
    t.start()
    try:
        assert taken.wait(30)
        yield seen["lease"]
    finally:
        release.set()
        t.join(30)


def test_one_pack_giving_its_leases_back_leaves_another_threads_pack_alone(tmp_path):
    """Fault guarded: a Checkpointer's background pack and another pack in the training thread: one giving its
    leases back (done reading) must not drop the other's, which still maps its file."""
    from ckpt_archive.format.read_lease import ReadLease, lease_scope

    a, b = _two_files(tmp_path)
    with _other_packs_lease(b) as other:
        with lease_scope() as mine:
            own = ReadLease(a)
            if not own.held:
                pytest.skip("this file system grants no read lease")
            mine.give_back()
            assert not _held(own)
            assert _held(other), "giving one pack's leases back dropped another pack's"
    assert not _held(other)


def test_a_pack_does_not_report_another_packs_broken_lease_as_its_own_source_changing(tmp_path):
    """Fault guarded: the writer's check between entries looked at every lease of the process, so a pack of an
    in-memory state (a Checkpointer's background save) failed with SourceChanged naming a file another
    pack was reading, when a trainer wrote that file."""
    from ckpt_archive.format.read_lease import ReadLease, check_leases, lease_scope

    a, b = _two_files(tmp_path)
    opener = None
    try:
        with _other_packs_lease(a) as other:
            if not other.held:
                pytest.skip("this file system grants no read lease")
            opener = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'r+b').close()", str(a)])
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and not other.broken():
                time.sleep(0.02)
            assert other.broken()
            with lease_scope():
                ReadLease(b)
                check_leases()  # this pack's own file is untouched
    finally:
        if opener is not None:
            opener.wait(60)
