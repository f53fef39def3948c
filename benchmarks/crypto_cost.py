"""What encryption costs (issue 28; ``run.py --crypto``): ``pack``, ``restore`` and ``verify --deep`` of the same
state into a plain and into an encrypted repository (``--key-file``), whole CLI processes, paired in the same
run (plain, encrypted, then encrypted, plain, ...), ``sync`` before each run.

Each side packs into a fresh repository of its own (``repository.json`` created outside the timing, so the
plain side does not pay for creating one while the encrypted side pays for its key derivation: both create
theirs first, and every timed encrypted process derives the data key from the key file, as a user's does).
Reported per operation: min / median / max wall seconds per side, the per-pair ratios encrypted / plain
(above 1: encryption costs that much), CPU seconds of the process tree, peak anonymous memory, and the
stored bytes of each repository.

Kept apart from run.py (which imports it for ``--crypto``) so each module stays near 600 lines.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
from pathlib import Path

import memwatch
from run import _cli, _stats, ensure_state

OPS = ("pack", "restore", "verify_deep")
SIDES = ("plain", "encrypted")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def run_crypto(size_mib: int, a: argparse.Namespace, log) -> dict:
    """Paired plain / encrypted runs of ``pack``, ``restore`` and ``verify --deep`` on the state of ``size_mib``.

    Returns:
        ``{"size_mib", "raw_bytes", "rows": [{"op", "wall_s": {side: [s]}, "cpu_s": {side: [s]},
        "peak_anon_mib": {side: MiB}, "ratios_encrypted_over_plain": [...], "loadavg": [min, med, max]}],
        "stored_bytes": {side: bytes}}``.
    """
    wd, meta = ensure_state(size_mib, a, log)
    pt = wd / "ckpt.pt"
    key = wd / "crypto-bench.key"
    if not key.exists():
        from ckpt_archive.format import crypto

        key.write_bytes(crypto.new_key_file_text())
        key.chmod(0o600)
    repos = {side: wd / f"repo_crypto_{side}" for side in SIDES}
    out = wd / "restored_crypto.pt"
    keyargs = {"plain": [], "encrypted": ["--key-file", str(key)]}
    env = dict(os.environ)
    env.pop("CKPT_ARCHIVE_KEY_FILE", None)

    def fresh(side: str) -> None:
        """An empty repository of this side (created untimed: init is not what is compared)."""
        shutil.rmtree(repos[side], ignore_errors=True)
        from ckpt_archive.repo.repository import Repository

        Repository.open(repos[side], create=True, key_file=str(key) if side == "encrypted" else False)

    def command(op: str, side: str) -> list[str]:
        repo = str(repos[side])
        if op == "pack":
            return _cli(["pack", str(pt), "--repo", repo, "--json", *keyargs[side]])
        if op == "restore":
            return _cli(["restore", repo, "--output", str(out), "--force", "--json", *keyargs[side]])
        return _cli(["verify", "--deep", repo, "--json", *keyargs[side]])

    def run(op: str, side: str) -> dict:
        if op == "pack":
            fresh(side)
        out.unlink(missing_ok=True)
        subprocess.run(["sync"], check=False)
        before = _children_cpu()
        r = memwatch.run_sampled(command(op, side), env=env, cwd=str(wd))
        cpu = _children_cpu() - before
        if r["rc"] != 0:
            raise SystemExit(f"{op} ({side}) failed: {(r['stderr'] or r['stdout']).strip()[-800:]}")
        return {"wall_s": r["wall_s"], "cpu_s": cpu, "peak_anon_bytes": r["peak_anon_bytes"]}

    for side in SIDES:  # each side needs its repository before the read comparisons
        run("pack", side)
    rows = []
    for op in OPS:
        runs: dict[str, list[dict]] = {s: [] for s in SIDES}
        loads = []
        for rep in range(a.reps):
            for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):  # A,B then B,A: neither always goes first
                loads.append(os.getloadavg()[0])
                runs[side].append(run(op, side))
        wall = {s: [r["wall_s"] for r in v] for s, v in runs.items()}
        cpu = {s: [r["cpu_s"] for r in v] for s, v in runs.items()}
        ratios = [e / p for p, e in zip(wall["plain"], wall["encrypted"])]
        cpu_ratios = [e / p for p, e in zip(cpu["plain"], cpu["encrypted"]) if p > 0]
        rows.append({"op": op, "wall_s": wall, "cpu_s": cpu, "ratios_encrypted_over_plain": ratios,
                     "cpu_ratios_encrypted_over_plain": cpu_ratios,
                     "peak_anon_mib": {s: max(r["peak_anon_bytes"] for r in v) / (1 << 20) for s, v in runs.items()},
                     "loadavg": [min(loads), statistics.median(loads), max(loads)]})
        log(f"[{size_mib} MiB] {op}: plain {_stats(wall['plain'])} s, encrypted {_stats(wall['encrypted'])} s, "
            f"encrypted/plain {_stats(ratios)} (CPU {_stats(cpu_ratios)}; load {_stats(loads)})")
    stored = {s: _dir_bytes(repos[s]) for s in SIDES}
    for side in SIDES:
        shutil.rmtree(repos[side], ignore_errors=True)
    out.unlink(missing_ok=True)
    return {"size_mib": size_mib, "raw_bytes": meta["raw_bytes"], "source_bytes": pt.stat().st_size,
            "rows": rows, "stored_bytes": stored}


def crypto_table(results: list[dict]) -> str:
    lines = ["| state | operation | plain s (min/med/max) | encrypted s (min/med/max) | encrypted / plain wall "
             "(min/med/max) | CPU encrypted / plain (med) | peak anon MiB plain / encrypted | load (min/med/max) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for res in results:
        for r in res["rows"]:
            cpu = statistics.median(r["cpu_ratios_encrypted_over_plain"]) if r["cpu_ratios_encrypted_over_plain"] else 0
            lines.append(f"| {res['size_mib']} MiB | `{r['op']}` | {_stats(r['wall_s']['plain'])} | "
                         f"{_stats(r['wall_s']['encrypted'])} | {_stats(r['ratios_encrypted_over_plain'])} | "
                         f"{cpu:.2f} | {r['peak_anon_mib']['plain']:.0f} / {r['peak_anon_mib']['encrypted']:.0f} | "
                         f"{_stats(r['loadavg'])} |")
        s = res["stored_bytes"]
        lines.append(f"| {res['size_mib']} MiB | stored bytes | {s['plain']:,} | {s['encrypted']:,} | "
                     f"{s['encrypted'] / s['plain']:.4f} | | | |")
    return "\n".join(lines)
