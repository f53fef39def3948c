"""The round-trip contract: what pack stores, load/restore give back exactly (issue 2's matrix)."""
from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch

import ckpt_archive
from tests.helpers import assert_same

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]


def _tensor(dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float64 if not dtype.is_complex else torch.complex64).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def full_state():
    sd = collections.OrderedDict()
    for dt in DTYPES:
        sd[f"t_{str(dt).split('.')[-1]}"] = _tensor(dt)
    sd["zero_dim"] = torch.tensor(3.25, dtype=torch.float64)
    sd["empty"] = torch.empty(0, 4)
    sd["noncontig"] = torch.arange(12.0).reshape(3, 4).t()
    sd._metadata = collections.OrderedDict({"": {"version": 1}, "fc": {"version": 2}})
    py_rng = random.Random(3).getstate()
    return {
        "model": sd,
        "optimizer": {"state": {0: {"step": torch.tensor(6000.0), "exp_avg": torch.randn(4)},
                                1: {"step": torch.tensor(6000.0), "exp_avg": torch.randn(2)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1],
                                        "amsgrad": False, "foreach": None}]},
        "rng": {"python": py_rng, "numpy": np.random.default_rng(7).bit_generator.state,
                "numpy_legacy": np.random.RandomState(5).get_state(), "torch": torch.get_rng_state()},
        "values": [1, 1.0, True, None, "s", b"\x00\xff", bytearray(b"ab"), float("inf"), float("-inf"),
                   float("nan"), 2**64 + 1, -(2**60), (1, (2, 3)), {3: "int key", (1, 2): "tuple key"}],
        "numpy": {"arr": np.arange(6, dtype=np.uint32).reshape(2, 3), "f16": np.ones(3, dtype=np.float16),
                  "scalar_f32": np.float32(1.5), "scalar_i64": np.int64(-3), "dtype": np.dtype("<f4")},
        "torch_types": {"dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu")},
        "dollar": {"$t": "not a tag"},
        "step": 5,
    }


def test_load_gives_back_exactly_what_was_packed(tmp_path):
    state = full_state()
    res = ckpt_archive.pack(state, tmp_path / "repo")
    assert res.status == "usable" and res.generation == 1
    assert_same(state, ckpt_archive.load(tmp_path / "repo"))


def test_restore_writes_a_weights_only_pt_equal_to_the_original(tmp_path):
    state = full_state()
    state.pop("numpy")  # a .pt with NumPy objects needs the NumPy allowlist to load (tested below)
    state["rng"].pop("numpy_legacy")
    ckpt_archive.pack(state, tmp_path / "repo")
    out = tmp_path / "out.pt"
    ckpt_archive.restore(tmp_path / "repo", "latest", out)
    assert_same(state, torch.load(out, weights_only=True))


def test_restored_numpy_state_loads_with_the_numpy_allowlist_only(tmp_path):
    from ckpt_archive.sources.torchfile import numpy_safe_globals

    state = {"rng": {"legacy": np.random.RandomState(1).get_state()}, "s": np.float64(2.5)}
    ckpt_archive.pack(state, tmp_path / "repo")
    out = tmp_path / "out.pt"
    ckpt_archive.restore(tmp_path / "repo", "latest", out)
    with torch.serialization.safe_globals(numpy_safe_globals()):
        assert_same(state, torch.load(out, weights_only=True))


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path):
    emb = torch.randn(50, 8)
    state = {"model": collections.OrderedDict(embed=emb, head=emb)}
    res = ckpt_archive.pack(state, tmp_path / "repo")
    entries = [e for m in res.manifest["members"] if m["role"] == "tensors" for e in m["entries"]]
    assert len(entries) == 1, "tied weights must be stored once"
    back = ckpt_archive.load(tmp_path / "repo")["model"]
    assert back["embed"].untyped_storage().data_ptr() == back["head"].untyped_storage().data_ptr()
    back["embed"][0, 0] = 123.0
    assert back["head"][0, 0] == 123.0


