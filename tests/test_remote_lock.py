"""The writer lock of an s3:// repository lives in the repository (issue 28): two machines never both hold it.

Two "machines" are two processes with their own user cache (``XDG_CACHE_HOME``), so the per-machine OS lock
cannot serialise them and only the lease tickets in the bucket can; the S3 test server (moto on 127.0.0.1)
answers both. Before this lock, each machine took its own cache lock and both ran retention or gc at once.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from s3server import s3_env, s3_server, s3_url  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.slow

HOLDER = textwrap.dedent("""
    import json, os, socket, sys, time
    host = sys.argv[4]
    if host:
        socket.gethostname = lambda: host          # another machine, as far as the lock can tell
        real = os.uname()
        os.uname = lambda: type(real)((real.sysname, host) + tuple(real)[2:])  # (what host_name() reads)
    from ckpt_archive.repo.repository import Repository
    url, log, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    r = Repository.open(url, create=True)
    for i in range(rounds):
        with r.lock(wait=60):
            start = time.time()
            with open(log, "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "event": "held"}) + "\\n")
            time.sleep(float(os.environ.get("HOLD_S", "0.3")))
            end = time.time()
            with open(log, "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "start": start, "end": end}) + "\\n")
""")


def _machine(tmp_path: Path, name: str, env: dict, *args: str, hold: float = 0.3) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    e = {**os.environ, **env, "XDG_CACHE_HOME": str(tmp_path / f"cache-{name}"), "CKPT_ARCHIVE_LOCK_LEASE": "4",
         "HOLD_S": str(hold), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                               os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _intervals(log: Path) -> list[tuple[float, float, int]]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return sorted((r["start"], r["end"], r["pid"]) for r in rows if "start" in r)


def test_two_machines_never_hold_the_lock_of_one_s3_repository_at_once(tmp_path, s3_url, s3_env):
    log = tmp_path / "holds.jsonl"
    procs = [_machine(tmp_path, m, s3_env, s3_url, str(log), "4", "") for m in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    spans = _intervals(log)
    assert len(spans) == 8 and {pid for *_, pid in spans} == {p.pid for p in procs}
    for (s1, e1, p1), (s2, e2, p2) in zip(spans, spans[1:]):
        assert e1 <= s2, f"pid {p1} held until {e1} while pid {p2} took it at {s2}"


def test_a_holder_killed_mid_lease_on_another_machine_is_taken_over_once_its_lease_runs_out(tmp_path, s3_url,
                                                                                               s3_env):
    from ckpt_archive.errors import LockError
    from ckpt_archive.repo.repository import Repository

    log = tmp_path / "holds.jsonl"
    holder = _machine(tmp_path, "a", s3_env, s3_url, str(log), "1", "machine-a", hold=600)
    deadline = time.time() + 120
    while not (log.exists() and "held" in log.read_text()):
        assert holder.poll() is None and time.time() < deadline, holder.communicate()[1]
        time.sleep(0.1)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    killed_at = time.time()
    r = Repository.open(s3_url)
    with pytest.raises(LockError, match="machine-a"):  # its lease (4 s) still runs: another machine must wait
        with r.lock(wait=0):
            pass
    with r.lock(wait=30):
        taken = time.time()
        r.check_lock()
    assert taken - killed_at >= 3.0  # not before the lease ran out (a small allowance for clocks)


def test_concurrent_packs_prunes_and_gc_from_two_machines_leave_a_consistent_repository(tmp_path, s3_url, s3_env):
    """pack, prune and gc at once from two machines: every pack gets its own generation, retention and gc
    never run together, and what remains all verifies."""
    script = tmp_path / "work.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, ckpt_archive
        url, seed = sys.argv[1], int(sys.argv[2])
        for i in range(3):
            st = {"model": {"w": torch.full((64, 64), float(seed * 10 + i))}, "progress": {"step": seed * 10 + i}}
            ckpt_archive.pack(st, url, options=ckpt_archive.PackOptions(wait=120, share_min_bytes=1024))
            ckpt_archive.prune(url, ckpt_archive.RetentionPolicy(keep_last=4), wait=120)
            ckpt_archive.gc(url, wait=120)
    """))
    procs = []
    for m, seed in (("a", 1), ("b", 2)):
        e = {**os.environ, **s3_env, "XDG_CACHE_HOME": str(tmp_path / f"cache-{m}"),
             "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(script), s3_url, str(seed)], env=e,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    import ckpt_archive

    gens = ckpt_archive.list_generations(s3_url, all=True)
    assert [g.status for g in gens] == ["usable"] * 4
    for g in gens:
        assert ckpt_archive.verify(s3_url, str(g.number), options=ckpt_archive.VerifyOptions(deep=True)).ok
