"""The in-repository lock of stores without OS locks (store/lease_lock.py): tickets, leases, fencing.

Unit cases run on fsspec's memory:// store with a fake clock; the two-process race and the holder killed
mid-lease run against the S3 test server (tests/test_remote_lock.py).
"""
from __future__ import annotations

import itertools
import json

import pytest

from ckpt_archive.errors import LockError
from ckpt_archive.store.lease_lock import LeaseLock

from tests.helpers import Clock

_n = itertools.count()


@pytest.fixture()
def store():
    from ckpt_archive.store.fsspec_store import FsspecStore

    return FsspecStore(f"memory://lease-{next(_n)}")


def test_a_second_writer_is_refused_while_the_first_holds_a_live_lease(store):
    clock = Clock()
    a, b = LeaseLock(store, lease=60, clock=clock), LeaseLock(store, lease=60, clock=clock)
    a.acquire()
    try:
        with pytest.raises(LockError, match="locked by another writer"):
            b.acquire()
        a.check()
    finally:
        a.release()
    b.acquire()  # released: free at once
    b.release()


def test_a_lease_not_refreshed_goes_stale_and_the_old_holder_is_fenced_off(store):
    """A writer whose lease lapsed (a stopped VM) must not go on committing after another took over."""
    clock = Clock()
    a = LeaseLock(store, lease=60, clock=clock)
    a.acquire()
    a._stop.set()  # a hung holder: no refreshes
    b = LeaseLock(store, lease=60, clock=clock)
    with pytest.raises(LockError):
        b.acquire()
    clock.t += 61
    notes = b.acquire()
    assert notes and "stale" in notes[0]
    with pytest.raises(LockError, match="lost the repository lock"):
        a.check()
    b.check()
    a.release()  # must not mark b's ticket released
    c = LeaseLock(store, lease=60, clock=clock)
    with pytest.raises(LockError):
        c.acquire()
    b.release()


def test_a_refreshed_lease_stays_held_past_its_first_term(store):
    clock = Clock()
    a = LeaseLock(store, lease=60, clock=clock)
    a.acquire()
    a._stop.set()
    for _ in range(5):
        clock.t += 40
        a.refresh()
    b = LeaseLock(store, lease=60, clock=clock)
    with pytest.raises(LockError):
        b.acquire()
    a.check()
    a.release()


def test_a_holder_that_could_not_refresh_for_a_lease_fences_itself(store):
    clock = Clock()
    a = LeaseLock(store, lease=60, clock=clock)
    a.acquire()
    a._stop.set()
    clock.t += 61
    with pytest.raises(LockError, match="could not refresh"):
        a.check()
    a.release()


def test_a_dead_pid_on_this_host_is_stale_at_once(store):
    clock = Clock()
    a = LeaseLock(store, lease=600, clock=clock)
    a.acquire()
    a._stop.set()
    key = a._key(a.seq)
    rec = json.loads(store.read_bytes(key))
    rec["pid"] = 2**22 + 12345  # no such process
    store.replace_bytes(key, json.dumps(rec).encode())
    b = LeaseLock(store, lease=600, clock=clock)
    assert "process is gone" in b.acquire()[0]
    b.release()


def test_tickets_only_grow_and_old_ones_are_cleaned(store):
    clock = Clock()
    seqs = []
    for _ in range(4):
        lk = LeaseLock(store, lease=60, clock=clock)
        lk.acquire()
        seqs.append(lk.seq)
        lk.release()
    assert seqs == [1, 2, 3, 4]
    assert store.listdir("locks") == ["000000000004.json"]


def test_two_racers_for_one_ticket_get_exactly_one_lock(store, monkeypatch):
    """Both see the lock free; the conditional create lets exactly one of them take ticket 1."""
    clock = Clock()
    a, b = LeaseLock(store, lease=60, clock=clock), LeaseLock(store, lease=60, clock=clock)
    real = LeaseLock._tickets
    seen = {"n": 0}

    def stale_view(self):  # b lists before a creates its ticket, then sees the truth
        seen["n"] += 1
        return [] if self is b and seen["n"] <= 2 else real(self)

    a.acquire()
    monkeypatch.setattr(LeaseLock, "_tickets", stale_view)
    with pytest.raises(LockError):
        b.acquire()
    a.release()
