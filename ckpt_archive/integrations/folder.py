"""``FolderPublisher``: a checkpoint folder a trainer has just written becomes a generation, in the background.

A Hugging Face Trainer (``checkpoint-N/``) or ``accelerator.save_state`` has already written the resume point to
disk when control comes back to us. What blocks the training thread (:meth:`FolderPublisher.publish`) is then:
waiting for the previous publish if it is still in flight (one at a time, as the Checkpointer does), and a
*snapshot* of the folder: every file hard-linked into a staging folder beside it (no bytes copied; a file whose
link fails, e.g. on a file system without hard links, is copied instead, so the stall is never longer than a
copy). Everything else runs in one background thread through :func:`ckpt_archive.ops.pack.pack`, the path
``ckpt-archive pack`` takes: read by the folder source (``sources/hf.py`` for a Trainer folder), encoded, written,
verified, trial-reloaded, published, then retention.

Why a snapshot: the trainer moves on while the pack reads. Its own rotation (``save_total_limit`` of the Trainer,
``total_limit`` of Accelerate) deletes old checkpoint folders at the *next* save, which may come while this one
is still being read. A hard link keeps every file of the snapshot whole whatever happens to its name in the
trainer's folder. What a link cannot keep is a file rewritten *in place* (same inode); that is caught instead:
the snapshot's size, mtime and inode per file (:func:`ckpt_archive.ops.backup.stat_snapshot`) are compared
again under the repository lock just before the marker is written (pack's before-publish hook), and a
difference withdraws the generation (never published), raised at the next call. So a publish either makes a
generation holding exactly the files that were there at :meth:`~FolderPublisher.publish`, or fails loudly.

The staging folder lives in the trainer's output folder, where others may write too, so every link, write and
delete there goes through the file layer (:mod:`ckpt_archive.store.fs`): the output folder is opened once by its
path, ``_ckpt-archive-staging`` in it ``O_NOFOLLOW`` (a symbolic link planted there is refused), the snapshot under
a random name created exclusively and held by descriptor until it is removed. The trainer's checkpoint folder is
only read, following its own links as the folder reader does.

Why not :class:`~ckpt_archive.training.checkpointer.Checkpointer`: its ``save`` takes a nested state from memory
and copies it; here the state is already on disk as a folder whose files (``training_args.bin``, the tokenizer,
the exact safetensors bytes) must come back as that folder, and the snapshot must be checked before publishing.
The behaviour the two share is the same: one publish in flight, the next call waits for it, a background
failure is raised (once) by the next :meth:`~FolderPublisher.publish`, :meth:`~FolderPublisher.wait` or
:meth:`~FolderPublisher.close`, and logged when it happens so a crashing training loop cannot hide it.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_archive.errors import SourceError, UsageError
from ckpt_archive.store import fs

if TYPE_CHECKING:
    from ckpt_archive.ops.pack import PackOptions, PackResult
    from ckpt_archive.retention.policy import RetentionPolicy

_LOG = logging.getLogger("ckpt_archive.integrations")

#: The staging folder's name, created beside the checkpoint folders. Its leading ``_`` keeps it out of what the
#: Hugging Face Hub upload of an output folder sends (``ignore_patterns=["_*", ...]``); no trainer's rotation
#: matches it (``checkpoint-*``, ``checkpoint_<n>``).
STAGING_NAME = "_ckpt-archive-staging"

_ACCELERATE_AUTO = re.compile(r"^checkpoint_\d+$")


@dataclasses.dataclass
class PublishHandle:
    """One :meth:`FolderPublisher.publish`: what it cost the caller now, the generation once published.

    Attributes:
        folder: the checkpoint folder given. snapshot: the staging copy the pack reads (removed afterwards).
        step: the progress step recorded (None: the folder's own, e.g. ``trainer_state.json``'s global_step).
        linked: files hard-linked into the snapshot. copied: files copied (their link failed).
        waited_s: seconds the caller waited for the previous publish. snapshot_s: seconds the snapshot took.
        blocked_s: ``waited_s + snapshot_s`` (plus the pack itself when ``block=True``).
        warnings: entries of the folder not archived (a FIFO, a dangling link), as the folder reader says too.
    """

    folder: Path
    snapshot: Path
    step: int | None
    linked: int
    copied: int
    waited_s: float
    snapshot_s: float
    warnings: list[str]
    _future: concurrent.futures.Future = dataclasses.field(repr=False, default=None)

    @property
    def blocked_s(self) -> float:
        return self.waited_s + self.snapshot_s

    def done(self) -> bool:
        """True once the background publish finished (published or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> "PackResult":
        """Wait for the background publish and return its :class:`~ckpt_archive.ops.pack.PackResult`.

        Raises:
            whatever the publish raised (``Withdrawn``: a file changed in place while it was packed);
            concurrent.futures.TimeoutError after ``timeout`` seconds.
        """
        return self._future.result(timeout)


def default_staging(folder: Path) -> Path:
    """Where the snapshot of ``folder`` goes: ``<parent>/_ckpt-archive-staging``, on the folder's file system so
    that hard links work. For Accelerate's automatic naming (``<project>/checkpoints/checkpoint_<n>``) the
    project folder is used instead: Accelerate's ``total_limit`` lists every entry of ``checkpoints/`` and
    expects a number in each name."""
    parent = folder.parent
    if parent.name == "checkpoints" and _ACCELERATE_AUTO.match(folder.name):
        parent = parent.parent
    return parent / STAGING_NAME


def snapshot_folder(folder: Path, into: "fs.Dir", name: str) -> tuple[int, int, list[str]]:
    """Recreate ``folder`` as the new folder ``name`` in the open folder ``into``, with hard links, copying where a
    link fails.

    What the folder reader (:func:`ckpt_archive.sources.files.read_folder`) would archive is kept: regular files
    (a symbolic link to a file as the file it points to, linked by its target), sub-folders; a symbolic link to a
    folder is recreated as such (the reader does not follow it and says so); a dangling link, a FIFO, a socket or
    a device is left out and named in the returned warnings.

    ``folder`` is only read, by its path (the trainer's own links followed as the reader follows them). Everything
    written goes through ``into``'s descriptor (:mod:`ckpt_archive.store.fs`): each folder of the copy is created
    there and opened ``O_NOFOLLOW``, each file and link created exclusively
    (:meth:`~ckpt_archive.store.fs.Dir.link_from`, :meth:`~ckpt_archive.store.fs.Dir.copy_from`,
    :meth:`~ckpt_archive.store.fs.Dir.symlink`), so a link met in the copy is never followed, written through or
    replaced.

    Returns:
        ``(files linked, files copied, warnings)``.

    Raises:
        SourceError: ``folder`` is not a folder. FileExistsError: ``name`` exists in ``into``. OSError: the copy
        cannot be written. UnsafePath: a folder of the copy was replaced by a symbolic link meanwhile.
    """
    if not folder.is_dir():
        raise SourceError("no such checkpoint folder (was it saved under another name?)", where=str(folder))
    linked = copied = 0
    warnings: list[str] = []
    into.mkdir(name)
    with into.sub(name) as top:
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
            src_dir = Path(dirpath)
            rel = src_dir.relative_to(folder)
            with top.walk(rel.parts) as dst:
                for entry in list(dirnames):
                    if (src_dir / entry).is_symlink():
                        dst.symlink(os.readlink(src_dir / entry), entry)
                        dirnames.remove(entry)
                    else:
                        dst.mkdir(entry)
                for entry in filenames:
                    src = src_dir / entry
                    if not src.is_file():  # dangling link, FIFO, socket, device: the reader skips them too
                        warnings.append(f"{src.relative_to(folder).as_posix()}: not a regular file (not archived)")
                        continue
                    try:
                        dst.link_from(src, entry)
                        linked += 1
                    except OSError:  # another file system under a link, no hard links here (some FUSE/network mounts)
                        dst.copy_from(src, entry)
                        copied += 1
    return linked, copied, warnings


class _Snapshot:
    """One publish's snapshot folder, ``<staging>/<host>-<pid>-<random>/`` (mode 0700), held open by descriptor from
    its creation to its removal.

    The staging folder's own folder (the trainer's output folder) is the root, resolved once by its path (the
    trainer's choice, links on it included); the staging folder in it is opened ``O_NOFOLLOW`` (created when
    absent), so a symbolic link planted at ``_ckpt-archive-staging`` is refused, never linked, written or deleted
    through; the snapshot's random name is created exclusively.

    Args:
        staging: the staging folder.

    Attributes:
        path: the snapshot folder's path (for the pack and messages; never used to write). dir: the open snapshot
        folder.

    Raises:
        UnsafePath: the staging folder is a symbolic link. OSError: it cannot be created or opened.
    """

    def __init__(self, staging: Path):
        self.staging = staging
        self.name: str | None = None  # set once the snapshot folder exists
        self.stage: fs.Dir | None = None
        self.dir: fs.Dir | None = None
        self.parent = fs.Dir.open(staging.parent, create=True)
        try:
            for attempt in range(3):
                self.stage = self.parent.sub(staging.name, create=True)
                _remove_stale_in(self.stage, staging)
                name = self._make(self.stage)
                if name is None:  # another publisher removed the staging folder, empty, meanwhile
                    self.stage.close()
                    if attempt == 2:
                        raise FileNotFoundError(errno.ENOENT, "removed while in use", str(staging))
                    continue
                self.name = name
                break
            self.dir = self.stage.sub(self.name)
        except BaseException:
            self.close()
            raise
        self.path = staging / self.name

    @staticmethod
    def _make(stage: "fs.Dir") -> str | None:
        """Create a fresh snapshot folder (mode 0700) in ``stage``; its name, or None when ``stage`` was removed."""
        for _ in range(100):
            name = _snapshot_name()
            try:
                stage.mkdir(name, 0o700)
                return name
            except FileExistsError:  # a name planted (or left) there: another random name, never that one
                continue
            except FileNotFoundError:
                return None
        raise FileExistsError(errno.EEXIST, "no free snapshot name", stage.path)

    def close(self) -> None:
        """Remove the snapshot (links only: the trainer's files are untouched), then the staging folder when empty;
        close the descriptors (idempotent)."""
        if self.dir is not None:
            self.dir.close()
        if self.stage is not None and self.stage.fd >= 0:
            if self.name is not None:
                with contextlib.suppress(OSError):
                    self.stage.remove_tree(self.name)
            self.stage.close()
            try:  # by name in its folder: a link there now is not a folder (ENOTDIR), never followed
                self.parent.rmdir(self.staging.name)
            except OSError:  # another publish's snapshot is there, or it is gone already
                pass
        self.parent.close()


class FolderPublisher:
    """Publish checkpoint folders a trainer has written, in a background thread, one at a time.

    ::

        with FolderPublisher("backups/run1", retention=RetentionPolicy(keep_last=3)) as pub:
            ...
            accelerator.save_state(f"out/step_{step}")
            if accelerator.is_main_process:
                pub.publish(f"out/step_{step}", step=step, metrics={"loss": loss})

    Args:
        repo: repository path/URL (created if absent). Each background publish opens it anew.
        retention: a :class:`~ckpt_archive.retention.policy.RetentionPolicy` run after each publish; None applies
            the repository's default policy, if any.
        config: the experiment's parameters (dict or path), recorded in every manifest.
        data_ids: data identity (list/dict or path), stored with every generation.
        tags: labels for every generation (``publish(..., tags=)`` adds more).
        code_version: free text recorded with the git commit.
        options: :class:`~ckpt_archive.ops.pack.PackOptions`; its ``wait`` (seconds for another writer's lock)
            defaults to :data:`ckpt_archive.training.checkpointer.DEFAULT_LOCK_WAIT` here.
        staging: the folder to snapshot into (on the same file system as the checkpoints, or every file is
            copied); default :func:`default_staging` of each published folder. Its own folder is reached by path
            (links on it followed); the staging folder itself must not be a symbolic link (refused: give the
            folder it points to).

    Raises:
        UsageError: ``retention`` is not a RetentionPolicy. NotFound / StoreError: the repository cannot be
        created or opened.
    """

    def __init__(self, repo: Any, *, retention: "RetentionPolicy | None" = None, config: Any = None,
                 data_ids: Any = None, tags: tuple[str, ...] | str = (), code_version: str | None = None,
                 options: "PackOptions | None" = None, staging: str | os.PathLike | None = None):
        from ckpt_archive.ops.common import open_repo
        from ckpt_archive.ops.pack import PackOptions
        from ckpt_archive.training.checkpointer import DEFAULT_LOCK_WAIT

        if retention is not None:
            from ckpt_archive.retention.policy import RetentionPolicy

            if not isinstance(retention, RetentionPolicy):
                raise UsageError(f"retention must be a RetentionPolicy or None, not {type(retention).__name__}")
        self.repo = repo
        self.location = open_repo(repo, create=True).location  # fails here, not in the first background publish
        self.retention = retention
        self.config = config
        self.data_ids = data_ids
        self.tags = (tags,) if isinstance(tags, str) else tuple(tags)
        self.code_version = code_version
        self.options = options if options is not None else PackOptions(wait=DEFAULT_LOCK_WAIT)
        self.staging = Path(staging).expanduser().absolute() if staging is not None else None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-folder-publisher")
        self._inflight: PublishHandle | None = None
        self._last: "PackResult | None" = None
        self._closed = False

    # -- publishing ------------------------------------------------------------------------------------------
    def publish(self, folder: str | os.PathLike, *, step: int | None = None, metrics: Any = None,
                tags: tuple[str, ...] | str = (), block: bool = False) -> PublishHandle:
        """Snapshot ``folder`` and make it a generation in the background.

        Returns once the snapshot is taken (after waiting for the previous publish, if still in flight): the
        trainer may delete or replace the folder's files from then on.

        Args:
            folder: the checkpoint folder the trainer wrote (complete: call this after the save returned on
                every process).
            step: the progress step to record (>= 0); None keeps what the folder says (a Trainer folder's
                ``trainer_state.json``).
            metrics: a dict of plain values (checked here, so a bad value fails this call).
            tags: labels for this generation, besides the publisher's.
            block: wait until the generation is usable (``handle.result()`` is then ready).

        Returns:
            :class:`PublishHandle`.

        Raises:
            the previous publish's exception (with a note naming its folder), once; UsageError: bad step,
            closed publisher; SourceError: no such folder, or metrics that cannot be recorded; UnsafePath: the
            staging folder is a symbolic link (nothing is written through it; remove it by hand); with
            ``block=True`` this publish's own failure.
        """
        from ckpt_archive.format.metrics import metrics_to_json

        if self._closed:
            raise UsageError("this FolderPublisher is closed")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise UsageError(f"step must be a non-negative int or None, not {step!r}")
        metrics_to_json(metrics)
        folder = Path(folder).absolute()
        t0 = time.perf_counter()
        self._finish_previous()
        t1 = time.perf_counter()
        staging = self.staging or default_staging(folder)
        snap = _Snapshot(staging)
        snap_dir = snap.path / folder.name  # the folder's own name: the HF reader reads the step from checkpoint-N
        try:
            linked, copied, warnings = snapshot_folder(folder, snap.dir, folder.name)
            from ckpt_archive.ops.backup import stat_snapshot

            taken = stat_snapshot(snap_dir)
        except BaseException:
            snap.close()
            raise
        t2 = time.perf_counter()
        extra = (tags,) if isinstance(tags, str) else tuple(tags)
        fut = self._pool.submit(self._publish, folder, snap_dir, snap, taken, step, metrics, self.tags + extra)
        fut.add_done_callback(lambda f, name=folder.name: _log_failure(f, name))
        handle = PublishHandle(folder, snap_dir, step, linked, copied, t1 - t0, t2 - t1, warnings, fut)
        self._inflight = handle
        if block:
            self._finish_previous()
        return handle

    def _publish(self, folder: Path, snap_dir: Path, snap: _Snapshot, taken: list, step: int | None, metrics: Any,
                 tags: tuple[str, ...]) -> "PackResult":
        from ckpt_archive.ops.backup import stat_snapshot
        from ckpt_archive.ops.pack import Annotations, pack

        def unchanged(candidate) -> str | None:
            try:
                now = stat_snapshot(snap_dir)
            except FileNotFoundError:
                now = None
            if now == taken:
                return None
            changed = _changed_entries(taken, now)
            return (f"{folder.name}: {', '.join(changed) or 'its files'} changed in place while it was being packed "
                    f"(a hard-linked snapshot keeps deleted files, not rewritten ones); what was packed may mix two "
                    f"versions, so it is not published")

        notes = Annotations(config=self.config, metrics=metrics, data_ids=self.data_ids, tags=tags,
                            code_version=self.code_version, progress={"step": step} if step is not None else None)
        try:
            return pack(str(snap_dir), self.repo, self.options, notes, retention=self.retention,
                        before_publish=unchanged)
        finally:
            snap.close()

    def _finish_previous(self) -> "PackResult | None":
        handle, self._inflight = self._inflight, None
        if handle is None:
            return None
        try:
            self._last = handle.result()
        except BaseException as exc:
            if not handle.done():  # the wait itself was interrupted (Ctrl-C): the publish goes on, still ours
                self._inflight = handle
                exc.add_note(f"(interrupted while waiting for the background publish of {handle.folder}, which goes "
                             f"on; it is usable only if `ckpt-archive list REPO` shows it)")
                raise
            exc.add_note(f"(raised by the background publish of {handle.folder}; it was not archived)")
            raise
        return self._last

    @property
    def last(self) -> "PackResult | None":
        """The newest publish known to have finished (its PackResult), without waiting."""
        return self._last

    def wait(self) -> "PackResult | None":
        """Wait for the publish in flight, if any.

        Returns:
            the newest publish's PackResult (None when nothing was published yet).

        Raises:
            the background publish's exception (once).
        """
        self._finish_previous()
        return self._last

    def close(self) -> "PackResult | None":
        """Wait for the publish in flight, then stop the background thread (idempotent).

        Raises:
            the background publish's exception (once).
        """
        if self._closed:
            return self._last
        try:
            return self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "FolderPublisher":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body failed: finish the publish in flight, never hide the body's exception
            self.close()
        except BaseException as bg:  # noqa: BLE001 - reported on the body's exception
            exc.add_note(f"also, the background publish failed: {type(bg).__name__}: {bg}")


def _changed_entries(before: list, after: list | None) -> list[str]:
    """Names of the snapshot's entries whose size, mtime or inode differ (at most 5)."""
    if after is None:
        return []
    a = {row[0]: row[1:] for row in before}
    b = {row[0]: row[1:] for row in after}
    names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    return names[:5] + ([f"{len(names) - 5} more"] if len(names) > 5 else [])


def _snapshot_name() -> str:
    """A snapshot's folder name under the staging folder: ``<host>-<pid>-<random>``, so that a later publisher on
    this host can tell the snapshots of a process that is gone (killed mid-publish) from those of a live one."""
    return f"{_host()}-{os.getpid()}-{uuid.uuid4().hex}"


def _host() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def remove_stale_snapshots(staging: Path) -> list[str]:
    """Remove the snapshots a killed publisher left in ``staging`` (``kill -9`` runs no cleanup): those named for this
    host and a process that no longer exists. A snapshot holds hard links, so one left behind keeps the disk space
    of a checkpoint folder the trainer's rotation has deleted since; the trainer's own files are never touched.

    ``staging`` is opened ``O_NOFOLLOW`` in its folder and each snapshot removed through its descriptor, never
    following a link inside (:meth:`ckpt_archive.store.fs.Dir.remove_tree`).

    Returns:
        the names removed.

    Raises:
        UnsafePath: ``staging`` is a symbolic link (nothing is removed through it).
    """
    try:
        with fs.Dir.open(staging.parent) as parent, parent.sub(staging.name) as stage:
            return _remove_stale_in(stage, staging)
    except (FileNotFoundError, NotADirectoryError):  # no staging folder yet
        return []


def _remove_stale_in(stage: "fs.Dir", staging: Path) -> list[str]:
    """:func:`remove_stale_snapshots` in the open staging folder ``stage`` (``staging``: its path, for the log)."""
    pattern = re.compile(rf"^{re.escape(_host())}-(\d+)-[0-9a-f]{{32}}$")
    removed = []
    for name in stage.listdir():
        m = pattern.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                stage.remove_tree(name)
            removed.append(name)
    if removed:
        _LOG.info("removed %d snapshot(s) left in %s by publishers that are gone", len(removed), staging)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _log_failure(fut: concurrent.futures.Future, name: str) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:  # raised again at the next call; logged now in case the training loop dies first
        _LOG.error("archiving %s failed: %s: %s", name, type(exc).__name__, exc)


__all__ = ["FolderPublisher", "PublishHandle", "snapshot_folder", "default_staging", "remove_stale_snapshots",
           "STAGING_NAME"]
