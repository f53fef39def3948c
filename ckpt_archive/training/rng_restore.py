"""Restoring the random streams of a checkpoint (Python, NumPy, torch CPU, CUDA), never raising.

:func:`restore_rng` puts each saved stream back with the function of :data:`_RESTORERS` for it; a
stream it cannot restore (a broken entry, CUDA devices that are not visible, a device type without a
restorer) is a warning and makes the resume not bitwise, never an exception: the RNG comes last in a
restore, after the model and optimizer are already in place.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from ckpt_archive.training.parts import RNG_STREAMS, is_tensor, rng_streams_by_key


@dataclasses.dataclass
class RngRestore:
    """What :func:`restore_rng` did.

    Attributes:
        report: stream -> what happened (``"restored"``, ``"restored 1 device(s)"``, a reason); ``missing``
            lists the streams of :data:`~ckpt_archive.training.parts.RNG_STREAMS` the checkpoint lacks.
        warnings: human-readable lines, in the order the streams were met.
        bitwise: False when a saved stream was not restored or a stream is missing.
        numpy_generator: a ``numpy.random.Generator`` holding a saved non-legacy bit generator state when
            no live generator was given for it, else None.
    """

    report: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)
    bitwise: bool = True
    numpy_generator: Any = None


def _set_python_rng(val: Any) -> None:
    import random

    if isinstance(val, (list, tuple)) and len(val) == 3:
        version, internal, gauss = val
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    else:
        raise ValueError(f"not a random.getstate() tuple ({type(val).__name__})")


def _set_numpy_rng(val: Any, target: Any) -> tuple[str, Any]:
    """Returns (status, generator_or_None)."""
    import numpy as np

    if isinstance(val, dict) and "bit_generator" in val:
        if target is not None:
            bg = getattr(target, "bit_generator", target)
            bg.state = val
            return "restored into the given generator", None
        if val["bit_generator"] == "MT19937":
            np.random.set_state(val)
            return "restored (np.random global state)", None
        bg_cls = getattr(np.random, str(val["bit_generator"]), None)
        if bg_cls is None:
            raise ValueError(f"unknown NumPy bit generator {val['bit_generator']!r}")
        gen = np.random.Generator(bg_cls())
        gen.bit_generator.state = val
        return (f"{val['bit_generator']} state not restored in place (no generator given: pass "
                f"rng={{'numpy': generator}}); returned as report.numpy_generator"), gen
    if isinstance(val, (list, tuple)) and len(val) >= 3 and val[0] == "MT19937":
        st = (str(val[0]), np.asarray(val[1], dtype=np.uint32), int(val[2]), *val[3:])
        if target is not None and hasattr(target, "set_state"):
            target.set_state(st)
            return "restored into the given RandomState", None
        np.random.set_state(st)
        return "restored (np.random global state)", None
    raise ValueError(f"not a NumPy RNG state ({type(val).__name__})")


def _cuda_states(val: Any) -> list:
    """The saved CUDA generator states, one per device, in device order."""
    if isinstance(val, (list, tuple)):
        return list(val)
    if isinstance(val, dict):
        return [val[k] for k in sorted(val, key=lambda x: int(re.sub(r"\D", "", str(x)) or 0))]
    if is_tensor(val):
        return [val]
    return []


def _restore_python(name: str, val: Any, targets: dict, out: RngRestore) -> None:
    _set_python_rng(val)
    out.report[name] = "restored"


def _restore_numpy(name: str, val: Any, targets: dict, out: RngRestore) -> None:
    out.report[name], gen = _set_numpy_rng(val, targets.get("numpy"))
    if gen is not None:
        out.numpy_generator = gen
        out.bitwise = False
        out.warnings.append(f"NumPy RNG: {out.report[name]}")


def _restore_torch(name: str, val: Any, targets: dict, out: RngRestore) -> None:
    import torch

    if not is_tensor(val):
        raise ValueError(f"not a torch RNG state tensor ({type(val).__name__})")
    torch.set_rng_state(val.to(torch.uint8) if val.dtype != torch.uint8 else val)
    out.report[name] = "restored"


def _restore_cuda(name: str, val: Any, targets: dict, out: RngRestore) -> None:
    import torch

    saved = _cuda_states(val)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    k = min(len(saved), visible)
    for dev in range(k):
        torch.cuda.set_rng_state(saved[dev], device=dev)
    if len(saved) > visible:
        msg = f"CUDA RNG: {len(saved)} saved, {visible} visible: restored {k}; not bitwise-resumable on this machine"
        out.warnings.append(msg)
        out.bitwise = False
        out.report[name] = msg
    else:
        out.report[name] = f"restored {k} device(s)"


def _no_restorer(name: str, val: Any, targets: dict, out: RngRestore) -> None:
    out.report[name] = "not restored (no restorer for this device type)"
    out.warnings.append(f"{name} RNG state saved but not restored: not bitwise-resumable")
    out.bitwise = False


#: Stream name -> the function that puts it back (other device types, e.g. ``xla``, have none).
_RESTORERS = {"python": _restore_python, "numpy": _restore_numpy, "torch": _restore_torch, "cuda": _restore_cuda}


def restore_rng(raw: Any, rng: bool | dict = True) -> RngRestore:
    """Restore every random stream of an RNG part into this process.

    Python ``random.setstate``; NumPy legacy ``get_state()`` tuples and MT19937 dicts into ``np.random``,
    other bit generators (PCG64 ``bit_generator.state`` dicts) into the given generator or into
    ``numpy_generator``; torch CPU ``set_rng_state``; CUDA: one state per device, restored for the devices
    that are visible ("2 saved, 0 visible" when fewer are).

    Args:
        raw: the RNG part (a dict of streams, or a bare torch RNG state tensor).
        rng: ``True``, or a dict ``{"numpy": generator}`` naming live generators to restore into.

    Returns:
        :class:`RngRestore`. Nothing is raised: a stream that fails is reported and warned about.
    """
    targets = rng if isinstance(rng, dict) else {}
    streams = rng_streams_by_key(raw) if isinstance(raw, dict) else ({"torch": raw} if is_tensor(raw) else {})
    out = RngRestore()
    for name, val in streams.items():
        try:
            _RESTORERS.get(name, _no_restorer)(name, val, targets, out)
        except Exception as exc:  # never crash on RNG
            msg = f"{name} RNG state not restored ({type(exc).__name__}: {exc}): not bitwise-resumable"
            out.warnings.append(msg)
            out.report[name] = msg
            out.bitwise = False
    absent = [s for s in RNG_STREAMS if s not in streams]
    if absent:
        out.bitwise = False
        out.report["missing"] = absent
        out.warnings.append(f"RNG streams not in the checkpoint: {', '.join(absent)}: they continue from this "
                            f"process's seeds: not bitwise-resumable")
    return out


__all__ = ["RngRestore", "restore_rng"]
