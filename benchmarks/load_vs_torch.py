"""``ckpt_archive.load`` against ``torch.load(weights_only=True)`` of the same state, and this tree's load
against another tree's (issue 29), in one run: rounds of three whole processes in a rotating order (torch,
this, other; then this, other, torch; ...), each run.py's Python worker (imports excluded from the timing on
both sides), ``sync`` before none (the files stay in the page cache: both sides read cached bytes).

Per side: min / median / max of the in-process seconds of the call and of its CPU seconds (user + sys, all
threads), whole-process wall seconds; ratios per round (torch / ours, other / this), then their median.

Run: ``python benchmarks/load_vs_torch.py --workdir W --size-mib 1024 --repo REPO --other TREE --reps 5``
(``W/<size>mib/ckpt.pt`` is the state, as run.py caches it; REPO a repository of it packed by either tree).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memwatch  # noqa: E402
from run import _py, _stats  # noqa: E402


def rounds(a: argparse.Namespace, log) -> dict:
    wd = Path(a.workdir) / f"{a.size_mib}mib"
    this = str(Path(a.this_tree).resolve())
    trees = {"torch.load": this, "this": this}
    if a.other:
        trees["other"] = str(Path(a.other).resolve())
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    loads = []
    for rep in range(a.reps):
        names = list(trees)
        for side in names[rep % len(names):] + names[:rep % len(names)]:
            op = "torch_load" if side == "torch.load" else "load"
            loads.append(os.getloadavg()[0])
            r = memwatch.run_sampled(_py(op, a, wd, Path(a.repo)), env={**os.environ, "PYTHONPATH": trees[side]},
                                     cwd=str(wd))
            if r["rc"] != 0:
                raise SystemExit(f"{side} failed: {(r['stderr'] or r['stdout']).strip()[-800:]}")
            info = json.loads(r["stdout"].strip().splitlines()[-1])
            runs[side].append({"wall_s": r["wall_s"], "seconds": info["seconds"], "cpu_s": info.get("cpu_s"),
                               "peak_anon_mib": r["peak_anon_bytes"] / (1 << 20), "loadavg": loads[-1]})
            log(f"  round {rep + 1} {side:10s} {info['seconds']:.2f} s in-process, cpu {info.get('cpu_s', 0):.2f} s "
                f"(load {loads[-1]:.1f})")
    col = {k: {f: [r[f] for r in v] for f in ("wall_s", "seconds", "cpu_s")} for k, v in runs.items()}
    ratio = {"torch_over_this_inprocess": [t / o for o, t in zip(col["this"]["seconds"], col["torch.load"]["seconds"])],
             "torch_over_this_wall": [t / o for o, t in zip(col["this"]["wall_s"], col["torch.load"]["wall_s"])],
             "torch_over_this_cpu": [t / o for o, t in zip(col["this"]["cpu_s"], col["torch.load"]["cpu_s"])]}
    if "other" in col:
        ratio["torch_over_other_inprocess"] = [t / o for o, t in zip(col["other"]["seconds"], col["torch.load"]["seconds"])]
        ratio["other_over_this_inprocess"] = [o / t for t, o in zip(col["this"]["seconds"], col["other"]["seconds"])]
        ratio["other_over_this_cpu"] = [o / t for t, o in zip(col["this"]["cpu_s"], col["other"]["cpu_s"])]
    return {"trees": trees, "runs": runs, "columns": col, "ratios": ratio,
            "loadavg": [min(loads), statistics.median(loads), max(loads)]}


def table(doc: dict) -> str:
    lines = ["| side | in-process s (min/med/max) | CPU s | whole process s |", "|---|---:|---:|---:|"]
    for k, c in doc["columns"].items():
        lines.append(f"| {k} | {_stats(c['seconds'])} | {_stats(c['cpu_s'])} | {_stats(c['wall_s'])} |")
    lines.append("")
    lines += [f"- {k}: {_stats(v)} (median of rounds {statistics.median(v):.2f}x)" for k, v in doc["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, help="run.py's scratch folder (the state is <size>mib/ckpt.pt)")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repo", required=True, help="a repository of that state")
    ap.add_argument("--this-tree", default=str(HERE.parent))
    ap.add_argument("--other", default=None, help="another code tree (e.g. main, unpacked)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=0, help="(run.py's worker flag; load uses its default)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    doc = rounds(a, log)
    doc["stamp"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    doc["cpus"] = len(os.sched_getaffinity(0))
    out = Path(a.out) if a.out else HERE / "results" / f"{doc['stamp']}-load-vs-torch.json"
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
