"""How long a Checkpointer.save blocks the training loop, against a clone() of the same state, in whole processes.

    python benchmarks/checkpointer.py --sizes tiny,64,256 --reps 5

Per size and repetition, two fresh processes run, paired and in a rotating order (A,B then B,A), each
building the same state first (benchmarks/state.py: bf16 weights, fp32 Adam moments, RNG, step; ``tiny`` is
one 4x4 fp32 tensor, the case issue 29 reported 2.5-3.2 s for):

* ``clone`` (the baseline): every tensor of the state ``clone()``d, timed the first time in the process
  (fresh memory: page faults, as a first save's buffers) and a second time;
* ``checkpointer``: ``Checkpointer(...)`` built, then at once ``save`` (``first_save``: until it returns, the
  only time the loop loses; the background thread may still be importing the publish path then), the
  modules the caller's thread imported during that save (a ``sys.meta_path`` spy), the time until that
  generation is usable, a second ``save`` (``save``: buffers reused) and its time to usable, then in the
  same process a ``clone()`` of the state (``clone_warm``) and a synchronous ``ckpt_archive.pack``.

A process is the unit because a first save's cost is a process's: imports, first allocations. min / median /
max per figure, with the 1-minute load average before and after each repetition (other jobs on a shared box
show up there). Targets: issue 29, first save <= 2x a ``clone()`` of the state (``first_save`` / ``clone``);
issue 16, a later save <= 1.5x ``clone_warm`` and <= 0.2x ``pack``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _state(size: str):
    import torch

    if size == "tiny":
        return {"model": {"w": torch.randn(4, 4)}, "step": 1}
    from state import build_state  # benchmarks/ is on the child's path

    return build_state(int(size) << 20)


def _tensors(obj, out):
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def child(mode: str, size: str, workdir: Path) -> dict:
    """One measurement process (``--child``): prints a JSON object on stdout."""
    import threading

    import torch

    state = _state(size)
    tensors = _tensors(state, [])
    out: dict = {"tensor_bytes": sum(t.numel() * t.element_size() for t in tensors)}

    def clone_s() -> float:
        t0 = time.perf_counter()
        copies = [t.clone() for t in tensors]
        took = time.perf_counter() - t0
        del copies
        return took

    if mode == "clone":
        out["clone"] = clone_s()
        out["clone_again"] = clone_s()
        return out
    main = threading.main_thread()
    seen: list[str] = []
    recording = [False]

    class Spy:  # records every module the caller's thread imports while recording
        def find_spec(self, name, path=None, target=None):
            if recording[0] and threading.current_thread() is main:
                seen.append(name)
            return None

    sys.meta_path.insert(0, Spy())
    import ckpt_archive

    repo = workdir / "ckpt"
    shutil.rmtree(repo, ignore_errors=True)
    t0 = time.perf_counter()
    ckpt = ckpt_archive.Checkpointer(repo, retention=ckpt_archive.RetentionPolicy(keep_last=1))
    out["construct"] = time.perf_counter() - t0
    recording[0] = True
    h = ckpt.save(1, state)
    recording[0] = False
    out["first_save"] = h.blocked_s
    out["imported_in_caller"] = len(seen)
    t0 = time.perf_counter()
    ckpt.wait()
    out["first_to_usable"] = h.blocked_s + time.perf_counter() - t0
    h = ckpt.save(2, state)
    out["save"] = h.blocked_s
    t0 = time.perf_counter()
    ckpt.wait()
    out["to_usable"] = h.snapshot_s + time.perf_counter() - t0
    ckpt.close()
    out["clone_warm"] = clone_s()
    shutil.rmtree(workdir / "pack", ignore_errors=True)
    t0 = time.perf_counter()
    ckpt_archive.pack(state, workdir / "pack")
    out["pack"] = time.perf_counter() - t0
    out["torch"] = torch.__version__
    return out


def _run_child(mode: str, size: str, workdir: Path, tree: Path = ROOT) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", mode, "--size", size,
                           "--workdir", str(workdir)], capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {size} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_size(size: str, reps: int, workdir: Path, tree: Path = ROOT) -> dict:
    rows: dict[str, list] = {}
    loads = []
    modes = ["clone", "checkpointer"]
    for rep in range(reps):
        before = os.getloadavg()[0]
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            res = _run_child(mode, size, workdir, tree)
            for k, v in res.items():
                if isinstance(v, (int, float)):
                    rows.setdefault(k, []).append(v)
        loads.append([round(before, 2), round(os.getloadavg()[0], 2)])
        print(f"  {size} rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in rows.items()
                                                               if k != "tensor_bytes"),
              f"(load {loads[-1][0]} -> {loads[-1][1]})", flush=True)
    stats = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in rows.items()}
    med = {k: s["median"] for k, s in stats.items()}
    return {"size": size, "tensor_bytes": rows["tensor_bytes"][0], "reps": reps, "values": rows, "stats": stats,
            "loadavg_1m": loads,
            "ratios": {"first_save/clone": med["first_save"] / med["clone"],
                       "save/clone_warm": med["save"] / med["clone_warm"],
                       "save/pack": med["save"] / med["pack"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,64,256", help="state sizes in MiB (or 'tiny'), comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="where repositories go (default: a temp dir on the same disk)")
    ap.add_argument("--tree", default=str(ROOT), help="the ckpt_archive checkout to measure (default: this one), "
                    "e.g. an older commit's, for a before/after")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(child(args.child, args.size, workdir)))
        return
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "loadavg": os.getloadavg()}
    print(f"machine: {machine}", flush=True)
    machine["tree"] = args.tree
    results = [run_size(s.strip(), args.reps, workdir / s.strip(), Path(args.tree)) for s in args.sizes.split(",")]

    def f(s, k, digits=4):
        return f"{s[k]['median']:.{digits}f} ({s[k]['min']:.{digits}f}-{s[k]['max']:.{digits}f})"

    print("\n| state | clone (fresh process) | first save blocked | first save / clone | modules imported by "
          "the caller | clone (warm) | later save blocked | later save / clone | to usable | pack |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["stats"]
        label = "4x4 fp32" if r["size"] == "tiny" else f"{r['size']} MiB"
        print(f"| {label} ({r['tensor_bytes']:,} B), {r['reps']} reps | {f(s, 'clone')} | {f(s, 'first_save')} | "
              f"{r['ratios']['first_save/clone']:.2f} | {int(s['imported_in_caller']['max'])} | "
              f"{f(s, 'clone_warm')} | {f(s, 'save')} | {r['ratios']['save/clone_warm']:.2f} | "
              f"{f(s, 'to_usable', 2)} | {f(s, 'pack', 2)} |")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out / f"checkpointer-{stamp}.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
