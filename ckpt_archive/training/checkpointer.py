"""``Checkpointer``: save from inside the training loop without stalling it, on one process or many.

::

    with ckpt_archive.Checkpointer("backups/run1", retention=RetentionPolicy(keep_last=3),
                                   config=cfg, data_ids=ids) as ckpt:
        restored = ckpt.restore(model=model, optimizer=opt, scheduler=sched)   # None on a fresh start
        for step in range(restored.step if restored else 0, total_steps):  # step: updates completed so far
            train_one_step()                                                 # one optimizer update
            if (step + 1) % 500 == 0:
                ckpt.save(step + 1, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                     "scheduler": sched.state_dict(), "rng": rng_state()}, {"loss": loss})

**What ``step`` means.** ``save(step, ...)`` records ``step`` as the generation's progress step: the number
of optimizer updates completed when the state was copied, the count Adam's ``state["step"]`` and a
per-step scheduler's ``last_epoch`` keep (so ``verify``/``inspect`` find the counters in agreement, and
``restore().step`` is where the loop resumes: the index of the next update, counted from 0).

What blocks the training thread (:meth:`Checkpointer.save`): waiting for the previous save (if still in
flight), then a copy of the state (:class:`~ckpt_archive.training.snapshot.Snapshotter`: tensor storages
copied into buffers reused from save to save, device -> host into pinned buffers for GPU tensors). From
then on the live state may change. Everything else runs in one background thread: encoding, writing,
verify, trial reload, publish and retention, through :func:`ckpt_archive.ops.pack.pack`, the very path
``ckpt-archive pack`` takes (one process), or through
:mod:`ckpt_archive.training.distributed` (many processes, one generation, the same publish lifecycle).
So a generation it makes is one ``pack`` of the same state would make: same format, same checks. The
modules that path needs are imported by that thread when the Checkpointer is built, never in the caller's
thread during a save.

**The state machine** (:class:`SaveState`, :attr:`Checkpointer.state`). One object owns the save in flight
(:class:`_Save`: its step, its future, and the snapshot buffers, which it holds from before its copy until
its background write has finished reading them), and the Checkpointer holds at most one:

==============  ==========================================================================================
``idle``        nothing in flight, no error pending: ``save`` copies at once.
``copying``     ``save`` is copying the state into the buffers (the caller's thread), or was interrupted
                doing so: the next call abandons that copy.
``publishing``  the copy was handed to the background thread, which owns it until the write finished.
``failed``      the last save failed; its error waits for the next ``save``/``wait``/``close``.
``closed``      ``close`` finished; ``save`` refuses.
==============  ==========================================================================================

Transitions: ``idle -> copying -> publishing -> idle`` (published) or ``-> failed`` (its error is raised
by the next :meth:`save`, :meth:`wait` or :meth:`close`, exactly once, and the state goes back to
``idle``). An exception at any point (a signal handler's, a timeout's, KeyboardInterrupt) leaves a state
from which the next call continues correctly:

* while ``save``/``wait``/``close`` waits for the save in flight: nothing changes; the save stays in
  flight, owns its buffers, and the next call waits for it again and raises its error if it fails;
* during the copy (``copying``): that ``save`` raises; its copy is abandoned (never published), and the
  buffers go back to the Checkpointer, which no write was reading;
* after the copy was handed over: the save publishes as if ``save`` had returned (``wait`` tells);
* in the background: the error is the save's own failure (``failed``), never lost.

The buffers are written only by a copy whose save holds them
(:meth:`~ckpt_archive.training.snapshot.Snapshotter.acquire`), and before a generation is marked usable
its write checks that its save held them from the copy to the end of its last read (the publish
lifecycle's before-publish hook, or each rank's trial-reload result under torch.distributed): a
generation marked usable holds exactly the state that its step's ``save`` copied.

Why one save in flight: the next :meth:`save` waits for it. Skipping instead would silently thin out the
resume points a user asked for, and queueing several would hold several copies of the state in memory;
waiting keeps memory at one copy (the reused buffers) and makes a too-frequent save visible as blocked
time (:attr:`SaveHandle.waited_s`). A failure in the background is raised by the next :meth:`save`,
:meth:`wait` or :meth:`close` (the original exception, with a note naming the step), once, whether or not
:meth:`SaveHandle.result` raised it already; it is never lost.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

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

#: Seconds between checks while the caller waits for the save in flight (the wait ends as soon as the save
#: does; this only bounds how long a check of :data:`_HOOK` may be late).
_WAIT_SLICE = 0.1

#: Test seam: called with the name of each point the caller's thread passes in :class:`Checkpointer` (see
#: ``_at``); tests raise exceptions from it to interrupt every state and every blocking call. None in use.
_HOOK: Callable[[str], None] | None = None


def _at(point: str) -> None:
    hook = _HOOK
    if hook is not None:
        hook(point)


class SaveState(str, enum.Enum):
    """Where a :class:`Checkpointer` stands (see the module docstring for the transitions)."""

    IDLE = "idle"
    COPYING = "copying"
    PUBLISHING = "publishing"
    FAILED = "failed"
    CLOSED = "closed"


class _Save:
    """The one owner of a save in flight: its step, its future, its snapshot (and, through the Snapshotter,
    the buffers it holds). ``phase`` goes ``copying -> queued -> publishing`` and ends ``done`` or
    ``abandoned``; the caller's thread and the background thread change it only under ``lock``."""

    def __init__(self, step: int):
        self.step = step
        self.lock = threading.Lock()
        self.phase = "copying"
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.snap: Any = None
        self.metrics: Any = None
        self.tags: tuple[str, ...] = ()
        self.shards: Any = None
        self.published: list = []  # (location, number) of the generation its write published, once it did

    def __repr__(self) -> str:
        return f"the save of step {self.step} ({self.phase})"


