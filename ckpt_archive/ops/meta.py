"""What a manifest says besides the state: config/metrics/data-id files, progress found in the state,
code identity, environment, loading instructions.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any

from ckpt_archive.format.config_file import load_value_file
from ckpt_archive.format.progress import find_metrics, find_progress

__all__ = ["load_value_file", "value_or_file", "find_progress", "find_metrics", "code_identity", "environment",
           "default_instructions"]


def value_or_file(value: Any, *, what: str, max_bytes: int | None = None) -> Any:
    """A value as given, or read from a file (:func:`load_value_file`); a file of more than
    ``4 * max_bytes`` bytes is refused unread (``pack`` then checks the encoded size against ``max_bytes``).

    Raises:
        SourceError: unreadable file. UsageError: the file is too large (names it and the limit).
    """
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        if max_bytes is not None:
            try:
                size = os.stat(value).st_size
            except OSError:
                size = 0  # load_value_file names the missing file
            if size > 4 * max_bytes:
                from ckpt_archive.errors import UsageError

                raise UsageError(f"{what} of {size} bytes is refused: the limit is {max_bytes} bytes as JSON "
                                 f"(docs/FORMAT.md, 'Reading hostile archives')", where=str(value))
        return load_value_file(value, what=what)
    return value


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
        if "torch" in sys.modules:
            import torch

            env["torch"] = torch.__version__
            env["devices"] = {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0}
        else:  # [issue 29] a pack that read its file without torch does not import it (~1 s) for these facts
            env["torch"], env["devices"] = _torch_facts_unimported()
    except Exception:  # environment facts are best effort
        pass
    try:
        import numpy

        env["numpy"] = numpy.__version__
    except Exception:
        pass
    return env


def _torch_facts_unimported() -> tuple[str | None, dict | None]:
    """torch's version and CUDA device count without importing torch: ``torch/version.py`` (the text
    ``torch.__version__`` and ``torch.version.cuda`` come from), and for a CUDA build the GPUs the NVIDIA
    driver lists (``/proc/driver/nvidia/gpus``), as many as ``CUDA_VISIBLE_DEVICES`` leaves visible when it
    is a list of indices (None when it names devices otherwise: not told)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    text = open(os.path.join(list(spec.submodule_search_locations)[0], "version.py"), encoding="utf-8").read()
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*(None|['\"][^'\"]*['\"])", text, re.M)
    if version is None or cuda is None:
        return (version.group(1) if version else None), None
    if cuda.group(1) == "None":
        return version.group(1), {"cuda": 0}  # a CPU build: torch.cuda.is_available() is False
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        n = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if not all(x.isdigit() for x in ids):
            return version.group(1), None
        valid = 0
        for x in ids:  # CUDA stops at the first index the driver does not have
            if int(x) >= n:
                break
            valid += 1
        n = valid
    return version.group(1), {"cuda": n}


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
