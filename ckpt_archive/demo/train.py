"""The demo's training project: small enough to run in a second, real enough to break a resume.

24 synthetic rows (2 inputs -> 1 target), an MLP 2->8->1 (33 parameters) with dropout 0.25, float64,
one torch thread, CPU, batch 4, Adam lr 0.03, StepLR(step_size=3, gamma=0.5). Three random streams
all matter to the trajectory:

* Python ``random`` applies a slight gain to each batch's inputs;
* a NumPy PCG64 generator makes the data noise and a fresh permutation of the rows every epoch;
* torch makes the initial weights and the dropout masks.

It follows the check-resume contract (``docs/check-resume.md``)::

    python -m ckpt_archive.demo.train --steps N --output DIR [--resume-from FILE] [--omit-rng-restore]

It adds ``N`` optimizer updates, records them with :class:`ckpt_archive.resume.trajectory.Trajectory`, and
writes ``DIR/checkpoint.pt`` after the last complete update: ``model``, ``optimizer``,
``scheduler``, ``rng`` (``python``, ``numpy``, ``torch``), ``data`` (``permutation``, ``cursor``,
``epoch``), ``progress`` (``step``, ``epoch``, ``samples_seen``) and ``config``, all taken at one
instant. The checkpoint is read back with ``torch.load(weights_only=True)`` only.

``--omit-rng-restore`` is the script-side negative control: it restores everything except the three
random streams, so the resumed run must diverge.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

CONFIG = {
    "seed": 1234, "rows": 24, "inputs": 2, "hidden": 8, "dropout": 0.25, "batch_size": 4,
    "lr": 0.03, "step_size": 3, "gamma": 0.5, "gain_jitter": 0.02, "noise_std": 0.05,
    "dtype": "float64",
}


def build(config: dict):
    """Build data, model, optimizer, scheduler and the NumPy generator from ``config``, freshly seeded.

    Returns:
        (x, y, model, optimizer, scheduler, np_rng): x float64 [rows, 2], y float64 [rows, 1].
    """
    import numpy as np
    import torch

    torch.set_num_threads(1)
    random.seed(config["seed"])
    np_rng = np.random.Generator(np.random.PCG64(config["seed"]))
    torch.manual_seed(config["seed"])
    rows = config["rows"]
    x_np = np_rng.uniform(-1.0, 1.0, size=(rows, config["inputs"]))
    noise = np_rng.normal(0.0, config["noise_std"], size=rows)
    y_np = np.sin(2.0 * x_np[:, 0]) + 0.5 * x_np[:, 1] + noise
    x = torch.tensor(x_np, dtype=torch.float64)
    y = torch.tensor(y_np, dtype=torch.float64).unsqueeze(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(config["inputs"], config["hidden"]),
        torch.nn.Tanh(),
        torch.nn.Dropout(config["dropout"]),
        torch.nn.Linear(config["hidden"], 1),
    ).to(torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=config["step_size"], gamma=config["gamma"])
    return x, y, model, optimizer, scheduler, np_rng


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt_archive.demo.train", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="optimizer updates this run adds")
    p.add_argument("--output", required=True, help="folder for checkpoint.pt and trajectory.json")
    p.add_argument("--resume-from", default=None, help="a checkpoint .pt to resume from")
    p.add_argument("--omit-rng-restore", action="store_true",
                   help="negative control: restore everything except the random streams")
    args = p.parse_args(argv)

    import torch

    from ckpt_archive.resume.trajectory import CHECKPOINT_FILE, Trajectory

    config = dict(CONFIG)
    x, y, model, optimizer, scheduler, np_rng = build(config)
    rows, batch = config["rows"], config["batch_size"]
    step, epoch, cursor, samples_seen = 0, 0, rows, 0
    permutation: list[int] = []

    if args.resume_from:
        state = torch.load(args.resume_from, map_location="cpu", weights_only=True)
        # Order matters: model and optimizer, then the scheduler (built above on the optimizer),
        # then data position and progress, random streams last.
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        permutation = [int(i) for i in state["data"]["permutation"]]
        cursor = int(state["data"]["cursor"])
        epoch = int(state["data"]["epoch"])
        step = int(state["progress"]["step"])
        samples_seen = int(state["progress"]["samples_seen"])
        if not args.omit_rng_restore:
            random.setstate(state["rng"]["python"])
            np_rng.bit_generator.state = state["rng"]["numpy"]
            torch.set_rng_state(state["rng"]["torch"])

    traj = Trajectory(args.output, meta={"script": "ckpt_archive.demo.train", "config": config,
                                         "resumed_from_step": step if args.resume_from else None,
                                         "omit_rng_restore": bool(args.omit_rng_restore)})
    loss_fn = torch.nn.MSELoss()
    model.train()
    for _ in range(args.steps):
        if cursor >= len(permutation):
            if permutation:
                epoch += 1
            permutation = np_rng.permutation(rows).tolist()
            cursor = 0
        ids = permutation[cursor:cursor + batch]
        cursor += len(ids)
        gain = 1.0 + config["gain_jitter"] * (random.random() - 0.5)
        xb = x[ids] * gain
        yb = y[ids]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        optimizer.step()
        step += 1
        samples_seen += len(ids)
        traj.record(step=step, sample_ids=ids, loss=loss.item(), optimizer=optimizer, epoch=epoch)
        scheduler.step()

    # One instant: after a complete optimizer step and its scheduler step.
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np_rng.bit_generator.state,
                "torch": torch.get_rng_state()},
        "data": {"permutation": list(permutation), "cursor": cursor, "epoch": epoch},
        "progress": {"step": step, "epoch": epoch, "samples_seen": samples_seen},
        "config": config,
    }
    path = os.path.join(args.output, CHECKPOINT_FILE)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    traj.finish(model=model, optimizer=optimizer, numpy_generator=np_rng)
    last = traj.updates[-1]["loss"] if traj.updates else float("nan")
    print(f"step {step}: loss {last}, cursor {cursor}/{rows}, "
          f"epoch {epoch}, next lr {optimizer.param_groups[0]['lr']}", file=sys.stderr)
    return 0


__all__ = ["CONFIG", "build", "main"]


if __name__ == "__main__":
    sys.exit(main())
