"""How long a Checkpointer.save blocks the training loop, against the bare host copy and a synchronous pack.

    python benchmarks/checkpointer.py --sizes 256,1024 --reps 5

Per size, one realistic state (benchmarks/state.py: bf16 weights, fp32 Adam moments, RNG, step) is built
once; then each repetition runs, paired and in a rotating order, in this process:

* ``copy_reused``: every tensor copied into buffers allocated beforehand (the memcpy floor; what the
  Checkpointer's steady state does);
* ``copy_fresh``: every tensor cloned into new memory (``{k: v.clone()}``, the bare host copy a user writes);
* ``save_blocked``: ``Checkpointer.save`` with nothing in flight: the time until it returns (the only
  time the loop loses); then ``to_usable``: until the background made the generation usable;
* ``pack``: ``ckpt_archive.pack`` of the same state, synchronously (what the loop would lose without it).

The first save of a Checkpointer allocates its buffers (page faults on a fresh process): it is shown
apart (``first_save_blocked``), from a fresh Checkpointer in each repetition. min / median / max are printed
with the load average before and after each repetition (other processes on a shared box show up there).
Targets (issue 16): median ``save_blocked`` <= 1.5 x ``copy_fresh`` and <= 0.2 x ``pack``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


def run_size(mib: int, reps: int, workdir: Path) -> dict:
    import torch

    import ckpt_archive
    from state import build_state

    state = build_state(mib << 20)
    tensors = _tensors(state, [])
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    reused = [torch.empty_like(t) for t in tensors]
    for dst, src in zip(reused, tensors):
        dst.copy_(src)  # fault the pages in once
    rows: dict[str, list[float]] = {k: [] for k in ("copy_reused", "copy_fresh", "first_save_blocked", "save_blocked",
                                                    "to_usable", "pack")}
    loads = []

    def copy_reused():
        t0 = time.perf_counter()
        for dst, src in zip(reused, tensors):
            dst.copy_(src)
        rows["copy_reused"].append(time.perf_counter() - t0)

    def copy_fresh():
        t0 = time.perf_counter()
        fresh = [t.clone() for t in tensors]
        rows["copy_fresh"].append(time.perf_counter() - t0)
        del fresh

    def checkpointer():
        repo = workdir / f"ckpt-{mib}"
        shutil.rmtree(repo, ignore_errors=True)
        ckpt = ckpt_archive.Checkpointer(repo, retention=ckpt_archive.RetentionPolicy(keep_last=1))
        h = ckpt.save(1, state)
        rows["first_save_blocked"].append(h.blocked_s)
        ckpt.wait()
        h = ckpt.save(2, state)
        rows["save_blocked"].append(h.blocked_s)
        t0 = time.perf_counter()
        ckpt.wait()
        rows["to_usable"].append(h.snapshot_s + time.perf_counter() - t0)
        ckpt.close()

    def pack():
        repo = workdir / f"pack-{mib}"
        shutil.rmtree(repo, ignore_errors=True)
        t0 = time.perf_counter()
        ckpt_archive.pack(state, repo)
        rows["pack"].append(time.perf_counter() - t0)

    ops = [copy_reused, copy_fresh, checkpointer, pack]
    for rep in range(reps):
        before = os.getloadavg()
        for op in ops[rep % len(ops):] + ops[:rep % len(ops)]:
            op()
        loads.append([round(before[0], 2), round(os.getloadavg()[0], 2)])
        print(f"  {mib} MiB rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in rows.items()),
              f"(load {loads[-1][0]} -> {loads[-1][1]})", flush=True)
    stats = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in rows.items()}
    med = {k: s["median"] for k, s in stats.items()}
    return {"mib": mib, "tensor_bytes": nbytes, "reps": reps, "seconds": rows, "stats": stats, "loadavg_1m": loads,
            "ratios": {"save_blocked/copy_fresh": med["save_blocked"] / med["copy_fresh"],
                       "save_blocked/copy_reused": med["save_blocked"] / med["copy_reused"],
                       "save_blocked/pack": med["save_blocked"] / med["pack"],
                       "first_save_blocked/pack": med["first_save_blocked"] / med["pack"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024", help="state sizes in MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="where repositories go (default: a temp dir on the same disk)")
    args = ap.parse_args()
    import torch

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg()}
    print(f"machine: {machine}", flush=True)
    results = [run_size(int(s), args.reps, workdir) for s in args.sizes.split(",")]
    print("\n| state | copy_reused | copy_fresh | save blocked (first save) | save blocked | to usable | pack | "
          "blocked / copy_fresh | blocked / pack |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["stats"]

        def f(k):
            return f"{s[k]['median']:.3f} ({s[k]['min']:.3f}-{s[k]['max']:.3f})"

        print(f"| {r['mib']} MiB ({r['tensor_bytes'] / 2**20:.0f} MiB tensors) | {f('copy_reused')} | {f('copy_fresh')} | "
              f"{f('first_save_blocked')} | {f('save_blocked')} | {f('to_usable')} | {f('pack')} | "
              f"{r['ratios']['save_blocked/copy_fresh']:.2f} | {r['ratios']['save_blocked/pack']:.3f} |")
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (out / f"checkpointer-{stamp}.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
