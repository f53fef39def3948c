"""Issue 29, start-up: what the CLI does before a command runs, without timing anything.

``main`` builds only the command its command line names (:func:`ckpt_archive.cli.app.app_for`), and the
values Typer would pass through unchanged are given without Typer's Pydantic conversion
(``_PlainCoercion``). These tests guard that neither changes what a command receives or prints. The import
budget of a whole run (no torch, NumPy, jsonschema, Pydantic) is guarded in tests/test_torch_free.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from ckpt_archive.cli import app as app_module
from ckpt_archive.cli.app import COMMAND_NAMES, app, app_for, build_app
from ckpt_archive.cli.commands import COMMAND_MODULES


def _names(a: typer.Typer) -> set[str]:
    return {c.name for c in a.registered_commands} | {g.name for g in a.registered_groups}


def test_each_command_module_registers_the_command_named_after_it():
    """Guards against ``app_for`` building the wrong command (or none) for a command line: the name -> module
    map is derived from the module names, so a module that registers another name must fail here."""
    assert set(COMMAND_NAMES.values()) == set(COMMAND_MODULES)
    for name, module in COMMAND_NAMES.items():
        assert _names(build_app((module,))) == {name}, module
    assert _names(app) == set(COMMAND_NAMES)


def test_a_command_line_builds_only_its_command_and_anything_else_builds_all():
    assert _names(app_for(["list", "REPO"])) == {"list"}
    assert _names(app_for(["check-resume", "--help"])) == {"check-resume"}
    for args in ([], ["--help"], ["--version"], ["lsit", "REPO"], ["check_resume"]):
        assert app_for(args) is app, args


@pytest.mark.parametrize("name", sorted(COMMAND_NAMES))
def test_a_command_built_alone_has_the_help_it_has_among_all(name):
    """Guards against a command's ``--help`` (usage line, options, metavars, exit codes) changing when only
    that command is built, as ``main`` builds it."""
    runner = CliRunner()
    alone = runner.invoke(app_for([name]), [name, "--help"], env={"COLUMNS": "100"})
    among_all = runner.invoke(app, [name, "--help"], env={"COLUMNS": "100"})
    assert alone.exit_code == among_all.exit_code == 0
    assert alone.output == among_all.output
    assert f"ckpt-archive {name}" in alone.output


def _typer_params():
    """Every parameter of every command (and sub-command) as Typer builds it: ``(command path, parameter)``."""
    def walk(cmd, path):
        for p in cmd.params:
            yield path, p
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {sub_name}")

    return list(walk(typer.main.get_command(app), "ckpt-archive"))


def test_values_given_without_pydantic_are_the_values_typer_gives():
    """Guards against a command receiving another value than Typer's own conversion gives: for every parameter
    of every command, an absent value (None) and a text value are converted by ``_PlainCoercion`` and by
    Typer's Pydantic adapter, and must come out equal, of the same type (or fail alike)."""
    ctx = typer.Context(typer.main.get_command(app))
    checked = 0
    for path, p in _typer_params():
        if not hasattr(p, "get_runtime_param"):
            pytest.skip("this Typer converts without Pydantic (before 0.26)")
        annotation = p.type_descriptor.annotation
        for value in (None, "x\udcff y", "7"):
            fast = app_module._PlainCoercion(annotation)
            outcomes = []
            for conv in ("fast", "typer"):
                p._runtime_param = fast if conv == "fast" else None
                try:
                    outcomes.append(("ok", p.get_runtime_param().coerce(value, param=p, ctx=ctx)))
                except Exception as exc:  # noqa: BLE001 - Typer's BadParameter and kin: compared, not judged
                    outcomes.append(("error", type(exc).__name__, str(exc)))
            got, want = outcomes
            assert got == want and type(got[-1]) is type(want[-1]), (path, p.name, value, got, want)
            checked += 1
    assert checked > 100


