"""Reader for Lightning ``.ckpt`` files (``Trainer.save_checkpoint`` / ``ModelCheckpoint``).

A Lightning checkpoint is one ``torch.save`` file holding a dict::

    epoch, global_step, pytorch-lightning_version, state_dict (OrderedDict), loops,
    callbacks, optimizer_states (list), lr_schedulers (list), hparams_name, hyper_parameters,
    and, with AMP, the precision plugin's state under its class name ("MixedPrecision": the
    GradScaler state_dict) or the legacy "native_amp_scaling_state".

It is loaded with ``torch.load(weights_only=True)`` only, like any ``.pt``; hyper-parameters
pickled as code objects (an ``argparse.Namespace``, a custom class) are refused with the global's
name, NumPy values only with ``allow_numpy``. The file is restored with ``torch.save`` of the
same nested object, so ``Trainer.fit(..., ckpt_path=restored)`` resumes from it.

Sharded Lightning checkpoints (FSDP / DeepSpeed) are folders: the DCP and generic folder readers
take them.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

from ckpt_archive.errors import SourceError
from ckpt_archive.format.exact_bytes import ZIP_ERRORS
from ckpt_archive.sources.base import SourceCheckpoint, SourceFile, register
from ckpt_archive.sources.hf import json_number, optimizer_facts, scaler_facts, scheduler_facts
from ckpt_archive.sources.torchfile import load_torch_file

_MARKER = b"pytorch-lightning_version"
_MAX_PICKLE_SCAN = 64 << 20  # bytes of data.pkl scanned for the marker during detection


def _detect(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                if pkl is None:
                    return False
                with zf.open(pkl) as fh:
                    return _MARKER in fh.read(_MAX_PICKLE_SCAN)
        if path.suffix.lower() == ".ckpt":
            with open(path, "rb") as fh:
                return _MARKER in fh.read(_MAX_PICKLE_SCAN)
    except ZIP_ERRORS:  # damaged or unsupported (encrypted, unknown method): not ours; torch-file explains why
        return False
    return False


def _read(path: Path, *, allow_numpy: bool = False, zip_crc_checked: bool = False, **_options) -> SourceCheckpoint:
    """``zip_crc_checked``: the caller checks the zip records' CRC-32 itself (see ``load_torch_file``)."""
    obj = load_torch_file(path, allow_numpy=allow_numpy, check_crc=not zip_crc_checked)
    if not isinstance(obj, dict) or "state_dict" not in obj:
        raise SourceError("not a Lightning checkpoint: no top-level state_dict", where=str(path))
    warnings: list[str] = []
    progress = _progress(obj, warnings)
    info: dict = {"filename": path.name, "lightning_version": obj.get("pytorch-lightning_version")}
    done = _batches_completed_in_epoch(obj)
    if done is not None:
        info["batches_completed_in_epoch"] = done
    _optimization_facts(obj, info)
    _run_facts(obj, info)
    return SourceCheckpoint(format="lightning", layout="file", state=obj, root=path.parent,
                            files=[SourceFile("", "torch", path)], progress=progress, info=info,
                            warnings=warnings)


def _progress(obj: dict, warnings: list[str]) -> dict:
    """``{"step": global_step, "epoch": epoch}`` where each is an int; a warning for one that is not."""
    progress: dict = {}
    for key, field in (("step", "global_step"), ("epoch", "epoch")):
        v = obj.get(field)
        if isinstance(v, int) and not isinstance(v, bool):
            progress[key] = v
        elif v is not None:
            warnings.append(f"{field} is {type(v).__name__}, not an integer")
    return progress


def _batches_completed_in_epoch(obj: dict) -> int | None:
    """The fit loop's completed batches in the current epoch (``loops.fit_loop["epoch_loop.batch_progress"]
    .current.completed``), or None where the checkpoint does not hold it as an int."""
    loops = obj.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    if not isinstance(fit, dict):
        return None
    bp = fit.get("epoch_loop.batch_progress")
    if isinstance(bp, dict) and isinstance(bp.get("current"), dict):
        done = bp["current"].get("completed")
        if isinstance(done, int):
            return done
    return None


def _optimization_facts(obj: dict, info: dict) -> None:
    """Facts of the optimizers, LR schedulers and grad scaler into ``info``."""
    opts = obj.get("optimizer_states")
    if isinstance(opts, list):
        info["optimizers"] = [optimizer_facts(o) for o in opts if isinstance(o, dict)]
    scheds = obj.get("lr_schedulers")
    if isinstance(scheds, list):
        info["lr_schedulers"] = [scheduler_facts(s) for s in scheds if isinstance(s, dict)]
    for key in ("MixedPrecision", "MixedPrecisionPlugin", "native_amp_scaling_state"):
        if isinstance(obj.get(key), dict) and "scale" in obj[key]:
            info["grad_scaler"] = scaler_facts(obj[key])
            break


def _run_facts(obj: dict, info: dict) -> None:
    """The plain hyper-parameters, the callbacks' names, the state_dict's key count and ``lr`` (the first LR
    scheduler's first ``last_lr``, after :func:`_optimization_facts`) into ``info``."""
    hp = obj.get("hyper_parameters")
    if isinstance(hp, dict):
        info["hyper_parameters"] = {str(k): v for k, v in hp.items() if _plain(v)}
    cbs = obj.get("callbacks")
    if isinstance(cbs, dict):
        info["callbacks"] = sorted(str(k) for k in cbs)
    sd = obj["state_dict"]
    if isinstance(sd, dict):
        info["state_dict_keys"] = len(sd)
    lr = json_number(info.get("lr_schedulers", [{}])[0].get("last_lr", [None])[0]) if info.get("lr_schedulers") else None
    if lr is not None:
        info["lr"] = lr


def _plain(v) -> bool:
    """Strict-JSON scalar (or a short list of them): safe for the manifest's source section."""
    if v is None or isinstance(v, (bool, str)):
        return True
    if isinstance(v, (int, float)):
        return json_number(v) is not None
    if isinstance(v, (list, tuple)) and len(v) <= 64:
        return all(x is None or isinstance(x, (bool, str)) or json_number(x) is not None for x in v)
    return False


register("lightning", _detect, _read, priority=30)


__all__ = []
