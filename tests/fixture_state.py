"""The deterministic state frozen in tests/fixtures/v1-basic (no RNG: identical on every torch version)."""
from __future__ import annotations

import collections


def fixture_state():
    import numpy as np
    import torch

    w = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    sd = collections.OrderedDict(weight=w, tied=w, bias=torch.arange(4, dtype=torch.bfloat16),
                                 mask=torch.tensor([True, False, True]), half=torch.arange(5, dtype=torch.float16),
                                 count=torch.tensor(9, dtype=torch.int64))
    sd._metadata = collections.OrderedDict({"": {"version": 1}})
    return {
        "model": sd,
        "optimizer": {"state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.linspace(0, 1, 24).reshape(4, 6)}},
                      "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}]},
        "scheduler": {"last_epoch": 12, "base_lrs": [0.001], "_last_lr": [0.0005]},
        "rng": {"python": (3, tuple(range(624)) + (624,), None),
                "numpy": {"bit_generator": "PCG64", "state": {"state": 2**127 + 12345, "inc": 2**100 + 1},
                          "has_uint32": 0, "uinteger": 0},
                "torch": torch.arange(16, dtype=torch.uint8)},
        "data": {"permutation": list(range(10, 0, -1)), "cursor": 4, "epoch": 1},
        "progress": {"step": 12, "epoch": 1},
        "misc": [float("nan"), float("inf"), 2**70, b"\x01\x02", (1, 2.5, None)],
        "np": {"legacy_key": np.arange(4, dtype=np.uint32), "scalar": np.float32(0.25)},
    }
