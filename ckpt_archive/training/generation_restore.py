"""A generation read and restored into a session's live objects on one process (the Checkpointer's restore).

:meth:`ckpt_archive.training.checkpointer.Checkpointer.restore` on one process: the generation picked
(``latest``, a number, ``tag:NAME``), read with every check (:func:`ckpt_archive.ops.common.open_reader`),
and put into the live model, optimizer, scheduler and scaler by
:func:`~ckpt_archive.training.restore.restore_training_state`; a generation written by several ranks is
consolidated first (:mod:`ckpt_archive.training.dist_restore`: sharded tensors assembled, saved rank 0's
per-rank values). Under torch.distributed each rank restores its own part instead
(:func:`ckpt_archive.training.dist_restore.restore_distributed`).
"""
from __future__ import annotations

from typing import Any

from ckpt_archive.errors import AllGenerationsDamaged, NoUsableGeneration
from ckpt_archive.training.restore import Restored, restore_training_state


def restore_generation(repo, generation: str | int, *, jobs: int | None, model: Any, optimizer: Any, scheduler: Any,
                       scaler: Any, policy: str, rng: bool | dict, session_lr: Any, keys: dict | None) -> Restored | None:
    """Read ``generation`` of ``repo`` and restore it into the live objects (one process).

    Args:
        repo: the open :class:`~ckpt_archive.repo.repository.Repository`. generation: ``"latest"``, a number
            or ``"tag:NAME"``. jobs: decoder threads (None: the default).
        model, optimizer, scheduler, scaler, policy, rng, session_lr, keys: as
            :func:`~ckpt_archive.training.restore.restore_training_state` (``policy`` already settled by the
            caller: :meth:`~ckpt_archive.training.checkpointer.Checkpointer.restore`).

    Returns:
        :class:`~ckpt_archive.training.restore.Restored`, or None when ``generation="latest"`` and nothing is
        usable yet (a fresh start): no generation, or only partial ones (a first save that never finished), or
        none this version can judge. Never when every published generation was found damaged: that is
        :class:`~ckpt_archive.errors.AllGenerationsDamaged` (its ``for_resume``).

    Raises:
        AllGenerationsDamaged (exit 1): every published generation is damaged; a fresh start would silently
            throw the run's progress away (and let retention remove what might still be recovered).
        IntegrityError: the generation fails a check (nothing wrong is restored). IncoherentState: structure
        mismatch (nothing restored). NotFound / NoUsableGeneration: a named generation does not exist or is
        not usable.
    """
    from ckpt_archive.ops.common import open_reader, pick

    try:
        gen = pick(repo, generation)
    except NoUsableGeneration as exc:
        if str(generation) == "latest" and not repo.usable() and not isinstance(exc, AllGenerationsDamaged):
            return None
        raise exc.for_resume() if isinstance(exc, AllGenerationsDamaged) else exc
    reader = open_reader(repo, gen, jobs=jobs)
    tree = reader.tree()
    from ckpt_archive.ops.dist_pack import is_distributed_tree

    if is_distributed_tree(tree):  # written by several ranks: consolidated here (saved rank 0's RNG)
        from ckpt_archive.training.dist_restore import apply_state, load_view

        state = load_view(reader, tree, 0)
        notes = [f"generation {gen.number} was saved by {len(tree['ranks'])} ranks and is restored on one "
                 f"process: sharded tensors consolidated; per-rank values (RNG states) are saved rank 0's"]
        report = apply_state(state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                             policy=policy, rng=rng, session_lr=session_lr, notes=notes)
        return Restored(gen.number, (gen.manifest.get("progress") or {}).get("step"), state, report)
    state = reader.load_node(tree)
    report = restore_training_state(state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                    rng=rng, policy=policy, session_lr=session_lr, keys=keys)
    return Restored(gen.number, (gen.manifest.get("progress") or {}).get("step"), state, report)


__all__ = ["restore_generation"]
