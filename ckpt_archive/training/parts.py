"""The parts of a resume point and where they sit in a checkpoint: one copy for training/ and resume/.

A checkpoint is a *resume point*: model, optimizer, scheduler, scaler, RNG streams, data order and
progress (:data:`PARTS`). Trainers name them differently (``optimizer_states``, ``lr_scheduler``,
``rng_state``): :func:`find_parts` finds them under conventional names (:data:`ALIASES`) or by their
shape. The random streams are recognised by key inside an RNG part (:func:`rng_streams_by_key`) or by
the shape of their state anywhere (:func:`rng_streams`). :func:`is_tensor` is the one tensor test.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

from ckpt_archive.errors import UsageError
from ckpt_archive.format.progress import EPOCH_KEYS, STEP_KEYS
from ckpt_archive.format.state_path import StatePath, walk
from ckpt_archive.format.tensor_stub import TensorStub
from ckpt_archive.training.values import as_number

#: The parts of a resume point, and the conventional top-level keys of a checkpoint (the contract of
#: ``check-resume``, docs/check-resume.md).
PARTS = ("model", "optimizer", "scheduler", "scaler", "rng", "data", "progress")
CONVENTIONAL_KEYS = PARTS
#: The random streams a bitwise resume needs (CUDA and other devices come on top where saved).
RNG_STREAMS = ("python", "numpy", "torch")

#: Conventional names (normalised: lowercase, file extension and ``_<rank>`` suffix removed).
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("model", "model_state_dict", "model_state", "state_dict", "net", "network", "module",
              "pytorch_model", "weights", "params"),
    "optimizer": ("optimizer", "optimizer_state_dict", "optimizer_state", "optim", "optim_state_dict", "opt",
                  "optimizer_states", "optimizers"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict", "lr_scheduler_state_dict",
                  "scheduler_state", "sched", "lr_schedulers", "schedulers"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict", "amp_scaler", "amp", "native_amp_scaling_state",
               "gradscaler"),
    "rng": ("rng", "rng_state", "rng_states", "random_states", "rngs", "random"),
    "data": ("data", "data_state", "dataloader", "dataloader_state", "sampler", "sampler_state", "data_cursor",
             "loader", "loader_state", "data_loader"),
    "progress": ("progress", "trainer_state", "training_state", "train_state", "loop_state"),
}


def is_tensor(v: Any) -> bool:
    """Whether ``v`` is a torch tensor (tested without importing torch)."""
    return type(v).__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype")


def norm_key(key: Any) -> str:
    """A key as compared with :data:`ALIASES`: lowercase, last ``/`` segment, no file extension or ``_<rank>``."""
    k = str(key).lower().rsplit("/", 1)[-1]
    k = re.sub(r"\.(pt|pth|bin|pkl|safetensors|ckpt|json)$", "", k)
    k = re.sub(r"_\d+$", "", k)
    return k


def looks_like(part: str, obj: Any) -> bool:
    """Whether ``obj`` has the shape of an optimizer, scheduler or GradScaler state_dict."""
    if part == "optimizer":
        return isinstance(obj, dict) and "param_groups" in obj and "state" in obj
    if part == "scheduler":
        # ChainedScheduler keeps no last_epoch of its own: its _schedulers list says what it is
        return isinstance(obj, dict) and (("last_epoch" in obj and (
            "base_lrs" in obj or "_last_lr" in obj or "_schedulers" in obj or "patience" in obj))
            or (isinstance(obj.get("_schedulers"), (list, tuple)) and "_last_lr" in obj))
    if part == "scaler":
        return isinstance(obj, dict) and "scale" in obj and "growth_factor" in obj
    return False


def find_parts(state: Any, keys: dict | None = None) -> dict[str, list[tuple[StatePath, Any]]]:
    """Locate the parts of a resume point in a nested state.

    Args:
        state: the nested checkpoint (a dict; for a folder source, a dict of relpath -> object).
        keys: part name -> path in ``state`` overriding the conventional names: the display form of
            :class:`~ckpt_archive.format.state_path.StatePath` (``"opt"``, ``"train.optimizer"``,
            ``'ckpt["opt.v2"]'``), a tuple (``("a", 0)``) or a ``StatePath``.

    Returns:
        part name -> list of ``(path, object)``; a list because Lightning keeps ``optimizer_states`` and
        ``lr_schedulers`` as lists (one entry per optimizer). ``progress`` holds a synthetic dict
        ``{"step": int|None, "epoch": int|None}`` gathered from ``progress`` or top-level counters.

    Raises:
        UsageError: a path given in ``keys`` does not exist in ``state``.
    """
    found = _given_parts(state, keys)
    if not isinstance(state, dict):
        return found
    given = set(found)
    # 1. conventional names at the top level, then one level down (e.g. {"checkpoint": {...}}); of
    # several such sub-checkpoints (a folder with epoch_1.pt and epoch_2.pt) only the newest.
    containers = list(_containers(state))
    subs = {id(c) for c, _ in containers[1:]}
    if len(containers) > 2:
        containers = [containers[0], newest_container(containers[1:])]
    for depth_state, prefix in containers:
        _conventional_parts(depth_state, prefix, given, subs, found)
    for part in _MULTI:
        if part in found and part not in given:
            found[part].sort(key=lambda e: _rank(e[0]))
    # 2. by shape, anywhere within three levels (an optimizer nested under an unusual key).
    for part in ("optimizer", "scheduler", "scaler"):
        if part not in found:
            hits = list(_scan(state, part, StatePath(), 3))
            if hits:
                found[part] = hits
    # A bare model state_dict (every value a tensor) is the model itself.
    if "model" not in found and state and all(is_tensor(v) or isinstance(v, TensorStub) for v in state.values()):
        found["model"] = [(StatePath(), state)]
    prog = _progress_of(state, found.get("progress"))
    if prog is None and len(containers) > 1:  # a folder of sub-checkpoints: the newest one's progress
        sub, sub_path = containers[1]
        sub_prog = _progress_of(sub, None)
        if sub_prog is not None:
            prog = (StatePath(tuple(sub_path) + tuple(sub_prog[0])), sub_prog[1])
    if prog is not None:
        found["progress"] = [prog]
    return found


def _given_parts(state: Any, keys: dict | None) -> dict[str, list[tuple[StatePath, Any]]]:
    """The parts named by ``keys`` (see :func:`find_parts`).

    Raises:
        UsageError: an unknown part, a malformed path, or a path that does not exist.
    """
    found: dict[str, list[tuple[StatePath, Any]]] = {}
    for part, spec in dict(keys or {}).items():
        if part not in PARTS:
            raise UsageError(f"unknown part {part!r} in keys (known: {', '.join(PARTS)})")
        try:
            path = StatePath.parse(spec)
        except ValueError as exc:
            raise UsageError(f"keys[{part!r}]: {exc}") from None
        try:
            obj = path.get(state)
        except (KeyError, IndexError, TypeError):
            raise UsageError(f"keys[{part!r}]: no {str(path)!r} in the checkpoint") from None
        found[part] = _expand(part, path, obj)
    return found


def _conventional_parts(container: dict, prefix: StatePath, given: set, subs: set, found: dict) -> None:
    """Add the parts found under conventional names in one container to ``found``. Several
    optimizers/schedulers/scalers in one container (Accelerate's optimizer.bin and optimizer_1.bin) are all
    kept; of any other part the first; an outer container wins. A sub-checkpoint (``model_0.pth`` holding a
    whole checkpoint) is never itself a part, whatever its name."""
    here: set[str] = set()
    for key, obj in container.items():
        if id(obj) in subs:
            continue
        nk = norm_key(key)
        for part, names in ALIASES.items():
            if part in given or nk not in names or not _fits(part, obj):
                continue
            if part in found and (part not in here or part not in _MULTI):
                continue
            found.setdefault(part, []).extend(_expand(part, prefix.child(key), obj))
            here.add(part)


def _fits(part: str, obj: Any) -> bool:
    """Whether ``obj``, found under a conventional name of ``part``, can be that part."""
    if part in ("model", "scaler"):
        return isinstance(obj, dict)
    if part in ("optimizer", "scheduler"):
        return looks_like(part, obj) or (isinstance(obj, (list, tuple)) and bool(obj)
                                         and all(looks_like(part, x) for x in obj))
    return True


#: Parts of which a checkpoint may hold several (one per optimizer), paired by their ``_<n>`` suffix.
_MULTI = ("optimizer", "scheduler", "scaler")


def _rank(path: StatePath) -> int:
    """The ``_<n>`` suffix of the last key (``optimizer_1.bin`` -> 1; none -> 0); list positions as is."""
    last = path[-1] if len(path) else ""
    if isinstance(last, int):
        return last
    m = re.search(r"_(\d+)(\.[A-Za-z]+)?$", str(last))
    return int(m.group(1)) if m else 0


def newest_container(containers: list[tuple[dict, StatePath]]) -> tuple[dict, StatePath]:
    """Of several sub-checkpoints (``epoch_1.pt``, ``epoch_2.pt`` in one folder) the newest: the highest
    progress step, then epoch, then the last by natural name order (``epoch_10`` after ``epoch_9``)."""
    def key(c: tuple[dict, StatePath]):
        prog = _progress_of(c[0], None)
        step, epoch = (prog[1]["step"], prog[1]["epoch"]) if prog else (None, None)
        name = str(c[1])
        natural = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
        return (step if step is not None else -1, epoch if epoch is not None else -1, natural)

    return max(containers, key=key)


def sub_checkpoints(state: Any) -> list[str]:
    """The keys of the sub-checkpoints of a folder state (each holds an optimizer or scheduler), when
    there are several; ``[]`` otherwise. :func:`find_parts` reads only the newest of them."""
    if not isinstance(state, dict):
        return []
    subs = list(_containers(state))[1:]
    return [str(p) for _, p in subs] if len(subs) > 1 else []


def _containers(state: dict) -> Iterable[tuple[dict, StatePath]]:
    """The top level, then the sub-checkpoints: sub-dicts holding an optimizer or scheduler state under a
    conventional name (``{"checkpoint": {...}}``, a folder's ``epoch_9.pt``, or ``model_0.pth`` whose name reads
    as a model but which holds a whole checkpoint)."""
    yield state, StatePath()
    for key, obj in state.items():
        if isinstance(obj, dict) and not looks_like("optimizer", obj) and not looks_like("scheduler", obj):
            if any(norm_key(k) in ALIASES[part] and _fits(part, v)
                   for k, v in obj.items() for part in ("optimizer", "scheduler")):
                yield obj, StatePath((key,))


def _expand(part: str, path: StatePath, obj: Any) -> list[tuple[StatePath, Any]]:
    """One entry per optimizer/scheduler of a list of them (Lightning), else the one object."""
    if part in ("optimizer", "scheduler") and isinstance(obj, (list, tuple)):
        return [(path.at(i), x) for i, x in enumerate(obj)]
    return [(path, obj)]


def _scan(obj: Any, part: str, path: StatePath, depth: int):
    """``(path, object)`` of every object shaped like ``part`` within ``depth`` levels."""
    if depth < 0:
        return
    if looks_like(part, obj):
        yield path, obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)):
                yield from _scan(v, part, path.child(k), depth - 1)
    elif isinstance(obj, list) and len(obj) <= 16:
        for i, v in enumerate(obj):
            if isinstance(v, dict):
                yield from _scan(v, part, path.at(i), depth - 1)


def _progress_of(state: dict, given: list | None) -> tuple[StatePath, dict] | None:
    """``(where, {"step", "epoch"})`` from the progress part (or one found by name), then the top level."""
    step = epoch = None
    where = StatePath()
    sources: list[tuple[StatePath, dict]] = []
    if given:
        sources.extend((p, o) for p, o in given if isinstance(o, dict))
    else:
        for key, obj in state.items():
            if norm_key(key) in ALIASES["progress"] and isinstance(obj, dict):
                sources.append((StatePath((key,)), obj))
    sources.append((StatePath(), state))
    for path, obj in sources:
        for k in STEP_KEYS:
            if step is None and k in obj and isinstance(as_number(obj[k]), int):
                step, where = int(as_number(obj[k])), path
        for k in EPOCH_KEYS:
            if epoch is None and k in obj and isinstance(as_number(obj[k]), int):
                epoch = int(as_number(obj[k]))
                where = where or path
    if step is None and epoch is None:
        return None
    return where, {"step": step, "epoch": epoch}



def rng_streams_by_key(rng: Any) -> dict[str, Any]:
    """Classify the entries of an RNG part into ``python``, ``numpy``, ``torch`` (CPU), ``cuda``."""
    out: dict[str, Any] = {}
    if not isinstance(rng, dict):
        return out
    for key, val in rng.items():
        k = str(key).lower()
        if "cuda" in k or "gpu" in k:
            out.setdefault("cuda", val)
        elif "numpy" in k or k.startswith("np") or k in ("numpy_random_seed",):
            out.setdefault("numpy", val)
        elif "python" in k or k in ("py", "random", "random_state", "py_rng", "python_rng"):
            out.setdefault("python", val)
        elif "torch" in k or "cpu" in k:
            out.setdefault("torch", val)
        elif "xla" in k or "mps" in k or "npu" in k or "xpu" in k:
            out.setdefault(k, val)
    return out


# The random streams by the shape of their state (anywhere in a checkpoint, under any key).

def is_python_rng_state(x: Any) -> bool:
    """A ``random.getstate()`` value: ``(3, <625 ints>, gauss)`` (tuple or list)."""
    return (isinstance(x, (tuple, list)) and len(x) == 3 and type(x[0]) is int and x[0] == 3
            and isinstance(x[1], (tuple, list)) and len(x[1]) == 625 and all(type(i) is int for i in x[1][:4]))


def is_numpy_rng_state(x: Any) -> bool:
    """A NumPy ``bit_generator.state`` dict (PCG64, MT19937, ...)."""
    return isinstance(x, dict) and isinstance(x.get("bit_generator"), str) and "state" in x


def is_numpy_legacy_rng_state(x: Any) -> bool:
    """A legacy ``np.random.get_state()`` tuple ``("MT19937", keys, pos, has_gauss, gauss)``."""
    return isinstance(x, (tuple, list)) and len(x) == 5 and x[0] == "MT19937"


def is_torch_rng_state(path: StatePath, x: Any) -> bool:
    """A torch generator state: a 1-d uint8 tensor of 5056 bytes (CPU mt19937), or of 16 bytes (a CUDA
    philox seed and offset) under a path that names ``cuda`` or ``rng``."""
    if not is_tensor(x):
        return False
    import torch

    if x.dtype != torch.uint8 or x.dim() != 1:
        return False
    if x.numel() == 5056:  # the CPU mt19937 generator state
        return True
    text = str(StatePath(path)).lower()
    return x.numel() == 16 and ("cuda" in text or "rng" in text)  # a CUDA philox state: seed, offset


def rng_streams(state: Any) -> dict[str, list[StatePath]]:
    """Where each random stream's state sits in ``state``: ``{"python": [path], "numpy": [...], "torch": [...]}``.

    Found by shape, not by key name (a ``random.getstate()`` tuple, a NumPy ``bit_generator`` dict or
    legacy ``MT19937`` tuple, a uint8 torch generator state), outside ``model``/``optimizer``/``scheduler``.
    """
    found: dict[str, list[StatePath]] = {}
    for path, node in walk(state, skip_top=("model", "optimizer", "scheduler")):
        if is_python_rng_state(node):
            found.setdefault("python", []).append(path)
        elif is_numpy_rng_state(node) or is_numpy_legacy_rng_state(node):
            found.setdefault("numpy", []).append(path)
        elif is_torch_rng_state(path, node):
            found.setdefault("torch", []).append(path)
    return found
