"""[break] A lock ticket at the last number a writer takes (``locks/999999999999999999.json``: planted, or
corrupt) blocked every writer of the repository forever: each one refused with exit 2 ("the last a writer
can take ... remove the folder locks/"), although nobody held the lock. A free or stale ticket there is now
removed by the next writer, which takes the lock below it -- still by one exclusive create, still with
fencing -- and says what it removed. A live holder there still holds the lock."""
from __future__ import annotations

import itertools
import json
import os

import pytest

from ckpt_archive.errors import LockError
from ckpt_archive.store.fs import host_name
from ckpt_archive.store.lease_lock import MAX_SEQ, LeaseLock

from tests.helpers import Clock

_n = itertools.count()


def _store():
    from ckpt_archive.store.fsspec_store import FsspecStore

    return FsspecStore(f"memory://ceiling-{os.getpid()}-{next(_n)}")


def _plant(store, seq: int, **record) -> None:
    store.write_bytes_once(f"locks/{seq:012d}.json", json.dumps(record).encode())


@pytest.mark.parametrize("record", [
    {"released": True},                                                                    # free
    {"released": False, "refreshed": 0.0, "host": "elsewhere", "pid": 1, "lease": 60},     # stale
    {"owner": "not a lock record"},                                                        # unreadable
], ids=["released", "stale", "unreadable"])
def test_a_free_or_stale_ticket_at_the_ceiling_no_longer_blocks_every_writer(record):
    """Fault: a ticket at MAX_SEQ that nobody holds refused every writer, forever (exit 2)."""
    store, clock = _store(), Clock()
    _plant(store, MAX_SEQ - 5, released=True)  # an older ticket below it (cleaned by the taker)
    _plant(store, MAX_SEQ, **record)
    a, b = LeaseLock(store, lease=60, clock=clock), LeaseLock(store, lease=60, clock=clock)
    notes = a.acquire()
    try:
        assert any("past the last ticket a writer takes" in n and f"{MAX_SEQ}" in n for n in notes), notes
        assert MAX_SEQ not in a._tickets() and a.seq in a._tickets() and a.seq == MAX_SEQ - 4
        a.check()  # holds it, fencing and all
        with pytest.raises(LockError, match="locked by another writer"):
            b.acquire()  # still one writer at a time
    finally:
        a.release()
    b.acquire()  # and the next one after it
    b.release()


def test_a_live_holder_at_the_ceiling_still_holds_the_lock():
    """The recovery takes only a lock nobody holds: a live ticket there is waited for, as any other."""
    store, clock = _store(), Clock()
    _plant(store, MAX_SEQ, released=False, refreshed=clock(), host="elsewhere", pid=1, lease=60)
    with pytest.raises(LockError, match="locked by another writer"):
        LeaseLock(store, lease=60, clock=clock).acquire()
    assert MAX_SEQ in LeaseLock(store, lease=60, clock=clock)._tickets()


def test_a_holder_whose_ticket_was_removed_after_its_lease_lapsed_never_writes_it_again():
    """Fencing of the recovery: a holder at the ceiling stopped past its lease (a paused VM) must not
    resume refreshing -- rewriting the ticket the next writer removed would make two holders that the
    newer-ticket rule cannot see (the new ticket is lower). refresh() stops at a lapse, as check() does."""
    store, clock = _store(), Clock()
    _plant(store, MAX_SEQ - 1, released=True)
    old = LeaseLock(store, lease=60, clock=clock)
    old.acquire()
    old._stop.set()  # its refresh thread is frozen with it
    assert old.seq == MAX_SEQ
    clock.t += 61  # paused past its lease: stale for everyone else
    new = LeaseLock(store, lease=60, clock=clock)
    new.acquire()
    try:
        old.refresh()  # the paused holder wakes up
        assert MAX_SEQ not in new._tickets(), "the removed ticket was written again"
        with pytest.raises(LockError, match="lost the repository lock"):
            old.check()
        new.check()
    finally:
        new.release()
        old.release()


def test_the_ceiling_ticket_is_named_on_this_host_when_its_pid_is_gone():
    """A ticket at the ceiling naming this host and a dead pid is stale at once: removed, and said so."""
    store = _store()
    _plant(store, MAX_SEQ, released=False, refreshed=1_000_000.0, host=host_name(), pid=2 ** 22 + 7,
           lease=60, since="then")
    notes = LeaseLock(store, lease=60, clock=Clock()).acquire()
    assert any("that process is gone" in n for n in notes), notes


@pytest.mark.parametrize("refreshed", ["NaN", "Infinity", "-Infinity"])
def test_a_ticket_refreshed_at_a_non_finite_time_is_stale_not_held_forever(refreshed):
    """Fault: json reads NaN and Infinity; a NaN refresh time compared False both ways, so the ticket was
    'held' at every clock and no writer ever took the lock (Infinity: held until the end of time). A ticket
    that cannot be read as a lock record is stale (docs/FORMAT.md)."""
    store = _store()
    store.write_bytes_once("locks/000000000005.json", (
        '{"released": false, "refreshed": %s, "host": "elsewhere", "pid": 1, "lease": 60, "since": "x"}'
        % refreshed).encode())
    clock = Clock()
    lock = LeaseLock(store, lease=60, clock=clock)
    info = json.loads(store.read_bytes("locks/000000000005.json"))
    assert lock.holder_state(info)[0] == "stale"
    lock.acquire(wait=0)  # taken over at once, as any stale ticket is
    lock.release()
