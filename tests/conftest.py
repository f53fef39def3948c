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


# --- process-wide torch switches a library may leave on (Lightning's Trainer(deterministic=True)) --------
# Lightning turns torch.use_deterministic_algorithms on for the whole process and never turns it off: every
# later test then ran in a mode the product must survive (tests/test_state_types.py checks it does) but that
# the rest of the suite did not choose. Restored after each test, only when torch is already imported.
@pytest.fixture(autouse=True)
def _restore_torch_deterministic_mode():
    import sys

    torch = sys.modules.get("torch")
    before = torch.are_deterministic_algorithms_enabled() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and before is not None and torch.are_deterministic_algorithms_enabled() != before:
        torch.use_deterministic_algorithms(before)
    elif torch is not None and before is None and torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)


# --- the CLI in-process: each Typer app's click command built once ------------------------------------
# typer.testing.CliRunner.invoke converts the Typer app into a click command on every call: for the full app
# (fifteen commands) that is Typer reading every command function's signature and type hints, 25-40 ms per
# invocation, and the suite invokes the CLI in-process thousands of times (the fuzz tests alone 4,500). The
# command is built once per app object and rebuilt when the app's registrations change; what a command does
# is looked up when it runs, so monkeypatched operations are still seen. The product's own main() builds
# the one command its command line names, once per process, and is not affected.
def _command_built_once():
    import weakref

    import typer.testing

    real = typer.testing._get_command
    built: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def get_command(app):
        key = (tuple(map(id, app.registered_commands)), tuple(map(id, app.registered_groups)),
               id(app.registered_callback))
        hit = built.get(app)
        if hit is None or hit[0] != key:
            hit = built[app] = (key, real(app))
        return hit[1]

    typer.testing._get_command = get_command


_command_built_once()
# --- end the CLI in-process -----------------------------------------------------------------------------
