"""The CLI's own process (``ckpt_archive/cli/process.py``): a reader of stdout that goes away, a stdout that cannot
be written, and a Ctrl-C at any moment, in real processes (what ``main`` adds around a command is not run by
Typer's CliRunner).

The rule (README, "Commands"): a reader that goes away (``| head``, ``>&-``) stops the output, never the
command, and never changes its exit code -- a pipe closed early is not "check failed" (1), and damage found is
still 1 when nobody reads the words; a result that could not be written for another reason (a full disk) is
exit 2 when it would have been 0. No traceback, no "internal error", in any case.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckpt_archive

torch = pytest.importorskip("torch")

F_SETPIPE_SZ = 1031  # Linux fcntl: the pipe's capacity


def _child_setup():
    # a shell's background job starts with SIGINT ignored and a child inherits that (tests/test_terminal.py)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _argv(*args) -> list[str]:
    return [sys.executable, "-m", "ckpt_archive", *map(str, args)]


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    """``good``: 40 usable generations (a long ``list``); ``bad``: generation 2 with a flipped member byte."""
    root = tmp_path_factory.mktemp("closed-out")
    good = root / "good"
    for i in range(40):
        ckpt_archive.pack({"w": torch.full((2,), float(i))}, good,
                          annotations=ckpt_archive.Annotations(tags=(f"nightly-{i}", "a-long-tag-" + "x" * 40)))
    bad = root / "bad"
    for i in range(2):
        ckpt_archive.pack({"w": torch.full((64,), float(i))}, bad)
    gen = bad / "generations" / "00000002"
    member = next(p for p in gen.iterdir() if p.name.startswith("tensors"))
    data = bytearray(member.read_bytes())
    data[-9] ^= 0xFF
    member.write_bytes(bytes(data))
    return {"good": good, "bad": bad}


def _with_stdout_closed(*args) -> subprocess.CompletedProcess:
    """``ckpt-archive ARGS >&-``."""
    return subprocess.run(["bash", "-c", 'exec "$@" >&-', "_", *_argv(*args)], capture_output=False,
                          stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=_child_setup)


def _reader_closes_early(*args, read: int = 1) -> tuple[int, str]:
    """``ckpt-archive ARGS | head -c READ``, the pipe only 4 KiB deep (a large output fills it): the reader takes
    ``read`` bytes and closes its end while the command still writes. Returns (exit code, stderr)."""
    proc = subprocess.Popen(_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_child_setup)
    try:
        fcntl.fcntl(proc.stdout.fileno(), F_SETPIPE_SZ, 4096)
    except OSError:
        pass
    if read:
        proc.stdout.read(read)
    proc.stdout.close()
    err = proc.stderr.read().decode("utf-8", "replace")
    return proc.wait(timeout=120), err


def _no_crash(stderr: str) -> None:
    assert "Traceback" not in stderr and "internal error" not in stderr and "Exception ignored" not in stderr, stderr


def test_list_json_with_stdout_closed_exits_0_without_a_traceback(repos):
    """Fault (break test): `list REPO --json >&-` printed a Python traceback (sys.stdout is None then)."""
    res = _with_stdout_closed("list", repos["good"], "--json")
    _no_crash(res.stderr)
    assert res.returncode == 0 and res.stderr == "", res.stderr  # --json: nothing on stderr


def test_verify_with_stdout_closed_exits_with_its_verdict_not_internal_error(repos):
    """Fault (break test): `verify REPO >&-` said "internal error" and exited 2 on a good generation."""
    good = _with_stdout_closed("verify", repos["good"])
    _no_crash(good.stderr)
    assert good.returncode == 0, good.stderr
    assert "stdout is closed" in good.stderr  # said, the verdict unchanged
    bad = _with_stdout_closed("verify", f"{repos['bad']}@2")
    _no_crash(bad.stderr)
    assert bad.returncode == 1, bad.stderr  # damage found is 1 whether or not anyone reads it


@pytest.mark.parametrize("read", [0, 1])
def test_a_reader_closing_the_pipe_early_never_changes_the_exit_code(repos, read):
    """Fault (break test): `verify REPO | head -1` sometimes exited 1 on a GOOD generation (rich's broken-pipe
    handler exits 1), which a watchdog with pipefail takes for damage. Every command's exit code is its verdict
    whatever the reader does: list (a long table, and --json), verify of a good generation (0) and of a damaged
    one (1), and the help."""
    cases = [(("list", repos["good"], "--all"), 0), (("list", repos["good"], "--json"), 0),
             (("verify", repos["good"]), 0), (("verify", f"{repos['bad']}@2"), 1), (("--help",), 0)]
    for args, want in cases:
        code, err = _reader_closes_early(*args, read=read)
        _no_crash(err)
        assert code == want, (args, code, err)


def test_a_result_that_cannot_be_written_is_exit_2_never_0(repos):
    """A full disk under a redirected stdout (ENOSPC): the reader has less than the whole result, so a command
    that would exit 0 exits 2 saying why (Python only noticed at its final flush, after the exit code was set);
    damage found stays 1."""
    with open("/dev/full", "w") as full:
        for args, want in ((("list", repos["good"], "--all"), 2), (("list", repos["good"], "--json"), 2),
                           (("verify", f"{repos['bad']}@2"), 1)):
            res = subprocess.run(_argv(*args), stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
            _no_crash(res.stderr)
            assert res.returncode == want, (args, res.returncode, res.stderr)
            assert "could not be written to stdout" in res.stderr, res.stderr


def test_a_ctrl_c_at_any_moment_of_the_start_is_the_interrupted_line_and_130(repos):
    """Fault (break test): a Ctrl-C in the CLI's first ~0.1 s (while Typer and the command are imported, before
    the command's own handler exists) showed a Python traceback. SIGINT at increasing delays after the start:
    each run either finishes cleanly or says it was interrupted and exits 130 (or, before Python installed its
    handler at all, dies of the signal, as the shell's 130), never a traceback. A SIGINT that lands while the
    interpreter itself still imports its ``site`` module (before any code of ours runs) is Python's own fatal
    start-up error: that sample says nothing about the CLI and is passed over."""
    seen = set()
    for delay in (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.7, 1.0):
        for args in (("list", repos["good"]), ("list", repos["good"], "--json")):
            proc = subprocess.Popen(_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=_child_setup)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
            if "init_import_site" in err:  # the interpreter's own start-up, before ckpt_archive was imported
                continue
            assert "Traceback" not in err, (delay, args, err)
            assert proc.returncode in (0, 130, -signal.SIGINT), (delay, args, proc.returncode, err)
            if proc.returncode == 130:
                assert "interrupted" in (err + out), (delay, args, err, out)
                if "--json" in args:
                    assert json.loads(out)["exit_code"] == 130 and err == "", (out, err)
            seen.add(proc.returncode)
    assert 130 in seen  # some SIGINT landed while the command was starting or running


def test_a_ctrl_c_during_the_imports_of_a_program_that_imports_the_cli_is_its_own(tmp_path):
    """The start-up answer is the CLI process's only: a program that imports ckpt_archive.cli.app (a test, a
    notebook) and is interrupted meanwhile gets its KeyboardInterrupt, not an exit."""
    code = ("import builtins, sys\n"
            "real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name == 'typer':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            "try:\n"
            "    import ckpt_archive.cli.app\n"
            "except KeyboardInterrupt:\n"
            "    print('caught by the program')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "caught by the program" in res.stdout, (res.stdout, res.stderr)
    as_cli = code.replace("import ckpt_archive.cli.app", "import runpy; runpy.run_module('ckpt_archive', "
                                                         "run_name='__main__', alter_sys=True)")
    res = subprocess.run([sys.executable, "-c", as_cli, "list", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 130 and "Traceback" not in res.stderr and "interrupted" in res.stderr, res.stderr
