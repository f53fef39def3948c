"""inspect lists where a generation's state holds NumPy values (issue 27): `verify` accepted a file packed with
--allow-numpy without saying which paths had come in as NumPy scalars, which the restored file needs NumPy's
allowlist for again."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive
from ckpt_archive.cli.app import app
from ckpt_archive.ops.pack import MAX_NUMPY_PATHS

runner = CliRunner()


def test_inspect_names_the_numpy_scalars_and_arrays_of_an_allow_numpy_file(tmp_path):
    f = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(3)}, "best_loss": np.float64(0.25), "epoch": np.int64(4),
                "sched": {"gamma": np.float32(0.5)}, "rng": {"numpy": np.random.RandomState(0).get_state()},
                "dtype": np.dtype("float16")}, f)
    assert runner.invoke(app, ["pack", str(f), "--repo", str(tmp_path / "repo"), "--allow-numpy"]).exit_code == 0
    info = ckpt_archive.inspect(tmp_path / "repo")
    assert info["numpy"]["scalars"] == {"count": 4, "paths": ["best_loss", "epoch", "sched/gamma", "dtype"]}
    assert info["numpy"]["arrays"] == ["rng/numpy/1"]
    res = runner.invoke(app, ["inspect", str(tmp_path / "repo")])
    assert res.exit_code == 0, res.output
    assert "NumPy scalars/dtypes (4;" in res.output and "best_loss, epoch, sched/gamma, dtype" in res.output
    assert "NumPy arrays (1): rng/numpy/1" in res.output
    js = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "repo"), "--json"]).stdout)
    assert js["numpy"]["scalars"]["paths"] == ["best_loss", "epoch", "sched/gamma", "dtype"]


def test_a_state_without_numpy_values_records_none_and_inspect_says_nothing(tmp_path):
    ckpt_archive.pack({"w": torch.ones(2), "step": 1}, tmp_path / "repo")
    info = ckpt_archive.inspect(tmp_path / "repo")
    assert info["numpy"] == {"arrays": [], "scalars": None}
    assert "numpy_values" not in info["manifest"]["source"]["info"]
    out = runner.invoke(app, ["inspect", str(tmp_path / "repo")]).output
    assert "NumPy scalars" not in out and "NumPy arrays" not in out


def test_many_numpy_scalars_are_counted_and_the_first_paths_listed(tmp_path):
    n = MAX_NUMPY_PATHS + 30
    ckpt_archive.pack({"losses": [np.float32(i) for i in range(n)]}, tmp_path / "repo")
    sc = ckpt_archive.inspect(tmp_path / "repo")["numpy"]["scalars"]
    assert sc["count"] == n and sc["paths"][:2] == ["losses/0", "losses/1"] and len(sc["paths"]) == MAX_NUMPY_PATHS
    assert "(+30 more)" in runner.invoke(app, ["inspect", str(tmp_path / "repo")]).output


@pytest.mark.parametrize("value", [np.float64(0.5), np.int32(-3), np.bool_(True)])
def test_numpy_scalars_still_round_trip_as_the_same_numpy_type(tmp_path, value):
    ckpt_archive.pack({"v": value}, tmp_path / "repo")
    back = ckpt_archive.load(tmp_path / "repo")["v"]
    assert type(back) is type(value) and back == value
