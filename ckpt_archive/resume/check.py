"""Resume correctness as a check: continuous vs interrupted + archived + resumed runs, and negative controls.

:func:`check_resume` runs a user's training command (a template with ``{steps}``, ``{output}`` and a
``{resume}`` form, see ``docs/check-resume.md``) in fresh processes:

1. **continuous**: ``steps`` updates from scratch;
2. **interrupted**: ``interrupt_at`` updates from scratch; its final ``checkpoint.pt`` is the resume
   point. It is *packed into an archive repository, verified (deep) and restored* through
   ckpt-archive before anything reads it: the archive is in the loop;
3. **resumed**: ``steps - interrupt_at`` more updates from the restored checkpoint;
4. **negative controls**: the same resume from a deliberately broken state. Tool-made controls load
   the archived state (:func:`ckpt_archive.load`), perturb one part in a type-preserving way (each RNG
   stream replaced by another valid state, optimizer moments zeroed, scheduler one step stale, data
   cursor shifted) and ``torch.save`` it for the run; script-side controls pass extra arguments
   (e.g. ``--omit-rng-restore``). Every control must diverge, otherwise the check could not have
   seen that fault.

Each run writes ``checkpoint.pt`` and ``trajectory.json`` (:mod:`ckpt_archive.resume.trajectory`) into its
``{output}``. Runs are compared per update and per field (sample ids, LR of every param group, loss)
with ``atol``/``rtol``, then the final states (``model``, ``optimizer``, ``scheduler``, ``rng``,
``data``, ``progress``) leaf by leaf and the next draws of every random stream. Non-finite values and
structure differences are flagged, never accepted silently. The result is ``verification.json``
(``schemas/verification.v1.schema.json``), validated before it is written.

Errors: :class:`~ckpt_archive.errors.UsageError` (bad arguments), :class:`~ckpt_archive.errors.OutputExists`,
:class:`~ckpt_archive.errors.SourceError` (a run failed or broke the contract) -> exit 2. A failed
comparison is *not* raised: :func:`check_resume` returns the report and ``report["all_checks_passed"]``
says whether it passed (the CLI exits 1 when it did not).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import json
import math
import os
import random as _random
import re
import shlex
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ckpt_archive.errors import CannotCheck, IntegrityError, OutputExists, RefusedPickle, SourceError, UsageError
from ckpt_archive.resume.trajectory import CHECKPOINT_FILE, TRAJECTORY_FILE, encode_float, load_trajectory

#: Top-level checkpoint keys the contract expects (see docs/check-resume.md). Only these are compared
#: in the final state; other keys (config, paths, timestamps) are listed as not compared.
CONVENTIONAL_KEYS = ("model", "optimizer", "scheduler", "scaler", "rng", "data", "progress")
#: Keys whose final-state difference counts as a *training* difference for a negative control.
TRAINING_KEYS = ("model", "optimizer", "scheduler", "scaler")
#: Tool-made negative controls, in the order they run.
TOOL_CONTROLS = ("python-rng", "numpy-rng", "torch-rng", "optimizer-moments", "scheduler-stale", "data-cursor")
CONTROL_ALIASES = {
    "python": "python-rng", "random": "python-rng", "numpy": "numpy-rng", "torch": "torch-rng",
    "cuda": "torch-rng", "optimizer": "optimizer-moments", "moments": "optimizer-moments",
    "scheduler": "scheduler-stale", "lr-scheduler": "scheduler-stale", "data": "data-cursor",
    "cursor": "data-cursor",
}
CONTROL_LABELS = {
    "python-rng": "the Python RNG", "numpy-rng": "the NumPy RNG", "torch-rng": "the torch RNG",
    "optimizer-moments": "the optimizer moments (zeroed)", "scheduler-stale": "the LR scheduler (one step stale)",
    "data-cursor": "the data cursor (shifted)",
}
REPORT_FORMAT = "ckpt-archive-verification"
REPORT_VERSION = 1
REPORT_FILE = "verification.json"
SCHEMA_FILE = "verification.v1.schema.json"
#: At most this many leaf differences are listed per comparison (all are counted).
MAX_LISTED = 20
_RESUME_TEMPLATE = re.compile(r"^\{resume:(.*)\}$", re.S)
_PERTURB_SEEDS = (0x5EED_C0DE, 0xBAD_5EED, 0xFACE_FEED)

Event = Callable[[str], None]


# --------------------------------------------------------------------------------------------------
# The command template
# --------------------------------------------------------------------------------------------------
def canonical_control(name: str) -> str:
    """Map a control name or alias (``numpy``, ``scheduler``) to its canonical name (``numpy-rng``).

    Raises:
        UsageError: unknown name (the message lists the known ones).
    """
    key = name.strip().lower()
    key = CONTROL_ALIASES.get(key, key)
    if key not in TOOL_CONTROLS:
        raise UsageError(f"unknown negative control {name!r}; known: {', '.join(TOOL_CONTROLS)} "
                         f"(or {', '.join(sorted(CONTROL_ALIASES))})")
    return key


def check_template(template: Sequence[str]) -> None:
    """Check that a command template carries the three placeholders of the contract.

    Raises:
        UsageError: empty command, or ``{steps}``, ``{output}`` or a ``{resume}`` form missing.
    """
    if not template:
        raise UsageError("no training command given: put it after '--', e.g. "
                         "-- python train.py --steps {steps} --output {output} {resume:--resume-from {}}")
    joined = "\x00".join(template)
    missing = [p for p in ("{steps}", "{output}") if p not in joined]
    if "{resume}" not in joined and not any(_RESUME_TEMPLATE.match(a) for a in template):
        missing.append("{resume} (or '{resume:--resume-from {}}')")
    if missing:
        raise UsageError(f"the command template lacks {', '.join(missing)}; see docs/check-resume.md")


def expand_command(template: Sequence[str], *, steps: int, output: str | os.PathLike,
                   resume: str | os.PathLike | None) -> list[str]:
    """Fill a command template for one run.

    * ``{steps}``: the number of optimizer updates this run adds; ``{output}``: the run's folder.
    * An argument holding ``{resume}`` (e.g. ``--resume-from={resume}``) is filled with the checkpoint
      path when the run resumes, and **dropped entirely** when it does not.
    * An argument that is exactly ``{resume:TEMPLATE}`` expands, when resuming, to ``TEMPLATE`` split
      like a shell would, with ``{}`` replaced by the path (``'{resume:--resume-from {}}'`` gives two
      arguments ``--resume-from PATH``); it vanishes when not resuming.

    Example:
        >>> expand_command(["t.py", "--n", "{steps}", "{resume:--from {}}"], steps=5, output="o", resume=None)
        ['t.py', '--n', '5']
        >>> expand_command(["t.py", "{resume:--from {}}"], steps=5, output="o", resume="c.pt")
        ['t.py', '--from', 'c.pt']
    """
    def fill(s: str) -> str:
        return s.replace("{steps}", str(steps)).replace("{output}", str(output))

    argv: list[str] = []
    for arg in template:
        m = _RESUME_TEMPLATE.match(arg)
        if m:
            if resume is not None:
                argv.extend(fill(part).replace("{}", str(resume)) for part in shlex.split(m.group(1)))
            continue
        if "{resume}" in arg:
            if resume is None:
                continue
            arg = arg.replace("{resume}", str(resume))
        argv.append(fill(arg))
    return argv


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunRecord:
    """One training process: its argv, where it wrote, how it ended."""

    name: str
    argv: list[str]
    output: Path
    exit_code: int | None = None
    seconds: float = 0.0
    timed_out: bool = False

    def stderr_tail(self, lines: int = 5) -> str:
        try:
            text = (self.output / "stderr.log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)
        tb = text.rfind("Traceback (most recent call last):")
        if tb >= 0:
            # A Python crash: the exception line and where it was raised, not the traceback's carets.
            body = text[tb:].splitlines()
            at = [i for i, ln in enumerate(body) if re.match(r'\s*File "(.*)", line (\d+)', ln)]
            tail = body[at[-1] + 1:] if at else body[1:]
            exc = " ".join(ln.strip() for ln in tail if ln.strip() and not ln[:1].isspace())
            frames = [re.match(r'\s*File "(.*)", line (\d+)', body[i]) for i in at]
            if exc:
                return exc + (f" (at {frames[-1].group(1)}:{frames[-1].group(2)})" if frames else "")
        return " | ".join(text.strip().splitlines()[-lines:])

    def to_json(self) -> dict:
        return {"name": self.name, "argv": self.argv, "output": str(self.output), "exit_code": self.exit_code,
                "seconds": round(self.seconds, 3), "timed_out": self.timed_out}


def _run(name: str, argv: list[str], output: Path, *, timeout: float | None, env: dict) -> RunRecord:
    output.mkdir(parents=True, exist_ok=False)
    rec = RunRecord(name, argv, output)
    t0 = time.monotonic()
    with open(output / "stdout.log", "wb") as out, open(output / "stderr.log", "wb") as err:
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                  timeout=timeout)
            rec.exit_code = proc.returncode
        except subprocess.TimeoutExpired:
            rec.timed_out = True
        except FileNotFoundError:
            raise UsageError(f"command not found: {argv[0]!r}", where=f"run {name}") from None
        except PermissionError:
            raise UsageError(f"command not executable: {argv[0]!r}", where=f"run {name}") from None
    rec.seconds = time.monotonic() - t0
    return rec


def _require_ok(rec: RunRecord) -> None:
    if rec.timed_out:
        raise SourceError(f"run '{rec.name}' timed out after {rec.seconds:.0f} s; log: {rec.output / 'stderr.log'}")
    if rec.exit_code != 0:
        tail = rec.stderr_tail()
        raise SourceError(f"run '{rec.name}' exited {rec.exit_code}"
                          + (f": {tail}" if tail else "") + f" (full log: {rec.output / 'stderr.log'})")
    if not (rec.output / CHECKPOINT_FILE).is_file():
        raise SourceError(f"run '{rec.name}' wrote no {CHECKPOINT_FILE} into its {{output}} folder "
                          "(the contract: the script saves its state there after its last update)",
                          where=str(rec.output))


def _load_checkpoint(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reason is reported with the file
        from ckpt_archive.sources.torchfile import diagnose_unreadable

        # torch's own first line ("Weights only load failed. ...") never names the refused global.
        err = diagnose_unreadable(path, exc)
        if isinstance(err, RefusedPickle):
            hint = ("the contract: checkpoint.pt must load with torch.load(weights_only=True), as the "
                    "resumed script loads it; save plain data: dicts, lists, numbers, strings, tensors")
            if "numpy" in err.message:
                hint += (" (np.random.Generator: bit_generator.state; the legacy np.random.get_state() "
                         "tuple with its array as .tolist())")
            err.hint = hint
        raise err from None


# --------------------------------------------------------------------------------------------------
# The archive in the loop
# --------------------------------------------------------------------------------------------------
class ArchiveLoop:
    """Carries the interruption checkpoint through ckpt-archive: pack, deep verify, restore, load.

    Args:
        repo: the archive repository (a folder or fsspec URL); created by :func:`ckpt_archive.pack`.
    """

    def __init__(self, repo: str | os.PathLike):
        self.repo = str(repo)
        self.generation: int | None = None

    def store(self, checkpoint: Path, *, step: int | None) -> dict:
        """Pack ``checkpoint`` as a new generation and verify it deeply.

        Returns:
            ``{"repository", "generation", "status", "verified"}``.

        Raises:
            IntegrityError: the new generation failed verification.
        """
        import ckpt_archive
        from ckpt_archive.ops.pack import Annotations

        res = ckpt_archive.pack(str(checkpoint), self.repo, annotations=Annotations(
            tags=("check-resume",), progress={"step": step} if step is not None else None))
        self.generation = int(res.generation)
        rep = ckpt_archive.verify(self.repo, str(self.generation), deep=True)
        if not rep.ok:
            reasons = "; ".join(f"{p.member or ''} {p.field or ''}: {p.reason}".strip() for p in rep.problems)
            raise IntegrityError(f"the archived interruption checkpoint failed verification: {reasons}",
                                 where=f"{self.repo}@{self.generation}")
        return {"repository": self.repo, "generation": self.generation, "status": str(res.status),
                "verified": True}

    def restore(self, output: Path) -> Path:
        """Restore the stored generation to the ``.pt`` file ``output`` (which must not exist)."""
        import ckpt_archive

        ckpt_archive.restore(self.repo, str(self.generation), output=str(output))
        return output

    def load(self) -> Any:
        """The stored state as a nested Python object (tensors, dicts, tuples, ints...)."""
        import ckpt_archive

        return ckpt_archive.load(self.repo, str(self.generation))


# --------------------------------------------------------------------------------------------------
# Finding parts of a state and perturbing them (type-preserving)
# --------------------------------------------------------------------------------------------------
def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "shape")


def _children(node) -> Iterable[tuple[Any, Any]]:
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return []


def _fmt_path(path: Sequence) -> str:
    """``("optimizer", "param_groups", _Index(0), "lr")`` -> ``optimizer.param_groups[0].lr``."""
    out = ""
    for p in path:
        if isinstance(p, _Index):
            out += f"[{int(p)}]"
        else:
            out += f".{p}" if out else str(p)
    return out or "<root>"


class _Index(int):
    """A list/tuple position inside a path (printed as ``[i]``, unlike an int dict key)."""


def _walk(node, path=(), skip_top=()):
    """Yield (path, node) depth first; the top-level keys in ``skip_top`` are not entered."""
    yield path, node
    for k, v in _children(node):
        if not path and k in skip_top:
            continue
        key = _Index(k) if isinstance(node, (list, tuple)) else k
        yield from _walk(v, path + (key,), skip_top)


def _get(node, path):
    for p in path:
        node = node[int(p) if isinstance(p, _Index) else p]
    return node


def _set(root, path, value):
    """Set ``root[path] = value``, rebuilding tuples on the way (they are immutable)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    key = int(head) if isinstance(head, _Index) else head
    if isinstance(root, tuple):
        items = list(root)
        items[key] = _set(items[key], rest, value)
        return type(root)(items) if type(root) is tuple else type(root)(*items)
    root[key] = _set(root[key], rest, value)
    return root


