"""Run a command and sample the peak anonymous memory of its whole process tree.

Anonymous memory is ``RssAnon`` from ``/proc/<pid>/status`` summed over the process and all its
descendants (found by walking ``/proc/*/stat`` parent ids each sample, since this kernel may lack
``/proc/<pid>/task/*/children``). File-backed pages -- a memory-mapped ``.pt``, the page cache --
are ``RssFile`` and do not count: the kernel can drop them. Sampling every ``interval`` seconds can
miss a peak shorter than that; buffers that matter live for a whole chunk or longer.
"""
from __future__ import annotations

import os
import subprocess
import time


def _ppid_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: ppid is the 2nd field after the last ')'
        rest = data[data.rfind(b")") + 2:].split()
        try:
            children.setdefault(int(rest[1]), []).append(int(name))
        except (IndexError, ValueError):
            continue
    return children


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants alive now."""
    kids = _ppid_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def rss_anon(pid: int) -> int:
    """RssAnon of one process in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_sampled(cmd: list[str], *, interval: float = 0.02, env: dict | None = None,
                cwd: str | None = None, timeout: float = 3600) -> dict:
    """Run ``cmd``; return wall seconds, peak tree RssAnon (bytes), rc, stdout, stderr.

    Returns:
        ``{"wall_s": float, "peak_anon_bytes": int, "rc": int, "stdout": str, "stderr": str}``.
    """
    # children cache bytecode as a user's Python does: an environment that sets PYTHONDONTWRITEBYTECODE
    # (this project's dev box does) would make every run compile the package's sources again (~0.1 s)
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONDONTWRITEBYTECODE"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                            text=True)
    peak = 0
    # drain pipes in threads so a chatty child never blocks on a full pipe
    import threading

    bufs = {"out": [], "err": []}
    threads = [threading.Thread(target=lambda s=proc.stdout, k="out": bufs[k].append(s.read()), daemon=True),
               threading.Thread(target=lambda s=proc.stderr, k="err": bufs[k].append(s.read()), daemon=True)]
    for th in threads:
        th.start()
    while proc.poll() is None:
        total = sum(rss_anon(p) for p in tree_pids(proc.pid))
        peak = max(peak, total)
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            break
        time.sleep(interval)
    proc.wait()
    wall = time.perf_counter() - t0
    for th in threads:
        th.join()
    return {"wall_s": wall, "peak_anon_bytes": peak, "rc": proc.returncode,
            "stdout": "".join(bufs["out"]), "stderr": "".join(bufs["err"])}
