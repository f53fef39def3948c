"""The Checkpointer's callers as a real training script has them: a signal handler whose exception is a
``TimeoutError``, a second thread, a signal handler that calls the Checkpointer itself, a forked DataLoader
worker, a script that ends with a save in flight. Each once lost a save or its error, or made a generation
usable that held another step's values (found by the break round after issue 24 item 7).

Every usable generation is compared bit for bit with the state as it was at its ``save`` call.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import UsageError
from ckpt_archive.training import checkpointer as ckmod
from ckpt_archive.training.checkpointer import Checkpointer, SaveState

from test_checkpointer_interrupts import _Gate, _check_repository

ROOT = Path(__file__).resolve().parents[1]


def _state(step: int, n: int = 4096, tensors: int = 6) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(tensors)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}


def test_a_timeout_error_from_a_signal_handler_during_wait_is_raised_not_swallowed(tmp_path, monkeypatch):
    """A SIGALRM handler that raises ``TimeoutError`` (what timeout helpers raise) while ``wait()`` waits for
    the save in flight: the wait polled the future with ``Future.exception(timeout=)`` and caught
    ``concurrent.futures.TimeoutError``, which is ``TimeoutError`` since Python 3.11, so the user's timeout was
    swallowed and ``wait()`` went on waiting and returned normally."""
    gate = _Gate(monkeypatch)
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, _state(1))
    opener = threading.Timer(3.0, gate.open.set)
    opener.start()

    def handler(signum, frame):
        raise TimeoutError("the step's deadline")

    old = signal.signal(signal.SIGALRM, handler)
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(TimeoutError, match="deadline"):
            ckpt.wait()
        assert time.monotonic() - t0 < 2.5, "the timeout was raised only after the save ended"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        gate.open.set()
        opener.cancel()
    assert ckpt.state is SaveState.PUBLISHING or ckpt.wait() is not None
    ckpt.close()
    _check_repository(tmp_path / "repo", {1: _state(1)}, must={1})


@pytest.mark.parametrize("second", ["save", "wait"])
def test_a_call_from_another_thread_during_a_copy_neither_mixes_steps_nor_loses_the_save(tmp_path, monkeypatch,
                                                                                          second):
    """Thread A is inside ``save(1)``'s copy when thread B calls ``save(2)`` (or ``wait()``). B's call abandoned
    A's copy as if it had been interrupted: B released the buffers A was still writing, B's own copy went into
    them, so step 2's generation was published holding step 1's values; A's save then failed its check with
    nobody to tell (``close()`` raised nothing) and step 1 was silently lost. Calls from several threads now
    take turns."""
    states = {1: _state(1), 2: _state(2)}
    main = threading.current_thread()
    errors: list = []
    other: list[threading.Thread] = []

    def in_copy(point):
        if point == "copy-acquired" and threading.current_thread() is main and not other:
            def call():
                try:
                    ckpt.save(2, states[2]) if second == "save" else ckpt.wait()
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
            other.append(threading.Thread(target=call))
            other[0].start()
            other[0].join(0.5)  # the other thread's call runs now, while this copy is under way

    monkeypatch.setattr(ckmod, "_HOOK", in_copy)
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, states[1])
    monkeypatch.setattr(ckmod, "_HOOK", None)
    other[0].join(60)
    assert errors == []
    ckpt.close()
    _check_repository(tmp_path / "repo", states, must={1, 2} if second == "save" else {1})


def test_two_threads_saving_at_once_never_make_a_mixed_generation(tmp_path):
    """The same, unstaged: two threads each save their own state (40 tensors), many times."""
    states = {s: _state(s, n=20_000, tensors=40) for s in range(1, 7)}
    ckpt = Checkpointer(tmp_path / "repo")
    errors: list = []

    def run(steps):
        try:
            for s in steps:
                ckpt.save(s, states[s])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(range(k, 7, 2),)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ckpt.close()
    assert errors == []
    _check_repository(tmp_path / "repo", states, must=set(states))


@pytest.mark.parametrize("call", ["wait", "save", "close"])
@pytest.mark.parametrize("point", ["waiting", "copy-acquired", "copied"])
def test_a_signal_handler_calling_the_checkpointer_inside_another_call_is_refused(tmp_path, monkeypatch, call, point):
    """A signal handler (``ckpt.wait()`` to flush, ``ckpt.save()`` for an emergency save) runs inside the
    training thread's own ``save`` call. Before, the inner call abandoned the outer copy still under way (the
    same as a second thread), so the outer save was lost without an error or the inner one was overwritten.
    The inner call now raises UsageError (set a flag in the handler, save from the loop); the outer save
    behaves as interrupted there, and every usable generation is its step's state."""
    gate = _Gate(monkeypatch)
    states = {1: _state(1), 2: _state(2), 3: _state(3), 9: _state(9)}
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, states[1])
    threading.Timer(0.3, gate.open.set).start()
    fired = []

    def handler(p):
        if p == point and not fired:
            fired.append(p)
            {"wait": ckpt.wait, "close": ckpt.close, "save": lambda: ckpt.save(9, states[9])}[call]()

    monkeypatch.setattr(ckmod, "_HOOK", handler)
    with pytest.raises(UsageError, match="signal handler"):
        ckpt.save(2, states[2])
    monkeypatch.setattr(ckmod, "_HOOK", None)
    assert fired == [point]
    assert ckpt.state is not SaveState.CLOSED
    gate.open.set()
    ckpt.save(3, states[3])
    ckpt.close()
    _check_repository(tmp_path / "repo", states, must={1, 3})


