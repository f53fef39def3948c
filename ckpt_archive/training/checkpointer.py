"""``Checkpointer``: save from inside the training loop without stalling it, on one process or many.

::

    with ckpt_archive.Checkpointer("backups/run1", retention=RetentionPolicy(keep_last=3),
                                   config=cfg, data_ids=ids) as ckpt:
        restored = ckpt.restore(model=model, optimizer=opt, scheduler=sched)   # None on a fresh start
        for step in range(restored.step + 1 if restored else 0, steps):
            train_one_step()
            if step % 500 == 0:
                ckpt.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "scheduler": sched.state_dict(), "rng": rng_state()}, {"loss": loss})

What blocks the training thread (:meth:`Checkpointer.save`): waiting for the previous save (if still in
flight), then a copy of the state (:class:`~ckpt_archive.training.snapshot.Snapshotter`: tensor storages
copied into buffers reused from save to save, device -> host into pinned buffers for GPU tensors). From
then on the live state may change. Everything else runs in one background thread: encoding, writing,
verify, trial reload, publish and retention, through :func:`ckpt_archive.ops.pack.pack`, the very path
``ckpt-archive pack`` takes (one process), or through
:mod:`ckpt_archive.training.distributed` (many processes, one generation, the same publish lifecycle).
So a generation it makes is one ``pack`` of the same state would make: same format, same checks.

At most one save is in flight: the next :meth:`save` waits for it. Skipping instead would silently thin
out the resume points a user asked for, and queueing several would hold several copies of the state in
memory; waiting keeps memory at one copy (the reused buffers) and makes a too-frequent save visible as
blocked time (:attr:`SaveHandle.waited_s`). A failure in the background is raised by the next
:meth:`save`, :meth:`wait` or :meth:`close` (the original exception, with a note naming the step), once;
it is never lost.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from ckpt_archive.errors import UsageError
from ckpt_archive.ops.common import RepoLike

if TYPE_CHECKING:
    from ckpt_archive.ops.pack import PackOptions, PackResult
    from ckpt_archive.repo.repository import Generation
    from ckpt_archive.retention.policy import RetentionPolicy
    from ckpt_archive.training.restore import RestoreReport

_LOG = logging.getLogger("ckpt_archive.checkpointer")

#: How long a background save may wait for another writer's repository lock, seconds.
DEFAULT_LOCK_WAIT = 60.0


class SaveHandle:
    """One :meth:`Checkpointer.save`: its timings now, its result once the background is done.

    Attributes:
        step: the step saved. waited_s: seconds the caller waited for the previous save.
        snapshot_s: seconds the copy of the state took. blocked_s: ``waited_s + snapshot_s``, what the
            training loop lost to this call (plus the publish itself when ``block=True``).
        snapshot_bytes: tensor bytes copied.
    """

    def __init__(self, step: int, future: concurrent.futures.Future, waited_s: float, snapshot_s: float,
                 snapshot_bytes: int):
        self.step = step
        self._future = future
        self.waited_s = waited_s
        self.snapshot_s = snapshot_s
        self.blocked_s = waited_s + snapshot_s
        self.snapshot_bytes = snapshot_bytes

    def done(self) -> bool:
        """True once the background write finished (published or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> "PackResult":
        """Wait for the background write and return its :class:`~ckpt_archive.ops.pack.PackResult`.

        Raises:
            whatever the background write raised; concurrent.futures.TimeoutError after ``timeout`` s.
        """
        return self._future.result(timeout)


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpointer.restore` restored.

    Attributes:
        generation: the generation restored. step: its progress step (None when it has none).
        state: the state as loaded (this rank's view under torch.distributed).
        report: the :class:`~ckpt_archive.training.restore.RestoreReport`.
    """

    generation: int
    step: int | None
    state: Any
    report: "RestoreReport"


class Checkpointer:
    """Asynchronous, verified checkpoints from inside the training loop (see the module docstring).

    Args:
        repo: repository path/URL (created if absent) or an open Repository. Under torch.distributed
            every rank must see the same repository (a shared filesystem or an object store URL).
        retention: a :class:`~ckpt_archive.retention.policy.RetentionPolicy` run after each publish;
            None applies the repository's default policy, if any.
        config: the experiment's parameters (dict or path), recorded in every manifest.
        data_ids: data identity (list/dict or path), stored as a member of every generation.
        tags: labels for every generation (``save(..., tags=)`` adds more).
        code_version: free text recorded with the git commit.
        options: :class:`~ckpt_archive.ops.pack.PackOptions` (level, jobs, chunk size); its ``wait`` (lock
            wait, seconds) defaults to ``DEFAULT_LOCK_WAIT`` here.
        pin_memory: pinned host buffers for GPU tensors (default True).
        process_group: the torch.distributed group whose ranks write one generation together; None uses
            the default group when one is initialised (then every rank must call
            ``Checkpointer(...)``, ``save``, ``wait`` and ``close`` in the same order).
        distributed: force (True) or forbid (False) the many-process path; None decides as above.
        timeout: seconds a rank waits for the others at each step of a distributed save (default 600).

    Raises:
        UsageError: bad arguments (retention of the wrong type, distributed=True with no process group).
    """

    def __init__(self, repo: RepoLike, *, retention: "RetentionPolicy | None" = None, config: Any = None,
                 data_ids: Any = None, tags: tuple[str, ...] | str = (), code_version: str | None = None,
                 options: "PackOptions | None" = None, pin_memory: bool = True, process_group: Any = None,
                 distributed: bool | None = None, timeout: float = 600.0):
        from ckpt_archive.ops.pack import PackOptions
        from ckpt_archive.training.snapshot import Snapshotter

        if retention is not None:
            from ckpt_archive.retention.policy import RetentionPolicy

            if not isinstance(retention, RetentionPolicy):
                raise UsageError(f"retention must be a RetentionPolicy or None, not {type(retention).__name__}")
        if options is None:
            options = PackOptions(wait=DEFAULT_LOCK_WAIT)
        self.retention = retention
        self.config = config
        self.data_ids = data_ids
        self.tags = (tags,) if isinstance(tags, str) else tuple(tags)
        self.code_version = code_version
        self.options = options
        self._dist = None
        if _use_distributed(distributed, process_group):
            from ckpt_archive.training.distributed import DistributedWriter

            self._dist = DistributedWriter(repo, process_group, timeout=timeout)
            self.repo = self._dist.repo
            self._snap = Snapshotter(pin_memory=pin_memory, on_dtensor=self._dist.note_dtensor)
        else:
            from ckpt_archive.ops.common import open_repo

            self.repo = open_repo(repo, create=True)
            self._snap = Snapshotter(pin_memory=pin_memory)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-checkpointer")
        self._inflight: SaveHandle | None = None
        self._last: "PackResult | None" = None
        self._closed = False

    # -- saving --------------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, metrics: Any = None, *, block: bool = False,
             tags: tuple[str, ...] | str = ()) -> SaveHandle:
        """Take a consistent copy of ``state`` and archive it in the background.

        Returns once the copy is taken (after waiting for the previous save, if still in flight): the live
        state may change from then on without changing the archive.

        Args:
            step: the training step this state follows (recorded as the manifest's progress step; >= 0).
            state: the nested training state (tensors on any device, NumPy arrays, plain values; DTensors
                under torch.distributed).
            metrics: a dict of plain values (checked here, so a bad value fails this call, not later).
            block: wait until the generation is usable (then ``handle.result()`` is ready).
            tags: labels for this generation, in addition to the checkpointer's.

        Returns:
            :class:`SaveHandle` (timings; ``result()`` gives the PackResult).

        Raises:
            the previous background save's exception (see the module docstring); UsageError: bad step,
            closed checkpointer; SourceError: metrics that cannot be recorded; with ``block=True`` this
            save's own failure.
        """
        from ckpt_archive.format.metrics import metrics_to_json

        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int, not {step!r}")
        metrics_to_json(metrics)  # refuse bad metrics in the caller's thread
        t0 = time.perf_counter()
        self._finish_previous()
        t1 = time.perf_counter()
        if self._dist is not None:
            self._dist.begin_snapshot()
        snap = self._snap.take(state)
        t2 = time.perf_counter()
        extra = (tags,) if isinstance(tags, str) else tuple(tags)
        fut = self._pool.submit(self._write, step, snap, metrics, self.tags + extra)
        handle = SaveHandle(step, fut, t1 - t0, t2 - t1, self._snap.last.tensor_bytes)
        self._inflight = handle
        if block:
            self._finish_previous()
        return handle

    def _write(self, step: int, snap: Any, metrics: Any, tags: tuple[str, ...]) -> "PackResult":
        from ckpt_archive.ops.pack import Annotations, pack

        notes = Annotations(config=self.config, metrics=metrics, data_ids=self.data_ids, tags=tags,
                            code_version=self.code_version, progress={"step": step})
        if self._dist is not None:
            return self._dist.write(snap, self.options, notes, self.retention)
        return pack(snap, self.repo, self.options, notes, retention=self.retention)

    def _finish_previous(self) -> "PackResult | None":
        handle, self._inflight = self._inflight, None
        if handle is None:
            return None
        try:
            self._last = handle.result()
        except BaseException as exc:
            exc.add_note(f"(raised by the background save of step {handle.step}; that step was not archived)")
            raise
        return self._last

    def wait(self) -> "PackResult | None":
        """Wait for the save in flight, if any.

        Returns:
            the newest save's PackResult (None when nothing was saved yet).

        Raises:
            the background save's exception (once).
        """
        self._finish_previous()
        return self._last

    # -- reading ---------------------------------------------------------------------------------------------
    def latest(self) -> "Generation | None":
        """The newest usable generation of the repository now (the save in flight is not waited for).

        Returns:
            a :class:`~ckpt_archive.repo.repository.Generation`, or None when none is usable yet.
        """
        usable = self.repo.usable()
        return usable[-1] if usable else None

    def restore(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                policy: str = "session", generation: str | int = "latest", rng: bool | dict = True,
                session_lr: Any = None, keys: dict | None = None) -> Restored | None:
        """Load a generation and restore it into the live objects (after waiting for the save in flight).

        One process: :func:`ckpt_archive.load` then
        :func:`~ckpt_archive.training.restore.restore_training_state` (structure checked first, model,
        optimizer, scheduler, scaler, then RNG streams; ``policy="session"`` keeps the session's LR).
        Under torch.distributed: see :meth:`DistributedWriter.restore
        <ckpt_archive.training.distributed.DistributedWriter.restore>` (each rank its own part; models and
        optimizers through ``set_state_dict``; any world size for sharded tensors).

        Args:
            model, optimizer, scheduler, scaler: live objects (None: that part is not restored).
            policy: ``"session"`` (default; the live optimizer's LR wins) or ``"checkpoint"``. With neither
                an optimizer nor a scheduler there is no LR to keep and ``"session"`` restores as saved; a
                scheduler without its optimizer is refused under ``"session"`` (the session's LR lives in
                the optimizer, and the archived ``base_lrs`` would silently override it).
            generation: ``"latest"``, a number or ``"tag:NAME"``.
            rng, session_lr, keys: as :func:`~ckpt_archive.training.restore.restore_training_state`.

        Returns:
            :class:`Restored`, or None when ``generation="latest"`` and nothing is usable yet (a fresh start).

        Raises:
            IntegrityError: the generation fails a check (nothing wrong is restored). IncoherentState:
            structure mismatch (nothing restored). NotFound: a named generation does not exist.
        """
        from ckpt_archive.errors import NoUsableGeneration
        from ckpt_archive.training.restore import restore_training_state

        from ckpt_archive.errors import UsageError

        self.wait()
        if optimizer is None and policy == "session":
            if scheduler is not None:
                raise UsageError("restore(policy='session') with a scheduler needs its optimizer= too: the session's "
                                 "LR lives in the optimizer, and the archived scheduler.base_lrs would override it at "
                                 "the next scheduler.step(); pass optimizer=, or policy='checkpoint' to take the "
                                 "archived LRs on purpose")
            policy = "checkpoint"  # no optimizer and no scheduler: no LR to keep
        if self._dist is not None:
            return self._dist.restore(generation, model=model, optimizer=optimizer, scheduler=scheduler,
                                      scaler=scaler, policy=policy, rng=rng, session_lr=session_lr)
        from ckpt_archive.ops.common import pick
        from ckpt_archive.repo.reader import ArchiveReader

        try:
            gen = pick(self.repo, generation)
        except NoUsableGeneration:
            if str(generation) == "latest" and not self.repo.usable():
                return None
            raise
        reader = ArchiveReader(self.repo.store, gen.key, gen.manifest, jobs=self.options.jobs)
        tree = reader.tree()
        from ckpt_archive.training.distributed import is_distributed_tree

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

    # -- lifetime --------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this Checkpointer is closed")

    def close(self) -> "PackResult | None":
        """Wait for the save in flight, then stop the background thread (idempotent).

        Returns:
            the newest save's PackResult, or None.

        Raises:
            the background save's exception (once).
        """
        if self._closed:
            return self._last
        try:
            return self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            if self._dist is not None:
                self._dist.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body failed: still finish the save in flight, but never hide the body's exception
            self.close()
        except BaseException as bg:  # noqa: BLE001 - reported on the body's exception
            exc.add_note(f"also, the background save failed: {type(bg).__name__}: {bg}")
            _LOG.error("background save failed while the training loop was failing: %s", bg)


def _use_distributed(distributed: bool | None, group: Any) -> bool:
    if distributed is False:
        return False
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        dist = None
    ready = dist is not None and dist.is_available() and dist.is_initialized()
    if distributed and not ready:
        raise UsageError("distributed=True needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group)")
    # an initialised group of one rank takes the same path (its live DTensors need the resharding restore)
    return ready


__all__ = ["Checkpointer", "SaveHandle", "Restored", "DEFAULT_LOCK_WAIT"]
