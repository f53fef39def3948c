"""The Checkpointer's state machine under interrupts: an exception raised at any point of ``save``/``wait``/
``close`` (a signal handler's, KeyboardInterrupt, a timeout's) or in the background never loses the save in
flight nor its error, never lets a copy overwrite buffers a publish may still read, and never leaves a
generation usable whose content is not its step's state (issue 24, item 7).

Fault guarded (the original report): ``save(2)`` interrupted while it waited for step 1 cleared the in-flight
handle; ``save(3)`` returned at once and overwrote the snapshot buffers step 1's pack was still reading;
step 1 failed its trial reload and was left partial, and ``close()``/``wait()`` raised nothing (and once, on
a loaded machine, a generation listed as usable held another step's values).

Interrupts are injected two ways: deterministically, through the Checkpointer's test seam (``_HOOK``, called
at every named point of the caller's thread: before and inside every wait, around the copy and the hand-over,
before an error is raised), and for real, from a ``SIGALRM`` handler armed with ``signal.setitimer`` while
40 MB tensors are copied and published (``slow``).
"""
from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.repo.repository import Repository
from ckpt_archive.store.faults import Faults
from ckpt_archive.training import checkpointer as ckmod
from ckpt_archive.training.checkpointer import Checkpointer, SaveState
from ckpt_archive.training.snapshot import BuffersBusy, Snapshotter

ROOT = Path(__file__).resolve().parents[1]


class Boom(Exception):
    """What a signal handler or a timeout raises in the training thread."""


def _state(step: int, n: int = 2048) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.full((7,), float(step))},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(n, generator=g)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "rng": {"torch": torch.get_rng_state()}}


def _bits(obj) -> list:
    """Every tensor of ``obj`` as raw bytes, in order (bit-for-bit comparison, NaN-safe)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return [(str(t.dtype), tuple(obj.shape), hashlib.sha256(raw).hexdigest())]
    if isinstance(obj, dict):
        return [(str(k), b) for k in obj for b in _bits(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [b for v in obj for b in _bits(v)]
    return [repr(obj)]


def _digest(obj) -> str:
    return hashlib.sha256(repr(_bits(obj)).encode()).hexdigest()


def _check_repository(repo: Path, expected: dict[int, dict], *, must: set[int], may: set[int] = frozenset(),
                      partial_ok: bool = False) -> dict[int, int]:
    """Every usable generation holds exactly its step's state; the steps in ``must`` are usable, none outside
    ``must | may`` is. Returns step -> usable generation count."""
    seen: dict[int, int] = {}
    for g in ckpt_archive.list_generations(repo, all=True):
        if g.status != "usable":
            assert partial_ok, f"generation {g.number} is {g.status}: {g.reason}"
            continue
        step = g.manifest["progress"]["step"]
        assert step in expected, f"generation {g.number} is usable with step {step}, which was never saved"
        got = ckpt_archive.load(repo, g.number)
        assert _bits(got) == _bits(expected[step]), \
            f"generation {g.number} is usable but does not hold step {step}'s state"
        seen[step] = seen.get(step, 0) + 1
    assert must <= set(seen), f"steps {sorted(must - set(seen))} were lost (usable: {sorted(seen)})"
    assert set(seen) <= must | set(may), f"steps {sorted(set(seen) - must - set(may))} usable, never saved whole"
    return seen


class _Gate:
    """Holds every background write until opened, and records any change to a snapshot while its write
    runs (a buffer overwritten under a running publish)."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.overwritten: list[int] = []
        real = Checkpointer._write

        def gated(ck, rec):
            before = _digest(rec.snap)
            self.open.wait(60)
            try:
                return real(ck, rec)
            finally:
                if _digest(rec.snap) != before:
                    self.overwritten.append(rec.step)

        monkeypatch.setattr(Checkpointer, "_write", gated)


def _raise_at(monkeypatch, point: str, exc: BaseException, *, then=None) -> list:
    """Make the caller's thread raise ``exc`` the first time it reaches ``point``; returns the points seen."""
    seen: list[str] = []
    fired = []

    def hook(p):
        seen.append(p)
        if p == point and not fired:
            fired.append(p)
            if then is not None:
                then()
            raise exc

    monkeypatch.setattr(ckmod, "_HOOK", hook)
    return fired


