"""Issue 11: exact means exact. Everything ``torch.load(weights_only=True)`` of the installed torch accepts
comes back with its type, bits, order and aliasing, or pack refuses it (exit 2) naming path and type.

The round-trip table is keyed by torch's own allowlist (``ckpt_archive.format.allowlist``): a new
entry in a future torch fails ``test_every_entry_of_torchs_allowlist_has_a_round_trip_case`` until a
case is added here.
"""
from __future__ import annotations

import argparse
import collections
import io
import json
import warnings

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive
from ckpt_archive.cli.app import app
from ckpt_archive.errors import RefusedPickle, SourceError
from ckpt_archive.format.allowlist import torch_allowed_globals
from ckpt_archive.ops.pack import PackOptions
from ckpt_archive.sources.torchfile import numpy_safe_globals

runner = CliRunner()
warnings.filterwarnings("ignore", message=".*(TypedStorage|quantiz|nested tensors|Sparse invariant).*")


# ------------------------------------------------------------------------------------------------
# exact comparison: type, order, bits, layout, strides, Parameter/requires_grad, attributes
def assert_exact(a, b, path="state"):
    assert type(a) is type(b), f"{path}: type {type(a).__qualname__} != {type(b).__qualname__}"
    if isinstance(a, torch.Tensor):
        _assert_tensor(a, b, path)
        assert list(vars(a)) == list(vars(b)), f"{path}: attributes"
        for k in vars(a):
            assert_exact(vars(a)[k], vars(b)[k], f"{path}.{k}")
        return
    if isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
        if isinstance(a, torch.TypedStorage):
            assert a.dtype == b.dtype, f"{path}: storage dtype"
            a, b = a.untyped(), b.untyped()
        assert a.nbytes() == b.nbytes() and bytes(a) == bytes(b), f"{path}: bytes"
        return
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys/order {list(a)} != {list(b)}"
        for k, kb in zip(a, b):
            assert type(k) is type(kb), f"{path}: key type of {k!r}"
            assert_exact(a[k], b[k], f"{path}[{k!r}]")
        if hasattr(a, "__dict__"):
            assert list(vars(a)) == list(vars(b)), f"{path}: attributes"
            for k in vars(a):
                assert_exact(vars(a)[k], vars(b)[k], f"{path}.{k}")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_exact(x, y, f"{path}[{i}]")
        return
    if isinstance(a, set):
        assert a == b, f"{path}: {a} != {b}"
        return
    if isinstance(a, argparse.Namespace):
        assert_exact(vars(a), vars(b), f"{path}.__dict__")
        return
    if isinstance(a, (float, complex)) and a != a:
        assert repr(a) == repr(b), f"{path}: {a!r} != {b!r}"
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def _bits(t):
    t = t.detach().contiguous()
    if t.numel() == 0:
        return b""
    if t.is_complex():
        t = torch.view_as_real(t)
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


def _assert_tensor(a, b, path):
    if a.is_nested or b.is_nested:
        assert a.is_nested and b.is_nested and a.dtype == b.dtype and a.size(0) == b.size(0), f"{path}: nested"
        for i, (x, y) in enumerate(zip(a.unbind(), b.unbind())):
            _assert_tensor(x, y, f"{path}.unbind()[{i}]")
        return
    assert (a.layout, a.dtype, tuple(a.shape), a.device.type) == (b.layout, b.dtype, tuple(b.shape), b.device.type), \
        f"{path}: {a.layout}/{a.dtype}/{tuple(a.shape)} != {b.layout}/{b.dtype}/{tuple(b.shape)}"
    assert a.requires_grad == b.requires_grad, f"{path}: requires_grad"
    if a.device.type == "meta":
        assert a.stride() == b.stride(), f"{path}: stride"
        return
    if a.layout == torch.sparse_coo:
        assert a.is_coalesced() == b.is_coalesced(), f"{path}: coalesced"
        _assert_tensor(a._indices(), b._indices(), f"{path}.indices")
        _assert_tensor(a._values(), b._values(), f"{path}.values")
        return
    if a.layout in (torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc):
        comp = ("crow_indices", "col_indices") if a.layout in (torch.sparse_csr, torch.sparse_bsr) \
            else ("ccol_indices", "row_indices")
        for name in (*comp, "values"):
            _assert_tensor(getattr(a, name)(), getattr(b, name)(), f"{path}.{name}")
        return
    assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset(), f"{path}: view geometry"
    if a.is_quantized:
        assert a.qscheme() == b.qscheme(), f"{path}: qscheme"
        assert _bits(a.int_repr()) == _bits(b.int_repr()), f"{path}: int_repr bits"
        if a.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()), f"{path}: qparams"
        else:
            assert a.q_per_channel_axis() == b.q_per_channel_axis()
            _assert_tensor(a.q_per_channel_scales(), b.q_per_channel_scales(), f"{path}.scales")
            _assert_tensor(a.q_per_channel_zero_points(), b.q_per_channel_zero_points(), f"{path}.zero_points")
        return
    assert bytes(a.untyped_storage()) == bytes(b.untyped_storage()) or _bits(a) == _bits(b), f"{path}: bits"
    assert _bits(a) == _bits(b), f"{path}: bits differ"


