"""Issue 11: an unmodified MultiStepLR training script (milestones at updates 3 and 7, gamma 0.5).

``MultiStepLR.state_dict()["milestones"]`` is a ``collections.Counter``; ``step()`` calls
``self.milestones[...]`` and ``load_state_dict`` keeps whatever type it is given, so an archive that
gives back a ``dict`` breaks the resumed run. A check-resume script: ``--steps N --output DIR
[--resume-from FILE]``, SGD with momentum (the optimizer holds moments), batches from the torch RNG,
checkpoint with ``model``, ``optimizer``, ``scheduler``, ``rng.torch`` and ``progress``.
"""
import argparse
import os
import sys

import torch

from ckpt_archive.resume.trajectory import CHECKPOINT_FILE, Trajectory

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--output", required=True)
p.add_argument("--resume-from")
args = p.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).to(torch.float64)
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 7], gamma=0.5)
step = 0
if args.resume_from:
    st = torch.load(args.resume_from, weights_only=True)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    step = st["progress"]["step"]
    torch.set_rng_state(st["rng"]["torch"])

traj = Trajectory(args.output)
for _ in range(args.steps):
    x = torch.randn(8, 4, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    step += 1
    traj.record(step=step, sample_ids=range((step - 1) * 8, step * 8), loss=loss.item(), optimizer=opt)
    sched.step()

torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": {"torch": torch.get_rng_state()}, "progress": {"step": step}},
           os.path.join(args.output, CHECKPOINT_FILE))
traj.finish(model=model, optimizer=opt)
sys.exit(0)
