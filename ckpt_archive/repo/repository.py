"""A repository: numbered generations, one writer lock, and the publish protocol.

The status rules (usable / copied / partial / damaged), the claim, the marker and the delete order are the
repository's one invariant and read best side by side here; how the writer lock is held (re-entrant, its
holder named, fencing) is :mod:`ckpt_archive.repo.lock`, and the lifecycle itself lives in
:mod:`ckpt_archive.repo.publish`.

Layout and ordering rules: docs/FORMAT.md. In short, a generation is written where no reader lists
it as usable (its number claimed by exclusive create), sealed (manifest), verified, trial-reloaded,
and only then published by writing ``USABLE.json`` last. Readers need no lock and list a generation
as usable only when its marker matches its manifest and names this location.

"This location" is compared by identity, not by spelling (:class:`~ckpt_archive.repo.place.Place`).
"""
from __future__ import annotations

import hashlib
import os
import re
import uuid
from typing import Any, ContextManager

from ckpt_archive import __version__

from ckpt_archive.errors import (CheckFailed, CkptArchiveError, FormatError, ImplausibleSize, IntegrityError,
                                ManifestInvalid, NewerFormatError, NoUsableGeneration, AllGenerationsDamaged, NotFound, StoreError, UnsafePath,
                                UsageError, CannotCheck)
from ckpt_archive.format import jsonio
from ckpt_archive.format.limits import MAX_MANIFEST_BYTES, MAX_SMALL_DOC_BYTES
from ckpt_archive.format.manifest import parse as parse_manifest
from ckpt_archive.format.times import iso, utcnow
from ckpt_archive.repo.generation import GEN_DIR, GEN_NAME, MAX_GENERATION, Generation, gen_key
from ckpt_archive.repo.lock import RepositoryLock
from ckpt_archive.repo.place import Place, canonical_url
from ckpt_archive.store.base import Store, open_store
from ckpt_archive.store.faults import NO_FAULTS, Faults
from ckpt_archive.store.fs import host_name

REPO_FILE = "repository.json"
MANIFEST = "manifest.json"
MARKER = "USABLE.json"
CLAIM = "CLAIM"
#: A deep check at a place failed (written by :func:`ckpt_archive.repo.publish.adopt`, never the marker).
CHECK_FAILED = "CHECK-FAILED.json"
REPO_FORMAT_VERSION = 1


def read_small(store: Store, key: str, limit: int) -> bytes:
    """THE read of a whole repository file held in memory (a manifest, a marker, ``repository.json``, a
    failed-check note, ``backup-state.json``): at most ``limit + 1`` bytes are read
    (:func:`ckpt_archive.format.limits.read_bounded`; docs/FORMAT.md, "Reading hostile archives").

    Args:
        store: the repository's store. key: the file. limit: the most bytes accepted
            (``limits.MAX_MANIFEST_BYTES``, ``limits.MAX_SMALL_DOC_BYTES``).

    Returns:
        the file's bytes.

    Raises:
        NotFound: absent. UnsafePath: not a regular file (exit 1).
        ImplausibleSize: (exit 1) larger than ``limit``, naming the file and the limit.
    """
    from ckpt_archive.format.limits import read_bounded

    with store.open_read(key) as fh:
        return read_bounded(fh, limit, where=key)


def read_json(store: Store, key: str, limit: int, *, where: str | None = None) -> Any:
    """:func:`read_small`, then the one strict JSON reader with the same size limit and a parse bounded at
    :data:`ckpt_archive.format.limits.MAX_SMALL_DOC_COST` (for documents other than manifests).

    Raises:
        as :func:`read_small`; InvalidJSON (exit 1; also a ``ValueError``): not strict JSON, too costly.
    """
    from ckpt_archive.format.limits import MAX_SMALL_DOC_COST

    return jsonio.loads(read_small(store, key, limit), where=where or key, max_bytes=limit,
                        max_cost=MAX_SMALL_DOC_COST)


