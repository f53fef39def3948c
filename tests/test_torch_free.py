"""Issue 29: a torch.save file is packed without importing torch when its pickle holds only what the
restricted reader (format/pt_pickle.py) proves equal to ``torch.load(weights_only=True)``'s result -- and
the archive is then the very archive the torch.load path writes. Anything the reader cannot prove falls
back to torch.load, whose verdict stands; a hostile pickle is never executed.
"""
from __future__ import annotations

import ast
import collections
import json
import os
import random
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import CkptArchiveError
from ckpt_archive.format import pt_encode, pt_pickle, state_tree
from ckpt_archive.sources import torchfile


def _adam_state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    sch = torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)
    for _ in range(2):
        m(torch.randn(3, 6)).sum().backward()
        opt.step()
        sch.step()
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), "scheduler": sch.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.Random(3).getstate(),
                    "numpy": {"bit_generator": "PCG64", "state": {"state": 2**127 + 5, "inc": 2**100 + 1},
                              "has_uint32": 0, "uinteger": 0}},
            "step": 2, "epoch": 0, "best_val_loss": torch.tensor(1.25, dtype=torch.bfloat16)}


def _dtypes():
    g = torch.Generator().manual_seed(1)
    out = {}
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128):
        out[str(dt)] = torch.randn(3, 4, generator=g, dtype=torch.float64 if not dt.is_complex else dt).to(dt)
    for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        out[str(dt)] = torch.randint(0 if dt == torch.uint8 else -50, 50, (5,), generator=g, dtype=dt)
    out["bool"] = torch.rand(7, generator=g) > 0.5
    out["nan_bits"] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])  # subnormal, NaN, -0
    return out


def _views():
    base = torch.arange(24, dtype=torch.float32)
    w = torch.randn(4, 3)
    flat = torch.arange(10, dtype=torch.int64)
    empty = torch.empty(0, 4)
    return {"tied_a": w, "tied_b": w, "t": w.t(), "row": w[1], "slice": base[3:9], "strided": base[::5],
            "reshaped": base.view(4, 6), "cols": base.view(4, 6)[:, 2:4], "flat_parts": [flat[:4], flat[4:]],
            "empty": torch.empty(0, 4), "empty_t": torch.empty(0, 4).t(), "empty_strided": torch.empty(3, 0)[:, :],
            "zero_dim": torch.tensor(3.25, dtype=torch.float64), "one_elem": torch.ones(1, 1, 1),
            "size1_dims": torch.ones(3, 1).expand(3, 1), "complex_view": torch.randn(4, dtype=torch.complex64)[1:3],
            "same_geometry": [base.view(4, 6), base.view(4, 6)], "one_empty_storage": [empty, empty.t()]}


def _values():
    shared = {"k": [1, 2]}
    od = collections.OrderedDict([("z", 1), ("a", torch.ones(2)), (3, "int key")])
    od._metadata = collections.OrderedDict({"": {"version": 2}})
    return {"floats": [1.5, float("inf"), float("-inf"), float("nan"), -0.0, 1e308],
            "ints": [0, -1, 255, 256, 65535, 65536, 2**31 - 1, -(2**31), 2**53 + 1, 2**64 + 1, -(2**70)],
            "strings": ["", "é", "\U0001f600", "a\ud800b"], "\udcff key": "lone surrogate key",
            "keys": {3: "int", (1, 2): "tuple", None: "none", 2.5: "float", True: "bool"},
            "nested": [[[]], ((),), {"": {}}], "long_list": list(range(40)), "long_floats": [0.5] * 20,
            "mixed_long": [1] * 10 + ["x"] * 10, "shared_a": shared, "shared_b": shared, "odict": od,
            "tuple_with_tensor": (torch.zeros(2), 1), "dollar": {"$t": "not a tag"}, "none": None}


def _lora():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import shared  # the benchmark's LoRA-like state, at a toy size
    finally:
        sys.path.pop(0)
    return shared.build(32, 3, rank=2)


#: states the restricted reader must read (the archive is then the torch.load path's, byte for byte)
READ_WITHOUT_TORCH = {"adam": _adam_state, "dtypes": _dtypes, "views": _views, "values": _values, "lora": _lora,
                      "bare_tensor": lambda: torch.arange(6.0), "bare_list": lambda: [torch.ones(2), 3],
                      "empty_dict": dict}


def _fixture_without_numpy():
    from tests.fixture_state import fixture_state

    st = fixture_state()
    del st["np"]
    st["misc"] = [v for v in st["misc"] if not isinstance(v, bytes)]
    return st


