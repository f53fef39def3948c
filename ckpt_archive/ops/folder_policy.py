"""Rewriting chosen files of a folder source while it is restored (``restore --policy session`` on an HF
Trainer or Accelerate folder).

The mechanism only: :func:`rewrite_folder_files` hands a *rewrite* callable the folder's state with
every tensor left as a :class:`~ckpt_archive.format.tensor_stub.TensorStub` (enough to find the
optimizer and scheduler files) and a loader that decodes one file's object from the archive (checked,
never unpickled); the callable returns the objects to write back. Those files are re-serialised with
``torch.save`` over the restored copy, so they are no longer byte-identical to the packed ones; every
other file stays as :func:`ckpt_archive.ops.restore.restore` wrote it. The policy that decides what to
rewrite (``training/folder_session.py``) lives in training, which uses ops, never the reverse.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ckpt_archive.errors import UsageError


@dataclasses.dataclass
class FileRewrite:
    """One file a folder rewrite re-serialises: ``relpath``, its new ``obj``, the ``fields`` it changed."""

    relpath: str
    obj: Any
    fields: list[str]


#: ``rewrite(stub_state, load) -> (rewrites, report)``: ``stub_state`` is ``{relpath: object}`` with
#: tensors as stubs, ``load(relpath)`` decodes that file's object, ``report`` is plain JSON data.
FolderRewrite = Callable[[dict, Callable[[str], Any]], "tuple[list[FileRewrite], dict]"]


def rewrite_folder_files(reader: Any, manifest: dict, dest: Any, rewrite: FolderRewrite, *,
                         map_location: Any = None) -> tuple[int, dict]:
    """Let ``rewrite`` choose and change files of a restored folder source, and write them with ``torch.save``.

    Args:
        reader: the :class:`~ckpt_archive.repo.reader.ArchiveReader` of the generation being restored.
        manifest: its manifest (``source.layout == "folder"``).
        dest: the restored folder (still in restore's staging folder), a
            :class:`~ckpt_archive.store.fs.Dir` of the file layer: every file is reached through it.
        rewrite: see :data:`FolderRewrite`.
        map_location: as given to ``restore`` (where decoded tensors go).

    Returns:
        ``(bytes_delta, report)``: the change of the folder's size in bytes, and ``report`` with
        ``rewritten``: ``[{"file": relpath, "fields": [...]}]`` (files not byte-identical to the packed
        ones), ``warnings``: one line per rewritten file, plus the rewrite's own report.

    Raises:
        UsageError (exit 2): ``rewrite`` names a file that is not a torch file of the folder (a
            safetensors, raw or opaque file cannot carry a rewritten state), or fails itself.
        IntegrityError (exit 1): a member fails its checks while decoded.
    """
    import torch

    from ckpt_archive.format.state_tree import decode
    from ckpt_archive.format.tensor_stub import TensorStub
    from ckpt_archive.ops.restore import _folder_node

    files = {f["relpath"]: f for f in manifest["source"]["files"]}
    tree = reader.tree()
    recs = manifest["tensors"]
    stub_state = decode(tree, lambda key: TensorStub(recs.get(key, {})), where=manifest.get("tree_member"))

    def torch_file(relpath: str) -> dict:
        f = files.get(relpath)
        if f is None or f.get("kind") != "torch" or f.get("hardlink_of"):
            kind = "absent" if f is None else ("a hardlink" if f.get("hardlink_of") else f.get("kind"))
            raise UsageError(f"cannot rewrite {relpath!r} of this folder source: it is {kind}, not a torch file")
        return f

    def load(relpath: str) -> Any:
        torch_file(relpath)
        return reader.load_node(_folder_node(tree, relpath), map_location=map_location)

    rewrites, report = rewrite(stub_state if isinstance(stub_state, dict) else {}, load)
    delta = 0
    done: list[dict] = []
    warnings: list[str] = []
    for rw in rewrites:
        torch_file(rw.relpath)
        parts = rw.relpath.split("/")
        with dest.walk(parts[:-1]) as folder:  # O_NOFOLLOW each step (the manifest's relpath, checked)
            before = folder.lstat(parts[-1]).st_size
            # in place: other names hardlinked to this file get the same bytes; the folder is renamed into
            # place only once complete, so no reader ever sees a half-written file
            with folder.rewrite(parts[-1]) as fh:
                torch.save(rw.obj, fh)
            delta += folder.lstat(parts[-1]).st_size - before
        done.append({"file": rw.relpath, "fields": list(rw.fields)})
        warnings.append(f"{rw.relpath}: rewritten with torch.save ({', '.join(rw.fields)}); it is no longer "
                        f"byte-identical to the packed file")
    return delta, {**report, "rewritten": done, "warnings": warnings}


__all__ = ["FileRewrite", "FolderRewrite", "rewrite_folder_files"]
