"""THE publish lifecycle: the one way a generation becomes usable (docs/FORMAT.md, "Write order").

::

    claim -> members -> seal (manifest) -> verify (re-read) -> trial reload -> [before-publish hook]
          -> USABLE marker, last

always under the repository's writer lock (taken here; re-entrant, so a caller that already holds it,
like ``pack`` running retention afterwards or ``export`` copying several generations, keeps holding
it). Three callers, one path:

* ``pack`` (:mod:`ckpt_archive.ops.pack`): members written from a source, manifest sealed after them;
* ``export`` (:mod:`ckpt_archive.ops.export`): members copied from another repository, the manifest
  first (so a re-run recognises its own partial copy by archive id), re-read at the destination;
* adopting a copied generation (``verify --deep`` of a ``copied`` generation, :func:`adopt`): the
  members and manifest were put there by another tool; the deep check runs under the lock and the
  marker follows it.

What differs between pack and export is given as :class:`Steps` (how the members arrive, how the
manifest is sealed, how they are re-read); what is common (order, lock, fsync, trial reload, the hook,
the marker and its record) lives here once. Fault points keep the names each caller always had
(:class:`Points`); the repository's :class:`~ckpt_archive.store.faults.Faults` object fires them.

The before-publish hook is called with the :class:`Candidate` (sealed, verified, trial-reloaded, not yet
published) under the lock. It returns ``None`` to publish, or a reason (str) to withdraw: the generation
is then removed (marker never written, so it was never usable) and :class:`Withdrawn` is raised.
``backup`` decides through it whether the source changed while it was packed.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from ckpt_archive.errors import CannotCheck, CkptArchiveError
from ckpt_archive.format.manifest import sha256_hex
from ckpt_archive.format import jsonio
from ckpt_archive.repo.repository import (CHECK_FAILED, Generation, Repository, gen_key, host_record, iso,
                                          raise_if_problems, utcnow)

if TYPE_CHECKING:  # imported where a generation is re-read: every CLI command enters record_publishes()
    from ckpt_archive.repo.reader import ArchiveReader, Problem


@dataclasses.dataclass(frozen=True)
class Points:
    """The fault-injection point names a caller's lifecycle passes (``None``: no point there).

    Attributes:
        claim: after the number is claimed. sealed: after the manifest and members are written and
        their folder fsynced. verified: after the re-read. reloaded: after the trial reload.
        (``publish`` itself fires inside :meth:`Repository.write_marker`.)
    """

    claim: str | None
    sealed: str | None
    verified: str | None
    reloaded: str | None


PACK_POINTS = Points(claim="claim", sealed="after-seal", verified="after-verify", reloaded="after-trial-reload")
EXPORT_POINTS = Points(claim="export-claim", sealed="export-after-members", verified="export-after-verify",
                       reloaded="export-after-trial-reload")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A generation sealed, verified and trial-reloaded here, about to be published (what the hook sees).

    Attributes:
        repo: the repository (its lock is held). number: the generation number.
        manifest: the parsed manifest. manifest_sha256: sha256 of ``manifest.json`` as stored.
        trial_reload: the trial reload's counts (``tensors``, ``bytes``, ``members``).
    """

    repo: Repository
    number: int
    manifest: dict
    manifest_sha256: str
    trial_reload: dict


#: Called before the marker is written: ``None`` publishes, a reason (str) withdraws the generation.
BeforePublish = Callable[[Candidate], "str | None"]


def phase(progress, name: str, total: int | None = None) -> None:
    """Tell a progress callback that a new phase of the work starts (``write``, ``verify``, ``trial reload``,
    ``copy``, ``re-read``), with its size in bytes when known.

    A progress callback is any ``callable(nbytes)``; one that also has ``phase(name, total)`` (the CLI's
    bars) is told each phase, so a bar never sits at 100 % while the next phase runs. Library code calls
    this, never the method directly.
    """
    fn = getattr(progress, "phase", None)
    if callable(fn):
        fn(name, total)


def note_interrupt(exc: BaseException, left: str, cleanup: str | None) -> None:
    """Attach to a ``KeyboardInterrupt`` what the interrupted work left behind and the command that cleans
    it (``ckpt_left``, ``ckpt_cleanup``; the CLI prints them and exits 130). The first note wins: the
    innermost code knows best."""
    if not getattr(exc, "ckpt_left", None):
        exc.ckpt_left = left  # type: ignore[attr-defined]
        exc.ckpt_cleanup = cleanup  # type: ignore[attr-defined]


