"""The one rule from a result or an error to the CLI's exit code (``ckpt_archive.errors.exit_code_for``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ckpt_archive import errors
from ckpt_archive.errors import exit_code_for


def test_exit_codes_are_the_documented_numbers_and_never_reused():
    codes = [errors.EXIT_OK, errors.EXIT_CHECK_FAILED, errors.EXIT_CANNOT_CHECK, errors.EX_TEMPFAIL,
             errors.EXIT_INTERRUPTED]
    assert codes == [0, 1, 2, 75, 130]


def test_an_explicit_exit_code_wins_over_ok_so_a_busy_backup_is_not_reported_as_a_failed_check():
    busy = SimpleNamespace(ok=False, exit_code=errors.EX_TEMPFAIL)
    assert exit_code_for(busy) == 75
    assert exit_code_for({"ok": False, "exit_code": 75}) == 75


def test_a_result_that_is_not_ok_exits_1_and_an_ok_one_0():
    assert exit_code_for(SimpleNamespace(ok=False)) == 1 and exit_code_for(SimpleNamespace(ok=True)) == 0
    assert exit_code_for({"all_checks_passed": False}) == 1 and exit_code_for({"all_checks_passed": True}) == 0


def test_errors_map_by_class_and_an_interrupt_to_130():
    assert exit_code_for(errors.IntegrityError("x")) == 1
    assert exit_code_for(errors.LockError("x")) == 2
    assert exit_code_for(OSError(5, "io")) == 2
    assert exit_code_for(KeyboardInterrupt()) == 130


def test_a_result_that_says_neither_ok_nor_exit_code_is_refused_not_taken_as_success():
    with pytest.raises(TypeError):
        exit_code_for(SimpleNamespace(generation=3))
    with pytest.raises(TypeError):
        exit_code_for({"generation": 3})


@pytest.mark.parametrize("args", [
    ["gc", "{repo}", "--wait", "inf"], ["prune", "{repo}", "--keep-last", "1", "--wait", "-1"],
    ["forget", "{repo}@1", "--wait", "nan"], ["adopt", "{repo}", "--wait", "1e999"],
    ["pack", "{src}", "--repo", "{repo}", "--wait", "-1"], ["export", "{repo}", "--to", "{dest}", "--wait", "inf"],
    ["backup", "{src}", "--repo", "{repo}", "--settle", "inf"],
    ["backup", "{src}", "--repo", "{repo}", "--stale-after", "0"],
    ["check-resume", "--steps", "2", "--interrupt-at", "1", "--timeout", "inf", "--", "true"],
])
def test_a_non_finite_or_negative_duration_option_is_a_usage_error(tmp_path, args):
    """Fault: duration options (--wait, --settle, --stale-after, --timeout) took ``inf``/``nan``/negative
    values: a negative --wait made filelock wait forever, ``inf`` never times out. Each is exit 2 (a usage
    error naming the option) before anything runs."""
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    fill = {"repo": str(tmp_path / "repo"), "src": str(tmp_path / "ck.pt"), "dest": str(tmp_path / "dest")}
    res = CliRunner().invoke(app, [a.format(**fill) for a in args])
    option = next(a for a in args if a in ("--wait", "--settle", "--stale-after", "--timeout"))
    assert res.exit_code == 2 and f"bad {option}" in res.output, res.output
    assert not (tmp_path / "repo").exists() and not (tmp_path / "dest").exists()


def test_a_negative_or_infinite_lock_wait_is_refused_by_the_library_too(tmp_path):
    """Fault: ``Repository.lock(wait=-1)`` (Python API, pack/export ``wait=``) waited forever: filelock reads
    a negative timeout as "no timeout"."""
    from ckpt_archive.repo.repository import Repository

    repo = Repository.open(tmp_path / "repo", create=True)
    for wait in (-1, float("inf"), float("nan")):
        with pytest.raises(errors.UsageError):
            with repo.lock(wait=wait):
                pass
    with repo.lock(wait=0):
        pass