def test_a_view_of_part_of_another_tensor_keeps_its_key_and_values(tmp_path):
    base = torch.arange(20.0)
    state = {"base": base, "part": base[5:9], "strided": base[::3]}
    ckpt_archive.pack(state, tmp_path / "repo")
    back = ckpt_archive.load(tmp_path / "repo")
    assert_same(state, back)
    assert back["part"].storage_offset() == 5 and back["strided"].stride() == (3,)


def test_non_contiguous_tensor_keeps_its_strides(tmp_path):
    t = torch.arange(6.0).reshape(2, 3).t()
    ckpt_archive.pack({"t": t}, tmp_path / "repo")
    back = ckpt_archive.load(tmp_path / "repo")["t"]
    assert back.stride() == t.stride() and torch.equal(back, t)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_every_dtype_round_trips_bit_exact_through_restore(tmp_path, dtype):
    t = _tensor(dtype, (257,))  # odd size: chunk and byte-group boundaries
    ckpt_archive.pack({"t": t}, tmp_path / "repo", options=ckpt_archive.PackOptions(chunk_bytes=64))
    ckpt_archive.restore(tmp_path / "repo", "latest", tmp_path / "o.pt")
    assert_same({"t": t}, torch.load(tmp_path / "o.pt", weights_only=True))


def test_only_restores_part_of_the_state(tmp_path):
    state = full_state()
    ckpt_archive.pack(state, tmp_path / "repo")
    out = tmp_path / "model.pt"
    ckpt_archive.restore(tmp_path / "repo", "latest", out, options=ckpt_archive.RestoreOptions(only="model"))
    assert_same(state["model"], torch.load(out, weights_only=True))


def test_manifest_records_progress_and_every_tensor_fingerprint(tmp_path):
    import hashlib

    state = full_state()
    res = ckpt_archive.pack(state, tmp_path / "repo", annotations=ckpt_archive.Annotations(progress={"epoch": 2}))
    m = res.manifest
    assert m["progress"] == {"step": 5, "epoch": 2, "cursor": None}
    rec = m["tensors"]["model/t_float32"]
    t = state["model"]["t_float32"]
    assert rec["dtype"] == "float32" and rec["shape"] == [3, 5]
    import blake3

    assert rec["raw_fp"] == "blake3:" + blake3.blake3(t.numpy().tobytes()).hexdigest()
    assert m["environment"]["torch"] == torch.__version__


