"""Readers for Hugging Face Trainer ``checkpoint-N/`` folders and Accelerate ``save_state`` folders.

Hugging Face Trainer (``Trainer._save_checkpoint``) writes, per checkpoint::

    config.json, generation_config.json          raw (JSON)
    model.safetensors | model-0000k-of-0000n.safetensors + model.safetensors.index.json
      | pytorch_model.bin | adapter_model.safetensors           safetensors / torch
    optimizer.pt, scheduler.pt, scaler.pt (fp16)                  torch (weights_only)
    rng_state.pth | rng_state_<rank>.pth                          torch, NumPy allowlist admitted
    trainer_state.json                                            raw; progress and LR read from it
    training_args.bin                                             opaque: a pickled TrainingArguments
    tokenizer files, pytorch_model_fsdp_0/ (DCP), ...             by content (see ``folders``)

Accelerate (``Accelerator.save_state``) writes ``model[_i].safetensors`` (or
``pytorch_model[_i].bin``), ``optimizer[_i].bin``, ``scheduler[_i].bin``, ``scaler.pt``,
``sampler[_i].bin`` (a pickled sampler object: opaque), ``dl_state_dict[_i].bin``,
``custom_checkpoint_<i>.pkl`` and ``random_states_<rank>.pkl``.

The RNG files of both libraries hold NumPy's legacy ``get_state()`` tuple (a uint32 array) by
design, and both libraries load them with ``torch.load(weights_only=True)`` plus an allowlist of
NumPy's own reconstruction types; we admit exactly the same narrow allowlist
(:func:`ckpt_archive.sources.torchfile.numpy_safe_globals`) for those files only, without
``--allow-numpy``. Any other file that needs NumPy types is kept opaque with a warning unless
``allow_numpy=True``.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from ckpt_archive.format import jsonio
from ckpt_archive.errors import SourceError
from ckpt_archive.sources.base import SourceCheckpoint, SourceFile, register
from ckpt_archive.sources.dcp import attach_dcp_info
from ckpt_archive.sources.files import read_folder

TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
_HF_DIR_RE = re.compile(r"^checkpoint-(\d+)$")
_ACC_DIR_RE = re.compile(r"^checkpoint_(\d+)$")


def json_number(x):
    """A strict-JSON number from a tensor/number, or ``None``: an int or a finite float (a one-element tensor
    gives its item; bools, non-finite floats and anything else give None). Never raises."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            if x.numel() != 1:
                return None
            x = x.item()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def optimizer_facts(opt: dict) -> dict:
    """LR and step count of a torch optimizer ``state_dict()``.

    Returns:
        ``{"param_groups": n, "lr": [per group], "steps": [distinct per-parameter step counts]}``
        (keys present where found).
    """
    out: dict = {}
    groups = opt.get("param_groups")
    if isinstance(groups, list):
        out["param_groups"] = len(groups)
        lrs = [json_number(g.get("lr")) for g in groups if isinstance(g, dict)]
        if any(v is not None for v in lrs):
            out["lr"] = lrs
    st = opt.get("state")
    if isinstance(st, dict):
        steps = set()
        for v in st.values():
            if isinstance(v, dict) and "step" in v:
                s = json_number(v["step"])
                if s is not None:
                    steps.add(int(s))
        if steps:
            out["steps"] = sorted(steps)
    return out


def scheduler_facts(sch: dict) -> dict:
    """``last_epoch`` and the last LR(s) of an LR scheduler ``state_dict()``."""
    out: dict = {}
    le = json_number(sch.get("last_epoch"))
    if le is not None:
        out["last_epoch"] = int(le)
    last = sch.get("_last_lr")
    if isinstance(last, (list, tuple)):
        vals = [json_number(v) for v in last]
        out["last_lr"] = vals
    return out


