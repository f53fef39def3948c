"""The writer lock of a repository on a store without OS locks (``s3://`` and other object stores): a
lock that lives in the repository, so two machines never both hold it.

restic keeps lock files in the repository and calls one stale when it was not refreshed for 30 minutes
(``internal/restic/lock.go``); borg does the same with a lock roster. Object stores have no rename and
no lock, but they have **conditional create** (S3 ``If-None-Match: *``, the store's ``write_bytes_once``),
and that is enough for a ticket lock with fencing:

* The lock is a sequence of **tickets** ``locks/<seq>.json`` (12 digits). Whoever creates ticket
  ``top + 1`` — exclusively, so exactly one of two racing writers does — holds the lock, but only if
  ticket ``top`` was free: released, or stale.
* A ticket holds ``owner`` (a random id), ``host``, ``pid``, ``since``, ``refreshed`` (UNIX seconds and
  RFC 3339) and ``lease`` (seconds). The holder rewrites its own ticket every ``lease / 4`` seconds.
* A ticket is **stale** when it was not refreshed for its ``lease`` seconds by the reader's clock, or, on the
  same host, when its pid is gone (the local lock's rule: a killed writer on this machine is seen at
  once). A ticket that cannot be read as a lock record counts as stale (it cannot be anybody's lease).
* **Fencing.** A holder whose lease lapsed (a stopped VM, a hung network) may still believe it holds the
  lock after another writer took ticket ``top + 1``. So before every step that commits or deletes
  (writing a marker, removing a generation, sweeping objects) the holder calls :meth:`LeaseLock.check`:
  it fails when a newer ticket exists or the holder's own refreshes lapsed for half the lease (a margin of
  lease / 2 before another writer may take over), and the step is not done.
* Release marks the ticket ``released``. Tickets older than the one just taken are removed by its taker;
  the top ticket is never removed, so sequence numbers only grow -- except a free or stale one at
  :data:`MAX_SEQ` (planted or corrupt: no writer counts that far), which would otherwise block every
  writer forever: the next writer removes it and takes the lock below it (a holder that ever wrote it has
  lapsed, and :meth:`LeaseLock.refresh` never writes a lapsed holder's ticket again).

Clocks: staleness compares another machine's ``refreshed`` time with this machine's clock, so the lease
(default :data:`DEFAULT_LEASE` = 10 minutes) must exceed any clock skew between writers.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import threading
import time

from ckpt_archive.errors import LockError, NotFound, StoreError
from ckpt_archive.store.fs import host_name, pid_alive

LOCK_DIR = "locks"
_TICKET = re.compile(r"^(\d{12,18})\.json$")
#: The highest ticket a writer takes: every ticket it creates must be one :meth:`LeaseLock._tickets` lists
#: (a ticket it cannot see is a lock nobody else can see either).
MAX_SEQ = 10 ** 18 - 1
#: Seconds a ticket stays valid without a refresh (env ``CKPT_ARCHIVE_LOCK_LEASE`` overrides, for tests).
DEFAULT_LEASE = 600.0


def _lease_seconds() -> float:
    try:
        v = float(os.environ.get("CKPT_ARCHIVE_LOCK_LEASE", DEFAULT_LEASE))
    except ValueError:
        return DEFAULT_LEASE
    return v if 1.0 <= v <= 86400.0 else DEFAULT_LEASE


    return True


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class LeaseLock:
    """One writer's hold on a repository's in-repository lock.

    Args:
        store: the repository's store (its ``write_bytes_once`` must be a conditional create).
        lease: seconds a ticket stays valid without a refresh (None: :data:`DEFAULT_LEASE` or the env).
        clock: the time source (tests).
    """

    def __init__(self, store, *, lease: float | None = None, clock=time.time):
        self.store = store
        self.lease = float(lease) if lease is not None else _lease_seconds()
        self.clock = clock
        self.owner = secrets.token_hex(8)
        self.seq: int | None = None
        self._since = 0.0
        self._last_ok = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- tickets ----------------------------------------------------------------------------------
    @staticmethod
    def _key(seq: int) -> str:
        return f"{LOCK_DIR}/{seq:012d}.json"

    def _tickets(self) -> list[int]:
        try:
            names = self.store.listdir(LOCK_DIR)
        except NotFound:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _TICKET.match(n)))

    def _read(self, seq: int) -> dict | None:
        try:
            if self.store.size(self._key(seq)) > 1 << 16:
                return {}  # not a lock record (and never read whole: a planted ticket of gigabytes)
            raw = self.store.read_bytes(self._key(seq))
        except NotFound:
            return None
        if len(raw) > 1 << 16:
            return {}
        try:
            info = json.loads(raw)
        except ValueError:
            return {}
        return info if isinstance(info, dict) else {}

    def _record(self, *, released: bool = False, now: float | None = None) -> bytes:
        now = self.clock() if now is None else now
        return json.dumps({"owner": self.owner, "host": host_name(), "pid": os.getpid(),
                           "since": _iso(self._since or now), "refreshed": now, "refreshed_at": _iso(now),
                           "lease": self.lease, "released": released}, indent=1).encode()

    def holder_state(self, info: dict | None) -> tuple[str, str]:
        """``(state, description)`` of a ticket: state is ``free`` (absent or released), ``stale`` or ``held``."""
        if info is None or info.get("released") is True:
            return "free", ""
        who = f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
        refreshed = info.get("refreshed")
        # [break] json reads NaN and Infinity: a NaN time compares False both ways and held the lock forever
        if not isinstance(refreshed, (int, float)) or isinstance(refreshed, bool) or not math.isfinite(refreshed):
            return "stale", f"an unreadable lock ticket ({who})"
        if info.get("host") == host_name() and pid_alive(info.get("pid")) is False:
            return "stale", f"{who}: that process is gone"
        # the holder's own lease (it refreshes every lease / 4): a reader configured with a shorter one must not
        # call a live holder stale; a value out of range falls back to this reader's
        lease = info.get("lease")
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not 1.0 <= lease <= 86400.0:
            lease = self.lease
        age = self.clock() - refreshed
        if -age > lease:  # refreshed further ahead than any clock skew the lease allows: nobody's lease
            return "stale", f"{who}: refreshed {-age:.0f} s in the future (lease {lease:.0f} s)"
        if age > lease:
            return "stale", f"{who}: not refreshed for {age:.0f} s (lease {lease:.0f} s)"
        return "held", f"{who}, refreshed {max(age, 0):.0f} s ago (lease {lease:.0f} s)"

    # -- acquire / check / release ------------------------------------------------------------------
    def acquire(self, wait: float = 0.0) -> list[str]:
        """Take the lock, waiting up to ``wait`` seconds for a live holder.

        Returns:
            notes on stale tickets taken over (for the caller's warnings).

        Raises:
            LockError: (exit 2) held by a live writer after ``wait`` seconds; says who.
            StoreError: the store refused the listing or the create.
        """
        deadline = time.monotonic() + max(0.0, wait)
        notes: list[str] = []
        while True:
            tickets = self._tickets()
            top = tickets[-1] if tickets else 0
            state, who = self.holder_state(self._read(top)) if top else ("free", "")
            if state == "held":
                if time.monotonic() >= deadline:
                    raise LockError(f"the repository is locked by another writer ({who}); retry later or pass "
                                    f"--wait SECONDS", where=f"{self.store.location}/{self._key(top)}")
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
                continue
            seq = top + 1
            if seq > MAX_SEQ:
                # [break] a ticket at the ceiling (planted or corrupt: no writer counts that far) is free or stale,
                # so nobody holds the lock: remove it and look again, instead of refusing every writer forever.
                # Safe: its holder, if one ever wrote it, lapsed and is fenced (refresh() and check() stop a
                # holder whose lease lapsed), and the ticket taken next is still one exclusive create.
                self._remove_ceiling_ticket(top, who)
                notes.append(f"removed lock ticket {self._key(top)}: past the last ticket a writer takes "
                             f"(planted or corrupt){', ' + who if who else ''}")
                continue
            self._since = written = self.clock()
            try:
                self.store.write_bytes_once(self._key(seq), self._record(now=written))
            except StoreError:
                if self.store.exists(self._key(seq)):
                    continue  # another writer took this ticket first: look again
                raise
            if state == "stale":
                notes.append(f"took over a stale lock ({who})")
            self.seq = seq
            self._last_ok = written  # what the others judge by: the time in the ticket, not when the write returned
            for old in tickets:  # never the top one: sequence numbers only grow
                if old < seq:
                    try:
                        self.store.remove(self._key(old))
                    except StoreError:
                        pass
            self._stop.clear()
            self._thread = threading.Thread(target=self._refresh_loop, name="ckpt-archive-lease", daemon=True)
            self._thread.start()
            return notes

    def _remove_ceiling_ticket(self, top: int, who: str) -> None:
        """Remove the free or stale ticket ``top`` at :data:`MAX_SEQ` (see :meth:`acquire`).

        Raises:
            LockError: (exit 2) the store refused the removal; says which file to remove by hand.
        """
        try:
            self.store.remove(self._key(top))
        except NotFound:
            pass  # another writer removed it first
        except StoreError as exc:
            raise LockError(f"lock ticket {top} is past the last a writer can take (planted or corrupt; {who or 'free'}) "
                            f"and could not be removed ({exc}); once no writer runs, remove {self._key(top)}",
                            where=f"{self.store.location}/{self._key(top)}") from None

    def _refresh_loop(self) -> None:
        period = max(0.2, self.lease / 4)
        while not self._stop.wait(period):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a failed refresh is judged by check() through the lapse
                continue

    def refresh(self) -> None:
        """Rewrite this holder's ticket with the current time (the lease renewal); notice a newer ticket.

        Raises:
            StoreError: the store refused the write.
        """
        if self.seq is None or self._lost:
            return
        lapsed = self.clock() - self._last_ok
        if lapsed > self.lease * 3 / 4:  # stopped near its lease's end (a paused VM; a refresh is due every lease / 4):
            # another writer may judge the ticket stale (clocks skewed by less than lease / 4) and hold the lock
            # now, and may have removed this ticket (acquire(), at the ceiling): never write it again
            self._lost = (f"this writer could not refresh its lease for {lapsed:.0f} s (three quarters of its "
                          f"lease of {self.lease:.0f} s)")
            return
        newer = [s for s in self._tickets() if s > self.seq]
        if newer:
            self._lost = (f"another writer took the lock (ticket {newer[-1]}) after this writer's lease of "
                          f"{self.lease:.0f} s lapsed")
            return
        written = self.clock()
        self.store.replace_bytes(self._key(self.seq), self._record(now=written))
        self._last_ok = written  # the ticket's time (a slow write must not lengthen this holder's view of its lease)

    def check(self) -> None:
        """Fencing: fail unless this writer still holds the lock (call before a commit or a deletion).

        Raises:
            LockError: (exit 2) the lock was lost (a newer ticket exists, or this writer's refreshes
                lapsed for longer than the lease); the step must not be carried out.
        """
        if self.seq is None:
            raise LockError("the repository lock is not held", where=self.store.location)
        if self._lost is None:
            # half the lease, not all of it: another writer may take over once a full lease has passed since the
            # ticket's last refresh, so a holder that checks at the last instant and then spends seconds
            # committing (a marker, a sweep) would overlap it. The margin is lease / 2 (minus clock skew).
            if self.clock() - self._last_ok > self.lease / 2:
                self._lost = (f"this writer could not refresh its lease for {self.clock() - self._last_ok:.0f} s "
                              f"(half its lease of {self.lease:.0f} s)")
            elif any(s > self.seq for s in self._tickets()):
                self._lost = "another writer took the lock after this writer's lease lapsed"
        if self._lost:
            raise LockError(f"lost the repository lock: {self._lost}; nothing more was committed or deleted "
                            f"(run the command again)", where=self.store.location)

    def release(self) -> None:
        """Mark this writer's ticket released (if it still holds it); stop refreshing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.seq is None:
            return
        try:
            if not any(s > self.seq for s in self._tickets()):  # (also after fencing itself: nobody took over)
                self.store.replace_bytes(self._key(self.seq), self._record(released=True))
        except StoreError:
            pass  # the lease runs out on its own
        finally:
            self.seq = None


class StoreWriterLock:
    """The writer lock of a repository on an object store: the machine's lock (an OS lock in the user's cache,
    so processes on one machine queue cheaply and a killed one frees it at once) and then the repository's
    own :class:`LeaseLock` (so two machines never both hold it). The interface of
    :class:`ckpt_archive.store.fs.WriterLock`, plus :meth:`check` (fencing).

    Args:
        local: the machine's lock (:class:`ckpt_archive.store.fs.WriterLock`).
        store: the repository's store (where the lease lives).
    """

    def __init__(self, local, store):
        self.local = local
        self.lease = LeaseLock(store)
        self.path = local.path
        self._held = False

    def acquire(self, timeout: float) -> bool:
        """Take both locks, waiting up to ``timeout`` seconds in all. True when held.

        Raises:
            what the machine's lock raises; StoreError: the store refused the lease's ticket.
        """
        start = time.monotonic()
        if not self.local.acquire(timeout):
            return False
        try:
            self.notes = self.lease.acquire(max(0.0, timeout - (time.monotonic() - start)))
        except LockError as exc:
            self.local.release()
            self._refused = exc
            return False
        except BaseException:
            self.local.release()
            raise
        self._held = True
        return True

    def read_owner(self, max_bytes: int = 1 << 16) -> bytes | None:
        """Who holds it: this machine's owner record, else the newest live lease ticket in the repository."""
        raw = self.local.read_owner(max_bytes)
        if raw is not None:
            return raw
        tickets = self.lease._tickets()
        if not tickets:
            return None
        info = self.lease._read(tickets[-1])
        if self.lease.holder_state(info)[0] != "held":
            return None
        return json.dumps({k: info.get(k) for k in ("pid", "host", "since")}).encode()

    def write_owner(self, data: bytes) -> None:
        self.local.write_owner(data)

    def check(self) -> None:
        """Fencing (:meth:`LeaseLock.check`): raise LockError if the repository's lock was lost."""
        if self._held:
            self.lease.check()

    def release(self) -> None:
        try:
            if self._held:
                self.lease.release()
        finally:
            self._held = False
            self.local.release()


__all__ = ["LeaseLock", "StoreWriterLock", "LOCK_DIR", "DEFAULT_LEASE"]