# ------------------------------------------------------------------------------------------------
# the table: one case per entry of torch's weights_only allowlist
def _random_bits(dtype, n=8):
    g = torch.Generator().manual_seed(n)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype)


def _dense_of(dtype):
    """A dense tensor of this dtype with arbitrary bits (NaN payloads included), or None when torch
    cannot hold a dense tensor of it (sub-byte dtypes, quantized dtypes: see _quantized)."""
    if dtype in (torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4):
        return None
    try:
        t = _random_bits(dtype)
        torch.save(t, io.BytesIO())  # torch.save cannot write some (uint1..7, int1..7): nothing to load then
    except (RuntimeError, TypeError, KeyError):
        return None
    return t


def _quantized():
    qt = torch.quantize_per_tensor(torch.linspace(-1, 1, 12).reshape(3, 4), 0.05, 7, torch.qint8)
    qc = torch.quantize_per_channel(torch.linspace(-1, 1, 12).reshape(3, 4),
                                    torch.tensor([0.01, 0.02, 0.03], dtype=torch.float64),
                                    torch.tensor([0, 1, 2]), 0, torch.quint8)
    q32 = torch.quantize_per_tensor(torch.linspace(-1, 1, 6), 0.01, 0, torch.qint32)
    q4 = torch.quantize_per_tensor(torch.linspace(0, 1, 8), 0.1, 0, torch.quint4x2)
    return {"per_tensor_qint8": qt, "per_channel_quint8": qc, "qint32": q32, "quint4x2": q4,
            "t_view": qt[1:]}


def _sparse():
    dense = torch.tensor([[0.0, 1.5, 0.0, 0.0], [2.5, 0.0, 0.0, -3.0], [0.0, 0.0, 0.0, 4.0], [0, 0, 0, 0.0]])
    coo = torch.sparse_coo_tensor(torch.tensor([[1, 0], [0, 1]]), torch.tensor([2.5, 1.5]), (4, 4))
    return {"coo_uncoalesced": coo, "coo_coalesced": dense.to_sparse(), "csr": dense.to_sparse_csr(),
            "csc": dense.to_sparse_csc(), "bsr": dense.to_sparse_bsr((2, 2)), "bsc": dense.to_sparse_bsc((2, 2))}


def _nested():
    return torch.nested.nested_tensor([torch.arange(6.0).reshape(2, 3), torch.ones(1, 3)])


def _param_with_state():
    p = torch.nn.Parameter(torch.ones(3))
    p.tag = "embedding"
    return p


def _tensor_with_attrs():
    t = torch.arange(4, dtype=torch.int16)
    t.note = {"k": (1, 2.5)}
    return t


def _layouts():
    return [getattr(torch, n) for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                                         "sparse_bsc", "_mkldnn", "jagged") if hasattr(torch, n)]


def _odict():
    od = collections.OrderedDict([("z", 1), ("a", torch.ones(1)), (3, "int key")])
    od._metadata = {"": {"version": 2}}
    return od