READ_WITHOUT_TORCH["fixture_state_plain"] = _fixture_without_numpy


def _needs_torch():
    p = torch.nn.Parameter(torch.ones(2))
    t = torch.arange(3.0)
    t.note = "attr"
    return {
        "parameter": {"p": p}, "requires_grad": {"g": torch.ones(2, requires_grad=True)},
        "size": {"s": torch.Size([2, 3])}, "device": {"d": torch.device("cpu")}, "dtype": {"d": torch.float16},
        "bytes": {"b": b"\x00\xff"}, "bytearray": {"b": bytearray(b"ab")}, "set": {"s": {1, 2}},
        "complex": {"c": 1 + 2j}, "counter": {"c": collections.Counter({7: 2})},
        "conj": {"c": torch.randn(3, dtype=torch.complex64).conj()}, "neg": {"n": torch.randn(3, dtype=torch.complex64).conj().imag},
        "attrs": {"t": t}, "sparse": {"s": torch.eye(3).to_sparse()},
        "quantized": {"q": torch.quantize_per_tensor(torch.linspace(0, 1, 4), 0.1, 0, torch.quint8)},
        "uint16": {"u": torch.zeros(4, dtype=torch.uint16)}, "float8": {"f": torch.zeros(2, dtype=torch.float8_e4m3fn)},
        "storage_value": {"s": torch.arange(3.0).untyped_storage()},
        "fixture_state": __import__("tests.fixture_state", fromlist=["fixture_state"]).fixture_state(),
        "odict_class": {"c": collections.OrderedDict},
    }


def _save(tmp_path, name, state):
    path = tmp_path / f"{name}.pt"
    torch.save(state, path)
    return path


def _assert_same_encoding(path):
    """The tree and tensor table the torch-free reader gives equal the torch.load path's, entry bytes too."""
    tree_t, table_t = state_tree.encode(torchfile.load_torch_file(path))
    state_f, _ = pt_pickle.read(path)
    tree_f, table_f = pt_encode.encode(state_f)
    assert json.dumps(tree_f) == json.dumps(tree_t)
    assert table_f.leaves == table_t.leaves
    assert list(table_f.entries) == list(table_t.entries)
    for key, e in table_t.entries.items():
        f = table_f.entries[key]
        assert (f.st_dtype, f.shape, f.nbytes) == (e.st_dtype, e.shape, e.nbytes), key
        assert bytes(f.source()) == bytes(e.source()), key
    assert set(table_f.leaf_bytes) == set(table_t.leaf_bytes)
    for key, get in table_t.leaf_bytes.items():
        assert b"".join(map(bytes, table_f.leaf_bytes[key]())) == b"".join(map(bytes, get())), key
    assert table_f.warnings == table_t.warnings


@pytest.mark.parametrize("name", sorted(READ_WITHOUT_TORCH))
def test_a_file_read_without_torch_encodes_exactly_as_torch_load_gives_it(tmp_path, name):
    """Guards against the torch-free reader storing anything other than what torch.load reads: tree, tensor
    records (views, tied storages, dtypes, strides of empty tensors), entry and view bytes."""
    _assert_same_encoding(_save(tmp_path, name, READ_WITHOUT_TORCH[name]()))


def _manifest_core(repo):
    gen = sorted(os.listdir(repo / "generations"))[-1]
    m = json.loads((repo / "generations" / gen / "manifest.json").read_text())
    return {k: m[k] for k in ("members", "tensors", "tree_member", "source", "summary", "progress", "metrics",
                              "instructions", "data", "format_version")}


def test_pack_without_torch_writes_the_archive_the_torch_load_path_writes(tmp_path, monkeypatch):
    """Guards against the two read paths drifting apart anywhere in the archive: members (every chunk and
    fingerprint), tensor index, tree, exact-bytes segments and the file's sha256, progress and metrics
    (found in the tensors read without torch: ``best_val_loss`` is a bf16 scalar tensor)."""
    state = {name: build() for name, build in READ_WITHOUT_TORCH.items()}
    state.update(step=7, best_val_loss=torch.tensor(0.75, dtype=torch.bfloat16))
    src = _save(tmp_path, "all", state)
    calls = []
    real = torchfile.load_torch_file
    monkeypatch.setattr(torchfile, "load_torch_file", lambda *a, **k: calls.append(a) or real(*a, **k))
    ckpt_archive.pack(src, tmp_path / "free")
    assert calls == [], "the torch-free path was not taken"
    monkeypatch.setattr(torchfile, "_read_torch_free", lambda *a, **k: None)
    ckpt_archive.pack(src, tmp_path / "torch")
    assert calls, "the torch.load path was not taken"
    free, via_torch = _manifest_core(tmp_path / "free"), _manifest_core(tmp_path / "torch")
    assert free == via_torch
    assert free["progress"]["step"] == 7 and free["metrics"] == {"best_val_loss": 0.75}
    ckpt_archive.restore(tmp_path / "free", output=tmp_path / "out.pt")
    assert (tmp_path / "out.pt").read_bytes() == src.read_bytes()


