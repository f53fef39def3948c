"""The CLI's start-up on a tiny repository, paired A/B of two code trees (issue 29, "Start-up").

``python benchmarks/startup.py --baseline TREE [--reps 7]`` runs, for each command below, whole processes
of this tree (``PYTHONPATH`` = the checkout this script is in) and of ``TREE`` (e.g. ``git archive`` of main
at the commit before a change, unpacked), interleaved A,B then B,A, and reports per side min / median / max
of **CPU seconds** (user + sys of the process, all its threads: ``os.wait4``'s rusage) and of wall seconds,
and the median of the paired CPU differences. CPU time is the measure that holds on a shared, loaded box;
wall is shown for context. Commands, on a tiny state (a 16x16 Linear + Adam with its step tensors + a step
counter, no LR scheduler, written once with torch):

- ``python -c pass``: the bare interpreter (pack's bound is 0.5 s above it);
- ``ckpt-archive --help``: the interpreter plus the CLI's imports, nothing else;
- ``list REPO``, ``verify REPO``, ``status REPO``: read-only commands (issue 29: <= 0.3 s wall, no torch);
- ``pack SRC --repo FRESH --json``: pack's fixed cost (issue 29: <= 0.5 s of CPU above the interpreter).

**Bytecode**: each tree's modules are compiled once, before the timed runs, into a ``__pycache__`` tree of its
own under the scratch directory (``PYTHONPYCACHEPREFIX``; ``PYTHONDONTWRITEBYTECODE`` removed), as an installed
package has them. Without it (this project's shells set ``PYTHONDONTWRITEBYTECODE=1``) every run compiles the
package's sources again: ~0.1-0.15 s of CPU that no installed copy pays (``--no-bytecode`` measures that way).

Each tree lists, once per command, which heavy modules the command imported (``torch``, ``numpy``,
``jsonschema``, ``pydantic``, ``rich.markdown``), read from ``sys.modules`` at exit by a wrapper.
``--instructions`` also counts, once per command and tree, the instructions the process executes (valgrind's
callgrind): a figure the box's load hardly moves. Each tree reads a repository it packed itself. The JSON goes to ``results/<UTC>-startup.json``.
"""
from __future__ import annotations

import argparse
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
HEAVY = ("torch", "numpy", "jsonschema", "pydantic", "rich.markdown")
PROBE = ("import sys\nsys.argv = ['ckpt-archive'] + sys.argv[1:]\ntry:\n    from ckpt_archive.cli.app import main\n"
         "    main()\nexcept SystemExit:\n    pass\nfinally:\n    print('MODULES', ','.join(m for m in %r if m in sys.modules), "
         "file=sys.stderr)\n    print('TREE', sys.modules['ckpt_archive'].__file__, file=sys.stderr)" % (HEAVY,))


