"""Attacks on issue 28's keys, encrypted repositories and signatures that the first suites missed.

Each test names the fault it guards against; see the docstrings.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import UsageError
from ckpt_archive.format import crypto
from ckpt_archive.repo.repository import Repository


@pytest.fixture()
def keyfile(tmp_path) -> Path:
    p = tmp_path / "repo.key"
    p.write_bytes(crypto.new_key_file_text())
    return p


def _state(step: int = 1) -> dict:
    return {"model": {"w": torch.arange(16, dtype=torch.float32) + step}, "progress": {"step": step}}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_key_file_that_is_a_fifo_is_refused_not_waited_on_forever(tmp_path, keyfile):
    """--key-file PATH naming a FIFO hung every command in open() (waiting for a writer that never came)."""
    ckpt_archive.pack(_state(), Repository.open(tmp_path / "r", create=True, key_file=keyfile))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    box = {}

    def attempt():
        try:
            Repository.open(tmp_path / "r", key_file=fifo)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            box["exc"] = exc

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the hung open() so the test run can end
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("opening a FIFO as a key file waited for a writer")
    assert isinstance(box.get("exc"), UsageError) and "not a regular file" in box["exc"].message
    with pytest.raises(UsageError, match="not a regular file"):
        Repository.open(tmp_path / "r", key_file=tmp_path)  # a directory: the same refusal


@pytest.mark.parametrize("shape", ["p16 at n=2**20", "many records"])
def test_hostile_key_records_cannot_hold_a_reader_deriving_for_minutes(monkeypatch, shape):
    """Each record's n, r, p were bounded (memory) but not their work n*r*p, nor the number of records:
    a repository.json with records of n = 2**20, r = 8, p = 16 (~50 s each here), or thousands of records,
    held every reader in scrypt for hours. Now refused before any key is derived."""
    calls = []
    real = crypto._kek
    monkeypatch.setattr(crypto, "_kek", lambda *a: calls.append(a[2:]) or real(*a))
    rec = crypto.wrap_data_key(crypto.new_data_key(), b"k", "r")
    calls.clear()
    if shape == "many records":
        records = [dict(rec, id=str(i)) for i in range(crypto.MAX_KEY_RECORDS + 1)]
    else:
        records = [dict(rec, kdf=dict(rec["kdf"], n=1 << 20, r=8, p=16)) for _ in range(3)]
    with pytest.raises(crypto.KeyRefused, match="repository.json"):
        crypto.unwrap_data_key(records, b"wrong key", "r")
    assert calls == [], "a key was derived before the records were refused"
    # the writer's own record still opens (and one record at the documented ceiling is still read)
    assert crypto.unwrap_data_key([rec], b"k", "r")[1] == rec["id"]


def _downgrade(root: Path) -> None:
    """What an attacker who can write the bucket does: drop "encryption" and plant plaintext generations."""
    cfg = json.loads((root / "repository.json").read_text())
    del cfg["encryption"]
    planted = root.parent / "planted"
    ckpt_archive.pack(_state(666), planted)
    for p in (root / "generations").iterdir():
        import shutil
        shutil.rmtree(p)
    import shutil
    shutil.copytree(planted / "generations" / "00000001", root / "generations" / "00000001")
    pcfg = json.loads((planted / "repository.json").read_text())
    (root / "repository.json").write_text(json.dumps({**pcfg, "id": cfg["id"]}))


def test_a_downgraded_repository_is_not_read_or_written_in_the_clear_with_the_key_from_the_environment(
        tmp_path, keyfile, monkeypatch):
    """Removing "encryption" from repository.json made every reader with $CKPT_ARCHIVE_KEY_FILE (the
    Checkpointer, integrations, any command without --key-file) silently load the attacker's plaintext
    generations as the repository's, and the next pack write the weights into the bucket in the clear."""
    root = tmp_path / "r"
    ckpt_archive.pack(_state(1), Repository.open(root, create=True, key_file=keyfile))
    _downgrade(root)
    monkeypatch.setenv("CKPT_ARCHIVE_KEY_FILE", str(keyfile))
    for attempt in (lambda: ckpt_archive.load(root, "latest"),
                    lambda: ckpt_archive.pack(_state(2), root)):
        with pytest.raises(UsageError, match="not encrypted, but CKPT_ARCHIVE_KEY_FILE is set"):
            attempt()
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app
    res = CliRunner().invoke(app, ["restore", f"{root}@latest", "--output", str(tmp_path / "o.pt")])
    assert res.exit_code == 2 and not (tmp_path / "o.pt").exists(), res.output
    assert len(list((root / "generations").iterdir())) == 1  # nothing written in the clear
    monkeypatch.delenv("CKPT_ARCHIVE_KEY_FILE")
    assert ckpt_archive.load(tmp_path / "planted", "latest")["progress"]["step"] == 666  # plain ones still open


