"""Issue 12: a data cursor across several resumes in one epoch. 12 samples, batch 2 (6 updates per epoch),
a seeded NumPy generator shuffles every epoch; a one-parameter model learns the mean of the batch targets.

A check-resume script: ``--steps N --output DIR [--resume-from FILE]`` plus
``--cursor-since-resume``: the bug under test. The saved cursor counts the batches *since the last resume*
(times the batch size) instead of the position in the epoch. After one interruption the two agree (the
run started at the epoch's start); after a second interruption in the same epoch the cursor is too small
and the resumed run replays samples it has already seen.
``--steps-is-total``: ``--steps`` is the global update to stop at (for the ``{total_steps}`` placeholder).
``--refuse-odd-cursor``: refuse (exit 1) a state whose cursor is not on a batch boundary (as the
data-cursor negative control makes it): the control's run fails instead of training.
``--short-resume``: a resumed run stops after 2 updates and exits 0 (a run that did not do what it was
asked); ``--short-on-odd-cursor``: only when the cursor is off a batch boundary (the data-cursor control's run).
``--rollover-at-end``: start the next epoch (new permutation, cursor 0, epoch + 1) right after an epoch's last
batch rather than before the next batch, so a checkpoint on an epoch boundary says cursor 0 of the next epoch.
"""
import argparse
import os
import sys

import numpy as np
import torch

from ckpt_archive import Trajectory
from ckpt_archive.resume.trajectory import CHECKPOINT_FILE

N, BATCH = 12, 2
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--output", required=True)
p.add_argument("--resume-from")
p.add_argument("--cursor-since-resume", action="store_true")
p.add_argument("--steps-is-total", action="store_true")
p.add_argument("--refuse-odd-cursor", action="store_true")
p.add_argument("--short-resume", action="store_true")
p.add_argument("--short-on-odd-cursor", action="store_true")
p.add_argument("--rollover-at-end", action="store_true")
args = p.parse_args()

torch.manual_seed(3)
rng = np.random.Generator(np.random.PCG64(3))
targets = np.linspace(-1.0, 1.0, N)
w = torch.zeros((), dtype=torch.float64)
lr = 0.1
step, epoch, pos, perm = 0, 0, N, []
if args.resume_from:
    st = torch.load(args.resume_from, weights_only=True)
    if args.refuse_odd_cursor and st["data"]["cursor"] % BATCH:
        sys.exit(f"refusing the checkpoint: data.cursor {st['data']['cursor']} is not on a batch boundary")
    w = st["model"]["w"].clone()
    step, epoch = st["progress"]["step"], st["progress"]["epoch"]
    rng.bit_generator.state = st["rng"]["numpy"]
    perm, pos = list(st["data"]["permutation"]), st["data"]["cursor"]
    torch.set_rng_state(st["rng"]["torch"])
batches_this_run = 0  # in the current epoch, since this process started

todo = args.steps - step if args.steps_is_total else args.steps
if args.resume_from and (args.short_resume or (args.short_on_odd_cursor and pos % BATCH)):
    todo = min(todo, 2)
traj = Trajectory(args.output)
for _ in range(todo):
    if pos >= len(perm):
        if perm:
            epoch += 1
        perm, pos, batches_this_run = [int(i) for i in rng.permutation(N)], 0, 0
    ids = perm[pos:pos + BATCH]
    pos += BATCH
    batches_this_run += 1
    y = float(targets[ids].mean())
    loss = (float(w) - y) ** 2
    w = w - lr * 2.0 * (w - y)
    step += 1
    traj.record(step=step, sample_ids=ids, loss=loss, lr=[lr], epoch=epoch)
    if args.rollover_at_end and pos >= len(perm):
        epoch += 1
        perm, pos, batches_this_run = [int(i) for i in rng.permutation(N)], 0, 0

cursor = batches_this_run * BATCH if args.cursor_since_resume else pos
torch.save({"model": {"w": w}, "rng": {"numpy": rng.bit_generator.state, "torch": torch.get_rng_state()},
            "data": {"permutation": perm, "cursor": cursor, "epoch": epoch},
            "progress": {"step": step, "epoch": epoch}}, os.path.join(args.output, CHECKPOINT_FILE))
traj.finish(numpy_generator=rng)
sys.exit(0)