NEEDS_TORCH = ["parameter", "requires_grad", "size", "device", "dtype", "bytes", "bytearray", "set", "complex",
               "counter", "conj", "neg", "attrs", "sparse", "quantized", "uint16", "float8", "storage_value",
               "fixture_state", "odict_class"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", NEEDS_TORCH)
def test_what_the_reader_cannot_prove_falls_back_to_torch_load(tmp_path, name, monkeypatch):
    """Guards against the restricted reader accepting anything outside its proven subset (Parameters,
    requires_grad, torch.Size/device/dtype values, bytes, sets, complex, Counter, conj/neg bits, tensor
    attributes, sparse/quantized/new dtypes, storages as values, NumPy, a class as a value): it says
    NotSimple, and pack then writes what the torch.load path writes."""
    state = _needs_torch()[name]
    src = _save(tmp_path, name, state)
    with pytest.raises(pt_pickle.NotSimple):
        pt_pickle.read(src)
    opts = ckpt_archive.PackOptions(allow_numpy=True)
    ckpt_archive.pack(src, tmp_path / "a", opts)
    monkeypatch.setattr(torchfile, "_read_torch_free", lambda *a, **k: None)
    ckpt_archive.pack(src, tmp_path / "b", opts)
    assert _manifest_core(tmp_path / "a") == _manifest_core(tmp_path / "b")


# ------------------------------------------------------------------------------------------------
# hand-made pickles: never executed, never accepted outside the subset
def _zip(path, pickle_bytes, records=None, *, version=b"3\n", byteorder=b"little"):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        if byteorder is not None:
            zf.writestr("archive/byteorder", byteorder)
        for key, data in (records or {}).items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", version)
    return path


def _tensor_pickle(key="0", storage="FloatStorage", numel=4, offset=0, size=(4,), stride=(1,), extra=b""):
    def uni(s):
        b = s.encode()
        return b"X" + struct.pack("<I", len(b)) + b

    def ints(xs):
        return b"(" + b"".join(b"J" + struct.pack("<i", x) for x in xs) + b"t"

    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + b"(" + uni("storage") + b"ctorch\n" + storage.encode()
            + b"\n" + uni(key) + uni("cpu") + b"J" + struct.pack("<i", numel) + b"tQ" + b"J" + struct.pack("<i", offset)
            + ints(size) + ints(stride) + b"\x89ccollections\nOrderedDict\n)R" + extra + b"tR.")


def test_a_pickle_that_would_run_code_is_refused_and_never_executed(tmp_path):
    """Guards against the reader executing or resolving any global: ``os.system`` (and a builtins.eval)
    stay names; the reader says NotSimple and pack refuses the file through torch's own unpickler."""
    marker = tmp_path / "pwned"
    for glob in (b"os\nsystem\n", b"posix\nsystem\n", b"builtins\neval\n"):
        arg = f"touch {marker}" if b"system" in glob else f"open({str(marker)!r}, 'w')"
        payload = (b"\x80\x02c" + glob + b"X" + struct.pack("<I", len(arg)) + arg.encode() + b"\x85R.")
        src = _zip(tmp_path / "evil.pt", payload)
        with pytest.raises(pt_pickle.NotSimple):
            pt_pickle.read(src)
        with pytest.raises(CkptArchiveError):
            ckpt_archive.pack(src, tmp_path / "r")
        assert not marker.exists()


@pytest.mark.parametrize("case", ["view past its storage", "record shorter than its storage", "storage key retyped",
                                  "big-endian file", "unknown version", "requires_grad", "hooks not empty",
                                  "unknown storage class", "global as a value", "truncated pickle", "odd setitems"])
