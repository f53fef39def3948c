"""Reader for torch.distributed.checkpoint (DCP) folders: ``.metadata`` plus ``*.distcp`` shards.

DCP is what training reaches for when it outgrows one GPU or one machine: every rank writes its
own ``__<rank>_<n>.distcp`` shard and rank 0 writes ``.metadata``, a *pickle* of
``torch.distributed.checkpoint.metadata.Metadata`` that says, for every tensor chunk and every
non-tensor value, which shard file holds it at which byte offset and length.

The archive keeps ``.metadata`` and every shard **byte for byte** (kind ``opaque``), so that
``torch.distributed.checkpoint.load`` works on the restored folder exactly as on the original. We
still need to *read* ``.metadata`` to know which shards must be present and how long they must be:
:func:`read_dcp_metadata` does that with a restricted unpickler (:class:`MetadataUnpickler`) that
admits only DCP's own metadata classes and the few torch/builtin types they are made of
(``torch.Size``, dtypes, layouts, paths); any other global is refused with its name. Plain
``pickle.load`` is never called on a user's file by this module.

Facts recorded in ``info["dcp"][subdir]`` (see :func:`describe_dcp`): the metadata version, each
shard file's size and the byte range the metadata needs from it, and one entry per stored item:
``[fqn, chunk_offsets | None, file, offset, length]``. :func:`check_dcp_folder` checks a set of
present files against that record (verify); :func:`consolidate_dcp` writes one ``torch.save`` file
(``restore --consolidate``).
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
from pathlib import Path

from ckpt_archive.errors import RefusedPickle, SourceError
from ckpt_archive.sources.base import SourceCheckpoint, SourceFile, register
from ckpt_archive.sources.files import file_sizes, is_dcp_file, read_folder

METADATA_NAME = ".metadata"
SHARD_SUFFIX = ".distcp"
_MAX_PROGRESS_ITEM = 1 << 20  # bytes; a step counter is a few hundred bytes

_PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path", "PurePath"}


def _allowed_global(module: str, name: str):
    """The object for ``module.name`` if the DCP metadata allowlist admits it, else ``None``."""
    import torch

    if module == "torch.distributed.checkpoint.metadata":
        mod = importlib.import_module(module)
        obj = getattr(mod, name, None)
        if isinstance(obj, type) and obj.__module__ == module:
            return obj
        return None
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        return importlib.import_module(module)._StorageInfo
    if module == "torch":
        obj = getattr(torch, name, None)
        if name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        return None
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout  # maps a layout name to a torch.layout, nothing else
    if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
        try:  # only pathlib's own modules: an archive never makes this reader import anything else
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
    if module == "collections" and name == "OrderedDict":
        import collections

        return collections.OrderedDict
    if module == "builtins" and name in ("set", "frozenset", "tuple", "list", "dict", "slice"):
        import builtins

        return getattr(builtins, name)
    return None


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits only DCP metadata classes and their parts.

    Admitted: every class defined in ``torch.distributed.checkpoint.metadata``,
    ``torch.distributed.checkpoint.filesystem._StorageInfo``, ``torch.Size``, torch dtypes /
    layouts / memory formats, ``torch.serialization._get_layout``, ``pathlib`` path classes,
    ``collections.OrderedDict`` and a few plain builtin containers. Anything else raises
    :class:`RefusedPickle` naming the global.
    """

    def find_class(self, module: str, name: str):  # noqa: D102 - documented on the class
        obj = _allowed_global(module, name)
        if obj is None:
            raise RefusedPickle(
                f"refused: DCP metadata references {module}.{name}, which is not one of DCP's own "
                f"metadata types; ckpt-archive never unpickles code from files")
        return obj


def read_dcp_metadata(path: Path):
    """Load a DCP ``.metadata`` file with :class:`MetadataUnpickler`.

    Args:
        path: the ``.metadata`` file.

    Returns:
        a ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        RefusedPickle: the pickle references a global outside the allowlist.
        SourceError: truncated or not a DCP metadata pickle.
    """
    try:
        from torch.distributed.checkpoint.metadata import Metadata
    except Exception as exc:  # torch built without distributed support
        raise SourceError(f"this torch build cannot read DCP checkpoints: {exc}", where=str(path)) from None
    try:
        with open(path, "rb") as fh:
            md = MetadataUnpickler(fh).load()
    except RefusedPickle as exc:
        exc.where = str(path)
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError) as exc:
        raise SourceError(f"unreadable DCP metadata ({type(exc).__name__}: {exc}); truncated?",
                          where=str(path)) from None
    if not isinstance(md, Metadata):
        raise SourceError(f"not DCP metadata (a pickled {type(md).__name__})", where=str(path))
    return md


