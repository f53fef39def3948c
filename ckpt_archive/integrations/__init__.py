"""Where training loops already are: one line in a trainer's own configuration.

* :mod:`ckpt_archive.integrations.transformers`: :class:`ArchiveCallback` (a Hugging Face ``TrainerCallback``:
  every ``checkpoint-N/`` the Trainer writes becomes a verified, trial-reloaded generation, in the background)
  and :func:`restore_checkpoint` (a generation back as a ``checkpoint-N/`` folder for
  ``trainer.train(resume_from_checkpoint=...)``); docs/integrations-transformers.md.
* :mod:`ckpt_archive.integrations.lightning`: :class:`ArchiveCheckpointIO` (a Lightning ``CheckpointIO`` plugin,
  synchronous or wrapped by Lightning's ``AsyncCheckpointIO``; ``ckpt_path="REPO@latest"`` resumes);
  docs/integrations-lightning.md.
* :mod:`ckpt_archive.integrations.folder`: :class:`FolderPublisher`, what the Trainer callback runs on and what
  the Accelerate recipe (``accelerator.save_state`` + ``publish``) uses: a folder a trainer has written, snapshot
  by hard links, packed in a background thread; docs/integrations-accelerate.md.

Each is an optional extra (``pip install ckpt-archive[transformers]``, ``[lightning]``, ``[accelerate]``). Nothing
here is imported by ``import ckpt_archive``, and this package imports neither transformers nor lightning: the
names below resolve on first use, each from its own module.
"""
from __future__ import annotations

_API = {
    "FolderPublisher": "folder", "PublishHandle": "folder",
    "ArchiveCallback": "transformers", "restore_checkpoint": "transformers",
    "ArchiveCheckpointIO": "lightning",
}


def __getattr__(name: str):
    mod = _API.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckpt_archive.integrations' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ckpt_archive.integrations.{mod}"), name)


def __dir__():
    return sorted(list(globals()) + list(_API))
