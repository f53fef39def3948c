"""Ratio benchmark: ckpt-archive against its peers and the usual loaders, same machine, same run.

Default mode (issue 29, :mod:`peers`): ckpt-archive against **restic** (repository v2, ``--compression
auto``) and **borg** (``--compression zstd,3``), the tools a user would run instead of us to keep a
checkpoint safe, where they are installed (a missing one is named in the table): pack vs backup/create,
restore vs restore/extract (+ fsync), ``verify --deep`` vs ``check --read-data`` / ``--verify-data``, stored
bytes, the LoRA-like incremental run, an incompressible fp32 state, ``load`` vs ``torch.load``, our peak
anonymous memory, a small repository's CLI start-up. Rounds of whole processes in a rotating order, ``sync``
before each run; min / median / max per side and the median per-round ratio (wall and CPU). Quick run:
``python benchmarks/run.py --sizes 64 --rand-sizes 64 --lora-base-mib 64 --lora-generations 3 --reps 2``.

``--vs-hand``: issue 14's paired table -- every comparison interleaved in this one driver process (ours,
baseline, then baseline, ours, ... ``--reps`` times) against the hand pipeline (``zstd && openssl``) --
each run a whole process (``ckpt-archive`` CLI processes for pack / verify / verify --deep / restore:
start-up included, as a user pays it), Python workers also reporting the in-process time of the call
alone. It prints min / median / max per side, the median of per-pair ratios (whole process and
in-process), the load average (``os.getloadavg``) around the runs, and the table "now vs target".
``--unpaired`` gives the older per-operation report described below.

For each state size it builds a realistic training state (``benchmarks/state.py``: trained-looking
bf16 weights + fp32 Adam moments, 80 % of the bytes fp32) saved as ``ckpt.pt``, the same tensors as
``ckpt.safetensors``, and the bf16 weights alone as ``weights.pt``. Then, ``--reps`` times, each
operation runs in its own subprocess while :mod:`memwatch` samples the peak anonymous memory
(RssAnon summed over the process tree; mapped file pages do not count):

baselines
  ``hand``            ``zstd -q -T0 -3 ckpt.pt && openssl dgst -sha256 ckpt.pt.zst`` (verifies nothing)
  ``hand_deep``       ``zstd -t ckpt.pt.zst && openssl dgst -sha256 ckpt.pt.zst``
  ``openssl_ours``    ``openssl dgst -sha256`` over our generation's stored files (members and shared objects)
  ``torch_load``      ``torch.load(ckpt.pt, weights_only=True)``
  ``safetensors_load`` ``safetensors.torch.load_file(ckpt.safetensors)``
  ``zipnn``           ZipNN compress of every tensor (threads = jobs), if installed
ours
  ``pack``            ``ckpt_archive.pack(ckpt.pt, repo, PackOptions(jobs=N))`` incl. verify + trial reload + publish
  ``verify`` / ``verify_deep`` / ``restore`` (to a ``.pt``) / ``load`` (to memory)

Times: medians over reps; Python operations time only the operation itself (interpreter start and
imports excluded), shell baselines time the whole command. Throughput is raw tensor bytes per
second. Everything runs with a warm page cache (inputs were just written or read).

Run: ``python benchmarks/run.py --sizes 256,1024 --reps 3`` (``--help`` for more). Prints the ratio
table and writes ``benchmarks/results/<utc-stamp>.json``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memwatch  # noqa: E402

MiB = 1 << 20


# --------------------------------------------------------------------------------------------------
# worker side: one operation per process
# --------------------------------------------------------------------------------------------------

def _self_anon() -> int:
    return memwatch.rss_anon(os.getpid())


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _generation_dir(repo: Path) -> Path:
    gens = sorted((repo / "generations").iterdir())
    return gens[-1]


def stored_paths(repo: Path) -> list[str]:
    """Every stored file of the newest generation: its members' own files and, format 3, the shared
    objects it references (``objects/...``); what verify reads and what the stored size counts."""
    from ckpt_archive.format.objects import stored_files

    g = _generation_dir(repo)
    m = json.loads((g / "manifest.json").read_text())
    keys = {key for rec in m["members"] for key, _, _ in stored_files(rec, f"generations/{g.name}")}
    return sorted(str(repo / k) for k in keys)


def stored_bytes(repo: Path) -> int:
    """Bytes of :func:`stored_paths`."""
    return sum(os.path.getsize(p) for p in stored_paths(repo))


def worker(op: str, a: argparse.Namespace) -> dict:
    """Run one operation; return ``{"seconds": float, "anon_before": int, ...}``."""
    import torch  # noqa: F401  (import cost outside the timed region)

    wd = Path(a.workdir)
    res: dict = {}
    if op == "build":
        import state as st
        s = st.build_state(a.size_mib * MiB, seed=0)
        raw = st.tensor_bytes(s)
        torch.save(s, wd / "ckpt.pt")
        from safetensors.torch import save_file
        flat = {k: v.contiguous() for k, v in st.flat_tensors(s).items()}
        save_file(flat, str(wd / "ckpt.safetensors"))
        w = st.weights_only(s)
        torch.save(w, wd / "weights.pt")
        (wd / "meta.json").write_text(json.dumps({"raw_bytes": raw, "weights_raw_bytes": st.tensor_bytes(w),
                                                   "plan": st.plan(a.size_mib * MiB)}))
        return {"seconds": 0.0, "anon_before": 0}
    if op in ("pack", "pack_weights", "verify", "verify_deep", "restore", "load"):
        # library imports are excluded from the timing, as torch's are for torch.load
        import jsonschema  # noqa: F401
        import numpy  # noqa: F401
        import zstandard  # noqa: F401

        import ckpt_archive.ops.load  # noqa: F401
        import ckpt_archive.ops.pack  # noqa: F401
        import ckpt_archive.ops.restore  # noqa: F401
        import ckpt_archive.ops.verify  # noqa: F401
        import ckpt_archive.repo.reader  # noqa: F401
        import ckpt_archive.format.manifest  # noqa: F401
        import ckpt_archive.sources  # noqa: F401
    before = _self_anon()
    cpu0 = os.times()
    if op == "torch_load":
        t0 = time.perf_counter()
        obj = torch.load(wd / "ckpt.pt", weights_only=True, map_location="cpu")
        dt = time.perf_counter() - t0
        res["cpu_s"] = _cpu_since(cpu0)  # user + sys of the call, all threads (issue 29: where the time goes)
        del obj
    elif op == "torch_resave":  # what restore replaces: torch.load + torch.save of the same state
        out = wd / "resaved.pt"
        t0 = time.perf_counter()
        obj = torch.load(wd / "ckpt.pt", weights_only=True, map_location="cpu")
        torch.save(obj, out)
        with open(out, "rb") as fh:
            os.fsync(fh.fileno())
        dt = time.perf_counter() - t0
        del obj
        out.unlink()
    elif op == "safetensors_load":
        from safetensors.torch import load_file
        t0 = time.perf_counter()
        obj = load_file(str(wd / "ckpt.safetensors"))
        dt = time.perf_counter() - t0
        del obj
    elif op in ("zipnn", "zipnn_weights"):
        import zipnn
        import state as st
        src = wd / ("ckpt.pt" if op == "zipnn" else "weights.pt")
        flat = st.flat_tensors(torch.load(src, weights_only=True, mmap=True, map_location="cpu"))
        names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
        coders = {}
        stored = 0
        t0 = time.perf_counter()
        for t in flat.values():
            data = bytearray(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # zipnn overwrites its input
            dname = names.get(t.dtype)
            if dname is None or len(data) < 4096:
                stored += len(data)
                continue
            z = coders.get(dname) or coders.setdefault(dname, zipnn.ZipNN(input_format="byte", bytearray_dtype=dname,
                                                                          threads=a.jobs))
            stored += len(z.compress(data))
        dt = time.perf_counter() - t0
        res["stored_bytes"] = stored
    elif op in ("pack", "pack_weights"):
        import ckpt_archive
        repo = Path(a.repo)
        src = wd / ("ckpt.pt" if op == "pack" else "weights.pt")
        from ckpt_archive.ops.pack import PackOptions
        opts = PackOptions(jobs=a.jobs or None)
        t0 = time.perf_counter()
        r = ckpt_archive.pack(str(src), str(repo), opts)
        dt = time.perf_counter() - t0
        gdir = _generation_dir(repo)
        res["stored_bytes"] = stored_bytes(repo)
        res["generation_bytes"] = _dir_bytes(gdir)
        res["status"] = getattr(r, "status", None)
    elif op in ("verify", "verify_deep"):
        import ckpt_archive
        t0 = time.perf_counter()
        rep = ckpt_archive.verify(str(a.repo), options=ckpt_archive.VerifyOptions(deep=(op == "verify_deep")))
        dt = time.perf_counter() - t0
        if not rep.ok:
            raise SystemExit(f"verify found problems: {rep.to_json()}")
    elif op == "restore":
        import ckpt_archive
        out = wd / "restored.pt"
        t0 = time.perf_counter()
        ckpt_archive.restore(str(a.repo), output=str(out), options=ckpt_archive.RestoreOptions(force=True))
        dt = time.perf_counter() - t0
        out.unlink()
    elif op == "load":
        import ckpt_archive
        t0 = time.perf_counter()
        obj = ckpt_archive.load(str(a.repo))
        dt = time.perf_counter() - t0
        res["cpu_s"] = _cpu_since(cpu0)
        del obj
    else:
        raise SystemExit(f"unknown op {op}")
    res.update({"seconds": dt, "anon_before": before})
    return res


def _cpu_since(t0: os.times_result) -> float:
    """User + system CPU seconds of this process (all its threads) since ``t0`` (``os.times()``)."""
    t1 = os.times()
    return (t1.user - t0.user) + (t1.system - t0.system)


# --------------------------------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------------------------------

def _py(op: str, a: argparse.Namespace, workdir: Path, repo: Path | None = None, size_mib: int = 0) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", op, "--workdir", str(workdir),
           "--jobs", str(a.jobs), "--size-mib", str(size_mib)]
    if repo is not None:
        cmd += ["--repo", str(repo)]
    return cmd


def measure(name: str, cmd: list[str], python: bool) -> dict:
    r = memwatch.run_sampled(cmd)
    if r["rc"] != 0:
        tail = (r["stderr"] or r["stdout"]).strip().splitlines()[-5:]
        return {"op": name, "error": f"rc={r['rc']}: " + " | ".join(tail)}
    out = {"op": name, "wall_s": r["wall_s"], "peak_anon_bytes": r["peak_anon_bytes"]}
    if python:
        info = json.loads(r["stdout"].strip().splitlines()[-1])
        out["seconds"] = info.pop("seconds")
        out.update(info)
    else:
        out["seconds"] = r["wall_s"]
    return out


def machine() -> dict:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    vers = {}
    for tool in (["zstd", "--version"], ["openssl", "version"]):
        try:
            vers[tool[0]] = subprocess.run(tool, capture_output=True, text=True).stdout.strip()
        except OSError:
            vers[tool[0]] = None
    import importlib.metadata as md
    for pkg in ("torch", "zstandard", "safetensors", "zipnn", "numpy", "ckpt-archive"):
        try:
            vers[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            vers[pkg] = None
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_bytes": mem, "python": platform.python_version(),
            "platform": platform.platform(), "versions": vers,
            "loadavg_start": os.getloadavg()}


def ensure_state(size_mib: int, a: argparse.Namespace, log) -> tuple[Path, dict]:
    """The scratch folder of a state size, with the state built there once (cached across runs), and its
    ``meta.json``."""
    wd = Path(a.workdir) / f"{size_mib}mib"
    wd.mkdir(parents=True, exist_ok=True)
    if not (wd / "meta.json").exists():
        log(f"[{size_mib} MiB] building state ...")
        r = measure("build", _py("build", a, wd, size_mib=size_mib), True)
        if "error" in r:
            raise SystemExit(f"building the state failed: {r['error']}")
    return wd, json.loads((wd / "meta.json").read_text())


def run_size(size_mib: int, a: argparse.Namespace, log) -> dict:
    wd, meta = ensure_state(size_mib, a, log)
    repo = wd / "repo"
    have_zipnn = subprocess.run([sys.executable, "-c", "import zipnn"], capture_output=True).returncode == 0
    ours = not a.baselines_only
    runs: dict[str, list[dict]] = {}

    def rec(r: dict) -> None:
        runs.setdefault(r["op"], []).append(r)
        if "error" in r:
            log(f"  {r['op']:18s} ERROR {r['error']}")
        else:
            log(f"  {r['op']:18s} {r['seconds']:8.2f} s  peak anon {r['peak_anon_bytes'] / MiB:8.1f} MiB")

    pt, zst = wd / "ckpt.pt", wd / "ckpt.pt.zst"
    for rep in range(a.reps):
        log(f"[{size_mib} MiB] rep {rep + 1}/{a.reps}  (load avg {os.getloadavg()[0]:.2f})")
        rec(measure("hand", ["sh", "-c", f"zstd -q -T0 -3 -f '{pt}' -o '{zst}' && openssl dgst -sha256 '{zst}'"], False))
        rec(measure("hand_deep", ["sh", "-c", f"zstd -q -t '{zst}' && openssl dgst -sha256 '{zst}'"], False))
        rec(measure("torch_load", _py("torch_load", a, wd), True))
        rec(measure("safetensors_load", _py("safetensors_load", a, wd), True))
        if have_zipnn and not a.no_zipnn:
            rec(measure("zipnn", _py("zipnn", a, wd), True))
        if ours:
            shutil.rmtree(repo, ignore_errors=True)
            r = measure("pack", _py("pack", a, wd, repo), True)
            rec(r)
            if "error" in r:
                ours = False
                continue
            rec(measure("openssl_ours", ["openssl", "dgst", "-sha256", *stored_paths(repo)], False))
            for op in ("verify", "verify_deep", "load", "restore"):
                rec(measure(op, _py(op, a, wd, repo), True))
    # sizes of the bf16-only state, once (deterministic)
    sizes = {"pt_bytes": pt.stat().st_size, "zstd3_bytes": zst.stat().st_size}
    wpt, wzst = wd / "weights.pt", wd / "weights.pt.zst"
    subprocess.run(["zstd", "-q", "-T0", "-3", "-f", str(wpt), "-o", str(wzst)], check=True)
    sizes["weights_zstd3_bytes"] = wzst.stat().st_size
    if have_zipnn and not a.no_zipnn:
        r = measure("zipnn_weights", _py("zipnn_weights", a, wd), True)
        rec(r)
    if ours and not a.baselines_only:
        wrepo = wd / "repo_weights"
        shutil.rmtree(wrepo, ignore_errors=True)
        rec(measure("pack_weights", _py("pack_weights", a, wd, wrepo), True))
        shutil.rmtree(wrepo, ignore_errors=True)
    return {"size_mib": size_mib, "raw_bytes": meta["raw_bytes"], "weights_raw_bytes": meta["weights_raw_bytes"],
            "plan": meta["plan"], "sizes": sizes, "runs": runs, "summary": summarize(runs)}


# --------------------------------------------------------------------------------------------------
# paired mode (default): every comparison interleaved A,B,A,B... in this one driver process
# --------------------------------------------------------------------------------------------------

#: the issue-14 table: (label, ours, baseline, target, stretch). Ratios are baseline time / our time
#: (= our throughput / the baseline's), taken per pair of neighbouring runs, then the median.
PAIRS = [
    ("`pack` (incl. verify + trial reload) / `zstd -T0 -3 && openssl dgst -sha256`", "cli_pack", "hand", 0.8, 1.0),
    ("`verify` / `openssl dgst -sha256` over the same files", "cli_verify", "openssl_ours", 1.0, None),
    ("`verify --deep` / `zstd -t && openssl dgst`", "cli_verify_deep", "hand_deep", 0.9, None),
    ("`ckpt_archive.load` / `torch.load(weights_only=True)`", "load", "torch_load", 0.9, None),
    ("`restore` to .pt / `torch.load` + `torch.save`", "cli_restore", "torch_resave", 0.9, None),
]


def _cli(args: list[str]) -> list[str]:
    """A whole ``ckpt-archive`` CLI process (interpreter start-up and imports included)."""
    return [sys.executable, "-c", "from ckpt_archive.cli.app import main; main()", *args]


def _stats(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def run_paired(size_mib: int, a: argparse.Namespace, log) -> dict:
    wd, meta = ensure_state(size_mib, a, log)
    repo, pt, zst = wd / "repo", wd / "ckpt.pt", wd / "ckpt.pt.zst"
    restored = wd / "restored.pt"
    hand = ["sh", "-c", f"zstd -q -T0 -3 -f '{pt}' -o '{zst}' && openssl dgst -sha256 '{zst}' >/dev/null"]

    def members() -> list[str]:
        return stored_paths(repo)

    def cmd(op: str) -> tuple[list[str], bool]:
        if op == "cli_pack":  # (no side effect here: cmd() is also asked only whether an op is Python)
            return _cli(["pack", str(pt), "--repo", str(repo), "--json"]), False
        if op == "hand":
            return hand, False
        if op == "cli_verify":
            return _cli(["verify", str(repo), "--json"]), False
        if op == "openssl_ours":
            return ["openssl", "dgst", "-sha256", *members()], False
        if op == "cli_verify_deep":
            return _cli(["verify", "--deep", str(repo), "--json"]), False
        if op == "hand_deep":
            return ["sh", "-c", f"zstd -q -t '{zst}' && openssl dgst -sha256 '{zst}' >/dev/null"], False
        if op == "cli_restore":
            return _cli(["restore", str(repo), "--output", str(restored), "--force", "--json"]), False
        return _py(op, a, wd, repo), True

    pairs = []
    # a repository and the hand pipeline's output must exist before the read comparisons
    measure("hand", hand, False)
    shutil.rmtree(repo, ignore_errors=True)
    first = measure("cli_pack", cmd("cli_pack")[0], False)
    if "error" in first:
        raise SystemExit(f"pack failed: {first['error']}")
    for label, ours, base, target, stretch in PAIRS:
        runs: dict[str, list[dict]] = {ours: [], base: []}
        loads = []
        for rep in range(a.reps):
            order = (ours, base) if rep % 2 == 0 else (base, ours)  # A,B then B,A: neither always goes first
            for op in order:
                loads.append(os.getloadavg()[0])
                c, py = cmd(op)
                if op == "cli_pack":
                    shutil.rmtree(repo, ignore_errors=True)
                r = measure(op, c, py)
                if "error" in r:
                    raise SystemExit(f"{op} failed: {r['error']}")
                runs[op].append(r)
            restored.unlink(missing_ok=True)
        wall = {op: [r["wall_s"] for r in rs] for op, rs in runs.items()}
        inproc = {op: [r["seconds"] for r in rs] for op, rs in runs.items()}
        ratio_wall = statistics.median(b / o for o, b in zip(wall[ours], wall[base]))
        # in-process: the call alone, only where both sides are Python calls (load vs torch.load)
        both_py = cmd(ours)[1] and cmd(base)[1]
        ratio_in = statistics.median(b / o for o, b in zip(inproc[ours], inproc[base])) if both_py else None
        row = {"label": label, "ours": ours, "baseline": base, "target": target, "stretch": stretch,
               "wall_s": wall, "inprocess_s": inproc, "ratio_whole_process": ratio_wall, "ratio_inprocess": ratio_in,
               "peak_anon_mib": {op: max(r["peak_anon_bytes"] for r in rs) / MiB for op, rs in runs.items()},
               "loadavg": [min(loads), statistics.median(loads), max(loads)]}
        pairs.append(row)
        log(f"[{size_mib} MiB] {ours} {_stats(wall[ours])} s vs {base} {_stats(wall[base])} s: "
            f"{ratio_wall:.2f}x whole process, {'-' if ratio_in is None else f'{ratio_in:.2f}x'} in-process "
            f"(load {_stats(loads)})")
    # sizes (deterministic) and pack's memory
    stored = sum(os.path.getsize(p) for p in members())
    wpt, wzst = wd / "weights.pt", wd / "weights.pt.zst"
    subprocess.run(["zstd", "-q", "-T0", "-3", "-f", str(wpt), "-o", str(wzst)], check=True)
    wrepo = wd / "repo_weights"
    shutil.rmtree(wrepo, ignore_errors=True)
    r = measure("cli_pack_weights", _cli(["pack", str(wpt), "--repo", str(wrepo), "--json"]), False)
    wstored = stored_bytes(wrepo)
    shutil.rmtree(wrepo, ignore_errors=True)
    return {"size_mib": size_mib, "raw_bytes": meta["raw_bytes"], "pairs": pairs,
            "sizes": {"stored": stored, "zstd3": zst.stat().st_size, "weights_stored": wstored,
                      "weights_zstd3": wzst.stat().st_size},
            "peak_anon_mib": {"pack": max(p["peak_anon_mib"].get("cli_pack", 0) for p in pairs),
                              "restore": max(p["peak_anon_mib"].get("cli_restore", 0) for p in pairs)},
            "pack_wall_median_s": statistics.median(next(p for p in pairs if p["ours"] == "cli_pack")["wall_s"]["cli_pack"])}


def _verdict(value: float, target: float, higher: bool) -> str:
    return "met" if (value >= target if higher else value <= target) else "**missed**"


def paired_table(results: list[dict]) -> str:
    lines = ["| state | operation | ours min/med/max s | baseline min/med/max s | ratio, whole process | "
             "ratio, in-process | target | | load avg (min/med/max) |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for res in results:
        for p in res["pairs"]:
            lines.append(f"| {res['size_mib']} MiB | {p['label']} | {_stats(p['wall_s'][p['ours']])} | "
                         f"{_stats(p['wall_s'][p['baseline']])} | {p['ratio_whole_process']:.2f}x | "
                         f"{'-' if p['ratio_inprocess'] is None else format(p['ratio_inprocess'], '.2f') + 'x'} | "
                         f">= {p['target']}x | "
                         f"{_verdict(p['ratio_whole_process'], p['target'], True)} | "
                         f"{' / '.join(f'{x:.1f}' for x in p['loadavg'])} |")
        sz = res["sizes"]
        lines.append(f"| {res['size_mib']} MiB | stored size / `zstd -3`, fp32-heavy state | | | "
                     f"{sz['stored'] / sz['zstd3']:.3f} | | <= 0.88 | {_verdict(sz['stored'] / sz['zstd3'], 0.88, False)} | |")
        lines.append(f"| {res['size_mib']} MiB | stored size / `zstd -3`, bf16 weights | | | "
                     f"{sz['weights_stored'] / sz['weights_zstd3']:.3f} | | <= 0.85 | "
                     f"{_verdict(sz['weights_stored'] / sz['weights_zstd3'], 0.85, False)} | |")
        pk = res["peak_anon_mib"]
        lines.append(f"| {res['size_mib']} MiB | peak anonymous memory, pack / restore | | | "
                     f"{pk['pack']:.0f} / {pk['restore']:.0f} MiB | | <= 512 MiB | "
                     f"{_verdict(max(pk.values()), 512, False)} | |")
    by = sorted(results, key=lambda r: r["raw_bytes"])
    for small, big in zip(by, by[1:]):
        f = big["raw_bytes"] / small["raw_bytes"]
        g = big["pack_wall_median_s"] / small["pack_wall_median_s"] * 4 / f
        lines.append(f"| {small['size_mib']} -> {big['size_mib']} MiB | pack time for 4x the state | | | {g:.2f}x | | "
                     f"<= 4.4x | {_verdict(g, 4.4, False)} | |")
        # the fixed cost is the line through both sizes at zero bytes (start-up, imports, repository work)
        slope = (big["pack_wall_median_s"] - small["pack_wall_median_s"]) / (big["raw_bytes"] - small["raw_bytes"])
        fixed = small["pack_wall_median_s"] - slope * small["raw_bytes"]
        lines.append(f"| {small['size_mib']} -> {big['size_mib']} MiB | pack's fixed cost (the line through both "
                     f"sizes at 0 bytes) | | | {fixed:.2f} s | | < 1 s | {_verdict(fixed, 1.0, False)} | |")
    return "\n".join(lines)


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for op, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out[op] = {"error": rs[-1]["error"]}
            continue
        out[op] = {"median_s": statistics.median(r["seconds"] for r in ok),
                   "all_s": [round(r["seconds"], 3) for r in ok],
                   "peak_anon_bytes": max(r["peak_anon_bytes"] for r in ok),
                   "anon_before_bytes": max((r.get("anon_before", 0) for r in ok), default=0)}
        stored = [r["stored_bytes"] for r in ok if "stored_bytes" in r]
        if stored:
            out[op]["stored_bytes"] = stored[-1]
    return out


def _m(summary: dict, op: str) -> float | None:
    s = summary.get(op)
    return None if not s or "error" in s else s["median_s"]


def ratios(size: dict) -> list[dict]:
    """The target rows for one size: value, target, pass."""
    s, raw = size["summary"], size["raw_bytes"]
    rows = []

    def row(name, value, target, better, note=""):
        ok = None if value is None else (value >= target if better == "higher" else value <= target)
        rows.append({"metric": name, "value": value, "target": target, "better": better, "pass": ok, "note": note})

    def speed(op_ours, op_base):
        a, b = _m(s, op_ours), _m(s, op_base)
        return None if a is None or b is None else b / a  # time ratio = throughput ratio (same raw bytes)

    row("pack (incl. verify + trial reload) throughput / hand pipeline", speed("pack", "hand"), 0.6, "higher")
    pk = s.get("pack", {})
    if "stored_bytes" in pk:
        row("stored size / zstd -3 (fp32-heavy state)", pk["stored_bytes"] / size["sizes"]["zstd3_bytes"], 0.90, "lower")
    if "stored_bytes" in s.get("zipnn", {}) and "stored_bytes" in pk:
        row("stored size / zipnn (fp32-heavy state, stretch)", pk["stored_bytes"] / s["zipnn"]["stored_bytes"], 1.0, "lower")
    pw = s.get("pack_weights", {})
    if "stored_bytes" in pw:
        row("stored size / zstd -3 (bf16 weights)", pw["stored_bytes"] / size["sizes"]["weights_zstd3_bytes"], 0.87, "lower")
        if "stored_bytes" in s.get("zipnn_weights", {}):
            row("stored size / zipnn (bf16 weights, stretch)", pw["stored_bytes"] / s["zipnn_weights"]["stored_bytes"], 1.0, "lower")
    row("verify throughput / openssl dgst over the same files", speed("verify", "openssl_ours"), 0.9, "higher")
    row("verify --deep throughput / zstd -t + openssl", speed("verify_deep", "hand_deep"), 0.6, "higher")
    row("load throughput / torch.load", speed("load", "torch_load"), 0.6, "higher")
    for op in ("pack", "restore"):
        if op in s and "error" not in s[op]:
            row(f"peak anon memory of {op} (MiB)", s[op]["peak_anon_bytes"] / MiB, 512, "lower")
    rows.append({"metric": "ratio zstd -3 (raw / stored)", "value": raw / size["sizes"]["zstd3_bytes"], "target": None,
                 "better": "higher", "pass": None, "note": ""})
    return rows


def linearity(results: list[dict]) -> list[dict]:
    rows = []
    by = sorted(results, key=lambda r: r["raw_bytes"])
    for small in by:
        for big in by:
            f = big["raw_bytes"] / small["raw_bytes"]
            if not 3.5 <= f <= 4.5:
                continue
            for op in ("pack", "verify", "verify_deep", "restore", "load"):
                a, b = _m(small["summary"], op), _m(big["summary"], op)
                if a and b:
                    # time growth normalised to exactly 4x the bytes; target 4.4
                    rows.append({"metric": f"{op}: time({big['size_mib']} MiB)/time({small['size_mib']} MiB) per 4x bytes",
                                 "value": b / a * 4 / f, "target": 4.4, "better": "lower", "pass": b / a * 4 / f <= 4.4,
                                 "note": f"bytes ratio {f:.2f}"})
    return rows


def table(results: list[dict], lin: list[dict]) -> str:
    lines = []
    for size in results:
        s, raw = size["summary"], size["raw_bytes"]
        lines.append(f"\n### {size['size_mib']} MiB state ({raw / MiB:.0f} MiB of tensors)\n")
        lines.append("| operation | median s | raw MB/s | peak anon MiB | runs (s) |")
        lines.append("|---|---:|---:|---:|---|")
        for op, v in s.items():
            if "error" in v:
                lines.append(f"| {op} | error: {v['error'][:80]} | | | |")
                continue
            nbytes = size["weights_raw_bytes"] if op.endswith("_weights") else raw
            lines.append(f"| {op} | {v['median_s']:.2f} | {nbytes / v['median_s'] / 1e6:.0f} | "
                         f"{v['peak_anon_bytes'] / MiB:.0f} | {', '.join(f'{x:.2f}' for x in v['all_s'])} |")
        lines.append("")
        lines.append("| ratio | reached | target | |")
        lines.append("|---|---:|---:|---|")
        for r in size["ratios"]:
            val = "n/a" if r["value"] is None else f"{r['value']:.3f}"
            tgt = "" if r["target"] is None else ("≥ " if r["better"] == "higher" else "≤ ") + f"{r['target']}"
            mark = "" if r["pass"] is None else ("met" if r["pass"] else "**missed**")
            lines.append(f"| {r['metric']} | {val} | {tgt} | {mark} |")
    if lin:
        lines.append("\n### Linearity (4x the state)\n")
        lines.append("| ratio | reached | target | |")
        lines.append("|---|---:|---:|---|")
        for r in lin:
            lines.append(f"| {r['metric']} | {r['value']:.2f} | ≤ {r['target']} | {'met' if r['pass'] else '**missed**'} |")
    return "\n".join(lines)


def _finish(mode: str, suffix: str, table, results: list, info: dict, stamp: str, a, log) -> int:
    """Write the results JSON (``benchmarks/results/<stamp><suffix>.json`` unless ``--out``) and print the table."""
    doc = {"stamp": stamp, "mode": mode, "machine": info, "jobs": a.jobs, "reps": a.reps, "results": results}
    out = Path(a.out) if a.out else HERE / "results" / f"{stamp}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"load average at start {info['loadavg_start']}, at end {info['loadavg_end']}; {info['cpus']} CPUs")
    print(table(results))
    log(f"\nwrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256", help="comma-separated state sizes in MiB (e.g. 256,1024,2048)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per operation (medians reported)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="threads for pack/zipnn")
    ap.add_argument("--workdir", default=str(HERE / "out"), help="scratch folder (states are cached here)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<stamp>.json)")
    ap.add_argument("--baselines-only", action="store_true", help="skip ckpt-archive operations")
    ap.add_argument("--no-zipnn", action="store_true")
    ap.add_argument("--vs-hand", action="store_true",
                    help="issue 14's paired table against the hand pipeline (zstd + openssl) instead of the peers")
    ap.add_argument("--rand-sizes", default="",
                    help="peers: sizes (MiB) of the incompressible fp32 state (two random float32 tensors)")
    ap.add_argument("--lora-base-mib", type=int, default=500,
                    help="peers: frozen bf16 base of the LoRA-like incremental run (0: skip it)")
    ap.add_argument("--lora-generations", type=int, default=10, help="peers: LoRA-like generations (2..N timed)")
    ap.add_argument("--memory-sizes", default="",
                    help="peers: sizes (MiB) of random fp32 states whose peak memory alone is measured (ours only)")
    ap.add_argument("--no-load", action="store_true", help="peers: skip load vs torch.load")
    ap.add_argument("--no-cli-small", action="store_true", help="peers: skip the small repository's CLI timings")
    ap.add_argument("--peer-ops", default="pack,restore,verify_deep",
                    help="peers: the rounds to time (without pack, one untimed pack per tool makes the repositories)")
    ap.add_argument("--unpaired", action="store_true",
                    help="the older report: every operation per repetition, medians per operation (not paired)")
    ap.add_argument("--ab", default=None, metavar="TREE",
                    help="paired A/B of this code tree against another checkout (e.g. a worktree of main)")
    ap.add_argument("--this-tree", default=str(HERE.parent), help="with --ab: the tree measured as 'this'")
    ap.add_argument("--ab-ops", default="pack,load", help="with --ab: operations (pack, load, verify, verify_deep, restore)")
    ap.add_argument("--crypto", action="store_true",
                    help="what encryption costs: pack, restore, verify --deep into a plain vs an encrypted repository")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repo", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size-mib", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a)))
        return 0
    for tool in ("zstd", "openssl"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: install it (apt-get install zstd openssl)")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    info = machine()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    results = []
    if a.ab:
        from ab import ab_table, run_ab  # the A/B mode lives in ab.py (keeps this module near 600 lines)

        for size_mib in [int(x) for x in a.sizes.split(",") if x]:
            results.append(run_ab(size_mib, a, log))
        info["loadavg_end"] = os.getloadavg()
        return _finish("ab", "-ab", ab_table, results, info, stamp, a, log)
    if a.crypto:
        from crypto_cost import crypto_table, run_crypto  # issue 28: plain vs encrypted, paired

        for size_mib in [int(x) for x in a.sizes.split(",") if x]:
            results.append(run_crypto(size_mib, a, log))
        info["loadavg_end"] = os.getloadavg()
        return _finish("crypto", "-crypto", crypto_table, results, info, stamp, a, log)
    if not a.unpaired and not a.vs_hand:
        from peers import main_peers, table as peers_table, versions  # restic / borg (issue 29)

        doc = main_peers(a, log)
        info["loadavg_end"] = os.getloadavg()
        info["versions"].update(versions())
        doc.update({"stamp": stamp, "machine": info, "jobs": a.jobs, "reps": a.reps})
        out = Path(a.out) if a.out else HERE / "results" / f"{stamp}-peers.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        print(f"load average at start {info['loadavg_start']}, at end {info['loadavg_end']}; {info['cpus']} CPUs")
        print(peers_table(doc))
        log(f"\nwrote {out}")
        return 0
    if not a.unpaired:
        for size_mib in [int(x) for x in a.sizes.split(",") if x]:
            results.append(run_paired(size_mib, a, log))
        info["loadavg_end"] = os.getloadavg()
        return _finish("paired", "", paired_table, results, info, stamp, a, log)
    for size_mib in [int(x) for x in a.sizes.split(",") if x]:
        r = run_size(size_mib, a, log)
        r["ratios"] = ratios(r)
        results.append(r)
    lin = linearity(results)
    info["loadavg_end"] = os.getloadavg()
    doc = {"stamp": stamp, "machine": info, "jobs": a.jobs, "reps": a.reps, "results": results, "linearity": lin}
    out = Path(a.out) if a.out else HERE / "results" / f"{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(table(results, lin))
    log(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
