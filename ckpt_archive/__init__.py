"""ckpt-archive: turn a training checkpoint (a resume point) into an archive people can trust.

Public API (plain functions; the CLI is a thin shell over them)::

    pack(source, repo, PackOptions(...), Annotations(...), retention=RetentionPolicy(...))
                                            -> PackResult   (generation, status "usable", ...)
    load(repo, generation="latest")         -> the nested state (dict/list/tuple/tensors/values)
    verify(repo, generation="latest", deep) -> VerifyReport (ok, problems)
    restore(repo, generation, output, ...)  -> RestoreResult
    list_generations(repo, all=False)       -> list[Generation]
    adopt(repo)                             -> AdoptReport  (every copied generation proven and marked usable here)
    status(repo, max_age=...)               -> StatusReport (watchdog: newest usable generation fresh and advancing?)
    export(repo, dest, ...)                 -> ExportResult (copied, re-read and trial-reloaded at dest)
    prune(repo, policy=None, dry_run=False) -> PruneResult  (retention; never leaves nothing restorable)
    forget(repo, generation, force=False)   -> ForgetResult (one generation, marker first, under the lock)
    gc(repo, dry_run=False)                 -> GcResult     (leftovers of interrupted writes)
    backup(source, repo, ...)               -> BackupResult (one idempotent run, for cron; exit_code 75 = retry)
    restore_training_state(state, model=, optimizer=, scheduler=, ...) -> RestoreReport
    check_resume(...)                       -> resume check of a training command (see docs/check-resume.md)
    Checkpointer(repo, retention=, config=, data_ids=)  -> save(step, state) from the training loop, in the
                                            background; one process or torch.distributed (docs/checkpointer.md)

Trainer integrations (optional extras, imported only when their module is): ``ckpt_archive.integrations.transformers``
(``ArchiveCallback``, ``restore_checkpoint``), ``ckpt_archive.integrations.lightning`` (``ArchiveCheckpointIO``),
``ckpt_archive.integrations.folder`` (``FolderPublisher``, the Accelerate recipe); docs/integrations-*.md.

Heavy imports (torch, safetensors) happen inside the functions, so ``import ckpt_archive`` is cheap.
"""
from __future__ import annotations

__version__ = "0.1.0"

_API = {
    "pack": "ops.pack", "PackOptions": "ops.pack", "Annotations": "ops.pack", "PackResult": "ops.pack",
    "load": "ops.load", "verify": "ops.verify", "VerifyReport": "ops.verify", "restore": "ops.restore",
    "RestoreResult": "ops.restore", "inspect": "ops.inspect", "list_generations": "ops.list",
    "Problem": "repo.reader", "Repository": "repo.repository", "Generation": "repo.repository",
    "RetentionPolicy": "retention.policy",
    "restore_training_state": "training.restore", "Checkpointer": "training.checkpointer", "export": "ops.export", "check_resume": "resume.check",
    "Trajectory": "resume.trajectory",
    "adopt": "ops.verify", "AdoptReport": "ops.verify", "status": "ops.status", "StatusReport": "ops.status",
    "prune": "ops.prune", "PruneResult": "ops.prune", "forget": "ops.forget", "ForgetResult": "ops.forget",
    "gc": "ops.gc", "GcResult": "ops.gc", "backup": "ops.backup", "BackupResult": "ops.backup",
}


def __getattr__(name: str):
    mod = _API.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckpt_archive' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ckpt_archive.{mod}"), name)


def __dir__():
    return sorted(list(globals()) + list(_API))
