"""Checkpointer on one process: the snapshot is consistent, the background publishes what pack would, and
nothing that goes wrong in the background is lost."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import IntegrityError, UsageError
from ckpt_archive.repo.repository import Repository
from ckpt_archive.store.faults import Faults
from ckpt_archive.training.checkpointer import Checkpointer
from ckpt_archive.training.snapshot import DEVICE_ATTR, Snapshotter

ROOT = Path(__file__).resolve().parent.parent


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _state(model, opt, sched):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": {"torch": torch.get_rng_state()}, "progress": {"step": 3}}


def _clone(obj):
    import copy

    return copy.deepcopy(obj)


def _assert_same(a, b, path="state"):
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def test_mutating_live_state_right_after_save_does_not_change_the_archive(tmp_path):
    model, opt, sched = _trained()
    state = _state(model, opt, sched)
    expected = _clone(state)
    with Checkpointer(tmp_path / "repo") as ckpt:
        handle = ckpt.save(3, state)
        # the training loop goes on at once: parameters and Adam moments change in place
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
        for s in opt.state.values():
            s["exp_avg"].mul_(-3.0)
        state["rng"]["torch"].zero_()
        result = handle.result()
    got = ckpt_archive.load(tmp_path / "repo", result.generation)
    _assert_same(got, expected)


def test_checkpointer_generation_is_what_pack_makes_of_the_same_state(tmp_path):
    model, opt, sched = _trained()
    shared = torch.arange(12.0)
    state = {**_state(model, opt, sched), "tied": {"a": shared, "b": shared, "view": shared[2:8].view(2, 3)},
             "half": torch.randn(3, 4).to(torch.bfloat16), "f16": torch.randn(5).half()}
    packed = ckpt_archive.pack(state, tmp_path / "packed",
                               annotations=ckpt_archive.Annotations(metrics={"loss": 0.5}, progress={"step": 3}))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        saved = ckpt.save(3, state, {"loss": 0.5}, block=True).result()
    a, b = packed.manifest, saved.manifest
    for field in ("format", "format_version", "source", "progress", "config", "metrics", "data", "tags",
                  "tree_member", "tensors", "summary", "instructions"):
        assert a[field] == b[field], field
    strip = ("stored_sha256", "chunks", "stored_bytes")
    assert [{k: v for k, v in m.items() if k not in strip} for m in a["members"]] == \
           [{k: v for k, v in m.items() if k not in strip} for m in b["members"]]
    gen = Repository.open(tmp_path / "ckpt").generation(saved.generation)
    assert gen.status == "usable" and gen.marker["trial_reload"]["result"] == "ok"
    got = ckpt_archive.load(tmp_path / "ckpt")
    assert got["tied"]["a"].untyped_storage().data_ptr() == got["tied"]["b"].untyped_storage().data_ptr()
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], state["half"])
    assert got["f16"].dtype == torch.float16 and torch.equal(got["f16"], state["f16"])


def test_checkpointer_keeps_conj_neg_bits_attributes_and_non_strided_tensors(tmp_path):
    """Fault guarded: the snapshot rebuilt each tensor over its copied storage with ``set_``, which drops the
    lazy conj/neg bits (a conjugate view came back unconjugated: wrong values, and verify passed) and the
    tensor's Python attributes, and raised in the training thread on a nested tensor; ``pack`` of the same
    state kept all of them."""
    import warnings

    c = torch.tensor([1 + 2j, 3 - 4j])
    p = torch.nn.Parameter(torch.ones(2))
    p.tag = "emb"
    t = torch.zeros(3)
    t.note = {"k": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"conj": c.conj(), "neg": c.conj().imag, "p": p, "t": t,
                 "nested": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)]),
                 "sparse": torch.eye(3).to_sparse(),
                 "q": torch.quantize_per_tensor(torch.ones(4), 0.5, 0, torch.qint8)}
        with Checkpointer(tmp_path / "ckpt") as ckpt:
            ckpt.save(1, state).result()
        got = ckpt_archive.load(tmp_path / "ckpt")
    assert got["conj"].is_conj() and torch.equal(got["conj"].resolve_conj(), state["conj"].resolve_conj())
    assert got["neg"].is_neg() and torch.equal(got["neg"].resolve_neg(), torch.tensor([-2.0, 4.0]))
    assert type(got["p"]) is torch.nn.Parameter and vars(got["p"]) == {"tag": "emb"}
    assert vars(got["t"]) == {"note": {"k": 1}}
    assert got["nested"].is_nested and all(torch.equal(a, b) for a, b in zip(got["nested"].unbind(), state["nested"].unbind()))
    assert torch.equal(got["sparse"].to_dense(), torch.eye(3)) and got["q"].is_quantized


def test_snapshot_keeps_parameters_views_and_reuses_its_buffers():
    p = torch.nn.Parameter(torch.randn(4, 4))
    base = torch.arange(10.0)
    od = collections.OrderedDict(w=p, v=base[1:5], base=base)
    od._metadata = {"": {"version": 1}}
    snap = Snapshotter()
    first = snap.take({"sd": od, "t": (1, 2.5)})
    assert snap.last.allocated_bytes == p.numel() * 4 + base.numel() * 4
    assert isinstance(first["sd"]["w"], torch.nn.Parameter) and first["sd"]["w"].requires_grad
    assert first["sd"]._metadata == {"": {"version": 1}} and type(first["sd"]) is collections.OrderedDict
    assert first["sd"]["v"].untyped_storage().data_ptr() == first["sd"]["base"].untyped_storage().data_ptr()
    assert first["sd"]["v"].storage_offset() == 1 and first["t"] == (1, 2.5)
    ptr = first["sd"]["w"].data_ptr()
    second = snap.take({"sd": od, "t": (1, 2.5)})
    assert snap.last.allocated_bytes == 0, "the second snapshot allocated instead of reusing its buffers"
    assert second["sd"]["w"].data_ptr() == ptr


def test_snapshot_records_the_gpu_device_of_a_host_copy():
    # what a CUDA tensor's pinned copy carries to the encoder (the copy itself needs a GPU: tests/gpu/)
    from ckpt_archive.format.state_tree import encode

    t = torch.ones(3)
    setattr(t, DEVICE_ATTR, "cuda:1")
    _, table = encode({"w": t})
    assert table.leaves["w"]["device"] == "cuda:1"


def test_background_failure_is_raised_at_the_next_call_and_leaves_nothing_usable(tmp_path):
    Repository.open(tmp_path / "repo", create=True)
    repo = Repository.open(tmp_path / "repo", faults=Faults.parse("after-verify=raise"))
    ckpt = Checkpointer(repo)
    ckpt.save(1, {"w": torch.ones(3)})  # returns: the failure happens in the background
    with pytest.raises(RuntimeError, match="injected failure") as info:
        ckpt.save(2, {"w": torch.ones(3)})
    notes = getattr(info.value, "__notes__", [])
    assert any("step 1" in n for n in notes) and any("left partial" in n and "gc" in n for n in notes)
    assert ckpt_archive.list_generations(tmp_path / "repo") == []
    assert ckpt.wait() is None  # raised once, not again
    ckpt.close()


def test_a_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path / "repo")
    gate = threading.Event()
    real = Checkpointer._write

    def slow(self, *a, **k):
        gate.wait(10)
        return real(self, *a, **k)

    monkeypatch.setattr(Checkpointer, "_write", slow)
    h1 = ckpt.save(1, {"w": torch.zeros(2)})
    threading.Timer(0.3, gate.set).start()
    h2 = ckpt.save(2, {"w": torch.ones(2)})
    assert h1.done() and h2.waited_s >= 0.2
    ckpt.close()
    gens = ckpt_archive.list_generations(tmp_path / "repo")
    assert [g.manifest["progress"]["step"] for g in gens] == [1, 2]
    assert torch.equal(ckpt_archive.load(tmp_path / "repo", 1)["w"], torch.zeros(2))


def test_body_exception_keeps_a_note_of_the_background_failure(tmp_path):
    Repository.open(tmp_path / "repo", create=True)
    repo = Repository.open(tmp_path / "repo", faults=Faults.parse("after-trial-reload=raise"))
    with pytest.raises(KeyError) as info:
        with Checkpointer(repo) as ckpt:
            ckpt.save(1, {"w": torch.ones(2)})
            time.sleep(0.05)
            raise KeyError("training blew up")
    assert any("background save failed" in n for n in info.value.__notes__)


def test_bad_metrics_and_steps_fail_in_the_callers_thread(tmp_path):
    with Checkpointer(tmp_path / "repo") as ckpt:
        with pytest.raises(UsageError):
            ckpt.save(-1, {"w": torch.ones(1)})
        with pytest.raises(Exception):
            ckpt.save(1, {"w": torch.ones(1)}, {"loss": torch.ones(1)})
    assert ckpt_archive.list_generations(tmp_path / "repo") == []


def test_restore_round_trips_model_optimizer_scheduler_scaler_and_rng(tmp_path):
    model, opt, sched = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    torch.manual_seed(123)
    with Checkpointer(tmp_path / "repo") as ckpt:
        assert ckpt.restore(model=model, optimizer=opt) is None  # fresh start
        state = {**_state(model, opt, sched), "scaler": scaler.state_dict()}
        ckpt.save(3, state)
        ckpt.wait()
        assert ckpt.latest().manifest["progress"]["step"] == 3
    after = torch.rand(3)
    m2, o2, s2 = _trained(seed=1)
    sc2 = torch.amp.GradScaler("cpu")
    with Checkpointer(tmp_path / "repo") as ckpt:
        got = ckpt.restore(model=m2, optimizer=o2, scheduler=s2, scaler=sc2, policy="checkpoint")
    assert got.step == 3 and got.generation == 1
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert s2.state_dict() == sched.state_dict()
    assert sc2.state_dict() == scaler.state_dict()
    assert torch.equal(torch.rand(3), after)  # the torch RNG stream continues where it was saved
    assert set(got.report.restored) >= {"model", "optimizer", "scheduler", "scaler", "rng"}


def test_restore_onto_fewer_cuda_devices_says_what_happened_to_the_extra_states(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs; tests/gpu/ covers the visible case")
    cuda_states = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]
    with Checkpointer(tmp_path / "repo") as ckpt:
        ckpt.save(1, {"rng": {"torch": torch.get_rng_state(), "cuda": cuda_states}}, block=True)
        got = ckpt.restore()
    assert got.report.bitwise_resumable is False
    assert any("2 saved, 0 visible" in w for w in got.report.warnings)


def test_closed_checkpointer_refuses_to_save(tmp_path):
    ckpt = Checkpointer(tmp_path / "repo")
    ckpt.close()
    with pytest.raises(UsageError):
        ckpt.save(1, {"w": torch.ones(1)})


def test_a_damaged_generation_is_never_restored(tmp_path):
    with Checkpointer(tmp_path / "repo") as ckpt:
        ckpt.save(1, {"model": {"w": torch.arange(1000.0)}}, block=True)
    member = next((tmp_path / "repo" / "generations" / "00000001").glob("tensors-*.ckz"))
    data = bytearray(member.read_bytes())
    data[-5] ^= 0xFF
    member.write_bytes(bytes(data))
    with Checkpointer(tmp_path / "repo") as ckpt:
        with pytest.raises(IntegrityError):
            ckpt.restore()


def test_session_restore_of_a_scheduler_without_its_optimizer_silently_took_the_archived_lrs(tmp_path):
    """policy='session' once fell back to 'checkpoint' whenever optimizer= was missing, so a scheduler
    restored alone brought the archived base_lrs back without a word (issue 12's first story)."""
    import torch

    from ckpt_archive import Checkpointer
    from ckpt_archive.errors import UsageError

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    with Checkpointer(tmp_path / "repo") as ckpt:
        ckpt.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sch.state_dict()},
                  block=True)
        live_opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        live_sch = torch.optim.lr_scheduler.StepLR(live_opt, step_size=10)
        with pytest.raises(UsageError, match="needs its optimizer"):
            ckpt.restore(model=model, scheduler=live_sch)
        assert live_sch.base_lrs == [1e-4]  # nothing was restored


