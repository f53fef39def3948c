"""What a manifest says besides the state: config/metrics/data-id files, progress found in the state,
code identity, environment, loading instructions.
"""
from __future__ import annotations

import collections

import os
import platform
import subprocess
import sys
from typing import Any

from ckpt_archive.format.config_file import load_value_file
from ckpt_archive.format.progress import find_metrics, find_progress

__all__ = ["load_value_file", "value_or_file", "find_progress", "find_metrics", "code_identity", "environment",
           "default_instructions", "needs_by_part", "restored_file_loading", "torch_load_snippet",
           "unsafe_globals_of_file", "unsafe_globals_of_state"]


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
        if "numpy" in sys.modules:
            env["numpy"] = sys.modules["numpy"].__version__
        else:  # [issue 29] nor NumPy (~0.1 s): its installed distribution's version
            import importlib.metadata

            env["numpy"] = importlib.metadata.version("numpy")
    except Exception:
        pass
    return env


def _dtype_classes(pkl: bytes) -> set[str]:
    """The NumPy dtype classes (``numpy.dtypes.UInt32DType``) a pickle builds: ``torch.load(weights_only=True)``
    checks the class of every object it BUILDs, and a dtype is pickled as ``numpy.dtype('u4', ...)`` -- its
    class never appears as a global, so ``get_unsafe_globals_in_checkpoint`` does not list it, yet the load
    refuses it. Read from the opcodes (nothing executed): the string following each ``numpy.dtype`` global
    (direct or through the memo) is the dtype's spec."""
    import pickletools

    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return set()
    found: set[str] = set()
    memo: dict = {}
    prev = None
    pending = False
    strings = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING")
    try:
        for op, arg, _ in pickletools.genops(pkl):
            if op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = prev
                continue
            if op.name == "MEMOIZE":
                memo[len(memo)] = prev
                continue
            if op.name == "GLOBAL":
                value = ("global", str(arg).replace(" ", "."))
            elif op.name in strings:
                value = ("str", arg)
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                value = memo.get(arg)
            else:
                value = None
            if pending and value is not None and value[0] == "str":
                try:
                    cls = type(np.dtype(value[1]))
                    found.add(f"{cls.__module__}.{cls.__qualname__}")
                except (TypeError, ValueError):
                    pass
                pending = False
            if value is not None and value[0] == "global" and value[1] in ("numpy.dtype", "numpy.core.numeric.dtype"):
                pending = True
            prev = value
    except Exception:  # noqa: BLE001 - a pickle this scan does not follow: the globals alone are the answer
        pass
    return {name for name in found if name != "numpy.dtype"}


def _unsafe_globals(f) -> list[str] | None:
    """What a ``torch.save`` zip (a path or a binary file object) holds that ``torch.load(weights_only=True)``
    refuses unless allowed: torch's ``get_unsafe_globals_in_checkpoint`` (the pickle's globals) plus the
    NumPy dtype classes it builds (:func:`_dtype_classes`). None when torch cannot tell (torch < 2.5, not a
    zip)."""
    import zipfile

    import torch

    finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if finder is None:
        return None
    try:
        names = set(finder(f))
        if hasattr(f, "seek"):
            f.seek(0)
        with zipfile.ZipFile(f) as zf:
            pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is not None and zf.getinfo(pkl).file_size <= (256 << 20):
                names |= _dtype_classes(zf.read(pkl))
    except Exception:  # noqa: BLE001 - an unreadable answer is "cannot tell", never a failed pack or restore
        return None
    return sorted(names)


