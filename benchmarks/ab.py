"""Paired A/B of two code trees (``run.py --ab TREE``): this checkout against another (e.g. a worktree
of main at the commit before a change), on the same state, interleaved A,B,B,A..., whole processes.

Kept apart from run.py (which imports it for ``--ab``) so each module stays near 600 lines.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
from pathlib import Path

import memwatch
from run import _cli, _py, _stats, ensure_state, stored_bytes


def run_ab(size_mib: int, a: argparse.Namespace, log) -> dict:
    """Paired A/B of two code trees: this one (``--this-tree``, default the repository this script is in)
    against ``--ab TREE`` (e.g. a worktree of main), same state, interleaved A,B,B,A..., whole processes.

    Operations (``--ab-ops``): ``pack`` (CLI, into a fresh repository each run), ``verify`` (CLI, shallow), ``load`` (Python worker,
    in-process time also kept), ``verify_deep`` (CLI) and ``restore`` (CLI, ``--force`` over a removed output, fsynced). Each tree reads the repository it packed itself.
    Ratios are the other tree's time / this tree's, per pair, then min/median/max (> 1: this tree faster).
    Also reports each tree's stored bytes and stored / ``zstd -3``, for the full state and the bf16 weights.
    """
    wd, meta = ensure_state(size_mib, a, log)
    trees = {"this": str(Path(a.this_tree).resolve()), "other": str(Path(a.ab).resolve())}
    envs = {k: {**os.environ, "PYTHONPATH": v} for k, v in trees.items()}
    pt, zst = wd / "ckpt.pt", wd / "ckpt.pt.zst"
    subprocess.run(["zstd", "-q", "-T0", "-3", "-f", str(pt), "-o", str(zst)], check=True)
    wpt, wzst = wd / "weights.pt", wd / "weights.pt.zst"
    subprocess.run(["zstd", "-q", "-T0", "-3", "-f", str(wpt), "-o", str(wzst)], check=True)
    repos = {k: wd / f"repo_ab_{k}" for k in trees}

    def run(op: str, side: str) -> dict:
        repo = repos[side]
        if op == "pack":
            shutil.rmtree(repo, ignore_errors=True)
            c, py = _cli(["pack", str(pt), "--repo", str(repo), "--json"]), False
        elif op == "verify":
            c, py = _cli(["verify", str(repo), "--json"]), False
        elif op == "verify_deep":
            c, py = _cli(["verify", "--deep", str(repo), "--json"]), False
        elif op == "restore":
            restored = wd / f"restored_ab_{side}.pt"
            restored.unlink(missing_ok=True)
            subprocess.run(["sync"], check=True)
            c, py = _cli(["restore", str(repo), "--output", str(restored), "--force", "--json"]), False
        else:
            c, py = _py(op, a, wd, repo), True
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = memwatch.run_sampled(c, env=envs[side], cwd=str(wd))  # cwd: `python -c` puts it first on sys.path
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if r["rc"] != 0:
            raise SystemExit(f"{op} ({side} tree) failed: {(r['stderr'] or r['stdout']).strip()[-800:]}")
        out = {"wall_s": r["wall_s"], "peak_anon_bytes": r["peak_anon_bytes"],
               "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}
        if op == "restore":
            (wd / f"restored_ab_{side}.pt").unlink(missing_ok=True)
        if py:
            out["seconds"] = json.loads(r["stdout"].strip().splitlines()[-1])["seconds"]
        return out

    for side in trees:  # every tree needs its own repository before the read comparisons
        run("pack", side)
    sizes = {side: stored_bytes(repos[side]) for side in trees}
    rows = []
    for op in [x for x in a.ab_ops.split(",") if x]:
        runs: dict[str, list[dict]] = {"this": [], "other": []}
        loads = []
        for rep in range(a.reps):
            for side in (("this", "other") if rep % 2 == 0 else ("other", "this")):
                loads.append(os.getloadavg()[0])
                runs[side].append(run(op, side))
        wall = {k: [r["wall_s"] for r in v] for k, v in runs.items()}
        ratios = [o / t for t, o in zip(wall["this"], wall["other"])]
        cpu = {k: [r["cpu_s"] for r in v] for k, v in runs.items()}
        row = {"op": op, "wall_s": wall, "ratios_other_over_this": ratios,
               "loadavg": [min(loads), statistics.median(loads), max(loads)], "cpu_s": cpu,
               "cpu_ratios_other_over_this": [o / t for t, o in zip(cpu["this"], cpu["other"])],
               "peak_anon_bytes": {k: [r["peak_anon_bytes"] for r in v] for k, v in runs.items()}}
        if "seconds" in runs["this"][0]:
            row["inprocess_s"] = {k: [r["seconds"] for r in v] for k, v in runs.items()}
            row["inprocess_ratios"] = [o / t for t, o in zip(row["inprocess_s"]["this"], row["inprocess_s"]["other"])]
        rows.append(row)
        log(f"[{size_mib} MiB] {op}: this {_stats(wall['this'])} s, other {_stats(wall['other'])} s, "
            f"other/this {_stats(ratios)}, CPU this {_stats(cpu['this'])} s, other {_stats(cpu['other'])} s, "
            f"other/this {_stats(row['cpu_ratios_other_over_this'])} (load {_stats(loads)})")
    wsizes = {}
    for side in trees:
        wrepo = wd / f"repo_ab_weights_{side}"
        shutil.rmtree(wrepo, ignore_errors=True)
        r = memwatch.run_sampled(_cli(["pack", str(wpt), "--repo", str(wrepo), "--json"]), env=envs[side], cwd=str(wd))
        if r["rc"] != 0:
            raise SystemExit(f"pack of the weights ({side} tree) failed")
        wsizes[side] = stored_bytes(wrepo)
        shutil.rmtree(wrepo, ignore_errors=True)
    for side in trees:
        shutil.rmtree(repos[side], ignore_errors=True)
    z3, wz3 = zst.stat().st_size, wzst.stat().st_size
    return {"size_mib": size_mib, "raw_bytes": meta["raw_bytes"], "trees": trees, "rows": rows,
            "stored": sizes, "zstd3": z3, "weights_stored": wsizes, "weights_zstd3": wz3,
            "stored_over_zstd3": {k: v / z3 for k, v in sizes.items()},
            "weights_stored_over_zstd3": {k: v / wz3 for k, v in wsizes.items()}}


def ab_table(results: list[dict]) -> str:
    lines = ["| state | operation | this tree min/med/max s | other tree min/med/max s | other / this (min/med/max) "
             "| load avg (min/med/max) |", "|---|---|---:|---:|---:|---|"]
    for res in results:
        for r in res["rows"]:
            extra = ""
            if "inprocess_ratios" in r:
                extra = f"; in-process {_stats(r['inprocess_ratios'])}"
            if "cpu_ratios_other_over_this" in r:
                extra += f"; CPU {_stats(r['cpu_ratios_other_over_this'])}"
            lines.append(f"| {res['size_mib']} MiB | `{r['op']}` | {_stats(r['wall_s']['this'])} | "
                         f"{_stats(r['wall_s']['other'])} | {_stats(r['ratios_other_over_this'])}{extra} | "
                         f"{_stats(r['loadavg'])} |")
        for key, label in (("stored_over_zstd3", "stored / `zstd -3`, fp32-heavy state"),
                           ("weights_stored_over_zstd3", "stored / `zstd -3`, bf16 weights")):
            v = res[key]
            lines.append(f"| {res['size_mib']} MiB | {label} | {v['this']:.4f} | {v['other']:.4f} | "
                         f"{v['this'] / v['other']:.4f} (this / other) | |")
    return "\n".join(lines)
