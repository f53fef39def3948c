"""[break] A source file truncated by another process while pack reads it.

pack maps ``torch.save`` files (format/pt_pickle.py, ``torch.load(mmap=True)``); a page of a mapped file
that a truncation removed is answered with SIGBUS: the process died (exit -7) with no message and left
its partial generation. Now a map is made only under a read lease (format/read_lease.py) -- the truncation
waits until pack lets go, and pack, seeing the lease broken, stops with exit 2 naming the file -- and
without a lease the bytes are read with pread, where the shrunk file is a short read, the same refusal.

Each test runs the CLI in a child process (a SIGBUS must not take pytest down with it) whose writer,
at its first entry, has another process truncate the source and gives it a second to do so.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="leases and SIGBUS as Linux has them")

_DRIVER = textwrap.dedent("""
    import os, subprocess, sys, time
    from ckpt_archive.repo import writer
    src, mode = sys.argv[1], sys.argv[2]
    held = open(src, "r+b") if mode == "open-for-write" else None  # no lease can be had: pread instead
    real, fired = writer._entry_fp, []

    def truncate_then(*a, **kw):
        if not fired:
            fired.append(1)
            if held is not None:
                held.truncate(0)
                held.flush()
            else:
                child = subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({src!r}, 0)"])
                print(f"TRUNCATOR {child.pid}", file=sys.stderr, flush=True)
                time.sleep(1.0)  # done by now unless something (a lease) holds it back
        return real(*a, **kw)

    writer._entry_fp = truncate_then
    from ckpt_archive.cli.app import main
    sys.argv = ["ckpt-archive", "pack", src, "--repo", sys.argv[3]]
    main()
""")


def _source(path: Path, parameter: bool = False) -> Path:
    """Eight tensors of 4 MiB: entries enough that the writer takes bytes after the truncation."""
    g = torch.Generator().manual_seed(0)
    make = (lambda t: torch.nn.Parameter(t, requires_grad=False)) if parameter else (lambda t: t)
    torch.save({f"w{i}": make(torch.randn(1 << 20, generator=g)) for i in range(8)}, path)
    return path


def _pack_while_truncated(tmp_path: Path, src: Path, mode: str) -> subprocess.CompletedProcess:
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, str(driver), str(src), mode, str(tmp_path / "r")],
                         capture_output=True, text=True, env=env, timeout=300)
    return res


def _nothing_usable(repo: Path) -> None:
    gens = repo / "generations"
    left = sorted(p.name for p in gens.iterdir()) if gens.exists() else []
    assert not left, f"a generation or its staging was left behind: {left}"


@pytest.mark.parametrize("parameter", [False, True], ids=["read-without-torch", "torch.load-mmap"])
def test_a_source_truncated_while_mapped_is_refused_with_exit_2_not_sigbus(tmp_path, parameter):
    """Fault: another process truncates the source while pack maps it; the next read of a vanished page
    killed pack with SIGBUS (exit -7, no message, the partial generation left). Now the truncation waits for
    pack's read lease, pack notices it at the next entry and refuses naming the file (exit 2), nothing is
    kept, and the truncation then goes ahead."""
    src = _source(tmp_path / "ck.pt", parameter=parameter)
    res = _pack_while_truncated(tmp_path, src, "other-process")
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "changed while it was being" in res.stderr and str(src) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    _nothing_usable(tmp_path / "r")
    # the truncation was held back, not lost: it happens once pack let go of the file
    pid = int(res.stderr.split("TRUNCATOR ")[1].split()[0])
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists() or src.stat().st_size == 0:
            break
        time.sleep(0.1)
    assert src.stat().st_size == 0


def test_a_source_truncated_where_no_lease_can_be_had_is_read_not_mapped(tmp_path):
    """Fault: the same truncation where no lease is granted (the file is open for writing elsewhere, as
    when its writer truncates it through its own descriptor): the map's SIGBUS again. Without a lease the
    bytes are read with pread; the short read is the same refusal (exit 2, the file named, nothing kept)."""
    src = _source(tmp_path / "ck.pt")
    res = _pack_while_truncated(tmp_path, src, "open-for-write")
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "changed while it was being" in res.stderr and str(src) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    _nothing_usable(tmp_path / "r")


def test_a_lease_is_broken_by_a_truncation_and_released_with_the_map(tmp_path):
    """Fault: the lease ends before the map does (closed with its descriptor while a view of the file is
    still read), so a truncation goes ahead under a live map: SIGBUS again. The lease goes with the map."""
    from ckpt_archive.format.pt_pickle import PtFile

    src = _source(tmp_path / "ck.pt")
    f = PtFile(src)
    if not f.lease.held:
        pytest.skip("this file system grants no read lease")
    view = f.view(0, 1 << 20)
    f.lease.close()  # the descriptor goes; the map (and the view) stay
    child = subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({str(src)!r}, 0)"])
    time.sleep(0.5)
    assert child.poll() is None, "the truncation went ahead while the file was still mapped"
    assert int(view[-1]) == int(view[-1])  # the page is still there to read
    del view, f
    child.wait(timeout=60)
    assert src.stat().st_size == 0


@pytest.mark.parametrize("parameter", [False, True], ids=["read-without-torch", "torch.load-mmap"])
def test_a_pack_in_a_training_process_lets_go_of_its_source_when_it_returns(tmp_path, parameter):
    """The lease's own risk: held past the pack (a map kept alive), it would make the trainer's next save
    over the same file wait up to the kernel's lease-break-time (45 s). Once pack returns it is gone."""
    import ckpt_archive
    from ckpt_archive.format import read_lease

    src = _source(tmp_path / "ck.pt", parameter=parameter)
    assert ckpt_archive.pack(str(src), tmp_path / "r").status == "usable"
    assert not list(read_lease._ACTIVE)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import os; os.truncate({str(src)!r}, 0)"], timeout=60, check=True)
    assert time.monotonic() - t0 < 10, "the trainer's rewrite of the packed file waited for pack's lease"


