"""A repository: numbered generations, one writer lock, and the publish protocol.

Layout and ordering rules: docs/FORMAT.md. In short, a generation is written where no reader lists
it as usable (its number claimed by exclusive create), sealed (manifest), verified, trial-reloaded,
and only then published by writing ``USABLE.json`` last. Readers need no lock and list a generation
as usable only when its marker matches its manifest and names this location.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import socket
import uuid
from typing import Iterator

from ckpt_archive import __version__

from ckpt_archive.errors import (CheckFailed, CkptArchiveError, FormatError, IntegrityError, LockError, ManifestInvalid,
                                NewerFormatError, NoUsableGeneration, NotFound, StoreError, UnsafePath, UsageError)
from ckpt_archive.format import jsonio
from ckpt_archive.format.manifest import parse as parse_manifest
from ckpt_archive.format.metrics import read_metrics
from ckpt_archive.store.base import Store, open_store
from ckpt_archive.store.faults import NO_FAULTS, Faults

REPO_FILE = "repository.json"
GEN_DIR = "generations"
MANIFEST = "manifest.json"
MARKER = "USABLE.json"
CLAIM = "CLAIM"
REPO_FORMAT_VERSION = 1
_GEN_RE = re.compile(r"^\d{8}$")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def parse_time(text: str | None) -> dt.datetime | None:
    if not text or not isinstance(text, str):
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:  # a hostile manifest's "created" is shown as unknown, never a crash
        return None


def gen_key(number: int) -> str:
    return f"{GEN_DIR}/{number:08d}"


@dataclasses.dataclass
class Generation:
    """One generation as a reader sees it.

    Attributes:
        number: the generation number (1, 2, ...).
        status: ``usable`` (marker matches, at this location), ``partial`` (no marker: interrupted or
            being deleted), ``copied`` (marker names another location; ``verify --deep`` here makes it
            usable), ``damaged`` (manifest or marker unreadable, or the manifest changed after publish).
        reason: why it is not usable (None when usable).
        manifest: the parsed manifest, or None.
        marker: the parsed marker, or None.
        manifest_sha256: sha256 of ``manifest.json`` as stored, or None.
    """

    number: int
    status: str
    reason: str | None = None
    manifest: dict | None = None
    marker: dict | None = None
    manifest_sha256: str | None = None
    error: CkptArchiveError | None = None

    @property
    def key(self) -> str:
        return gen_key(self.number)

    path = key

    @property
    def created(self) -> dt.datetime | None:
        return parse_time(self.manifest.get("created")) if self.manifest else None

    @property
    def step(self) -> int | None:
        return (self.manifest or {}).get("progress", {}).get("step")

    @property
    def tags(self) -> list[str]:
        return list((self.manifest or {}).get("tags", []))

    @property
    def metrics(self) -> dict:
        """The manifest's metrics as plain JSON values (old manifests' tagged values read here, once:
        :func:`ckpt_archive.format.metrics.read_metrics`)."""
        return read_metrics((self.manifest or {}).get("metrics"))

    @property
    def raw_bytes(self) -> int | None:
        return (self.manifest or {}).get("summary", {}).get("raw_bytes")

    @property
    def stored_bytes(self) -> int | None:
        return (self.manifest or {}).get("summary", {}).get("stored_bytes")

    @property
    def usable(self) -> bool:
        return self.status == "usable"

    def to_json(self) -> dict:
        created = self.created
        return {"generation": self.number, "status": self.status, "reason": self.reason, "step": self.step,
                "epoch": (self.manifest or {}).get("progress", {}).get("epoch"),
                "created": iso(created) if created else None, "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes, "tags": self.tags, "metrics": self.metrics,
                "archive_id": (self.manifest or {}).get("archive_id"),
                "source_format": (self.manifest or {}).get("source", {}).get("format")}


class Repository:
    """A repository of generations at a local path or URL. Open with :meth:`open`.

    Args:
        store: where its bytes live.
        config: the parsed ``repository.json``.
        faults: the fault-injection hook the lifecycle calls at each step (:data:`NO_FAULTS`: none).
    """

    def __init__(self, store: Store, config: dict, faults: Faults = NO_FAULTS):
        self.store = store
        self.config = config
        self.faults = faults
        self._lock_depth = 0

    # -- opening -------------------------------------------------------------------------------------
    @classmethod
    def open(cls, url: str | os.PathLike, *, create: bool = False, faults: Faults | None = None,
             **store_options) -> "Repository":
        """Open (or with ``create=True``, create) a repository.

        Args:
            url: a local path or a URL (``s3://bucket/prefix``).
            create: create ``repository.json`` when absent.
            faults: the fault-injection hook; ``None`` reads the plan from ``CKPT_ARCHIVE_INJECT`` (once,
                here: this is the entry point every operation opens a repository through).
            **store_options: for URL stores (``endpoint_url=``, ``storage_options=``).

        Returns:
            the open :class:`Repository`.

        Raises:
            NotFound: no ``repository.json`` there and ``create`` is false.
            NewerFormatError: the repository was written by a newer format.
            StoreError: the store refused access.
        """
        store = open_store(url, **store_options)
        if faults is None:
            faults = Faults.from_env()
        if store.exists(REPO_FILE):
            return cls(store, cls._read_config(store), faults)
        if not create:
            if store.exists(GEN_DIR):
                raise NotFound("repository.json is missing (a damaged or foreign repository?)", where=store.location)
            raise NotFound("not a ckpt-archive repository (no repository.json)", where=store.location)
        config = {"format": "ckpt-archive-repository", "format_version": REPO_FORMAT_VERSION,
                  "id": uuid.uuid4().hex, "created": iso(utcnow()), "retention": None}
        try:
            store.write_bytes_once(REPO_FILE, jsonio.dumps(config, indent=1, ensure_ascii=True))
        except StoreError:
            pass  # created concurrently by another writer: read theirs
        return cls(store, cls._read_config(store), faults)

    @staticmethod
    def _read_config(store: Store) -> dict:
        # InvalidJSON (a ManifestInvalid): "not valid JSON (...)", also for a duplicate key or NaN
        config = jsonio.loads(store.read_bytes(REPO_FILE), where=f"{store.location}/{REPO_FILE}")
        if not isinstance(config, dict) or config.get("format") != "ckpt-archive-repository":
            raise ManifestInvalid("not a ckpt-archive repository file", where=f"{store.location}/{REPO_FILE}")
        v = config.get("format_version")
        if isinstance(v, int) and v > REPO_FORMAT_VERSION:
            raise NewerFormatError(f"written by format {v}, this reader knows up to {REPO_FORMAT_VERSION}",
                                   where=f"{store.location}/{REPO_FILE}")
        return config

    @property
    def location(self) -> str:
        return self.store.location

    def set_default_retention(self, policy: dict | None) -> None:
        """Store a default retention policy in ``repository.json`` (atomic replace; hold the lock)."""
        self.config["retention"] = policy
        self.store.replace_bytes(REPO_FILE, jsonio.dumps(self.config, indent=1, ensure_ascii=True))

    # -- listing ---------------------------------------------------------------------------------------
    def numbers(self) -> list[int]:
        return sorted(int(n) for n in self.store.listdir(GEN_DIR) if _GEN_RE.match(n))

    def generation(self, number: int) -> Generation:
        """Read one generation's manifest and marker and decide its status (no member is read)."""
        key = gen_key(number)
        try:
            names = set(self.store.listdir(key))
        except UnsafePath as exc:  # a generation folder that is a symbolic link: never followed
            return Generation(number, "damaged", str(exc), error=exc)
        if not names and not self.store.exists(key):
            raise NotFound(f"no generation {number}", where=self.location)
        if MANIFEST not in names:
            if MARKER in names:
                # Deletion removes the marker first, so a marker without its manifest is damage, not an
                # interrupted write: keep it as evidence (gc leaves damaged generations alone).
                return Generation(number, "damaged", "manifest.json is missing although the generation was "
                                  "published (USABLE marker present)")
            why = "no manifest: interrupted before seal" if CLAIM in names else "no manifest (being deleted?)"
            return Generation(number, "partial", why)
        try:
            raw = self.store.read_bytes(f"{key}/{MANIFEST}")
        except NotFound:
            return Generation(number, "partial", "manifest vanished (being deleted?)")
        sha = hashlib.sha256(raw).hexdigest()
        try:
            manifest = parse_manifest(raw, where=f"{key}/{MANIFEST}")
        except (CheckFailed, FormatError, NewerFormatError) as exc:  # incl. UnsafePath, ImplausibleSize
            return Generation(number, "damaged", str(exc), manifest_sha256=sha, error=exc)
        if MARKER not in names:
            return Generation(number, "partial", "sealed but never published (no USABLE marker)", manifest, None, sha)
        try:
            marker = jsonio.loads(self.store.read_bytes(f"{key}/{MARKER}"), where=f"{key}/{MARKER}")
        except NotFound:
            return Generation(number, "partial", "marker removed (being deleted?)", manifest, None, sha)
        except (UnicodeDecodeError, ValueError):
            return Generation(number, "damaged", "USABLE marker is not valid JSON", manifest, None, sha)
        if not isinstance(marker, dict) or marker.get("manifest_sha256") != sha:
            return Generation(number, "damaged", "manifest.json changed after it was published (sha256 differs "
                              "from the marker's)", manifest, marker if isinstance(marker, dict) else None, sha)
        if marker.get("location") != self.location:
            return Generation(number, "copied", f"trial-reloaded at {marker.get('location')}, not here: run "
                              f"verify --deep to make it usable here", manifest, marker, sha)
        return Generation(number, "usable", None, manifest, marker, sha)

    def generations(self) -> list[Generation]:
        """All generations, oldest first, each with its status."""
        out = []
        for n in self.numbers():
            try:
                out.append(self.generation(n))
            except NotFound:
                continue  # deleted while listing
            except CheckFailed as exc:  # one bad generation never hides the others
                out.append(Generation(n, "damaged", str(exc), error=exc))
        return out

    def usable(self) -> list[Generation]:
        return [g for g in self.generations() if g.usable]

    def resolve(self, spec: str | int = "latest") -> Generation:
        """Find a generation: ``"latest"`` (newest usable), a number, or ``"tag:NAME"`` (newest usable so tagged).

        Raises:
            NotFound: no such number. NoUsableGeneration: nothing usable matches. UsageError: bad spec.
        """
        spec = str(spec)
        if spec.isdigit():
            return self.generation(int(spec))
        if spec == "latest":
            usable = self.usable()
            if not usable:
                raise NoUsableGeneration(self._none_usable_reason(), where=self.location)
            return usable[-1]
        if spec.startswith("tag:"):
            tag = spec[4:]
            tagged = [g for g in self.usable() if tag in g.tags]
            if not tagged:
                raise NoUsableGeneration(f"no usable generation tagged {tag!r}", where=self.location)
            return tagged[-1]
        raise UsageError(f"bad generation {spec!r}: use a number, 'latest' or 'tag:NAME'")

    def _none_usable_reason(self) -> str:
        gens = self.generations()
        if not gens:
            return "the repository holds no generation yet"
        parts = ", ".join(f"#{g.number} {g.status}" for g in gens[-5:])
        return f"no usable generation ({parts})"

    # -- writer lock -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, wait: float = 0) -> Iterator[None]:
        """Hold the repository's single-writer lock (re-entrant for this object).

        The store says which file to lock (:meth:`~ckpt_archive.store.base.Store.lock_file`): local
        repositories lock ``REPO/.lock`` (filelock: an OS lock the kernel releases when the holder
        dies, so a killed writer never leaves a lock behind); remote ones lock a file in the user's
        cache keyed by the URL (one writer per machine). The holder's pid/host/time are written to
        ``.lock.owner`` to say who holds it. Entered again while this object holds it (the publish
        lifecycle inside ``pack``'s lock), it just holds on.

        Args:
            wait: seconds to wait for another writer (0: fail at once).

        Raises:
            LockError: not obtained within ``wait`` seconds; says who holds it.
        """
        import filelock

        if self._lock_depth:
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
            return
        lock_path = self.store.lock_file()
        owner_path = lock_path.with_name(lock_path.name + ".owner")
        lock = filelock.FileLock(str(lock_path))
        try:
            lock.acquire(timeout=wait)
        except filelock.Timeout:
            holder = ""
            try:
                info = jsonio.loads(owner_path.read_bytes(), where=str(owner_path), max_bytes=1 << 16)
                if not isinstance(info, dict):
                    raise ValueError("not an object")
                alive = _pid_alive(info.get("pid")) if info.get("host") == socket.gethostname() else None
                holder = (f" by pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
                          + ("" if alive is not False else " (that process is gone: the OS lock is held by "
                             "another process, or the file system does not release locks; if no writer "
                             f"runs, remove {lock_path})"))
            except (OSError, ValueError):
                pass
            raise LockError(f"the repository is locked by another writer{holder}; retry later or pass "
                            f"--wait SECONDS", where=self.location) from None
        try:
            try:
                owner_path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                  "since": iso(utcnow())}))
            except OSError:
                pass
            self._lock_depth = 1
            yield
        finally:
            self._lock_depth = 0
            try:
                owner_path.unlink()
            except OSError:
                pass
            lock.release()

    # -- writing ---------------------------------------------------------------------------------------
    def claim_next(self) -> int:
        """Claim the next generation number by exclusive create of its CLAIM file.

        Numbers are never reused, even after ``forget``/``prune``/``gc`` removed the highest ones: the
        highest number ever about to be claimed is kept in ``repository.json`` (``highest_generation``),
        written before the claim, so a number always names one archive (exports and reports can rely on
        it). Call with the lock held.
        """
        try:
            self.config = self._read_config(self.store)
        except CkptArchiveError:
            pass
        high = self.config.get("highest_generation")
        high = high if isinstance(high, int) and not isinstance(high, bool) and high >= 0 else 0
        n = max((self.numbers() or [0])[-1], high) + 1
        for _ in range(1000):
            # the high-water mark is written BEFORE the claim: a claim that then fails (and that gc
            # removes) can never hand its number out again
            self.config["highest_generation"] = n
            self.store.replace_bytes(REPO_FILE, jsonio.dumps(self.config, indent=1, ensure_ascii=True))
            if self.store.claim(f"{gen_key(n)}/{CLAIM}"):
                return n
            n += 1
        raise StoreError("could not claim a generation number", where=self.location)

    @property
    def locked(self) -> bool:
        """True while this object holds the writer lock."""
        return self._lock_depth > 0

    def write_marker(self, number: int, manifest_sha256: str, archive_id: str, record: dict) -> dict:
        """Publish: write ``USABLE.json`` (the commit point). Only :mod:`ckpt_archive.repo.publish`
        calls this, with the lock held.

        Raises:
            RuntimeError: the lock is not held (a programming error: the marker is written under the lock).
        """
        if not self.locked:
            raise RuntimeError("write_marker needs the repository lock (use ckpt_archive.repo.publish)")
        marker = {"manifest_sha256": manifest_sha256, "archive_id": archive_id, "generation": number,
                  "location": self.location, **record}
        self.faults.point("publish")
        self.store.replace_bytes(f"{gen_key(number)}/{MARKER}", jsonio.dumps(marker, indent=1, ensure_ascii=True))
        return marker

    def remove_generation(self, number: int) -> None:
        """Delete a generation in reverse publish order: marker, members, manifest, claim, folder.

        The caller holds the lock and has decided the generation may go (retention, forget, gc).
        A crash part-way leaves a ``partial`` generation, never a usable one with missing members.
        """
        key = gen_key(number)
        self.faults.point("prune-before-marker-removal")
        self.store.remove(f"{key}/{MARKER}")
        self.store.fsync_dir(key)  # durable where that means anything (a no-op on object stores)
        self.faults.point("prune-after-marker-removal")
        names = [n for n in self.store.listdir(key) if n not in (MANIFEST, CLAIM)]
        for i, name in enumerate(sorted(names)):
            self.store.remove_prefix(f"{key}/{name}")
            if i == 0:
                self.faults.point("prune-mid-delete")
        self.store.remove(f"{key}/{MANIFEST}")
        self.store.remove(f"{key}/{CLAIM}")
        self.store.remove_prefix(key)


def _pid_alive(pid) -> bool | None:
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except (OverflowError, ValueError):  # not a pid at all (a hand-edited owner file)
        return None
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_record(location: str) -> dict:
    return {"where": location, "host": socket.gethostname(), "when": iso(utcnow()), "tool_version": __version__}


def raise_if_problems(step: str, problems: list, number: int) -> None:
    if problems:
        first = problems[0]
        where = first.member or first.field
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise IntegrityError(f"{step} of generation {number} failed: {first.reason}{more}; the generation "
                             f"stays partial and earlier generations are untouched", where=where)


__all__ = ["Repository", "Generation", "CheckFailed", "utcnow", "iso", "gen_key", "host_record"]