def unsafe_globals_of_state(state: Any) -> list[str] | None:
    """The globals (``"module.qualname"``) a ``torch.save`` file of ``state`` holds that
    ``torch.load(weights_only=True)`` refuses unless allowed: NumPy's reconstructors, dtypes and arrays (and
    the dtype classes it builds), an admitted plain-data class, ``bytes``...; ``[]`` when plain
    ``weights_only=True`` loads it.

    How: ``state`` is saved with ``torch.save`` into memory, every tensor pickled as ``torch.device("cpu")``
    and every NumPy array as one element of its dtype (so the cost is per object, not per byte: ~10 ms for
    3000 tensors), and that pickle's opcodes are read (:func:`_unsafe_globals`; nothing is unpickled).
    Tensors need nothing beyond weights_only's defaults (torch rebuilds them itself), so leaving them out
    changes no answer.

    A state of plain containers and tensors only (:func:`_pickles_plain`) is answered ``[]`` without
    pickling it, and without importing torch when none of its tensors is a torch tensor: a ``.pt`` read
    without torch (format/pt_pickle.py) stays a pack without ``import torch`` (~1 s of CPU).

    Returns:
        sorted names, or None when this torch cannot tell (torch < 2.5) or ``torch.save`` refuses the state.
    """
    if _pickles_plain(state):
        return []
    import io
    import pickle
    import types

    import torch

    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None

    class Skeleton(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor):
                return torch.device, ("cpu",)  # a global weights_only always allows, and no storage
            if np is not None and type(obj) is np.ndarray and obj.size > 1:
                # one element, not none: an empty array's b"" data pickles as builtins.bytes, a real one's not
                return obj.flat[:1].__reduce_ex__(2)
            return NotImplemented

    module = types.SimpleNamespace(Pickler=Skeleton, Unpickler=pickle.Unpickler, __name__="pickle")
    buf = io.BytesIO()
    try:
        torch.save(state, buf, pickle_module=module)
    except Exception:  # noqa: BLE001 - a state torch.save refuses: restore says so when it writes it
        return None
    buf.seek(0)
    return _unsafe_globals(buf)


def _pickles_plain(state: Any) -> bool:
    """Whether ``state`` holds only what pickles with no global beyond the two :func:`unsafe_globals_of_state`
    always finds allowed: ``dict``, ``list``, ``tuple``, ``str``, ``int``, ``float``, ``bool``, ``None`` (exact
    types: a subclass pickles its class), ``collections.OrderedDict`` (with its attributes, a state_dict's
    ``_metadata``), and tensors (pickled as ``torch.device``): a torch-free :class:`PtTensor`, or a
    ``torch.Tensor`` when torch is already imported (a state holding one came from torch). Anything else (a
    NumPy array, a set, bytes, an enum, a class) is False: torch's own scan decides. Shared and cyclic
    references are walked once; no recursion (any nesting)."""
    from collections import OrderedDict

    from ckpt_archive.format.pt_pickle import PtTensor

    torch = sys.modules.get("torch")
    tensors = (PtTensor,) if torch is None else (PtTensor, torch.Tensor)
    atoms = (str, int, float, bool, type(None))
    seen: set[int] = set()
    stack = [state]
    while stack:
        x = stack.pop()
        kind = type(x)
        if kind in atoms or issubclass(kind, tensors):
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        if kind is dict or kind is OrderedDict:
            stack.extend(x.keys())
            stack.extend(x.values())
            if kind is OrderedDict:
                stack.extend(vars(x).values())
        elif kind is list or kind is tuple:
            stack.extend(x)
        else:
            return False
    return True


def unsafe_globals_of_file(path: str | os.PathLike) -> list[str] | None:
    """The globals of a ``torch.save`` file that ``torch.load(weights_only=True)`` refuses unless allowed
    (:func:`_unsafe_globals`, read from the file's pickle, nothing unpickled); None when it cannot be told
    (a legacy, non-zip file; torch < 2.5).

    A file the torch-free reader accepts (:func:`ckpt_archive.format.pt_pickle.read`: only
    ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2`` and the classic storage classes, all of
    which plain ``weights_only=True`` allows) is answered ``[]`` without importing torch ([issue 29]: ``import
    torch`` was 2-3 s of restore's CPU on the benchmark box, for the answer torch's scan gives such a file);
    anything else is left to torch's scan."""
    import zipfile

    try:
        if not zipfile.is_zipfile(path):
            return None
    except OSError:
        return None
    if _plain_without_torch(path):
        return []
    return _unsafe_globals(os.fspath(path))


