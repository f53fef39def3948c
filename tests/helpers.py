"""Shared test helpers: deep equality that distinguishes what the round-trip contract promises."""
from __future__ import annotations

import collections
import math


def assert_same(a, b, path="state"):
    """Equal in structure (dict vs OrderedDict vs list vs tuple, key order), types (int vs float vs bool,
    NumPy dtype), tensor dtype, shape, stride-independent bits."""
    import numpy as np
    import torch

    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        ac, bc = a.detach().contiguous(), b.detach().contiguous()
        if a.numel():
            if a.is_complex():
                ac, bc = torch.view_as_real(ac), torch.view_as_real(bc)
            assert torch.equal(ac.reshape(-1).view(torch.uint8), bc.reshape(-1).view(torch.uint8)), \
                f"{path}: bits differ"
        return
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: bytes differ"
        return
    if isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{path}: {a!r} != {b!r}"
        return
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path}: key type of {k!r}"
            assert_same(a[k], b[k], f"{path}[{k!r}]")
        if isinstance(a, collections.OrderedDict):
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}: _metadata"
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
        return
    if isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{path}: nan != {b!r}"
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


class Clock:
    """A settable clock for lease-lock tests: ``clock()`` is ``clock.t`` (seconds)."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def without_read_leases(monkeypatch) -> None:
    """Sources are read as where no Linux read lease can be had (NFS, a file open for writing elsewhere):
    never mapped, read with ``pread``, a change caught by the stat and ctime checks alone.

    For tests whose simulated trainer rewrites the source in pack's own thread: under a lease that write
    waits for the kernel's lease-break-time (45 s) before it proceeds, since the thread that would give
    the lease back is the one waiting (a trainer in another process waits only until pack notices)."""
    from ckpt_archive.format import read_lease

    monkeypatch.setattr(read_lease, "_F_SETLEASE", None)


def cli_in_process(*args) -> "subprocess.CompletedProcess":
    """``ckpt-archive ARGS`` run in this process (Typer's CliRunner), answered as ``subprocess.run`` would:
    ``returncode``, ``stdout``, ``stderr``.

    For tests about what a command says and does, not about the process (start-up, imports, signals,
    a new interpreter reading what another wrote): a subprocess costs 1.5-2 s of interpreter and torch start
    per call. An exception that escaped the command (which a user would see as a traceback) is raised here
    rather than turned into an exit code. Not covered here (the subprocess tests of tests/test_cli_startup.py and
    tests/test_terminal.py are): what ``main`` adds around the command -- ``--json`` usage errors as JSON, the
    exit code of a Ctrl-C after the command finished, the allocator settings, the frozen exit."""
    import subprocess

    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app_for

    argv = [str(a) for a in args]
    res = CliRunner().invoke(app_for(argv), argv)  # the app main() builds for this command line
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return subprocess.CompletedProcess(["ckpt-archive", *map(str, args)], res.exit_code, res.stdout, res.stderr)