def scaler_facts(sc: dict) -> dict:
    """The AMP GradScaler fields (``scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``_growth_tracker``) as strict-JSON numbers."""
    out = {}
    for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        if k in sc:
            v = json_number(sc[k])
            if v is not None:
                out[k.lstrip("_")] = v
    return out


def rng_facts(obj: dict, rel: str, warnings: list[str]) -> dict:
    """What an RNG-state file holds: python / numpy (bit generator name) / cpu / cuda device count.

    Understands HF's keys (``python``, ``numpy``, ``cpu``, ``cuda``) and Accelerate's
    (``random_state``, ``numpy_random_seed``, ``torch_manual_seed``, ``torch_cuda_manual_seed``,
    ``torch_xpu_manual_seed``, ...).
    """
    import torch

    out: dict = {"file": rel}
    if "python" in obj or "random_state" in obj:
        out["python"] = True
    np_state = obj.get("numpy", obj.get("numpy_random_seed"))
    if isinstance(np_state, tuple) and np_state and isinstance(np_state[0], str):
        out["numpy"] = np_state[0]
    elif isinstance(np_state, dict) and "bit_generator" in np_state:
        out["numpy"] = str(np_state["bit_generator"])
    if isinstance(obj.get("cpu", obj.get("torch_manual_seed")), torch.Tensor):
        out["cpu"] = True
    for key, label in (("cuda", "cuda"), ("torch_cuda_manual_seed", "cuda"), ("torch_xpu_manual_seed", "xpu"),
                       ("torch_mlu_manual_seed", "mlu"), ("torch_npu_manual_seed", "npu"),
                       ("torch_hpu_manual_seed", "hpu")):
        v = obj.get(key)
        if v is None:
            continue
        n = len(v) if isinstance(v, (list, tuple)) else 1
        out[f"{label}_devices"] = n
        warnings.append(f"{rel}: {n} {label.upper()} RNG state{'s' if n != 1 else ''} saved; a bitwise "
                        f"resume needs {n} visible {label.upper()} device{'s' if n != 1 else ''}")
    if "xm_seed" in obj:
        out["xla"] = True
    return out


def _read_json(path: Path) -> dict:
    try:
        # the one strict reader (duplicate keys, depth, size); HF writes NaN/Infinity with Python's json
        data = jsonio.loads(path.read_bytes(), where=str(path), allow_nonfinite=True)
    except (OSError, ValueError) as exc:
        raise SourceError(f"unreadable JSON: {getattr(exc, 'message', exc)}", where=str(path)) from None
    if not isinstance(data, dict):
        raise SourceError("expected a JSON object", where=str(path))
    return data


def _check_index(root: Path, files: list[SourceFile]) -> None:
    """Every shard a ``*.index.json`` weight map names must be present."""
    rels = {f.relpath for f in files}
    for f in files:
        if not f.relpath.endswith(".index.json"):
            continue
        data = _read_json(root / f.relpath)
        wm = data.get("weight_map")
        if not isinstance(wm, dict):
            continue
        parent = f.relpath.rsplit("/", 1)[0] + "/" if "/" in f.relpath else ""
        missing = sorted({str(v) for v in wm.values() if parent + str(v) not in rels})
        if missing:
            raise SourceError(f"the weight map names shard(s) that are missing: {', '.join(missing)}",
                              where=str(root / f.relpath))


def _model_files(files: list[SourceFile]) -> list[str]:
    pat = re.compile(r"^(model|pytorch_model|adapter_model|consolidated)([_.-].*)?\.(safetensors|bin)$")
    return [f.relpath for f in files if pat.match(f.relpath)
            or f.relpath.startswith(("pytorch_model_fsdp", "global_step"))]


def _detect_hf(path: Path) -> bool:
    if not path.is_dir():
        return False
    if (path / TRAINER_STATE).is_file():
        return True
    if _HF_DIR_RE.match(path.name):
        return any((path / n).is_file() for n in ("optimizer.pt", "scheduler.pt", TRAINING_ARGS)) or any(
            path.glob("rng_state*.pth"))
    return False