def _plain_without_torch(path: str | os.PathLike) -> bool:
    """Whether :func:`ckpt_archive.format.pt_pickle.read` accepts the ``torch.save`` file ``path`` (then plain
    ``torch.load(weights_only=True)`` loads it, nothing to allow). Reads the zip's records and its pickle; no
    tensor byte is touched (the file's map is closed unread)."""
    from ckpt_archive.format import pt_pickle

    try:
        _, file = pt_pickle.read(path)
    except pt_pickle.NotSimple:
        return False
    if hasattr(file.map, "close"):
        try:
            file.map.close()
        except BufferError:  # a view of it still held: the map goes with its last view
            pass
    return True


def _read_without_torch(state: Any) -> bool:
    """[break] True when ``state`` holds tensors read by :mod:`ckpt_archive.format.pt_pickle` and otherwise
    only plain containers and scalars: exactly what that reader accepts, all of which plain
    ``weights_only=True`` loads. Asking :func:`unsafe_globals_of_state` instead imported torch (the second
    it saves) and, since it cannot save a PtTensor, answered "cannot tell": the torch-free pack wrote other
    instructions than the torch.load path for the same file."""
    from ckpt_archive.format.pt_pickle import PtTensor

    plain = (str, int, float, bool, type(None))
    stack, seen, found = [state], set(), False
    while stack:
        x = stack.pop()
        if type(x) is PtTensor:
            found = True
        elif type(x) in (dict, collections.OrderedDict):
            if id(x) not in seen:
                seen.add(id(x))
                stack.extend(x.keys())
                stack.extend(x.values())
                stack.extend(getattr(x, "__dict__", {}).items())  # an OrderedDict's _metadata (BUILD)
        elif type(x) in (list, tuple):
            if id(x) not in seen:
                seen.add(id(x))
                stack.extend(x)
        elif type(x) not in plain:
            return False
    return found


def needs_by_part(state: Any) -> dict | None:
    """What a restored ``.pt`` of ``state`` needs allowed (:func:`unsafe_globals_of_state`), as a whole and
    per top-level key (what ``restore --only KEY`` writes).

    Returns:
        ``{"allow": [names], "plain_parts": [keys whose file loads with plain weights_only=True]}``, or None
        when it cannot be told.
    """
    if _read_without_torch(state):
        return {"allow": [], "plain_parts": []}  # what unsafe_globals_of_state says of it, without torch
    whole = unsafe_globals_of_state(state)
    if whole is None:
        return None
    plain: list[str] = []
    if whole and isinstance(state, dict):
        for key, value in state.items():
            if isinstance(key, str) and unsafe_globals_of_state(value) == []:
                plain.append(key)
    return {"allow": whole, "plain_parts": plain}


def _resolve(name: str) -> tuple[str | None, str, Any]:
    """``"numpy._core.multiarray._reconstruct"`` -> (module to import, Python expression, the object): the
    longest importable module prefix, then attributes; (None, name, None) when it cannot be found here."""
    import importlib

    parts = name.split(".")
    if len(parts) == 2 and parts[0] == "builtins":
        import builtins

        return None, parts[1], getattr(builtins, parts[1], None)
    for cut in range(len(parts) - 1, 0, -1):
        mod_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - not a module: try a shorter prefix
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        return mod_name, name, obj
    return None, name, None