def _signed_elsewhere(tmp_path, *, copied: bool) -> tuple[Path, Path]:
    """A generation signed by key A (``copied``: exported, so it is ``copied`` at the path given), and the
    public key B of another signer."""
    from ckpt_archive.ops.keys import new_key

    a, b = new_key(tmp_path / "a"), new_key(tmp_path / "b")
    r = Repository.open(tmp_path / "r", create=True, sign_key=a.path)
    ckpt_archive.pack(_state(), r)
    root = tmp_path / "r"
    if copied:
        import shutil
        shutil.copytree(root, tmp_path / "moved")
        root = tmp_path / "moved"
    return root, Path(str(b.path) + ".pub")


@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("copied", [False, True])
def test_verify_trust_with_another_key_does_not_mark_a_good_generation_damaged_for_everyone(tmp_path, deep, copied):
    """`verify --trust B.pub` of a generation signed by A (a reader with the wrong, or someone else's, trust
    file) wrote CHECK-FAILED.json into the repository: the good generation became damaged for every reader,
    with or without --trust. Refusing to vouch is this reader's verdict (exit 1), not damage to record."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app
    root, other = _signed_elsewhere(tmp_path, copied=copied)
    args = ["verify", f"{root}@1", "--trust", str(other)] + (["--deep"] if deep else [])
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and "not by a trusted key" in res.output, res.output
    assert not (root / "generations" / "00000001" / "CHECK-FAILED.json").exists()
    assert ckpt_archive.verify(root, "1").ok  # every other reader still finds it as it is
    assert ckpt_archive.load(root, "1")["progress"]["step"] == 1


@pytest.mark.parametrize("signed", [False, True])
def test_export_with_trust_refuses_an_unsigned_or_foreign_generation_and_writes_nothing(tmp_path, signed):
    """`export SRC --to DEST --trust A.pub` copied (exit 0) a generation that was unsigned or signed by another
    key, and proved it usable at DEST: --trust was read and then never checked on export."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app
    if signed:
        root, other = _signed_elsewhere(tmp_path, copied=False)
    else:
        from ckpt_archive.ops.keys import new_key
        ckpt_archive.pack(_state(), tmp_path / "r")
        root, other = tmp_path / "r", Path(str(new_key(tmp_path / "b").path) + ".pub")
    res = CliRunner().invoke(app, ["export", str(root), "--to", str(tmp_path / "dest"), "--trust", str(other)])
    assert res.exit_code == 1, res.output
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").rglob("USABLE.json"))
    assert not (tmp_path / "dest").exists(), "DEST was created before the refusal"


def _memory_store():
    import itertools
    from ckpt_archive.store.fsspec_store import FsspecStore

    _memory_store.n = getattr(_memory_store, "n", itertools.count())
    return FsspecStore(f"memory://breakcrypto-{os.getpid()}-{next(_memory_store.n)}")


def test_a_ticket_at_the_last_twelve_digit_number_does_not_let_two_writers_hold_the_lock():
    """A ticket locks/999999999999.json (planted, or reached) made the next writer create
    1000000000000.json, a name the 12-digit listing never saw, and remove the old one: the next writer found
    no ticket, took 000000000001, and both held the repository's lock at once."""
    from ckpt_archive.errors import LockError
    from ckpt_archive.store import lease_lock
    from ckpt_archive.store.lease_lock import LeaseLock

    for top in (999_999_999_999, getattr(lease_lock, "MAX_SEQ", 10 ** 18 - 1)):
        store = _memory_store()
        store.write_bytes_once(f"locks/{top:012d}.json", json.dumps({"released": True}).encode())
        a, b = LeaseLock(store, lease=60), LeaseLock(store, lease=60)
        notes = a.acquire()
        try:
            if top < lease_lock.MAX_SEQ:
                assert a.seq == top + 1 and a.seq in a._tickets()
            else:  # the ceiling: the free ticket there is removed (test_lock_ceiling.py), never a lock nobody sees
                assert a.seq in a._tickets() and top not in a._tickets() and "past the last ticket" in notes[0]
            with pytest.raises(LockError, match="locked by another writer"):
                b.acquire()
        finally:
            a.release()
            b.release()


def test_a_ticket_refreshed_far_in_the_future_does_not_hold_the_lock_forever():
    """A ticket whose "refreshed" lies years ahead (hostile, or a writer whose clock ran wild) was "held"
    until that time came: no writer could take the repository's lock again."""
    from ckpt_archive.store.lease_lock import LeaseLock

    store = _memory_store()
    store.write_bytes_once("locks/000000000001.json", json.dumps(
        {"released": False, "refreshed": 1e15, "host": "elsewhere", "pid": 1, "lease": 60}).encode())
    c = LeaseLock(store, lease=60)
    notes = c.acquire()
    c.release()
    assert notes and "in the future" in notes[0]