def _cli(*args):
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _readme_loop(repo, total_steps, *, zero_based=False, every=3):
    """The README's Checkpointer loop (``step``: updates completed, as save() documents it), or, with
    ``zero_based``, the loop as the README had it (the 0-based index of the update just made)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)

    def train_one_step():
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        return loss

    with Checkpointer(repo) as ckpt:
        restored = ckpt.restore(model=model, optimizer=opt, scheduler=sched)
        start = restored.step if restored else 0
        for step in range(start, total_steps):
            loss = train_one_step()
            saved = step if zero_based else step + 1
            if (step + 1) % every == 0:
                ckpt.save(saved, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                  "scheduler": sched.state_dict(), "rng": {"torch": torch.get_rng_state()}},
                          metrics={"loss": loss.item()})
    return restored, opt


def test_the_readme_loop_gets_no_counter_warning_and_resumes_at_the_next_update(tmp_path):
    """Issue 26: the README's loop passed a 0-based step, and verify/inspect then warned "optimizer step 100 vs
    progress step 99 ... the parts were saved at different instants", with an explanation (AMP-skipped steps
    explain optimizer < progress) that did not fit the numbers. With save()'s documented convention (updates
    completed) the counters agree: no finding; restore().step is where the loop resumes. The completeness
    lint also said "no ... step counter saved" although the manifest records it."""
    repo = tmp_path / "repo"
    _readme_loop(repo, 6)
    gen = ckpt_archive.list_generations(repo)[-1]
    assert gen.manifest["progress"]["step"] == 6
    for cmd in ("verify", "inspect"):
        res = _cli(cmd, repo)
        assert res.exit_code == 0, res.output
        assert "counters disagree" not in res.output and "different instants" not in res.output, res.output
        assert "optimizer step 6 " not in res.output
        # the progress step is in the manifest: the completeness lint no longer says none was saved
        assert "step counter saved" not in " ".join(res.output.split()), res.output
    restored, opt = _readme_loop(repo, 8)  # resumes after update 6: runs updates 7 and 8 only
    assert restored.step == 6
    assert max(int(s["step"]) for s in opt.state.values()) == 8


def test_a_zero_based_step_is_explained_as_such_not_called_a_different_instant(tmp_path):
    """A loop that passes the 0-based index of the last update (the README's old loop) gets one info
    finding that names what it compares and the convention, and no warning."""
    from ckpt_archive.training.audit import counters_finding

    repo = tmp_path / "repo"
    _readme_loop(repo, 6, zero_based=True)
    res = _cli("inspect", repo)
    assert res.exit_code == 0, res.output
    assert "counters disagree" not in res.output and "different instants" not in res.output, res.output
    text = " ".join(res.output.split())
    assert "optimizer step 6" in text and "progress step 5" in text and "0-based" in text, res.output
    f = counters_finding("optimizer.state", 6, 5)
    assert f.severity == "info"
    # the other directions stay warnings, each with the explanation that fits its sign
    ahead, behind = counters_finding("o", 110, 99), counters_finding("o", 90, 99)
    assert ahead.severity == behind.severity == "warning"
    assert "11 more updates" in ahead.message and "AMP" not in ahead.message
    assert "9 fewer updates" in behind.message and "AMP" in behind.message


def test_the_first_save_runs_no_torch_operation_the_construction_did_not_warm_up(tmp_path):
    """Issue 29: a Checkpointer's first save of a 4x4 state blocked 0.6-0.8 ms against a 0.1 ms clone(): each
    torch operation's first call in a process costs 10-130 us more (argument parser and dispatcher set up).
    The constructor runs the copy's operations once (``warm_up``, on a throwaway snapshotter); this fails
    when ``take`` starts using an operation the warm-up does not run (the first save would pay for it
    again), or when the warm-up touches the Checkpointer's own buffers or write count."""
    from torch.overrides import TorchFunctionMode

    from ckpt_archive.training.snapshot import warm_up

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.add(getattr(func, "__qualname__", None) or repr(func))
            return func(*args, **(kwargs or {}))

    state = {"model": {"w": torch.randn(4, 4), "p": torch.nn.Parameter(torch.randn(3))},
             "view": torch.arange(6.0)[2:], "step": 1}
    with Calls() as warmed:
        warm_up()
    with Calls() as taken:
        Snapshotter(pin_memory=False).take(state)
    assert taken.seen and taken.seen <= warmed.seen, sorted(taken.seen - warmed.seen)
    ckpt = Checkpointer(tmp_path / "repo")
    try:
        assert ckpt._snap.writes == 0 and not ckpt._snap._buffers  # the warm-up used a throwaway snapshotter
    finally:
        ckpt.close()


def test_a_torch_import_still_running_in_another_thread_is_neither_warmed_up_nor_walked(monkeypatch):
    """Break test: ``Checkpointer(..., distributed=False)`` built while another thread was still importing torch
    (a second Checkpointer's background thread, a user's loader thread) ran the warm-up's ``torch.zeros`` on the
    half-imported module: ``AttributeError: partially initialized module 'torch'``, or SIGSEGV. A module whose
    import has not finished counts as absent (no tensor can have been made from it): no operation runs."""
    from torch.overrides import TorchFunctionMode

    from ckpt_archive.training.snapshot import loaded, warm_up

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    assert loaded("torch") is torch
    monkeypatch.setattr(torch.__spec__, "_initializing", True, raising=False)  # as importlib marks it meanwhile
    assert loaded("torch") is None
    with Calls() as calls:
        warm_up()
        copy = Snapshotter(pin_memory=False).take({"step": 3, "config": {"lr": 1e-4}})
    assert calls.n == 0 and copy == {"step": 3, "config": {"lr": 1e-4}}


def test_a_checkpointer_built_while_a_thread_imports_torch_saves_and_restores(tmp_path):
    """The break test's reproduction, end to end in a fresh interpreter (it crashed 4 of 4 times with SIGSEGV
    before the fix): a thread imports torch; meanwhile a Checkpointer is built and saves a state of plain values,
    the state later saved with tensors, and every generation loads back as saved."""
    script = r"""
import sys, threading, time
threading.Thread(target=__import__, args=("torch",)).start()
time.sleep(float(sys.argv[2]))
from ckpt_archive.training.checkpointer import Checkpointer
ckpt = Checkpointer(sys.argv[1], distributed=False)
ckpt.save(1, {"step": 1, "config": {"lr": 1e-4}})
import torch
ckpt.save(2, {"model": {"w": torch.arange(6.0)}, "step": 2})
ckpt.close()
print("OK")
"""
    for delay in ("0.05", "0.3"):
        repo = tmp_path / f"repo-{delay}"
        proc = subprocess.run([sys.executable, "-c", script, str(repo), delay], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0 and "OK" in proc.stdout, (delay, proc.returncode, proc.stderr[-3000:])
        assert ckpt_archive.load(repo, generation=1) == {"step": 1, "config": {"lr": 1e-4}}
        assert torch.equal(ckpt_archive.load(repo, generation=2)["model"]["w"], torch.arange(6.0))


def test_a_meta_default_device_never_turns_saved_or_loaded_data_into_meta_tensors(tmp_path):
    """Break test (silent wrong result): under ``torch.set_default_device("meta")`` -- how large models are
    built before their weights are loaded -- a Checkpointer's save copied CPU tensors into *meta* tensors
    (its buffers were made on the default device), archived them, and verify passed. Every tensor the
    snapshot, ``load`` and ``restore`` build is now made on the CPU, whatever the default device."""
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3, dtype=torch.int64)},
             "view": torch.arange(6.0)[2:], "step": 5}
    with torch.device("meta"):
        ckpt = Checkpointer(tmp_path / "repo", distributed=False)
        ckpt.save(5, state, block=True)
        ckpt.close()
        loaded = ckpt_archive.load(tmp_path / "repo")
        ckpt_archive.restore(tmp_path / "repo", "latest", tmp_path / "out.pt")
    for got in (loaded, torch.load(tmp_path / "out.pt", weights_only=True)):
        for key in ("w", "b"):
            assert got["model"][key].device.type == "cpu" and torch.equal(got["model"][key], state["model"][key])
        assert torch.equal(got["view"], state["view"]) and got["step"] == 5