def test_a_forked_child_using_the_parents_checkpointer_is_refused_not_hung(tmp_path):
    """A DataLoader worker (a forked child) calls the parent's Checkpointer: the background thread did not
    survive the fork, so the save was queued to no thread and ``wait()``/``close()`` hung forever."""
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, _state(1))
    ckpt.wait()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what save does, never run pytest's teardown
        os.close(r)
        try:
            handle = ckpt.save(2, _state(2))
            handle.result(timeout=10)
            msg = b"saved"
        except UsageError as exc:
            msg = b"refused: " + str(exc).encode()
        except BaseException as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {exc}".encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        got = fh.read().decode()
    os.waitpid(pid, 0)
    assert got.startswith("refused:") and "fork" in got, got
    ckpt.save(3, _state(3))  # the parent's Checkpointer is untouched
    ckpt.close()
    _check_repository(tmp_path / "repo", {1: _state(1), 3: _state(3)}, must={1, 3})


_EXIT_SCRIPT = r"""
import sys, torch
from ckpt_archive.training.checkpointer import Checkpointer
ckpt = Checkpointer(sys.argv[1])
ckpt.save(1, {"w": torch.arange(4_000_000, dtype=torch.float32), "b": torch.ones(3)})
print("script ends", flush=True)
"""


def test_a_save_in_flight_when_the_script_ends_is_finished_not_left_partial(tmp_path):
    """The script ends (no close(), no with) while its last save is in flight. The interpreter's shutdown
    of concurrent.futures came first, so the pack could not start its encoder threads: the save always
    failed ('cannot schedule new futures after interpreter shutdown') and was left partial. It is now
    finished before the interpreter stops its threads."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPT_ARCHIVE_INJECT", None)
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "repo")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot schedule" not in proc.stderr, proc.stderr[-3000:]
    gens = ckpt_archive.list_generations(tmp_path / "repo", all=True)
    assert [(g.number, g.status) for g in gens] == [(1, "usable")], [(g.number, g.status, g.reason) for g in gens]
    got = ckpt_archive.load(tmp_path / "repo", 1)
    assert torch.equal(got["w"], torch.arange(4_000_000, dtype=torch.float32))


def test_a_save_failing_after_the_script_ended_is_reported_on_stderr(tmp_path):
    """The same, with the save failing in the background: nobody calls close() any more, so the error is
    written to stderr (the logger ``ckpt_archive.checkpointer``) with its step, never dropped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPT_ARCHIVE_INJECT": "after-trial-reload=raise"}
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "repo")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert "injected failure" in proc.stderr and "step 1" in proc.stderr, proc.stderr[-3000:]
    assert ckpt_archive.list_generations(tmp_path / "repo") == []


def test_a_write_into_the_buffers_after_the_copy_withdraws_the_generation_even_under_the_same_holder(tmp_path,
                                                                                                      monkeypatch):
    """The check before the marker proved less than it said: it asked only whether the save still *held* the
    buffers, so a copy that wrote them without taking them (a copy abandoned by another call, still running)
    went unseen and the generation was published holding its bytes. The Snapshotter now counts every buffer
    write, and a save publishes only if none happened after its own copy."""
    real = Checkpointer._write

    def overwritten(ck, rec):
        ck._snap.take(_state(2), owner=rec)  # same holder, other values: what a stray copy would write
        return real(ck, rec)

    monkeypatch.setattr(Checkpointer, "_write", overwritten)
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, _state(1))
    with pytest.raises(Exception, match="changed hands|written") as info:
        ckpt.wait()
    assert any("not archived" in n for n in info.value.__notes__)
    assert ckpt_archive.list_generations(tmp_path / "repo") == []
    ckpt.close()


