"""What a :class:`~ckpt_archive.training.checkpointer.Checkpointer` needs from its process before the first
save, done once when it is built: whether torch.distributed is in use, the modules its background write imports,
and the first calls of the torch operations its copy makes.

[issue 29] A first save is meant to cost what a later one does (<= 2x a ``clone()`` of the state). Each of these
made it cost more, measured on a quiet box (benchmarks/README.md, eleventh round): imported by the background
thread while a save made right after construction copied, the write's modules held the GIL and every torch call
of the copy waited its turn (a first save of 64 MiB: 8x a clone); and each torch operation's first call in a
process is 10-130 us slower than later ones (a 4x4 state: 3x a clone).
"""
from __future__ import annotations

import importlib
import queue
from typing import Any

from ckpt_archive.errors import UsageError
from ckpt_archive.training.snapshot import loaded, warm_up


def import_publish_path(distributed: bool, retention: bool) -> None:
    """Import what the background write needs (pack, the writer, the trial reload, safetensors, zstandard; the
    distributed writer and prune when ``distributed`` / ``retention``). A module that cannot be imported is
    left for the write to report, with its context."""
    names = ["ckpt_archive.ops.pack", "ckpt_archive.format.state_tree", "ckpt_archive.sources",
             "ckpt_archive.repo.writer", "ckpt_archive.repo.trial_reload", "ckpt_archive.repo.objects",
             "ckpt_archive.format.codec", "safetensors", "safetensors.torch", "zstandard"]
    if distributed:
        names += ["ckpt_archive.training.distributed", "ckpt_archive.ops.dist_pack"]
    if retention:
        names += ["ckpt_archive.ops.prune"]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def prepare(jobs: "queue.SimpleQueue", *, distributed: bool, retention: bool) -> None:
    """The once-per-Checkpointer preparation, in the caller's thread when torch is imported: the publish path's
    modules (~0.15 s), then the copy's torch operations run once (:func:`~ckpt_archive.training.snapshot.warm_up`;
    after those imports, which register torch operations of their own: warmed before them, a first save of a
    4x4 state still took 0.4 ms against 0.1 later).

    Without torch imported (yet), the imports are queued on ``jobs`` for the background thread: they import
    torch (safetensors.torch, ~1.5 s), which in the caller's thread cost a plain-value state's construction
    1.5 s, and a Ctrl-C in the middle of it left torch unimportable in the process (break test); there is no
    tensor copy for them to slow down.
    """
    if loaded("torch") is None:
        jobs.put((import_publish_path, (distributed, retention)))
        return
    import_publish_path(distributed, retention)
    warm_up()


def use_distributed(distributed: bool | None, group: Any) -> bool:
    """Whether a Checkpointer writes through torch.distributed: ``distributed`` when given (True needs an
    initialised process group), else whether one is initialised (a group of one rank included: its live
    DTensors need the resharding restore).

    Raises:
        UsageError: ``distributed=True`` without an initialised process group.
    """
    if distributed is False:
        return False
    if distributed is None and loaded("torch") is None:
        # torch not imported, or still being imported by another thread: no process group can be initialised
        # yet, and importing torch.distributed from a half-imported torch aborted the process ("terminate
        # called after throwing an instance of 'python_error'": break test)
        return False
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        dist = None
    ready = dist is not None and dist.is_available() and dist.is_initialized()
    if distributed and not ready:
        raise UsageError("distributed=True needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group)")
    return ready


__all__ = ["import_publish_path", "prepare", "use_distributed"]