def note_complete(exc: BaseException, text: str) -> None:
    """Attach to a ``KeyboardInterrupt`` that the work asked for was done before it landed (``ckpt_complete``:
    e.g. restore's output renamed into place, complete): the CLI says so and exits 0, not 130."""
    if not getattr(exc, "ckpt_complete", None):
        exc.ckpt_complete = text  # type: ignore[attr-defined]


#: Where :func:`commit` records each generation it publishes, when a caller asked (:func:`record_publishes`).
_PUBLISH_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("ckpt_archive_publish_log", default=None)


@contextlib.contextmanager
def record_publishes() -> Iterator[list[tuple[str, int]]]:
    """Collect ``(location, number)`` of every generation published in this context, as it is published.

    A Ctrl-C can land after the marker was written (during retention, or while the result is printed):
    the CLI reads this list to say the generation was published instead of "interrupted" (exit 0).

    Returns:
        (as the context value) the list, appended to by :func:`commit` right after each marker is written.
    """
    log: list[tuple[str, int]] = []
    token = _PUBLISH_LOG.set(log)
    try:
        yield log
    finally:
        _PUBLISH_LOG.reset(token)


class Withdrawn(CannotCheck):
    """The before-publish hook withdrew the generation: it was removed, never published (exit 2).

    Attributes:
        number: the withdrawn generation's number. reason: the hook's reason.
        warnings, leftovers: what the operation had to say so far (``pack`` fills them in).
    """

    def __init__(self, number: int, reason: str, *, where: str | None = None):
        super().__init__(f"generation {number} withdrawn before publishing: {reason}", where=where)
        self.number = number
        self.reason = reason
        self.warnings: list[str] = []
        self.leftovers: list[str] = []


@dataclasses.dataclass
class Published:
    """A generation this lifecycle made usable.

    Attributes:
        number: its number. manifest: the parsed manifest. manifest_sha256: of ``manifest.json``.
        marker: the ``USABLE.json`` written. verified, trial_reload: the records the marker holds.
    """

    number: int
    manifest: dict
    manifest_sha256: str
    marker: dict
    verified: dict
    trial_reload: dict


class Steps(Protocol):
    """What a caller supplies to :func:`publish` (every method runs under the lock, in this order)."""

    def claim(self, repo: Repository) -> int:
        """Claim the generation number (exclusive create of its ``CLAIM``) and return it."""

    def write_members(self, repo: Repository, number: int) -> None:
        """Write (or copy) the members."""

    def seal(self, repo: Repository, number: int) -> tuple[dict, bytes]:
        """Make sure ``manifest.json`` is written; return it parsed and as stored."""

    def verify(self, repo: Repository, number: int, reader: ArchiveReader) -> dict:
        """Re-read what was written; raise :class:`~ckpt_archive.errors.IntegrityError` on a mismatch;
        return the marker's ``verified`` record."""

    def reloaded(self, problems: list[Problem], counts: dict) -> None:
        """Observe the trial reload's result (before a failure is raised)."""

    # Optional: ``trial_reload(reader, problems) -> counts`` replaces :func:`~ckpt_archive.repo.trial_reload.trial_reload`
    # (the distributed checkpointer: each rank reloads what it wrote, rank 0 gathers the results).

    def record(self, repo: Repository, counts: dict) -> dict:
        """The marker's ``trial_reload`` record and any extra fields (``{"trial_reload": ..., ...}``)."""


