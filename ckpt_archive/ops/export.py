"""Export: copy usable generations to another destination and prove them recoverable *there*.

"Copied" is not "recoverable". For each generation, in this order (docs/export.md):

1. claim ``generations/N/CLAIM`` at DEST (the same number N as at the source);
2. write ``manifest.json`` (byte-identical, so its sha256 is the source's) -- first, so that a re-run
   recognises its own partial generation by ``archive_id``; harmless, because without the marker no
   reader lists the generation;
3. copy every member write-once, and every shared object it references (format 3) once per destination
   and atomically, skipping an object already there with the recorded size; then re-read each **from
   DEST**: size, sha256 of every chunk and of the whole stored file (:mod:`ckpt_archive.ops.export_copy`);
4. trial reload from DEST (the core's :func:`~ckpt_archive.repo.trial_reload.trial_reload` over
   DEST's store: decode every member, rebuild every tensor, compare raw sha256, dtype, shape, rebuild
   the tree);
5. write DEST's ``USABLE.json`` last, recording DEST as where the trial reload ran; then re-open DEST
   as a reader would and confirm the generation is listed ``usable``.

Resumable and idempotent: a re-run finds its own partial generation (same ``archive_id``), aborts the
multipart uploads a killed run left below it (invisible but billed parts), removes objects there that
are not part of the archive, keeps the members that are present and match, replaces any that do not,
copies the rest and finishes; shared objects a killed run left half-written are removed first, and an
object at DEST that is not what the manifest records is replaced, never trusted. A generation already
usable at DEST is not copied again. A DEST holding another archive under the same number is refused
(exit 2); nothing there is touched.

The recovery proof (endpoint, region, install and restore commands, fingerprints, trial-reload record)
is rendered by :mod:`ckpt_archive.ops.export_proof`.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import os
from typing import Any, Callable, Mapping

from ckpt_archive.errors import (CheckFailed, CkptArchiveError, ImplausibleSize, IntegrityError, NoUsableGeneration, NotFound,
                                 NotUsable, OutputExists, UsageError)
from ckpt_archive.ops.export_copy import (SharedCopies, StoredFile, check_at, clean_objects,
                                          copy_file, files_of, place_object, recheck_object, stored_digest)
from ckpt_archive.ops.export_proof import (endpoint_for, fingerprints, install_commands, read_last_check, region_for,
                                           render_markdown, restore_command, verify_command, write_report)

def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclasses.dataclass
class Check:
    """One check and its result, for the recovery proof."""

    name: str
    ok: bool
    detail: str = ""
    member: str | None = None

    def to_json(self) -> dict:
        return {"check": self.name, "result": "ok" if self.ok else "failed", "detail": self.detail,
                "member": self.member}


@dataclasses.dataclass
class ExportedGeneration:
    """What happened to one generation.

    Attributes:
        generation: its number (the same at the source and at DEST).
        archive_id: the archive's uuid (from the manifest).
        step, epoch: training progress recorded in the manifest (None when not given).
        status: ``exported`` (copied now and proven), ``resumed`` (a partial copy was finished),
            ``already-usable`` (DEST already held it, usable there; nothing copied).
        members: one dict per stored file at DEST: ``key``, ``member``, ``bytes``, ``sha256``,
            ``action`` (``copied`` | ``present`` | ``replaced`` | ``kept``), and ``object`` (the fingerprint
            of a shared object, else None).
        bytes_copied: stored bytes sent to DEST now.
        bytes_skipped: stored bytes this generation holds that were not copied because DEST held them: the
            shared objects it references that were there and the files an interrupted run had copied
            (re-read there all the same), or all of its stored bytes when the whole generation was already
            usable there (``already-usable``).
        checks: every check made, in order.
        marker: DEST's marker (dict) once written (its ``trial_reload`` is the trial-reload record).
        fingerprints: archive id, manifest sha256, every source file's sha256
            (:func:`~ckpt_archive.ops.export_proof.fingerprints`).
        cleaned: what this run removed at DEST that a killed run had left below this generation
            (``{"aborted_uploads": [keys], "removed": [keys]}``).
    """

    generation: int
    archive_id: str
    step: int | None
    epoch: int | None
    status: str = "exported"
    members: list[dict] = dataclasses.field(default_factory=list)
    bytes_copied: int = 0
    bytes_skipped: int = 0
    checks: list[Check] = dataclasses.field(default_factory=list)
    marker: dict | None = None
    fingerprints: dict | None = None
    cleaned: dict = dataclasses.field(default_factory=lambda: {"aborted_uploads": [], "removed": []})

    def to_json(self) -> dict:
        return {"generation": self.generation, "archive_id": self.archive_id, "step": self.step,
                "epoch": self.epoch, "status": self.status, "bytes_copied": self.bytes_copied,
                "bytes_skipped": self.bytes_skipped, "objects": self.members,
                "checks": [c.to_json() for c in self.checks],
                "marker": self.marker, "fingerprints": self.fingerprints,
                "trial_reload": (self.marker or {}).get("trial_reload"), "cleaned": self.cleaned}


@dataclasses.dataclass
class ExportResult:
    """The recovery proof of one export.

    Attributes:
        source: the source repository's location; destination: DEST's location.
        generations: per generation, oldest first.
        bytes_copied: stored bytes sent to DEST in this run (each stored file counted once).
        bytes_skipped: stored bytes not sent because DEST held them before this run (shared objects, whole
            generations already usable there), each stored file counted once (:func:`run_totals`).
        restore_command: the exact command that restores the newest exported generation on a new machine
            (with ``AWS_ENDPOINT_URL=`` when DEST was reached through a custom endpoint).
        verify_command: the command that re-proves it there.
        command: the command line that ran (when the CLI ran it).
        started, finished: ISO-8601 UTC.
        endpoint_url: the S3 endpoint DEST was reached through (``--endpoint-url`` or the environment's).
        region: the region botocore used for DEST, when known.
        install_commands: how to install exactly this code on the next machine.
        resume_check: the last resume check archived to the source repository (``check-resume``, ``demo``):
            ``kind``, ``created``, ``passed``, ``report``, ``picture`` (None when that file is not here),
            ``generation`` (:func:`~ckpt_archive.ops.export_proof.read_last_check`); the proof links its
            picture. None when there is none.
    """

    source: str
    destination: str
    generations: list[ExportedGeneration]
    bytes_copied: int
    restore_command: str
    verify_command: str
    command: str | None
    started: str
    finished: str
    endpoint_url: str | None = None
    region: str | None = None
    install_commands: list[str] = dataclasses.field(default_factory=list)
    bytes_skipped: int = 0
    resume_check: dict | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for g in self.generations for c in g.checks)

    def to_json(self) -> dict:
        return {"ok": self.ok, "command": self.command, "source": self.source, "destination": self.destination,
                "endpoint_url": self.endpoint_url, "region": self.region, "started": self.started,
                "finished": self.finished, "bytes_copied": self.bytes_copied,
                "bytes_skipped": self.bytes_skipped,
                "generations": [g.to_json() for g in self.generations],
                "install_commands": self.install_commands, "restore_command": self.restore_command,
                "verify_command": self.verify_command, "resume_check": self.resume_check}

    def to_markdown(self) -> str:
        return render_markdown(self)


# ------------------------------------------------------------------------------------------------
# selection
# ------------------------------------------------------------------------------------------------
def select_generations(repo, generations: Any = None) -> list:
    """Pick the source generations to export; every one must be usable at the source.

    Args:
        repo: the source :class:`~ckpt_archive.repo.repository.Repository`.
        generations: ``None`` or ``"latest"`` (newest usable), ``"all"`` (every usable one),
            ``"latest:N"`` (the N newest usable), a number (int or digits), ``"tag:NAME"``, or a list of
            numbers.

    Returns:
        usable :class:`~ckpt_archive.repo.repository.Generation` objects, oldest first.

    Raises:
        NoUsableGeneration: nothing usable matches, or a named generation is not usable at the source (exit 2;
            AllGenerationsDamaged, exit 1: every published generation is damaged). IntegrityError: a named
            generation is damaged (exit 1).
        NotFound: a named generation does not exist. UsageError: a malformed selection.
    """
    if generations is None:
        generations = "latest"
    if isinstance(generations, (list, tuple)):
        picked = [_usable_one(repo, str(n)) for n in generations]
    elif isinstance(generations, int) or (isinstance(generations, str) and generations.isdigit()):
        picked = [_usable_one(repo, str(generations))]
    elif generations in ("all", "all-usable", "all_usable"):
        picked = repo.usable()
        if not picked:
            raise repo.no_usable_error()
    elif isinstance(generations, str) and generations.startswith("latest:"):
        try:
            n = int(generations.split(":", 1)[1])
        except ValueError:
            raise UsageError(f"bad selection {generations!r}: use latest:N with N >= 1") from None
        if n < 1:
            raise UsageError(f"bad selection {generations!r}: use latest:N with N >= 1")
        usable = repo.usable()
        if not usable:
            raise repo.no_usable_error()
        picked = usable[-n:]
    elif isinstance(generations, str):
        picked = [_usable_one(repo, generations)]
    else:
        raise UsageError(f"bad generation selection {generations!r}")
    by_number = {g.number: g for g in picked}
    return [by_number[n] for n in sorted(by_number)]


def _usable_one(repo, spec: str):
    """The usable generation ``spec`` names. Refused otherwise, with the verdict ``verify`` and ``restore`` of
    it give: damaged (found wrong) exit 1; partial, in a newer format or copied (adopt it first) exit 2."""
    g = repo.resolve(spec)
    if not g.usable:
        from ckpt_archive.ops.common import status_words

        why = f"generation {g.number} is {status_words(g)} at the source; only usable generations are exported"
        if g.found_wrong:  # [break] exit 1 as verify/restore of the same damage, not 2
            raise IntegrityError(f"{why} (`ckpt-archive verify {repo.location}@{g.number}` lists what is wrong)",
                                 where=repo.location)
        raise NoUsableGeneration(why, where=repo.location)
    return g


# ------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------
def _check_destination(src, dest) -> None:
    """Refuse a destination that is empty, or that is/contains/lies inside the source repository."""
    import os
    from pathlib import Path

    from ckpt_archive.store.base import has_scheme

    text = os.fspath(dest).strip() if dest is not None else ""
    if not text:
        raise UsageError("empty destination: give a folder or a URL such as s3://bucket/prefix")
    local_root = src.store.local_path("")
    if has_scheme(text) or local_root is None:
        return
    real = Path(os.path.realpath(Path(text).expanduser()))
    root = Path(os.path.realpath(local_root))
    if real == root or root in real.parents or real in root.parents:
        raise UsageError(f"the destination must lie outside the source repository ({root})", where=text)


def _open_destination(src, dest, to_key_file, to_plain: bool, sign_key, options: dict):
    """DEST opened (created if absent) with its own key (docs/keys.md, "Export"): ``to_key_file``; else, for an
    encrypted source, ``$CKPT_ARCHIVE_KEY_FILE`` unless ``to_plain``. An encrypted source is never copied
    in the clear unasked, and a plain DEST is never given a key it would ignore.

    Raises:
        UsageError: ``to_plain`` with ``to_key_file``; an encrypted source with neither a key for DEST nor
            ``to_plain``; a key for a DEST that exists unencrypted. KeyRefused: (exit 2) DEST is encrypted
            and no key given for it, or the key does not open it.
    """
    from ckpt_archive.format.crypto import KeyRefused
    from ckpt_archive.repo.keys import ENV_KEY_FILE
    from ckpt_archive.repo.repository import Repository

    if to_plain and to_key_file is not None:
        raise UsageError("give --to-plain or --to-key-file, not both")
    key = to_key_file
    if key is None and not to_plain and getattr(src.store, "encrypted", False):
        key = os.environ.get(ENV_KEY_FILE) or None
        if key is None:
            raise UsageError(f"{src.location} is encrypted: give the destination a key (--to-key-file PATH, "
                             f"to_key_file=) or ask for a copy in the clear (--to-plain, to_plain=True)")
    if key is not None:
        try:
            probe = Repository.open(dest, key_file=False, **options)
        except (NotFound, KeyRefused):
            pass  # absent (created below) or encrypted (opened with the key below)
        else:
            raise UsageError(f"the destination {probe.location} is not encrypted: pass --to-plain (to_plain=True) "
                             f"to write these generations there in the clear, or export to a new destination")
    try:
        return Repository.open(dest, create=True, key_file=key if key is not None else False, sign_key=sign_key,
                               **options)
    except KeyRefused as exc:
        why = "is encrypted" if key is None else f"refuses the key: {exc.message}"
        raise KeyRefused(f"the destination {why}; give its key with --to-key-file PATH (to_key_file=)",
                         where=exc.where) from None


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """What :func:`export` copies and how DEST is written (``ckpt-archive export``'s options, one name each).

    Attributes:
        generations: which usable generations (see :func:`select_generations`); default the newest.
        report: write the recovery proof to this file (Markdown, or JSON with ``report_format="json"``).
        report_format: ``"markdown"`` or ``"json"``.
        command: the command line to record in the proof.
        to_key_file: DEST's key file: a new DEST is created encrypted with it, an encrypted one is opened
            with it (a plain source exported with it: an encrypted copy). None: a plain source gives a plain
            DEST; an encrypted source gives a DEST encrypted with ``$CKPT_ARCHIVE_KEY_FILE``, and without
            that variable is refused unless ``to_plain`` (docs/keys.md, "Export").
        to_plain: write DEST in the clear from an encrypted source (asked for, never the default: a copy
            for a bucket must not lose its encryption silently).
        sign_key: sign each generation published at DEST that carries no signature from the source (a
            source's signature covers content, not place: it travels unchanged). None:
            ``$CKPT_ARCHIVE_SIGN_KEY``.

    Example:
        >>> ExportOptions(generations="all", to_plain=True).generations
        'all'
    """

    generations: Any = None
    report: str | os.PathLike | None = None
    report_format: str = "markdown"
    command: str | None = None
    to_key_file: str | os.PathLike | None = None
    to_plain: bool = False
    sign_key: str | os.PathLike | None = None


def export(repo, dest, options: ExportOptions | None = None, *, wait: float = 0,
           on_bytes: Callable[[int], None] | None = None, on_generation: Callable[[int, int, int], None] | None = None,
           store_options: Mapping[str, Any] | None = None,
           dest_store_options: Mapping[str, Any] | None = None) -> ExportResult:
    """Copy usable generations to ``dest``, verify the copy there, trial-reload it there, mark it usable.

    Args:
        repo: the source repository (path, URL, or an open :class:`~ckpt_archive.repo.repository.Repository`).
        dest: the destination: a local path or an fsspec URL (``s3://bucket/prefix``). Its
            ``repository.json`` is created if absent.
        options: :class:`ExportOptions`: which generations, the proof's file, DEST's key and signing key.
        wait: seconds to wait for DEST's writer lock (as ``wait=`` of every operation that writes).
        on_bytes: progress callback, called with stored bytes copied to DEST, then re-read, then raw bytes
            decoded by the trial reload; one with ``phase(name, total)`` is told each phase.
        on_generation: called ``(generation, index, count)`` when a generation starts.
        store_options: for a URL source repository, as in every operation
            (``{"endpoint_url": ..., "storage_options": {...}}``; :func:`~ckpt_archive.ops.common.open_repo`).
        dest_store_options: the same mapping for DEST: ``endpoint_url`` (an S3-compatible endpoint, overrides
            ``AWS_ENDPOINT_URL``; recorded in the proof) and ``storage_options`` (extra fsspec options, e.g.
            ``{"s3_additional_kwargs": {"ServerSideEncryption": "aws:kms"}}``).

    Returns:
        :class:`ExportResult`, the recovery proof.

    Raises:
        NoUsableGeneration / NotFound: nothing to export at the source.
        OutputExists: DEST holds another archive (or a partial of unknown origin) at a generation number.
        IntegrityError: a member's bytes at the source or at DEST do not match the manifest, or the trial
            reload at DEST failed (names the member); DEST's marker is then not written.
        StoreError: DEST refused access (credentials, permissions, network).
        LockError: another writer holds DEST.
        TypeError: an unknown keyword argument or store option (``lock_wait`` is ``wait``; ``endpoint_url`` and
            ``storage_options`` go in ``dest_store_options``; ``generations=`` and the other options go in
            :class:`ExportOptions`), or an options field of the wrong type.

    Example:
        >>> import os, torch, ckpt_archive, tempfile
        >>> src, dest = tempfile.mkdtemp(), os.path.join(tempfile.mkdtemp(), "offsite")
        >>> _ = ckpt_archive.pack({"w": torch.ones(2)}, src)
        >>> proof = ckpt_archive.export(src, dest, ckpt_archive.ExportOptions(generations="all"))
        >>> proof.ok, [(g.generation, g.status) for g in proof.generations]
        (True, [(1, 'exported')])
    """
    from ckpt_archive.ops.common import take_options

    o = take_options(options, ExportOptions, "export")
    generations, report, report_format, command = o.generations, o.report, o.report_format, o.command
    to_key_file, to_plain, sign_key = o.to_key_file, o.to_plain, o.sign_key
    started = _now()
    if report is not None:  # before any copy, not after it: a FIFO or device there is not ours to replace
        from ckpt_archive.ops.common import refuse_special_output

        refuse_special_output(report, option="--report")
    from ckpt_archive.ops.common import checked_store_options, open_repo

    src = open_repo(repo, store_options)
    picked = select_generations(src, generations)
    from ckpt_archive.ops.common import check_trust

    for g in picked:  # --trust: an unsigned or foreign-signed generation is refused before DEST is touched
        check_trust(src, g)
    _check_destination(src, dest)
    dst = _open_destination(src, dest, to_key_file, to_plain, sign_key, checked_store_options(dest_store_options))
    endpoint_url = (dest_store_options or {}).get("endpoint_url")
    if dst.location == src.location:
        raise UsageError(f"source and destination are the same repository ({src.location})")
    dst.signer()  # a bad --sign-key is refused before any generation is copied (UsageError)
    with dst.lock(wait=wait):
        done = _export_all(src, dst, picked, on_bytes, on_generation)
    endpoint, region = endpoint_for(dst.location, endpoint_url), region_for(dst.location)
    encrypted = "encryption" in dst.config
    copied, skipped = run_totals(done)
    result = ExportResult(
        source=src.location, destination=dst.location, generations=done,
        bytes_copied=copied, bytes_skipped=skipped,
        restore_command=restore_command(dst.location, picked[-1], endpoint, region, encrypted=encrypted),
        verify_command=verify_command(dst.location, picked[-1].number, endpoint, region, encrypted=encrypted,
                                      signer=picked[-1].signer),
        command=command, started=started, finished=_now(), endpoint_url=endpoint, region=region,
        install_commands=install_commands("://" in dst.location), resume_check=read_last_check(src))
    if report is not None:
        write_report(result, report, report_format)
    return result


def _export_all(src, dst, picked: list, on_bytes, on_generation) -> list[ExportedGeneration]:
    """Export each of ``picked`` in order under DEST's lock (held by the caller), objects shared between them
    copied once. A failure that comes from the source having moved on (a generation forgotten or rewritten
    meanwhile) is said so; an interrupt notes the partial generation left at DEST.

    Raises:
        CheckFailed / NotFound: as :func:`_export_one`. KeyboardInterrupt: noted, re-raised.
    """
    from ckpt_archive.repo.publish import note_interrupt

    again = f"run the same export again to resume (it cleans what it left), or `ckpt-archive gc {dst.location}`"
    shared = SharedCopies()
    done: list[ExportedGeneration] = []
    for i, g in enumerate(picked):
        if on_generation:
            on_generation(g.number, i, len(picked))
        try:
            done.append(_export_one(src, dst, g, on_bytes=on_bytes, cleanup=again, shared=shared))
        except (CheckFailed, NotFound) as exc:
            _raise_if_source_moved_on(src, g, exc, dst.location, again)
            raise
        except KeyboardInterrupt as exc:
            note_interrupt(exc, f"generation {g.number} at {dst.location} left partial (no reader lists it)", again)
            raise
    return done


def run_totals(done: list[ExportedGeneration]) -> tuple[int, int]:
    """(bytes copied, bytes skipped) of a whole run, each stored file counted once: a shared object that
    several generations reference is copied (or found at DEST) once per run, and an object this run copied
    for one generation was not "already at the destination" for the next. Skipped: the files DEST held
    before the run (re-read there all the same); the manifest and marker are not counted."""
    from ckpt_archive.repo.repository import MANIFEST, MARKER

    action: dict[str, tuple[str, int]] = {}
    for g in done:
        for m in g.members:
            key, nbytes = m["key"], m.get("bytes")
            if nbytes is None or key.endswith((f"/{MANIFEST}", f"/{MARKER}")):
                continue
            copied = m["action"] in ("copied", "replaced")
            if key not in action or (copied and action[key][0] != "copied"):
                action[key] = ("copied" if copied else "skipped", nbytes)
    copied = sum(n for what, n in action.values() if what == "copied")
    return copied, sum(n for what, n in action.values() if what == "skipped")


def _raise_if_source_moved_on(src, g, exc, dst_location: str, again: str) -> None:
    """A source file missing or changed while its generation was being exported: if that generation is no
    longer the usable one that was picked (forget, prune or a Checkpointer's retention removed it
    meanwhile; export reads the source without its writer lock, so a training run is never stalled by
    an hour-long upload), this is not damage found at the source but an export that could not be
    carried out (exit 2); nothing was published at DEST.

    Raises:
        NotUsable: the source generation was removed or changed meanwhile.
    """
    try:
        now = src.generation(g.number)
    except CkptArchiveError:
        now = None
    if now is not None and now.usable and now.manifest_sha256 == g.manifest_sha256:
        return  # still there and the same: what failed is real damage at the source (exit 1)
    state = "removed" if now is None else f"now {now.status}"
    raise NotUsable(f"generation {g.number} was {state} at the source while it was being exported ({exc}); "
                    f"nothing was published at {dst_location}: export a generation that is still usable there "
                    f"(`ckpt-archive list {src.location}`); `ckpt-archive gc {dst_location}` removes the partial "
                    f"copy", where=src.location) from None


def _export_one(src, dst, g, *, on_bytes, cleanup: str | None = None,
                shared: SharedCopies | None = None) -> ExportedGeneration:
    from ckpt_archive.format.limits import MAX_MANIFEST_BYTES, MAX_SMALL_DOC_BYTES
    from ckpt_archive.repo.repository import CLAIM, MANIFEST, MARKER, gen_key, read_small

    manifest = g.manifest
    number = g.number
    key = gen_key(number)
    progress = manifest.get("progress") or {}
    out = ExportedGeneration(number, manifest["archive_id"], progress.get("step"), progress.get("epoch"),
                             fingerprints=fingerprints(manifest, g.manifest_sha256))
    raw_manifest = read_small(src.store, f"{key}/{MANIFEST}", MAX_MANIFEST_BYTES)
    manifest_sha = hashlib.sha256(raw_manifest).hexdigest()
    if manifest_sha != g.manifest_sha256:
        raise IntegrityError(f"manifest.json of generation {number} changed while exporting", where=src.location)

    # -- what DEST already holds at this number ---------------------------------------------------------
    names = set(dst.store.listdir(key))
    if MANIFEST in names:
        try:
            theirs = read_small(dst.store, f"{key}/{MANIFEST}", MAX_MANIFEST_BYTES)
        except ImplausibleSize:
            theirs = b""  # larger than any manifest: not ours (named below as an unreadable manifest)
        if hashlib.sha256(theirs).hexdigest() != manifest_sha:
            other = _archive_id_of(theirs)
            if other != out.archive_id:
                raise OutputExists(
                    f"generation {number} there holds another archive ({other or 'unreadable manifest'}), not "
                    f"{out.archive_id} (step {out.step}) from {src.location}; nothing was changed. Export to "
                    f"another destination, or remove it there first (ckpt-archive forget)", where=dst.location)
            if MARKER in names:
                raise OutputExists(f"generation {number} there has a manifest that differs from the source's "
                                   f"and a marker: it is damaged there; remove it (ckpt-archive forget --force) "
                                   f"and export again", where=dst.location)
            dst.store.remove(f"{key}/{MANIFEST}")  # our own partial copy, damaged: replace it
            names.discard(MANIFEST)
        else:
            existing = dst.generation(number)
            if existing.usable:
                return _already_usable(dst, existing, out, key)
            out.status = "resumed"
    elif names - {CLAIM}:
        raise OutputExists(f"generation {number} there is a partial generation of unknown origin (no manifest): "
                           f"run ckpt-archive gc on the destination first; nothing was changed", where=dst.location)
    elif names:
        out.status = "resumed"
    names = _clean_own_partial(dst, key, g.manifest, names, out)  # ours (same archive id), or nothing there yet
    shared = shared if shared is not None else SharedCopies()
    if shared.cleaned is None and any(m.get("objects") for m in g.manifest["members"]):
        shared.cleaned = clean_objects(dst)  # once per run: what a killed run left below objects/
        out.cleaned["aborted_uploads"] += shared.cleaned["aborted_uploads"]
        out.cleaned["removed"] += shared.cleaned["removed"]

    # -- 1. claim, 2. manifest first, 3. members, 4. trial reload, 5. marker: the one publish lifecycle ---------
    from ckpt_archive.repo.publish import EXPORT_POINTS, Lifecycle

    steps = _ExportSteps(src, g, out, names, raw_manifest, manifest_sha, on_bytes, shared)
    published = Lifecycle(dst, steps, EXPORT_POINTS, reload_where=f"trial reload at {dst.location}",
                          progress=on_bytes, cleanup=cleanup).run()
    dst.faults.point("export-after-publish")
    raw_marker = read_small(dst.store, f"{key}/{MARKER}", MAX_SMALL_DOC_BYTES)
    out.members.append({"key": f"{key}/{MARKER}", "member": None, "bytes": len(raw_marker),
                        "sha256": hashlib.sha256(raw_marker).hexdigest(), "action": "written",
                        "object": None})
    out.marker = published.marker
    listed = dst.generation(number)
    out.checks.append(Check("listed as usable by a reader of the destination", listed.usable,
                            listed.reason or f"marker names {dst.location}"))
    if not listed.usable:
        raise IntegrityError(f"generation {number} is {listed.status} at the destination after publishing: "
                             f"{listed.reason}", where=dst.location)
    return out


def _clean_own_partial(dst, key: str, manifest: dict, names: set, out: ExportedGeneration) -> set:
    """Before (re)copying generation ``key`` at DEST, which is ours (same archive id, no marker) or not
    there yet: abort the multipart uploads a killed run left below it (invisible objects, billed parts),
    and remove objects that are not part of this archive. Records both in ``out.cleaned``.

    Returns:
        the names present below ``key`` afterwards.
    """
    from ckpt_archive.repo.repository import CLAIM, MANIFEST, MARKER

    out.cleaned["aborted_uploads"] = dst.store.abort_uploads(key)
    expected = {CLAIM, MANIFEST, MARKER} | {rec["stored_path"] for rec in manifest["members"]}
    for name in sorted(names - expected):
        dst.store.remove_prefix(f"{key}/{name}")
        out.cleaned["removed"].append(f"{key}/{name}")
    return names & expected


class _ExportSteps:
    """The publish lifecycle's steps for a generation copied from ``src`` (see
    :class:`ckpt_archive.repo.publish.Steps`): the manifest first (a re-run recognises its own partial
    copy by archive id; harmless, as no reader lists a generation without its marker), then every member
    copied write-once and re-read from DEST (size, sha256 of every chunk and of the whole)."""

    def __init__(self, src, g, out: "ExportedGeneration", names: set, raw_manifest: bytes, manifest_sha: str,
                 on_bytes, shared: SharedCopies):
        self.src = src
        self.g = g
        self.out = out
        self.names = names
        self.raw_manifest = raw_manifest
        self.manifest_sha = manifest_sha
        self.on_bytes = on_bytes
        self.shared = shared
        self.actions: dict[str, str] = {}

    def claim(self, dst) -> int:
        from ckpt_archive.repo.repository import CLAIM, gen_key

        if CLAIM not in self.names:
            dst.store.claim(f"{gen_key(self.g.number)}/{CLAIM}")
        return self.g.number

    def write_members(self, dst, number: int) -> None:
        from ckpt_archive.repo.publish import phase
        from ckpt_archive.repo.repository import MANIFEST, gen_key

        key, names, out = gen_key(number), self.names, self.out
        if MANIFEST not in names:
            dst.write_manifest(number, self.raw_manifest, point=None)  # atomic: never an empty or cut manifest
        out.members.append({"key": f"{key}/{MANIFEST}", "member": None, "bytes": len(self.raw_manifest),
                            "sha256": self.manifest_sha, "action": "present" if MANIFEST in names else "copied",
                            "object": None})
        dst.faults.point("export-after-manifest")
        files = files_of(self.g.manifest, key)
        phase(self.on_bytes, f"copy of generation {number}", sum(f.rec["stored_bytes"] for f in files))
        for f in files:
            if f.fp is not None:  # a shared object: once per destination, skipped when already there
                action = place_object(self.src, dst, f, self.shared, self.on_bytes)
                if action == "present":
                    out.bytes_skipped += f.rec["stored_bytes"]
                else:
                    out.bytes_copied += f.rec["stored_bytes"]
                self.actions[f.key] = action
                continue
            action = "copied"
            if f.rec["stored_path"] in names or dst.store.exists(f.key):
                bad = check_at(dst.store, f.key, f.rec)
                if bad is None:
                    action = "present"
                else:
                    dst.store.remove(f.key)  # a damaged piece of our own partial copy (no marker): redo it
                    action = "replaced"
            if action != "present":
                copy_file(self.src.store, dst.store, f, self.on_bytes, dst.faults)
                out.bytes_copied += f.rec["stored_bytes"]
                dst.faults.point("export-after-member")
            else:  # our own partial copy's file, whole (sha256 checked): not copied again
                out.bytes_skipped += f.rec["stored_bytes"]
            self.actions[f.key] = action
        phase(self.on_bytes, f"re-read of generation {number} from {dst.location}",
              sum(f.rec["stored_bytes"] for f in files if f.fp not in self.shared.verified))
        for f in files:
            self._reread(dst, number, f)

    def _reread(self, dst, number: int, f: StoredFile) -> None:
        """Re-read one stored file from DEST (a shared object once per run); raise when it does not match."""
        out, rec, action = self.out, f.rec, self.actions[f.key]
        what = "shared object " + f.key if f.fp is not None else rec["path"]
        if f.fp is not None and f.fp in self.shared.verified:
            sha, with_gen = self.shared.verified[f.fp]
            out.checks.append(Check("shared object re-read from destination earlier in this run", True,
                                    f"{rec['stored_bytes']} bytes, with generation {with_gen}; the trial reload "
                                    f"decodes it again", member=f.key))
            out.members.append({"key": f.key, "member": f.member, "bytes": rec["stored_bytes"], "sha256": sha,
                                "action": action, "object": f.fp})
            return
        whole: list[str] = []
        bad = check_at(dst.store, f.key, rec, self.on_bytes, whole)
        if bad is not None and f.fp is not None and action == "present":
            # kept on its size, but its bytes are not the manifest's: never trusted, replaced from the source
            bad = recheck_object(self.src, dst, f, self.on_bytes, whole)
            out.bytes_copied += rec["stored_bytes"]
            out.bytes_skipped -= rec["stored_bytes"]
            action = self.actions[f.key] = "replaced"
        out.checks.append(Check("size and sha256 re-read from destination (every chunk and whole)", bad is None,
                                bad or f"{rec['stored_bytes']} bytes, {len(rec.get('chunks', []))} chunk(s)",
                                member=f.key if f.fp is not None else rec["path"]))
        if bad is not None:
            raise IntegrityError(f"copy at {dst.location} does not match the manifest: {bad}; generation "
                                 f"{number} stays partial there", where=what)
        if f.fp is not None:
            self.shared.verified[f.fp] = (whole[0], number)
        out.members.append({"key": f.key, "member": f.member if f.fp is not None else rec["path"],
                            "bytes": rec["stored_bytes"], "sha256": whole[0], "action": action, "object": f.fp})

    def seal(self, dst, number: int) -> tuple[dict, bytes]:
        return self.g.manifest, self.raw_manifest  # written first, byte-identical to the source's

    def verify(self, dst, number: int, reader) -> dict:
        # every member was re-read from DEST as it was copied (write_members)
        return {"when": _now(), "result": "ok", "members": len(self.g.manifest["members"]),
                "where": dst.location, "how": "size and sha256 of every chunk and member re-read from here"}

    def reloaded(self, problems: list, counts: dict) -> None:
        self.out.checks.append(Check("trial reload from destination (decode every member, rebuild every tensor, "
                                     "compare raw sha256/dtype/shape, rebuild the tree)", not problems,
                                     f"{counts['tensors']} tensor(s), {counts['bytes']} raw bytes decoded"
                                     if not problems else
                                     "; ".join(f"{p.member or p.field}: {p.reason}" for p in problems[:5])))
        if not problems:  # [issue 11] say when exact bytes are not had
            from ckpt_archive.format.exact_bytes import exact_note

            self.out.checks.append(Check("source files restore byte for byte (sha256 equal to the originals)",
                                         True, exact_note(self.g.manifest)))

    def record(self, dst, counts: dict) -> dict:
        from ckpt_archive.repo.repository import host_record

        rec = {"trial_reload": {**host_record(dst.location), "result": "ok", "tensors": counts["tensors"],
                                "bytes": counts["bytes"]},
               "exported_from": {"location": self.src.location, "generation": self.g.number, "when": _now()}}
        if (self.g.marker or {}).get("signature") is not None:  # it covers content, not place: it travels
            rec["signature"] = self.g.marker["signature"]
        return rec


def _already_usable(dst, existing, out: ExportedGeneration, key: str) -> ExportedGeneration:
    """DEST already holds this archive, usable there: re-check sizes, then the sha256 of every stored chunk
    read from DEST (the shallow verify); copy nothing. A byte that rotted at DEST since it was proven
    fails the export (exit 1, the member named): exit 0 still means DEST holds it verified."""
    from ckpt_archive.repo.reader import ArchiveReader
    from ckpt_archive.repo.repository import MANIFEST, MARKER

    out.status = "already-usable"
    out.marker = existing.marker
    out.bytes_skipped = sum(f.rec["stored_bytes"] for f in files_of(existing.manifest, key))  # all of it was there
    out.members.append({"key": f"{key}/{MANIFEST}", "member": None, "bytes": None,
                        "sha256": existing.manifest_sha256, "action": "kept", "object": None})
    for f in files_of(existing.manifest, key):
        rec = f.rec
        try:
            size = dst.store.size(f.key)
        except NotFound:
            size = None
        ok = size == rec["stored_bytes"]
        out.checks.append(Check("already usable at destination: size re-checked", ok,
                                f"{size} bytes" if ok else f"{size} bytes stored, manifest says {rec['stored_bytes']}"
                                                            f"; run ckpt-archive verify --deep there",
                                member=f.key if f.fp is not None else rec["path"]))
        out.members.append({"key": f.key, "member": f.member, "bytes": rec["stored_bytes"],
                            "sha256": stored_digest(rec), "action": "kept", "object": f.fp})
    if all(c.ok for c in out.checks):  # sizes right: read DEST's bytes (sha256 of every stored chunk)
        problems: list = []
        ArchiveReader(dst.store, key, existing.manifest).check_stored(problems)
        for p in problems:
            out.checks.append(Check("already usable at destination: stored sha256 re-read from there", False,
                                    f"{p.reason}; run ckpt-archive verify --deep there, then forget it there "
                                    f"(ckpt-archive forget --force) and export again", member=p.member))
        if not problems:
            out.checks.append(Check("already usable at destination: stored sha256 re-read from there", True,
                                    "every stored chunk matches the manifest"))
    trial = (existing.marker or {}).get("trial_reload") or {}
    out.checks.append(Check("marker at destination matches the manifest and names the destination", True,
                            f"trial reload there on {trial.get('when')} by {trial.get('host')}"))
    out.members.append({"key": f"{key}/{MARKER}", "member": None, "bytes": None, "sha256": None, "action": "kept",
                        "object": None})
    if not all(c.ok for c in out.checks):
        bad = next(c for c in out.checks if not c.ok)
        raise IntegrityError(f"generation {out.generation} is marked usable at the destination but {bad.detail}",
                             where=bad.member)
    return out


def _archive_id_of(raw: bytes) -> str | None:
    from ckpt_archive.format.jsonio import loads
    from ckpt_archive.format.limits import MAX_MANIFEST_BYTES, MAX_MANIFEST_COST

    try:
        doc = loads(raw, where="manifest.json", max_bytes=MAX_MANIFEST_BYTES, max_cost=MAX_MANIFEST_COST)
    except ValueError:
        return None
    return doc.get("archive_id") if isinstance(doc, dict) else None


__all__ = ["export", "ExportOptions", "ExportResult", "ExportedGeneration", "Check", "select_generations", "restore_command",
           "write_report", "render_markdown"]  # the last three live in ops/export_proof.py