def torch_load_snippet(allow: list[str], path: str = "ckpt.pt") -> str:
    """Python that loads a restored ``torch.save`` file with exactly ``allow`` admitted (nothing else) by
    ``torch.serialization.safe_globals``; plain ``torch.load(path, weights_only=True)`` when ``allow`` is
    empty. Each global is imported by its module and named as the file names it; one whose ``__module__``
    and ``__qualname__`` differ from that name is given as ``(object, "name")``, as torch matches names."""
    if not allow:
        return f"import torch\nstate = torch.load({path!r}, weights_only=True)\n"
    imports = {"torch"}
    items = []
    for name in allow:
        mod, expr, obj = _resolve(name)
        if mod is not None:
            imports.add(mod)
        own = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        items.append(expr if own == name else f"({expr}, {name!r})")
    lines = [f"import {m}" for m in sorted(imports)]
    lines.append("allowed = [" + ", ".join(items) + "]  # exactly what the file holds besides tensors")
    lines.append("with torch.serialization.safe_globals(allowed):")
    lines.append(f"    state = torch.load({path!r}, weights_only=True)")
    return "\n".join(lines) + "\n"


def _kinds(allow: list[str]) -> str:
    """``["numpy.dtype", "argparse.Namespace", "builtins.bytes"]`` -> ``"NumPy values, argparse.Namespace,
    bytes"`` (what the types are, in words)."""
    words = []
    if any(n.startswith("numpy.") for n in allow):
        words.append("NumPy values")
    words += [n.removeprefix("builtins.") for n in allow if not n.startswith("numpy.")]
    return ", ".join(words)


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


def default_instructions(source_format: str, layout: str, top_keys: list[str], needs: dict | None = None,
                         allowed: list[str] | None = None) -> dict:
    """Loading instructions when the user gives none, generated from what the restored output needs.

    Args:
        source_format, layout: the source's (``"torch-file"``, ``"file"``; a ``"folder"`` restores as a folder).
        top_keys: the state's top-level keys.
        needs: :func:`needs_by_part` of the state (None: could not be told).
        allowed: plain-data classes admitted at pack (``ckpt_archive.load`` needs those but
            ``argparse.Namespace``).

    Returns:
        ``{"text", "snippet"}``: the snippet runs as written once ``REPO`` and ``ckpt.pt`` name the
        repository and the restored file (tests/test_loading_instructions.py runs it for every kind of state).
    """
    keys = ", ".join(repr(k) for k in top_keys[:12]) or "(none)"
    extra = [a for a in (allowed or []) if a != "argparse.Namespace"]
    load_args = f", options=ckpt_archive.LoadOptions(allow={extra!r})" if extra else ""
    api = (f"import ckpt_archive\n"
           f"state = ckpt_archive.load('REPO', generation='latest'{load_args})  # the exact state; nothing unpickled\n")
    if layout == "folder":
        snippet = ("# restore the folder, then resume with the original library:\n"
                   "#   ckpt-archive restore REPO@latest --output ./restored\n"
                   f"import ckpt_archive\n"
                   f"files = ckpt_archive.load('REPO', generation='latest'{load_args})  # {{relpath: state}}\n")
        what = "checkpoint folder" if source_format == "folder" else f"{source_format} checkpoint folder"
        text = f"A {what}. Restore it with `ckpt-archive restore REPO@GEN --output DIR` and " \
               f"point the original trainer at DIR."
        return {"text": text, "snippet": snippet}
    policy = ("A checkpoint carries progress, not policy: check the LR the next step will use "
              "(`ckpt-archive inspect`).")
    if source_format == "safetensors-file":
        snippet = (api + "\n# the file `ckpt-archive restore REPO@latest --output model.safetensors` writes:\n"
                   "from safetensors.torch import load_file\nstate = load_file('model.safetensors')\n")
        text = ("A .safetensors file. `ckpt-archive restore REPO@GEN --output model.safetensors` writes it back "
                "byte for byte; it loads with safetensors.torch.load_file(path).")
        return {"text": text, "snippet": snippet}
    use = ("# then: model.load_state_dict(state['model']); optimizer.load_state_dict(state['optimizer']);\n"
           "# scheduler.load_state_dict(state['scheduler']); RNG streams last -- or, in that order:\n"
           "# ckpt_archive.restore_training_state(state, model=..., optimizer=..., scheduler=...)\n"
           f"# top-level keys: {keys}\n")
    allow = None if needs is None else needs["allow"]
    load = torch_load_snippet(allow or [])
    snippet = api + "\n# the file `ckpt-archive restore REPO@latest --output ckpt.pt` writes:\n" + load + use
    if allow is None:
        text = (f"A {source_format} checkpoint. `ckpt-archive restore REPO@GEN --output ckpt.pt` writes a torch.save "
                f"file; what torch.load(path, weights_only=True) needs allowed could not be told here (if it "
                f"refuses the file, it names the type to allow with torch.serialization.safe_globals); "
                f"ckpt_archive.load gives the exact state without it. {policy}")
        snippet = api + use
    elif not allow:
        text = (f"A {source_format} checkpoint. `ckpt-archive restore REPO@GEN --output ckpt.pt` writes a file that "
                f"loads with torch.load(path, weights_only=True). {policy}")
    else:
        plain = needs.get("plain_parts") or []
        parts = (f" `--only {plain[0]}` writes a part that loads with plain weights_only=True"
                 + (f" (so do {', '.join(plain[1:])})" if len(plain) > 1 else "") + ";") if plain else ""
        text = (f"A {source_format} checkpoint. `ckpt-archive restore REPO@GEN --output ckpt.pt` writes a file that "
                f"holds {_kinds(allow)}: torch.load(path, weights_only=True) refuses it unless exactly these are "
                f"allowed: {', '.join(allow)} (the snippet does it with torch.serialization.safe_globals).{parts} "
                f"ckpt_archive.load gives the exact state without any pickle. {policy}")
    return {"text": text, "snippet": snippet}


