"""ckpt-archive: turn a training checkpoint (a resume point) into an archive people can trust.

Public API (plain functions; the CLI is a thin shell over them)::

    pack(source, repo, PackOptions(...), Annotations(...), retention=RetentionPolicy(...))
                                            -> PackResult   (generation, status "usable", ...)
    load(repo, generation="latest", LoadOptions(...))     -> the nested state (dict/list/tuple/tensors/values)
    verify(repo, generation="latest", VerifyOptions(...)) -> VerifyReport (ok, problems)
    restore(repo, generation, output, RestoreOptions(...)) -> RestoreResult
    inspect(repo, generation="latest")      -> InspectResult (manifest, marker, summary, policy audit)
    list_generations(repo, all=False)       -> list[Generation]
    adopt(repo)                             -> AdoptReport  (every copied generation proven and marked usable here)
    status(repo, max_age=...)               -> StatusReport (watchdog: newest usable generation fresh and advancing?)
    export(repo, dest, ExportOptions(...))  -> ExportResult (copied, re-read and trial-reloaded at dest)
    prune(repo, policy=None, dry_run=False) -> PruneResult  (retention; never leaves nothing restorable)
    forget(repo, generation, force=False)   -> ForgetResult (one generation, marker first, under the lock)
    gc(repo, dry_run=False)                 -> GcResult     (leftovers of interrupted writes)
    backup(source, repo, BackupOptions(...)) -> BackupResult (one idempotent run, for cron; exit_code 75 = retry)
    restore_training_state(state, model=, optimizer=, scheduler=, ...) -> RestoreReport
    check_resume(...)                       -> resume check of a training command (see docs/check-resume.md)
    Checkpointer(repo, retention=, config=, data_ids=)  -> save(step, state) from the training loop, in the
                                            background; one process or torch.distributed (docs/checkpointer.md)

Trainer integrations (optional extras, imported only when their module is): ``ckpt_archive.integrations.transformers``
(``ArchiveCallback``, ``restore_checkpoint``), ``ckpt_archive.integrations.lightning`` (``ArchiveCheckpointIO``),
``ckpt_archive.integrations.folder`` (``FolderPublisher``, the Accelerate recipe); docs/integrations-*.md.

Every operation takes the same names (``store_options``, ``wait``, ``on_bytes``, ``jobs``); pack, load, verify,
restore and backup take their options as one frozen options object, never as loose keywords. Each refuses
keyword arguments it does not know, and returns a typed result with ``to_json()``: docs/api.md.

Heavy imports (torch, safetensors) happen inside the functions, so ``import ckpt_archive`` is cheap.
"""
from __future__ import annotations

__version__ = "0.1.0"

_API = {
    # operations (plain functions) and the options objects they take
    "pack": "ops.pack", "PackOptions": "ops.pack", "Annotations": "ops.pack",
    "load": "ops.load", "LoadOptions": "ops.load", "verify": "ops.verify", "VerifyOptions": "ops.verify",
    "restore": "ops.restore", "RestoreOptions": "ops.restore",
    "inspect": "ops.inspect", "list_generations": "ops.list", "adopt": "ops.verify", "status": "ops.status",
    "export": "ops.export", "ExportOptions": "ops.export", "prune": "ops.prune", "forget": "ops.forget", "gc": "ops.gc", "backup": "ops.backup",
    "BackupOptions": "ops.backup",
    "restore_training_state": "training.restore", "check_resume": "resume.check",
    # their typed results (each with to_json())
    "PackResult": "ops.pack", "VerifyReport": "ops.verify", "RestoreResult": "ops.restore",
    "InspectResult": "ops.inspect", "AdoptReport": "ops.verify", "StatusReport": "ops.status",
    "ExportResult": "ops.export", "ExportedGeneration": "ops.export", "PruneResult": "ops.prune",
    "ForgetResult": "ops.forget", "GcResult": "ops.gc", "BackupResult": "ops.backup",
    "RestoreReport": "training.restore", "PolicyVerdict": "ops.policy_check", "Problem": "repo.reader",
    # the objects they work on
    "Repository": "repo.repository", "Generation": "repo.repository", "RetentionPolicy": "retention.policy",
    "Checkpointer": "training.checkpointer", "Trajectory": "resume.trajectory",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    mod = _API.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckpt_archive' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ckpt_archive.{mod}"), name)


def __dir__():
    return sorted(list(globals()) + list(_API))
