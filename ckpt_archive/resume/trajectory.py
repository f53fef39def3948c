"""Record what a training run did, update by update, for ``ckpt-archive check-resume``.

A training script that follows the check-resume contract (see ``docs/check-resume.md``) creates one
:class:`Trajectory` per run, calls :meth:`Trajectory.record` after every optimizer update and
:meth:`Trajectory.finish` once at the end. The result is ``trajectory.json`` in the run's output
folder: per update the consumed sample ids, the learning rate of every param group, the loss and
(optionally) the epoch; at the end a sha256 digest of every parameter and optimizer-state tensor and
the next few draws of each random stream (taken from *copies* of the generators, so recording them
changes nothing in the run).

The file is strict JSON (RFC 8259): non-finite floats are written as the strings ``"nan"``,
``"inf"`` and ``"-inf"`` and decoded back by :func:`load_trajectory`.

Example::

    from ckpt_archive.resume.trajectory import Trajectory

    traj = Trajectory(args.output)
    for ...:
        loss = train_one_batch(batch)             # forward, backward, optimizer.step()
        traj.record(step=global_step, sample_ids=batch_ids, loss=loss.item(),
                    lr=[g["lr"] for g in optimizer.param_groups], epoch=epoch)
        scheduler.step()
    traj.finish(model=model, optimizer=optimizer, numpy_generator=np_rng)

Only the standard library is imported at module level; torch and NumPy are imported when used.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random as _random
from pathlib import Path
from typing import Any, Iterable, Sequence

#: The file name inside the run's output folder.
TRAJECTORY_FILE = "trajectory.json"
#: The checkpoint file name inside the run's output folder.
CHECKPOINT_FILE = "checkpoint.pt"
FORMAT = "ckpt-archive-trajectory"
VERSION = 1
#: How many values :meth:`Trajectory.finish` draws from each random stream.
NEXT_DRAWS = 3


def encode_float(x: float) -> float | str:
    """A float as strict JSON: finite floats unchanged, non-finite as ``"nan"``/``"inf"``/``"-inf"``."""
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def decode_float(v: Any) -> float:
    """Inverse of :func:`encode_float`."""
    if isinstance(v, str):
        return float(v)
    return float(v)


def _as_int_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (int,)):
        return [int(ids)]
    out = []
    for i in ids:
        if hasattr(i, "item"):
            i = i.item()
        out.append(int(i))
    return out


def tensor_digest(t) -> dict:
    """sha256 of a tensor's raw bytes (contiguous, CPU) with its dtype and shape.

    Args:
        t: a ``torch.Tensor`` of any dtype and shape.

    Returns:
        ``{"dtype": "float64", "shape": [8, 2], "sha256": "<64 hex>"}``.
    """
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().tobytes()
    else:
        raw = t.numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "sha256": hashlib.sha256(raw).hexdigest()}


def _optimizer_digest(optimizer) -> dict:
    """sha256 over every tensor of the optimizer state, in a stable order, plus per-entry digests."""
    import torch

    sd = optimizer.state_dict()
    h = hashlib.sha256()
    entries = {}
    for pid in sorted(sd["state"], key=lambda k: (str(type(k)), k)):
        for name in sorted(sd["state"][pid]):
            v = sd["state"][pid][name]
            if isinstance(v, torch.Tensor):
                d = tensor_digest(v)
            else:
                d = {"value": repr(v), "sha256": hashlib.sha256(repr(v).encode()).hexdigest()}
            entries[f"state.{pid}.{name}"] = d
            h.update(f"{pid}.{name}:".encode() + d["sha256"].encode())
    return {"sha256": h.hexdigest(), "entries": entries}


class Trajectory:
    """Collects per-update records and writes ``trajectory.json`` into ``output``.

    Args:
        output: the run's output folder (``{output}`` in the check-resume command template). Created
            if missing.
        meta: optional strict-JSON-serialisable facts about the run (config, seed), kept verbatim.
        data_ids: the run's data identity as this process built it (a label map ``{"cat": 0, ...}``, a file list,
            a tokenizer fingerprint; plain JSON values). check-resume compares it between the runs and names
            the entries that differ: a label map built from a ``set`` of strings changes with
            ``PYTHONHASHSEED`` while the sample ids stay the same.

    Raises:
        OSError: if ``output`` cannot be created. ValueError: ``data_ids`` is not plain JSON.
    """

    def __init__(self, output: str | os.PathLike, meta: dict | None = None, data_ids: Any = None):
        if data_ids is not None:
            try:
                json.dumps(data_ids, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"Trajectory data_ids must be plain JSON values: {exc}") from None
        self.output = Path(output)
        self.output.mkdir(parents=True, exist_ok=True)
        self.updates: list[dict] = []
        self.meta = dict(meta or {})
        self.data_ids = data_ids
        self.final: dict | None = None

    def record(self, *, step: int, sample_ids: Iterable[int], loss: float,
               lr: Sequence[float] | None = None, optimizer=None, epoch: int | None = None) -> None:
        """Record one optimizer update.

        Call it after ``optimizer.step()`` and *before* ``scheduler.step()``, so the learning rates
        are the ones this update used.

        Args:
            step: the global update number after this update (1 for the first update of a fresh
                run; a resumed run continues the numbering, e.g. 6..10).
            sample_ids: the ids (dataset row indices, ints) of the samples this update consumed, in
                batch order. A tensor, NumPy array or list.
            loss: the training loss of this update (a float; non-finite values are kept and flagged
                by the comparison).
            lr: the learning rate of every param group for this update. Taken from ``optimizer``
                when omitted.
            optimizer: a ``torch.optim.Optimizer``; used only when ``lr`` is omitted.
            epoch: the epoch this update belongs to (0-based), for per-epoch duplicate/missing counts.

        Raises:
            ValueError: if neither ``lr`` nor ``optimizer`` is given.
        """
        if lr is None:
            if optimizer is None:
                raise ValueError("Trajectory.record needs lr=[...] or optimizer=")
            lr = [g["lr"] for g in optimizer.param_groups]
        if hasattr(loss, "item"):
            loss = loss.item()
        rec = {"step": int(step), "sample_ids": _as_int_list(sample_ids),
               "lr": [encode_float(float(x)) for x in lr], "loss": encode_float(float(loss))}
        if epoch is not None:
            rec["epoch"] = int(epoch)
        self.updates.append(rec)

    def finish(self, *, model=None, optimizer=None, python_random: _random.Random | None = None,
               numpy_generator=None, torch_generator=None, write: bool = True) -> dict:
        """Record the end-of-run digests and the next draws of each random stream; write the file.

        The next draws come from copies of the generators: the run's own streams are untouched.

        Args:
            model: a ``torch.nn.Module``; every entry of its ``state_dict()`` is digested (sha256).
            optimizer: a ``torch.optim.Optimizer``; its state tensors are digested, and the LR of
                each param group (the LR the *next* update would use) is recorded.
            python_random: a ``random.Random`` instance; the module-level generator when omitted.
            numpy_generator: a ``numpy.random.Generator`` the run draws from, or for legacy NumPy
                code a ``numpy.random.RandomState`` or the module ``numpy.random`` itself (its global
                state); skipped when omitted.
            torch_generator: a ``torch.Generator``; the default CPU generator when omitted.
            write: write ``trajectory.json`` now (default).

        Returns:
            The ``final`` section (strict-JSON-ready dict).
        """
        import torch

        final: dict[str, Any] = {"step": self.updates[-1]["step"] if self.updates else None}
        if model is not None:
            final["params"] = {k: tensor_digest(v) for k, v in model.state_dict().items()}
        if optimizer is not None:
            final["optimizer"] = _optimizer_digest(optimizer)
            final["next_lr"] = [encode_float(float(g["lr"])) for g in optimizer.param_groups]
        draws: dict[str, list] = {}
        r = _random.Random()
        r.setstate((python_random or _random).getstate())
        draws["python"] = [encode_float(r.random()) for _ in range(NEXT_DRAWS)]
        if numpy_generator is not None:
            import numpy as np

            if isinstance(numpy_generator, np.random.Generator):
                bg = type(numpy_generator.bit_generator)()
                bg.state = numpy_generator.bit_generator.state
                nxt = np.random.Generator(bg).random(NEXT_DRAWS)
            else:  # legacy: a RandomState or np.random (np.random.seed / np.random.permutation code)
                rs = np.random.RandomState()
                rs.set_state(numpy_generator.get_state())
                nxt = rs.random_sample(NEXT_DRAWS)
            draws["numpy"] = [encode_float(x) for x in nxt.tolist()]
        g = torch.Generator()
        g.set_state((torch_generator.get_state() if torch_generator is not None else torch.get_rng_state()))
        draws["torch"] = [encode_float(x) for x in torch.rand(NEXT_DRAWS, generator=g, dtype=torch.float64).tolist()]
        final["next_draws"] = draws
        self.final = final
        if write:
            self.write()
        return final

    def to_json(self) -> dict:
        """The whole trajectory as a strict-JSON dict."""
        out = {"format": FORMAT, "version": VERSION, "meta": self.meta, "updates": self.updates,
               "final": self.final}
        if self.data_ids is not None:
            out["data_ids"] = self.data_ids
        return out

    def write(self) -> Path:
        """Write ``trajectory.json`` atomically (the file layer: a fresh ``O_EXCL`` temporary name, fsync,
        rename; never through a link planted at a predictable name). Returns its path."""
        from ckpt_archive.store.fs import write_file_atomic

        path = self.output / TRAJECTORY_FILE
        write_file_atomic(path, json.dumps(self.to_json(), allow_nan=False, indent=1).encode("utf-8"))
        return path


def load_trajectory(path: str | os.PathLike) -> dict:
    """Read a ``trajectory.json`` (or the folder holding it) and decode non-finite floats.

    Returns:
        ``{"updates": [{"step", "sample_ids", "lr" (floats), "loss" (float), "epoch"?}], "final": ...,
        "data_ids"?: the run's data identity when it recorded one}``.

    Raises:
        ckpt_archive.errors.SourceError: missing file, not JSON, or not a trajectory (the reason
            names the file and the field).
    """
    from ckpt_archive.errors import SourceError

    p = Path(path)
    if p.is_dir():
        p = p / TRAJECTORY_FILE
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SourceError("no trajectory written (the script must call Trajectory.finish or write "
                          f"{TRAJECTORY_FILE} into {{output}})", where=str(p)) from None
    except (OSError, ValueError) as exc:
        raise SourceError(f"not a readable trajectory: {exc}", where=str(p)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SourceError(f"not a trajectory: field 'format' is not {FORMAT!r}", where=str(p))
    if data.get("version", 0) > VERSION:
        raise SourceError(f"trajectory written by format {data.get('version')}, this reader knows up to "
                          f"{VERSION}", where=str(p))
    updates = data.get("updates")
    if not isinstance(updates, list):
        raise SourceError("field 'updates' is not a list", where=str(p))
    for i, u in enumerate(updates):
        try:
            u["step"] = int(u["step"])
            u["sample_ids"] = [int(x) for x in u["sample_ids"]]
            u["lr"] = [decode_float(x) for x in u["lr"]]
            u["loss"] = decode_float(u["loss"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"update {i}: missing or malformed field ({exc})", where=str(p)) from None
    final = data.get("final") or {}
    if "next_draws" in final:
        final["next_draws"] = {k: [decode_float(x) for x in v] for k, v in final["next_draws"].items()}
    if "next_lr" in final:
        final["next_lr"] = [decode_float(x) for x in final["next_lr"]]
    data["final"] = final
    return data