def _is_python_rng(x) -> bool:
    return (isinstance(x, (tuple, list)) and len(x) == 3 and type(x[0]) is int and x[0] == 3
            and isinstance(x[1], (tuple, list)) and len(x[1]) == 625 and all(type(i) is int for i in x[1][:4]))


def _is_numpy_rng(x) -> bool:
    return isinstance(x, dict) and isinstance(x.get("bit_generator"), str) and "state" in x


def _is_numpy_legacy_rng(x) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 5 and x[0] == "MT19937"


def _is_torch_rng(path, x) -> bool:
    if not _is_tensor(x):
        return False
    import torch

    if x.dtype != torch.uint8 or x.dim() != 1:
        return False
    if x.numel() == 5056:  # the CPU mt19937 generator state
        return True
    text = ".".join(str(p) for p in path).lower()
    return x.numel() == 16 and ("cuda" in text or "rng" in text)  # a CUDA philox state: seed, offset


def _like(template, values):
    """Rebuild ``values`` (a list) with the container type of ``template`` (tuple/list)."""
    return type(template)(values) if isinstance(template, (tuple, list)) else values


def _new_python_state(old, salt: int):
    for seed in _PERTURB_SEEDS:
        new = _random.Random(seed + salt).getstate()
        if list(new[1]) != list(old[1]):
            break
    return _like(old, [new[0], _like(old[1], list(new[1])), None])


