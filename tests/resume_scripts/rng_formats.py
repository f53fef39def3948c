"""A correct resume whose checkpoint holds every random-stream format docs/check-resume.md lists.

A check-resume script: ``--steps N --output DIR [--resume-from FILE]``. Each update draws from all of
them, so perturbing any one changes the run:

* ``rng.python``: ``random.getstate()`` with a cached Gaussian (``random.gauss`` draws pairs);
* ``rng.numpy_legacy``: the legacy ``np.random.get_state()`` tuple with its array as ``.tolist()``;
* ``rng.numpy``: ``generator.bit_generator.state`` of PCG64 (all ints), and of MT19937, SFC64 and
  Philox (whose states hold arrays, saved as ``.tolist()``: ``weights_only=True`` refuses arrays);
* ``rng.torch``: ``torch.get_rng_state()``.
"""
import argparse
import os
import random
import sys

import numpy as np
import torch

from ckpt_archive import Trajectory
from ckpt_archive.resume.trajectory import CHECKPOINT_FILE

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--output", required=True)
p.add_argument("--resume-from")
args = p.parse_args()

BITGENS = ("PCG64", "MT19937", "SFC64", "Philox")


def plain(x):
    """A bit_generator.state with its arrays as lists (what weights_only=True loads)."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x.tolist() if isinstance(x, np.ndarray) else x


def as_arrays(saved, template):
    """The saved state with lists back as arrays of the dtype a fresh state of that generator has."""
    if isinstance(template, dict):
        return {k: as_arrays(saved[k], template[k]) for k in template}
    return np.array(saved, dtype=template.dtype) if isinstance(template, np.ndarray) else saved


torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
gens = {name: np.random.Generator(getattr(np.random, name)(i + 1)) for i, name in enumerate(BITGENS)}
w = torch.zeros((), dtype=torch.float64)
step = 0
if args.resume_from:
    st = torch.load(args.resume_from, weights_only=True)
    w, step = st["model"]["w"], st["progress"]["step"]
    for name, g in gens.items():
        g.bit_generator.state = as_arrays(st["rng"]["numpy"][name], g.bit_generator.state)
    s = st["rng"]["numpy_legacy"]
    np.random.set_state((s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]))
    random.setstate(st["rng"]["python"])
    torch.set_rng_state(st["rng"]["torch"])

traj = Trajectory(args.output)
for _ in range(args.steps):
    ids = np.random.permutation(10)[:2].tolist()
    noise = sum(float(g.random()) for g in gens.values()) + random.gauss(0.0, 1.0) + float(torch.rand(()))
    y = sum(ids) / 2.0 + noise
    loss = (float(w) - y) ** 2
    w = w - 0.1 * 2 * (w - y)
    step += 1
    traj.record(step=step, sample_ids=ids, loss=loss, lr=[0.1])

s = np.random.get_state()
torch.save({"model": {"w": w}, "progress": {"step": step},
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                    "numpy_legacy": (s[0], s[1].tolist(), s[2], s[3], s[4]),
                    "numpy": {name: plain(g.bit_generator.state) for name, g in gens.items()}}},
           os.path.join(args.output, CHECKPOINT_FILE))
traj.finish(numpy_generator=np.random)
sys.exit(0)
