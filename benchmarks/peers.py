"""Paired benchmark against the peers a user would run instead of us: restic and borg (issue 29).

``python benchmarks/run.py --sizes 1024,3072 --reps 3`` (the default mode of run.py) runs, per state, every
comparison as rounds of whole processes in a rotating order (ours, restic, borg, [hand]; then restic, borg,
hand, ours; ...), with ``sync`` before each run, and reports min / median / max per side and the median of
the per-round ratios *peer time / our time* (above 1: we are faster). A peer that is not installed is said
to be missing in the table and the JSON; nothing else changes.

Comparisons (each tool into its own fresh repository per round; init is not timed):

========================  ==============================================  ==========================================
ours                      restic 0.14+ (repository v2)                    borg 1.2+
========================  ==============================================  ==========================================
``ckpt-archive pack``     ``restic backup --compression auto``            ``borg create --compression zstd,3``
``ckpt-archive restore``  ``restic restore`` then ``sync FILE`` (fsync)    ``borg extract`` then ``sync FILE``
``verify --deep``         ``restic check --read-data``                    ``borg check --verify-data``
stored bytes (``du``)     the repository's bytes                          the repository's bytes
========================  ==============================================  ==========================================

borg runs with ``--encryption=none`` (it does the least work: no MAC; restic always encrypts). The
hand pipeline (``zstd -T0 -3 && openssl dgst -sha256``: checks nothing it wrote) is kept as context in the
pack and ``verify --deep`` rounds. Our pack includes its verify and trial reload; restore and our
pack fsync; restic and borg do not fsync restored files, so ``sync FILE`` is added (also shown without).

States: the realistic one of :mod:`state` (bf16 weights + fp32 Adam moments, ``--sizes`` MiB); an
incompressible fp32 state (two ``randn`` float32 tensors, ``--rand-sizes`` MiB); the LoRA-like incremental
run (``--lora-base-mib`` frozen bf16 base and small changing fp32 adapters + Adam moments, benchmarks/shared.py's
builder; generations 2..N timed, each tool backing up generation g into the repository that holds 1..g-1,
the same path replaced by a hard link as a trainer replaces ``ckpt.pt``). Peak anonymous memory
(:mod:`memwatch`) of our pack, restore, verify --deep and export, per state. A tiny repository's CLI
``verify`` / ``list`` / ``status``: wall and CPU time, and whether torch was imported.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memwatch  # noqa: E402

MiB = 1 << 20

#: (operation, target ratio restic/ours, target ratio borg/ours) from issue 29's table; None: no target
TARGETS = {
    "pack": (1.2, 1.1),
    "restore": (1.0, 1.2),
    "verify_deep": (2.0, None),
    "lora": (1.0, None),
    "load": (0.9, None),  # torch.load / ours, in-process
}


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def _cli(args: list[str]) -> list[str]:
    """A whole ``ckpt-archive`` CLI process (interpreter start-up and imports included)."""
    return [sys.executable, "-c", "from ckpt_archive.cli.app import main; main()", *args]


def _stats(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def du(path: Path) -> int:
    """Bytes of every regular file under ``path`` (hard links once)."""
    seen, total = set(), 0
    for p in Path(path).rglob("*"):
        try:
            st = p.lstat()
        except OSError:
            continue
        if p.is_file() and not p.is_symlink() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def run(cmd: list[str] | str, env: dict | None = None, cwd: str | None = None) -> dict:
    """One measured run: ``sync`` first (untimed), then the whole process; wall, CPU (user + sys of the
    process tree) and peak anonymous memory."""
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if isinstance(cmd, str):
        cmd = ["sh", "-c", cmd]
    r = memwatch.run_sampled(cmd, env={**os.environ, **(env or {})}, cwd=cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r["rc"] != 0:
        tail = (r["stderr"] or r["stdout"]).strip().splitlines()[-6:]
        raise SystemExit(f"{' '.join(cmd)[:300]} failed (rc={r['rc']}):\n" + "\n".join(tail))
    return {"wall_s": r["wall_s"], "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "peak_anon_mib": r["peak_anon_bytes"] / MiB, "stdout": r["stdout"][-2000:]}


def quiet(cmd: list[str] | str, env: dict | None = None, cwd: str | None = None) -> None:
    """An untimed setup step (repository init, removal); fails loudly."""
    if isinstance(cmd, str):
        cmd = ["sh", "-c", cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)[:300]} failed (rc={r.returncode}):\n{r.stderr[-1500:]}")


# --------------------------------------------------------------------------------------------------
# the tools
# --------------------------------------------------------------------------------------------------

class Ours:
    name = "ours"

    def __init__(self, work: Path):
        self.repo = work / "ours-repo"
        self.out = work / "ours-restored.pt"

    def fresh(self) -> None:
        shutil.rmtree(self.repo, ignore_errors=True)

    def backup(self, src: Path) -> list[str]:
        return _cli(["pack", str(src), "--repo", str(self.repo), "--json"])

    def restore(self, src: Path) -> list[str]:
        return _cli(["restore", str(self.repo), "--output", str(self.out), "--force", "--json"])

    def check(self) -> list[str]:
        return _cli(["verify", "--deep", str(self.repo), "--json"])

    def cleanup_restore(self) -> None:
        self.out.unlink(missing_ok=True)

    def stored(self) -> int:
        return du(self.repo)


class Restic:
    name = "restic"

    def __init__(self, work: Path):
        self.repo = work / "restic-repo"
        self.target = work / "restic-restored"
        self.env = {"RESTIC_PASSWORD": "benchmark", "RESTIC_CACHE_DIR": str(work / "restic-cache"),
                    "RESTIC_PROGRESS_FPS": "0.016"}

    def fresh(self) -> None:
        shutil.rmtree(self.repo, ignore_errors=True)
        shutil.rmtree(self.env["RESTIC_CACHE_DIR"], ignore_errors=True)
        quiet(["restic", "-r", str(self.repo), "init", "--repository-version", "2"], self.env)

    def backup(self, src: Path) -> list[str]:
        return ["restic", "-r", str(self.repo), "--compression", "auto", "backup", "-q", str(src)]

    def restore(self, src: Path, fsync: bool = True) -> str:
        shutil.rmtree(self.target, ignore_errors=True)
        restored = self.target / str(src.resolve()).lstrip("/")
        cmd = f"restic -r '{self.repo}' restore latest --target '{self.target}' -q"
        return cmd + (f" && sync '{restored}'" if fsync else "")

    def check(self) -> list[str]:
        return ["restic", "-r", str(self.repo), "check", "--read-data", "-q"]

    def cleanup_restore(self) -> None:
        shutil.rmtree(self.target, ignore_errors=True)

    def stored(self) -> int:
        return du(self.repo)


class Borg:
    name = "borg"

    def __init__(self, work: Path):
        self.repo = work / "borg-repo"
        self.target = work / "borg-restored"
        self.env = {"BORG_BASE_DIR": str(work / "borg-base"), "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes",
                    "BORG_RELOCATED_REPO_ACCESS_IS_OK": "yes", "BORG_PASSPHRASE": ""}
        self.n = 0

    def fresh(self) -> None:
        shutil.rmtree(self.repo, ignore_errors=True)
        shutil.rmtree(self.env["BORG_BASE_DIR"], ignore_errors=True)
        quiet(["borg", "init", "--encryption=none", str(self.repo)], self.env)
        self.n = 0

    def backup(self, src: Path) -> str:
        self.n += 1
        return f"cd '{src.parent}' && borg create --compression zstd,3 '{self.repo}::a{self.n}' '{src.name}'"

    def restore(self, src: Path, fsync: bool = True) -> str:
        shutil.rmtree(self.target, ignore_errors=True)
        self.target.mkdir(parents=True)
        cmd = f"cd '{self.target}' && borg extract '{self.repo}::a{self.n}'"
        return cmd + (f" && sync '{self.target / src.name}'" if fsync else "")

    def check(self) -> list[str]:
        return ["borg", "check", "--verify-data", str(self.repo)]

    def cleanup_restore(self) -> None:
        shutil.rmtree(self.target, ignore_errors=True)

    def stored(self) -> int:
        return du(self.repo)


class Hand:
    """The old hand pipeline, as context: compress and hash, check nothing."""

    name = "hand"

    def __init__(self, work: Path):
        self.zst = work / "hand.zst"

    def fresh(self) -> None:
        self.zst.unlink(missing_ok=True)

    def backup(self, src: Path) -> str:
        return f"zstd -q -T0 -3 -f '{src}' -o '{self.zst}' && openssl dgst -sha256 '{self.zst}' >/dev/null"

    def check(self) -> str:
        return f"zstd -q -t '{self.zst}' && openssl dgst -sha256 '{self.zst}' >/dev/null"

    def stored(self) -> int:
        return self.zst.stat().st_size


def peers(work: Path, log, *, hand: bool = True) -> tuple[list, dict]:
    """The tools to run here: ours and every installed peer; ``{tool: "not installed"}`` for the others."""
    tools: list = [Ours(work)]
    missing = {}
    for cls, exe in ((Restic, "restic"), (Borg, "borg")):
        if have(exe):
            tools.append(cls(work))
        else:
            missing[cls.name] = f"{exe} not installed (apt-get install {'restic' if exe == 'restic' else 'borgbackup'})"
            log(f"  {cls.name}: {missing[cls.name]} -- left out of the comparison")
    if hand and have("zstd") and have("openssl"):
        tools.append(Hand(work))
    return tools, missing


def versions() -> dict:
    out = {}
    for tool, args in (("restic", ["version"]), ("borg", ["--version"]), ("zstd", ["--version"])):
        if have(tool):
            out[tool] = subprocess.run([tool, *args], capture_output=True, text=True).stdout.strip()
        else:
            out[tool] = None
    return out


# --------------------------------------------------------------------------------------------------
# rounds
# --------------------------------------------------------------------------------------------------

def _rotated(items: list, rep: int) -> list:
    k = rep % len(items)
    return items[k:] + items[:k]


def _summary(label: str, op: str, runs: dict[str, list[dict]], loads: list[float]) -> dict:
    """min/median/max per side and the median per-round ratio peer / ours."""
    wall = {k: [r["wall_s"] for r in v] for k, v in runs.items()}
    row = {"label": label, "op": op, "wall_s": wall,
           "cpu_s": {k: [r["cpu_s"] for r in v] for k, v in runs.items()},
           "peak_anon_mib": {k: max(r["peak_anon_mib"] for r in v) for k, v in runs.items()},
           "loadavg": [min(loads), statistics.median(loads), max(loads)], "ratio": {}}
    row["ratio_cpu"] = {}
    for side, ws in wall.items():
        if side != "ours" and not side.startswith("ours"):
            row["ratio"][side] = statistics.median(b / o for o, b in zip(wall["ours"], ws))
            cs = row["cpu_s"]
            row["ratio_cpu"][side] = statistics.median(b / o for o, b in zip(cs["ours"], cs[side]) if o > 0)
    return row


def compare(state: str, src: Path, tools: list, reps: int, log, *, with_restore: bool = True,
            ops: tuple = ("pack", "restore", "verify_deep")) -> list[dict]:
    """Pack, restore and deep-check rounds of one state file; returns table rows (also stored bytes).
    ``ops`` without ``"pack"``: one untimed pack per tool makes the repositories the other rounds read."""
    rows = []
    # pack: each tool into a fresh repository every round; the last round's repositories are then read
    runs: dict[str, list[dict]] = {t.name: [] for t in tools}
    loads = []
    for rep in range(reps if "pack" in ops else 1):
        for t in _rotated(tools, rep):
            t.fresh()
            loads.append(os.getloadavg()[0])
            runs[t.name].append(run(t.backup(src), getattr(t, "env", None)))
    if "pack" in ops:
        rows.append(_summary(f"{state}: pack / backup / create", "pack", runs, loads))
        rows[-1]["stored_bytes"] = {t.name: t.stored() for t in tools}
        log(_line(rows[-1]))
    with_restore = with_restore and "restore" in ops
    readers = [t for t in tools if hasattr(t, "restore")]
    if with_restore:
        runs, loads = {t.name: [] for t in readers}, []
        nofsync: dict[str, list[dict]] = {}
        for rep in range(reps):
            for t in _rotated(readers, rep):
                loads.append(os.getloadavg()[0])
                runs[t.name].append(run(t.restore(src), getattr(t, "env", None)))
                t.cleanup_restore()
                if t.name != "ours":  # the peers without fsync too (they do not fsync on their own)
                    nofsync.setdefault(f"{t.name} (no fsync)", []).append(
                        run(t.restore(src, fsync=False), getattr(t, "env", None)))
                    t.cleanup_restore()
        rows.append(_summary(f"{state}: restore / restore + fsync / extract + fsync", "restore",
                             {**runs, **nofsync}, loads))
        log(_line(rows[-1]))
    if "verify_deep" not in ops:
        return rows
    runs, loads = {t.name: [] for t in tools}, []
    for rep in range(reps):
        for t in _rotated(tools, rep):
            loads.append(os.getloadavg()[0])
            runs[t.name].append(run(t.check(), getattr(t, "env", None)))
    rows.append(_summary(f"{state}: verify --deep / check --read-data / check --verify-data", "verify_deep",
                         runs, loads))
    log(_line(rows[-1]))
    return rows


def memory(state: str, rows: list[dict], ours: "Ours", work: Path, log) -> dict:
    """Peak anonymous memory (MiB) of our pack, restore and verify --deep (the worst of the rounds just run)
    and of one export of the repository they left."""
    out = {r["op"]: r["peak_anon_mib"]["ours"] for r in rows if r["op"] in ("pack", "restore", "verify_deep")}
    dest = work / "ours-export"
    shutil.rmtree(dest, ignore_errors=True)
    out["export"] = run(_cli(["export", str(ours.repo), "--to", str(dest), "--json"]))["peak_anon_mib"]
    shutil.rmtree(dest, ignore_errors=True)
    log(f"  [{state}] peak anonymous memory, MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in out.items()))
    return out


def load_rounds(state: str, wd: Path, repo: Path, a: argparse.Namespace, log) -> dict:
    """``ckpt_archive.load`` of our repository against ``torch.load(weights_only=True)`` of the file, both in
    Python workers (run.py's), paired; the in-process time of the call alone is the ratio that counts
    (imports are excluded on both sides)."""
    from run import _py

    sides = {"ours": _py("load", a, wd, repo), "torch.load": _py("torch_load", a, wd)}
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    inproc: dict[str, list[float]] = {k: [] for k in sides}
    loads = []
    for rep in range(a.reps):
        for side in _rotated(list(sides), rep):
            loads.append(os.getloadavg()[0])
            r = run(sides[side])
            runs[side].append(r)
            inproc[side].append(json.loads(r["stdout"].strip().splitlines()[-1])["seconds"])
    row = _summary(f"{state}: `ckpt_archive.load` / `torch.load(weights_only=True)`", "load", runs, loads)
    row["inprocess_s"] = inproc
    row["ratio_inprocess"] = statistics.median(b / o for o, b in zip(inproc["ours"], inproc["torch.load"]))
    log(_line(row) + f"; in-process {row['ratio_inprocess']:.2f}x")
    return row


def lora_rounds(files: list[Path], tools: list, work: Path, log) -> dict:
    """The LoRA-like incremental run: every tool backs up generation 1 (untimed), then generations 2..N
    are timed, each tool in a rotating order per generation, from the same path (a hard link replaced)."""
    tools = [t for t in tools if t.name != "hand"]
    link = work / "lora-ckpt.pt"
    for t in tools:
        t.fresh()
    runs: dict[str, list[dict]] = {t.name: [] for t in tools}
    loads = []
    for g, f in enumerate(files):
        for t in _rotated(tools, g):
            tmp = work / "lora-ckpt.pt.new"
            tmp.unlink(missing_ok=True)
            os.link(f, tmp)
            os.replace(tmp, link)
            r = run(t.backup(link), getattr(t, "env", None))
            if g > 0:
                loads.append(os.getloadavg()[0])
                runs[t.name].append(r)
    row = _summary(f"LoRA-like, time per generation 2-{len(files)}", "lora", runs, loads)
    row["stored_bytes"] = {t.name: t.stored() for t in tools}
    log(_line(row))
    return row


def cli_small(work: Path, reps: int, log) -> dict:
    """A tiny repository (a 16x16 model + Adam with its step tensors + a step counter; no LR scheduler,
    whose next LR the policy audit simulates with real torch): our CLI ``verify``, ``list``, ``status``
    as whole processes -- wall, CPU, and whether torch was imported (a separate run with a wrapper that
    reports ``sys.modules`` at exit)."""
    src = work / "small-adam.pt"
    if not src.exists():
        quiet([sys.executable, "-c", (
            "import torch,sys; m=torch.nn.Linear(16,16); o=torch.optim.Adam(m.parameters()); "
            "m(torch.randn(2,16)).sum().backward(); o.step(); "
            "torch.save({'model': m.state_dict(), 'optimizer': o.state_dict(), 'step': 1}, sys.argv[1])"),
            str(src)])
    repo = work / "small-repo"
    out = {}
    # the package's bytecode compiled once, as an installed copy has it: a shell with PYTHONDONTWRITEBYTECODE=1
    # (this project's) would otherwise compile every module on every run (~0.1-0.15 s of CPU; startup.py)
    env = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(work / "pycache")}
    quiet([sys.executable, "-m", "compileall", "-q", str(HERE.parent / "ckpt_archive")], env)
    # pack's fixed cost: a whole CLI pack of the tiny file into a fresh repository, paired with the bare
    # interpreter's start-up (``python -c pass``); the bound is 0.5 s above the interpreter
    packs, bare = [], []
    for rep in range(reps):
        for side in (("pack", "bare") if rep % 2 == 0 else ("bare", "pack")):
            if side == "pack":
                shutil.rmtree(repo, ignore_errors=True)
                packs.append(run(_cli(["pack", str(src), "--repo", str(repo), "--json"]), env))
            else:
                bare.append(run([sys.executable, "-c", "pass"]))
    out["pack (fixed cost)"] = {"wall_s": [r["wall_s"] for r in packs], "cpu_s": [r["cpu_s"] for r in packs],
                                "interpreter_wall_s": [r["wall_s"] for r in bare],
                                "interpreter_cpu_s": [r["cpu_s"] for r in bare],
                                "above_interpreter_s": statistics.median(p["wall_s"] - b["wall_s"]
                                                                         for p, b in zip(packs, bare)),
                                "above_interpreter_cpu_s": statistics.median(p["cpu_s"] - b["cpu_s"]
                                                                             for p, b in zip(packs, bare))}
    log(f"  small repository: pack wall {_stats(out['pack (fixed cost)']['wall_s'])} s, above the interpreter "
        f"{out['pack (fixed cost)']['above_interpreter_s']:.2f} s wall / "
        f"{out['pack (fixed cost)']['above_interpreter_cpu_s']:.2f} s CPU")
    probe_code = ("import sys\nsys.argv=['ckpt-archive']+sys.argv[1:]\ntry:\n from ckpt_archive.cli.app import main; "
                  "main()\nexcept SystemExit: pass\nfinally:\n print('TORCH', 'torch' in sys.modules, file=sys.stderr)")
    shutil.rmtree(repo, ignore_errors=True)
    probe = subprocess.run([sys.executable, "-c", probe_code, "pack", str(src), "--repo", str(repo), "--json"],
                           capture_output=True, text=True, env={**os.environ, **env})
    out["pack (fixed cost)"]["imports_torch"] = "TORCH True" in probe.stderr
    for cmd in (["verify", str(repo), "--json"], ["list", str(repo), "--json"], ["status", str(repo), "--json"]):
        rs = [run(_cli(cmd), env) for _ in range(reps)]
        probe = subprocess.run([sys.executable, "-c", probe_code, *cmd], capture_output=True, text=True,
                               env={**os.environ, **env})
        out[cmd[0]] = {"wall_s": [r["wall_s"] for r in rs], "cpu_s": [r["cpu_s"] for r in rs],
                       "imports_torch": "TORCH True" in probe.stderr}
        log(f"  small repository: {cmd[0]} wall {_stats(out[cmd[0]]['wall_s'])} s, CPU "
            f"{_stats(out[cmd[0]]['cpu_s'])} s, imports torch: {out[cmd[0]]['imports_torch']}")
    return out


def _line(row: dict) -> str:
    sides = ", ".join(f"{k} {_stats(v)} s" for k, v in row["wall_s"].items())
    ratios = ", ".join(f"{k}/ours {v:.2f}x" for k, v in row["ratio"].items())
    return f"  {row['label']}: {sides}; {ratios} (load {_stats(row['loadavg'])})"


# --------------------------------------------------------------------------------------------------
# states
# --------------------------------------------------------------------------------------------------

def build_rand(path: Path, size_mib: int) -> None:
    """Two random float32 tensors of ``size_mib / 2`` MiB each (zstd saves almost nothing on them)."""
    quiet([sys.executable, "-c", (
        "import torch,sys; n=int(sys.argv[2])*2**20//8; g=torch.Generator().manual_seed(0); "
        "torch.save({'a': torch.randn(n, generator=g), 'b': torch.randn(n, generator=g)}, sys.argv[1])"),
        str(path), str(size_mib)])


def build_lora(folder: Path, base_mib: int, generations: int) -> list[Path]:
    """Generations 1..N of the LoRA-like state (benchmarks/shared.py's builder), cached in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"step{g}.pt" for g in range(1, generations + 1)]
    if not all(f.exists() for f in files):
        quiet([sys.executable, "-c", (
            "import sys; sys.path.insert(0, sys.argv[1]); import shared; from pathlib import Path\n"
            "for g in range(1, int(sys.argv[4]) + 1):\n"
            "    p = Path(sys.argv[2]) / f'step{g}.pt'\n"
            "    p.exists() or shared.save(int(sys.argv[3]), g, p)"),
            str(HERE), str(folder), str(base_mib), str(generations)])
    return files


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------

def table(doc: dict) -> str:
    """The Markdown table of a peers run (benchmarks/README.md keeps the full one)."""
    lines = ["| state / operation | ours min/med/max s | restic min/med/max s | borg min/med/max s | restic / ours, "
             "wall (CPU) | borg / ours, wall (CPU) | target (restic, borg) | load avg |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for row in doc["rows"]:
        w, r = row["wall_s"], row["ratio"]
        if row["op"] == "load":
            ri = row["ratio_inprocess"]
            lines.append(f"| {row['label']} (whole process; in-process ratio) | {_stats(w['ours'])} | torch.load "
                         f"{_stats(w['torch.load'])} | | {r['torch.load']:.2f}x; in-process **{ri:.2f}x**"
                         f"{' met' if ri >= 0.9 else ' missed'} | | >= 0.9x | {_stats(row['loadavg'])} |")
            continue
        tgt = TARGETS.get(row["op"], (None, None))

        def verdict(side: str, want) -> str:
            if side not in r:
                return doc["missing"].get(side, "-")
            mark = "" if want is None else (" met" if r[side] >= want else " **missed**")
            return f"{r[side]:.2f}x{mark} (CPU {row['ratio_cpu'][side]:.2f}x)"

        extra = ""
        if "restic (no fsync)" in r:
            extra = f" (no fsync: {r['restic (no fsync)']:.2f}x)"
        bextra = f" (no fsync: {r['borg (no fsync)']:.2f}x)" if "borg (no fsync)" in r else ""
        lines.append(f"| {row['label']} | {_stats(w.get('ours', []))} | {_stats(w.get('restic', []))} | "
                     f"{_stats(w.get('borg', []))} | {verdict('restic', tgt[0])}{extra} | {verdict('borg', tgt[1])}"
                     f"{bextra} | >= {tgt[0] or '-'}x, >= {tgt[1] or '-'}x | {_stats(row['loadavg'])} |")
        if "hand" in w:
            lines.append(f"| {row['label']}: hand pipeline (context) | | | | | | hand / ours "
                         f"{r['hand']:.2f}x ({_stats(w['hand'])} s) | |")
        if "stored_bytes" in row:
            sb = row["stored_bytes"]
            ratio = f"{sb['ours'] / sb['restic']:.3f}" if sb.get("restic") else "-"
            lines.append(f"| {row['label'].split(':')[0]}: stored MB ours / restic / borg | "
                         f"{sb['ours'] / 1e6:.0f} | {sb.get('restic', 0) / 1e6:.0f} | {sb.get('borg', 0) / 1e6:.0f} | "
                         f"ours/restic {ratio} | | <= 0.85 | |")
    for state, mem in doc.get("memory", {}).items():
        worst = max(mem.values())
        lines.append(f"| {state}: peak anonymous MiB, pack / restore / verify --deep / export | "
                     + " / ".join(f"{mem[k]:.0f}" if k in mem else "-"
                                  for k in ("pack", "restore", "verify_deep", "export"))
                     + f" | | | | | <= 512 {'met' if worst <= 512 else '**missed**'} | |")
    for cmd, v in (doc.get("cli_small") or {}).items():
        if "above_interpreter_s" in v:
            lines.append(f"| tiny state: CLI `pack` (wall; CPU) | {_stats(v['wall_s'])}; {_stats(v['cpu_s'])} | "
                         f"interpreter {_stats(v['interpreter_wall_s'])} | | fixed cost above the interpreter "
                         f"{v['above_interpreter_s']:.2f} s wall, {v['above_interpreter_cpu_s']:.2f} s CPU | | <= 0.5 s "
                         f"({'met' if v['above_interpreter_s'] <= 0.5 else '**missed**'}); torch "
                         f"{'imported' if v['imports_torch'] else 'not imported'} | |")
            continue
        ok = statistics.median(v["wall_s"]) <= 0.3 and not v["imports_torch"]
        lines.append(f"| small repository: CLI `{cmd}` (wall; CPU) | {_stats(v['wall_s'])}; {_stats(v['cpu_s'])} | "
                     f"| | | | <= 0.3 s wall, no torch import: {'met' if ok else '**missed**'} (torch "
                     f"{'imported' if v['imports_torch'] else 'not imported'}) | |")
    return "\n".join(lines)


def main_peers(a: argparse.Namespace, log) -> dict:
    """Run everything ``a`` asks for; returns the results document (run.py writes it)."""
    work = Path(a.workdir) / "peers"
    work.mkdir(parents=True, exist_ok=True)
    tools, missing = peers(work, log)
    doc: dict = {"mode": "peers", "missing": missing, "peer_versions": versions(), "rows": [], "memory": {}}
    from run import ensure_state

    for size in [int(x) for x in a.sizes.split(",") if x]:
        wd, meta = ensure_state(size, a, log)
        label = f"{size} MiB state ({meta['raw_bytes'] / MiB:.0f} MiB of tensors)"
        log(f"[{label}] rounds, load avg {os.getloadavg()[0]:.2f}")
        rows = compare(label, wd / "ckpt.pt", tools, a.reps, log, ops=tuple(a.peer_ops.split(",")))
        doc["rows"] += rows
        if not a.no_load:
            doc["rows"].append(load_rounds(label, wd, tools[0].repo, a, log))
        doc["memory"][label] = memory(label, rows, tools[0], work, log)
    for size in [int(x) for x in (a.rand_sizes or "").split(",") if x]:
        src = Path(a.workdir) / f"rand{size}mib.pt"
        if not src.exists():
            log(f"[fp32 random {size} MiB] building ...")
            build_rand(src, size)
        label = f"{size} MiB random fp32"
        log(f"[{label}] rounds, load avg {os.getloadavg()[0]:.2f}")
        rows = compare(label, src, tools, a.reps, log, ops=tuple(a.peer_ops.split(",")))
        doc["rows"] += rows
        doc["memory"][label] = memory(label, rows, tools[0], work, log)
    for size in [int(x) for x in (a.memory_sizes or "").split(",") if x]:
        src = Path(a.workdir) / f"rand{size}mib.pt"
        if not src.exists():
            log(f"[fp32 random {size} MiB] building ...")
            build_rand(src, size)
        label = f"{size} MiB random fp32 (memory only)"
        ours = Ours(work)
        ours.fresh()
        rows = []
        for op, cmd in (("pack", lambda: ours.backup(src)), ("restore", lambda: ours.restore(src)),
                        ("verify_deep", ours.check)):
            r = run(cmd())
            rows.append({"op": op, "peak_anon_mib": {"ours": r["peak_anon_mib"]}, "wall_s": {"ours": [r["wall_s"]]}})
            ours.cleanup_restore()
        doc["memory"][label] = memory(label, rows, ours, work, log)
        ours.fresh()
    if a.lora_base_mib:
        files = build_lora(Path(a.workdir) / f"lora{a.lora_base_mib}", a.lora_base_mib, a.lora_generations)
        log(f"[LoRA-like, {a.lora_base_mib} MiB base, {len(files)} generations] load avg {os.getloadavg()[0]:.2f}")
        doc["rows"].append(lora_rounds(files, tools, work, log))
    if not a.no_cli_small:
        doc["cli_small"] = cli_small(work, max(3, a.reps), log)
    for t in tools:
        if hasattr(t, "fresh"):
            t.fresh() if t.name == "hand" else shutil.rmtree(t.repo, ignore_errors=True)
    return doc