def test_a_safetensors_source_without_a_lease_is_read_not_mapped_and_loads_the_same(tmp_path):
    """safe_open maps the file too: without a lease (here: the file is open for writing elsewhere) its bytes
    are read instead -- the same tensors, in the file's order, and the same header metadata."""
    from safetensors.torch import save_file

    from ckpt_archive.sources.files import load_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"z": torch.randn(300, generator=g), "a": torch.arange(7, dtype=torch.int16),
               "m": torch.randn(3, 4, generator=g).to(torch.bfloat16)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    mapped, meta = load_safetensors(path)
    with open(path, "r+b"):  # a writer holds it open: no read lease can be had
        read, meta_read = load_safetensors(path)
    assert list(read) == list(mapped) and meta_read == meta == {"format": "pt", "note": "x"}
    for k in mapped:
        assert torch.equal(read[k], mapped[k]) and read[k].dtype == mapped[k].dtype


def test_a_map_kept_alive_by_a_cycle_does_not_hold_the_lease_past_its_scope(tmp_path):
    """Fault: the lease lived as long as the last map made from it; a map in a reference cycle (freed only
    when the garbage collector runs) held it on after pack returned, and a trainer's next save over the file
    waited up to 45 s (seen: 46 s). lease_scope gives every lease taken inside it back when it ends."""
    import gc

    from ckpt_archive.format.pt_pickle import PtFile
    from ckpt_archive.format.read_lease import lease_scope

    src = _source(tmp_path / "ck.pt")
    gc.disable()
    try:
        with lease_scope():
            f = PtFile(src)
            if not f.lease.held:
                pytest.skip("this file system grants no read lease")
            cycle = {"file": f, "view": f.view(0, 1 << 20)}
            cycle["self"] = cycle
            del f, cycle
        assert _truncation_seconds(src) < 10, "a truncation waited for a lease its scope had ended"
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.parametrize("parameter", [False, True], ids=["read-without-torch", "torch.load-mmap"])
def test_pack_gives_its_leases_back_with_the_garbage_collector_off(tmp_path, parameter):
    """The same fault through pack itself: with the collector off, whatever of pack's source reading ends in
    a cycle stays; the trainer's rewrite of the file must still not wait for it."""
    import gc

    import ckpt_archive

    src = _source(tmp_path / "ck.pt", parameter=parameter)
    gc.disable()
    try:
        assert ckpt_archive.pack(str(src), tmp_path / "r").status == "usable"
        assert _truncation_seconds(src) < 10, "the trainer's rewrite of the packed file waited for pack's lease"
    finally:
        gc.enable()
        gc.collect()


def _truncation_seconds(src: Path) -> float:
    """How long another process's truncation of ``src`` waited (a lease still held makes it wait ~45 s)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import os; os.truncate({str(src)!r}, 0)"], timeout=60, check=True)
    return time.monotonic() - t0