class Lifecycle:
    """One run of the lifecycle; :attr:`step` and :attr:`number` say how far it got (for error messages).

    Args:
        repo: the repository to publish in.
        steps: the caller's :class:`Steps`.
        points: the caller's fault point names.
        before_publish: the hook (see the module docstring), or None.
        wait: seconds to wait for the writer lock.
        jobs: decoder threads for the re-read and the trial reload.
        reload_where: the trial-reload step's name in error messages (``"trial reload"``).
        progress: a progress callback (raw bytes decoded by the trial reload; told each phase, see
            :func:`phase`), or None.
        cleanup: the command that removes what an interrupted run leaves (default ``ckpt-archive gc REPO``).
    """

    def __init__(self, repo: Repository, steps: Steps, points: Points, *, before_publish: BeforePublish | None = None,
                 wait: float = 0.0, jobs: int | None = None, reload_where: str = "trial reload", progress=None,
                 cleanup: str | None = None):
        self.repo = repo
        self.steps = steps
        self.points = points
        self.before_publish = before_publish
        self.wait = wait
        self.jobs = jobs
        self.reload_where = reload_where
        self.progress = progress
        self.cleanup = cleanup
        self.step = "claim"
        self.number: int | None = None
        self.published = False

    def _point(self, name: str | None) -> None:
        if name:
            self.repo.faults.point(name)

    def run(self) -> Published:
        """Run every step under the lock and publish.

        Returns:
            :class:`Published`.

        Raises:
            LockError: another writer. IntegrityError: verify or trial reload failed (the generation stays
            partial). Withdrawn: the hook withdrew it (removed). StoreError / OSError: the store failed.
            Any other error after the claim keeps its type and carries a note (``__notes__``) naming the step,
            the partial generation and ``ckpt-archive gc``; the tool's own errors say the same in their ``hint``.
        """
        try:
            return self._run()
        except KeyboardInterrupt as exc:
            if self.number is not None and not (self.published or self._marker_written()):
                note_interrupt(exc, f"generation {self.number} of {self.repo.location} left partial at step "
                               f"'{self.step}' (no reader lists it)",
                               self.cleanup or f"`ckpt-archive gc {self.repo.location}` removes it")
            raise
        except Withdrawn:
            raise  # removed by commit(): nothing left behind
        except (CkptArchiveError, OSError) as exc:
            if self.number is not None and isinstance(exc, CkptArchiveError):
                note = self.left_note()
                if "ckpt-archive gc" not in str(exc):
                    exc.hint = f"{exc.hint}; {note}" if exc.hint else note
            raise
        except Exception as exc:
            if self.number is None:
                raise
            # An unexpected error after the claim: never an anonymous "internal error" with a silent
            # partial generation. The error keeps its type (a Python caller sees what happened); a note
            # names the step, what was left and how to clean it, and the CLI prints the notes.
            exc.add_note(f"at step '{self.step}' of {self.repo.location}: {self.left_note()}")
            raise

    def left_note(self) -> str:
        """What a failure after the claim leaves, and the command that removes it."""
        cleanup = self.cleanup or f"`ckpt-archive gc {self.repo.location}` removes it"
        return (f"generation {self.number} left partial (`ckpt-archive list --all` shows it; earlier generations "
                f"untouched); {cleanup}")

    def _marker_written(self) -> bool:
        """Whether an interrupt during step 'publish' came after the marker was written (the generation is usable)."""
        if self.step != "publish" or self.number is None:
            return False
        try:
            return self.repo.generation(self.number).usable
        except Exception:  # noqa: BLE001 - only decides which note the interrupt carries
            return False

    def _run(self) -> Published:
        r, steps = self.repo, self.steps
        with r.lock(self.wait):
            self.step = "claim"
            self.number = number = steps.claim(r)
            key = gen_key(number)
            self._point(self.points.claim)
            self.step = "write members"
            steps.write_members(r, number)
            self.step = "seal"
            manifest, raw = steps.seal(r, number)
            r.store.fsync_dir(key)  # the members' and manifest's directory entries are durable too
            self._point(self.points.sealed)
            self.step = "verify"
            phase(self.progress, "verify")
            from ckpt_archive.repo.reader import ArchiveReader
            from ckpt_archive.repo.trial_reload import trial_reload

            reader = ArchiveReader(r.store, key, manifest, jobs=self.jobs)
            verified = steps.verify(r, number, reader)
            self._point(self.points.verified)
            self.step = "trial reload"
            phase(self.progress, "trial reload", (manifest.get("summary") or {}).get("raw_bytes"))
            problems: list[Problem] = []
            own_reload = getattr(steps, "trial_reload", None)  # optional Steps method (distributed saves)
            counts = (own_reload(reader, problems) if own_reload is not None
                      else trial_reload(reader, problems, on_bytes=self.progress))
            steps.reloaded(problems, counts)
            raise_if_problems(self.reload_where, problems, number)
            self._point(self.points.reloaded)
            self.step = "publish"
            sha = sha256_hex(raw)
            marker = commit(Candidate(r, number, manifest, sha, counts), {"verified": verified,
                            **steps.record(r, counts)}, self.before_publish)
            self.published = True
        return Published(number, manifest, sha, marker, verified, marker["trial_reload"])


def publish(repo: Repository, steps: Steps, points: Points, *, before_publish: BeforePublish | None = None,
            wait: float = 0.0, jobs: int | None = None) -> Published:
    """Run the lifecycle once (see :class:`Lifecycle` for a run whose progress the caller reads).

    Args:
        repo: the repository. steps: the caller's :class:`Steps`. points: its fault point names.
        before_publish: the hook, or None. wait: seconds for the lock. jobs: decoder threads.

    Returns:
        :class:`Published`.

    Raises:
        As :meth:`Lifecycle.run`.
    """
    return Lifecycle(repo, steps, points, before_publish=before_publish, wait=wait, jobs=jobs).run()


