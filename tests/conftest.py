"""Shared pytest hooks. Keep each section small and marked with who uses it."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# --- the user cache (validated manifests, remote-repository locks) --------------------------------
# Tests (and the CLI processes they start, which inherit the environment) use a cache of their own, so a
# run neither reads verdicts an earlier run left in ~/.cache nor leaves thousands behind there.
_CACHE = tempfile.mkdtemp(prefix="ckpt-archive-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# --- fault-injection tally (tests/test_faults.py) ------------------------------------------------
# test_faults.py records every injection point it tried and whether the repository survived it; the
# summary line below appears in normal pytest output (no -s needed).
FAULT_TALLY: dict = {"tried": 0, "survived": 0, "failed": []}


@pytest.fixture(scope="session")
def fault_tally() -> dict:
    return FAULT_TALLY


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if FAULT_TALLY["tried"]:
        terminalreporter.write_sep("-", "fault injection")
        terminalreporter.write_line(f"fault injection: {FAULT_TALLY['tried']} injection points tried, "
                                    f"{FAULT_TALLY['survived']} survived")
        for name in FAULT_TALLY["failed"]:
            terminalreporter.write_line(f"  not survived: {name}")
# --- end fault-injection tally ---------------------------------------------------------------------
