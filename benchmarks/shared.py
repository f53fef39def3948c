"""Shared objects (issue 15) on a generated LoRA-like state: storage over 10 generations, the second pack
of an unchanged state, and a fully changed state with and without sharing.

The state: a frozen bf16 base (``--base-mib``, default 1024 MiB, in 32 MiB matrices with trained-looking
values) plus, per base matrix, LoRA adapters A (r x d) and B (d x r) in fp32 and their Adam moments,
which change every step. Everything is saved with ``torch.save`` as a user's trainer would.

Measured, all in this one run and on this machine (its load swings, so every comparison is paired:
A,B then B,A, ``--reps`` times, whole ``ckpt-archive`` processes, start-up included; min/median/max):

1. storage: 10 generations packed one after another (adapter + moments changing, base frozen), the
   repository's bytes on disk against one generation stored without sharing plus 10x the changing
   part (target <= 1.1x);
2. second pack of an unchanged state (the same ``ckpt.pt`` packed into a repository that already holds
   it) against the first pack of it into an empty repository (target: >= 5x faster), and what the
   second pack wrote besides its manifest and marker;
3. a fully changed state (every tensor new) packed with sharing against ``--no-share`` into a repository
   holding the previous state (target: no slower, within noise).

Run: ``python benchmarks/shared.py --base-mib 1024 --reps 3``. Prints the table and writes
``benchmarks/results/shared-<utc-stamp>.json``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def build(base_mib: int, step: int, rank: int = 16, seed: int = 0) -> dict:
    """The LoRA-like state at ``step``: frozen base (same for every step) + adapters and Adam moments."""
    import torch

    d = 4096
    rows = (32 * MiB) // (2 * d)  # 32 MiB bf16 matrices
    n = max(1, base_mib // 32)
    g = torch.Generator().manual_seed(seed)
    model, adapters = {}, {}
    for i in range(n):
        w = (torch.randn(rows, d, generator=g) * 0.02).to(torch.bfloat16)
        model[f"layers.{i}.weight"] = w
    gs = torch.Generator().manual_seed(seed * 1000 + step + 1)
    opt_state = {}
    for i in range(n):
        a = torch.randn(rank, d, generator=gs) * 0.01
        b = torch.randn(rows, rank, generator=gs) * 0.01
        adapters[f"layers.{i}.lora_A"] = a
        adapters[f"layers.{i}.lora_B"] = b
        for j, t in enumerate((a, b)):
            opt_state[2 * i + j] = {"step": torch.tensor(float(step)), "exp_avg": torch.randn_like(t) * 1e-3,
                                    "exp_avg_sq": torch.rand_like(t) * 1e-6}
    return {"model": {**model, **adapters}, "optimizer": {"state": opt_state, "param_groups": [
        {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
         "params": list(range(2 * n))}]}, "step": step}


def save(base_mib: int, step: int, path: Path, *, all_new: bool = False) -> int:
    import torch

    state = build(base_mib, step, seed=step if all_new else 0)
    torch.save(state, path)
    return path.stat().st_size


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckpt_archive.cli.app", *args]


#: CPU seconds (user + system) of each process :func:`timed` ran, in order: under a swinging machine load
#: the CPU a command needs is steadier than its wall time, so both are reported.
CPU: list[float] = []


def timed(cmd: list[str]) -> float:
    import resource

    def children_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    c = children_cpu()
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t
    CPU.append(children_cpu() - c)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return dt


def stats(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def manifest(repo: Path, n: int) -> dict:
    return json.loads((repo / "generations" / f"{n:08d}" / "manifest.json").read_text())


def inprocess_worker(pt: str, repo_base: str, reps: int) -> None:
    """Time ``ckpt_archive.pack`` of a state already in memory: first into an empty repository, then the
    same state again (prints one JSON line)."""
    import torch

    import ckpt_archive

    state = torch.load(pt, weights_only=True)
    first, second = [], []
    for rep in range(reps):
        repo = Path(f"{repo_base}-{rep}")
        shutil.rmtree(repo, ignore_errors=True)
        t = time.perf_counter()
        ckpt_archive.pack(state, repo)
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        ckpt_archive.pack(state, repo)
        second.append(time.perf_counter() - t)
        shutil.rmtree(repo)
    print(json.dumps({"first_s": first, "second_s": second,
                      "speedup_median": statistics.median(first) / statistics.median(second)}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker-inprocess":
        inprocess_worker(argv[1], argv[2], int(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--generations", type=int, default=10)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ckpt-shared-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {"base_mib": a.base_mib, "reps": a.reps, "load_before": os.getloadavg()}
    try:
        # 1. storage over N generations -------------------------------------------------------------
        ckpts = []
        for s in range(1, a.generations + 1):
            p = work / f"step{s}.pt"
            save(a.base_mib, s, p)
            ckpts.append(p)
        flat = work / "flat"
        timed(cli("pack", str(ckpts[0]), "--repo", str(flat), "--no-share", "--quiet"))
        one_gen = manifest(flat, 1)["summary"]["stored_bytes"]
        shared = work / "shared"
        for p in ckpts:
            timed(cli("pack", str(p), "--repo", str(shared), "--quiet"))
        changing = [manifest(shared, n)["summary"].get("new_stored_bytes", 0) for n in range(2, a.generations + 1)]
        change = statistics.median(changing)
        total = du(shared)
        budget = one_gen + a.generations * change
        out["storage"] = {"one_generation_bytes": one_gen, "changing_part_bytes": change,
                          "repository_bytes": total, "budget_bytes": budget, "ratio": total / budget}
        for p in ckpts[2:]:
            p.unlink()
        shutil.rmtree(flat)

        # 2. second pack of an unchanged state vs the first pack -----------------------------------------
        first, second = [], []
        for rep in range(a.reps):
            order = ("first", "second") if rep % 2 == 0 else ("second", "first")
            for which in order:
                repo = work / f"r2-{rep}"
                if which == "first":
                    shutil.rmtree(repo, ignore_errors=True)
                    first.append(timed(cli("pack", str(ckpts[0]), "--repo", str(repo), "--quiet")))
                else:
                    if not (repo / "repository.json").exists():
                        timed(cli("pack", str(ckpts[0]), "--repo", str(repo), "--quiet"))
                    second.append(timed(cli("pack", str(ckpts[0]), "--repo", str(repo), "--quiet")))
            shutil.rmtree(work / f"r2-{rep}", ignore_errors=True)
        # the same in one process (the library / Checkpointer path: no interpreter start-up, no torch import,
        # no .pt to read and fingerprint), first and second pack alternating with fresh repositories
        worker = subprocess.run([sys.executable, __file__, "--worker-inprocess", str(ckpts[0]), str(work / "r2-in"),
                                 str(a.reps)], capture_output=True, text=True)
        if worker.returncode != 0:
            raise SystemExit(f"in-process worker failed:\n{worker.stderr[-2000:]}")
        inproc = json.loads(worker.stdout.strip().splitlines()[-1])
        repo = work / "r2-written"
        timed(cli("pack", str(ckpts[0]), "--repo", str(repo), "--quiet"))
        timed(cli("pack", str(ckpts[0]), "--repo", str(repo), "--quiet"))
        m2 = manifest(repo, 2)
        gen2 = repo / "generations" / "00000002"
        besides = sum(f.stat().st_size for f in gen2.iterdir() if f.name not in ("manifest.json", "USABLE.json"))
        out["second_pack"] = {"first_s": first, "second_s": second,
                              "speedup_median": statistics.median(first) / statistics.median(second),
                              "in_process": inproc,
                              "new_stored_bytes": m2["summary"].get("new_stored_bytes"),
                              "bytes_written_besides_manifest_and_marker": besides}
        shutil.rmtree(repo)

        # 3. fully changed state: sharing vs --no-share ------------------------------------------------
        new = work / "allnew.pt"
        save(a.base_mib, 2, new, all_new=True)
        with_share, without, cpu_share, cpu_without = [], [], [], []
        for rep in range(a.reps):
            order = ("share", "noshare") if rep % 2 == 0 else ("noshare", "share")
            for which in order:
                repo = work / f"r3-{which}"
                shutil.rmtree(repo, ignore_errors=True)
                extra = [] if which == "share" else ["--no-share"]
                timed(cli("pack", str(ckpts[0]), "--repo", str(repo), "--quiet", *extra))
                t = timed(cli("pack", str(new), "--repo", str(repo), "--quiet", *extra))
                (with_share if which == "share" else without).append(t)
                (cpu_share if which == "share" else cpu_without).append(CPU[-1])
                shutil.rmtree(repo)
        out["fully_changed"] = {"share_s": with_share, "no_share_s": without,
                                "ratio_median": statistics.median(with_share) / statistics.median(without),
                                "share_cpu_s": cpu_share, "no_share_cpu_s": cpu_without,
                                "cpu_ratio_median": statistics.median(cpu_share) / statistics.median(cpu_without)}
    finally:
        out["load_after"] = os.getloadavg()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    st, sp, fc = out["storage"], out["second_pack"], out["fully_changed"]
    lines = [
        f"LoRA-like state: base {a.base_mib} MiB bf16 (frozen), adapters + Adam moments changing; "
        f"load {out['load_before'][0]:.1f} -> {out['load_after'][0]:.1f}",
        "| measure | now | target |", "|---|---:|---:|",
        f"| {a.generations} generations / (one generation + {a.generations} x changing part) | "
        f"{st['ratio']:.3f} ({st['repository_bytes'] / MiB:.0f} MiB vs {st['budget_bytes'] / MiB:.0f} MiB) | <= 1.1 |",
        f"| first pack / second pack of an unchanged state (whole CLI processes, median) | "
        f"{sp['speedup_median']:.1f}x (first {stats(sp['first_s'])} s, second {stats(sp['second_s'])} s) | >= 5x |",
        f"| the same in one process (library / Checkpointer: no start-up, no .pt to read) | "
        f"{sp['in_process']['speedup_median']:.1f}x (first {stats(sp['in_process']['first_s'])} s, second "
        f"{stats(sp['in_process']['second_s'])} s) | >= 5x |",
        f"| second pack: bytes written besides manifest and marker | {sp['bytes_written_besides_manifest_and_marker']} "
        f"| small (state tree, tensors < 1 MiB) |",
        f"| fully changed state: pack with sharing / --no-share, wall (median) | {fc['ratio_median']:.3f} "
        f"(share {stats(fc['share_s'])} s, no-share {stats(fc['no_share_s'])} s) | <= 1.0 within noise |",
        f"| fully changed state: pack with sharing / --no-share, CPU (median) | {fc['cpu_ratio_median']:.3f} "
        f"(share {stats(fc['share_cpu_s'])} s, no-share {stats(fc['no_share_cpu_s'])} s) | <= 1.0 within noise |",
    ]
    print("\n".join(lines))
    res_dir = HERE / "results"
    res_dir.mkdir(exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (res_dir / f"shared-{stamp}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
