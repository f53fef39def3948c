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
then on the live state may change. Everything else runs in one background thread
(:mod:`ckpt_archive.training.background`): encoding, writing,
verify, trial reload, publish and retention, through :func:`ckpt_archive.ops.pack.pack`, the very path
``ckpt-archive pack`` takes (one process), or through
:mod:`ckpt_archive.training.distributed` (many processes, one generation, the same publish lifecycle).
So a generation it makes is one ``pack`` of the same state would make: same format, same checks. The
modules that path needs are imported by that thread when the Checkpointer is built, never in the caller's
thread during a save.

**The state machine** (:class:`SaveState`, :attr:`Checkpointer.state`). One object owns the save in flight
(:class:`_Save`: its step, its outcome, and the snapshot buffers, which it holds from before its copy until
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
  flight, owns its buffers, and the next call waits for it again and raises its error if it fails (a
  ``TimeoutError`` raised there is the caller's, never taken for the wait's own; the waits run no Python
  code of ``threading``, whose locks an interrupt there could leave taken:
  :class:`~ckpt_archive.training.background.Done`);
* during the copy (``copying``): that ``save`` raises; its copy is abandoned (never published), and the
  buffers go back to the Checkpointer, which no write was reading;
* after the copy was handed over: the save publishes as if ``save`` had returned (``wait`` tells);
* in the background: the error is the save's own failure (``failed``), never lost.

The buffers are written only by a copy whose save holds them
(:meth:`~ckpt_archive.training.snapshot.Snapshotter.acquire`), and before a generation is marked usable
its write checks that its save held them from the copy to the end of its last read, and that nothing wrote
them after its copy (the Snapshotter counts every write; the publish lifecycle's before-publish hook, or
each rank's trial-reload result under torch.distributed): a generation marked usable holds exactly the
state that its step's ``save`` copied.

**Who may call** (:meth:`Checkpointer._enter`): one call at a time. A call from another thread waits for
the running one; a call made inside a running call in the same thread (a signal handler's) raises
UsageError, since it would have to abandon a copy still being written; a forked child (a DataLoader worker)
is refused, its background thread being gone. At interpreter exit, a save in flight of a Checkpointer never
closed is finished before Python stops its threads, and a failure nothing raised is logged
(:func:`_finish_all_at_exit`). Under torch.distributed every ``save`` call takes part in its save's
exchanges, even one that handed no copy over (it says so; the others publish nothing for it), and the
previous save's failure is raised after the hand-over, so the ranks' saves never pair up out of step.

Why one save in flight: the next :meth:`save` waits for it. Skipping instead would silently thin out the
resume points a user asked for, and queueing several would hold several copies of the state in memory;
waiting keeps memory at one copy (the reused buffers) and makes a too-frequent save visible as blocked
time (:attr:`SaveHandle.waited_s`). A failure in the background is raised by the next :meth:`save`,
:meth:`wait` or :meth:`close` (the original exception, with a note naming the step), once, whether or not
:meth:`SaveHandle.result` raised it already; it is never lost.
"""
from __future__ import annotations

import concurrent.futures.thread  # (imported before _finish_all_at_exit registers: see there)
import dataclasses
import enum
import logging
import os
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from ckpt_archive.errors import UsageError
from ckpt_archive.training.background import WAIT_SLICE, Done, run_jobs, wait_done
from ckpt_archive.ops.common import RepoLike
from ckpt_archive.training.generation_restore import restore_generation
from ckpt_archive.training.restore import Restored

if TYPE_CHECKING:
    from ckpt_archive.ops.pack import PackOptions, PackResult
    from ckpt_archive import Generation
    from ckpt_archive.retention.policy import RetentionPolicy
    from ckpt_archive.training.restore import RestoreReport

_LOG = logging.getLogger("ckpt_archive.checkpointer")

#: How long a background save may wait for another writer's repository lock, seconds.
DEFAULT_LOCK_WAIT = 60.0

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
    """The one owner of a save in flight: its step, its outcome, its snapshot (and, through the Snapshotter,
    the buffers it holds). ``phase`` goes ``copying -> queued -> publishing`` and ends ``done`` or
    ``abandoned``; the caller's thread and the background thread change it only under ``lock``. ``seq``
    numbers the save calls of a Checkpointer (under torch.distributed, the exchanges of every rank's call
    number ``seq`` belong together)."""

    def __init__(self, step: int, seq: int = 0):
        self.step = step
        self.seq = seq
        self.lock = threading.Lock()
        self.phase = "copying"
        self.over = Done()   # set by the background thread once result/error is final
        self.result: "PackResult | None" = None
        self.error: BaseException | None = None
        self.writes = -1  # the Snapshotter's write count right after this save's copy (see intact())
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

    def __init__(self, step: int, rec: _Save, waited_s: float, snapshot_s: float, snapshot_bytes: int):
        self.step = step
        self._rec = rec
        self.waited_s = waited_s
        self.snapshot_s = snapshot_s
        self.blocked_s = waited_s + snapshot_s
        self.snapshot_bytes = snapshot_bytes

    def done(self) -> bool:
        """True once the background write finished (published or failed)."""
        return self._rec.over.flag

    def result(self, timeout: float | None = None) -> "PackResult":
        """Wait for the background write and return its :class:`~ckpt_archive.ops.pack.PackResult`.

        Raises:
            whatever the background write raised (the Checkpointer's next ``save``/``wait``/``close``
            raises it too: it owns the error); TimeoutError after ``timeout`` s (the save goes on).
        """
        rec = self._rec
        if not wait_done(rec.over, timeout):
            raise TimeoutError(f"the save of step {rec.step} was still in flight after {timeout} s")
        if rec.error is not None:
            raise rec.error
        return rec.result


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
            ``Checkpointer(...)``, ``save``, ``wait`` and ``close`` in the same order; ranks out of step
            fail loudly, see docs/checkpointer.md).
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
        from ckpt_archive.training.preload import prepare, use_distributed
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
        if use_distributed(distributed, process_group):
            from ckpt_archive.training.distributed import DistributedWriter

            self._dist = DistributedWriter(repo, process_group, timeout=timeout)
            self.repo = self._dist.repo
        else:
            from ckpt_archive.ops.common import open_repo

            self.repo = open_repo(repo, create=True)
        self._snap = Snapshotter(pin_memory=pin_memory)
        # the background thread: one, fed through a SimpleQueue (its put is one C call: no Python-level lock
        # a signal handler's exception could leave taken, as ThreadPoolExecutor.submit's semaphore could);
        # a daemon, so an unclosed Checkpointer never keeps the interpreter alive (at exit, the save in
        # flight is finished first: _finish_all_at_exit)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker_done = Done()
        self._worker = threading.Thread(target=run_jobs, args=(self._jobs, self._worker_done), daemon=True,
                                        name="ckpt-checkpointer")
        # once per Checkpointer: the write's modules and the copy's first torch calls (training/preload.py)
        prepare(self._jobs, distributed=self._dist is not None, retention=retention is not None)
        self._worker.start()
        self._current: _Save | None = None       # the one save in flight (copying or publishing)
        self._error: BaseException | None = None  # a failed save's error, not yet raised (state "failed")
        self._raised: BaseException | None = None  # the last background error raised (for __exit__)
        self._last: "PackResult | None" = None
        self._closed = False
        # callers: one call at a time (another thread's call waits its turn); a call made while another
        # runs in the same thread (a signal handler's) is refused; a forked child is refused (see _enter)
        self._calls = threading.RLock()
        self._active: tuple[str, int] | None = None  # (the call running, its thread)
        self._pid = os.getpid()
        # torch.distributed: every save() call takes part in its save's exchanges, handed over or not
        self._seq = 0                              # save calls started
        self._sent = 0                             # save calls whose exchanges were handed to the background
        self._unsent: dict[int, tuple] = {}        # seq -> (step, why its copy was not handed over)
        self._bg_seq = 0                           # (background thread) the last save call it took part in
        self._skips: list[Done] = []
        _LIVE.add(self)

    @property
    def state(self) -> SaveState:
        """Where this Checkpointer stands now (:class:`SaveState`; see the module docstring)."""
        if self._closed:
            return SaveState.CLOSED
        rec = self._current
        if rec is not None and rec.phase == "copying":
            return SaveState.COPYING
        if rec is not None and rec.phase != "abandoned":
            if not rec.over.flag:
                return SaveState.PUBLISHING
            if rec.error is not None:
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
            the previous background save's exception (see the module docstring; under torch.distributed
            raised after this save's copy was handed over); UsageError: bad step, closed checkpointer, a
            call from inside another call of this Checkpointer (a signal handler's) or from a forked child;
            SourceError: metrics that cannot be recorded; with ``block=True`` this save's own failure. An
            exception raised while this call waits or copies (KeyboardInterrupt, a signal handler's)
            propagates: the save in flight stays in flight; a copy that was not handed over is abandoned
            (this step is not saved).
        """
        with self._enter("save"):  # (a with: an interrupt cannot land between taking the turn and its release)
            try:
                self._active = ("save", threading.get_ident())
                return self._save(step, state, metrics, block, tags)
            finally:
                self._active = None

    def _save(self, step, state, metrics, block, tags) -> SaveHandle:
        self._check_open()
        seq = None
        if self._dist is not None:
            # every save() call takes part in its save's exchanges, even one that raises before its copy is
            # handed over (an interrupt, a bad argument): else the ranks' calls pair up out of step
            self._send_skips()
            self._seq += 1
            seq = self._seq
            self._unsent[seq] = (step, "it raised before its copy was handed over")
        try:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise UsageError(f"step must be a non-negative int (optimizer updates completed), not {step!r}")
            self._metrics_to_json(metrics)  # refuse bad metrics in the caller's thread
            extra = (tags,) if isinstance(tags, str) else tuple(tags)
            t0 = time.perf_counter()
            _at("save")
            self._settle(wait=True)   # publishing -> idle | failed
            if self._dist is None:
                self._raise_pending()  # failed -> idle (raises); distributed: after the hand-over, below
            t1 = time.perf_counter()
            rec = _Save(step, seq or 0)
            self._current = rec       # idle -> copying: from here rec is reachable, whatever interrupts us
            _at("copy")
            try:
                self._snap.acquire(rec)
                _at("copy-acquired")
                if self._dist is not None:
                    from ckpt_archive.training.distributed import ShardNotes

                    rec.shards = ShardNotes()
                rec.snap = self._snap.take(state, owner=rec, on_dtensor=rec.shards.add if rec.shards else None)
                rec.writes = self._snap.writes
                rec.metrics, rec.tags = metrics, self.tags + extra
                _at("copied")
                with rec.lock:  # copying -> publishing: handed over; the background thread owns rec from here
                    if rec.phase != "copying":  # abandoned by someone while being written: never hand it over
                        from ckpt_archive.training.snapshot import BuffersBusy

                        raise BuffersBusy(f"{rec!r} was abandoned while its copy was being written: not saved")
                    self._jobs.put((self._run, (rec,)))
                    _at("submitted")
                    rec.phase = "queued"
            except BaseException:
                self._abandon_copy(rec)  # (the next call does it too, if an interrupt lands in here)
                raise
        except BaseException as exc:
            if seq is not None and seq in self._unsent:
                self._unsent[seq] = (step, f"it raised {type(exc).__name__}: {exc}")
                self._send_skips()  # now, so the others stop waiting (else the next call of this rank sends it)
            raise
        if seq is not None:
            self._unsent.pop(seq, None)
            self._sent = max(self._sent, seq)
        _at("handed-over")
        t2 = time.perf_counter()
        handle = SaveHandle(step, rec, t1 - t0, t2 - t1, self._snap.last.tensor_bytes)
        if self._dist is not None:
            # the previous save's failure, raised once this save's copy is in flight: a rank whose previous
            # save failed must not sit this save out while the others make it (docs/checkpointer.md)
            self._raise_pending()
        if block:
            self._settle(wait=True)
            self._raise_pending()
        return handle

    # -- who may call -----------------------------------------------------------------------------------------
    def _enter(self, name: str) -> threading.RLock:
        """The caller's turn, as a context manager (the Checkpointer's call lock): a call from another thread
        waits until the running call returns; a call made while another call of this Checkpointer runs in
        the same thread (a signal handler's or a callback's) is refused; so is a forked child.

        Raises:
            UsageError: a call from a forked child (a DataLoader worker), or from inside another call.
        """
        if os.getpid() != self._pid:
            raise UsageError(f"Checkpointer.{name}() in a forked child process (a DataLoader worker?): this "
                             f"Checkpointer belongs to process {self._pid}, and its background thread did not "
                             f"survive the fork (the save would wait forever); save from the training process, "
                             f"or build a Checkpointer in the child")
        active = self._active
        if active is not None and active[1] == threading.get_ident():  # this thread is inside a call already
            raise UsageError(f"Checkpointer.{name}() was called while {active[0]}() of the same Checkpointer "
                             f"is running in this thread, from a signal handler or a callback it runs: that "
                             f"call would be left with its copy half done; in the handler set a flag and call "
                             f"{name}() from the training loop")
        return self._calls

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
        """The background thread: publish ``rec`` (unless its save abandoned it), then record its outcome
        (after giving its buffers back: the write has read them for the last time)."""
        with rec.lock:
            abandoned = rec.phase != "queued"  # the caller was interrupted between submit and hand-over
            rec.phase = "abandoned" if abandoned else "publishing"
        if self._dist is not None:
            if rec.seq <= self._bg_seq:  # (cannot happen: a skip is sent only after its call's own submit)
                abandoned = True
            elif abandoned:  # it still takes part in its save's exchanges, saying it has nothing
                self._run_skip(rec.seq, rec.step, "it was interrupted as its copy was handed over")
            self._bg_seq = max(self._bg_seq, rec.seq)
        if abandoned:
            rec.over.set()
            return
        result, error = None, None
        try:
            result = self._write(rec)
        except BaseException as exc:  # noqa: BLE001 - every failure is the save's, raised by the next call
            error = exc
        finally:
            self._snap.release(rec)  # before it is done: whoever sees it done may reuse them
            if error is not None:
                error.add_note(_failure_note(rec))
            rec.result, rec.error = result, error
            rec.phase = "done"
            rec.over.set()

    def _run_skip(self, seq: int, step: Any, why: str, done: Done | None = None) -> None:
        """The background thread, for a save call of this rank that handed no copy over: take part in that
        save's exchanges with the other ranks, saying so (they then publish nothing for it). Once per call."""
        try:
            if seq <= self._bg_seq:  # its copy was handed over after all, or it was sent already
                return
            self._bg_seq = seq
            self._dist.skip(seq, step, why)
        except Exception as exc:  # noqa: BLE001 - the group is broken: the next save raises that
            _LOG.debug("save call %s (step %r) could not tell the other ranks it has nothing: %s", seq, step, exc)
        finally:
            if done is not None:
                done.set()

    def _send_skips(self) -> None:
        """Hand the background thread every earlier save call of this rank whose copy was never handed over
        (torch.distributed; in call order, before anything newer). Sending one twice is harmless."""
        self._skips = [d for d in self._skips if not d.flag]
        while self._sent < self._seq:
            seq = self._sent + 1
            step, why = self._unsent.get(seq, (None, "it raised before its copy was handed over"))
            done = Done()
            self._skips.append(done)
            self._jobs.put((self._run_skip, (seq, step, why, done)))
            self._unsent.pop(seq, None)
            self._sent = seq

    def _write(self, rec: _Save) -> "PackResult":
        from ckpt_archive.ops.pack import Annotations, pack
        from ckpt_archive.ops.pack import record_publishes

        notes = Annotations(config=self.config, metrics=rec.metrics, data_ids=self.data_ids, tags=rec.tags,
                            code_version=self.code_version, progress={"step": rec.step})

        def intact(candidate=None) -> str | None:
            # the buffers were held by this save from before its copy, and not one byte was written into them
            # since its copy ended (the Snapshotter counts every write): nothing else is in its snapshot
            if self._snap.holds(rec) and self._snap.writes == rec.writes:
                return None
            return (f"the snapshot buffers of step {rec.step} changed hands or were written again before its write "
                    f"finished reading them: its members may hold another step's values")

        with record_publishes() as published:
            rec.published = published
            if self._dist is not None:
                return self._dist.write(rec.snap, self.options, notes, self.retention, rec.shards, intact,
                                        seq=rec.seq, step=rec.step)
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
        while not rec.over.flag:
            if not wait:
                return
            _at("waiting")
            # a Done, not Future.exception(timeout=): that one's TimeoutError is the builtin one (3.11+), so
            # a signal handler's own TimeoutError raised in the wait was caught as "not done yet" and lost;
            # and Future/Event run Python code around their locks, which an interrupt can leave taken
            rec.over.wait(WAIT_SLICE)
        _at("settle")
        exc = rec.error
        if exc is not None:
            self._error = exc      # -> failed (set before the save is let go: an interrupt in between
            self._current = None   #    leaves it both pending and in flight; settling again is the same)
        else:
            self._last = rec.result
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
            UsageError: called from inside another call of this Checkpointer, or from a forked child.
        """
        with self._enter("wait"):
            try:
                self._active = ("wait", threading.get_ident())
                return self._wait()
            finally:
                self._active = None

    def _wait(self) -> "PackResult | None":
        if self._dist is not None and not self._closed:
            self._send_skips()
            self._wait_skips()
        self._settle(wait=True)
        self._raise_pending()
        return self._last

    def _wait_skips(self) -> None:
        """(torch.distributed) Wait until the background thread has sent every skip handed to it (so no
        exchange of the caller's thread, a restore's, runs beside one of the background's)."""
        while self._skips:
            done = self._skips[0]
            while not done.flag:
                _at("waiting")
                done.wait(WAIT_SLICE)
            self._skips.pop(0)

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
            the save in flight's exception, as :meth:`wait` (once; nothing is restored: call again).
            IntegrityError: the generation fails a check (nothing wrong is restored). IncoherentState:
            structure mismatch (nothing restored). NotFound: a named generation does not exist.
            UsageError: called from inside another call of this Checkpointer, or from a forked child.
        """
        with self._enter("restore"):
            try:
                self._active = ("restore", threading.get_ident())
                return self._restore(model, optimizer, scheduler, scaler, policy, generation, rng, session_lr, keys)
            finally:
                self._active = None

    def _restore(self, model, optimizer, scheduler, scaler, policy, generation, rng, session_lr, keys):
        self._wait()
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
        return restore_generation(self.repo, generation, jobs=self.options.jobs, model=model, optimizer=optimizer,
                                  scheduler=scheduler, scaler=scaler, policy=policy, rng=rng, session_lr=session_lr,
                                  keys=keys)

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
            flight: call ``close()`` again. UsageError: called from inside another call of this
            Checkpointer, or from a forked child.
        """
        with self._enter("close"):
            try:
                self._active = ("close", threading.get_ident())
                return self._close()
            finally:
                self._active = None

    def _close(self) -> "PackResult | None":
        if self._closed:
            self._raise_pending()
            return self._last
        if self._dist is not None:
            self._send_skips()
            self._wait_skips()
        self._settle(wait=True)
        _at("close")
        try:
            self._raise_pending()
        finally:
            self._closed = True
            self._jobs.put(None)  # the background thread ends once the jobs before it are done
            wait_done(self._worker_done)
            if self._dist is not None:
                self._dist.close()
        return self._last

    def _finish_at_exit(self) -> None:
        """The interpreter is exiting and this Checkpointer was never closed: finish the save in flight (before
        concurrent.futures stops accepting work, which would fail it), and write a failure nobody will raise
        any more to the log (stderr unless logging is configured)."""
        if self._closed or os.getpid() != self._pid:
            return
        # a call still running in another thread (a non-daemon thread goes on at exit): its turn first, as
        # for any caller (settling here beside its copy would abandon a copy still being written)
        if not self._calls.acquire(timeout=DEFAULT_LOCK_WAIT):
            _LOG.error("the interpreter is exiting while another thread's Checkpointer call still runs after %s s: "
                       "its save in flight, if any, is not waited for here", DEFAULT_LOCK_WAIT)
            return
        try:
            self._finish_at_exit_locked()
        finally:
            self._calls.release()

    def _finish_at_exit_locked(self) -> None:
        if self._closed:
            return
        if self._dist is not None:
            self._send_skips()
        rec = self._current
        if rec is not None and rec.phase in ("queued", "publishing"):
            _LOG.info("the interpreter is exiting: finishing the save of step %s in flight (close() was not called)",
                      rec.step)
            wait_done(rec.over)
        self._settle(wait=False)
        err = self._error
        if err is not None:
            self._error = None
            self._raised = err
            _LOG.error("the background save failed and this Checkpointer was never closed, so nothing raised it: "
                       "%s: %s%s", type(err).__name__, err, "".join(f" {n}" for n in getattr(err, "__notes__", ())))

    def __enter__(self) -> "Checkpointer":
        return self

    def __del__(self) -> None:
        # never closed: a failure nobody asked for would otherwise vanish with the object
        try:
            self._jobs.put(None)  # (no job of this object is queued any more: each holds it) the thread ends
        except Exception:  # noqa: BLE001 - half-built object
            pass
        try:
            if not self._closed and (self._error is not None or self.state is SaveState.FAILED):
                _LOG.error("a Checkpointer was dropped without close() after its background save failed: %s",
                           self._error or self._current.error)
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


#: Every Checkpointer of this process not yet garbage-collected (for :func:`_finish_all_at_exit`).
_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def _finish_all_at_exit() -> None:
    """At interpreter exit, before its threads are joined: finish the saves in flight of Checkpointers never
    closed, and log their failures. Registered with ``threading._register_atexit``, the hook
    concurrent.futures uses to stop accepting work at exit: registered after it (this module imports
    ``concurrent.futures.thread`` first), so it runs before it (the hooks run last-registered first). A
    plain ``atexit`` hook runs too late: the pack of the save in flight could no longer start its threads
    ('cannot schedule new futures after interpreter shutdown') and the save was always lost."""
    for ckpt in list(_LIVE):
        try:
            ckpt._finish_at_exit()
        except BaseException as exc:  # noqa: BLE001 - a Ctrl-C here: the save is left partial, said once
            _LOG.error("the save in flight at exit was not finished (%s: %s): its generation is left partial "
                       "(never usable; `ckpt-archive gc` removes it)", type(exc).__name__, exc)


_CF_THREAD = concurrent.futures.thread  # imported first, so its exit hook runs after ours (above)
try:
    threading._register_atexit(_finish_all_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - another Python, or imported during shutdown
    pass


def _failure_note(rec: _Save) -> str:
    """What a failed save left: nothing usable, or (a failure after the marker) a usable generation."""
    published = rec.published
    if published:
        numbers = ", ".join(str(n) for _, n in published)
        return (f"(raised by the background save of step {rec.step} after generation {numbers} was published: "
                f"that generation is usable and holds step {rec.step}; what failed came after it)")
    return f"(raised by the background save of step {rec.step}; that step was not archived)"


__all__ = ["Checkpointer", "SaveHandle", "SaveState", "Restored", "DEFAULT_LOCK_WAIT"]
