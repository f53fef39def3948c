"""State that commonly goes missing, packed from real ``torch.save`` files and live objects: NumPy RNG
in both forms, NumPy scalars (refused without ``--allow-numpy``), AMP GradScaler state, an fp16 config
without scaler state (flagged by ``verify``), tied weights, views, and CUDA RNG states for more devices
than are visible.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive
from ckpt_archive.cli.app import app
from ckpt_archive.errors import RefusedPickle
from ckpt_archive.sources.torchfile import numpy_safe_globals
from tests.helpers import assert_same

runner = CliRunner()


def _cli_json(*args):
    res = runner.invoke(app, [str(a) for a in args] + ["--json"])
    return res, json.loads(res.stdout)


# --- NumPy -------------------------------------------------------------------------------------------
def test_numpy_pcg64_and_legacy_rng_states_resume_the_same_draws(tmp_path):
    gen = np.random.default_rng(2**100 + 7)
    gen.standard_normal(5)
    legacy = np.random.RandomState(11)
    legacy.randint(0, 100, 7)
    state = {"rng": {"pcg64": gen.bit_generator.state, "legacy": legacy.get_state()}}
    assert state["rng"]["pcg64"]["state"]["state"] > 2**64  # a 128-bit int: beyond JSON's exact range
    src = tmp_path / "rng.pt"
    torch.save(state, src)
    repo = tmp_path / "repo"
    ckpt_archive.pack(src, repo, options=ckpt_archive.PackOptions(allow_numpy=True))
    back = ckpt_archive.load(repo)
    assert_same(state, back)
    assert back["rng"]["legacy"][1].dtype == np.uint32 and back["rng"]["legacy"][1].shape == (624,)

    g2 = np.random.default_rng()
    g2.bit_generator.state = back["rng"]["pcg64"]
    assert np.array_equal(g2.standard_normal(8), gen.standard_normal(8))
    l2 = np.random.RandomState()
    l2.set_state(back["rng"]["legacy"])
    assert np.array_equal(l2.randint(0, 2**31 - 1, 8), legacy.randint(0, 2**31 - 1, 8))

    out = tmp_path / "restored.pt"
    ckpt_archive.restore(repo, output=out)
    with torch.serialization.safe_globals(numpy_safe_globals()):
        assert_same(state, torch.load(out, weights_only=True))


def test_numpy_scalars_in_a_pt_are_refused_by_default_pointing_at_allow_numpy(tmp_path):
    state = {"best_loss": np.float32(0.25), "seen": np.int64(2**40), "w": torch.ones(2)}
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    with pytest.raises(RefusedPickle) as info:
        ckpt_archive.pack(src, tmp_path / "repo")
    assert "--allow-numpy" in str(info.value) and "ckpt.pt" in str(info.value)
    res, payload = _cli_json("pack", src, "--repo", tmp_path / "repo")
    assert res.exit_code == 2 and payload["error"] == "RefusedPickle" and "--allow-numpy" in payload["hint"]
    assert not (tmp_path / "repo").exists() or ckpt_archive.list_generations(tmp_path / "repo") == []

    res, payload = _cli_json("pack", src, "--repo", tmp_path / "repo", "--allow-numpy")
    assert res.exit_code == 0, res.output
    back = ckpt_archive.load(tmp_path / "repo")
    assert_same(state, back)  # np.float32 stays np.float32, np.int64 stays np.int64
    assert type(back["best_loss"]) is np.float32 and type(back["seen"]) is np.int64


def test_numpy_scalars_are_accepted_directly_from_python(tmp_path):
    state = {"metric": np.float64(0.5), "flag": np.bool_(True), "ids": np.arange(4, dtype=np.int16)}
    ckpt_archive.pack(state, tmp_path / "repo")
    assert_same(state, ckpt_archive.load(tmp_path / "repo"))


# --- AMP GradScaler ----------------------------------------------------------------------------------
def _scaler_after(steps: int):
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2048.0, growth_factor=3.0, backoff_factor=0.25,
                                  growth_interval=100)
    for _ in range(steps):
        scaler.scale(m(torch.randn(4, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return m, opt, scaler


def test_grad_scaler_state_round_trips_exactly_into_a_live_scaler(tmp_path):
    m, opt, scaler = _scaler_after(37)
    sd = scaler.state_dict()
    assert sd == {"scale": 2048.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 100,
                  "_growth_tracker": 37}
    src = tmp_path / "amp.pt"
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "scaler": sd, "step": 37}, src)
    repo = tmp_path / "repo"
    ckpt_archive.pack(src, repo, annotations=ckpt_archive.Annotations(config={"fp16": True}))
    out = tmp_path / "restored.pt"
    ckpt_archive.restore(repo, output=out)
    back = torch.load(out, weights_only=True)
    assert_same(sd, back["scaler"])  # types too: scale a float, tracker and interval ints

    fresh = torch.amp.GradScaler("cpu")  # defaults: scale 65536, tracker 0
    report = ckpt_archive.restore_training_state(back, scaler=fresh, rng=False)
    assert "scaler" in report.restored
    assert fresh.get_scale() == 2048.0 and fresh._get_growth_tracker() == 37
    assert (fresh.get_growth_factor(), fresh.get_backoff_factor(), fresh.get_growth_interval()) == (3.0, 0.25, 100)


def test_fp16_config_without_scaler_state_is_flagged_by_verify(tmp_path):
    m, opt, scaler = _scaler_after(3)
    base = {"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 3,
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}
    bad, good = tmp_path / "bad", tmp_path / "good"
    ckpt_archive.pack(base, bad, annotations=ckpt_archive.Annotations(config={"fp16": True}))
    ckpt_archive.pack({**base, "scaler": scaler.state_dict()}, good, annotations=ckpt_archive.Annotations(config={"fp16": True}))

    res, payload = _cli_json("verify", bad)
    assert res.exit_code == 0
    flagged = [w for w in payload["warnings"] if "GradScaler" in w]
    assert flagged and "fp16" in flagged[0]
    res, payload = _cli_json("verify", bad, "--strict")
    assert res.exit_code == 1 and any("GradScaler" in p["reason"] for p in payload["problems"])

    res, payload = _cli_json("verify", good, "--strict")
    assert not any("GradScaler" in w for w in payload["warnings"])
    assert not any("GradScaler" in p["reason"] for p in payload["problems"])


# --- tied weights and views ----------------------------------------------------------------------------
class _TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 40, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2 / Llama do


def test_tied_weights_from_a_pt_file_are_stored_once_and_retied(tmp_path):
    torch.manual_seed(0)
    model = _TiedLM()
    src = tmp_path / "tied.pt"
    torch.save({"model": model.state_dict()}, src)
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(src, repo)
    stored = [e for m in res.manifest["members"] if m["role"] == "tensors" for e in m["entries"]]
    assert len(stored) == 3, "emb.weight and head.weight share one storage: stored once (+ body w, b)"
    out = tmp_path / "restored.pt"
    ckpt_archive.restore(repo, output=out)
    sd = torch.load(out, weights_only=True)["model"]
    assert list(sd) == list(model.state_dict())
    assert sd["emb.weight"].untyped_storage().data_ptr() == sd["head.weight"].untyped_storage().data_ptr()
    fresh = _TiedLM()
    fresh.load_state_dict(sd)
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, model.emb.weight)


def test_views_into_one_flat_buffer_keep_every_key_and_value(tmp_path):
    flat = torch.randn(40, generator=torch.Generator().manual_seed(1))
    state = {"flat": flat, "w": flat[:12].view(3, 4), "b": flat[12:15], "tail_t": flat[20:32].view(4, 3).t()}
    src = tmp_path / "views.pt"
    torch.save(state, src)
    repo = tmp_path / "repo"
    ckpt_archive.pack(src, repo)
    back = ckpt_archive.load(repo)
    assert list(back) == list(state)
    assert_same(state, back)
    assert back["b"].storage_offset() == 12 and back["tail_t"].stride() == (1, 3)
    back["flat"][13] = 99.0  # still one buffer: a write through the base shows in the view
    assert back["b"][1] == 99.0


# --- CUDA RNG states on a machine with fewer devices ------------------------------------------------------
def test_cuda_rng_states_for_two_devices_restore_on_cpu_with_both_counts(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA devices")
    torch.manual_seed(5)
    cpu_state = torch.get_rng_state()
    expected_draw = torch.rand(3)
    cuda = [torch.randint(0, 255, (16,), dtype=torch.uint8) for _ in range(2)]  # Philox: seed + offset
    state = {"rng": {"python": random.getstate(), "numpy": np.random.RandomState(3).get_state(),
                     "torch": cpu_state, "cuda": cuda}, "step": 9}
    src = tmp_path / "rng.pt"
    torch.save(state, src)
    repo = tmp_path / "repo"
    ckpt_archive.pack(src, repo, options=ckpt_archive.PackOptions(allow_numpy=True))
    back = ckpt_archive.load(repo)
    assert_same(state, back)

    torch.manual_seed(999)
    report = ckpt_archive.restore_training_state(back)
    assert any("2 saved, 0 visible" in w for w in report.warnings), report.warnings
    assert report.bitwise_resumable is False
    assert torch.equal(torch.rand(3), expected_draw), "the CPU stream must still be restored"


def test_reader_reports_cuda_rng_states_of_a_trainer_rng_file(tmp_path):
    from ckpt_archive.sources import read_source

    d = tmp_path / "checkpoint-3"
    d.mkdir()
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 0.5}))
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
                "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2}, d / "rng_state.pth")
    src = read_source(d)
    assert src.info["rng"] == [{"file": "rng_state.pth", "python": True, "numpy": "MT19937", "cpu": True,
                                "cuda_devices": 2}]
    assert any("2 CUDA RNG states saved" in w for w in src.warnings)


def test_tensor_metric_is_refused_naming_the_metric_and_the_fix():
    # metrics={"val_loss": loss} with a 0-d tensor is the usual slip; the message must say which value
    import torch

    from ckpt_archive.errors import SourceError
    from ckpt_archive.format.state_tree import encode_value

    with pytest.raises(SourceError) as info:
        encode_value({"acc": 0.9, "val_loss": torch.tensor(0.5)})
    assert "val_loss" in str(info.value) and "loss.item()" in str(info.value)
    assert "acc" not in str(info.value)


def test_long_lists_of_plain_values_keep_every_edge_through_the_fast_path(tmp_path):
    """Fault guarded: long lists of ints, floats or str (a sampler's permutation, a loss history) are
    encoded and decoded as a whole when every element is its own JSON form; an element that is not (an int
    past 2**53, a nan or -inf, a bool among ints, a str with lone surrogates) must still take the tagged
    path, or it would come back as another value or type."""
    import math
    import os

    n = 40
    state = {
        "perm": list(range(n)),
        "big": list(range(n)) + [2**53 + 1],
        "neg_big": [-(2**53) - 1] + list(range(n)),
        "floats": [0.5] * n + [-0.0],
        "nan": [1.0] * n + [float("nan"), float("-inf")],
        "bools_in_ints": [1] * n + [True],
        "strs": ["a"] * n,
        "bad_str": ["a"] * n + [os.fsdecode(b"\xe9")],
        "nested": [[1, 2]] * n,
    }
    ckpt_archive.pack(state, tmp_path / "r")
    back = ckpt_archive.load(tmp_path / "r")
    for key in ("perm", "big", "neg_big", "strs", "bad_str", "nested"):
        assert back[key] == state[key] and [type(v) for v in back[key]] == [type(v) for v in state[key]], key
    assert math.copysign(1.0, back["floats"][-1]) == -1.0 and back["floats"][:-1] == state["floats"][:-1]
    assert math.isnan(back["nan"][-2]) and back["nan"][-1] == float("-inf")
    assert type(back["bools_in_ints"][-1]) is bool and type(back["bools_in_ints"][0]) is int


def test_pack_load_and_the_checkpointer_work_when_the_script_turned_on_deterministic_algorithms(tmp_path):
    """Fault: a training script with ``torch.use_deterministic_algorithms(True)`` crashed pack (and the in-loop
    Checkpointer) on a uint4 or int2 tensor: ``torch.empty(0, dtype=uint4)`` runs the deterministic fill, which
    has no kernel for those dtypes (NotImplementedError, "fill_empty_deterministic_")."""
    import torch

    import ckpt_archive

    u = torch.tensor([1, 2, 3, 4], dtype=torch.uint8).view(torch.uint4)
    i2 = torch.tensor([5, 6], dtype=torch.uint8).view(torch.int2)
    state = {"u": u, "u_view": u[1:3], "i2": i2, "w": torch.ones(3)}
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ckpt_archive.pack(state, tmp_path / "r")
        back = ckpt_archive.load(tmp_path / "r")
        with ckpt_archive.Checkpointer(tmp_path / "c") as ck:
            ck.save(1, state)
    finally:
        torch.use_deterministic_algorithms(was)
    assert back["u"].dtype == torch.uint4 and back["u"].view(torch.uint8).tolist() == [1, 2, 3, 4]
    assert back["u_view"].view(torch.uint8).tolist() == [2, 3] and back["i2"].dtype == torch.int2
    assert ckpt_archive.load(tmp_path / "c")["u"].view(torch.uint8).tolist() == [1, 2, 3, 4]
