"""Issue 27: a label map built in an order that is not fixed. 8 rows, each a class name; the label of a row is
its class's position in ``labels``, a map built from the classes in an order that differs from process to process
(here: seeded by the run's output folder name, so that the continuous and interrupted runs differ every time, as
``list(set(names))`` does under ``PYTHONHASHSEED=random``). The sample ids are the same in every run; the labels
behind them are not, so the loss differs from update 1.

A check-resume script: ``--steps N --output DIR [--resume-from FILE]``; ``--record-ids`` records the label map
with ``Trajectory(data_ids=...)``; ``--sorted`` builds it in sorted order (the fix).
"""
import argparse
import random
from pathlib import Path

import torch

from ckpt_archive import Trajectory
from ckpt_archive.resume.trajectory import CHECKPOINT_FILE

CLASSES = ["bird", "cat", "cow", "dog", "fish", "fox", "horse", "owl"]
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--output", required=True)
p.add_argument("--resume-from")
p.add_argument("--record-ids", action="store_true")
p.add_argument("--sorted", action="store_true")
args = p.parse_args()

names = list(CLASSES)
if not args.sorted:
    random.Random(Path(args.output).name).shuffle(names)  # stands for list(set(CLASSES)) under a random hash seed
labels = {name: i for i, name in enumerate(names)}
rows = [CLASSES[i % len(CLASSES)] for i in range(8)]
torch.manual_seed(0)
w = torch.zeros((), dtype=torch.float64)
step = 0
if args.resume_from:
    st = torch.load(args.resume_from, weights_only=True)
    w, step = st["model"]["w"].clone(), st["progress"]["step"]
traj = Trajectory(args.output, data_ids=labels if args.record_ids else None)
for _ in range(args.steps):
    i = step % len(rows)
    y = torch.tensor(float(labels[rows[i]]), dtype=torch.float64)
    loss = (w - y) ** 2
    w = w - 0.1 * 2 * (w - y)
    step += 1
    traj.record(step=step, sample_ids=[i], loss=float(loss), lr=[0.1])
torch.save({"model": {"w": w}, "progress": {"step": step}}, Path(args.output) / CHECKPOINT_FILE)
traj.finish()