#: allowlist name -> a value exercising it. Names not here are classified by _case_for_entry below.
NAMED_CASES = {
    "collections.OrderedDict": _odict,
    "collections.Counter": lambda: collections.Counter({7: 2, 3: 1, 5: 4}),  # MultiStepLR.milestones
    "torch.nn.parameter.Parameter": lambda: [torch.nn.Parameter(torch.ones(2)),
                                             torch.nn.Parameter(torch.zeros(2), requires_grad=False)],
    "torch.serialization._get_layout": _layouts,
    "torch.Size": lambda: torch.Size([2, 0, 3]),
    "torch.Tensor": lambda: [torch.Tensor, torch.ones(2, 3).t(), torch.ones(2, requires_grad=True)],
    "torch.device": lambda: [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
    "_codecs.encode": lambda: [b"\x00\xffbytes", b"x"],  # b"" pickles as builtins.bytes(): weights_only refuses it
    "builtins.bytearray": lambda: bytearray(b"\x01\x02"),
    "builtins.set": lambda: {1, "a", (2, 3), None},
    "builtins.complex": lambda: [1 + 2j, complex(float("inf"), float("nan"))],
    "torch._utils._rebuild_tensor": lambda: torch.arange(5, dtype=torch.float64)[1:4],
    "torch._utils._rebuild_tensor_v2": lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:3],
    "torch._utils._rebuild_tensor_v3": lambda: [_random_bits(torch.uint16), _random_bits(torch.float8_e4m3fn)],
    "torch._utils._rebuild_parameter": lambda: torch.nn.Parameter(torch.ones(2)),
    "torch._utils._rebuild_parameter_with_state": _param_with_state,
    "torch._tensor._rebuild_from_type_v2": _tensor_with_attrs,
    "torch._utils._rebuild_sparse_tensor": _sparse,
    "torch._utils._rebuild_qtensor": _quantized,
    "torch._utils._rebuild_meta_tensor_no_storage": lambda: torch.empty(3, 4, device="meta").t(),
    "torch._utils._rebuild_nested_tensor": _nested,
    "torch.storage.UntypedStorage": lambda: [torch.storage.UntypedStorage, torch.arange(3.0).untyped_storage()],
    "torch.storage.TypedStorage": lambda: [torch.storage.TypedStorage,
                                           torch.storage.TypedStorage(wrap_storage=torch.arange(3.0).untyped_storage(),
                                                                      dtype=torch.float32, _internal=True)],
}

#: rebuild functions torch.save uses only for tensors this machine cannot make. They are resolved through
#: the same generic path as the ones above (torch's own function applied to stored arguments), but
#: a CPU-only test cannot produce them.
NEEDS_OTHER_DEVICE = {
    "torch._utils._rebuild_device_tensor_from_numpy": "XLA/MTIA/MAIA tensors without storage",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": "XLA/MTIA/MAIA/privateuse1 tensors without storage",
    "torch._utils._rebuild_wrapper_subclass": "storage-less wrapper tensor subclasses (need the subclass "
                                              "allowlisted; refused like every tensor subclass)",
}


def _case_for_entry(name, obj):
    """A value exercising an allowlist entry that is a value itself (dtype, qscheme, legacy class)."""
    if name in NAMED_CASES:
        return NAMED_CASES[name]()
    if isinstance(obj, torch.dtype):
        dense = _dense_of(obj)
        return [obj] if dense is None else [obj, dense]
    if isinstance(obj, torch.qscheme):
        return obj
    if isinstance(obj, type) and obj in torch._tensor_classes:  # legacy tensor classes as values
        return obj
    if isinstance(obj, torch.serialization.StorageType):  # what torch.load gives for torch.FloatStorage
        return obj
    return None


def _table():
    cases, missing = {}, []
    for name, obj in torch_allowed_globals().items():
        if name in NEEDS_OTHER_DEVICE:
            continue
        value = _case_for_entry(name, obj)
        if value is None:
            missing.append(name)
        else:
            cases[name] = value
    return cases, missing