def test_a_value_typer_must_convert_is_still_converted_and_checked(monkeypatch):
    """Guards against ``_PlainCoercion`` passing a value through that Typer converts or refuses: a number
    option given text is refused with Typer's message (exit 2); numbers, paths and repeated options reach the
    command exactly as Typer alone gives them (the same command with the plain coercion switched off)."""
    install = app_module._coerce_plain_values_without_pydantic

    def run_with(args: list[str], plain: bool):
        monkeypatch.setattr(app_module, "_coerce_plain_values_without_pydantic", install if plain else (lambda p: None))
        seen = {}
        probe = typer.Typer()

        @probe.command(cls=app_module._Command)
        def run(n: int = typer.Option(None, "--n"), p: Optional[Path] = typer.Option(None, "--p"),
                s: str = typer.Option("dflt", "--s"), q: Optional[List[Path]] = typer.Option(None, "--q")) -> None:
            seen.update(n=n, p=p, s=s, q=q)

        result = CliRunner().invoke(probe, args)
        return result.exit_code, result.output, {k: (type(v), v) for k, v in seen.items()}

    for args in (["--n", "x"], ["--n", "3", "--p", "a/b", "--s", "t", "--q", "c", "--q", "d"], [], ["--s", ""]):
        assert run_with(args, plain=True) == run_with(args, plain=False), args
    code, output, _ = run_with(["--n", "x"], plain=True)
    assert code == 2 and "--n" in output


def test_commands_with_a_frozen_exit_leave_what_they_write_whole(tmp_path):
    """``main`` leaves the objects of ``verify``/``list``/``status``/``inspect``/``restore`` out of the exit's
    garbage collections (gc.freeze: 20-30 ms of a 0.3 s verify, 0.9 s after a 288 MiB restore said it was
    done). What they write -- the failed-check note a verify that finds damage records, a restore's output --
    must be complete on disk once the process has exited: this fails if a command joins READ_ONLY_COMMANDS
    with a file left for the collector to flush."""
    import json
    import os
    import subprocess
    import sys

    import torch

    import ckpt_archive
    from ckpt_archive.cli.common import READ_ONLY_COMMANDS

    assert READ_ONLY_COMMANDS <= set(COMMAND_NAMES)
    repo = tmp_path / "repo"
    state = {"model": {"w": torch.arange(4096.0)}, "step": 1}
    ckpt_archive.pack(state, repo)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = tmp_path / "out.pt"
    proc = subprocess.run([sys.executable, "-m", "ckpt_archive", "restore", str(repo), "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["step"] == 1
    gen = next((repo / "generations").iterdir())
    member = max((p for p in gen.rglob("*") if p.is_file() and p.name.startswith("tensors")),
                 key=lambda p: p.stat().st_size)
    data = bytearray(member.read_bytes())
    data[len(data) // 2] ^= 0xFF
    member.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "ckpt_archive", "verify", str(repo)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    note = json.loads((gen / "CHECK-FAILED.json").read_text())  # whole JSON: written and closed before exit
    assert note["by"] == "verify", note
    for cmd in sorted(READ_ONLY_COMMANDS - {"verify", "restore"}):
        proc = subprocess.run([sys.executable, "-m", "ckpt_archive", cmd, str(repo)], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, (cmd, proc.stderr[-2000:])


def _numpy_threads(env_extra: dict) -> int:
    """Threads of a fresh interpreter after the CLI's start-up settings and ``import numpy``."""
    import os
    import subprocess
    import sys

    code = ("import os; from ckpt_archive.cli.app import quiet_blas_threads; quiet_blas_threads(); import numpy; "
            "print(len(os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="threads counted in /proc")
def test_numpy_starts_no_blas_threads_in_the_cli_unless_the_user_asked_for_them():
    """Fault (issue 29, perf of verify --deep): NumPy's OpenBLAS started a thread per core at import, each
    spinning before it slept: 70-100 ms of CPU at every import of NumPy, for a tool that does no linear algebra.
    The CLI's process now asks for one thread (none started beside the main one); a thread count the user set is
    left as it is."""
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: OpenBLAS starts no extra thread anyway")
    quiet = _numpy_threads({})
    assert quiet == 1, quiet
    assert _numpy_threads({"OPENBLAS_NUM_THREADS": "2"}) > quiet


def test_the_users_runs_do_not_inherit_the_clis_blas_setting(monkeypatch):
    """check-resume starts the user's training runs: they get the environment the user gave, not the thread count
    the CLI set for itself (a BLAS thread count can change a float reduction's order)."""
    from ckpt_archive.resume.check import _run_environment

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv(app_module.BLAS_MARK, raising=False)
    monkeypatch.delitem(__import__("sys").modules, "numpy", raising=False)
    assert app_module.quiet_blas_threads() is True
    env = _run_environment(None)
    assert "OPENBLAS_NUM_THREADS" not in env and app_module.BLAS_MARK not in env
    monkeypatch.delenv(app_module.BLAS_MARK)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")  # the user's own setting goes through
    assert app_module.quiet_blas_threads() is False
    assert _run_environment(None)["OPENBLAS_NUM_THREADS"] == "4"
