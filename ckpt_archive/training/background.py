"""The Checkpointer's background thread, and a completion flag its caller's thread can wait on whatever
interrupts it.

:func:`run_jobs` is the one background thread of a :class:`~ckpt_archive.training.checkpointer.Checkpointer`:
``(fn, args)`` jobs from a ``queue.SimpleQueue`` (its ``put`` is one C call: no Python-level lock that a
signal handler's exception could leave taken), run in order until ``None``. :class:`Done` says a job is over;
the caller's thread waits on it in slices (:func:`wait_done`) with one C-level ``Lock.acquire`` at a time, so
an exception raised during the wait (KeyboardInterrupt, a signal handler's, a ``TimeoutError`` of its own)
propagates and leaves nothing taken. What the jobs do, and the states of a save, are the Checkpointer's.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

_LOG = logging.getLogger("ckpt_archive.checkpointer")

#: Seconds between checks while the caller waits for the save in flight (the wait ends as soon as the save
#: does; this only bounds how long a check of ``checkpointer._HOOK`` may be late).
WAIT_SLICE = 0.1


class Done:
    """A completion flag that the caller's thread can wait on whatever interrupts it.

    ``threading.Event``, ``Condition`` and ``concurrent.futures.Future`` run Python code around their locks
    (``Condition.__enter__``, ``Condition.wait``): a signal handler's exception raised in there leaves a lock
    taken or released twice, and the next wait deadlocks with the background thread or raises
    ``RuntimeError: release unlocked lock`` instead of the handler's exception. Here the caller's side is one
    C-level ``Lock.acquire`` with a timeout (an interrupt there takes nothing) and a plain attribute: the
    lock is held from creation until :meth:`set` releases it, after ``flag`` is True, so a caller interrupted
    right after its acquire succeeded leaves it taken but ``flag`` already says done, and nobody waits on the
    lock again.
    """

    __slots__ = ("flag", "_lock")

    def __init__(self):
        self.flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """Done (called once, by the background thread)."""
        self.flag = True
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; returns ``flag``."""
        if not self.flag and self._lock.acquire(timeout=timeout):
            self._lock.release()
        return self.flag


def wait_done(done: Done, timeout: float | None = None) -> bool:
    """Wait for ``done`` (forever when ``timeout`` is None, else up to ``timeout`` seconds), in slices of
    :data:`WAIT_SLICE` seconds; returns ``done.flag``. An exception raised in the wait (a signal handler's)
    propagates and changes nothing."""
    end = None if timeout is None else time.monotonic() + timeout
    while not done.flag:
        left = WAIT_SLICE if end is None else min(WAIT_SLICE, end - time.monotonic())
        if left <= 0:
            break
        done.wait(left)
    return done.flag


def run_jobs(jobs: "queue.SimpleQueue", done: Done) -> None:
    """The background thread: run ``(fn, args)`` jobs in order until ``None``. Holds no reference to the
    Checkpointer between jobs (so an unreferenced one is collected, and its ``__del__`` ends this thread)."""
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - the jobs record their own failures; never kill the thread
                _LOG.exception("Checkpointer background job failed")
            del job, fn, args
    finally:
        done.set()


__all__ = ["WAIT_SLICE", "Done", "wait_done", "run_jobs"]