def test_every_entry_of_torchs_allowlist_has_a_round_trip_case():
    _, missing = _table()
    assert not missing, (f"torch's weights_only allowlist has entries with no round-trip case here: {missing}; "
                         f"add a case to NAMED_CASES (and support in format/state_tree.py if it fails)")


def test_every_allowlisted_type_and_tensor_kind_round_trips_bit_type_and_order_exact(tmp_path):
    cases, _ = _table()
    state = {"cases": cases, "quantized_dtypes": _quantized(), "sparse": _sparse()}
    ckpt_archive.pack(state, tmp_path / "r")
    back = ckpt_archive.load(tmp_path / "r")
    for name in cases:
        assert_exact(cases[name], back["cases"][name], name)
    assert_exact(state, back)
    assert list(back["cases"]) == list(cases)  # key order across ~140 entries


def _savable(cases):
    """The table as a user would torch.save it: the legacy storage class itself (``torch.FloatStorage``),
    not the ``StorageType`` stand-in torch.load returns for it (torch.save cannot write a StorageType)."""
    import importlib

    def real(name, v):
        if not isinstance(v, torch.serialization.StorageType):
            return v
        module, cls = name.rsplit(".", 1)
        return importlib.import_module(module).__dict__[cls]

    return {name: real(name, v) for name, v in cases.items()}


def test_a_torch_save_file_of_the_table_restores_to_what_torch_load_gives(tmp_path):
    cases = _savable(_table()[0])
    src = tmp_path / "table.pt"
    torch.save({"cases": cases}, src)
    expected = torch.load(src, weights_only=True)
    ckpt_archive.pack(src, tmp_path / "r")
    assert_exact(expected, ckpt_archive.load(tmp_path / "r"))
    ckpt_archive.restore(tmp_path / "r", output=tmp_path / "out.pt")
    assert_exact(expected, torch.load(tmp_path / "out.pt", weights_only=True))


def test_aliasing_views_tied_weights_and_storage_values_come_back_shared(tmp_path):
    base = torch.arange(16, dtype=torch.float32)
    emb = torch.nn.Parameter(torch.randn(4, 3))
    state = {"base": base, "view": base[3:9].view(2, 3), "strided": base[::4], "as_bytes": base.view(torch.uint8),
             "storage": base.untyped_storage(), "emb": emb, "head": emb,
             "q": (qt := torch.quantize_per_tensor(torch.ones(6), 0.5, 0, torch.qint8)), "q_view": qt[2:]}
    ckpt_archive.pack(state, tmp_path / "r")
    back = ckpt_archive.load(tmp_path / "r")
    assert_exact(state, back)
    ptr = back["base"].untyped_storage().data_ptr()
    assert {back[k].untyped_storage().data_ptr() for k in ("view", "strided", "as_bytes")} == {ptr}
    assert back["storage"].data_ptr() == ptr
    assert back["head"] is back["emb"]  # one object under two names, as torch.load's memo gives it
    assert back["q_view"].untyped_storage().data_ptr() == back["q"].untyped_storage().data_ptr()
    back["base"][4] = 100.0
    assert back["view"][0, 1] == 100.0 and bytes(back["storage"][16:20]) == torch.tensor([100.0]).numpy().tobytes()