def _jsonable_offsets(offsets) -> list[int] | None:
    if offsets is None:
        return None
    return [int(x) for x in offsets]


def describe_dcp(folder: Path, *, sizes_prefix: str = "", sizes: dict[str, int] | None = None) -> dict:
    """Summarise a DCP folder's metadata as strict JSON (for the manifest's ``source`` section).

    Args:
        folder: the folder holding ``.metadata``.
        sizes_prefix: the folder's relpath inside the source (``""`` when it is the source).
        sizes: relpath -> size in bytes of the files present (default: measured on disk).

    Returns:
        ``{"version", "metadata_size", "keys", "tensors", "tensor_bytes", "bytes_items",
        "files": {shard: {"size", "entries", "needed"}}, "entries": [[fqn, chunk_offsets|None,
        shard, offset, length], ...], "problems": [...]}`` where ``needed`` is the end of the
        furthest byte range the metadata reads from that shard and ``problems`` lists metadata
        entries without storage (empty for a sound checkpoint).

    Raises:
        RefusedPickle / SourceError: see :func:`read_dcp_metadata`.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = read_dcp_metadata(folder / METADATA_NAME)
    try:
        return _describe(md, folder, sizes_prefix, sizes, BytesStorageMetadata, TensorStorageMetadata)
    except (AttributeError, TypeError, ValueError, KeyError, OverflowError, RuntimeError) as exc:
        # a pickle of the admitted classes can still hold anything in their fields: refuse, naming it
        raise SourceError(f"DCP metadata holds a malformed shard table ({type(exc).__name__}: {exc}); refused",
                          where=str(folder / METADATA_NAME)) from None


def _describe(md, folder: Path, sizes_prefix: str, sizes, BytesStorageMetadata, TensorStorageMetadata) -> dict:
    from ckpt_archive.errors import UnsafePath
    from ckpt_archive.format.paths import check_relpath

    prefix = f"{sizes_prefix}/" if sizes_prefix else ""
    if sizes is None:
        sizes = {f"{prefix}{p.name}": p.stat().st_size for p in folder.iterdir() if p.is_file()}
    entries = []
    files: dict[str, dict] = {}
    stored = set()
    for idx, sinfo in (md.storage_data or {}).items():
        rel = sinfo.relative_path
        try:  # the shard table names files beside .metadata: plain relative names only
            check_relpath(rel if isinstance(rel, str) else str(rel), where=str(folder / METADATA_NAME),
                          what="DCP shard path")
        except UnsafePath as exc:
            raise SourceError(exc.message, where=exc.where) from None
        rel = str(rel)
        off, length = sinfo.offset, sinfo.length
        if not (isinstance(off, int) and isinstance(length, int) and off >= 0 and length >= 0):
            raise ValueError(f"shard {rel!r} has offset {off!r} and length {length!r}")
        if not isinstance(idx.fqn, str):
            raise ValueError(f"an entry's key is a {type(idx.fqn).__name__}, not a string")
        entries.append([idx.fqn, _jsonable_offsets(idx.offset), rel, off, length])
        rec = files.setdefault(rel, {"size": sizes.get(prefix + rel), "entries": 0, "needed": 0})
        rec["entries"] += 1
        rec["needed"] = max(rec["needed"], off + length)
        stored.add((idx.fqn, tuple(idx.offset) if idx.offset is not None else None))
    entries.sort(key=lambda e: (e[2], e[3], e[0]))
    problems = []
    tensors = tensor_bytes = bytes_items = 0
    for fqn, meta in (md.state_dict_metadata or {}).items():
        if isinstance(meta, TensorStorageMetadata):
            tensors += 1
            tensor_bytes += meta.size.numel() * _dtype_size(meta.properties.dtype)
            for chunk in meta.chunks:
                if (fqn, tuple(chunk.offsets)) not in stored:
                    problems.append(f"tensor {fqn} chunk at {list(chunk.offsets)} has no storage entry")
        elif isinstance(meta, BytesStorageMetadata):
            bytes_items += 1
            if (fqn, None) not in stored and not any(s[0] == fqn for s in stored):
                problems.append(f"value {fqn} has no storage entry")
    return {
        "version": str(getattr(md, "version", "") or ""),
        "metadata_size": sizes.get(prefix + METADATA_NAME),
        "keys": len(md.state_dict_metadata or {}),
        "tensors": tensors,
        "tensor_bytes": int(tensor_bytes),
        "bytes_items": bytes_items,
        "files": dict(sorted(files.items())),
        "entries": entries,
        "problems": problems,
    }


def _dtype_size(dtype) -> int:
    try:
        return dtype.itemsize
    except AttributeError:  # pragma: no cover - very old torch
        import torch

        return torch.empty((), dtype=dtype).element_size()


def check_dcp_record(files_present: dict[str, int], record: dict, subdir: str = "") -> list[str]:
    """Problems with one DCP folder's files, judged against its :func:`describe_dcp` record.

    Args:
        files_present: relpath (inside the source/restored folder) -> size in bytes.
        record: the record stored at pack time.
        subdir: the DCP folder's relpath (``""`` when the source is the DCP folder).

    Returns:
        one line per problem: a missing ``.metadata`` or shard, a shard shorter than the byte range
        the metadata reads from it, a shard whose size differs from the one recorded at pack time,
        a metadata entry without storage.
    """
    prefix = f"{subdir}/" if subdir else ""
    problems = []
    if prefix + METADATA_NAME not in files_present:
        problems.append(f"{prefix}{METADATA_NAME}: DCP metadata missing")
    elif record.get("metadata_size") is not None and files_present[prefix + METADATA_NAME] != record["metadata_size"]:
        problems.append(f"{prefix}{METADATA_NAME}: {files_present[prefix + METADATA_NAME]} bytes, "
                        f"{record['metadata_size']} recorded at pack time")
    for shard, rec in sorted(record.get("files", {}).items()):
        rel = prefix + shard
        if rel not in files_present:
            problems.append(f"{rel}: shard referenced by {rec['entries']} DCP metadata entries is missing")
            continue
        have = files_present[rel]
        if have < rec["needed"]:
            problems.append(f"{rel}: shard is {have} bytes but the DCP metadata reads up to byte "
                            f"{rec['needed']} (truncated)")
        elif rec.get("size") is not None and have != rec["size"]:
            problems.append(f"{rel}: shard is {have} bytes, {rec['size']} recorded at pack time")
    for p in record.get("problems", []):
        problems.append(f"{prefix}{METADATA_NAME}: {p}")
    return problems


def check_dcp_folder(files_present: dict[str, int], info: dict) -> list[str]:
    """Check every DCP folder recorded in a source's ``info`` (``info["dcp"]``) against the files present.

    Args:
        files_present: relpath -> size in bytes (e.g. raw sizes of the archive's members, or the
            files of a restored folder).
        info: the source ``info`` recorded at pack time (``SourceCheckpoint.info`` / the manifest's
            ``source.info``).

    Returns:
        one line per problem (empty when every referenced shard is present and whole).
    """
    problems = []
    try:  # the record comes from a manifest: hostile until checked, so a malformed one is a problem
        for subdir, record in sorted((info or {}).get("dcp", {}).items()):
            problems.extend(check_dcp_record(files_present, record, subdir))
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        problems.append(f"{METADATA_NAME}: the manifest's DCP record is malformed ({type(exc).__name__}: {exc})")
    return problems


def attach_dcp_info(info: dict, root: Path, files: list[SourceFile], warnings: list[str]) -> None:
    """Record, for every sub-folder holding a DCP checkpoint, the shards its ``.metadata`` references.

    Raises :class:`SourceError` when a referenced shard is missing or shorter than the metadata
    needs (a damaged checkpoint is not archived). Sets ``info["dcp"] = {subdir: record}`` (``""`` for the folder itself); see
    :func:`describe_dcp`. Used by the folder readers (HF Trainer, Accelerate, any folder) for DCP
    checkpoints inside them.
    """
    rels = [f.relpath for f in files]
    dirs = sorted({r.rsplit("/", 1)[0] if "/" in r else "" for r in rels
                   if r.rsplit("/", 1)[-1] == ".metadata" and is_dcp_file(r, rels, root)})
    if not dirs:
        return
    sizes = file_sizes(files)
    rec = {}
    for d in dirs:
        rec[d] = describe_dcp(root / d if d else root, sizes_prefix=d, sizes=sizes)
        problems = check_dcp_record(sizes, rec[d], d)
        if problems:
            raise SourceError(f"damaged DCP checkpoint: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                              where=str(root / d if d else root))
    info["dcp"] = rec


def consolidate_dcp(folder: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write one ``torch.save`` file holding the whole state of a DCP folder (``restore --consolidate``).

    The folder's ``.metadata`` is first read with :class:`MetadataUnpickler`, so a metadata pickle
    referencing anything but DCP's own types is refused before torch reads it; then
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` runs in this process (no
    process group). The file is written beside ``output`` and renamed into place.

    Args:
        folder: a DCP folder (e.g. a restored one).
        output: the ``.pt`` file to write.

    Returns:
        the output path.

    Raises:
        RefusedPickle / SourceError: unreadable or refused metadata, or a shard torch cannot read.
    """
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(folder)
    output = Path(output)
    from ckpt_archive.store.fs import staged_file

    read_dcp_metadata(folder / METADATA_NAME)
    try:
        # a restore target: staged beside it through the file layer, renamed over it when complete
        with staged_file(output) as tmp, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp_to_torch_save(folder, tmp)
    except (RefusedPickle, SourceError):
        raise
    except Exception as exc:
        raise SourceError(f"could not consolidate the DCP checkpoint: {exc}", where=str(folder)) from None
    return output