def test_a_malformed_file_is_not_read_without_torch(tmp_path, case):
    """Guards against the reader accepting a file torch.load would read otherwise or refuse: each of these
    says NotSimple (then torch.load decides, and pack refuses or packs exactly as before)."""
    rec = {"0": struct.pack("<4f", 1, 2, 3, 4)}
    kw: dict = {}
    if case == "view past its storage":
        data = _tensor_pickle(size=(5,))
    elif case == "record shorter than its storage":
        data, rec = _tensor_pickle(numel=4), {"0": b"\0" * 12}
    elif case == "storage key retyped":
        one = _tensor_pickle()[2:-1]
        two = _tensor_pickle(storage="IntStorage")[2:-1]
        data = b"\x80\x02" + one + two + b"\x86."
    elif case == "big-endian file":
        data, kw = _tensor_pickle(), {"byteorder": b"big"}
    elif case == "unknown version":
        data, kw = _tensor_pickle(), {"version": b"99\n"}
    elif case == "requires_grad":
        data = _tensor_pickle().replace(b"\x89ccollections", b"\x88ccollections")
    elif case == "hooks not empty":
        data = _tensor_pickle().replace(b"OrderedDict\n)R", b"OrderedDict\n)RK\x01K\x02s")
    elif case == "unknown storage class":
        data = _tensor_pickle(storage="QInt8Storage")
    elif case == "global as a value":
        data = b"\x80\x02ccollections\nOrderedDict\n."
    elif case == "truncated pickle":
        data = _tensor_pickle()[:-3]
    else:
        data = b"\x80\x02}(K\x01K\x02K\x03u."
    src = _zip(tmp_path / "x.pt", data, rec, **kw)
    with pytest.raises(pt_pickle.NotSimple):
        pt_pickle.read(src)


def test_the_hand_made_tensor_pickle_is_read_like_torch_reads_it(tmp_path):
    """The hand-made files above differ from a good one only in the defect named: this one reads, so each
    refusal is the reader's rule at work, not a broken helper."""
    src = _zip(tmp_path / "ok.pt", _tensor_pickle(size=(2, 2), stride=(2, 1)), {"0": struct.pack("<4f", 1, 2, 3, 4)})
    state, _ = pt_pickle.read(src)
    assert isinstance(state, pt_pickle.PtTensor) and state.shape == (2, 2)
    assert torch.equal(torch.load(src, weights_only=True), torch.tensor([[1.0, 2], [3, 4]]))
    _assert_same_encoding(src)


def test_pack_of_a_plain_checkpoint_does_not_import_torch(tmp_path):
    """Guards against pack's fixed cost coming back: ``import torch`` (about a second of CPU) for a file whose
    pickle needs none of it (issue 26's loading needs brought it back once), nor NumPy (~0.1 s) for a state
    whose chunks are all small. Checked in a fresh interpreter through the library call."""
    src = _save(tmp_path, "ckpt", _adam_state())
    code = ("import sys, ckpt_archive; r = ckpt_archive.pack(sys.argv[1], sys.argv[2]); "
            "assert r.status == 'usable'; print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "r")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False"


def test_item_of_a_scalar_read_without_torch_is_torchs(tmp_path):
    """``PtTensor.item()`` (what the progress and metrics finders call) gives what ``Tensor.item()`` gives,
    for every dtype the reader accepts."""
    vals = {str(k): v.reshape(-1)[:1].clone() for k, v in _dtypes().items()}
    src = _save(tmp_path, "scalars", vals)
    state, _ = pt_pickle.read(src)
    back = torch.load(src, weights_only=True)
    for k, t in back.items():
        got, want = state[k].item(), t.item()
        assert type(got) is type(want) and (got == want or (got != got and want != want)), k
    with pytest.raises(ValueError):
        pt_pickle.read(_save(tmp_path, "two", torch.ones(2)))[0].item()


def _model_and_adam():
    st = _adam_state()
    del st["scheduler"]  # the Checkpointer states below hold schedulers (training/simulate_plain.py)
    return st


@pytest.mark.parametrize("state", ["model_only", "model_and_adam"])
def test_read_only_commands_do_not_import_torch(tmp_path, state):
    """Guards against ``verify``, ``verify --deep``, ``list``, ``status`` and ``inspect`` importing torch
    (about a second of CPU) to read what needs no tensor: a model-only state (whose biases the policy audit
    decodes as small tensors) and model + Adam (step counters); nor NumPy (~0.1 s: the small chunks need
    none), nor jsonschema (~0.1 s: the manifests' verdicts were remembered when pack wrote them, docs/FORMAT.md
    "Manifest"); nor Pydantic (~0.1 s: Typer converts option values through it, ckpt_archive.cli.app's
    ``_PlainCoercion`` spares the values it would pass through unchanged), nor ``importlib.metadata`` (~0.03 s:
    the email package), nor another command's module (``main`` builds only the command run); and with
    ``--json``, which prints no table, not rich either (issue 29: <= 0.3 s). Each command runs in a fresh
    interpreter; ``sys.modules`` is read after it."""
    st = _model_and_adam() if state == "model_and_adam" else _adam_state()["model"]
    src = _save(tmp_path, state, st)
    repo = tmp_path / "r"
    ckpt_archive.pack(src, repo)
    _assert_read_only_commands_import_nothing_heavy(repo)


def _assert_read_only_commands_import_nothing_heavy(repo):
    heavy = ("torch", "numpy", "jsonschema", "rich", "pydantic", "importlib.metadata", "ckpt_archive.cli.pack_cmd",
             "ckpt_archive.cli.prune_cmd")
    code = ("import sys\nsys.argv = ['ckpt-archive'] + sys.argv[1:]\ntry:\n    from ckpt_archive.cli.app import main\n"
            "    main()\nexcept SystemExit as exc:\n    code = exc.code\nprint('IMPORTED', [m for m in %r if m in "
            "sys.modules], 'EXIT', code, file=sys.stderr)" % (heavy,))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for cmd in (["verify", str(repo)], ["verify", "--deep", str(repo)], ["list", str(repo)],
                ["status", str(repo)], ["inspect", str(repo)], ["verify", str(repo), "--json"],
                ["list", str(repo), "--json"], ["status", str(repo), "--json"]):
        out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, env=env, timeout=120)
        last = out.stderr.strip().splitlines()[-1]
        assert last.endswith("EXIT 0") or last.endswith("EXIT None"), (cmd, out.stderr[-2000:])
        imported = set(ast.literal_eval(last.split("IMPORTED ", 1)[1].split(" EXIT ")[0]))
        assert not imported - ({"rich"} if "--json" not in cmd else set()), (cmd, out.stderr[-2000:])