class Repository:
    """A repository of generations at a local path or URL. Open with :meth:`open`.

    Args:
        store: where its bytes live.
        config: the parsed ``repository.json``.
        faults: the fault-injection hook the lifecycle calls at each step (:data:`NO_FAULTS`: none).
    """

    def __init__(self, store: Store, config: dict, faults: Faults = NO_FAULTS, *, trust: dict | None = None,
                 sign_key=None):
        self.store = store
        self.config = config
        self.faults = faults
        #: ``{fingerprint: public key}`` a generation must be signed by to be read (None: no requirement)
        self.trust = trust
        self._sign_key = sign_key  # a path, a loaded key, or None (then $CKPT_ARCHIVE_SIGN_KEY, read when signing)
        self._signer = None
        #: store keys met while listing for a cleanup (gc, prune, forget) whose path breaks the path rule
        #: (``generations/00000002/../x`` on an object store), each with why: skipped, never read or deleted
        self.unsafe_keys: list[str] = []
        self.place = Place.of(store)
        self._writer = RepositoryLock(store, self.place.location)

    # -- opening -------------------------------------------------------------------------------------
    @classmethod
    def open(cls, url: str | os.PathLike, *, create: bool = False, faults: Faults | None = None,
             key_file: str | os.PathLike | None = None, trust=None, sign_key=None,
             **store_options) -> "Repository":
        """Open (or with ``create=True``, create) a repository.

        Args:
            url: a local path or a URL (``s3://bucket/prefix``).
            create: create ``repository.json`` when absent.
            faults: the fault-injection hook; ``None`` reads the plan from ``CKPT_ARCHIVE_INJECT`` (once,
                here: this is the entry point every operation opens a repository through).
            key_file: the key file of an encrypted repository (None: ``$CKPT_ARCHIVE_KEY_FILE``); with
                ``create`` and no repository there yet, the new repository is encrypted with it.
            trust: public key files (or keys) a generation must be signed by to be read (None:
                ``$CKPT_ARCHIVE_TRUST``; neither: no signature required, a present one is still checked).
            sign_key: the Ed25519 private key file every generation published through this object is
                signed with (None: ``$CKPT_ARCHIVE_SIGN_KEY``).
            **store_options: for URL stores (``endpoint_url=``, ``storage_options=``).

        Returns:
            the open :class:`Repository`.

        Raises:
            NotFound: no ``repository.json`` there and ``create`` is false.
            UsageError: no repository there, ``url`` is a local ``PATH@GEN`` that does not exist, and ``PATH`` is a
                repository (a generation given to a command that takes a repository: the message names it).
            NewerFormatError: the repository was written by a newer format.
            StoreError: the store refused access.
            KeyRefused: (exit 2) encrypted and no key given, or the key does not open it.
            UsageError: a key or trust file is missing or malformed; ``key_file`` for a plain repository.
        """
        from ckpt_archive.repo import keys

        store = open_store(url, **store_options)
        if faults is None:
            faults = Faults.from_env()
        material, explicit = keys.key_material(key_file)
        trusted = keys.load_trust(trust)
        if store.exists(REPO_FILE):
            config = cls._read_config(store)
            return cls(keys.open_encrypted(store, config, material, explicit), config, faults, trust=trusted,
                       sign_key=sign_key)
        if not create:
            if store.exists(GEN_DIR):
                raise NotFound("repository.json is missing (a damaged or foreign repository?)", where=store.location)
            _refuse_a_generation_given_as_a_repository(url)
            raise NotFound("not a ckpt-archive repository (no repository.json)", where=store.location)
        config = {"format": "ckpt-archive-repository", "format_version": REPO_FORMAT_VERSION,
                  "id": uuid.uuid4().hex, "created": iso(utcnow()), "retention": None}
        if material is not None:
            config["encryption"] = keys.new_encryption(material, config["id"])
        try:
            # atomic like every other write (a temporary file, then linked to its name): a full disk or a
            # kill leaves no repository.json or a whole one, never a 0-byte or half file
            with store.write_new(REPO_FILE) as fh:
                fh.write(jsonio.dumps(config, indent=1, ensure_ascii=True))
        except StoreError:
            if not store.exists(REPO_FILE):
                raise  # not a concurrent creator: the store refused (no such bucket, access denied)
            # created concurrently by another writer: read theirs
        config = cls._read_config(store)
        return cls(keys.open_encrypted(store, config, material, explicit), config, faults, trust=trusted,
                   sign_key=sign_key)

    @staticmethod
    def _read_config(store: Store) -> dict:
        # InvalidJSON (a ManifestInvalid): "not valid JSON (...)", also for a duplicate key or NaN;
        # ImplausibleSize: larger than any repository.json (read no further)
        # A repository.json that breaks its rules is damage found (exit 1, naming the file), as every other
        # document of an archive that is not what it must be (tests/test_hostile_sizes.py's table).
        where = f"{store.location}/{REPO_FILE}"
        config = read_json(store, REPO_FILE, MAX_SMALL_DOC_BYTES, where=where)
        if not isinstance(config, dict) or config.get("format") != "ckpt-archive-repository":
            raise ManifestInvalid("not a ckpt-archive repository file", where=where)
        high = config.get("highest_generation")
        if high is not None and (not isinstance(high, int) or isinstance(high, bool)
                                 or not 0 <= high <= MAX_GENERATION):
            raise ManifestInvalid(f"highest_generation {high!r} is not a generation number "
                              f"(an integer from 0 to {MAX_GENERATION}); the file was damaged or edited",
                              where=where)
        v = config.get("format_version")
        if isinstance(v, int) and v > REPO_FORMAT_VERSION:
            raise NewerFormatError(f"written by format {v}, this reader knows up to {REPO_FORMAT_VERSION}",
                                   where=f"{store.location}/{REPO_FILE}")
        return config

    @property
    def location(self) -> str:
        """Where the repository is, by identity: the resolved real path, or the normalised URL (:class:`Place`)."""
        return self.place.location

    def set_default_retention(self, policy: dict | None) -> None:
        """Store a default retention policy in ``repository.json`` (atomic replace; hold the lock).

        ``repository.json`` is read again under the lock first: the copy read when this object was opened
        may predate another writer's change (a ``key change``: writing the old copy back would undo the
        rotation, and a user who then destroys the old key file could no longer open the repository).

        Raises:
            LockError: the lock was lost (fencing).
        """
        if self.locked:
            self.check_lock()
        self.config = self._read_config(self.store)
        self.config["retention"] = policy
        self.store.replace_bytes(REPO_FILE, jsonio.dumps(self.config, indent=1, ensure_ascii=True))

    # -- listing ---------------------------------------------------------------------------------------
    def numbers(self) -> list[int]:
        return sorted(int(n) for n in self.store.listdir(GEN_DIR) if GEN_NAME.match(n))

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
            raw = read_small(self.store, f"{key}/{MANIFEST}", MAX_MANIFEST_BYTES)
        except NotFound:
            return Generation(number, "partial", "manifest vanished (being deleted?)")
        except ImplausibleSize as exc:  # larger than any manifest a reader accepts: read no further
            return self._unreadable(number, names, str(exc), exc)
        except IntegrityError as exc:  # an encrypted manifest that fails its authentication
            return self._unreadable(number, names, f"manifest.json: {exc.message}", exc)
        sha = hashlib.sha256(raw).hexdigest()
        try:
            manifest = parse_manifest(raw, where=f"{key}/{MANIFEST}")
        except NewerFormatError as exc:  # another version's: judged by that version, not removed by this one
            return Generation(number, "damaged", str(exc), manifest_sha256=sha, error=exc)
        except (CheckFailed, FormatError) as exc:  # incl. UnsafePath, ImplausibleSize
            what = "empty manifest" if not raw else str(exc)
            return self._unreadable(number, names, what, exc, sha)
        if manifest.get("generation") != number:  # a folder copied or renamed under another number
            err = ManifestInvalid(f"the folder is generation {number} but its manifest says generation "
                                  f"{manifest.get('generation')!r}: a number always names one archive", where=key)
            return Generation(number, "damaged", str(err), manifest_sha256=sha, error=err)
        return self._published(number, key, names, manifest, sha)

    @staticmethod
    def _unreadable(number: int, names: set, why: str, exc: BaseException, sha: str | None = None) -> Generation:
        """A generation whose manifest cannot be read: ``damaged`` once published (its USABLE marker is there:
        evidence, kept), else ``partial`` -- never usable, a leftover of a pack or export that failed before
        its marker (an older version's seal could leave an empty or cut ``manifest.json`` on a full disk),
        which ``gc`` removes."""
        if MARKER in names:
            return Generation(number, "damaged", why, manifest_sha256=sha, error=exc)
        return Generation(number, "partial", f"never published (no USABLE marker) and its manifest cannot be read "
                          f"({why}): left by an interrupted write", manifest_sha256=sha, error=exc)

    def _published(self, number: int, key: str, names: set, manifest: dict, sha: str) -> Generation:
        """:meth:`generation`'s second half: a sealed manifest (sha256 ``sha``), judged by its marker and any
        failed-check note (no member is read)."""
        if MARKER not in names:
            return Generation(number, "partial", "sealed but never published (no USABLE marker)", manifest, None, sha)
        try:
            marker = read_json(self.store, f"{key}/{MARKER}", MAX_SMALL_DOC_BYTES)
        except NotFound:
            return Generation(number, "partial", "marker removed (being deleted?)", manifest, None, sha)
        except ImplausibleSize as exc:
            return Generation(number, "damaged", f"USABLE marker is not read: {exc.message}", manifest, None, sha)
        except IntegrityError as exc:  # an encrypted marker that fails its authentication
            return Generation(number, "damaged", f"USABLE marker: {exc.message}", manifest, None, sha, error=exc)
        except (UnicodeDecodeError, ValueError):
            return Generation(number, "damaged", "USABLE marker is not valid JSON", manifest, None, sha)
        if not isinstance(marker, dict) or marker.get("manifest_sha256") != sha:
            return Generation(number, "damaged", "manifest.json changed after it was published (sha256 differs "
                              "from the marker's)", manifest, marker if isinstance(marker, dict) else None, sha)
        signer = None
        if "signature" in marker:  # a present signature is always checked, trusted keys or not
            from ckpt_archive.format import signature

            try:
                signer = signature.check(marker["signature"], manifest_sha256=sha,
                                         archive_id=manifest.get("archive_id"), generation=number)
            except signature.SignatureProblem as exc:
                exc.where = f"{key}/{MARKER}"
                return Generation(number, "damaged", f"its signature is bad: {exc.message}", manifest, marker, sha,
                                  error=exc)
        if CHECK_FAILED in names:
            note = self._check_failed(key, sha)
            if note is not None:
                first = (note.get("problems") or [{}])[0]
                what = "deep check" if note.get("by") in (None, "adopt", "verify --deep") else \
                    f"check by `{note.get('by')}`"
                return Generation(number, "damaged", f"its {what} at {note.get('location')} failed "
                                  f"({note.get('when')}): {first.get('member') or first.get('field') or '-'}: "
                                  f"{first.get('reason')}; after repairing it, `ckpt-archive verify --deep "
                                  f"{self.location}@{number}` checks it again", manifest, marker, sha,
                                  check_failed=note, found_damaged_here=self.place.holds(marker))
        if not self.place.holds(marker):
            return Generation(number, "copied", f"trial-reloaded at {marker.get('location')}, not here (restore "
                              f"reads it, checking every byte; ckpt-archive adopt makes it usable here)",
                              manifest, marker, sha, signer=signer)
        return Generation(number, "usable", None, manifest, marker, sha, signer=signer)

    def _check_failed(self, key: str, sha: str) -> dict | None:
        """The failed-check note of this manifest (an unreadable note counts: the check did fail), or None."""
        try:
            note = read_json(self.store, f"{key}/{CHECK_FAILED}", MAX_SMALL_DOC_BYTES)
        except NotFound:
            return None
        except ImplausibleSize:
            return {"problems": [{"field": CHECK_FAILED, "reason": "a failed-check note larger than any note"}]}
        except (UnicodeDecodeError, ValueError):
            return {"problems": [{"field": CHECK_FAILED, "reason": "a failed-check note that is not valid JSON"}]}
        if not isinstance(note, dict):
            return {"problems": [{"field": CHECK_FAILED, "reason": "a failed-check note that is not an object"}]}
        return note if note.get("manifest_sha256") in (sha, None) else None

    def note_check_failed(self, gen: Generation, problems: list, *, by: str) -> str | None:
        """[issue 24: one status rule] Record that a reader's check of ``gen`` found it damaged here, so that
        every reader (``list``, ``@latest``, restore, load) treats it as damaged from now on
        (docs/FORMAT.md, "One status rule"): ``CHECK-FAILED.json`` beside the marker, as ``adopt`` writes it.

        Readers hold no lock, so the note is only ever *created* -- atomically and exclusively
        (:meth:`~ckpt_archive.store.base.Store.write_new`): it never replaces a note or anything else, and a
        note already there (another reader's) stays. Only a deep check that passes removes it, under the lock
        (``verify --deep``, ``adopt``: :func:`ckpt_archive.repo.publish.adopt`). A generation that is not
        ``usable`` or ``copied`` here, or already has a note, gets none.

        Args:
            gen: the generation as the reader resolved it (its ``manifest_sha256`` ties the note to that manifest).
            problems: what was found (:class:`~ckpt_archive.repo.reader.Problem` or ``{"member", "field",
                "reason"}``); the first 20 are kept. by: the command that found them (``verify``, ``restore``).

        Returns:
            None when recorded (or when no note applies), else one line saying why it could not be written
            (a read-only repository, a store refusing it): the caller reports it; the damage stays reported.
        """
        if gen.status not in ("usable", "copied") or gen.check_failed is not None or not gen.manifest_sha256:
            return None
        rows = [p.to_json() if hasattr(p, "to_json") else dict(p) for p in problems]
        if not rows:
            return None
        key = f"{gen.key}/{CHECK_FAILED}"
        doc = {"generation": gen.number, "manifest_sha256": gen.manifest_sha256, "location": self.location,
               **host_record(self.location), "by": by, "problems": rows[:20], "problem_count": len(rows)}
        try:
            if not self.store.exists(f"{gen.key}/{MARKER}"):
                return None  # removed meanwhile (prune, forget): nothing left to mark
            with self.store.write_new(key) as fh:
                fh.write(jsonio.dumps(doc, indent=1, ensure_ascii=True))
        except StoreError:
            return None if self._exists_quietly(key) else f"the failed check could not be recorded at {key}"
        except (OSError, CkptArchiveError) as exc:
            why = getattr(exc, "strerror", None) or getattr(exc, "message", None) or str(exc)
            return (f"the failed check could not be recorded in the repository ({why}); `ckpt-archive list` "
                    f"shows generation {gen.number} as {gen.status} until a writable check records it")
        return None

    def _exists_quietly(self, key: str) -> bool:
        try:
            return self.store.exists(key)
        except (OSError, CkptArchiveError):
            return False

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

    def resolve(self, spec: str | int = "latest", *, copied: bool = False) -> Generation:
        """Find a generation: ``"latest"`` (newest usable), a number, or ``"tag:NAME"`` (newest usable so tagged).

        A generation usable here whose check failed later (a recorded ``CHECK-FAILED.json``:
        :attr:`Generation.found_damaged_here`) is still what ``latest``/``tag:`` names: it is refused where it
        is read, naming the newest that verifies, so falling back to an older generation stays the user's
        choice (``--fallback``), never a silent one (docs/FORMAT.md, "One status rule").

        Args:
            spec: the selector.
            copied: also pick ``copied`` generations for ``latest``/``tag:`` (restore and load, which
                decode and check every byte anyway).

        Raises:
            NotFound: no such number (says which exist). NoUsableGeneration: nothing usable matches.
            UsageError: bad spec.
        """
        spec = str(spec)
        want = (lambda g: g.readable or g.found_damaged_here) if copied else (lambda g: g.usable or g.found_damaged_here)
        if spec.isdigit():
            try:
                return self.generation(int(spec))
            except NotFound:
                raise NotFound(f"no generation {int(spec)}; {self.existing_summary()}", where=self.location) from None
        if spec == "latest":
            gens = self.generations()
            picked = [g for g in gens if want(g)]
            if not picked:
                raise self.no_usable_error(gens)
            return picked[-1]
        if spec.startswith("tag:"):
            tag = spec[4:]
            gens = self.generations()
            tagged = [g for g in gens if want(g) and tag in g.tags]
            if not tagged:
                raise self._no_tagged_error(gens, tag)
            return tagged[-1]
        raise UsageError(f"bad generation {spec!r}: use a number, 'latest' or 'tag:NAME'")

    def existing_summary(self, gens: list[Generation] | None = None) -> str:
        """One line naming the generations that exist and their status (``@N`` errors list them)."""
        gens = self.generations() if gens is None else gens
        if not gens:
            return "the repository holds no generation yet"
        by: dict[str, list[int]] = {}
        for g in gens:
            by.setdefault(g.status, []).append(g.number)
        parts = []
        for status in ("usable", "copied", "partial", "damaged"):
            if status in by:
                parts.append(f"{status}: {_ranges(by[status])}")
        return "existing generations: " + "; ".join(parts)

    def no_usable_error(self, gens: list[Generation] | None = None) -> NoUsableGeneration:
        """The error for "no usable generation" (``@latest``, ``export --all-usable``), with its verdict: when
        every generation that could have been picked -- every published one; a ``partial`` generation never is --
        was found damaged (:attr:`Generation.found_wrong`), :class:`~ckpt_archive.errors.AllGenerationsDamaged`
        (exit 1, as ``verify``/``restore`` of each say); otherwise (no generation at all, only partial ones, one
        in a newer format, a ``copied`` one to adopt) :class:`~ckpt_archive.errors.NoUsableGeneration` (exit 2:
        nothing was found wrong)."""
        gens = self.generations() if gens is None else gens
        candidates = [g for g in gens if g.status != "partial"]
        if candidates and all(g.found_wrong for g in candidates):
            return AllGenerationsDamaged(f"{self._none_usable_reason(gens)}: every published generation is damaged "
                                         f"(`ckpt-archive list --all {self.location}` says why)", where=self.location)
        return NoUsableGeneration(self._none_usable_reason(gens), where=self.location)

    def _no_tagged_error(self, gens: list[Generation], tag: str) -> NoUsableGeneration:
        """:meth:`no_usable_error` for ``tag:NAME``: exit 1 when every published generation so tagged was found
        damaged, else exit 2 (none so tagged, or not judged here)."""
        candidates = [g for g in gens if g.status != "partial" and tag in g.tags]
        if candidates and all(g.found_wrong for g in candidates):  # [break] found wrong: exit 1
            return AllGenerationsDamaged(f"no usable generation tagged {tag!r}: every generation so tagged is damaged "
                                         f"({_ranges([g.number for g in candidates])}; `ckpt-archive list --all "
                                         f"{self.location}` says why)", where=self.location)
        return NoUsableGeneration(f"no usable generation tagged {tag!r}", where=self.location)

    def _none_usable_reason(self, gens: list[Generation] | None = None) -> str:
        gens = self.generations() if gens is None else gens
        if not gens:
            return "the repository holds no generation yet"
        text = f"no usable generation ({self.existing_summary(gens)})"
        if any(g.status == "copied" for g in gens):
            text += ("; copied generations were proven at another place: restore reads them, and "
                     f"`ckpt-archive adopt {self.location}` makes them usable here")
        return text

    # -- writer lock (ckpt_archive.repo.lock) -------------------------------------------------------------
    def lock(self, wait: float = 0) -> ContextManager[None]:
        """Hold the repository's single-writer lock (re-entrant for this object).

        The store gives the lock (:meth:`~ckpt_archive.store.base.Store.writer_lock`, through the file
        layer :mod:`ckpt_archive.store.fs`): local repositories lock ``REPO/.lock`` (``flock``: an OS lock
        the kernel releases when the holder dies, so a killed writer never leaves a lock behind); remote
        ones lock a file in the user's cache keyed by the URL (one writer per machine). The lock file is
        opened ``O_NOFOLLOW`` relative to its folder, never through a link. The holder's pid/host/time are
        written to ``.lock.owner`` (a fresh ``O_EXCL`` temporary file renamed over it) to say who holds it.
        Entered again while this object holds it (the publish lifecycle inside ``pack``'s lock), it just
        holds on.

        Args:
            wait: seconds to wait for another writer (0: fail at once).

        Raises:
            LockError: not obtained within ``wait`` seconds; says who holds it.
            ReadOnlyRepository: (a LockError) the repository is read-only here: the lock cannot be taken.
            LinkInRepository: ``.lock`` is a symbolic link (exit 2; nothing was written through it).
        """
        return self._writer.hold(wait)

    def check_lock(self) -> None:
        """Fencing: before a commit or a deletion, make sure this writer still holds the lock (a lease lock
        of an object store can be lost when its holder stalls past the lease; an OS lock cannot).

        Raises:
            LockError: (exit 2) the lock is not held or was lost; the step must not be carried out.
        """
        self._writer.check()

    # -- writing ---------------------------------------------------------------------------------------
    def claim_next(self) -> int:
        """Claim the next generation number by exclusive create of its CLAIM file.

        Numbers are never reused, even after ``forget``/``prune``/``gc`` removed the highest ones: the
        highest number ever about to be claimed is kept in ``repository.json`` (``highest_generation``),
        written before the claim, so a number always names one archive (exports and reports can rely on
        it). Call with the lock held.

        Raises:
            UsageError: the signing key (``sign_key``, ``$CKPT_ARCHIVE_SIGN_KEY``) is missing or not an Ed25519
                private key: checked before anything is claimed, so a bad key leaves no partial generation.
        """
        self.signer()
        if self.locked:  # fencing: repository.json is rewritten below (a lapsed writer must not clobber it)
            self.check_lock()
        try:
            self.config = self._read_config(self.store)
        except CkptArchiveError:
            pass
        high = self.config.get("highest_generation")
        high = high if isinstance(high, int) and not isinstance(high, bool) and high >= 0 else 0
        n = max((self.numbers() or [0])[-1], high) + 1
        for _ in range(1000):
            if n > MAX_GENERATION:
                raise CannotCheck(f"no generation number left: the next would be {n}, and a generation folder "
                                  f"holds 8 digits (up to {MAX_GENERATION}); pack into a new repository",
                                  where=self.location)
            # the high-water mark is written BEFORE the claim: a claim that then fails (and that gc
            # removes) can never hand its number out again
            self.config["highest_generation"] = n
            self.store.replace_bytes(REPO_FILE, jsonio.dumps(self.config, indent=1, ensure_ascii=True))
            if self.store.claim(f"{gen_key(n)}/{CLAIM}"):
                return n
            n += 1
        raise StoreError("could not claim a generation number", where=self.location)

    def signer(self):
        """The Ed25519 private key generations published here are signed with, or None (loaded once, when
        first needed: readers never read a signing key).

        Raises:
            UsageError: the key file is missing or not an Ed25519 private key.
        """
        if self._signer is None and (self._sign_key is not None or os.environ.get("CKPT_ARCHIVE_SIGN_KEY")):
            from ckpt_archive.repo import keys

            self._signer = (keys.load_signer(self._sign_key) if isinstance(self._sign_key, (str, os.PathLike))
                            or self._sign_key is None else self._sign_key)
        return self._signer

    @property
    def locked(self) -> bool:
        """True while this object holds the writer lock."""
        return self._writer.locked

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
        if "signature" not in marker:  # a carried signature (export, adopt) covers content, not place: kept
            signer = self.signer()
            if signer is not None:
                from ckpt_archive.format import signature

                marker["signature"] = signature.sign(signer, signature.statement(
                    manifest_sha256, archive_id, number, marker.get("trial_reload") or {}))
        identity = self.place.identity()
        if identity:
            marker["identity"] = identity
        self.faults.point("publish")
        self.check_lock()
        self.store.replace_bytes(f"{gen_key(number)}/{MARKER}", jsonio.dumps(marker, indent=1, ensure_ascii=True))
        return marker

    def write_manifest(self, number: int, raw: bytes, *, point: str | None = "seal-write") -> None:
        """Seal: put a generation's manifest in place atomically (``Store.write_new``: a fresh temporary name in
        the generation folder, fsync, link to ``manifest.json``, temporary name removed, folder fsynced).

        A failure part-way (a full disk) leaves no ``manifest.json`` at all, never an empty or cut one, so the
        generation stays ``partial`` and ``gc`` removes it, as pack's message says. Fault point ``point``
        (pack's ``seal-write``; export passes None) fires with half the bytes written.

        Raises:
            StoreError: a manifest is there already. InsufficientSpace: the disk is full. OSError.
        """
        half = len(raw) // 2
        with self.store.write_new(f"{gen_key(number)}/{MANIFEST}") as fh:
            fh.write(raw[:half])
            if point is not None:
                self.faults.point(point)
            fh.write(raw[half:])

    def remove_generation(self, number: int, *, sweep: bool = True):
        """Delete a generation in reverse publish order: marker, members, manifest, claim, folder; then
        (``sweep``) the shared objects it referenced that no remaining manifest references.

        The caller holds the lock and has decided the generation may go (retention, forget, gc, a
        withdrawn publish). A crash part-way leaves a ``partial`` generation, never a usable one with
        missing members; objects a crash leaves unreferenced are removed by ``gc``. A generation whose
        references are unknown (no manifest, or one that cannot be read) makes the sweep consider every
        object (:func:`ckpt_archive.repo.objects.sweep`).

        Args:
            number: the generation. sweep: False when the caller sweeps once for several removals
                (take :func:`ckpt_archive.repo.objects.refs_of` before removing).

        Returns:
            the :class:`ckpt_archive.repo.objects.SweepResult` with ``sweep``, else None.
        """
        from ckpt_archive.repo import objects

        refs = objects.refs_of(self, number) if sweep else None
        try:
            self._remove_generation(number)
        except KeyboardInterrupt as exc:
            if not getattr(exc, "ckpt_left", None):  # what Ctrl-C left, for the CLI (publish.note_interrupt)
                exc.ckpt_left = f"generation {number} of {self.location} left partial while being removed"
                exc.ckpt_cleanup = f"`ckpt-archive gc {self.location}` removes it"
            raise
        return objects.sweep(self, refs) if sweep else None

    def safe_listdir(self, key: str) -> list[str]:
        """``store.listdir(key)`` without the names whose key breaks the path rule (``..``, ``.``, a name
        holding a slash: stray keys an object store may hold, e.g. ``generations/00000002/../x``). Each
        one skipped is named in :attr:`unsafe_keys`; a cleanup goes on without reading or deleting it."""
        return self._split_listing(key)[0]

    def _split_listing(self, key: str) -> tuple[list[str], list[str]]:
        from ckpt_archive.format.paths import check_relpath

        safe, unsafe = [], []
        for name in self.store.listdir(key):
            full = f"{key}/{name}" if key else name
            try:
                if not name or "/" in name or "\\" in name:
                    raise UnsafePath(f"store key {full!r} is refused: not a plain name")
                check_relpath(full, what="store key")
            except UnsafePath as exc:
                unsafe.append(name)
                note = (f"skipped store key {full!r} at {self.location}: {exc.message}; never read or deleted "
                        f"through, remove it by hand")
                if note not in self.unsafe_keys:
                    self.unsafe_keys.append(note)
                continue
            safe.append(name)
        return safe, unsafe

    def _remove_generation(self, number: int) -> None:
        key = gen_key(number)
        self.faults.point("prune-before-marker-removal")
        if self.locked:
            self.check_lock()
        self.store.remove(f"{key}/{MARKER}")
        self.store.fsync_dir(key)  # durable where that means anything (a no-op on object stores)
        self.faults.point("prune-after-marker-removal")
        safe, unsafe = self._split_listing(key)
        names = [n for n in safe if n not in (MANIFEST, CLAIM)]
        for i, name in enumerate(sorted(names)):
            self.store.remove_prefix(f"{key}/{name}")
            if i == 0:
                self.faults.point("prune-mid-delete")
        self.store.remove(f"{key}/{MANIFEST}")
        self.store.remove(f"{key}/{CLAIM}")
        if not unsafe:  # a recursive delete of the folder would take an unsafe key with it: left alone
            self.store.remove_prefix(key)


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    out: list[list[int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def host_record(location: str) -> dict:
    return {"where": location, "host": host_name(), "when": iso(utcnow()), "tool_version": __version__}


def raise_if_problems(step: str, problems: list, number: int) -> None:
    if problems:
        first = problems[0]
        where = first.member or first.field
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise IntegrityError(f"{step} of generation {number} failed: {first.reason}{more}; the generation "
                             f"stays partial and earlier generations are untouched", where=where)


__all__ = ["Repository", "Generation", "Place", "canonical_url", "CheckFailed", "utcnow", "iso", "gen_key", "host_record",
           "read_small", "read_json"]


_GEN_SELECTOR = re.compile(r"^([0-9]+|latest|tag:[^/@]+)$", re.ASCII)


def _refuse_a_generation_given_as_a_repository(url: Any) -> None:
    """``ckpt-archive list r1@latest`` (a command that takes a repository, given a generation of one) said only
    "r1@latest: not a ckpt-archive repository" [issue 26]: name the repository it meant.

    Raises:
        UsageError: ``url`` is a local ``PATH@GEN`` that does not exist while ``PATH`` holds a repository.
    """
    from ckpt_archive.store.base import has_scheme

    spec = os.fspath(url) if isinstance(url, (str, os.PathLike)) else None
    if not spec or "@" not in spec or has_scheme(spec) or os.path.exists(spec):
        return
    head, _, tail = spec.rpartition("@")
    if head and _GEN_SELECTOR.match(tail) and os.path.isfile(os.path.join(head, REPO_FILE)):
        raise UsageError(f"a generation (@{tail}) of the repository {head}; this command takes a repository: give "
                         f"{head}", where=spec)