def test_decoded_tensors_member_is_a_valid_safetensors_file_with_str_metadata(tmp_path):
    from safetensors.torch import load

    from ckpt_archive.ops.common import open_repo as _repo
    from ckpt_archive.repo.reader import ArchiveReader

    state = {"a": torch.randn(4, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    res = ckpt_archive.pack(state, tmp_path / "repo")
    r = _repo(tmp_path / "repo")
    gen = r.resolve("latest")
    reader = ArchiveReader(r.store, gen.key, gen.manifest)
    raw = bytes(reader.read_member_bytes("tensors-00000.safetensors", limit=1 << 30))
    loaded = load(raw)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    import json, struct

    n = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    from ckpt_archive.format.fingerprint import MemberRawCheck

    check = MemberRawCheck(res.manifest["members"][0])  # every entry's blake3 and the header's, derived
    check.update(raw)
    assert check.problem() is None and check.result() == res.manifest["members"][0]["raw_fp"]


def test_tree_and_manifest_are_strict_json(tmp_path):
    import json

    state = full_state()
    res = ckpt_archive.pack(state, tmp_path / "repo")
    text = (tmp_path / "repo" / "generations" / "00000001" / "manifest.json").read_text()
    json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert res.manifest["format_version"] == 3  # its float tensors are stored sign-rotated (bg2r/bg4r+zstd)


def test_config_metrics_and_data_ids_keep_their_types(tmp_path):
    (tmp_path / "c.yaml").write_text("lr: 1e-4\nwarmup: 4\nnothing: null\nflag: false\nname: run\n")
    (tmp_path / "m.toml").write_text("val_loss = 0.5\nstep = 4\n")
    (tmp_path / "ids.json").write_text("[3, 1, 2]")
    res = ckpt_archive.pack({"w": torch.ones(1)}, tmp_path / "repo", annotations=ckpt_archive.Annotations(config=tmp_path / "c.yaml", metrics=tmp_path / "m.toml", data_ids=tmp_path / "ids.json"))
    c = res.manifest["config"]
    assert c == {"lr": 1e-4, "warmup": 4, "nothing": None, "flag": False, "name": "run"}
    assert type(c["lr"]) is float and type(c["warmup"]) is int and c["flag"] is False
    assert res.manifest["metrics"] == {"val_loss": 0.5, "step": 4}
    assert res.manifest["data"]["count"] == 3 and len(res.manifest["data"]["fingerprint"]) == 64


def test_a_pt_file_source_round_trips(tmp_path):
    state = full_state()
    state.pop("numpy")
    state["rng"].pop("numpy_legacy")
    torch.save(state, tmp_path / "ck.pt")
    res = ckpt_archive.pack(tmp_path / "ck.pt", tmp_path / "repo")
    assert res.manifest["source"]["format"] == "torch-file"
    assert_same(state, ckpt_archive.load(tmp_path / "repo"))


def test_parameters_come_back_as_parameters_with_their_requires_grad(tmp_path):
    state = {"p": torch.nn.Parameter(torch.randn(3)), "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
             "t": torch.zeros(2)}
    ckpt_archive.pack(state, tmp_path / "repo")
    back = ckpt_archive.load(tmp_path / "repo")
    assert type(back["p"]) is torch.nn.Parameter and back["p"].requires_grad
    assert type(back["frozen"]) is torch.nn.Parameter and not back["frozen"].requires_grad
    assert type(back["t"]) is torch.Tensor
    ckpt_archive.restore(tmp_path / "repo", "latest", tmp_path / "o.pt")
    assert type(torch.load(tmp_path / "o.pt", weights_only=True)["p"]) is torch.nn.Parameter


def test_only_with_a_missing_key_lists_the_keys_that_are_there(tmp_path):
    # `restore --only model` on a Trainer folder (keys model.safetensors, optimizer.pt, ...) must say
    # what to write instead
    from ckpt_archive.errors import NotFound

    repo = tmp_path / "r"
    ckpt_archive.pack({"model.safetensors": {"w": torch.zeros(1)}, "optimizer.pt": {"state": {}}}, repo)
    with pytest.raises(NotFound) as info:
        ckpt_archive.load(repo, options=ckpt_archive.LoadOptions(only="model"))
    assert "no key 'model'" in str(info.value) and "keys there: model.safetensors, optimizer.pt" in str(info.value)


def test_empty_tensors_keep_their_strides_through_load_and_restore(tmp_path):
    """Fault (break test): torch counts an empty tensor as contiguous whatever its strides, so
    ``torch.empty(2, 0).t()`` (strides (1, 1)) was stored as a plain entry and came back with (2, 1) from
    load and restore; an empty tensor whose strides are not C-order is now kept as a view."""
    from ckpt_archive.ops.restore import restore

    state = {"f": torch.empty(2, 0).t(), "g": torch.empty(0, 4)[:, ::2], "h": torch.empty(3, 0, 4).permute(2, 0, 1),
             "e": torch.empty(0, 3), "w": torch.ones(2, 3)}
    ckpt_archive.pack(state, tmp_path / "r")
    back = ckpt_archive.load(tmp_path / "r")
    restore(tmp_path / "r", output=tmp_path / "o.pt")
    restored = torch.load(tmp_path / "o.pt", weights_only=True)
    for k, t in state.items():
        assert (back[k].shape, back[k].stride()) == (t.shape, t.stride()), k
        assert (restored[k].shape, restored[k].stride()) == (t.shape, t.stride()), k
