"""Issue 5, case 5: mid-epoch data order. 10 samples, batch 2, a seeded NumPy generator shuffles every
epoch; a one-parameter model learns the mean of the batch targets.

A check-resume script: ``--steps N --output DIR [--resume-from FILE] [--restore-generator-only]``.
``--restore-generator-only`` is the bug under test: on resume it restores the generator state (and the
weights and counters) but neither the permutation nor the cursor, so the interrupted epoch starts over
with a fresh permutation. The checkpoint also carries ``rng.torch`` (seeded), which the script never draws from.
"""
import argparse
import os
import sys

import numpy as np
import torch

from ckpt_archive import Trajectory  # the public import users' scripts rely on
from ckpt_archive.resume.trajectory import CHECKPOINT_FILE

N, BATCH = 10, 2
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--output", required=True)
p.add_argument("--resume-from")
p.add_argument("--restore-generator-only", action="store_true")
args = p.parse_args()

torch.manual_seed(7)  # seeded like everything else, though this script never draws from torch
rng = np.random.Generator(np.random.PCG64(7))
targets = np.linspace(-1.0, 1.0, N)
w = torch.zeros((), dtype=torch.float64)
lr = 0.1
step, epoch, cursor, perm = 0, 0, N, []
if args.resume_from:
    st = torch.load(args.resume_from, weights_only=True)
    w = st["model"]["w"].clone()
    step, epoch = st["progress"]["step"], st["progress"]["epoch"]
    rng.bit_generator.state = st["rng"]["numpy"]
    if not args.restore_generator_only:
        perm, cursor = list(st["data"]["permutation"]), st["data"]["cursor"]
        torch.set_rng_state(st["rng"]["torch"])

traj = Trajectory(args.output)
for _ in range(args.steps):
    if cursor >= len(perm):
        if perm:
            epoch += 1
        perm, cursor = [int(i) for i in rng.permutation(N)], 0
    ids = perm[cursor:cursor + BATCH]
    cursor += BATCH
    y = float(targets[ids].mean())
    loss = (float(w) - y) ** 2
    w = w - lr * 2.0 * (w - y)
    step += 1
    traj.record(step=step, sample_ids=ids, loss=loss, lr=[lr], epoch=epoch)

torch.save({"model": {"w": w}, "rng": {"numpy": rng.bit_generator.state, "torch": torch.get_rng_state()},
            "data": {"permutation": perm, "cursor": cursor, "epoch": epoch},
            "progress": {"step": step, "epoch": epoch}}, os.path.join(args.output, CHECKPOINT_FILE))
traj.finish(numpy_generator=rng)
sys.exit(0)
