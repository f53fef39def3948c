"""ckpt-archive: turn a training checkpoint (a resume point) into an archive people can trust.

Public API (plain functions; the CLI is a thin shell over them)::

    pack(state_or_path, repo, ...)          -> PackResult   (generation, status "usable", ...)
    load(repo, generation="latest")         -> the nested state (dict/list/tuple/tensors/values)
    verify(repo, generation="latest", deep) -> VerifyReport (ok, problems)
    restore(repo, generation, output, ...)  -> RestoreResult
    list_generations(repo, all=False)       -> list[Generation]
    export(repo, dest, ...)                 -> ExportResult (copied, re-read and trial-reloaded at dest)
    restore_training_state(state, model=, optimizer=, scheduler=, ...) -> RestoreReport
    check_resume(...)                       -> resume check of a training command (see docs/check-resume.md)

Heavy imports (torch, safetensors) happen inside the functions, so ``import ckpt_archive`` is cheap.
"""
from __future__ import annotations

__version__ = "0.1.0"

_API = {
    "pack": "ops.api", "load": "ops.api", "verify": "ops.api", "restore": "ops.api", "inspect": "ops.api",
    "list_generations": "ops.api", "PackResult": "ops.api", "VerifyReport": "ops.api", "Problem": "repo.archive",
    "RestoreResult": "ops.api", "Repository": "repo.repository", "Generation": "repo.repository",
    "restore_training_state": "training.restore", "export": "ops.export", "check_resume": "resume.check",
    "Trajectory": "resume.trajectory",
}


def __getattr__(name: str):
    mod = _API.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckpt_archive' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ckpt_archive.{mod}"), name)


def __dir__():
    return sorted(list(globals()) + list(_API))