def _coerce_like(old, new):
    """``new`` converted to the type of ``old`` where both are plain values; containers recursively."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = type(old)()
        for k in old:
            out[k] = _coerce_like(old[k], new[k]) if k in new else old[k]
        return out
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new):
        return _like(old, [_coerce_like(o, n) for o, n in zip(old, new)])
    if _is_tensor(old):
        import torch

        return torch.as_tensor(new, dtype=old.dtype).reshape(old.shape)
    if type(old).__module__ == "numpy":
        import numpy as np

        return np.asarray(new, dtype=getattr(old, "dtype", None)) if hasattr(old, "shape") and old.shape else type(old)(new)
    if isinstance(old, bool) or isinstance(new, bool):
        return type(old)(new)
    if isinstance(old, (int, float, str)) and old is not None:
        return type(old)(new)
    return new


def _new_numpy_state(old: dict, salt: int) -> dict:
    import numpy as np

    cls = getattr(np.random, old["bit_generator"], None)
    if cls is None:
        raise CannotCheck(f"unknown NumPy bit generator {old['bit_generator']!r}")
    for seed in _PERTURB_SEEDS:
        new = cls(seed + salt).state
        if repr(new["state"]) != repr(old["state"]):
            break
    return _coerce_like(old, new)


def _new_numpy_legacy_state(old, salt: int):
    import numpy as np

    new = np.random.RandomState(_PERTURB_SEEDS[0] + salt).get_state()
    return _like(old, [old[0], _coerce_like(old[1], new[1]), type(old[2])(new[2]), type(old[3])(new[3]),
                       type(old[4])(new[4])])


def _new_torch_state(old, salt: int):
    import torch

    if old.numel() == 5056:
        for seed in _PERTURB_SEEDS:
            new = torch.Generator().manual_seed(seed + salt).get_state()
            if not torch.equal(new, old):
                return new.to(old.device)
    seed_and_offset = torch.tensor([_PERTURB_SEEDS[0] + salt, 0], dtype=torch.int64).view(torch.uint8)
    return seed_and_offset.clone().to(old.device)


STREAMS = {"python-rng": "python", "numpy-rng": "numpy", "torch-rng": "torch"}


def rng_streams(state) -> dict[str, list[tuple]]:
    """Where each random stream's state sits in ``state``: ``{"python": [path], "numpy": [...], "torch": [...]}``.

    Found by shape, not by key name (a ``random.getstate()`` tuple, a NumPy ``bit_generator`` dict or
    legacy ``MT19937`` tuple, a uint8 torch generator state), outside ``model``/``optimizer``/``scheduler``.
    """
    found: dict[str, list[tuple]] = {}
    for path, node in _walk(state, skip_top=("model", "optimizer", "scheduler")):
        if _is_python_rng(node):
            found.setdefault("python", []).append(path)
        elif _is_numpy_rng(node) or _is_numpy_legacy_rng(node):
            found.setdefault("numpy", []).append(path)
        elif _is_torch_rng(path, node):
            found.setdefault("torch", []).append(path)
    return found


def _find_optimizer_states(state) -> list[tuple]:
    found = []
    for path, node in _walk(state, skip_top=("model",)):
        if isinstance(node, dict) and "state" in node and "param_groups" in node \
                and isinstance(node["param_groups"], (list, tuple)):
            found.append(path)
    return found


def _find_scheduler_states(state) -> list[tuple]:
    found = []
    for path, node in _walk(state, skip_top=("model", "optimizer", "rng", "data")):
        if isinstance(node, dict) and type(node.get("last_epoch")) is int and (
                "_step_count" in node or "base_lrs" in node or "_last_lr" in node):
            found.append(path)
    return found


def _find_cursors(state) -> list[tuple]:
    if isinstance(state, dict) and isinstance(state.get("data"), dict) and type(state["data"].get("cursor")) is int:
        return [("data", "cursor")]
    return [p for p, n in _walk(state, skip_top=("model", "optimizer", "scheduler", "rng"))
            if p and p[-1] == "cursor" and type(n) is int]


@dataclasses.dataclass
class Perturbation:
    """What a tool-made control changed: ``applied`` is False when the part was not in the state."""

    name: str
    applied: bool
    changed: list[str]
    note: str = ""


def perturb(state, control: str, *, previous_lr: Sequence[float] | None = None) -> tuple[Any, Perturbation]:
    """Return a perturbed deep copy of ``state`` for the tool-made negative control ``control``.

    Every replacement keeps the type of what it replaces (tuple stays tuple, int stays int, a uint8
    tensor stays a uint8 tensor of the same length), so a correct restore code path accepts it.

    Args:
        state: the archived state (nested dict; conventional keys ``rng``, ``optimizer``,
            ``scheduler``, ``data``, ``progress``; parts are also found by their shape).
        control: one of :data:`TOOL_CONTROLS`.
        previous_lr: the LR of every param group in the last update before the interruption (the
            LR a one-step-stale scheduler would still hand out); used by ``scheduler-stale``.

    Returns:
        (new_state, Perturbation). ``Perturbation.applied`` is False (and the state unchanged) when
        the part is not in the state.
    """
    control = canonical_control(control)
    st = copy.deepcopy(state)
    changed: list[str] = []
    salt = TOOL_CONTROLS.index(control)
    if control in ("python-rng", "numpy-rng", "torch-rng"):
        hits = []
        for path, node in _walk(st, skip_top=("model", "optimizer", "scheduler")):
            if control == "python-rng" and _is_python_rng(node):
                hits.append((path, _new_python_state(node, salt)))
            elif control == "numpy-rng" and _is_numpy_rng(node):
                hits.append((path, _new_numpy_state(node, salt)))
            elif control == "numpy-rng" and _is_numpy_legacy_rng(node):
                hits.append((path, _new_numpy_legacy_state(node, salt)))
            elif control == "torch-rng" and _is_torch_rng(path, node):
                hits.append((path, _new_torch_state(node, salt)))
        # outermost first and no nested duplicates (a legacy tuple holds an array, not another state)
        for path, new in hits:
            st = _set(st, path, new)
            changed.append(_fmt_path(path))
    elif control == "optimizer-moments":
        for opath in _find_optimizer_states(st):
            opt = _get(st, opath)
            for pid, pstate in _children(opt["state"]):
                if not isinstance(pstate, dict):
                    continue
                for k, v in list(pstate.items()):
                    if k != "step" and _is_tensor(v) and (v.is_floating_point() or v.is_complex()):
                        import torch

                        pstate[k] = torch.zeros_like(v)
                        changed.append(_fmt_path(opath + ("state", pid, k)))
    elif control == "scheduler-stale":
        for spath in _find_scheduler_states(st):
            sch = _get(st, spath)
            sch["last_epoch"] = sch["last_epoch"] - 1
            changed.append(_fmt_path(spath + ("last_epoch",)))
            if type(sch.get("_step_count")) is int:
                sch["_step_count"] = sch["_step_count"] - 1
                changed.append(_fmt_path(spath + ("_step_count",)))
            if previous_lr is not None and isinstance(sch.get("_last_lr"), (list, tuple)) \
                    and len(sch["_last_lr"]) == len(previous_lr):
                sch["_last_lr"] = _coerce_like(sch["_last_lr"], list(previous_lr))
                changed.append(_fmt_path(spath + ("_last_lr",)))
        if changed and previous_lr is not None:
            # The optimizer holds the LR the next update uses: as of one scheduler step earlier.
            for opath in _find_optimizer_states(st):
                groups = _get(st, opath)["param_groups"]
                if len(groups) == len(previous_lr):
                    for i, g in enumerate(groups):
                        if isinstance(g, dict) and "lr" in g:
                            g["lr"] = _coerce_like(g["lr"], previous_lr[i])
                            changed.append(_fmt_path(opath + ("param_groups", _Index(i), "lr")))
    elif control == "data-cursor":
        for cpath in _find_cursors(st):
            cur = _get(st, cpath)
            parent = _get(st, cpath[:-1])
            size = None
            if isinstance(parent, dict):
                for key in ("permutation", "order", "indices", "sample_order"):
                    if key in parent and hasattr(parent[key], "__len__"):
                        size = len(parent[key])
                        break
            shift = -1 if (size is not None and cur + 1 > size) else 1
            st = _set(st, cpath, type(cur)(cur + shift))
            changed.append(f"{_fmt_path(cpath)} {cur} -> {cur + shift}")
    applied = bool(changed)
    note = "" if applied else _MISSING_NOTES[control]
    if control == "optimizer-moments" and not applied and not _find_optimizer_states(st):
        note = "no optimizer state (a dict with 'state' and 'param_groups') in the checkpoint"
    return (st if applied else state), Perturbation(control, applied, changed, note)


_MISSING_NOTES = {
    "python-rng": "no Python random state (a random.getstate() tuple) in the checkpoint",
    "numpy-rng": "no NumPy generator state (a dict with 'bit_generator') in the checkpoint",
    "torch-rng": "no torch RNG state (a uint8 tensor from torch.get_rng_state()) in the checkpoint",
    "optimizer-moments": "the optimizer state holds no moment tensors (e.g. SGD without momentum)",
    "scheduler-stale": "no LR scheduler state (a dict with 'last_epoch') in the checkpoint",
    "data-cursor": "no data cursor ('data': {'cursor': int}) in the checkpoint",
}


# --------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------
def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    if math.isfinite(a) and math.isfinite(b):
        return abs(a - b) <= atol + rtol * abs(a)
    return (math.isnan(a) and math.isnan(b)) or a == b


def _jsonable(v):
    if isinstance(v, float):
        return encode_float(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    return repr(v)[:200]


class _TreeDiff:
    """Leaf-by-leaf comparison of two nested states in depth-first order."""

    def __init__(self, atol: float, rtol: float, skip: Iterable[tuple] = ()):
        self.atol, self.rtol = atol, rtol
        self.skip = set(skip)
        self.diffs: list[dict] = []
        self.total = 0
        self.non_finite: list[str] = []
        self.max_abs: dict[str, float] = {}

    def add(self, path, kind, expected=None, got=None, **extra):
        self.total += 1
        if len(self.diffs) < MAX_LISTED:
            d = {"field": _fmt_path(path), "kind": kind, "expected": _jsonable(expected), "got": _jsonable(got)}
            d.update({k: _jsonable(v) for k, v in extra.items()})
            self.diffs.append(d)

    def compare(self, a, b, path=()):
        if path in self.skip:
            return None
        if _is_tensor(a) or _is_tensor(b):
            return self._tensors(a, b, path)
        if type(a) is not type(b):
            return self.add(path, "type", type(a).__name__, type(b).__name__)
        if isinstance(a, dict):
            for k in a:
                if k not in b:
                    self.add(path + (k,), "missing", "present", "absent")
                else:
                    self.compare(a[k], b[k], path + (k,))
            for k in b:
                if k not in a:
                    self.add(path + (k,), "extra", "absent", "present")
            return None
        if isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return self.add(path, "length", len(a), len(b))
            for i, (x, y) in enumerate(zip(a, b)):
                self.compare(x, y, path + (_Index(i),))
            return None
        if isinstance(a, float):
            if not (math.isfinite(a) and math.isfinite(b)):
                self.non_finite.append(_fmt_path(path))
            if not _close(a, b, self.atol, self.rtol):
                self.add(path, "value", a, b, abs_diff=abs(a - b) if math.isfinite(a - b) else None)
            return None
        if type(a).__module__ == "numpy" and hasattr(a, "shape"):
            import torch

            return self._tensors(torch.as_tensor(a), torch.as_tensor(b), path)
        if a != b:
            self.add(path, "value", a, b)
        return None

    def _tensors(self, a, b, path):
        import torch

        if not (_is_tensor(a) and _is_tensor(b)):
            return self.add(path, "type", type(a).__name__, type(b).__name__)
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return self.add(path, "structure", f"{a.dtype} {list(a.shape)}", f"{b.dtype} {list(b.shape)}")
        a, b = a.detach().cpu(), b.detach().cpu()
        name = _fmt_path(path)
        if a.is_floating_point() or a.is_complex():
            a64 = a.to(torch.complex128) if a.is_complex() else a.to(torch.float64)
            b64 = b.to(torch.complex128) if b.is_complex() else b.to(torch.float64)
            fa, fb = torch.isfinite(a64), torch.isfinite(b64)
            both = fa & fb
            if not bool(both.all()):
                self.non_finite.append(name)
            diff = torch.where(both, (a64 - b64).abs(), torch.zeros((), dtype=torch.float64))
            tol = self.atol + self.rtol * a64.abs()
            bad = (diff > tol) & both
            same_nonfinite = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
            bad |= ~both & ~same_nonfinite
            self.max_abs[name] = float(diff.max()) if diff.numel() else 0.0
        else:
            bad = a != b
            if a.dtype != torch.bool:
                self.max_abs[name] = float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0
        if bool(bad.any()):
            idx = int(bad.reshape(-1).nonzero()[0])
            ea, gb = a.reshape(-1)[idx].item(), b.reshape(-1)[idx].item()
            self.add(path, "value", ea, gb, index=idx, elements_differing=int(bad.sum()),
                     max_abs_diff=self.max_abs.get(name))


def _state_parts(state) -> tuple[list[str], list[str]]:
    if not isinstance(state, dict):
        return [], []
    keys = [k for k in state if isinstance(k, str)]
    compared = [k for k in keys if k in CONVENTIONAL_KEYS]
    if not compared:  # no conventional keys: compare everything
        return keys, []
    return compared, [k for k in keys if k not in CONVENTIONAL_KEYS]


def compare_trajectories(expected: list[dict], got: list[dict], *, atol: float, rtol: float,
                         prefix: list[dict] | None = None) -> dict:
    """Compare per-update records (``sample_ids``, ``lr`` per group, ``loss``) step by step.

    Args:
        expected: the continuous run's updates for the compared steps.
        got: the candidate run's updates (compared by position; step numbers are checked too).
        prefix: the updates before the interruption (the interrupted run's), used to count
            duplicated/never-seen samples per epoch over the whole resumed line.

    Returns:
        ``{"steps_compared", "first_divergence", "lr_divergence", "loss_divergence", "data_order",
        "non_finite", "structure"}``; each divergence is ``None`` when that field matched.
    """
    res: dict[str, Any] = {"steps_compared": [u["step"] for u in expected], "first_divergence": None,
                           "lr_divergence": None, "loss_divergence": None, "data_order": None,
                           "non_finite": [], "structure": []}
    exp_steps = [u["step"] for u in expected]
    got_steps = [u["step"] for u in got]
    if got_steps != exp_steps[:len(got_steps)] or len(got) != len(expected):
        res["structure"].append(f"updates recorded: expected steps {_span(exp_steps)}, got {_span(got_steps)} "
                                "(is the progress counter restored and {steps} honoured?)")
    first: dict | None = None
    data_first: dict | None = None
    for i, (e, g) in enumerate(zip(expected, got)):
        step = e["step"]
        fields: list[dict] = []
        if e["sample_ids"] != g["sample_ids"]:
            d = {"step": step, "field": "sample_ids", "expected": e["sample_ids"], "got": g["sample_ids"]}
            fields.append(d)
            if data_first is None:
                data_first = {"first_divergent_step": step, "batch": i + 1, "expected_ids": e["sample_ids"],
                              "got_ids": g["sample_ids"]}
        if len(e["lr"]) != len(g["lr"]):
            res["structure"].append(f"step {step}: {len(e['lr'])} param groups expected, {len(g['lr'])} got")
            fields.append({"step": step, "field": "lr", "expected": e["lr"], "got": g["lr"]})
        else:
            for gi, (le, lg) in enumerate(zip(e["lr"], g["lr"])):
                if not (math.isfinite(le) and math.isfinite(lg)):
                    res["non_finite"].append(f"lr[{gi}] at step {step}")
                if not _close(le, lg, atol, rtol):
                    d = {"step": step, "field": f"lr[{gi}]", "expected": le, "got": lg}
                    fields.append(d)
                    if res["lr_divergence"] is None:
                        res["lr_divergence"] = dict(d, group=gi)
        le, lg = e["loss"], g["loss"]
        if not (math.isfinite(le) and math.isfinite(lg)):
            res["non_finite"].append(f"loss at step {step}")
        if not _close(le, lg, atol, rtol):
            d = {"step": step, "field": "loss", "expected": le, "got": lg}
            fields.append(d)
            if res["loss_divergence"] is None:
                res["loss_divergence"] = dict(d, abs_diff=abs(le - lg) if math.isfinite(le - lg) else None)
        if fields and first is None:
            first = fields[0]
    if first is None and len(got) != len(expected):
        n = min(len(got), len(expected))
        step = expected[n]["step"] if n < len(expected) else got_steps[n]
        first = {"step": step, "field": "updates", "expected": len(expected), "got": len(got)}
    res["first_divergence"] = first
    if data_first is not None or len(got) != len(expected):
        counts = _data_counts(expected, got, prefix or [])
        res["data_order"] = dict(data_first or {"first_divergent_step": first["step"] if first else None,
                                                "batch": None, "expected_ids": None, "got_ids": None}, **counts)
    for key in ("first_divergence", "lr_divergence", "loss_divergence"):
        if res[key] is not None:
            res[key] = {k: _jsonable(v) for k, v in res[key].items()}
    return res


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return f"{steps[0]}..{steps[-1]}"
    return ",".join(map(str, steps))


def _data_counts(expected: list[dict], got: list[dict], prefix: list[dict]) -> dict:
    """Duplicated and never-seen samples of the resumed line (prefix + got) against the continuous one.

    Per epoch when every update records ``epoch``: a sample counts as *duplicated* for each extra
    time it is consumed within one epoch, and as *never seen* when the continuous run consumed it in
    that epoch but the resumed line did not. Without epochs the whole compared window is one group.
    """
    cont = prefix + expected
    line = prefix + got
    by_epoch = all("epoch" in u for u in cont + line)

    def groups(updates):
        g: dict[Any, Counter] = {}
        for u in updates:
            g.setdefault(u["epoch"] if by_epoch else "window", Counter()).update(u["sample_ids"])
        return g

    if by_epoch:
        ge, gg = groups(cont), groups(line)
    else:
        ge, gg = groups(expected), groups(got)
    per_epoch = []
    dup_total = miss_total = 0
    for key in sorted(set(ge) | set(gg), key=str):
        e, g = ge.get(key, Counter()), gg.get(key, Counter())
        dup = sum(max(0, c - max(1, e.get(i, 0))) for i, c in g.items())
        miss = sum(1 for i in e if g.get(i, 0) == 0)
        dup_total += dup
        miss_total += miss
        if dup or miss:
            per_epoch.append({"epoch": key if by_epoch else None, "duplicated": dup, "never_seen": miss})
    return {"duplicated": dup_total, "never_seen": miss_total, "per_epoch": per_epoch,
            "counted_by": "epoch" if by_epoch else "window"}


def compare_runs(expected_traj: dict, got_traj: dict, expected_state, got_state, *, interrupt_at: int,
                 atol: float, rtol: float, prefix: list[dict] | None = None, name: str = "resumed",
                 training_only: bool = False, ignore_streams: Iterable[str] = ()) -> dict:
    """Compare a resumed (or control) run with the continuous run: per update, final state, next draws.

    Args:
        expected_traj / got_traj: loaded trajectories (:func:`ckpt_archive.resume.trajectory.load_trajectory`).
        expected_state / got_state: the final ``checkpoint.pt`` of each run (nested state).
        interrupt_at: updates before the resume; steps ``interrupt_at+1..`` are compared.
        training_only: for negative controls: ignore the ``rng``, ``data`` and ``progress`` parts and
            the next draws (a perturbed stream that is restored but never used shows up only there,
            and that is "changed nothing" for training).
        ignore_streams: random streams (``python``, ``numpy``, ``torch``) declared unused: their
            final state and next draws are not compared (an unused stream is often unseeded).

    Returns:
        the comparison object of ``verification.json`` (``matched``, ``first_divergence``, ...).
    """
    exp_updates = [u for u in expected_traj["updates"] if u["step"] > interrupt_at]
    res = compare_trajectories(exp_updates, got_traj["updates"], atol=atol, rtol=rtol, prefix=prefix)
    res["name"] = name
    # Final state, leaf by leaf.
    compared, not_compared = _state_parts(expected_state)
    _, got_extra = _state_parts(got_state)
    if training_only:
        compared = [k for k in compared if k not in ("rng", "data", "progress")] if any(
            k in CONVENTIONAL_KEYS for k in compared) else compared
    streams = rng_streams(expected_state)
    ignore = set(ignore_streams)
    skip_paths = [p for st, paths in streams.items() if st in ignore for p in paths]
    td = _TreeDiff(atol, rtol, skip=skip_paths)
    if isinstance(expected_state, dict) and isinstance(got_state, dict):
        for k in compared:
            if k not in got_state:
                td.add((k,), "missing", "present", "absent")
            else:
                td.compare(expected_state[k], got_state[k], (k,))
    else:
        td.compare(expected_state, got_state)
    training_nf = [p for p in td.non_finite if p.split(".")[0] in ("model", "optimizer")]
    res["non_finite"] += [f"final {p}" for p in training_nf]
    final = {"matched": td.total == 0, "compared": compared,
             "not_compared": sorted(set(not_compared) | set(got_extra))
             + [f"{_fmt_path(p)} (declared without effect)" for p in skip_paths],
             "first_divergent_field": td.diffs[0]["field"] if td.diffs else None,
             "differences": td.diffs, "differences_total": td.total}
    res["final_state"] = final
    model_diffs = [v for k, v in td.max_abs.items() if k == "model" or k.startswith("model.")]
    res["max_param_abs_diff"] = max(model_diffs) if model_diffs else None
    if res["max_param_abs_diff"] is not None and td.total and any(
            d["field"].startswith("model") and d["kind"] != "value" for d in td.diffs):
        res["max_param_abs_diff"] = None  # structure differs: no meaningful number
    # Next draws of every random stream.
    draws_diff = []
    draws_compared: list[str] = []
    if not training_only:
        ed = (expected_traj.get("final") or {}).get("next_draws") or {}
        gd = (got_traj.get("final") or {}).get("next_draws") or {}
        # Only streams the checkpoint carries: a stream it does not save cannot be expected to continue.
        draws_compared = [st for st in sorted(set(ed) | set(gd)) if st in streams and st not in ignore]
        for stream in draws_compared:
            if stream not in ed or stream not in gd:
                draws_diff.append({"stream": stream, "expected": _jsonable(ed.get(stream)),
                                   "got": _jsonable(gd.get(stream)), "kind": "missing"})
            elif len(ed[stream]) != len(gd[stream]) or not all(
                    _close(x, y, atol, rtol) for x, y in zip(ed[stream], gd[stream])):
                draws_diff.append({"stream": stream, "expected": _jsonable(ed[stream]), "got": _jsonable(gd[stream]),
                                   "kind": "value"})
    res["next_draws"] = {"matched": not draws_diff, "compared": draws_compared, "differences": draws_diff}
    rng_only = bool(td.diffs) and all(any(d["field"] == _fmt_path(p) or d["field"].startswith(_fmt_path(p) + ".")
                                          or d["field"].startswith(_fmt_path(p) + "[")
                                          for ps in streams.values() for p in ps) for d in td.diffs)
    if (rng_only or draws_diff) and res["first_divergence"] is None:
        bad = sorted({st for st, ps in streams.items() for p in ps for d in td.diffs
                      if d["field"].startswith(_fmt_path(p))} | {d["stream"] for d in draws_diff})
        res["hint"] = (f"every update matched but the {', '.join(bad)} RNG state differs at the end: if the "
                       f"script never draws from it (and does not seed it), declare it with "
                       + " ".join(f"--expect-no-effect {b}" for b in bad))
    if res["first_divergence"] is not None and not training_only:
        # The updates diverged. A stream the resume forgot to restore usually ends in another state
        # while the streams it did restore end alike: name it (the per-update fields cannot).
        ended: dict[str, bool] = {}
        for st, ps in streams.items():
            if st in ignore:
                continue
            sd = _TreeDiff(atol, rtol)
            for p in ps:
                try:
                    sd.compare(_get(expected_state, p), _get(got_state, p), p)
                except (KeyError, IndexError, TypeError):
                    sd.add(p, "missing", "present", "absent")
            ended[st] = sd.total == 0
        differ = sorted(st for st, same in ended.items() if not same)
        if differ and len(differ) < len(ended):
            res["suspect_streams"] = differ
            res["hint"] = (f"of the random streams the checkpoint carries, only {', '.join(differ)} ends in "
                           f"another state than in the continuous run ({', '.join(sorted(set(ended) - set(differ)))} "
                           f"end alike): check that the resume restores the {', '.join(differ)} RNG state")
    last_step = exp_updates[-1]["step"] if exp_updates else interrupt_at
    if res["first_divergence"] is None and td.diffs:
        d = td.diffs[0]
        res["first_divergence"] = {"step": last_step, "field": f"final.{d['field']}", "expected": d["expected"],
                                   "got": d["got"]}
    if res["first_divergence"] is None and draws_diff:
        d = draws_diff[0]
        res["first_divergence"] = {"step": last_step, "field": f"next_draws.{d['stream']}",
                                   "expected": d["expected"], "got": d["got"]}
    res["diverged"] = res["first_divergence"] is not None or bool(res["structure"])
    res["matched"] = not res["diverged"] and not res["non_finite"]
    return res


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------
def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def prepare_output(output: str | os.PathLike | None, *, default_prefix: str) -> Path:
    """Create the output folder; refuse an existing non-empty one (a proof is never overwritten).

    Args:
        output: the folder; ``None`` makes ``./<default_prefix>-<UTC timestamp>``.

    Raises:
        OutputExists: the folder exists and is not empty.
    """
    if output is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = Path(f"{default_prefix}-{stamp}")
        n = 1
        while out.exists():
            n += 1
            out = Path(f"{default_prefix}-{stamp}-{n}")
    else:
        out = Path(output)
    if out.exists():
        if not out.is_dir():
            raise OutputExists("exists and is not a folder; give a new --output", where=str(out))
        if any(out.iterdir()):
            raise OutputExists("folder exists and is not empty; an earlier proof is never overwritten: "
                               "give a new --output", where=str(out))
    out.mkdir(parents=True, exist_ok=True)
    return out.resolve()


def _interruption_facts(state, interrupt_at: int) -> dict:
    facts: dict[str, Any] = {"step": None, "epoch": None, "cursor": None, "samples_per_epoch": None,
                             "mid_epoch": None}
    if not isinstance(state, dict):
        return facts
    prog = state.get("progress") if isinstance(state.get("progress"), dict) else {}
    data = state.get("data") if isinstance(state.get("data"), dict) else {}
    if type(prog.get("step")) is int:
        facts["step"] = prog["step"]
    for src in (data, prog):
        if type(src.get("epoch")) is int and facts["epoch"] is None:
            facts["epoch"] = src["epoch"]
    if type(data.get("cursor")) is int:
        facts["cursor"] = data["cursor"]
    for key in ("permutation", "order", "indices", "sample_order"):
        if key in data and hasattr(data[key], "__len__"):
            facts["samples_per_epoch"] = len(data[key])
            break
    if facts["cursor"] is not None and facts["samples_per_epoch"]:
        facts["mid_epoch"] = 0 < facts["cursor"] < facts["samples_per_epoch"]
    return facts


def _next_lr(traj: dict, state) -> list[float] | None:
    nl = (traj.get("final") or {}).get("next_lr")
    if nl:
        return [float(x) for x in nl]
    try:
        return [float(g["lr"]) for g in state["optimizer"]["param_groups"]]
    except (KeyError, TypeError, IndexError):
        return None


def _data_summary(traj: dict) -> dict:
    ups = traj["updates"]
    epochs = [u.get("epoch") for u in ups]
    new_perm = None
    if all(e is not None for e in epochs):
        for u, prev in zip(ups[1:], ups):
            if u["epoch"] != prev["epoch"]:
                new_perm = u["step"]
                break
    return {"updates": len(ups), "samples_consumed": sum(len(u["sample_ids"]) for u in ups),
            "distinct_samples": len({i for u in ups for i in u["sample_ids"]}),
            "epochs": sorted({e for e in epochs if e is not None}),
            "new_epoch_at_step": new_perm}


def _control_verdict(cmp: dict | None, *, name: str, kind: str, label: str, expected_no_effect: bool,
                     applied: bool = True, note: str = "", crashed: RunRecord | None = None) -> dict:
    """The ``negative_controls`` entry for one control, and whether it is acceptable (``ok``)."""
    entry: dict[str, Any] = {"name": name, "kind": kind, "diverged": False, "first_divergent_step": None,
                             "field": None, "expected": None, "got": None, "status": "", "ok": False,
                             "message": "", "changed": []}
    if not applied:
        entry.update(status="skipped", ok=True, message=f"not run: {note}")
        return entry
    if crashed is not None:
        entry.update(diverged=True, status="diverged", ok=True,
                     message=f"the run refused the perturbed state (exit {crashed.exit_code}): "
                             f"{crashed.stderr_tail(2)}", field="exit_code", expected=0, got=crashed.exit_code)
        return entry
    assert cmp is not None
    fd = cmp["first_divergence"]
    if cmp["diverged"]:
        entry.update(diverged=True, status="diverged", ok=True)
        if fd:
            entry.update(first_divergent_step=fd["step"], field=fd["field"], expected=fd.get("expected"),
                         got=fd.get("got"))
            entry["message"] = (f"diverged at update {fd['step']}, field {fd['field']}: expected "
                                f"{_short(fd.get('expected'))}, got {_short(fd.get('got'))}")
        else:
            entry["message"] = "diverged: " + "; ".join(cmp["structure"])
        if expected_no_effect:
            entry["message"] += " (declared --expect-no-effect, but perturbing it did change the run)"
    elif expected_no_effect:
        entry.update(status="no-effect-expected", ok=True,
                     message=f"perturbing {label} changed nothing, as declared with --expect-no-effect")
    else:
        entry.update(status="no-effect", ok=False,
                     message=f"perturbing {label} changed nothing: either it is not restored or not used"
                             + (" (declare an unused stream with --expect-no-effect)" if kind == "tool" else ""))
    return entry


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.7g}"
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def check_resume(command: Sequence[str], *, steps: int, interrupt_at: int, output: str | os.PathLike | None = None,
                 atol: float = 1e-12, rtol: float = 0.0, controls: Sequence[str] | None = None,
                 expect_no_effect: Sequence[str] = (), script_controls: Sequence[Sequence[str] | str] = (),
                 jobs: int = 1, timeout: float | None = None, env: dict | None = None,
                 on_event: Event | None = None, kind: str = "check-resume",
                 archive_loop: ArchiveLoop | None = None) -> dict:
    """Run the resume check and write ``verification.json`` into ``output``.

    Args:
        command: the command template (argv list) with ``{steps}``, ``{output}`` and a ``{resume}``
            form (see :func:`expand_command`).
        steps: total optimizer updates of the continuous run (> ``interrupt_at``).
        interrupt_at: updates before the interruption (>= 1).
        output: a new or empty folder; default ``./ckpt-archive-check-resume-<UTC timestamp>``.
        atol / rtol: tolerance for floats: ``|expected - got| <= atol + rtol * |expected|``.
        controls: tool-made controls to run (names or aliases, see :data:`TOOL_CONTROLS`); all by
            default, ``[]`` for none.
        expect_no_effect: controls declared unused (``numpy``: the script draws nothing from NumPy):
            a control that changes nothing is then accepted.
        script_controls: extra arguments (a string split like a shell, or a list) appended to the
            resumed command for each script-side control, e.g. ``"--omit-rng-restore"``.
        jobs: how many control runs at once (each is a separate process).
        timeout: seconds per run; ``None`` for no limit.
        env: environment for the runs (default: this process's, with ``PYTHONHASHSEED=0`` unless set).
        on_event: called with one human line per phase (progress on stderr in the CLI).
        kind: ``"check-resume"`` or ``"demo"``, recorded in the report.
        archive_loop: where the interruption checkpoint goes (default: a repository ``archive/`` in
            ``output``).

    Returns:
        the report written to ``verification.json`` (see ``schemas/verification.v1.schema.json``);
        ``report["all_checks_passed"]`` is the verdict.

    Raises:
        UsageError: bad arguments or command template.
        OutputExists: ``output`` exists and is not empty.
        SourceError: a run failed, timed out, or broke the contract (no checkpoint/trajectory, wrong
            number of updates).
        IntegrityError: the archived interruption checkpoint failed verification.
    """
    say = on_event or (lambda s: None)
    command = list(command)
    check_template(command)
    if interrupt_at < 1 or steps <= interrupt_at:
        raise UsageError(f"need 1 <= --interrupt-at < --steps, got --interrupt-at {interrupt_at} --steps {steps}")
    if atol < 0 or rtol < 0 or not (math.isfinite(atol) and math.isfinite(rtol)):
        raise UsageError(f"tolerances must be finite and >= 0, got atol {atol} rtol {rtol}")
    if jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {jobs}")
    chosen = list(TOOL_CONTROLS) if controls is None else list(dict.fromkeys(canonical_control(c) for c in controls))
    no_effect = {canonical_control(c) for c in expect_no_effect}
    scripted = [shlex.split(s) if isinstance(s, str) else list(s) for s in script_controls]
    if any(not s for s in scripted):
        raise UsageError("an empty --script-control was given")
    out = prepare_output(output, default_prefix=f"ckpt-archive-{kind}")
    run_env = dict(os.environ if env is None else env)
    run_env.setdefault("PYTHONHASHSEED", "0")
    runs_dir, resume_dir = out / "runs", out / "resume"
    resume_dir.mkdir()
    loop = archive_loop or ArchiveLoop(out / "archive")
    records: list[RunRecord] = []
    t_start = time.monotonic()

    def launch(name: str, n: int, resume: Path | None, extra: Sequence[str] = ()) -> RunRecord:
        argv = expand_command(command, steps=n, output=runs_dir / name, resume=resume) + list(extra)
        rec = _run(name, argv, runs_dir / name, timeout=timeout, env=run_env)
        records.append(rec)
        return rec

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        say(f"running continuous ({steps} updates) and interrupted ({interrupt_at} updates) in fresh processes")
        f_cont = pool.submit(launch, "continuous", steps, None)
        f_int = pool.submit(launch, "interrupted", interrupt_at, None)
        cont, intr = f_cont.result(), f_int.result()
        for rec in (cont, intr):
            _require_ok(rec)
        cont_traj, int_traj = load_trajectory(cont.output), load_trajectory(intr.output)
        for rec, traj, n in ((cont, cont_traj, steps), (intr, int_traj, interrupt_at)):
            got = [u["step"] for u in traj["updates"]]
            if got != list(range(1, n + 1)):
                raise SourceError(f"run '{rec.name}' recorded updates {_span(got)}, expected 1..{n} "
                                  "(does the script run {steps} updates and call Trajectory.record with step=?)",
                                  where=str(rec.output / TRAJECTORY_FILE))
        determinism = compare_trajectories(cont_traj["updates"][:interrupt_at], int_traj["updates"], atol=atol, rtol=rtol)
        determinism = {"matched": determinism["first_divergence"] is None and not determinism["structure"],
                       "first_divergence": determinism["first_divergence"]}

        say(f"packing the interruption checkpoint (update {interrupt_at}) into the archive, verifying, restoring")
        int_ckpt = _load_checkpoint(intr.output / CHECKPOINT_FILE)
        facts = _interruption_facts(int_ckpt, interrupt_at)
        archive = loop.store(intr.output / CHECKPOINT_FILE, step=facts["step"] if facts["step"] is not None else interrupt_at)
        restored = loop.restore(resume_dir / "restored.pt")
        archive["restored_to"] = str(restored)
        archived_state = loop.load()
        cmp_restored = _TreeDiff(0.0, 0.0)
        cmp_restored.compare(int_ckpt, archived_state)
        archive["round_trip_exact"] = cmp_restored.total == 0
        if cmp_restored.total:
            d = cmp_restored.diffs[0]
            raise IntegrityError(f"the archive did not give back the interruption checkpoint exactly: "
                                 f"{d['field']} ({d['kind']}: {_short(d['expected'])} vs {_short(d['got'])})",
                                 where=archive["repository"])

        say(f"resuming from the restored checkpoint for {steps - interrupt_at} more updates")
        res = launch("resumed", steps - interrupt_at, restored)
        _require_ok(res)
        res_traj = load_trajectory(res.output)
        cont_state = _load_checkpoint(cont.output / CHECKPOINT_FILE)
        res_state = _load_checkpoint(res.output / CHECKPOINT_FILE)
        positive = compare_runs(cont_traj, res_traj, cont_state, res_state, interrupt_at=interrupt_at,
                                atol=atol, rtol=rtol, prefix=int_traj["updates"], name="resumed",
                                ignore_streams={STREAMS[c] for c in no_effect if c in STREAMS})
        positive_ok = positive["matched"] and determinism["matched"]

        entries: list[dict] = []
        previous_lr = int_traj["updates"][-1]["lr"] if int_traj["updates"] else None
        if positive_ok:
            jobs_list = []
            for name in chosen:
                label = CONTROL_LABELS[name]
                new_state, pert = perturb(archived_state, name, previous_lr=previous_lr)
                if not pert.applied:
                    entries.append(_control_verdict(None, name=name, kind="tool", label=label,
                                                    expected_no_effect=name in no_effect, applied=False,
                                                    note=pert.note))
                    continue
                import torch

                path = resume_dir / f"control-{name}.pt"
                torch.save(new_state, path)
                jobs_list.append((name, "tool", label, pert, path, ()))
            for args in scripted:
                name = _script_control_name(args)
                jobs_list.append((name, "script", f"the script-side control {' '.join(args)!r}", None, restored, args))
            if jobs_list:
                say(f"running {len(jobs_list)} negative control(s): " + ", ".join(j[0] for j in jobs_list))
            futures = [(j, pool.submit(launch, _run_name(j[0]), steps - interrupt_at, j[4], j[5])) for j in jobs_list]
            for (name, ckind, label, pert, path, _), fut in futures:
                rec = fut.result()
                if rec.timed_out:
                    raise SourceError(f"control run '{rec.name}' timed out after {rec.seconds:.0f} s")
                crashed = rec if (rec.exit_code != 0 or not (rec.output / CHECKPOINT_FILE).is_file()
                                  or not (rec.output / TRAJECTORY_FILE).is_file()) else None
                cmp = None
                if crashed is None:
                    cmp = compare_runs(cont_traj, load_trajectory(rec.output), cont_state,
                                       _load_checkpoint(rec.output / CHECKPOINT_FILE), interrupt_at=interrupt_at,
                                       atol=atol, rtol=rtol, prefix=int_traj["updates"], name=name,
                                       training_only=True)
                e = _control_verdict(cmp, name=name, kind=ckind, label=label,
                                     expected_no_effect=(name in no_effect), crashed=crashed)
                if pert is not None:
                    e["changed"] = pert.changed[:MAX_LISTED]
                    if path != restored:
                        path.unlink(missing_ok=True)
                if cmp is not None:
                    e["comparison"] = _compact(cmp)
                entries.append(e)
            order = {n: i for i, n in enumerate(list(chosen) + [_script_control_name(a) for a in scripted])}
            entries.sort(key=lambda e: order.get(e["name"], 99))
        else:
            for name in chosen:
                entries.append({"name": name, "kind": "tool", "diverged": False, "first_divergent_step": None,
                                "field": None, "expected": None, "got": None, "status": "not-run", "ok": False,
                                "message": "not run: the resume itself already diverged", "changed": []})
            for args in scripted:
                entries.append({"name": _script_control_name(args), "kind": "script", "diverged": False,
                                "first_divergent_step": None, "field": None, "expected": None, "got": None,
                                "status": "not-run", "ok": False,
                                "message": "not run: the resume itself already diverged", "changed": []})
    finally:
        pool.shutdown(wait=True)

    ran = [e for e in entries if e["status"] not in ("skipped", "not-run")]
    relevant = [e for e in ran if e["status"] != "no-effect-expected"]
    negative_detected = bool(relevant) and all(e["diverged"] for e in relevant)
    controls_ok = positive_ok and all(e["ok"] for e in entries)
    problems: list[str] = []
    warnings: list[str] = []
    if not determinism["matched"]:
        fd = determinism["first_divergence"] or {}
        problems.append(f"the script is not deterministic: the continuous and interrupted runs already differ "
                        f"at update {fd.get('step')} ({fd.get('field')}) before any resume; seed every random "
                        "stream from the config")
    if not positive["matched"]:
        problems.append("the resumed run does not match the continuous run: " + describe(positive))
    for e in entries:
        if e["status"] == "no-effect":
            problems.append(e["message"])
        elif e["status"] == "skipped":
            warnings.append(f"control {e['name']} {e['message']}")
    if positive_ok and not ran:
        problems.append("no negative control could run, so nothing shows that this check would see a broken "
                        "resume (the checkpoint holds none of rng/optimizer/scheduler/data)")
    if facts["step"] is not None and facts["step"] != interrupt_at:
        warnings.append(f"the interruption checkpoint says progress.step {facts['step']}, expected {interrupt_at}")
    all_ok = positive_ok and controls_ok and not problems

    report: dict[str, Any] = {
        "format": REPORT_FORMAT, "version": REPORT_VERSION, "tool_version": _tool_version(), "kind": kind,
        "created": _utc_now(), "command": command, "steps": steps, "interrupt_at": interrupt_at,
        "tolerance": {"atol": atol, "rtol": rtol},
        "all_checks_passed": all_ok,
        "positive": positive,
        "determinism": determinism,
        "negative_divergence_detected": negative_detected,
        "negative_controls": entries,
        "cursor_at_interruption": facts["cursor"],
        "samples_per_epoch": facts["samples_per_epoch"],
        "interruption": facts,
        "next_lr_after_final_step": {"continuous": _next_lr(cont_traj, cont_state),
                                     "resumed": _next_lr(res_traj, res_state)},
        "max_param_abs_diff": positive["max_param_abs_diff"],
        "data": {"continuous": _data_summary(cont_traj), "resumed_line": _data_summary(
            {"updates": int_traj["updates"] + res_traj["updates"]})},
        "lr_per_step": {"continuous": [[u["step"], [encode_float(x) for x in u["lr"]]] for u in cont_traj["updates"]],
                        "resumed_line": [[u["step"], [encode_float(x) for x in u["lr"]]]
                                         for u in int_traj["updates"] + res_traj["updates"]]},
        "archive": archive,
        "runs": [r.to_json() for r in sorted(records, key=lambda r: _RUN_ORDER.get(r.name, 9))],
        "problems": problems,
        "warnings": warnings,
        "seconds": round(time.monotonic() - t_start, 3),
        "output": str(out),
    }
    write_report(report, out / REPORT_FILE)
    return report


_RUN_ORDER = {"continuous": 0, "interrupted": 1, "resumed": 2}


def _script_control_name(args: Sequence[str]) -> str:
    """``["--omit-rng-restore"]`` -> ``"omit-rng-restore"`` (the name in ``negative_controls``)."""
    return " ".join(args).lstrip("-") or "script"


def _run_name(control: str) -> str:
    return "control-" + (re.sub(r"[^A-Za-z0-9_.-]+", "_", control).strip("_") or "script")


def _compact(cmp: dict) -> dict:
    keep = ("first_divergence", "lr_divergence", "loss_divergence", "data_order", "max_param_abs_diff",
            "structure", "non_finite")
    out = {k: cmp.get(k) for k in keep}
    out["final_state_first_divergent_field"] = cmp["final_state"]["first_divergent_field"]
    return out


def describe(cmp: dict) -> str:
    """One human line for a comparison: the first divergent update and field, LR and data order apart."""
    parts = []
    fd = cmp.get("first_divergence")
    if fd:
        parts.append(f"first divergence at update {fd['step']}, field {fd['field']}: expected "
                     f"{_short(fd.get('expected'))}, got {_short(fd.get('got'))}")
    if cmp.get("lr_divergence"):
        d = cmp["lr_divergence"]
        parts.append(f"LR diverges at update {d['step']} (group {d['group']}: expected {_short(d['expected'])}, "
                     f"got {_short(d['got'])})")
    if cmp.get("loss_divergence"):
        d = cmp["loss_divergence"]
        parts.append(f"loss diverges at update {d['step']}")
    if cmp.get("data_order"):
        d = cmp["data_order"]
        parts.append(f"data order diverges at update {d['first_divergent_step']} (batch {d['batch']} of the resumed "
                     f"run): {d['duplicated']} duplicated, {d['never_seen']} never-seen samples")
    if cmp.get("structure"):
        parts.extend(cmp["structure"])
    if cmp.get("non_finite"):
        parts.append("non-finite values: " + ", ".join(cmp["non_finite"][:5]))
    if cmp.get("hint"):
        parts.append(cmp["hint"])
    return "; ".join(parts) or "no difference"


def _tool_version() -> str:
    from ckpt_archive import __version__

    return __version__


def schema_path() -> Path:
    """Where ``verification.v1.schema.json`` lives (inside the package)."""
    return Path(__file__).parent.parent / "schemas" / SCHEMA_FILE


def validate_report(report: dict) -> None:
    """Validate a report against ``schemas/verification.v1.schema.json``.

    Raises:
        jsonschema.ValidationError: the report breaks the schema (a bug in this module).
    """
    import jsonschema

    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)


def write_report(report: dict, path: Path) -> Path:
    """Validate ``report`` and write it as strict JSON, atomically (temporary name, fsync, rename)."""
    validate_report(report)
    text = json.dumps(report, indent=2, allow_nan=False)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