def _checkpointer_repo(path, parts):
    """A repository written as docs/checkpointer.md writes one: a model trained a few steps with Adam (a
    GradScaler around it where asked), the schedulers named, the RNG streams (NumPy's state is an array), saved
    every other step by the Checkpointer."""
    import numpy as np

    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    sched = {"StepLR": lambda: torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5),
             "CosineAnnealingLR": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 100),
             "OneCycleLR": lambda: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100),
             None: lambda: None}[parts.get("scheduler")]()
    scaler = torch.amp.GradScaler("cpu") if parts.get("scaler") else None
    with ckpt_archive.Checkpointer(path) as ckpt:
        for step in range(4):
            loss = m(torch.randn(3, 8)).sum()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            if step % 2:
                state = {"model": m.state_dict(),
                         "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                                 "torch": torch.get_rng_state()}}
                if parts.get("optimizer"):
                    state.update(optimizer=opt.state_dict(), data={"cursor": step})
                if sched is not None:
                    state["scheduler"] = sched.state_dict()
                if scaler is not None:
                    state["scaler"] = scaler.state_dict()
                ckpt.save(step + 1, state)
    return path


CHECKPOINTER_STATES = {
    "model_rng": {},
    "adam": {"optimizer": True},
    "adam_scaler": {"optimizer": True, "scaler": True},
    "adam_steplr": {"optimizer": True, "scheduler": "StepLR"},
    "adam_cosine": {"optimizer": True, "scheduler": "CosineAnnealingLR"},
    "adam_onecycle_scaler": {"optimizer": True, "scheduler": "OneCycleLR", "scaler": True},
}


@pytest.mark.parametrize("name", sorted(CHECKPOINTER_STATES))
def test_read_only_commands_of_a_checkpointer_repository_do_not_import_torch(tmp_path, name):
    """Guards against ``verify`` and ``inspect`` of a repository the Checkpointer wrote (docs/checkpointer.md)
    importing torch and NumPy (~3 s in all, issue 29's break test): the policy audit rebuilt the scheduler as a
    real torch object to tell its next LR (StepLR, CosineAnnealingLR, OneCycleLR), and ``inspect`` asked NumPy
    the item size of the RNG state's NumPy array. The commands and imports of the test above, each in a fresh
    interpreter."""
    _assert_read_only_commands_import_nothing_heavy(_checkpointer_repo(tmp_path / "r", CHECKPOINTER_STATES[name]))


def test_small_tensors_read_for_the_audit_have_torchs_values(tmp_path):
    """Guards against the audit's torch-free small tensors (SmallTensor) reading other values than torch:
    every dtype it reads, 0-d and shaped, item() and tolist() as torch gives them."""
    from ckpt_archive.format.tensor_stub import SmallTensor

    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(2, 3, generator=g).to(dt) for dt in (torch.float64, torch.float32, torch.float16,
                                                              torch.bfloat16, torch.complex64, torch.complex128)]
    cases += [torch.randint(-9, 9, (4,), generator=g, dtype=dt) for dt in (torch.int64, torch.int32, torch.int16,
                                                                           torch.int8)]
    cases += [torch.tensor([0, 200], dtype=torch.uint8), torch.tensor([True, False]), torch.tensor(2.5),
              torch.tensor(float("nan"), dtype=torch.bfloat16), torch.tensor(7, dtype=torch.uint16)]
    for t in cases:
        rec = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "kind": "torch"}
        raw = (torch.view_as_real(t) if t.is_complex() else t).contiguous().reshape(-1).view(torch.uint8).numpy()
        st = SmallTensor.from_bytes(rec, raw.tobytes())
        want = t.tolist()
        assert json.dumps(st.tolist(), default=repr) == json.dumps(want, default=repr), t.dtype
        if t.numel() == 1:
            assert repr(st.item()) == repr(t.item()) and type(st.item()) is type(t.item()), t.dtype


