"""Lightning: a ``CheckpointIO`` plugin whose checkpoints are generations of a repository.

::

    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from ckpt_archive.integrations.lightning import ArchiveCheckpointIO

    io = ArchiveCheckpointIO("backups/run1", retention=RetentionPolicy(keep_last=5))
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(save_top_k=2, monitor="val_loss")])  # or
    trainer = L.Trainer(plugins=[AsyncCheckpointIO(io)], ...)         # the pack runs in Lightning's thread
    trainer.fit(model, ckpt_path="backups/run1@latest")                # resume from the newest usable one

``save_checkpoint(checkpoint, path)`` packs the checkpoint dict Lightning built (``state_dict``,
``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``, ...) into a new generation with
:func:`ckpt_archive.ops.pack.pack`: verified and trial-reloaded before it counts, retention after; the file name
Lightning chose (``epoch=3-step=400.ckpt``, ``last.ckpt``) is its tag, and the monitored value of each
``ModelCheckpoint`` a metric (so ``--keep-best --best-by val_loss:min`` can use it). At ``path`` it writes a small
*pointer file* (JSON: repository, generation, archive id), because ``ModelCheckpoint`` decides by the files in its
folder (a name that exists gets a ``-v1`` suffix; ``ckpt_path="last"`` looks for ``last*.ckpt``): without one,
saves collided on one name and ``ckpt_path="best"`` loaded another save than the best. ``remove_checkpoint(path)``
deletes the pointer and forgets the usable generations tagged with that name (``ModelCheckpoint``'s top-k
rotation). ``load_checkpoint(path)`` takes ``REPO@GEN`` (``latest``, a number, ``tag:NAME``), a pointer file (the
generation it names), a repository (its newest usable generation), or a path that names no file whose file name
is a tag of this plugin's repository (``best_model_path`` on a new machine); every byte is checked on the way
(:func:`ckpt_archive.load`) and nothing is unpickled.

Lightning hands ``ckpt_path`` to ``strategy.load_checkpoint`` -> ``checkpoint_io.load_checkpoint`` without looking
at the file system (only ``"last"``, ``"best"``, ``"hpc"`` and ``"registry:"`` are resolved first; ``"last"``
finds the newest ``last*.ckpt`` pointer in ``dirpath``; on a new machine use ``REPO@latest``). Strategies that save
sharded folders themselves (FSDP, DeepSpeed) do not go through a ``CheckpointIO`` and are not covered.

Under ``AsyncCheckpointIO`` the save runs in Lightning's thread (tensors cloned by Lightning first) while
``remove_checkpoint`` is called from the training thread: a forget that would race the publish in flight (or
would remove what is, until that publish lands, the newest usable generation) is deferred to the end of the
save in flight, so the training thread never waits for the repository lock. See docs/integrations-lightning.md.

This module imports ``lightning`` (``pip install ckpt-archive[lightning]``); ``import ckpt_archive`` does not.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.plugins import CheckpointIO

from ckpt_archive.errors import LockError, UsageError

if TYPE_CHECKING:
    from ckpt_archive.ops.pack import PackOptions, PackResult
    from ckpt_archive.retention.policy import RetentionPolicy

_LOG = logging.getLogger("ckpt_archive.integrations")


class ArchiveCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` plugin that saves each checkpoint as a generation (see the module docstring).

    Args:
        repo: repository path or URL (created if absent).
        retention: a :class:`~ckpt_archive.retention.policy.RetentionPolicy` run after each save (None: the
            repository's default policy, if any). ``ModelCheckpoint``'s ``save_top_k`` removals forget
            generations too.
        config: the experiment's parameters (dict or path), recorded in every manifest.
        data_ids: data identity (list/dict or path), stored with every generation.
        tags: labels for every generation (the checkpoint's file name is added to each).
        code_version: free text recorded with the git commit.
        options: :class:`~ckpt_archive.ops.pack.PackOptions` (lock wait defaults to 60 s).

    Attributes:
        last: the newest save's :class:`~ckpt_archive.ops.pack.PackResult` (None before the first).
        forgotten: generation numbers forgotten through ``remove_checkpoint``, in order.

    Raises:
        UsageError: ``retention`` is not a RetentionPolicy.
    """

    def __init__(self, repo: Any, retention: "RetentionPolicy | None" = None, *, config: Any = None,
                 data_ids: Any = None, tags: tuple[str, ...] | str = (), code_version: str | None = None,
                 options: "PackOptions | None" = None):
        from ckpt_archive.ops.pack import PackOptions
        from ckpt_archive.training.checkpointer import DEFAULT_LOCK_WAIT

        super().__init__()
        if retention is not None:
            from ckpt_archive.retention.policy import RetentionPolicy

            if not isinstance(retention, RetentionPolicy):
                raise UsageError(f"retention must be a RetentionPolicy or None, not {type(retention).__name__}")
        self.repo = repo
        self._location: str | None = None  # resolved at first use: only the rank that saves creates the repository
        self.retention = retention
        self.config = config
        self.data_ids = data_ids
        self.tags = (tags,) if isinstance(tags, str) else tuple(tags)
        self.code_version = code_version
        self.options = options if options is not None else PackOptions(wait=DEFAULT_LOCK_WAIT)
        self.last: "PackResult | None" = None
        self.forgotten: list[int] = []
        self._mutex = threading.Lock()
        self._saving = 0  # saves running now (Lightning's async thread, or the caller's)
        # removals not done yet: (tag, the newest generation number it may forget, or None while no usable
        # generation carries the tag -- under AsyncCheckpointIO the save it follows may still be queued)
        self._to_forget: list[tuple[str, int | None]] = []
        # file name -> (the path its newest pointer was written at, that file's (st_dev, st_ino)): a pointer is
        # deleted later only if it is still that file
        self._pointers: dict[str, tuple[Any, tuple[int, int] | None]] = {}

    # -- CheckpointIO ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Pack ``checkpoint`` into a new generation tagged with ``path``'s file name; return once it is usable.

        Args:
            checkpoint: the dict Lightning built (``Trainer.save_checkpoint``); its tensors are read here (and
                under ``AsyncCheckpointIO`` they are Lightning's clones).
            path: where Lightning would write the file; only its name is used (the tag).
            storage_options: not supported (as Lightning's ``TorchCheckpointIO``).

        Raises:
            TypeError: ``storage_options`` given. What :func:`ckpt_archive.ops.pack.pack` raises
            (``SourceError`` for a value that cannot be archived exactly, naming its path; ``LockError``;
            ``IntegrityError`` when the new generation fails its checks, nothing published).
        """
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                            f"{type(self).__name__}: a generation goes where the repository is")
        from ckpt_archive.ops.pack import Annotations, pack

        name = _tag_of(path)
        self._repo_location(create=True)
        if threading.current_thread() is not threading.main_thread() and not _async_io_clones():
            raise UsageError("this Lightning's AsyncCheckpointIO hands the live tensors to its saving thread (later "
                             "releases clone them first: Lightning PR #21079), so training would change them while "
                             "they are packed and the generation would mix steps; upgrade lightning, or use "
                             f"{type(self).__name__} without AsyncCheckpointIO")
        with self._mutex:
            self._saving += 1
        try:
            notes = Annotations(config=self.config, metrics=_monitored(checkpoint), data_ids=self.data_ids,
                                tags=self.tags + (name,), code_version=self.code_version)
            self.last = pack(checkpoint, self.repo, self.options, notes, retention=self.retention)
            self._write_pointer(path, self.last)
        finally:
            self._end_save()

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The checkpoint dict of a generation, every chunk and tensor checked (nothing is unpickled).

        Args:
            path: ``REPO@GEN`` (``latest``, a number, ``tag:NAME``), a pointer file this plugin wrote (the
                generation it names), a repository (its newest usable generation), or a path that names no file
                and whose file name is a tag of this plugin's
                repository (``ModelCheckpoint.best_model_path``).
            map_location: a device (or its name) to move tensors to; a function is ignored (tensors come back
                on the CPU and Lightning moves them).
            weights_only: ignored: a generation holds plain data only.

        Returns:
            the checkpoint dict as it was saved (types, dtypes, shapes and bits).

        Raises:
            FileNotFoundError: ``path`` is none of the above, or a pointer to a generation that is gone (or is
            another archive now). UsageError: ``path`` is a file but not a pointer (this plugin loads generations;
            pack the file first). NoUsableGeneration / NotFound / IntegrityError: as
            :func:`ckpt_archive.load`.
        """
        from ckpt_archive.ops.load import LoadOptions, load

        repo, generation = self._resolve(path)
        import torch

        where = map_location if isinstance(map_location, (str, torch.device)) else None
        state = load(repo, generation, LoadOptions(map_location=where, jobs=self.options.jobs))
        if not isinstance(state, dict):
            raise UsageError(f"{os.fspath(path)} holds a {type(state).__name__}, not a Lightning checkpoint dict")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Forget the usable generations tagged with ``path``'s file name; never the newest usable generation.

        Runs at once when no save of this plugin is in flight and the repository lock is free; otherwise it is
        deferred to the end of the save in flight (or the next save), so the caller never waits for the lock. A
        generation that is the newest usable one is forgotten after the next save. When no usable generation
        carries the name yet (under ``AsyncCheckpointIO`` the save it follows may still be queued), the removal
        waits for the first one that does. Once a removal has found its generations, a later save of the same
        name is never touched by it.
        """
        name = _tag_of(path)
        written = self._pointers.get(name)
        # ModelCheckpoint's file checks see it gone at once, as a deleted file; one this plugin wrote here is
        # deleted only while it is still that file
        _remove_pointer(path, identity=written[1] if written and os.fspath(written[0]) == os.fspath(path) else None)
        with self._mutex:
            self._to_forget.append((name, None))
            if self._saving:
                return  # the save in flight forgets it when it ends (_end_save)
        self._forget_pending(wait=0.0)

    def teardown(self) -> None:
        """Forget what is still pending (a removal deferred past the last save). Lightning's ``AsyncCheckpointIO``
        does not pass its teardown on; what it leaves is forgotten by this plugin's next save."""
        with self._mutex:
            if self._saving:
                return
        self._forget_pending(wait=self.options.wait)

    # -- forgetting ------------------------------------------------------------------------------------------------
    def _end_save(self) -> None:
        """End a save: forget what was asked meanwhile, then count the save as ended -- under the mutex, so a
        removal either sees this save still running (and is picked up here) or runs itself. A tag that cannot be
        forgotten now (the newest usable generation, a lock held elsewhere) stays pending for the next save."""
        tried: set[tuple[str, int | None]] = set()
        while True:
            with self._mutex:
                fresh = [t for t in self._to_forget if t not in tried]
                if not fresh:
                    self._saving -= 1
                    return
            tried.update(fresh)
            try:
                self._forget_pending(wait=self.options.wait)
            except BaseException:
                with self._mutex:
                    self._saving -= 1
                raise

    def _forget_pending(self, *, wait: float) -> None:
        """Forget the usable generations of every pending tag that can be forgotten now; keep the rest pending."""
        from ckpt_archive.errors import NotFound
        from ckpt_archive.repo.repository import Repository

        with self._mutex:
            pending, self._to_forget = self._to_forget, []
        if not pending:
            return
        keep: list[tuple[str, int | None]] = []
        try:
            try:
                location = self._repo_location()
            except NotFound:  # nothing saved yet (its save may still be queued): every removal waits
                keep = pending
                return
            # the repository object itself where one was given: it holds the key (key_file=) a path would lose
            repo = self.repo if isinstance(self.repo, Repository) else location
            usable = (repo if isinstance(repo, Repository) else Repository.open(repo)).usable()
            for i, (name, limit) in enumerate(pending):
                if not self._forget_tag(repo, usable, name, limit, keep, wait=wait):
                    keep.extend(pending[i + 1:])  # another writer holds the lock: retried after the next save
                    return
        except BaseException:
            keep = pending  # nothing is dropped: retried after the next save
            raise
        finally:
            if keep:
                with self._mutex:
                    self._to_forget[:0] = [t for t in dict.fromkeys(keep) if t not in self._to_forget]

    def _forget_tag(self, repo: Any, usable: list, name: str, limit: int | None, keep: list, *, wait: float) -> bool:
        """Forget the usable generations tagged ``name`` (up to generation ``limit``) but the newest usable one;
        what must wait goes to ``keep``. Returns False when another writer holds the lock (this tag is kept)."""
        from ckpt_archive.errors import NotFound
        from ckpt_archive.ops.forget import forget

        newest = usable[-1].number if usable else None
        numbers = [g.number for g in usable if name in g.tags and (limit is None or g.number <= limit)]
        if not numbers:
            if limit is None:  # its save is still queued (AsyncCheckpointIO): applied once it lands
                keep.append((name, None))
            return True
        limit = max(numbers)  # from now on a later save of the same name is never touched
        for n in numbers:
            if n == newest:  # never the newest usable one: kept until a newer generation is usable
                keep.append((name, limit))
                continue
            try:
                forget(repo, n, wait=wait)
            except NotFound:  # gone already (retention, another forget)
                continue
            except LockError:  # another writer: retried after the next save, never waited for here
                keep.append((name, limit))
                return False
            self.forgotten.append(n)
            written = self._pointers.get(name)
            if written is not None:  # written by a save that landed after its removal (async)
                _remove_pointer(written[0], generation=n, identity=written[1])
        return True

    def _resolve(self, path: Any) -> tuple[Any, str]:
        """(repository, generation) that ``path`` names (see :meth:`load_checkpoint`)."""
        from ckpt_archive.errors import NoUsableGeneration, NotFound
        from ckpt_archive.ops.common import split_repo_spec
        from ckpt_archive.repo.repository import Repository

        text = os.fspath(path)
        repo, generation = split_repo_spec(text)
        if repo != text:  # REPO@GEN
            return repo, generation
        pointer = _read_pointer(text)
        if pointer:
            return self._pointed(text, pointer)
        if os.path.isfile(text):
            raise UsageError(f"{text} is a file: {type(self).__name__} loads generations of a repository (REPO@latest, "
                             f"REPO@N, REPO@tag:NAME); pack the file first (ckpt-archive pack {text} --repo REPO) or "
                             f"load it without this plugin", where=text)
        try:
            Repository.open(text)
            return text, "latest"
        except NotFound:
            pass
        name = Path(text).name
        try:
            location = self._repo_location()
            Repository.open(location).resolve(f"tag:{name}")
            return location, f"tag:{name}"
        except (NoUsableGeneration, NotFound):
            pass
        raise FileNotFoundError(f"{text}: neither REPO@GEN, a repository, nor the name of a usable generation of "
                                f"{os.fspath(self.repo)} (give ckpt_path=\"{os.fspath(self.repo)}@latest\")")

    def _write_pointer(self, path: Any, result: "PackResult") -> None:
        """Write the pointer file at ``path`` (atomically where it is local): ModelCheckpoint decides by the files in
        its folder (a name that exists gets a ``-v1`` suffix; ``ckpt_path="last"`` looks for ``last*.ckpt``), so
        a checkpoint it saved must exist there as a file, as with Lightning's own ``TorchCheckpointIO``.

        Through the file layer (:func:`ckpt_archive.store.fs.write_file_atomic`): the folder Lightning chose is
        reached by its path (created if absent, as Lightning creates it); the pointer is a fresh ``O_EXCL`` file
        renamed over the name, so a symbolic link planted at the name is replaced, never written through. The new
        file's identity (device, inode), read through the same folder descriptor, is kept: a later removal deletes
        only that file."""
        from ckpt_archive.store import fs

        text = os.fspath(path)
        if not _is_local(text):  # a remote dirpath (s3://): no pointer; the generation is tagged all the same
            return
        data = json.dumps({_POINTER_KEY: 1, "repository": self._repo_location(), "generation": result.generation,
                           "archive_id": result.manifest.get("archive_id")}, indent=1).encode() + b"\n"
        p = _local(text)
        with fs.Dir.open(p.parent, create=True) as d:
            d.write_atomic(p.name, data)
            st = d.lstat(p.name)
        self._pointers[_tag_of(path)] = (path, (st.st_dev, st.st_ino) if st is not None else None)

    def _pointed(self, text: str, pointer: dict) -> tuple[Any, str]:
        """(repository, generation) a pointer file names, checked to be that archive's generation and usable."""
        from ckpt_archive.errors import NoUsableGeneration, NotFound
        from ckpt_archive.repo.repository import Repository

        repo, number = pointer["repository"], pointer["generation"]
        try:
            gen = Repository.open(repo).resolve(str(number))
        except (NotFound, NoUsableGeneration) as exc:
            raise FileNotFoundError(f"{text} points to generation {number} of {repo}, which is not usable there any "
                                    f"more ({exc}); `ckpt-archive list {repo}` shows what is") from exc
        if (gen.manifest or {}).get("archive_id") != pointer["archive_id"]:
            raise FileNotFoundError(f"{text} points to generation {number} of {repo}, but that generation is another "
                                    f"archive now; load by REPO@GEN (`ckpt-archive list {repo}`)")
        return repo, str(number)

    def _repo_location(self, create: bool = False) -> str:
        """The repository's location (created on first save; under DDP only global rank 0 saves).

        Raises:
            NotFound: no repository there yet and ``create`` is false.
        """
        if self._location is None:
            from ckpt_archive.ops.common import open_repo

            self._location = open_repo(self.repo, create=create).location
        return self._location


def _async_io_clones() -> bool:
    """Whether the installed ``AsyncCheckpointIO`` clones a checkpoint's tensors in the caller's thread before it
    hands them to its own (Lightning PR #21079, August 2025; before, the training thread kept changing them)."""
    try:
        from lightning.pytorch.plugins.io import async_plugin
    except ImportError:  # no AsyncCheckpointIO at all: whoever calls from a thread passes their own copy
        return True
    if hasattr(async_plugin, "_clone_tensor"):
        return True
    import inspect

    try:
        return "clone" in inspect.getsource(async_plugin.AsyncCheckpointIO.save_checkpoint)
    except (OSError, TypeError):
        return False


#: the key that marks a pointer file this plugin wrote at a checkpoint path
_POINTER_KEY = "ckpt-archive-lightning-pointer"
_POINTER_MAX = 64 << 10


def _is_local(text: str) -> bool:
    return "://" not in text or text.startswith("file://")


def _local(text: str) -> Path:
    """The local path a ``file://`` URL or a plain path names, absolute (``~`` expanded)."""
    return Path(text.removeprefix("file://")).expanduser().absolute()


def _read_pointer(path: Any, quiet: bool = False) -> dict:
    """The pointer file at ``path`` as ``{"repository", "generation", "archive_id"}``, or ``{}`` when ``path`` is not
    a local file this plugin wrote (missing, too large, not JSON, other keys). Read as hostile input: at most
    64 KiB, every field type-checked.

    For loading only: ``path`` is what the user (or Lightning's ``"last"``/``"best"``) named, so a symbolic link there
    is followed, as any reader of that path would; the file it comes to is read through the file layer
    (``O_NOFOLLOW`` from its folder). :func:`_remove_pointer` follows no link at the name."""
    text = os.fspath(path)
    if not _is_local(text):
        return {}
    real = Path(os.path.realpath(_local(text)))
    return _pointer_in(real.parent, real.name, text, quiet)


def _pointer_in(folder: Path, name: str, text: str, quiet: bool, *, remove: bool = False,
                generation: int | None = None, identity: tuple[int, int] | None = None) -> dict:
    """The pointer ``name`` of ``folder`` (opened once, by its path), read ``O_NOFOLLOW`` (a symbolic link at ``name``
    is no pointer); ``{}`` when it is none. With ``remove``, a pointer (naming ``generation``, and being the file
    ``identity`` (st_dev, st_ino), when given) is then deleted through the same folder descriptor it was read
    through, so no folder swapped for a link meanwhile can redirect the delete."""
    from ckpt_archive.errors import UnsafePath
    from ckpt_archive.store import fs

    try:
        d = fs.Dir.open(folder)
    except OSError:  # no such folder
        return {}
    with d:
        try:
            raw = d.read_file(name, _POINTER_MAX)
        except (OSError, UnsafePath):  # unreadable, or a symbolic link: no pointer of ours
            return {}
        pointer = _parse_pointer(raw, text, quiet)
        if pointer and remove and generation in (None, pointer["generation"]):
            st = d.lstat(name)
            if identity is None or (st is not None and (st.st_dev, st.st_ino) == identity):
                d.unlink(name, missing_ok=True)
        return pointer


def _parse_pointer(raw: bytes | None, text: str, quiet: bool) -> dict:
    try:
        data = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):  # not JSON (or nested past the parser's depth): no pointer
        return {}
    if not isinstance(data, dict) or data.get(_POINTER_KEY) != 1:
        return {}
    repo, number, archive_id = data.get("repository"), data.get("generation"), data.get("archive_id")
    if (not isinstance(repo, str) or not repo or isinstance(number, bool) or not isinstance(number, int)
            or number < 1 or not isinstance(archive_id, str)):
        if not quiet:
            _LOG.warning("%s looks like a ckpt-archive pointer but its fields are not valid; ignored", text)
        return {}
    return {"repository": repo, "generation": number, "archive_id": archive_id}


def _remove_pointer(path: Any, generation: int | None = None, identity: tuple[int, int] | None = None) -> None:
    """Delete the pointer file at ``path`` if it is one this plugin wrote (never another file; with ``generation``,
    only one naming that generation; with ``identity``, only that very file, ``(st_dev, st_ino)``). A symbolic link
    at ``path`` is never followed nor deleted: it is no pointer."""
    text = os.fspath(path)
    if _is_local(text):
        p = _local(text)
        _pointer_in(p.parent, p.name, text, True, remove=True, generation=generation, identity=identity)


def _tag_of(path: Any) -> str:
    name = Path(os.fspath(path)).name
    if not name:
        raise UsageError(f"checkpoint path {os.fspath(path)!r} has no file name to tag the generation with")
    return name


def _monitored(checkpoint: Any) -> dict | None:
    """``{monitor: current score}`` of every ``ModelCheckpoint`` state in the checkpoint (a one-element tensor or
    a number), so retention can keep the best generations by it."""
    out: dict = {}
    callbacks = checkpoint.get("callbacks") if isinstance(checkpoint, dict) else None
    if not isinstance(callbacks, dict):
        return None
    for state in callbacks.values():
        if not isinstance(state, dict):
            continue
        monitor, score = state.get("monitor"), state.get("current_score")
        if not isinstance(monitor, str) or score is None:
            continue
        if hasattr(score, "numel") and score.numel() == 1:
            score = score.item()
        if isinstance(score, (int, float)) and not isinstance(score, bool):
            out[monitor] = score
    return out or None


__all__ = ["ArchiveCheckpointIO"]
