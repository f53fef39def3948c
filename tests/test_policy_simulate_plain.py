"""Issue 29: the policy audit tells the next LRs of StepLR, ExponentialLR, CosineAnnealingLR, OneCycleLR, LinearLR
and ConstantLR without ``import torch`` (training/simulate_plain.py); the values must be the very floats the real
torch scheduler gives.

Each state below comes from a real torch run (two param groups, every position of the schedule, its end and past
it, and the fields the audit perturbs to find what drives a step); ``simulate`` answers it in plain Python where
it can and through torch where told to, and the two must be equal: LRs bit for bit, the exception, the note.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim import lr_scheduler as L

from ckpt_archive.training import simulate as sim_mod
from ckpt_archive.training import simulate_plain

BUILDERS = {
    "StepLR": lambda o: L.StepLR(o, step_size=3, gamma=0.5),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=5, eta_min=1e-5),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=[1e-2, 3e-3], total_steps=12),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=6),
    "LinearLR_decay": lambda o: L.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=4),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=3),
    "OneCycleLR_linear_3phase": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=9, anneal_strategy="linear",
                                                         three_phase=True),
}


def _states(name):
    """(scheduler state, optimizer groups) after every number of steps from 0 to past the schedule's end."""
    out = []
    for n in range(0, 16):
        torch.manual_seed(0)
        p1, p2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.Adam([{"params": [p1], "lr": 1e-3}, {"params": [p2], "lr": 4e-4}])
        sched = BUILDERS[name](opt)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(n):
                    opt.step()
                    sched.step()
        except ValueError:  # OneCycleLR past total_steps
            break
        out.append((sched.state_dict(), opt.state_dict()["param_groups"]))
    return out


def _perturbed(sd, groups):
    """The fields the audit scales by 1.5 to find what drives each step (training/nextstep.py)."""
    yield sd, groups
    for key in ("lr", "initial_lr", "max_lr", "min_lr"):
        if key in groups[0]:
            yield sd, [dict(g, **{key: g[key] * 1.5}) for g in groups]
    yield dict(sd, base_lrs=[b * 1.5 for b in sd["base_lrs"]]), groups


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_next_lrs_told_without_torch_are_torchs(name, monkeypatch):
    """Guards against the torch-free next LRs (what verify/inspect report as the LR of the next steps) differing
    from what the real torch scheduler, restored and stepped, gives: any order of operations other than torch's
    shows here as a float off by one ulp; and against the torch-free path answering a state torch raises on."""
    real = simulate_plain.plain_lrs
    answered = []
    cases = [c for sd, groups in _states(name) for c in _perturbed(sd, groups)]
    for sd, groups in cases:
        monkeypatch.setattr(simulate_plain, "plain_lrs", lambda *a: answered.append(real(*a)) or answered[-1])
        fast = sim_mod.simulate(sd, archived_groups=groups, steps=4)
        monkeypatch.setattr(simulate_plain, "plain_lrs", lambda *a: None)
        slow = sim_mod.simulate(sd, archived_groups=groups, steps=4)
        assert (fast.lrs, fast.raises, fast.note) == (slow.lrs, slow.raises, slow.note), (name, sd, groups)
    told = [a for a in answered if a is not None]
    assert len(told) >= len(cases) * 2 // 3, (name, len(told), len(cases))  # the torch-free path was taken


def test_a_state_outside_what_is_certain_goes_to_torch():
    """Guards against the torch-free path guessing: another class, a setting that is not a plain number, a
    state in its initial step, a group without a number as lr answer None (torch then runs)."""
    sd, groups = _states("StepLR")[2]
    plain = sim_mod.plain_state(sd)
    pg = [sim_mod._plain_group(g) for g in groups]
    assert simulate_plain.plain_lrs("StepLR", plain, pg, 3) is not None
    assert simulate_plain.plain_lrs("LambdaLR", plain, pg, 3) is None
    assert simulate_plain.plain_lrs("StepLR", dict(plain, gamma="0.5"), pg, 3) is None
    assert simulate_plain.plain_lrs("StepLR", dict(plain, step_size=0), pg, 3) is None
    assert simulate_plain.plain_lrs("StepLR", dict(plain, _is_initial=True), pg, 3) is None
    assert simulate_plain.plain_lrs("StepLR", plain, [{"momentum": 0.9}] * 2, 3) is None