def timed(cmd: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    """One whole process: (CPU seconds = user + sys of it and its threads, wall seconds). Fails loudly.
    ``cwd`` must hold no ``ckpt_archive``: ``python -m``/``-c`` put it first on ``sys.path``, before
    ``PYTHONPATH``, and both sides would import the same tree."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err.decode()[-1500:]}")
    return ru.ru_utime + ru.ru_stime, wall


def instructions(cmd: list[str], env: dict, cwd: Path) -> int | None:
    """Instructions one whole process executes (valgrind's callgrind ``Collected``; ``PYTHONHASHSEED=0``), or
    None without valgrind. Unlike CPU seconds, this count hardly moves with the box's load: on a shared box it
    is the figure that compares two trees' start-up (a run takes ~30x the process's CPU time)."""
    if shutil.which("valgrind") is None:
        return None
    p = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
                       env={**env, "PYTHONHASHSEED": "0"}, cwd=cwd, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    found = [ln for ln in p.stderr.splitlines() if "Collected :" in ln]
    return int(found[-1].rsplit(":", 1)[1]) if found and p.returncode == 0 else None


def _stats(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the other code tree (a directory holding ckpt_archive/)")
    ap.add_argument("--this-tree", default=str(HERE.parent))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--work", default=None, help="scratch directory (default: a fresh temporary one)")
    ap.add_argument("--commands", default="bare,help,list,verify,status,pack")
    ap.add_argument("--json", action="store_true", help="run list / verify / status with --json")
    ap.add_argument("--instructions", action="store_true",
                    help="also count each command's instructions once per tree under valgrind (load-independent)")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="compile the package's sources on every run (PYTHONDONTWRITEBYTECODE=1)")
    a = ap.parse_args()
    trees = {"this": str(Path(a.this_tree).resolve()), "base": str(Path(a.baseline).resolve())}
    work = Path(a.work or tempfile.mkdtemp(prefix="ckpt-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    envs = {k: {**os.environ, "PYTHONPATH": v} for k, v in trees.items()}
    for k, env in envs.items():
        if a.no_bytecode:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(work / f"pycache-{k}")
            subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", trees[k] + "/ckpt_archive"],
                           env=env, check=True, stdout=subprocess.DEVNULL)
    src = work / "small-adam.pt"
    if not src.exists():
        subprocess.run([sys.executable, "-c", (
            "import torch,sys; m=torch.nn.Linear(16,16); o=torch.optim.Adam(m.parameters()); "
            "m(torch.randn(2,16)).sum().backward(); o.step(); "
            "torch.save({'model': m.state_dict(), 'optimizer': o.state_dict(), 'step': 1}, sys.argv[1])"),
            str(src)], check=True)
    repos = {k: work / f"repo-{k}" for k in trees}
    for k, r in repos.items():
        shutil.rmtree(r, ignore_errors=True)
        timed([sys.executable, "-m", "ckpt_archive", "pack", str(src), "--repo", str(r), "--json"], envs[k], work)
    cli = [sys.executable, "-m", "ckpt_archive"]

    def argv(cmd: str, side: str) -> list[str]:
        repo = str(repos[side])
        if cmd == "bare":
            return [sys.executable, "-c", "pass"]
        if cmd == "help":
            return cli + ["--help"]
        if cmd == "pack":
            fresh = work / f"fresh-{side}"
            shutil.rmtree(fresh, ignore_errors=True)
            return cli + ["pack", str(src), "--repo", str(fresh), "--json"]
        return cli + [cmd, repo] + (["--json"] if a.json else [])

    doc = {"trees": trees, "reps": a.reps, "python": sys.version.split()[0], "commands": {},
           "bytecode": not a.no_bytecode, "json": a.json,
           "started": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())}
    loads = []
    for cmd in a.commands.split(","):
        cpu = {k: [] for k in trees}
        wall = {k: [] for k in trees}
        for rep in range(a.reps):
            for side in (("this", "base") if rep % 2 == 0 else ("base", "this")):
                c, w = timed(argv(cmd, side), envs[side], work)
                cpu[side].append(c)
                wall[side].append(w)
            loads.append(os.getloadavg()[0])
        row = {"cpu_s": cpu, "wall_s": wall,
               "cpu_this_minus_base_s": statistics.median(t - b for t, b in zip(cpu["this"], cpu["base"]))}
        if cmd != "bare":
            row["imports"] = {}
            for side in trees:
                probe_argv = [sys.executable, "-c", PROBE] + argv(cmd, side)[3:]
                out = subprocess.run(probe_argv, env=envs[side], capture_output=True, text=True, cwd=work)
                if f"{trees[side]}/ckpt_archive" not in out.stderr:
                    raise SystemExit(f"{side}: the probe imported another tree's ckpt_archive:\n{out.stderr[-800:]}")
                line = [ln for ln in out.stderr.splitlines() if ln.startswith("MODULES")][-1]
                row["imports"][side] = [m for m in line.split(" ", 1)[1].split(",") if m]
        if a.instructions:
            row["instructions"] = {side: instructions(argv(cmd, side), envs[side], work) for side in trees}
        doc["commands"][cmd] = row
        print(f"{cmd:7s} CPU s this {_stats(cpu['this'])} | base {_stats(cpu['base'])} | median paired diff "
              f"{row['cpu_this_minus_base_s']:+.3f}; wall this {_stats(wall['this'])} | base {_stats(wall['base'])}"
              + (f"; imports this {row['imports']['this']} base {row['imports']['base']}" if "imports" in row else "")
              + (f"; instructions this {row['instructions']['this']} base {row['instructions']['base']}"
                 if "instructions" in row else ""),
              flush=True)
    if "bare" in doc["commands"] and "pack" in doc["commands"]:
        for side in trees:
            above = statistics.median(p - b for p, b in zip(doc["commands"]["pack"]["cpu_s"][side],
                                                            doc["commands"]["bare"]["cpu_s"][side]))
            doc.setdefault("pack_above_interpreter_cpu_s", {})[side] = above
            print(f"pack above the interpreter, median paired CPU s, {side}: {above:.3f}")
    doc["loadavg"] = loads
    print(f"load average (1 min) during the run: {_stats(loads)}")
    out = HERE / "results" / f"{doc['started']}-startup{'-json' if a.json else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
