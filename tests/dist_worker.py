"""One rank of the distributed Checkpointer tests (started by torchrun, or by tests/test_checkpointer_distributed.py
with the same environment variables for the killed-rank case).

    python tests/dist_worker.py SCENARIO KIND REPO OUT

SCENARIO: ``save`` (two saves, the live state mutated right after each), ``restore`` (fresh objects restored
from the latest generation, compared with what ``save`` recorded), ``kill`` (the second save's rank 1 is
SIGKILLed while writing a member), ``desync`` (one rank's ``save(2)`` raises before its copy is handed over,
or one rank's previous save failed alone: both ranks go on saving steps 3 and 4; KIND names the case, see
:func:`desync`). KIND: ``ddp`` (replicated full tensors) or ``fsdp`` (FSDP2 ``fully_shard``:
DTensor shards). Every rank writes ``OUT/rank<R>.json`` (results) and, for ``save``, ``OUT/expected-<R>.pt``.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def build(kind: str, world: int, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, steps: int, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def flat_full(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat_full(v, f"{prefix}{k}/"))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = full(v)
    return out


def desync(case: str, repo: str, rank: int) -> dict:
    """Steps 1-4 saved by every rank; one rank's save(2) goes wrong as ``case`` says:
    ``at-POINT``: rank 1's save(2) is interrupted at the Checkpointer's point POINT (a signal handler's
    exception); ``bad-metrics``: rank 1's save(2) is given metrics it refuses; ``rank0-fails-after-publish``:
    rank 0's save(2) fails alone, after its generation was published (the others' succeeded)."""
    import time

    from ckpt_archive.repo.repository import Repository
    from ckpt_archive.store.faults import Faults
    from ckpt_archive.training import checkpointer as ck

    real = ck.Checkpointer._write

    def slow(self, rec):  # each save still in flight when the next one starts (its wait is interrupted)
        time.sleep(0.3)
        return real(self, rec)

    ck.Checkpointer._write = slow
    target = repo
    if case == "rank0-fails-after-publish" and rank == 0:
        Repository.open(repo, create=True)
        target = Repository.open(repo, faults=Faults.parse("after-publish=raise@2"))
    dist.barrier()
    ckpt = ck.Checkpointer(target, timeout=30)
    log = []
    for step in (1, 2, 3, 4):
        state = {"model": {"w": torch.full((64,), float(step))}, "mine": torch.full((8,), float(10 * step + rank)),
                 "step": step}
        metrics = {"loss": 1.0}
        if rank == 1 and step == 2 and case.startswith("at-"):
            point = case[3:]

            def hook(p, fired=[]):
                if p == point and not fired:
                    fired.append(p)
                    raise KeyboardInterrupt("a signal handler's exception")

            ck._HOOK = hook
        if rank == 1 and step == 2 and case == "bad-metrics":
            metrics = {"loss": object()}
        try:
            ckpt.save(step, state, metrics)
            log.append([step, "ok", ""])
        except BaseException as exc:  # noqa: BLE001 - recorded
            log.append([step, type(exc).__name__, str(exc) + " ".join(getattr(exc, "__notes__", []))])
        ck._HOOK = None
    try:
        ckpt.close()
        log.append(["close", "ok", ""])
    except BaseException as exc:  # noqa: BLE001
        log.append(["close", type(exc).__name__, str(exc)])
    ck.Checkpointer._write = real
    return {"log": log}


def main() -> None:
    scenario, kind, repo, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "desync":
        results = {}
        for case in kind.split(","):
            results[case] = desync(case, os.path.join(repo, case), rank)
        with open(os.path.join(out, f"desync-rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
        dist.destroy_process_group()
        return
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckpt_archive
    from ckpt_archive.repo.repository import Repository
    from ckpt_archive.store.faults import Faults

    result: dict = {"rank": rank}
    try:
        model, opt = build(kind, world)
        if scenario in ("save", "kill"):
            torch.manual_seed(1000 + rank)  # per-rank RNG streams, as data-parallel jobs have
            target = repo
            if scenario == "kill" and rank == 1:
                target = Repository.open(repo, faults=Faults.parse("member-write=kill@2"))
            ckpt = ckpt_archive.Checkpointer(target, timeout=60)
            blocked = []
            for step in (2, 4):
                train(model, opt, 2, rank)
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optimizer": osd, "rng": {"torch": torch.get_rng_state()},
                         "progress": {"step": step}}
                expected = {**{f"model/{k}": v for k, v in flat_full(msd).items()},
                            **{f"optimizer/{k}": v for k, v in flat_full(osd).items()},
                            "rng/torch": torch.get_rng_state().clone()}
                try:
                    h = ckpt.save(step, state)
                except Exception as exc:  # the previous save failed (kill scenario)
                    result["error"] = f"{type(exc).__name__}: {exc}"
                    break
                blocked.append(h.blocked_s)
                with torch.no_grad():  # the loop goes on at once: the archive must not see this
                    for p in model.parameters():
                        p.mul_(-2.0)
                torch.rand(5)
                if scenario == "save":
                    torch.save(expected, os.path.join(out, f"expected-{step}-{rank}.pt"))
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(-0.5)  # undo, so training continues from the saved values
            try:
                res = ckpt.close()
                result["generation"] = res.generation if res else None
            except Exception as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["blocked_s"] = blocked
        elif scenario == "restore":
            model, opt = build(kind, world, seed=7)  # different initial values
            with ckpt_archive.Checkpointer(repo, timeout=60) as ckpt:
                got = ckpt.restore(model=model, optimizer=opt, policy="checkpoint")
            msd, osd = get_state_dict(model, opt)
            live = {**{f"model/{k}": v for k, v in flat_full(msd).items()},
                    **{f"optimizer/{k}": v for k, v in flat_full(osd).items()},
                    "rng/torch": torch.get_rng_state()}
            src = rank if rank < int(sys.argv[5]) else 0
            expected = torch.load(os.path.join(out, f"expected-{got.step}-{src}.pt"), weights_only=True)
            result["step"] = got.step
            result["missing"] = sorted(set(expected) - set(live))
            result["mismatch"] = sorted(k for k in expected if k in live and not torch.equal(expected[k], live[k]))
            result["warnings"] = got.report.warnings
            result["restored"] = got.report.restored
    except Exception:
        result["crash"] = traceback.format_exc()
    with open(os.path.join(out, f"{scenario}-rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
