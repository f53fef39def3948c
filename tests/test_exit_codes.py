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
