"""The demo's training script with a classic resume bug: the LR scheduler's state is never restored
(``StepLR.load_state_dict`` does nothing), so the scheduler restarts its count after a resume."""
import sys

import torch

torch.optim.lr_scheduler.StepLR.load_state_dict = lambda self, state_dict: None

from ckpt_archive.demo.train import main  # noqa: E402

sys.exit(main())