def restored_file_loading(path: str | os.PathLike, *, plain_parts: list[str] | None = None) -> dict:
    """How the file ``restore`` just wrote loads, from the file itself (``restore`` prints it).

    Args:
        path: the restored file (a ``torch.save`` file or a ``.safetensors`` file).
        plain_parts: top-level keys that load with plain ``weights_only=True`` (from the manifest's
            instructions), suggested as ``--only`` when the whole file needs more.

    Returns:
        ``{"format": "torch" | "safetensors", "allow": [names] | None, "snippet": str, "text": str}``;
        ``allow`` is None when it could not be told (a legacy, non-zip ``torch.save`` file).
    """
    import zipfile

    from pathlib import Path

    from ckpt_archive.store import fs

    p = os.fspath(path)
    if not zipfile.is_zipfile(p):
        with fs.Dir.open(Path(p).parent) as folder:  # the target just written, read through the file layer
            fd = folder.open_file(Path(p).name, os.O_RDONLY | os.O_NONBLOCK)
            try:
                head = os.read(fd, 1)
            finally:
                os.close(fd)
        if head != b"\x80":  # not a pickle either: a .safetensors file (restore writes nothing else)
            return {"format": "safetensors", "allow": [], "text": "loads with safetensors.torch.load_file(path)",
                    "snippet": f"from safetensors.torch import load_file\nstate = load_file({p!r})\n"}
    allow = unsafe_globals_of_file(p)
    if allow is None:
        text = ("is a legacy (non-zip) torch.save file, whose needs are not read without loading it: "
                "`ckpt-archive inspect REPO@GEN` names what the packed state needs allowed, and "
                "torch.load(path, weights_only=True) names any type it refuses (allow it with "
                "torch.serialization.safe_globals)")
        return {"format": "torch", "allow": None, "text": text, "snippet": torch_load_snippet([], p)}
    if not allow:
        return {"format": "torch", "allow": [], "text": "loads with torch.load(path, weights_only=True)",
                "snippet": torch_load_snippet([], p)}
    text = (f"holds {_kinds(allow)}: torch.load(path, weights_only=True) refuses it unless exactly these are "
            f"allowed: {', '.join(allow)}; load it with the snippet")
    if plain_parts:
        text += f", or restore a part that needs none (--only {plain_parts[0]})"
    return {"format": "torch", "allow": allow, "text": text, "snippet": torch_load_snippet(allow, p)}