def test_a_huge_planted_lock_ticket_is_not_read_whole(monkeypatch):
    """A ticket was read whole before its size was checked: a planted locks/<seq>.json of gigabytes made
    every writer allocate it. It is now judged by its size first (an unreadable ticket: stale)."""
    from ckpt_archive.store.lease_lock import LeaseLock

    store = _memory_store()
    store.write_bytes_once("locks/000000000001.json", b" " * ((1 << 16) + 1))
    monkeypatch.setattr(type(store), "read_bytes", lambda *a, **k: pytest.fail("the oversized ticket was read"))
    c = LeaseLock(store, lease=60)
    assert c._read(1) == {}


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_bad_signing_key_is_refused_before_a_generation_is_written(tmp_path, monkeypatch, how):
    """pack --sign-key NOT-A-KEY packed and wrote the whole generation, then failed at the marker: every
    attempt left a partial generation behind (and spent the whole pack). It is refused before the claim."""
    bad = tmp_path / "not-a-key"
    bad.write_text("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    kw = {}
    if how == "environment":
        monkeypatch.setenv("CKPT_ARCHIVE_SIGN_KEY", str(bad))
    else:
        kw["sign_key"] = bad
    with pytest.raises(UsageError, match="signing key"):
        ckpt_archive.pack(_state(), Repository.open(tmp_path / "r", create=True, **kw))
    gens = tmp_path / "r" / "generations"
    assert not gens.exists() or not any(gens.iterdir()), list(gens.iterdir())


def test_key_change_to_the_same_key_is_refused_not_reported_as_a_change(tmp_path, keyfile):
    """`key change --key-file K --new-key-file K` (or a copy of K) said "now opens with K (not with K)" and
    K still opened the repository: a user rotating a leaked key believed it was rotated."""
    from ckpt_archive.ops.keys import change_repository_key

    ckpt_archive.pack(_state(), Repository.open(tmp_path / "r", create=True, key_file=keyfile))
    copy = tmp_path / "copy.key"
    copy.write_bytes(keyfile.read_bytes().rstrip(b"\n"))  # the same secret, spelt without the newline
    before = (tmp_path / "r" / "repository.json").read_bytes()
    with pytest.raises(UsageError, match="same key"):
        change_repository_key(tmp_path / "r", keyfile, copy)
    assert (tmp_path / "r" / "repository.json").read_bytes() == before


def test_a_holder_fences_itself_well_before_another_writer_may_take_over():
    """check() let a holder whose refreshes had failed commit until the very second its lease ran out, the
    same second another writer may take the lock over: a commit or a sweep that then took seconds ran
    alongside the other writer's. The holder now stops after half its lease, while the others still wait."""
    from ckpt_archive.errors import LockError
    from ckpt_archive.store.lease_lock import LeaseLock

    class Clock:
        t = 1_000_000.0

        def __call__(self):
            return self.t

    store, clock = _memory_store(), Clock()
    a, b = LeaseLock(store, lease=60, clock=clock), LeaseLock(store, lease=60, clock=clock)
    a.acquire()
    a._stop.set()  # its refreshes fail from now on
    clock.t += 45
    with pytest.raises(LockError, match="could not refresh"):
        a.check()
    with pytest.raises(LockError, match="locked by another writer"):
        b.acquire()  # while the others still see a's lease as held
    a.release()


def test_saving_a_default_retention_does_not_undo_a_key_change_made_since_the_repository_was_opened(
        tmp_path, keyfile):
    """set_default_retention (prune --save-default) wrote back the repository.json read when its Repository was
    opened: a `key change` made meanwhile (another process, while this one waited for the lock) was undone, the
    old key opened the repository again and the new one no longer did -- a user who destroyed the old key
    file after rotating lost the repository."""
    from ckpt_archive.ops.keys import change_repository_key

    ckpt_archive.pack(_state(), Repository.open(tmp_path / "r", create=True, key_file=keyfile))
    opened_early = Repository.open(tmp_path / "r", key_file=keyfile)
    new = tmp_path / "new.key"
    new.write_bytes(crypto.new_key_file_text())
    change_repository_key(tmp_path / "r", keyfile, new)
    with opened_early.lock():
        opened_early.set_default_retention({"keep_last": 3})
    r = Repository.open(tmp_path / "r", key_file=new)  # the rotation holds
    assert r.config["retention"] == {"keep_last": 3}
    with pytest.raises(crypto.KeyRefused):
        Repository.open(tmp_path / "r", key_file=keyfile)


def test_list_and_status_with_trust_do_not_call_an_untrusted_generation_usable_or_healthy(tmp_path):
    """docs/keys.md: --trust on list and status requires a signature by a trusted key; `status --trust`
    answered "ok: newest usable generation 1" (exit 0) and `list --trust` showed it "usable" when the
    generation was signed by another key or not at all: a watchdog gave a clean bill to what --trust refuses."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app
    root, other = _signed_elsewhere(tmp_path, copied=False)
    state = tmp_path / "status.json"
    res = CliRunner().invoke(app, ["status", str(root), "--trust", str(other), "--state", str(state), "--json"])
    assert res.exit_code == 1, res.output
    assert "not by a trusted key" in res.output
    res = CliRunner().invoke(app, ["list", str(root), "--trust", str(other), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["generations"]
    assert [r["status"] for r in rows] == ["untrusted"] and "not by a trusted key" in rows[0]["reason"]
    # trusting the signer: usable and healthy as before
    signer = Path(str(tmp_path / "a") + ".pub")
    res = CliRunner().invoke(app, ["status", str(root), "--trust", str(signer), "--state", str(state)])
    assert res.exit_code == 0, res.output