_PROGRESS_NAMES = {"global_step": "step", "step": "step", "iteration": "step", "epoch": "epoch",
                   "current_epoch": "epoch"}


def _progress_from_items(folder: Path, record: dict, warnings: list[str]) -> dict:
    """Read small non-tensor values named like a step/epoch counter (``weights_only`` loads only)."""
    import torch

    progress: dict = {}
    for fqn, chunk, shard, off, length in record["entries"]:
        if chunk is not None or length > _MAX_PROGRESS_ITEM:
            continue
        leaf = fqn.rsplit(".", 1)[-1]
        key = _PROGRESS_NAMES.get(leaf)
        if key is None or key in progress:
            continue
        try:
            with open(folder / shard, "rb") as fh:
                fh.seek(off)
                data = fh.read(length)
            value = torch.load(io.BytesIO(data), weights_only=True)
        except Exception:  # a compressed/transformed item or anything unexpected: just not a fact
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value.item())
        if isinstance(value, int) and not isinstance(value, bool):
            progress[key] = value
    return progress


def _detect(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_NAME).is_file() and any(
        p.suffix == SHARD_SUFFIX for p in path.iterdir())


def _read(path: Path, *, allow_numpy: bool = False, **_options) -> SourceCheckpoint:
    if not (path / METADATA_NAME).is_file():
        raise SourceError("not a DCP folder: no .metadata file", where=str(path))
    state, files, warnings = read_folder(path, allow_numpy=allow_numpy)
    sizes = file_sizes(files)
    record = describe_dcp(path, sizes=sizes)
    problems = check_dcp_record(sizes, record)
    if problems:
        raise SourceError(f"damaged DCP checkpoint: {problems[0]}"
                          + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), where=str(path))
    info: dict = {"dcp": {"": record}}
    progress = _progress_from_items(path, record, warnings)
    # Lightning's sharded (FSDP) checkpoints put progress in a meta.pt beside the shards.
    for rel, obj in state.items():
        if isinstance(obj, dict):
            for name, key in _PROGRESS_NAMES.items():
                v = obj.get(name)
                if key not in progress and isinstance(v, int) and not isinstance(v, bool):
                    progress[key] = v
    unknown = [f.relpath for f in files if f.kind == "opaque" and f.relpath != METADATA_NAME
               and not f.relpath.endswith(SHARD_SUFFIX)]
    if unknown:
        info["other_opaque"] = unknown
    return SourceCheckpoint(format="dcp", layout="folder", state=state, files=files, root=path,
                            progress=progress, info=info, warnings=warnings)


register("dcp", _detect, _read, priority=10)