SAVE_POINTS = ["save", "waiting", "settle", "copy", "copy-acquired", "copied", "submitted", "handed-over"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), Boom("timer")], ids=["KeyboardInterrupt", "Boom"])
@pytest.mark.parametrize("point", SAVE_POINTS)
def test_an_interrupt_anywhere_in_save_loses_no_save_and_overwrites_no_buffer_in_use(tmp_path, monkeypatch,
                                                                                      point, exc):
    """save(2) interrupted at ``point`` while step 1 is being written: step 1 still publishes (nothing read
    its buffers' overwrite), save(3) and close() then work, and every usable generation holds its step's
    state bit for bit. Step 2 is saved only when the interrupt came after its copy was handed over."""
    gate = _Gate(monkeypatch)
    states = {s: _state(s) for s in (1, 2, 3)}
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, states[1])
    assert ckpt.state is SaveState.PUBLISHING
    timer = threading.Timer(0.3, gate.open.set)  # step 1 finishes while save(2) waits (if it still does)
    timer.start()
    fired = _raise_at(monkeypatch, point, exc)
    with pytest.raises(type(exc)):
        ckpt.save(2, states[2])
    assert fired == [point]
    monkeypatch.setattr(ckmod, "_HOOK", None)
    gate.open.set()
    ckpt.save(3, states[3])
    ckpt.close()  # nothing failed in the background: raises nothing
    timer.join()
    assert gate.overwritten == [], f"a snapshot changed while its write ran (steps {gate.overwritten})"
    handed_over = point == "handed-over"
    seen = _check_repository(tmp_path / "repo", states, must={1, 3} | ({2} if handed_over else set()))
    assert seen.get(2, 0) == (1 if handed_over else 0)


@pytest.mark.parametrize("call,point", [("wait", "waiting"), ("wait", "settle"), ("close", "waiting"),
                                        ("close", "settle"), ("close", "close")])
def test_an_interrupt_while_wait_or_close_waits_changes_nothing(tmp_path, monkeypatch, call, point):
    """wait()/close() interrupted while the save is in flight: the save stays in flight; the next call
    waits for it again and returns its result; a close() interrupted leaves the Checkpointer open."""
    gate = _Gate(monkeypatch)
    states = {1: _state(1)}
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, states[1])
    timer = threading.Timer(0.3, gate.open.set)
    timer.start()
    fired = _raise_at(monkeypatch, point, Boom("timer"))
    with pytest.raises(Boom):
        getattr(ckpt, call)()
    timer.join()
    assert fired == [point]
    monkeypatch.setattr(ckmod, "_HOOK", None)
    assert ckpt.state is not SaveState.CLOSED, "an interrupted close() closed the Checkpointer"
    result = ckpt.wait()
    assert result is not None and result.manifest["progress"]["step"] == 1
    ckpt.close()
    assert ckpt.state is SaveState.CLOSED
    _check_repository(tmp_path / "repo", states, must={1})


def _failing_repo(tmp_path, spec: str) -> Repository:
    Repository.open(tmp_path / "repo", create=True)
    return Repository.open(tmp_path / "repo", faults=Faults.parse(spec))