def test_loading_needs_of_a_plain_state_are_told_without_torch_as_torch_tells_them(tmp_path, monkeypatch):
    """Guards against pack importing torch (~1 s of CPU) to tell what a restored ``.pt`` needs allowed
    (issue 26's ``needs_by_part``), and against the torch-free answer differing from torch's own scan: a
    state read without torch is answered like the same state read by ``torch.load``; states with what
    pickles as another global (NumPy, a set, bytes, an enum) are still left to torch's scan."""
    import enum

    import numpy as np

    from ckpt_archive.ops import meta

    src = _save(tmp_path, "ckpt", _model_and_adam())
    torch_free, _ = pt_pickle.read(src)
    loaded = torch.load(src, weights_only=True)

    class Color(enum.IntEnum):
        RED = 1

    others = [{"a": np.arange(3)}, {"s": {1, 2}}, {"b": b"xy"}, {"e": Color.RED}, [collections.Counter()]]
    fast = {"torch_free": meta.needs_by_part(torch_free), "loaded": meta.needs_by_part(loaded)}
    fast_others = [meta.unsafe_globals_of_state(s) for s in others]
    assert meta._pickles_plain(torch_free) and meta._pickles_plain(loaded)
    assert not any(meta._pickles_plain(s) for s in others)
    monkeypatch.setattr(meta, "_pickles_plain", lambda state: False)  # torch's scan alone
    assert fast["torch_free"] == fast["loaded"] == meta.needs_by_part(loaded) == {"allow": [], "plain_parts": []}
    assert fast_others == [meta.unsafe_globals_of_state(s) for s in others]
    assert fast_others[0], "the NumPy state needs its globals allowed"


def test_restore_of_a_plain_checkpoint_does_not_import_torch_and_tells_what_torch_tells(tmp_path, monkeypatch):
    """Guards against restore importing torch (2-3 s of CPU on the benchmark box, issue 29) to tell how the
    file it wrote loads (issue 26's ``extra["loading"]``): a ``.pt`` kept as exact bytes whose pickle the
    torch-free reader accepts is answered without torch, in a fresh interpreter, with the very answer torch's
    own scan gives that file; a file holding another global (NumPy) is still left to torch's scan."""
    import numpy as np

    from ckpt_archive.ops import meta

    src = _save(tmp_path, "ckpt", _model_and_adam())
    ckpt_archive.pack(src, tmp_path / "r")
    code = ("import sys, ckpt_archive; r = ckpt_archive.restore(sys.argv[1], output=sys.argv[2]); "
            "print('torch' in sys.modules, r.extra['loading']['allow'])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r"), str(tmp_path / "out.pt")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False []"
    numpy_file = _save(tmp_path, "np", {"w": torch.ones(2), "a": np.arange(3)})
    fast = [meta.restored_file_loading(tmp_path / "out.pt"), meta.restored_file_loading(numpy_file)]
    assert fast[1]["allow"], "a NumPy array needs its globals allowed"
    monkeypatch.setattr(meta, "_plain_without_torch", lambda path: False)  # torch's scan alone
    assert fast == [meta.restored_file_loading(tmp_path / "out.pt"), meta.restored_file_loading(numpy_file)]
