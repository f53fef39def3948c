"""Summaries that say what happened (issue 26): an export re-run, the age of a generation, info findings
under --quiet, and which checkpoint file a backup picked (by step, not mtime)."""
from __future__ import annotations

import json
import os
import random
import re
import time

import numpy as np
import torch
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from ckpt_archive.ops.export_copy import files_of
from ckpt_archive.repo.repository import Repository


def cli(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def test_an_export_rerun_counts_the_whole_generation_as_skipped_not_0_bytes(tmp_path):
    """It said "moved 0 B; skipped 0 B already at the destination" (and bytes_skipped 0) when the whole
    generation was already there."""
    src = tmp_path / "src"
    ca.pack({"model": {"w": torch.randn(300, 300)}, "step": 1}, src)
    g = Repository.open(src).generation(1)
    stored = sum(f.rec["stored_bytes"] for f in files_of(g.manifest, g.key))
    first = json.loads(cli("export", src, "--to", tmp_path / "dst", "--json").stdout)
    assert first["bytes_copied"] == stored and first["bytes_skipped"] == 0
    again = cli("export", src, "--to", tmp_path / "dst", "--json")
    doc = json.loads(again.stdout)
    assert doc["ok"] is True and doc["generations"][0]["status"] == "already-usable"
    assert doc["bytes_copied"] == 0 and doc["bytes_skipped"] == stored == doc["generations"][0]["bytes_skipped"]
    human = cli("export", src, "--to", tmp_path / "dst")
    assert human.exit_code == 0 and "moved 0 B; skipped 0 B" not in human.stdout
    assert re.search(r"moved 0 B; skipped \d+\.\d KiB already at the destination", human.stdout), human.stdout


def test_status_says_a_fresh_generation_is_seconds_old_not_0_0_h(tmp_path):
    repo = tmp_path / "repo"
    ca.pack({"w": torch.ones(2), "step": 3}, repo)
    res = cli("status", repo, "--state", tmp_path / "st.json")
    assert res.exit_code == 0, res.output
    assert re.search(r"\(step 3, \d+ s old\)", res.stdout) and " h old" not in res.stdout


def _complete_but_for_the_data_cursor(repo):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    ca.pack({"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 1,
             "rng": {"python": random.getstate(), "numpy": np.random.default_rng(1).bit_generator.state,
                     "torch": torch.get_rng_state()}}, repo)


def test_verify_quiet_prints_nothing_for_an_info_finding_and_never_calls_it_a_warning(tmp_path):
    """`verify -q` printed "warning: completeness (info): ..." on every run: cron mailed a state that is fine."""
    repo = tmp_path / "repo"
    _complete_but_for_the_data_cursor(repo)
    res = cli("verify", repo, "-q")
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == ""
    res = cli("verify", repo)
    assert res.exit_code == 0 and "warning" not in res.output
    assert "info: completeness: data: could not check" in res.stdout
    doc = json.loads(cli("verify", repo, "--json").stdout)    # the JSON keeps it, as it was
    assert any(w.startswith("completeness (info): data") for w in doc["warnings"])


# ---------------------------------------------------------------------------------------- backup: by step
def _save(path, step, mtime_ago):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.full((4,), float(step))}, "step": step}, path)
    t = time.time() - mtime_ago
    os.utime(path, (t, t))
    return path


def _backup(source, repo):
    res = cli("backup", source, "--repo", repo, "--settle", 0, "--json")
    return res, json.loads(res.stdout)


def test_backup_picks_the_highest_step_not_a_stray_older_step_file_written_later(tmp_path):
    """A stray older-step file written later became @latest."""
    out = tmp_path / "out"
    good = _save(out / "ckpt-a.pt", 200, 600)
    res, doc = _backup(out, tmp_path / "repo")
    assert res.exit_code == 0 and doc["checkpoint"] == str(good.absolute())
    stray = _save(out / "copied-from-elsewhere.pt", 100, 0)  # written now, an older step
    res, doc = _backup(out, tmp_path / "repo")
    assert res.exit_code == 0 and doc["action"] == "unchanged" and doc["checkpoint"] == str(good.absolute())
    assert ca.load(tmp_path / "repo")["step"] == 200
    note = next(w for w in doc["warnings"] if "lower than step 200" in w)
    assert str(stray.absolute()) in note and "holds step 100" in note and "not chosen" in note
    assert f"chose {good.absolute()} (step 200)" in note and "generation 1" in note
    human = cli("backup", out, "--repo", tmp_path / "repo", "--settle", 0)
    assert "warning: the newest file" in human.stderr and "not chosen" in human.stderr


def test_backup_orders_files_by_their_step_and_remembers_it(tmp_path, monkeypatch):
    from ckpt_archive.ops import backup as backup_mod
    from ckpt_archive.ops import checkpoint_pick

    out = tmp_path / "out"
    _save(out / "z-early.pt", 10, 0)
    _save(out / "a-late.pt", 30, 300)
    _save(out / "m-mid.pt", 20, 200)
    steps: dict = {}
    assert [p.name for p in backup_mod.checkpoint_candidates(out, steps)] == ["a-late.pt", "m-mid.pt", "z-early.pt"]

    def no_reading(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(checkpoint_pick, "_read_step", no_reading)  # unchanged files: from the remembered steps
    assert [p.name for p in backup_mod.checkpoint_candidates(out, steps)] == ["a-late.pt", "m-mid.pt", "z-early.pt"]


def test_backup_of_a_lower_step_as_the_only_checkpoint_warns_that_latest_went_back(tmp_path):
    src = tmp_path / "last.pt"
    _save(src, 500, 60)
    assert _backup(src, tmp_path / "repo")[0].exit_code == 0
    _save(src, 400, 0)                                        # the run restarted from an older checkpoint
    res, doc = _backup(src, tmp_path / "repo")
    assert res.exit_code == 0 and doc["action"] == "packed" and doc["generation"] == 2
    note = next(w for w in doc["warnings"] if "lower than step 500" in w)
    assert "holds step 400" in note and "now generation 2, @latest" in note and "REPO@1" in note


def test_backup_without_a_lower_step_says_nothing_about_steps(tmp_path):
    out = tmp_path / "out"
    _save(out / "a.pt", 100, 600)
    _backup(out, tmp_path / "repo")
    _save(out / "b.pt", 200, 0)
    res, doc = _backup(out, tmp_path / "repo")
    assert doc["action"] == "packed" and doc["checkpoint"].endswith("b.pt") and not doc["warnings"]