def _read_hf(path: Path, *, allow_numpy: bool = False, **_options) -> SourceCheckpoint:
    state, files, warnings = read_folder(
        path, allow_numpy=allow_numpy, numpy_files=("rng_state*.pth",), opaque_files=(TRAINING_ARGS,))
    _check_index(path, files)
    info: dict = {}
    progress: dict = {}
    m = _HF_DIR_RE.match(path.name)
    if (path / TRAINER_STATE).is_file():
        info["trainer"] = _trainer_state(path, progress)
        gs = info["trainer"]["global_step"]
        if m and int(m.group(1)) != gs:
            warnings.append(f"folder is named {path.name} but {TRAINER_STATE} says global_step {gs}")
    else:
        warnings.append(f"no {TRAINER_STATE}: Trainer cannot resume from this folder (progress unknown)")
        if m:
            progress["step"] = int(m.group(1))
    _collect_training_facts(state, info, warnings)
    models = _model_files(files)
    if not models:
        warnings.append("no model weights found (model.safetensors, pytorch_model.bin, adapter_model.*)")
    info["model_files"] = models
    if (path / "config.json").is_file():
        cfg = _read_json(path / "config.json")
        info["model"] = {k: cfg[k] for k in ("model_type", "architectures", "torch_dtype", "dtype",
                                              "tie_word_embeddings") if k in cfg}
    info["opaque"] = [f.relpath for f in files if f.kind == "opaque"]
    attach_dcp_info(info, path, files, warnings)
    return SourceCheckpoint(format="hf-trainer", layout="folder", state=state, files=files, root=path,
                            progress=progress, info=info, warnings=warnings)


#: trainer_state.json fields shown as they are (numbers, strings, booleans or null; non-finite numbers as null).
_TRAINER_FIELDS = ("max_steps", "num_train_epochs", "train_batch_size", "save_steps", "logging_steps",
                   "eval_steps", "num_input_tokens_seen", "total_flos", "best_metric", "best_global_step",
                   "best_model_checkpoint")


def _trainer_state(path: Path, progress: dict) -> dict:
    """The facts of the folder's ``trainer_state.json``; sets ``progress`` step (``global_step``) and epoch
    (the whole epochs of its fractional ``epoch``).

    Returns:
        ``{"global_step", "epoch", <_TRAINER_FIELDS>, "last_logged" (the last log entry with a learning rate:
        its step, learning_rate and loss), "stateful_callbacks" (their names)}``, each where present.

    Raises:
        SourceError: ``global_step`` is not an integer (or the file is not JSON).
    """
    ts = _read_json(path / TRAINER_STATE)
    gs = ts.get("global_step")
    if not isinstance(gs, int) or isinstance(gs, bool):
        raise SourceError(f"field global_step is {gs!r}, expected an integer", where=str(path / TRAINER_STATE))
    progress["step"] = gs
    ep = json_number(ts.get("epoch"))
    if ep is not None:
        progress["epoch"] = int(math.floor(ep))
    trainer = {"global_step": gs, "epoch": ep}
    for k in _TRAINER_FIELDS:
        v = ts.get(k)
        if v is None or isinstance(v, (str, bool)) or json_number(v) is not None:
            trainer[k] = v if not isinstance(v, float) or math.isfinite(v) else None
    logs = ts.get("log_history")
    if isinstance(logs, list):
        last_lr = next((e for e in reversed(logs) if isinstance(e, dict) and "learning_rate" in e), None)
        if last_lr is not None:
            trainer["last_logged"] = {k: json_number(last_lr.get(k)) for k in ("step", "learning_rate", "loss")
                                      if json_number(last_lr.get(k)) is not None}
    cbs = ts.get("stateful_callbacks")
    if isinstance(cbs, dict):
        trainer["stateful_callbacks"] = sorted(cbs)
    return trainer


