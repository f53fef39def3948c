"""Hugging Face Transformers: every ``checkpoint-N/`` the Trainer writes becomes a verified generation.

::

    from ckpt_archive.integrations.transformers import ArchiveCallback, restore_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ArchiveCallback("backups/run1", retention=RetentionPolicy(keep_last=3),
                                                 export_to="s3://bucket/run1")])
    trainer.train(resume_from_checkpoint=restore_checkpoint("backups/run1", args.output_dir))  # on a new machine

:class:`ArchiveCallback` hooks ``on_save``, which the Trainer calls after it wrote ``checkpoint-N/`` (weights,
``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json``) and rotated older folders. On
the main process only (``state.is_world_process_zero``), after every process finished writing its files (a
barrier when ``torch.distributed`` is initialised), the folder is handed to a
:class:`~ckpt_archive.integrations.folder.FolderPublisher`: hard-linked into a snapshot (the stall; no bytes
copied) and packed in a background thread by the Trainer-folder source (``sources/hf.py``), verified,
trial-reloaded, published, then retention. ``on_train_end`` waits for the publish in flight and, with
``export_to``, exports the usable generations there (copied, re-read and trial-reloaded at the destination) and
writes the recovery proof. See docs/integrations-transformers.md.

This module imports ``transformers`` (``pip install ckpt-archive[transformers]``); ``import ckpt_archive`` does not.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ckpt_archive.errors import UsageError

if TYPE_CHECKING:
    from ckpt_archive.ops.export import ExportResult
    from ckpt_archive.ops.pack import PackOptions
    from ckpt_archive.retention.policy import RetentionPolicy

_LOG = logging.getLogger("ckpt_archive.integrations")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$", re.ASCII)
#: log_history keys that are progress or run totals, not metrics of the model
_NOT_METRICS = frozenset({"step", "epoch", "total_flos", "train_runtime", "train_samples_per_second",
                          "train_steps_per_second", "eval_runtime", "eval_samples_per_second",
                          "eval_steps_per_second", "num_input_tokens_seen"})


class ArchiveCallback(TrainerCallback):
    """A ``TrainerCallback`` that archives every checkpoint the Trainer saves (see the module docstring).

    Args:
        repo: repository path or URL (created if absent).
        retention: a :class:`~ckpt_archive.retention.policy.RetentionPolicy` run after each publish (None: the
            repository's default policy, if any). Independent of the Trainer's ``save_total_limit``, which
            rotates the folders in ``output_dir`` only.
        export_to: a destination (path or ``s3://bucket/prefix``): ``on_train_end`` exports there.
        export_generations: which usable generations to export (``"all"``, ``"latest"``, ``"latest:N"``, ...;
            :func:`ckpt_archive.ops.export.select_generations`). Default ``"all"``.
        report: where the recovery proof goes (Markdown); default ``<output_dir>/recovery-proof-<UTC time>.md``.
        export_options: for :func:`ckpt_archive.export`: :class:`~ckpt_archive.ops.export.ExportOptions` fields (``to_key_file``, ``to_plain``, ...) and its keywords (``dest_store_options``,
            ``wait``).
        config: the experiment's parameters to record (dict or path); default the ``TrainingArguments`` as
            ``TrainingArguments.to_json_string`` writes them (tokens masked by transformers).
        data_ids: data identity (list/dict or path), stored with every generation.
        tags: labels for every generation.
        code_version: free text recorded with the git commit.
        options: :class:`~ckpt_archive.ops.pack.PackOptions` (lock wait defaults to 60 s).
        block: publish synchronously in ``on_save`` (the Trainer waits for verify and trial reload).
        staging: where snapshots go (default ``<output_dir>/_ckpt-archive-staging``, same file system).

    Attributes:
        export_result: the :class:`~ckpt_archive.ops.export.ExportResult` of ``on_train_end`` (None before).
        last: the newest publish's :class:`~ckpt_archive.ops.pack.PackResult` (None before the first).

    Raises (from the Trainer's calls): a publish's failure at the next ``on_save`` or at ``on_train_end``
    (training stops: a checkpoint was not archived); the export's failure at ``on_train_end``.
    """

    def __init__(self, repo: Any, retention: "RetentionPolicy | None" = None, export_to: Any = None, *,
                 export_generations: Any = "all", report: str | os.PathLike | None = None,
                 export_options: dict | None = None, config: Any = None, data_ids: Any = None,
                 tags: tuple[str, ...] | str = (), code_version: str | None = None,
                 options: "PackOptions | None" = None, block: bool = False,
                 staging: str | os.PathLike | None = None):
        if retention is not None:
            from ckpt_archive.retention.policy import RetentionPolicy

            if not isinstance(retention, RetentionPolicy):
                raise UsageError(f"retention must be a RetentionPolicy or None, not {type(retention).__name__}")
        self.repo = repo
        self.retention = retention
        self.export_to = export_to
        self.export_generations = export_generations
        self.report = report
        self.export_options = dict(export_options or {})
        self.config = config
        self.data_ids = data_ids
        self.tags = tags
        self.code_version = code_version
        self.options = options
        self.block = block
        self.staging = staging
        self.export_result: "ExportResult | None" = None
        self.last = None
        self._publisher = None  # made on the main process at its first save: other ranks never touch the repo

    # -- Trainer events ---------------------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        _barrier()  # every rank's files (rng_state_<rank>.pth, shards) are on disk before rank 0 snapshots
        if not state.is_world_process_zero:
            return
        folder = _checkpoint_folder(args, state)
        publisher = self._publisher_for(args)
        publisher.publish(folder, step=int(state.global_step), metrics=_metrics(state), block=self.block)
        self.last = publisher.last

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self._publisher is None:
            return
        self.last = self._publisher.wait()
        if self.export_to is None:
            return
        import dataclasses

        from ckpt_archive.ops.export import ExportOptions, export

        report = self.report
        if report is None:
            import datetime

            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            report = Path(args.output_dir) / f"recovery-proof-{stamp}.md"
        # the repository object itself where one was given (it holds the key a path would lose); an encrypted
        # one is exported encrypted (export_options to_key_file= / to_plain=, or $CKPT_ARCHIVE_KEY_FILE)
        source = self.repo if not isinstance(self.repo, (str, os.PathLike)) else self._publisher.location
        fields = {f.name for f in dataclasses.fields(ExportOptions)}  # the rest are export()'s keywords (wait, ...)
        options = ExportOptions(generations=self.export_generations, report=report,
                                **{k: v for k, v in self.export_options.items() if k in fields})
        self.export_result = export(source, self.export_to, options,
                                    **{k: v for k, v in self.export_options.items() if k not in fields})
        exported = ", ".join(str(g.generation) for g in self.export_result.generations)
        _LOG.info("exported generation(s) %s to %s, verified and trial-reloaded there; proof: %s; restore there "
                  "with: %s", exported, self.export_result.destination, report, self.export_result.restore_command)

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _publisher_for(self, args):
        if self._publisher is None:
            from ckpt_archive.integrations.folder import FolderPublisher

            config = self.config if self.config is not None else _training_args_config(args)
            self._publisher = FolderPublisher(self.repo, retention=self.retention, config=config,
                                              data_ids=self.data_ids, tags=self.tags,
                                              code_version=self.code_version, options=self.options,
                                              staging=self.staging)
        return self._publisher

    def close(self):
        """Wait for the publish in flight and stop the background thread (``on_train_end`` only waits, so the
        callback can serve another ``train()``). Raises the background publish's failure, once."""
        if self._publisher is not None:
            self.last = self._publisher.close()
            self._publisher = None
        return self.last


def restore_checkpoint(repo: Any, output_dir: str | os.PathLike, generation: str | int = "latest", *,
                       force: bool = False) -> Path:
    """Restore a generation made from a Trainer folder as ``<output_dir>/checkpoint-N/``.

    Every byte is checked against the manifest on the way (:func:`ckpt_archive.restore`); the folder's files come
    back byte for byte (weights, ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json``,
    ``training_args.bin``), so ``trainer.train(resume_from_checkpoint=...)`` continues bit for bit where the
    archived run was.

    Safe to call from every process of a multi-process run (``torchrun``, ``accelerate launch``), as the one-line
    ``trainer.train(resume_from_checkpoint=restore_checkpoint(...))`` does: the processes that share
    ``output_dir`` take turns under a file lock (``<output_dir>/.checkpoint-N.ckpt-archive-restore.lock``, ``flock``
    through :class:`ckpt_archive.store.fs.WriterLock`); the
    first restores, the others find the folder it restored and return it. What was restored is recorded beside it
    (``.checkpoint-N.ckpt-archive-restore.json``: the generation's archive id and manifest sha256, and every
    file's size, mtime and inode), so a folder is reused only when it is exactly that restore, untouched since;
    any other ``checkpoint-N/`` already there is refused (or replaced with ``force``). Each process resolves
    ``"latest"`` itself: while another machine may still publish to the repository, pass a number.

    Args:
        repo: repository path or URL.
        output_dir: the folder to restore into (the Trainer's ``output_dir`` on the new machine); created if
            absent.
        generation: ``"latest"`` (newest usable), a number or ``"tag:NAME"``.
        force: replace an existing ``checkpoint-N/`` there (only after the restored one is complete) unless it is
            this generation's restore, unchanged since.

    Returns:
        the restored folder, ``<output_dir>/checkpoint-N`` (N: the Trainer's global step).

    Raises:
        UsageError: the generation was not packed from a Trainer ``checkpoint-N/`` folder (it was a
        ``torch.save`` file or a state from memory: use :func:`ckpt_archive.restore`). OutputExists: the folder
        exists and is not this generation's unchanged restore (without ``force``). NoUsableGeneration / NotFound:
        nothing to restore. IntegrityError: the generation fails its checks (nothing is written;
        ``ckpt-archive verify REPO --fallback`` names the newest that verifies). UnsafePath: the lock file is a
        symbolic link (nothing is written through it; remove it by hand). PermissionError: ``output_dir`` is not
        writable.
    """
    import errno

    from ckpt_archive.errors import ReadOnlyRepository
    from ckpt_archive.ops.backup import stat_snapshot
    from ckpt_archive.ops.common import open_repo, pick
    from ckpt_archive.ops.restore import RestoreOptions, restore
    from ckpt_archive.store import fs

    r = open_repo(repo)
    gen = pick(r, generation, False)
    source = gen.manifest.get("source") or {}
    if source.get("format") != "hf-trainer":
        raise UsageError(f"generation {gen.number} was packed from a {source.get('format')!r} source, not a Hugging "
                         f"Face Trainer checkpoint-N/ folder; restore it with ckpt_archive.restore(...)",
                         where=r.location)
    name = _folder_name(gen)
    root = Path(output_dir).expanduser().absolute()
    out = root / name
    record = f".{name}.ckpt-archive-restore.json"
    identity = {"archive_id": gen.manifest.get("archive_id"), "generation": gen.number,
                "manifest_sha256": gen.manifest_sha256}
    # output_dir is the root (its path, links on it included, is the caller's choice); the record and the lock in
    # it are opened O_NOFOLLOW through its descriptor, so a link planted at their names is refused or replaced,
    # never written through, and the restore itself goes through the layer's Staging
    with fs.Dir.open(root, create=True) as d:
        lock = fs.WriterLock(root, f".{name}.ckpt-archive-restore.lock")
        try:
            lock.acquire(math.inf)  # the other processes of this run wait their turn, as long as the restore takes
        except ReadOnlyRepository:  # the layer's words are for a repository; here it is the restore's target
            raise PermissionError(errno.EACCES, "output_dir is not writable here; nothing was restored",
                                  str(root)) from None
        try:
            if _restored_before(d, record, out, identity):
                return out  # another process of this run (or an earlier call) restored exactly this; untouched since
            d.unlink(record, missing_ok=True)  # the folder is about to change: an old record must not vouch for it
            # the generation picked, even if a newer one is published since
            restore(r, gen.number, out, RestoreOptions(force=force))
            d.write_atomic(record, json.dumps(dict(identity, files=stat_snapshot(out))).encode())
        finally:
            lock.release()
    return out


def _restored_before(d, record: str, out: Path, identity: dict) -> bool:
    """Whether ``out`` is the restore of ``identity`` that the record ``record`` of the open folder ``d`` describes,
    with every file as it was written then (size, mtime, inode; no entry added or removed). A record that cannot be
    read (absent, a symbolic link, over 16 MiB, not JSON) counts as none."""
    from ckpt_archive.errors import UnsafePath
    from ckpt_archive.ops.backup import stat_snapshot

    try:
        raw = d.read_file(record, 16 << 20)  # ours is a few KiB per file; never read a huge one
        if raw is None:
            return False
        saved = json.loads(raw)
        if not isinstance(saved, dict) or any(saved.get(k) != v for k, v in identity.items()):
            return False
        return out.is_dir() and not out.is_symlink() and saved.get("files") == stat_snapshot(out)
    except (OSError, ValueError, RecursionError, UnsafePath):
        return False


def _folder_name(gen) -> str:
    """``checkpoint-N`` for a generation: the source folder's own name (checked: it is read from a manifest), else
    its progress step."""
    path = (gen.manifest.get("source") or {}).get("path") or ""
    name = re.split(r"[\\/]", path)[-1] if isinstance(path, str) else ""
    if _CHECKPOINT_DIR.match(name):
        return name
    step = (gen.manifest.get("progress") or {}).get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return f"checkpoint-{step}"
    raise UsageError(f"generation {gen.number} records neither a checkpoint-N folder name nor a step",
                     where=f"generation {gen.number}")


def _checkpoint_folder(args, state) -> Path:
    """The folder the Trainer just saved: ``<output_dir>[/<trial>]/checkpoint-<global_step>``."""
    name = f"checkpoint-{state.global_step}"
    places = []
    if getattr(state, "trial_name", None):  # hyperparameter search: the Trainer's _get_output_dir
        places.append(Path(args.output_dir) / str(state.trial_name) / name)
    places.append(Path(args.output_dir) / name)
    for p in places:
        if p.is_dir():
            return p
    from ckpt_archive.errors import SourceError

    raise SourceError(f"the Trainer reported a save at step {state.global_step} but no {name}/ folder is there "
                      f"(looked in {', '.join(str(p.parent) for p in places)})", where=str(places[-1]))


def _metrics(state) -> dict:
    """The newest logged value of every numeric metric up to this step (``loss``, ``learning_rate``,
    ``grad_norm``, ``eval_loss``, ...) from ``state.log_history``; progress and throughput keys left out."""
    out: dict = {}
    for entry in state.log_history or ():
        if not isinstance(entry, dict) or (isinstance(entry.get("step"), int) and entry["step"] > state.global_step):
            continue
        for k, v in entry.items():
            if k in _NOT_METRICS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out[str(k)] = v if not isinstance(v, float) or math.isfinite(v) else str(v)
    return out


def _training_args_config(args) -> Any:
    """The TrainingArguments as transformers serialises them (tokens masked), or None if it cannot."""
    try:
        return json.loads(args.to_json_string())
    except (TypeError, ValueError, AttributeError) as exc:
        _LOG.warning("TrainingArguments not recorded as the config (%s); pass config= to ArchiveCallback", exc)
        return None


def _barrier() -> None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


__all__ = ["ArchiveCallback", "restore_checkpoint"]