def test_one_tensor_or_array_under_two_names_comes_back_as_one_object_from_load_and_restore(tmp_path):
    """Fault guarded: the same tensor (or NumPy array) object reached twice came back as two objects (a
    tensor pair sharing storage, an array as two copies), where torch.load gives one: an in-place change
    through one name no longer showed through the other (a resumed run's tied parameter list diverges)."""
    import numpy as np

    p = torch.nn.Parameter(torch.ones(3))
    t = torch.arange(6.0)
    arr = np.arange(4)
    state = {"a": t, "b": t, "params": [p, p], "named": {"p": p}, "n1": arr, "n2": arr, "other": t.clone()}
    torch.save(state, tmp_path / "src.pt")
    ckpt_archive.pack(state, tmp_path / "r")
    back = ckpt_archive.load(tmp_path / "r")
    assert back["a"] is back["b"] and back["params"][0] is back["params"][1] is back["named"]["p"]
    assert back["n1"] is back["n2"] and back["other"] is not back["a"]
    assert_exact({k: v for k, v in state.items() if k[0] != "n"}, {k: v for k, v in back.items() if k[0] != "n"})
    assert back["n1"].dtype == arr.dtype and np.array_equal(back["n1"], arr)
    res = runner.invoke(app, ["restore", str(tmp_path / "r"), "-o", str(tmp_path / "out.pt")])
    assert res.exit_code == 0, res.output
    with torch.serialization.safe_globals(numpy_safe_globals()):
        out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["a"] is out["b"] and out["params"][0] is out["params"][1] is out["named"]["p"]
    assert out["n1"] is out["n2"]
    out["n1"][0] = 7
    assert out["n2"][0] == 7
    # a part that holds only the second name still restores whole
    only = ckpt_archive.load(tmp_path / "r", options=ckpt_archive.LoadOptions(only="named"))
    assert torch.equal(only["p"], p) and type(only["p"]) is torch.nn.Parameter
    # the other mutable values torch.load's memo keeps as one object: a bytearray, an admitted object
    ns, ba = argparse.Namespace(lr=0.1, w=t), bytearray(b"ab")
    ckpt_archive.pack({"args": ns, "hparams": ns, "ba": [ba, ba]}, tmp_path / "r2",
                      PackOptions(allow=["argparse.Namespace"]))
    back2 = ckpt_archive.load(tmp_path / "r2", options=ckpt_archive.LoadOptions(allow=["argparse.Namespace"]))
    assert back2["args"] is back2["hparams"] and back2["ba"][0] is back2["ba"][1]