def commit(candidate: Candidate, record: dict, before_publish: BeforePublish | None = None) -> dict:
    """The last step: ask the hook, then write the marker (the commit point). Call with the lock held.

    Args:
        candidate: the checked generation.
        record: the marker's lifecycle records (``verified``, ``trial_reload``, provenance).
        before_publish: the hook, or None.

    Returns:
        the marker written.

    Raises:
        Withdrawn: the hook withdrew the generation; it was removed (reverse publish order).
        RuntimeError: the lock is not held (a programming error).
    """
    r = candidate.repo
    if not r.locked:
        raise RuntimeError("publishing needs the repository lock")
    if before_publish is not None:
        reason = before_publish(candidate)
        if reason:
            r.remove_generation(candidate.number)
            raise Withdrawn(candidate.number, str(reason), where=r.location)
    marker = r.write_marker(candidate.number, candidate.manifest_sha256, candidate.manifest["archive_id"], record)
    log = _PUBLISH_LOG.get()
    if log is not None:
        log.append((r.location, candidate.number))
    return marker


def adopt(repo: Repository, number: int, check: Callable[[Generation], tuple[list[Problem], dict | None]], *,
          wait: float = 0.0, before_publish: BeforePublish | None = None) -> tuple[Generation, list[Problem],
                                                                                   dict | None, bool]:
    """Make a ``copied`` generation (members and manifest put here by another tool) usable here.

    Under the lock: re-read the generation (it must still be ``copied``, or ``damaged`` by an earlier
    failed check here), run the deep ``check`` (the caller's: trial reload and layout checks), and only
    when it finds nothing wrong write the marker naming this location, with the check's record and where
    it was copied from. A check that finds problems writes ``CHECK-FAILED.json`` beside the marker (the
    generation is then ``damaged``: never listed as copied, never picked by ``@latest``); a later check
    that passes removes it.

    Args:
        repo: the repository. number: the generation.
        check: ``generation -> (problems, trial-reload counts)``; must decode every member (deep).
        wait: seconds for the lock. before_publish: the hook, or None.

    Returns:
        ``(generation as read under the lock, problems, counts, marked)``; ``marked`` is False when the
        check found problems, or the generation was no longer ``copied`` (then it was only checked).

    Raises:
        LockError: another writer holds the lock. Withdrawn: the hook withdrew it.
    """
    with repo.lock(wait):
        gen = repo.generation(number)
        problems, counts = check(gen)
        was_failed = gen.check_failed is not None
        if gen.status != "copied" and not was_failed:
            return gen, problems, counts, False
        note = f"{gen.key}/{CHECK_FAILED}"
        if problems and all(getattr(p, "local", False) for p in problems):
            return gen, problems, counts, False  # this machine's or this reader's (--trust): nothing to record
        if problems:
            recorded = [p for p in problems if not getattr(p, "local", False)]
            # Recorded beside the marker, never in it: list and @latest see the failure at once; only a
            # passing check here (this path, under the lock) removes the note.
            repo.store.replace_bytes(note, jsonio.dumps(
                {"generation": number, "manifest_sha256": gen.manifest_sha256, "location": repo.location,
                 **host_record(repo.location), "problems": [p.to_json() for p in recorded[:20]],
                 "problem_count": len(recorded)}, indent=1, ensure_ascii=True))
            return repo.generation(number), problems, counts, False
        if was_failed:
            repo.store.remove(note)
            gen = repo.generation(number)
            if gen.status != "copied":
                return gen, problems, counts, False
        trial = {**host_record(repo.location), "result": "ok", **(counts or {})}
        record = {"verified": {"when": iso(utcnow()), "result": "ok"}, "trial_reload": trial,
                  "copied_from": (gen.marker or {}).get("location")}
        if (gen.marker or {}).get("signature") is not None:  # a signature covers content, not place: kept
            record["signature"] = gen.marker["signature"]
        commit(Candidate(repo, number, gen.manifest, gen.manifest_sha256, counts or {}), record, before_publish)
    return gen, problems, counts, True


__all__ = ["publish", "adopt", "commit", "phase", "note_interrupt", "note_complete", "record_publishes", "Lifecycle", "Steps", "Points", "PACK_POINTS", "EXPORT_POINTS",
           "Candidate", "BeforePublish", "Withdrawn", "Published"]