@pytest.mark.parametrize("call", ["save", "wait", "close"])
@pytest.mark.parametrize("point", ["waiting", "settle", "raise"])
def test_a_background_failure_survives_an_interrupt_and_is_raised_by_the_next_call(tmp_path, monkeypatch,
                                                                                     call, point):
    """The original report's second half: after the interrupt, close()/wait() raised nothing. Step 1 fails
    its publish while the caller is interrupted (in the wait, as the outcome is recorded, or as the error
    is about to be raised): the next save/wait/close raises step 1's error, exactly once, and step 1 is
    not usable."""
    gate = _Gate(monkeypatch)
    ckpt = Checkpointer(_failing_repo(tmp_path, "after-verify=raise"))
    states = {1: _state(1), 2: _state(2)}
    ckpt.save(1, states[1])
    timer = threading.Timer(0.3, gate.open.set)  # step 1 fails while the caller waits for it
    timer.start()
    fired = _raise_at(monkeypatch, point, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        if point == "raise":  # the error is pending only once step 1 finished
            ckpt.wait()
        else:
            ckpt.save(2, states[2])
    timer.join()
    assert fired == [point]
    monkeypatch.setattr(ckmod, "_HOOK", None)
    while ckpt.state is SaveState.PUBLISHING:  # interrupted in the wait: step 1 may not have failed yet
        time.sleep(0.01)
    assert ckpt.state is SaveState.FAILED
    with pytest.raises(RuntimeError, match="injected failure") as info:
        if call == "save":
            ckpt.save(2, states[2])
        else:
            getattr(ckpt, call)()
    assert any("step 1" in n and "not archived" in n for n in info.value.__notes__)
    if call == "save":  # raised before the copy: step 2 was not taken
        assert ckpt.state is SaveState.IDLE
        ckpt.save(2, states[2])
    ckpt.close()  # raised once, not again
    _check_repository(tmp_path / "repo", states, must={2} if call == "save" else set(), partial_ok=True)
    assert not any(g.status == "usable" and g.manifest["progress"]["step"] == 1
                   for g in ckpt_archive.list_generations(tmp_path / "repo", all=True))


@pytest.mark.parametrize("fault", ["claim", "after-members", "after-seal", "after-verify", "after-trial-reload",
                                   "publish"])
def test_a_failure_at_any_step_of_the_background_publish_is_raised_and_never_usable(tmp_path, fault):
    ckpt = Checkpointer(_failing_repo(tmp_path, f"{fault}=raise"))
    ckpt.save(1, _state(1))
    with pytest.raises(RuntimeError, match="injected failure") as info:
        ckpt.wait()
    assert any("step 1" in n and "not archived" in n for n in info.value.__notes__)
    assert ckpt.wait() is None and ckpt.close() is None  # once
    assert ckpt_archive.list_generations(tmp_path / "repo") == []


def test_a_failure_after_the_marker_says_the_generation_is_usable(tmp_path):
    """after-publish (retention's turn) fails: the generation was published and holds its step; the error
    is still raised, and its note says so instead of 'not archived'."""
    states = {1: _state(1)}
    ckpt = Checkpointer(_failing_repo(tmp_path, "after-publish=raise"))
    ckpt.save(1, states[1])
    with pytest.raises(RuntimeError, match="injected failure") as info:
        ckpt.close()
    assert any("generation 1 was published" in n and "usable" in n for n in info.value.__notes__)
    _check_repository(tmp_path / "repo", states, must={1})


def test_a_keyboard_interrupt_in_the_background_thread_is_the_saves_failure(tmp_path, monkeypatch):
    def interrupted(ck, rec):
        raise KeyboardInterrupt("in the background")

    monkeypatch.setattr(Checkpointer, "_write", interrupted)
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, _state(1))
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, _state(2))
    ckpt.close()


class _Exploding:
    """A value whose copy raises (an exception inside the copy, in the caller's thread)."""

    def __deepcopy__(self, memo):
        raise Boom("in the copy")


def test_an_exception_inside_the_copy_abandons_that_save_only(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    states = {1: _state(1), 3: _state(3)}
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, states[1])
    gate.open.set()
    with pytest.raises(Boom):
        ckpt.save(2, {**_state(2), "odd": _Exploding()})
    assert ckpt.state is SaveState.IDLE
    ckpt.save(3, states[3])
    ckpt.close()
    assert gate.overwritten == []
    _check_repository(tmp_path / "repo", states, must={1, 3})