def test_strings_with_lone_surrogates_round_trip_as_values_and_keys(tmp_path):
    """Fault guarded: a str holding lone surrogates (os.fsdecode of a file name that is not UTF-8, as a data
    loader's state records it; torch.load(weights_only=True) accepts it) made pack fail with "internal
    error (UnicodeEncodeError)" after claiming a generation; it is now stored exactly (tagged, base64 of
    its surrogate-passing UTF-8) and comes back equal from load and restore."""
    import os

    name = os.fsdecode(b"/data/caf\xe9.jpg")
    state = {"files": [name, "plain"], "by_name": {name: 1, "ok": 2}, "w": torch.ones(2)}
    torch.save(state, tmp_path / "src.pt")
    res = runner.invoke(app, ["pack", str(tmp_path / "src.pt"), "--repo", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    back = ckpt_archive.load(tmp_path / "r")
    assert back["files"] == [name, "plain"] and list(back["by_name"].items()) == [(name, 1), ("ok", 2)]
    res = runner.invoke(app, ["restore", str(tmp_path / "r"), "-o", str(tmp_path / "out.pt")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out.pt").read_bytes() == (tmp_path / "src.pt").read_bytes()
    ckpt_archive.pack(state, tmp_path / "r2")
    assert_exact(state, ckpt_archive.load(tmp_path / "r2"))
    assert runner.invoke(app, ["verify", "--deep", str(tmp_path / "r2")]).exit_code == 0


def test_dynamic_quantization_packed_params_round_trip_and_load_into_the_model(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    qmodel = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    sd = qmodel.state_dict()
    src = tmp_path / "q.pt"
    torch.save(sd, src)
    expected = torch.load(src, weights_only=True)  # what weights_only accepts: the packed params' tuple
    ckpt_archive.pack(src, tmp_path / "r")
    back = ckpt_archive.load(tmp_path / "r")
    assert_exact(expected, back)
    fresh = torch.ao.quantization.quantize_dynamic(
        torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),
        {torch.nn.Linear}, dtype=torch.qint8)
    fresh.load_state_dict(back)
    x = torch.randn(3, 8)
    assert torch.equal(fresh(x), qmodel(x))


# ------------------------------------------------------------------------------------------------
# refusals: no value is ever stored as a lookalike of another type
class _MyDict(dict):
    pass


@pytest.mark.parametrize("value, tname", [
    (_MyDict(a=1), "_MyDict"), (collections.defaultdict(list), "defaultdict"), (frozenset([1]), "frozenset"),
    (collections.namedtuple("P", "x y")(1, 2), "P"), (range(3), "range"),
    (torch.ones(2).as_subclass(type("Sub", (torch.Tensor,), {})), "Sub"),
])
def test_a_value_that_cannot_round_trip_is_refused_naming_path_and_type(tmp_path, value, tname):
    with pytest.raises(SourceError) as exc:
        ckpt_archive.pack({"opt": {"state": {0: value}}}, tmp_path / "r")
    assert exc.value.where == "opt/state/0" and tname in exc.value.message and exc.value.hint
    assert "stored as" not in str(exc.value)
    assert not (tmp_path / "r" / "generations").exists() or not any((tmp_path / "r" / "generations").iterdir())


def test_a_refused_value_is_exit_2_on_the_command_line_naming_path_and_type(tmp_path):
    src = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(1)}, "lr": {"values": [0.1]}}, src)
    # torch.save of a live object with a dict subclass: weights_only refuses the file, naming the global
    src2 = tmp_path / "sub.pt"
    torch.save({"model": {"w": torch.ones(1)}, "extra": _MyDict(k=1)}, src2)
    res = runner.invoke(app, ["pack", str(src2), "--repo", str(tmp_path / "r")])
    assert res.exit_code == 2 and "_MyDict" in res.stderr and "Traceback" not in res.stderr
    with pytest.raises(SourceError) as exc:
        ckpt_archive.pack({"model": {"w": torch.ones(1)}, "extra": _MyDict(k=1)}, tmp_path / "r2")
    assert exc.value.exit_code == 2 and exc.value.where == "extra" and "_MyDict" in exc.value.message
    assert runner.invoke(app, ["pack", str(src), "--repo", str(tmp_path / "r3")]).exit_code == 0


def test_no_stored_as_warning_remains_in_the_code():
    import pathlib

    root = pathlib.Path(ckpt_archive.__file__).parent
    hits = [str(p.relative_to(root)) for p in root.rglob("*.py") if "stored as a" in p.read_text() and
            "warnings.append" in p.read_text().split("stored as a")[0][-300:]]
    assert not hits, f"'stored as' warnings (a lookalike of another type kept usable): {hits}"


# ------------------------------------------------------------------------------------------------
# MultiStepLR: milestones is a Counter
def test_multisteplr_state_restores_as_a_counter_and_the_scheduler_steps_by_epoch(tmp_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    src = tmp_path / "ckpt.pt"
    torch.save({"scheduler": sched.state_dict(), "optimizer": opt.state_dict()}, src)
    res = runner.invoke(app, ["pack", str(src), "--repo", str(tmp_path / "r"), "--json"])
    assert res.exit_code == 0 and not json.loads(res.stdout)["warnings"], res.stderr
    ckpt_archive.restore(tmp_path / "r", output=tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert type(back["scheduler"]["milestones"]) is collections.Counter
    assert back["scheduler"]["milestones"] == collections.Counter({2: 1, 4: 2})
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[1], gamma=0.9)
    opt2.load_state_dict(back["optimizer"])
    sched2.load_state_dict(back["scheduler"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the epoch parameter in scheduler.step() is deprecated"
        sched2.step(4)
        sched.step(4)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_check_resume_passes_on_an_unmodified_multisteplr_script(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "resume_scripts" / "multistep_lr.py"
    out = tmp_path / "c"
    r = subprocess.run([sys.executable, "-m", "ckpt_archive", "check-resume", "--steps", "10", "--interrupt-at",
                        "5", "--jobs", "2", "--output", str(out), "--control", "scheduler", "--json", "--",
                        sys.executable, str(script), "--steps", "{steps}", "--output", "{output}",
                        "{resume:--resume-from {}}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["all_checks_passed"] and report["archive"]["round_trip_exact"]
    stale = next(e for e in report["negative_controls"] if e["name"] == "scheduler-stale")
    assert stale["diverged"] and stale["first_divergent_step"] == 8  # the milestone at update 7 moves


# ------------------------------------------------------------------------------------------------
# plain-data classes: argparse.Namespace (timm, torchvision references) and --allow
def _timm_like(path):
    args = argparse.Namespace(model="resnet50", lr=0.1, epochs=90, amp=True, mean=(0.485, 0.456, 0.406))
    torch.save({"epoch": 7, "arch": "resnet50", "state_dict": {"fc.weight": torch.randn(3, 4)},
                "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                "version": 2, "args": args, "metric": 76.5}, path)


@pytest.mark.parametrize("name", ["last.pth.tar", "checkpoint.pth"])
def test_a_namespace_file_is_refused_naming_the_allow_flag_without_the_opt_in(tmp_path, name):
    src = tmp_path / name
    _timm_like(src)
    res = runner.invoke(app, ["pack", str(src), "--repo", str(tmp_path / "r")])
    assert res.exit_code == 2 and "--allow argparse.Namespace" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    with pytest.raises(RefusedPickle):
        ckpt_archive.pack(src, tmp_path / "r")


@pytest.mark.parametrize("name", ["last.pth.tar", "checkpoint.pth"])
def test_a_namespace_file_packs_with_the_opt_in_and_comes_back_as_a_namespace(tmp_path, name):
    src = tmp_path / name
    _timm_like(src)
    res = runner.invoke(app, ["pack", str(src), "--repo", str(tmp_path / "r"), "--allow", "argparse.Namespace",
                              "--json"])
    assert res.exit_code == 0, res.stderr
    with torch.serialization.safe_globals([argparse.Namespace]):
        expected = torch.load(src, weights_only=True)
    back = ckpt_archive.load(tmp_path / "r")
    assert_exact(expected, back)
    assert type(back["args"]) is argparse.Namespace and back["args"].mean == (0.485, 0.456, 0.406)
    res = runner.invoke(app, ["restore", str(tmp_path / "r"), "-o", str(tmp_path / name)[:-4] + ".out"])
    assert res.exit_code == 0, res.stderr
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert_exact(expected, torch.load(str(tmp_path / name)[:-4] + ".out", weights_only=True))


class PlainConfig:  # a user's plain-data class, admitted by --allow
    def __init__(self, lr):
        self.lr = lr


class CodeOnLoad:
    def __setstate__(self, state):  # building it would run this
        raise AssertionError("ran code")


def test_a_user_named_plain_class_round_trips_and_a_class_with_code_hooks_is_refused(tmp_path):
    state = {"cfg": PlainConfig(0.3), "w": torch.ones(2)}
    name = f"{PlainConfig.__module__}.PlainConfig"
    with pytest.raises(SourceError, match=f"--allow {name}"):
        ckpt_archive.pack(state, tmp_path / "r")
    ckpt_archive.pack(state, tmp_path / "r", PackOptions(allow=[name]))
    from ckpt_archive.errors import FormatError

    with pytest.raises(FormatError, match=f"--allow {name}"):
        ckpt_archive.load(tmp_path / "r")  # a reader never imports a class it did not ask for
    back = ckpt_archive.load(tmp_path / "r", options=ckpt_archive.LoadOptions(allow=[PlainConfig]))
    assert type(back["cfg"]) is PlainConfig and back["cfg"].lr == 0.3
    from ckpt_archive.errors import UsageError

    with pytest.raises(UsageError, match="__setstate__"):
        ckpt_archive.pack({"x": CodeOnLoad()}, tmp_path / "r2", PackOptions(allow=[CodeOnLoad]))


# ------------------------------------------------------------------------------------------------
# folders: a file the tool cannot take apart rides along opaque
def test_a_folder_with_a_file_that_cannot_round_trip_still_packs_with_it_opaque(tmp_path):
    import numpy as np

    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"w": torch.ones(3)}, folder / "model.pt")
    # loads with torch.load(weights_only=True) + NumPy's allowlist, but an object array is not plain data
    torch.save({"ids": np.array([1, "two", None], dtype=object)}, folder / "random_states_0.pkl")
    (folder / "notes.bin").write_bytes(bytes(range(256)))
    res = runner.invoke(app, ["pack", str(folder), "--repo", str(tmp_path / "r"), "--allow-numpy", "--json"])
    assert res.exit_code == 0, res.stderr
    warnings_ = json.loads(res.stdout)["warnings"]
    assert any(w.startswith("random_states_0.pkl: kept opaque") and "object" in w for w in warnings_), warnings_
    info = ckpt_archive.inspect(tmp_path / "r")
    assert "random_states_0.pkl" in info.opaque_members
    kinds = {f["relpath"]: f["kind"] for f in info.manifest["source"]["files"]}
    assert kinds["model.pt"] == "torch" and kinds["random_states_0.pkl"] == "opaque"
    ckpt_archive.restore(tmp_path / "r", output=tmp_path / "out")
    assert (tmp_path / "out" / "random_states_0.pkl").read_bytes() == (folder / "random_states_0.pkl").read_bytes()


# --- break test of issue 11: views with lazy bits, failures after the claim, container aliasing ---

@pytest.mark.parametrize("make", [
    lambda torch: torch.randn(3, dtype=torch.complex64).conj(),
    lambda torch: torch.randn(3)._neg_view(),
    lambda torch: torch.randn(3, dtype=torch.complex128)._neg_view().conj(),
    lambda torch: torch.randn(3, 4, dtype=torch.complex64).conj().t(),
    lambda torch: torch.randn(3, dtype=torch.complex128),
], ids=["conj", "neg", "conj-neg-c128", "conj-transposed", "complex128-misaligned"])
def test_conj_and_neg_views_round_trip_with_their_bits(tmp_path, make):
    import torch
    import ckpt_archive

    torch.save({"v": make(torch)}, tmp_path / "f.pt")
    want = torch.load(tmp_path / "f.pt", weights_only=True)["v"]
    ckpt_archive.pack(str(tmp_path / "f.pt"), str(tmp_path / "r"))
    got = ckpt_archive.load(str(tmp_path / "r"))["v"]
    assert (got.is_conj(), got.is_neg()) == (want.is_conj(), want.is_neg())
    assert got.dtype == want.dtype and got.stride() == want.stride()
    assert torch.equal(got.clone(), want.clone())


def test_failure_after_claim_names_partial_generation_and_gc(tmp_path, monkeypatch):
    import torch
    import ckpt_archive
    import ckpt_archive.ops.pack as pack_mod
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(pack_mod, "write_members", boom)
    with pytest.raises(RuntimeError, match="boom") as info:  # the library keeps the error's type...
        ckpt_archive.pack({"a": torch.ones(2)}, str(tmp_path / "r"))
    text = " ".join(getattr(info.value, "__notes__", []))  # ...and notes what it left
    assert "generation 1 left partial" in text and "ckpt-archive gc" in text
    src = tmp_path / "s.pt"
    torch.save({"a": torch.ones(2)}, src)
    res = CliRunner().invoke(app, ["pack", str(src), "--repo", str(tmp_path / "r")])  # the CLI prints the notes
    assert res.exit_code == 2 and "left partial" in res.stderr and "ckpt-archive gc" in res.stderr, res.stderr


def test_container_aliasing_is_kept():
    import collections
    from ckpt_archive.format.state_tree import decode, encode

    lst, dct, st, cnt = [1, 2], {"a": 1}, {1, 2}, collections.Counter(a=1)
    tree, _ = encode({"v": (lst, lst), "d": [dct, dct], "s": [st, st], "c": (cnt, cnt)})
    got = decode(json.loads(json.dumps(tree)), lambda k: None)
    assert got["v"][0] is got["v"][1] and got["d"][0] is got["d"][1]
    assert got["s"][0] is got["s"][1] and got["c"][0] is got["c"][1]
    assert got["v"][0] == [1, 2]


def test_a_frozenset_file_was_told_to_use_an_allow_that_can_never_admit_it(tmp_path):
    """torch refuses builtins.frozenset in a weights_only load; the hint said `--allow builtins.frozenset`,
    which the allowlist then refuses (no plain __dict__): say to convert it instead."""
    from ckpt_archive.format.allowlist import refused_global_hint

    hint = refused_global_hint("builtins.frozenset")
    assert "--allow" not in hint and "convert" in hint
    assert "--allow argparse.Namespace" in refused_global_hint("argparse.Namespace")