class SaveHandle:
    """One :meth:`Checkpointer.save`: its timings now, its result once the background is done.

    Attributes:
        step: the step saved (optimizer updates completed). waited_s: seconds the caller waited for the
            previous save.
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
            whatever the background write raised (the Checkpointer's next ``save``/``wait``/``close``
            raises it too: it owns the error); concurrent.futures.TimeoutError after ``timeout`` s.
        """
        return self._future.result(timeout)


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpointer.restore` restored.

    Attributes:
        generation: the generation restored. step: its progress step (None when it has none): for a
            generation a Checkpointer saved, the optimizer updates completed, i.e. the 0-based index of
            the next update, where the loop resumes.
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
        from ckpt_archive.format.metrics import metrics_to_json  # what save() runs in the caller's thread
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
        self._metrics_to_json = metrics_to_json
        self._dist = None
        if _use_distributed(distributed, process_group):
            from ckpt_archive.training.distributed import DistributedWriter

            self._dist = DistributedWriter(repo, process_group, timeout=timeout)
            self.repo = self._dist.repo
        else:
            from ckpt_archive.ops.common import open_repo

            self.repo = open_repo(repo, create=True)
        self._snap = Snapshotter(pin_memory=pin_memory)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-checkpointer")
        # the publish path's modules, imported by the background thread now (a first save would otherwise
        # wait for them, or import them in the caller's thread)
        self._pool.submit(_import_publish_path, self._dist is not None, retention is not None)
        self._current: _Save | None = None       # the one save in flight (copying or publishing)
        self._error: BaseException | None = None  # a failed save's error, not yet raised (state "failed")
        self._raised: BaseException | None = None  # the last background error raised (for __exit__)
        self._last: "PackResult | None" = None
        self._closed = False

    @property
    def state(self) -> SaveState:
        """Where this Checkpointer stands now (:class:`SaveState`; see the module docstring)."""
        if self._closed:
            return SaveState.CLOSED
        rec = self._current
        if rec is not None and rec.phase == "copying":
            return SaveState.COPYING
        if rec is not None and rec.phase != "abandoned":
            if not rec.future.done():
                return SaveState.PUBLISHING
            if rec.future.exception() is not None:
                return SaveState.FAILED
        return SaveState.FAILED if self._error is not None else SaveState.IDLE

    # -- saving --------------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, metrics: Any = None, *, block: bool = False,
             tags: tuple[str, ...] | str = ()) -> SaveHandle:
        """Take a consistent copy of ``state`` and archive it in the background.

        Returns once the copy is taken (after waiting for the previous save, if still in flight): the live
        state may change from then on without changing the archive.

        Args:
            step: the number of optimizer updates completed when ``state`` was taken (>= 0): 100 after the
                100th ``optimizer.step()``, the count Adam's ``state["step"]`` keeps. Recorded as the
                manifest's progress step; ``restore().step`` gives it back (the 0-based index of the next
                update). ``verify``/``inspect`` compare it with the optimizer's own counter
                (docs/checkpointer.md, "What step means").
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
            save's own failure. An exception raised while this call waits or copies (KeyboardInterrupt, a
            signal handler's) propagates: the save in flight stays in flight; a copy that was not handed
            over is abandoned (this step is not saved).
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative int (optimizer updates completed), not {step!r}")
        self._metrics_to_json(metrics)  # refuse bad metrics in the caller's thread
        extra = (tags,) if isinstance(tags, str) else tuple(tags)
        t0 = time.perf_counter()
        _at("save")
        self._settle(wait=True)   # publishing -> idle | failed
        self._raise_pending()     # failed -> idle (raises)
        t1 = time.perf_counter()
        rec = _Save(step)
        self._current = rec       # idle -> copying: from here rec is reachable, whatever interrupts us
        _at("copy")
        try:
            self._snap.acquire(rec)
            _at("copy-acquired")
            if self._dist is not None:
                from ckpt_archive.training.distributed import ShardNotes

                rec.shards = ShardNotes()
            rec.snap = self._snap.take(state, owner=rec, on_dtensor=rec.shards.add if rec.shards else None)
            rec.metrics, rec.tags = metrics, self.tags + extra
            _at("copied")
            with rec.lock:  # copying -> publishing: handed over; the background thread owns rec from here
                self._pool.submit(self._run, rec)
                _at("submitted")
                rec.phase = "queued"
        except BaseException:
            self._abandon_copy(rec)  # (the next call does it too, if an interrupt lands in here)
            raise
        _at("handed-over")
        t2 = time.perf_counter()
        handle = SaveHandle(step, rec.future, t1 - t0, t2 - t1, self._snap.last.tensor_bytes)
        if block:
            self._settle(wait=True)
            self._raise_pending()
        return handle

    def _abandon_copy(self, rec: _Save) -> None:
        """A save whose copy was never handed over: drop it and give its buffers back (no write read them)."""
        with rec.lock:
            if rec.phase == "copying":
                rec.phase = "abandoned"
        if rec.phase == "abandoned":
            self._snap.release(rec)
            if self._current is rec:
                self._current = None

    def _run(self, rec: _Save) -> None:
        """The background thread: publish ``rec`` (unless its save abandoned it), then complete its future
        (after giving its buffers back: the write has read them for the last time)."""
        with rec.lock:
            if rec.phase != "queued":  # the caller was interrupted between submit and hand-over
                rec.phase = "abandoned"
                return
            rec.phase = "publishing"
        result, error = None, None
        try:
            result = self._write(rec)
        except BaseException as exc:  # noqa: BLE001 - every failure is the save's, raised by the next call
            error = exc
        finally:
            self._snap.release(rec)  # before the future completes: whoever sees it done may reuse them
            rec.phase = "done"
            if error is not None:
                error.add_note(_failure_note(rec))
                rec.future.set_exception(error)
            else:
                rec.future.set_result(result)

    def _write(self, rec: _Save) -> "PackResult":
        from ckpt_archive.ops.pack import Annotations, pack
        from ckpt_archive.repo.publish import record_publishes

        notes = Annotations(config=self.config, metrics=rec.metrics, data_ids=self.data_ids, tags=rec.tags,
                            code_version=self.code_version, progress={"step": rec.step})

        def intact(candidate=None) -> str | None:
            # the buffers were held by this save from before its copy; still held now, after the last read,
            # means no other copy wrote them in between (Snapshotter.take refuses to, and this proves it)
            if self._snap.holds(rec):
                return None
            return (f"the snapshot buffers of step {rec.step} changed hands before its write finished reading "
                    f"them: its members may hold another step's values")

        with record_publishes() as published:
            rec.published = published
            if self._dist is not None:
                return self._dist.write(rec.snap, self.options, notes, self.retention, rec.shards, intact)
            return pack(rec.snap, self.repo, self.options, notes, retention=self.retention, before_publish=intact)

    def _settle(self, *, wait: bool) -> None:
        """Record the outcome of the save in flight once it is done (waiting for it when ``wait``):
        publishing -> idle (result kept) or failed (error kept for :meth:`_raise_pending`). An exception
        raised during the wait changes nothing."""
        rec = self._current
        if rec is None:
            return
        if rec.phase in ("copying", "abandoned"):  # a save interrupted before its copy was handed over
            self._abandon_copy(rec)
            return
        while not rec.future.done():
            if not wait:
                return
            _at("waiting")
            try:  # Future.exception: a Condition wait (interrupt-safe: it cleans up in a finally)
                rec.future.exception(timeout=_WAIT_SLICE)
            except concurrent.futures.TimeoutError:
                pass
        _at("settle")
        exc = rec.future.exception()
        if exc is not None:
            self._error = exc      # -> failed (set before the save is let go: an interrupt in between
            self._current = None   #    leaves it both pending and in flight; settling again is the same)
        else:
            self._last = rec.future.result()
            self._current = None

    def _raise_pending(self) -> None:
        """failed -> idle: raise the failed save's error (once)."""
        err = self._error
        if err is None:
            return
        _at("raise")
        self._raised = err
        try:
            raise err
        finally:
            self._error = None

    def wait(self) -> "PackResult | None":
        """Wait for the save in flight, if any.

        Returns:
            the newest save's PackResult (None when nothing was saved yet).

        Raises:
            the background save's exception (once). An exception raised while waiting (KeyboardInterrupt)
            propagates and changes nothing: the save stays in flight and the next call waits again.
        """
        self._settle(wait=True)
        self._raise_pending()
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
            the background save's exception (once; the Checkpointer is closed all the same). An exception
            raised while waiting (KeyboardInterrupt) propagates and leaves it open, the save still in
            flight: call ``close()`` again.
        """
        if self._closed:
            self._raise_pending()
            return self._last
        self._settle(wait=True)
        _at("close")
        try:
            self._raise_pending()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            if self._dist is not None:
                self._dist.close()
        return self._last

    def __enter__(self) -> "Checkpointer":
        return self

    def __del__(self) -> None:
        # never closed: a failure nobody asked for would otherwise vanish with the object
        try:
            if not self._closed and (self._error is not None or self.state is SaveState.FAILED):
                _LOG.error("a Checkpointer was dropped without close() after its background save failed: %s",
                           self._error or self._current.future.exception())
        except Exception:  # noqa: BLE001 - interpreter shutdown, half-built object
            pass

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:  # the body failed: still finish the save in flight, but never hide the body's exception
            self.close()
        except BaseException as bg:  # noqa: BLE001
            if bg is not self._raised:
                raise  # interrupted while waiting (a second Ctrl-C): not the save's failure
            exc.add_note(f"also, the background save failed: {type(bg).__name__}: {bg}")
            _LOG.error("background save failed while the training loop was failing: %s", bg)


def _failure_note(rec: _Save) -> str:
    """What a failed save left: nothing usable, or (a failure after the marker) a usable generation."""
    published = rec.published
    if published:
        numbers = ", ".join(str(n) for _, n in published)
        return (f"(raised by the background save of step {rec.step} after generation {numbers} was published: "
                f"that generation is usable and holds step {rec.step}; what failed came after it)")
    return f"(raised by the background save of step {rec.step}; that step was not archived)"


def _import_publish_path(distributed: bool, retention: bool) -> None:
    """Import what the background write needs (run by the background thread at construction)."""
    import importlib

    names = ["ckpt_archive.ops.pack", "ckpt_archive.format.state_tree", "ckpt_archive.sources",
             "ckpt_archive.repo.writer", "ckpt_archive.repo.trial_reload", "ckpt_archive.repo.objects",
             "ckpt_archive.format.codec", "safetensors", "safetensors.torch", "zstandard"]
    if distributed:
        names += ["ckpt_archive.training.distributed", "ckpt_archive.training.dist_publish"]
    if retention:
        names += ["ckpt_archive.ops.prune"]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # the write reports it, with its context
            pass


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


__all__ = ["Checkpointer", "SaveHandle", "SaveState", "Restored", "DEFAULT_LOCK_WAIT"]