def _collect_training_facts(state: dict, info: dict, warnings: list[str]) -> None:
    """Optimizer / scheduler / scaler / RNG facts of the decomposed files (both layouts)."""
    rng = []
    for rel in sorted(state):
        obj = state[rel]
        if not isinstance(obj, dict):
            continue
        name = rel.rsplit("/", 1)[-1]
        stem = name.split(".")[0]
        if re.match(r"^optimizer(_\d+)?$", stem) and "param_groups" in obj:
            info.setdefault("optimizer", {})[rel] = optimizer_facts(obj)
        elif re.match(r"^scheduler(_\d+)?$", stem):
            info.setdefault("scheduler", {})[rel] = scheduler_facts(obj)
        elif stem == "scaler":
            info["grad_scaler"] = scaler_facts(obj)
        elif re.match(r"^(rng_state|random_states)(_\d+)?$", stem):
            rng.append(rng_facts(obj, rel, warnings))
    if rng:
        info["rng"] = rng


_ACC_MODEL = re.compile(r"^(model|pytorch_model)(_\d+)?\.(safetensors|bin)$")
_ACC_OPT = re.compile(r"^optimizer(_\d+)?\.bin$")


def _detect_accelerate(path: Path) -> bool:
    if not path.is_dir() or (path / TRAINER_STATE).is_file():
        return False
    names = [p.name for p in path.iterdir() if p.is_file()]
    if any(re.match(r"^random_states_\d+\.pkl$", n) for n in names):
        return True
    return any(_ACC_MODEL.match(n) for n in names) and any(_ACC_OPT.match(n) for n in names)


def _read_accelerate(path: Path, *, allow_numpy: bool = False, **_options) -> SourceCheckpoint:
    state, files, warnings = read_folder(path, allow_numpy=allow_numpy, numpy_files=("random_states_*.pkl",))
    _check_index(path, files)
    info: dict = {}
    progress: dict = {}
    _collect_training_facts(state, info, warnings)
    ranks = sorted(int(m.group(1)) for f in files
                   if (m := re.match(r"^random_states_(\d+)\.pkl$", f.relpath)))
    if ranks:
        info["processes"] = len(ranks)
        missing = [r for r in range(max(ranks) + 1) if r not in ranks]
        if missing:
            raise SourceError(f"random_states for process(es) {', '.join(map(str, missing))} missing",
                              where=str(path))
        rs = state.get("random_states_0.pkl")
        if isinstance(rs, dict) and json_number(rs.get("step")) is not None:
            info["accumulation_step"] = int(json_number(rs["step"]))  # Accelerator.step: micro-step counter
    m = _ACC_DIR_RE.match(path.name)
    if m:
        info["save_iteration"] = int(m.group(1))
    steps = sorted({s for facts in info.get("optimizer", {}).values() for s in facts.get("steps", [])})
    if len(steps) == 1:
        progress["step"] = steps[0]
        info["step_source"] = "optimizer state step"
    else:
        lasts = {f["last_epoch"] for f in info.get("scheduler", {}).values() if "last_epoch" in f}
        if len(lasts) == 1:
            progress["step"] = lasts.pop()
            info["step_source"] = "scheduler last_epoch"
    info["model_files"] = _model_files(files)
    info["opaque"] = [f.relpath for f in files if f.kind == "opaque"]
    attach_dcp_info(info, path, files, warnings)
    return SourceCheckpoint(format="accelerate", layout="folder", state=state, files=files, root=path,
                            progress=progress, info=info, warnings=warnings)


register("hf-trainer", _detect_hf, _read_hf, priority=20)
register("accelerate", _detect_accelerate, _read_accelerate, priority=25)


__all__ = ["TRAINER_STATE", "TRAINING_ARGS", "optimizer_facts", "scheduler_facts", "scaler_facts", "rng_facts"]
