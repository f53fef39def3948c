"""The demo: a tiny, real training project and the end-to-end resume proof built on it.

* :mod:`ckpt_archive.demo.train`: the training script (24 synthetic rows, an MLP 2->8->1 with
  dropout, Adam + StepLR, three random streams). It follows the check-resume contract
  (``docs/check-resume.md``): ``--steps N --output DIR [--resume-from FILE] [--omit-rng-restore]``.
* :func:`ckpt_archive.demo.run.run_demo`: runs the continuous, interrupted, resumed and negative
  control runs through :func:`ckpt_archive.resume.check.check_resume` and writes the proof.
"""
from __future__ import annotations

#: Known facts the proof shows (checked by the test suite).
STEPS = 10
INTERRUPT_AT = 5
ROWS = 24
BATCH = 4


__all__ = ["STEPS", "INTERRUPT_AT", "ROWS", "BATCH"]