def test_building_a_checkpointer_in_a_process_without_torch_does_not_import_it_in_the_callers_thread(tmp_path):
    """Break test: construction imported the publish path in the caller's thread, and with it torch
    (safetensors.torch): 1.5 s for a plain-value state, and a Ctrl-C in the middle of torch's import left torch
    unimportable for the rest of the process. Without torch imported, the background thread imports it."""
    script = r"""
import sys, threading
main = threading.main_thread()
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if threading.current_thread() is main:
            seen.append(name)
        return None
from ckpt_archive.training.checkpointer import Checkpointer
sys.meta_path.insert(0, Spy())
for distributed in (False, None):
    ckpt = Checkpointer(sys.argv[1] + str(distributed), distributed=distributed)
    ckpt.save(1, {"step": 1, "lr": 1e-4})
    ckpt.close()
print("TORCH_IN_CALLER", any(n == "torch" or n.startswith("torch.") for n in seen))
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "repo")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TORCH_IN_CALLER False" in proc.stdout, proc.stdout
    for distributed in ("False", "None"):
        assert ckpt_archive.load(tmp_path / f"repo{distributed}") == {"step": 1, "lr": 1e-4}


def test_a_resume_over_generations_all_damaged_is_refused_not_a_fresh_start(tmp_path):
    """Fault (helper review): `restore()` answered None -- "nothing usable yet, start fresh" -- when every
    published generation of the repository was found damaged, so a training script resumed from step 0 without a
    word, its next saves beside generations that might still be recovered. Now AllGenerationsDamaged (exit 1)
    with what to do; a repository with only a partial generation (a first save that never finished) is still a
    fresh start."""
    import json

    from ckpt_archive.errors import AllGenerationsDamaged

    model, opt, sched = _trained()
    repo = tmp_path / "repo"
    with Checkpointer(repo) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(model, opt, sched))
            ckpt.wait()
    for n in (1, 2):  # each manifest changed after it was published: found wrong by reading it
        p = repo / "generations" / f"{n:08d}" / "manifest.json"
        p.write_text(json.dumps(dict(json.loads(p.read_text()), code_version="edited")))
    with Checkpointer(repo) as ckpt:
        with pytest.raises(AllGenerationsDamaged, match="does not start fresh") as info:
            ckpt.restore(model=model, optimizer=opt)
    assert info.value.exit_code == 1 and "new repository" in info.value.hint

    fresh = tmp_path / "fresh"
    with Checkpointer(fresh) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
        ckpt.wait()
    (fresh / "generations" / "00000001" / "USABLE.json").unlink()  # only a partial generation left
    with Checkpointer(fresh) as ckpt:
        assert ckpt.restore(model=model, optimizer=opt) is None
