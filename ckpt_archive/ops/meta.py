"""What a manifest says besides the state: config/metrics/data-id files, progress found in the state,
code identity, environment, loading instructions.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckpt_archive.errors import SourceError


def load_value_file(path: str | os.PathLike, *, what: str = "file") -> Any:
    """Read a JSON, YAML (1.2) or TOML file keeping value types.

    YAML is read with ruamel.yaml's YAML 1.2 safe loader, so ``1e-4`` is a float (PyYAML's 1.1 rules
    read it as a string), ``null`` stays None, ``4`` an int and ``false`` a bool. A ``.txt`` file of
    one id per line (data ids) gives a list of str.

    Raises:
        SourceError: missing or unparsable, naming the file and the parser's message.
    """
    p = Path(path)
    if not p.is_file():
        raise SourceError(f"{what} not found", where=str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SourceError(f"{what} is not UTF-8 text (JSON, YAML, TOML or one id per line)", where=str(p)) from None
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            return json.loads(text)
        if suffix in (".yaml", ".yml"):
            return _yaml(text)
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python < 3.11
                import tomli as tomllib
            return _plain(tomllib.loads(text))
        if suffix in (".txt", ".ids", ".lst"):
            return [line.strip() for line in text.splitlines() if line.strip()]
        # unknown suffix: try JSON, then YAML
        try:
            return json.loads(text)
        except ValueError:
            return _yaml(text)
    except SourceError:
        raise
    except Exception as exc:  # parsers raise many types; report one line naming the file
        raise SourceError(f"cannot parse {what}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                          where=str(p)) from None


def _yaml(text: str) -> Any:
    from ruamel.yaml import YAML

    y = YAML(typ="safe", pure=True)
    y.version = (1, 2)
    return _plain(y.load(text))


def _plain(value: Any) -> Any:
    """Turn parser-specific containers/scalars into plain JSON-able Python values."""
    import datetime as _dt

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
        return value
    return str(value)


def value_or_file(value: Any, *, what: str) -> Any:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return load_value_file(value, what=what)
    return value


# Progress keys of common trainers (one table; training/policy.py has its own copy until format/progress.py
# unifies them): nanoGPT saves ``iter_num``; timm's CheckpointSaver and torchvision's reference scripts
# ``epoch``; fairseq ``optimizer_history[-1]["num_updates"]`` and ``extra_state["train_iterator"]["epoch"]``
# (and ``iterations_in_epoch``, a cursor).
_STEP_KEYS = ("step", "global_step", "iteration", "iter", "iter_num", "num_updates", "update")
_EPOCH_KEYS = ("epoch", "current_epoch")
_CURSOR_KEYS = ("cursor", "data_cursor", "batch_idx", "sample_idx", "position", "iterations_in_epoch")
# Metrics trainers save next to progress: nanoGPT ``best_val_loss``, timm ``metric`` (the eval metric of
# that epoch) and ``best_metric``, torchvision classification ``best_acc1`` (older scripts).
_METRIC_KEYS = ("best_val_loss", "metric", "best_metric", "best_acc1", "best_loss", "val_loss")


def _progress_places(state: dict) -> list:
    places = [state] + [state[k] for k in ("progress", "trainer_state", "data", "sampler", "loader", "extra_state")
                        if isinstance(state.get(k), dict)]
    extra = state.get("extra_state")
    if isinstance(extra, dict) and isinstance(extra.get("train_iterator"), dict):
        places.append(extra["train_iterator"])  # fairseq
    hist = state.get("optimizer_history")
    if isinstance(hist, list) and hist and isinstance(hist[-1], dict):
        places.append(hist[-1])  # fairseq: num_updates of the last optimizer
    return places


def find_metrics(state: Any) -> dict:
    """Metrics found at the top level of a checkpoint dict (:data:`_METRIC_KEYS`): finite or not, plain
    numbers (int/float, or a one-element tensor) only."""
    found: dict = {}
    if not isinstance(state, dict):
        return found
    for name in _METRIC_KEYS:
        v = state.get(name)
        if isinstance(v, bool):
            continue
        if type(v) in (int, float):
            found[name] = v
        elif hasattr(v, "numel") and getattr(v, "numel")() == 1 and not getattr(v, "is_quantized", False):
            found[name] = v.item()
    return found


def find_progress(state: Any) -> dict:
    """Progress (step / epoch / cursor) found at conventional places of a checkpoint dict.

    Looks at the top level, then at ``progress``, ``trainer_state``, ``data``, ``sampler``, ``loader``,
    ``extra_state`` (and fairseq's ``extra_state.train_iterator`` and last ``optimizer_history``
    entry). Only ints (and a float epoch) are taken. Keys: :data:`_STEP_KEYS` (nanoGPT ``iter_num``,
    fairseq ``num_updates``, ...), :data:`_EPOCH_KEYS`, :data:`_CURSOR_KEYS`.
    """
    found: dict = {}
    if not isinstance(state, dict):
        return found
    places = _progress_places(state)
    for place in places:
        for names, field in ((_STEP_KEYS, "step"), (_EPOCH_KEYS, "epoch"), (_CURSOR_KEYS, "cursor")):
            if field in found:
                continue
            for name in names:
                v = place.get(name)
                if isinstance(v, bool):
                    continue
                if isinstance(v, int) or (field == "epoch" and isinstance(v, float)):
                    found[field] = v
                    break
                if hasattr(v, "numel") and getattr(v, "is_sparse", False) is False and getattr(v, "layout", None) \
                        is not None and str(v.layout) == "torch.strided" and not v.is_quantized \
                        and v.device.type != "meta" and v.numel() == 1 and not v.is_floating_point():
                    found[field] = int(v.item())
                    break
    return found


def code_identity(code_version: str | None, cwd: str | os.PathLike | None = None) -> dict:
    """Git commit + dirty flag when run inside a git work tree; ``code_version`` as given."""
    out: dict = {"version": code_version, "git_commit": None, "dirty": None}
    try:
        kw = dict(cwd=cwd or os.getcwd(), capture_output=True, text=True, timeout=10)
        r = subprocess.run(["git", "rev-parse", "HEAD"], **kw)
        if r.returncode == 0:
            out["git_commit"] = r.stdout.strip()
            s = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **kw)
            out["dirty"] = bool(s.stdout.strip()) if s.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": None, "numpy": None,
           "devices": None, "executable": sys.executable}
    try:
        import torch

        env["torch"] = torch.__version__
        env["devices"] = {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    except Exception:  # environment facts are best effort
        pass
    try:
        import numpy

        env["numpy"] = numpy.__version__
    except Exception:
        pass
    return env


def default_instructions(source_format: str, layout: str, top_keys: list[str]) -> dict:
    """Loading instructions when the user gives none: text and a runnable snippet."""
    keys = ", ".join(repr(k) for k in top_keys[:12]) or "(none)"
    if layout == "folder":
        snippet = ("# restore the folder, then resume with the original library\n"
                   "#   ckpt-archive restore REPO@latest --output ./restored\n"
                   "import ckpt_archive\n"
                   "files = ckpt_archive.load('REPO', generation='latest')  # {relpath: state}\n")
        what = "checkpoint folder" if source_format == "folder" else f"{source_format} checkpoint folder"
        text = f"A {what}. Restore it with `ckpt-archive restore REPO@GEN --output DIR` and " \
               f"point the original trainer at DIR."
    else:
        snippet = ("import ckpt_archive\n"
                   "state = ckpt_archive.load('REPO', generation='latest')\n"
                   f"# top-level keys: {keys}\n"
                   "# model.load_state_dict(state['model']); optimizer.load_state_dict(state['optimizer'])\n"
                   "# scheduler.load_state_dict(state['scheduler']); restore RNG streams last\n"
                   "# or: ckpt_archive.restore_training_state(state, model=..., optimizer=..., scheduler=...)\n")
        text = (f"A {source_format} checkpoint. `ckpt-archive restore REPO@GEN --output ckpt.pt` writes a file "
                f"that loads with torch.load(path, weights_only=True). A checkpoint carries progress, not policy: "
                f"check the LR the next step will use (`ckpt-archive inspect`).")
    return {"text": text, "snippet": snippet}
