"""The Checkpointer on a real GPU: correctness checks, then blocked time and time to usable for a large state.

    python benchmarks/gpu_checkpointer.py --gib 10 --reps 3        # needs CUDA; ~5 min on one H100/H200

Checks (each prints PASS/FAIL; exit 1 on any FAIL, 2 without CUDA):
1. a CUDA model + AdamW + GradScaler (``torch.amp``), bf16 and fp16 tensors: ``save`` returns, the live
   tensors are changed on the GPU at once, and the archive holds the values at ``save`` time, bit for bit;
2. the snapshot's buffers for CUDA tensors are pinned, and reused by the next save (no new allocation);
3. the manifest records ``cuda:N`` for tensors that lived there;
4. the CUDA RNG state of every visible device, the GradScaler state and bf16/fp16 tensors round-trip
   through ``Checkpointer.restore``;
5. restoring on fewer visible devices (a subprocess with ``CUDA_VISIBLE_DEVICES`` emptied) restores the
   rest, and the report says how many CUDA RNG states were saved and how many devices were visible.

Then a ``--gib`` GiB state of bf16/fp32 tensors on the GPU: ``save`` blocked time (device -> pinned host),
against a bare ``.to("cpu")`` of the same tensors, and the time until the generation is usable.
Write the figures into benchmarks/README.md ("Checkpointer" section).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAILS: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILS.append(name)


def correctness(workdir: Path) -> None:
    import torch

    import ckpt_archive
    from ckpt_archive.training.snapshot import DEVICE_ATTR  # noqa: F401 (documents what check 3 relies on)

    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(torch.randn(16, 64, device=dev)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    extra = {"bf16": torch.randn(33, 7, device=dev).bfloat16(), "f16": torch.randn(129, device=dev).half()}
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
             "extra": extra, "rng": rng, "progress": {"step": 3}}
    expect = {"w": model[0].weight.detach().cpu().clone(), "bf16": extra["bf16"].cpu().clone(),
              "m": opt.state[model[0].weight]["exp_avg"].cpu().clone()}
    repo = workdir / "gpu-repo"
    ckpt = ckpt_archive.Checkpointer(repo)
    h = ckpt.save(3, state)
    with torch.no_grad():  # the loop goes on at once, on the GPU
        model[0].weight.mul_(-3)
        extra["bf16"].zero_()
        opt.state[model[0].weight]["exp_avg"].add_(1)
    res = h.result()
    got = ckpt_archive.load(repo, res.generation)
    check("archive holds the values at save time (weights, bf16, Adam moment)",
          torch.equal(got["model"]["0.weight"], expect["w"]) and torch.equal(got["extra"]["bf16"], expect["bf16"])
          and torch.equal(got["optimizer"]["state"][0]["exp_avg"], expect["m"]))
    bufs = list(ckpt._snap._buffers.values())
    check("CUDA tensors are copied into pinned host buffers", all(getattr(b, "is_pinned", lambda: True)() for b in bufs),
          f"{len(bufs)} buffers")
    h2 = ckpt.save(4, state)
    check("the second save reuses the pinned buffers", ckpt._snap.last.allocated_bytes == 0,
          f"allocated {ckpt._snap.last.allocated_bytes} B")
    h2.result()
    devs = {rec.get("device") for rec in res.manifest["tensors"].values()}
    check("manifest records the CUDA device", "cuda:0" in devs, str(devs))
    # restore into fresh objects
    torch.manual_seed(1)
    m2 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dev)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    s2 = torch.amp.GradScaler("cuda")
    torch.cuda.manual_seed_all(999)
    r = ckpt.restore(model=m2, optimizer=o2, scaler=s2, generation=res.generation, policy="checkpoint")
    check("GradScaler state round-trips", s2.state_dict() == {k: v for k, v in scaler.state_dict().items()},
          str(s2.state_dict()))
    check("CUDA RNG state of every device round-trips",
          all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), rng["cuda"])),
          f"{len(rng['cuda'])} devices; report {r.report.rng}")
    check("bf16 / fp16 tensors round-trip", r.state["extra"]["bf16"].dtype == torch.bfloat16
          and torch.equal(r.state["extra"]["f16"], extra["f16"].cpu()))
    ckpt.close()
    # fewer visible devices
    code = ("import ckpt_archive,json,sys;c=ckpt_archive.Checkpointer(sys.argv[1]);"
            "r=c.restore(generation=int(sys.argv[2]));print(json.dumps({'w':r.report.warnings,'b':r.report.bitwise_resumable}))")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code, str(repo), str(res.generation)], env=env, capture_output=True,
                         text=True, timeout=300)
    rep = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"w": [out.stderr[-500:]], "b": None}
    n = len(rng["cuda"])
    check("restore on fewer visible devices says what happened to the extra RNG states",
          any(f"{n} saved, 0 visible" in w for w in rep["w"]) and rep["b"] is False, str(rep))


def large(workdir: Path, gib: float, reps: int) -> dict:
    import torch

    import ckpt_archive

    dev = torch.device("cuda:0")
    n_tensors = 64
    per = int(gib * 2**30 / n_tensors)
    state = {}
    for i in range(n_tensors):
        if i % 5 == 0:
            state[f"w{i}"] = torch.randn(per // 2, device=dev).bfloat16()
        else:
            state[f"m{i}"] = torch.randn(per // 4, device=dev) * 1e-3
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows: dict[str, list[float]] = {"to_cpu": [], "save_blocked": [], "to_usable": []}
    repo = workdir / "gpu-large"
    with ckpt_archive.Checkpointer(repo, retention=ckpt_archive.RetentionPolicy(keep_last=1)) as ckpt:
        ckpt.save(0, state, block=True)  # allocates the pinned buffers once
        for rep in range(reps):
            t0 = time.perf_counter()
            host = {k: v.to("cpu") for k, v in state.items()}
            torch.cuda.synchronize()
            rows["to_cpu"].append(time.perf_counter() - t0)
            del host
            h = ckpt.save(rep + 1, state)
            rows["save_blocked"].append(h.blocked_s)
            t0 = time.perf_counter()
            ckpt.wait()
            rows["to_usable"].append(h.snapshot_s + time.perf_counter() - t0)
            print(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rows.items()), flush=True)
    return {"bytes": nbytes, "seconds": rows, "median": {k: statistics.median(v) for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked", file=sys.stderr)
        sys.exit(2)
    print(f"devices: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}, "
          f"torch {torch.__version__}, loadavg {os.getloadavg()}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="ckpt-gpu-"))
    correctness(workdir)
    if not args.skip_large:
        res = large(workdir, args.gib, args.reps)
        m = res["median"]
        print(json.dumps(res))
        print(f"\n| state | bare .to('cpu') | save blocked | blocked / copy | to usable |\n|---|---|---|---|---|\n"
              f"| {res['bytes'] / 2**30:.1f} GiB | {m['to_cpu']:.2f} s | {m['save_blocked']:.2f} s | "
              f"{m['save_blocked'] / m['to_cpu']:.2f} | {m['to_usable']:.1f} s |")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
