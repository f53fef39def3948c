"""``ckpt-archive status``: the watchdog for scheduled backups (issue 13). A live process is not a healthy
one: exit 1 when the newest usable generation is too old or a newer one did not advance the step."""
from __future__ import annotations

import datetime as dt
import json
import shutil
import time

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from ckpt_archive.errors import UsageError
from ckpt_archive.ops.status import parse_age, status


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _pack(repo, step: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed or step)
    return ca.pack({"w": torch.randn(8, generator=g), "step": step}, repo)


def test_a_fresh_advancing_repository_is_healthy(tmp_path):
    _pack(tmp_path / "repo", 100)
    res = cli("status", tmp_path / "repo", "--max-age", "2h", "--state", tmp_path / "st.json", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["generation"] == 1 and doc["step"] == 100 and doc["problems"] == []


def test_a_newest_generation_older_than_max_age_is_exit_1(tmp_path):
    res = _pack(tmp_path / "repo", 100)
    created = dt.datetime.fromisoformat(res.manifest["created"].replace("Z", "+00:00"))
    report = status(tmp_path / "repo", max_age="2h", state=tmp_path / "st.json", now=created + dt.timedelta(hours=3))
    assert not report.ok and "3.0 h old, more than --max-age 2.0 h" in report.problems[0]
    time.sleep(0.05)
    cli_res = cli("status", tmp_path / "repo", "--max-age", "0.01s", "--state", tmp_path / "st2.json")
    assert cli_res.exit_code == 1 and "unhealthy" in cli_res.stdout and "--max-age" in cli_res.stdout  # the verdict


def test_a_new_generation_that_did_not_advance_the_step_is_exit_1(tmp_path):
    repo, state = tmp_path / "repo", tmp_path / "st.json"
    _pack(repo, 100)
    assert cli("status", repo, "--max-age", "2h", "--state", state).exit_code == 0
    _pack(repo, 100, seed=7)                # a crash loop: the same step packed again
    res = cli("status", repo, "--max-age", "2h", "--state", state, "--json")
    assert res.exit_code == 1, res.output
    (problem,) = json.loads(res.stdout)["problems"]
    assert "step did not advance" in problem and "generation 2 holds step 100" in problem
    _pack(repo, 200)
    assert cli("status", repo, "--max-age", "2h", "--state", state).exit_code == 0


def test_the_same_generation_at_the_next_check_is_judged_by_age_only(tmp_path):
    repo, state = tmp_path / "repo", tmp_path / "st.json"
    _pack(repo, 100)
    assert cli("status", repo, "--max-age", "2h", "--state", state).exit_code == 0
    assert cli("status", repo, "--max-age", "2h", "--state", state).exit_code == 0


def test_no_usable_generation_is_exit_1_and_names_copied_ones(tmp_path):
    _pack(tmp_path / "repo", 1)
    shutil.copytree(tmp_path / "repo", tmp_path / "moved")
    res = cli("status", tmp_path / "moved", "--state", tmp_path / "st.json")
    assert res.exit_code == 1 and "no usable generation" in res.stdout and "ckpt-archive adopt" in res.stdout


def test_a_repository_that_cannot_be_read_is_exit_2(tmp_path):
    res = cli("status", tmp_path / "nope", "--max-age", "1h", "--state", tmp_path / "st.json")
    assert res.exit_code == 2
    assert cli("status", tmp_path, "--max-age", "soon").exit_code == 2


def test_the_default_state_lives_outside_the_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    _pack(tmp_path / "repo", 1)
    before = sorted(p.name for p in (tmp_path / "repo").iterdir())
    report = status(tmp_path / "repo")
    assert report.state_file.startswith(str(tmp_path / "state" / "ckpt-archive" / "status"))
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == before      # the watchdog only reads


def test_ages_parse_with_explicit_units():
    assert parse_age("2h") == 7200 and parse_age("1d12h") == 129600 and parse_age("90min") == 5400
    with pytest.raises(UsageError):
        parse_age("5m")                       # months in retention, minutes elsewhere: refused


def test_a_newest_generation_dated_in_the_future_is_unhealthy(tmp_path):
    """Fault: a generation whose manifest ``created`` lies in the future (a trainer host with a fast clock,
    or a resealed hand-edit to 2999) had a negative age forever, so ``status --max-age`` said healthy
    (exit 0, "-8521108.9 h old") and the watchdog never fired. It must be exit 1 naming the clock skew,
    and must not become the baseline the next step check compares with."""
    from hostile_archive import edit_manifest

    repo, state = tmp_path / "repo", tmp_path / "st.json"
    _pack(repo, 100)
    edit_manifest(repo, lambda m: m.__setitem__("created", "2999-01-01T00:00:00Z"))
    res = cli("status", repo, "--max-age", "2h", "--state", state, "--json")
    assert res.exit_code == 1, res.output
    (problem,) = json.loads(res.stdout)["problems"]
    assert "in the future" in problem and "clock skew" in problem
    assert not state.exists()
    # a few minutes of drift is tolerated
    from ckpt_archive.ops.status import CLOCK_SKEW_TOLERANCE_S

    when = dt.datetime(2999, 1, 1, tzinfo=dt.timezone.utc)
    assert status(repo, max_age="2h", record=False, now=when - dt.timedelta(seconds=60)).ok
    assert not status(repo, max_age="2h", record=False,
                      now=when - dt.timedelta(seconds=CLOCK_SKEW_TOLERANCE_S + 60)).ok


def test_created_with_lower_case_t_and_z_is_a_valid_rfc3339_time(tmp_path):
    """Fault: ``created: "2026-12-01t10:00:00z"`` (valid RFC 3339, accepted by the schema) was not parsed:
    status printed "is of unknown age old" and ``prune --keep-daily 3`` exited 2 ("keeps none"). One
    parser (repository.parse_time) reads every created time."""
    from hostile_archive import edit_manifest

    repo = tmp_path / "repo"
    _pack(repo, 100)
    edit_manifest(repo, lambda m: m.__setitem__("created", "2026-12-01t10:00:00z"))
    when = dt.datetime(2026, 12, 1, 11, 0, tzinfo=dt.timezone.utc)
    report = status(repo, max_age="2h", record=False, now=when)
    assert report.ok and report.age_s == 3600.0, report.problems
    res = cli("prune", repo, "--keep-daily", "3", "--dry-run")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("age", ["inf", "Infinity", "1e400", "9" * 400 + "h", "nan", "-1", "0", "0s"])
def test_a_non_finite_negative_or_zero_max_age_is_a_usage_error(tmp_path, age):
    """Fault: ``status --max-age inf`` was accepted (a watchdog that never fires) and ``--json`` then
    printed ``"max_age_s": {"$t": "float", "v": "inf"}``. Non-finite, negative and zero durations are a
    usage error (exit 2) and the JSON error object is plain."""
    _pack(tmp_path / "repo", 100)
    res = cli("status", tmp_path / "repo", "--max-age", age, "--state", tmp_path / "st.json", "--json")
    assert res.exit_code == 2, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["error"] == "UsageError" and "$t" not in res.stdout