def test_state_machine_goes_idle_copying_publishing_idle_and_closed(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    ckpt = Checkpointer(tmp_path / "repo")
    assert ckpt.state is SaveState.IDLE
    states_seen = []
    monkeypatch.setattr(ckmod, "_HOOK", lambda p: states_seen.append((p, ckpt.state)))
    ckpt.save(1, _state(1))
    assert ("copied", SaveState.COPYING) in states_seen
    assert ckpt.state is SaveState.PUBLISHING
    gate.open.set()
    ckpt.wait()
    assert ckpt.state is SaveState.IDLE
    ckpt.close()
    assert ckpt.state is SaveState.CLOSED


def test_snapshot_buffers_held_by_a_save_are_never_overwritten():
    """The invariant itself: while one owner holds the buffers, another copy refuses before writing."""
    snap = Snapshotter()
    a, b = object(), object()
    snap.acquire(a)
    first = snap.take({"w": torch.ones(4)}, owner=a)
    with pytest.raises(BuffersBusy):
        snap.take({"w": torch.zeros(4)}, owner=b)
    with pytest.raises(BuffersBusy):
        snap.take({"w": torch.zeros(4)})
    with pytest.raises(BuffersBusy):
        snap.acquire(b)
    assert torch.equal(first["w"], torch.ones(4))
    assert not snap.release(b) and snap.release(a)
    snap.acquire(b)
    snap.take({"w": torch.zeros(4)}, owner=b)
    assert torch.equal(first["w"], torch.zeros(4))  # the same buffer, reused once a was done


def test_a_write_whose_buffers_changed_hands_is_withdrawn_not_published(tmp_path, monkeypatch):
    """The check before the marker: if the buffers stopped being this save's while its write read them
    (they never do: the copy refuses; here they are taken by force), the generation is withdrawn, never
    usable, and the error is raised."""
    real = Checkpointer._write

    def stolen(ck, rec):
        ck._snap.release(rec)
        ck._snap.acquire(object())  # another holder, as a copy racing the write would be
        return real(ck, rec)

    monkeypatch.setattr(Checkpointer, "_write", stolen)
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.save(1, _state(1))
    with pytest.raises(Exception, match="changed hands") as info:
        ckpt.wait()
    assert any("not archived" in n for n in info.value.__notes__)
    assert ckpt_archive.list_generations(tmp_path / "repo") == []


def test_a_plain_first_save_imports_nothing_in_the_callers_thread(tmp_path):
    """Issue 29: the first save imported 523 modules in the training thread (torch.distributed.tensor pulls
    in sympy and mpmath) to ask whether a tensor is a DTensor. A fresh interpreter records every module
    the caller's thread imports during save(); none may be imported (the publish path's are imported by
    the background thread)."""
    script = r"""
import sys, threading, torch
from ckpt_archive.training.checkpointer import Checkpointer
main = threading.main_thread()
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if threading.current_thread() is main and recording:
            seen.append(name)
        return None
recording = False
sys.meta_path.insert(0, Spy())
ckpt = Checkpointer(sys.argv[1])
recording = True
ckpt.save(1, {"model": {"w": torch.randn(4, 4)}, "optimizer": {"state": {}, "param_groups": []}}, {"loss": 0.5})
recording = False
ckpt.close()
print("IMPORTED", sorted(seen))
print("DTENSOR", "torch.distributed.tensor" in sys.modules, "SYMPY", "sympy" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "repo")], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout, proc.stdout
    assert "DTENSOR False SYMPY False" in proc.stdout, proc.stdout
    assert ckpt_archive.list_generations(tmp_path / "repo")[0].manifest["progress"]["step"] == 1


# -- real signals, 40 MB tensors (the size the race showed at) -------------------------------------------------
def _big(step: int) -> dict:
    n = 10_000_000  # 40 MB of float32
    return {"model": {"w": torch.full((n,), float(step)), "b": torch.arange(16.0) + step},
            "step_tag": step}


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.002, 0.02, 0.08, 0.2, 0.5])
def test_sigalrm_during_save_of_40mb_tensors_never_loses_or_mixes_a_save(tmp_path, delay):
    """The original report, for real: a SIGALRM handler raises in the training thread ``delay`` s into
    save(2) while step 1 (40 MB) is being published; wherever it lands (waiting, copying, handing over),
    save(3) and close() follow, nothing is lost or mixed, and every usable generation is its step's state."""
    states = {s: _big(s) for s in (1, 2, 3)}

    def handler(signum, frame):
        raise Boom("SIGALRM")

    old = signal.signal(signal.SIGALRM, handler)
    try:
        ckpt = Checkpointer(tmp_path / "repo")
        ckpt.save(1, states[1])
        interrupted = False
        signal.setitimer(signal.ITIMER_REAL, delay)
        try:
            ckpt.save(2, states[2])
            ckpt.wait()
        except Boom:
            interrupted = True
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        ckpt.save(3, states[3])
        ckpt.close()
    finally:
        signal.signal(signal.SIGALRM, old)
    _check_repository(tmp_path / "repo", states, must={1, 3} | (set() if interrupted else {2}), may={2})


@pytest.mark.slow
def test_a_storm_of_sigalrm_across_saves_waits_and_close_keeps_every_step(tmp_path):
    """A timer firing every few milliseconds through a whole loop of saves (each interrupted call retried, as
    a loop that catches its timeout would): every step ends usable with exactly its state, none twice
    unless its interrupted save had already handed its copy over, and close() raises nothing."""
    states = {s: _big(s) for s in range(1, 5)}
    fired = [0]
    armed = [False]

    def handler(signum, frame):
        if armed[0]:  # raise only inside the retried call, never in this test's own bookkeeping
            fired[0] += 1
            raise Boom("SIGALRM")

    def retry(fn, *args):
        while True:
            try:
                armed[0] = True
                return fn(*args)
            except Boom:
                pass
            finally:
                armed[0] = False

    old = signal.signal(signal.SIGALRM, handler)
    try:
        ckpt = Checkpointer(tmp_path / "repo", retention=None)
        signal.setitimer(signal.ITIMER_REAL, 0.003, 0.017)
        try:
            for s in states:
                retry(ckpt.save, s, states[s])
            retry(ckpt.close)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert fired[0] > 0
    _check_repository(tmp_path / "repo", states, must=set(states))