_EXIT_THREAD_SCRIPT = r"""
import sys, threading, time, torch
from ckpt_archive.training import checkpointer as ck
ckpt = ck.Checkpointer(sys.argv[1])
def slow_copy(point):
    if point == "copy-acquired" and threading.current_thread().name == "saver":
        time.sleep(1.5)  # the interpreter starts exiting while this thread is inside the copy
ck._HOOK = slow_copy
threading.Thread(target=ckpt.save, args=(1, {"w": torch.arange(1000.0)}), name="saver").start()
time.sleep(0.3)
print("main ends", flush=True)
"""


def test_a_save_still_copying_in_another_thread_at_exit_is_not_abandoned(tmp_path):
    """The exit hook settles the Checkpointer while a (non-daemon) thread is still inside ``save``'s copy:
    settling without waiting its turn took that running copy for an interrupted one and abandoned it, so
    the thread's save failed its check in the background with nobody left to raise it. The hook now
    waits for the running call first, then for the save it handed over."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPT_ARCHIVE_INJECT", None)
    proc = subprocess.run([sys.executable, "-c", _EXIT_THREAD_SCRIPT, str(tmp_path / "repo")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "failed" not in proc.stderr, proc.stderr[-3000:]
    gens = ckpt_archive.list_generations(tmp_path / "repo", all=True)
    assert [(g.number, g.status) for g in gens] == [(1, "usable")], [(g.number, g.status, g.reason) for g in gens]
    assert torch.equal(ckpt_archive.load(tmp_path / "repo", 1)["w"], torch.arange(1000.0))


_INSIDE_THREADING_SCRIPT = r"""
import os, sys, threading, time, torch
from ckpt_archive.training import checkpointer as ck

class Boom(Exception):
    pass

real = ck.Checkpointer._write
gate = threading.Event()
def gated(self, rec):
    gate.wait(30)
    return real(self, rec)
ck.Checkpointer._write = gated

def watchdog(what, seconds=20):
    t = threading.Timer(seconds, lambda: (print("HUNG", what, flush=True), os._exit(3)))
    t.daemon = True
    t.start()
    return t

LIBS = (os.sep + "threading.py", os.sep + "concurrent" + os.sep, os.sep + "queue.py")
call, first, last = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for k in range(first, last + 1):
    gate.clear()
    ckpt = ck.Checkpointer(os.path.join(sys.argv[1], f"{call}-{k}"))
    ckpt.save(1, {"w": torch.ones(8)})
    seen = [0]
    def local(frame, event, arg):
        if event in ("line", "return"):
            seen[0] += 1
            if seen[0] == k:
                raise Boom(f"event {k}: {event} in {frame.f_code.co_name}")
        return local
    def tracer(frame, event, arg):
        if threading.current_thread() is threading.main_thread() and any(p in frame.f_code.co_filename for p in LIBS):
            return local  # (only the caller's thread: signal handlers run nowhere else)
        return None
    threading.Timer(0.1, gate.set).start()
    sys.settrace(tracer)
    try:
        {"wait": ckpt.wait, "close": ckpt.close, "save": lambda: ckpt.save(2, {"w": torch.zeros(8)})}[call]()
        got = "returned"
    except Boom:
        got = "Boom"
    except BaseException as exc:
        got = f"OTHER {type(exc).__name__}: {exc}"
    finally:
        sys.settrace(None)
    gate.set()
    dog = watchdog(f"{call} event {k}")
    try:
        ckpt.close()
    except BaseException as exc:
        got += f" / close raised {type(exc).__name__}: {exc}"
    dog.cancel()
    print(k, got, flush=True)
print("DONE", flush=True)
"""


@pytest.mark.parametrize("call", ["wait", "save", "close"])
def test_an_exception_raised_inside_pythons_threading_code_during_a_call_never_hangs_it(tmp_path, call):
    """A signal handler's exception can land inside the Python code of ``threading`` and
    ``concurrent.futures`` that a wait runs (``Condition.__enter__`` after its lock was taken,
    ``Condition.wait`` after it released its lock): the lock stayed taken, and the next ``close()`` deadlocked
    with the background thread (seen under a 0.2 ms SIGALRM storm: close() hung after 15 s of waits), or
    the caller got ``RuntimeError: release unlocked lock`` instead of its own exception. The caller's side now
    runs no such code: it waits on plain locks and reads the save's outcome from the save itself. Here an
    exception is raised at each of the first 30 line/return events of that code, in turn."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPT_ARCHIVE_INJECT", None)
    proc = subprocess.run([sys.executable, "-c", _INSIDE_THREADING_SCRIPT, str(tmp_path), call, "1", "30"],
                          capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout
    assert "HUNG" not in out and "DONE" in out, out[-3000:] + proc.stderr[-3000:]
    bad = [line for line in out.splitlines() if "OTHER" in line or "close raised" in line]
    assert bad == [], bad
