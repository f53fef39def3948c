"""``restore``: write an archived generation back as the files it came from (a ``torch.save`` file, a
``.safetensors`` file, or a checkpoint folder), atomically, never over the repository itself."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from ckpt_archive.errors import (CannotCheck, InsufficientSpace, IntegrityError, OutputExists, UsageError,
                                 first_line)
from ckpt_archive.format.paths import check_relpath
from ckpt_archive.ops.common import (RepoLike, copied_note, open_repo, refuse_special_output, refuse_unusable,
                                     require_readable)
from ckpt_archive.ops.load import with_fallback
from ckpt_archive.repo.reader import ArchiveReader
from ckpt_archive.repo.repository import Generation, Repository
from ckpt_archive.store.fs import Dir, Entry


@dataclasses.dataclass
class RestoreResult:
    """What :func:`restore` wrote: ``output`` path, ``generation``, ``bytes_written``, ``layout``.

    ``extra["loading"]`` (a file output): how the file loads, read from the file written
    (:func:`ckpt_archive.ops.meta.restored_file_loading`: ``format``, ``allow`` -- the globals
    ``torch.load(weights_only=True)`` needs allowed --, ``text``, ``snippet``).
    """

    generation: int
    output: str
    bytes_written: int
    layout: str
    only: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    extra: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"ok": True, "generation": self.generation, "output": self.output,
                "bytes_written": self.bytes_written, "layout": self.layout, "only": self.only,
                "warnings": self.warnings, **self.extra}


def _check_space(path: Path, need: int) -> None:
    import shutil

    p = path.parent
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < need:
        raise InsufficientSpace(f"needs about {need} bytes, {free} free", where=str(p))


def restore(repo: RepoLike, generation: str | int = "latest", output: str | os.PathLike | None = None, *,
            force: bool = False, only: str | None = None, fallback: bool = False, map_location=None,
            jobs: int | None = None, transform: Callable[[Any], Any] | None = None,
            consolidate: str | os.PathLike | None = None, allow=(), data_ids: Any = None,
            allow_data_change: bool = False, unverified: bool = False, folder_rewrite: Callable | None = None,
            on_bytes=None, **store_options) -> RestoreResult:
    """Write an archived generation back as a ``torch.save`` file (file sources) or a folder (folder
    sources), atomically: written in a private staging folder beside it (``.NAME.tmp-PID-<hex>``, created
    through the file layer :mod:`ckpt_archive.store.fs`: relative to the output folder's descriptor, never
    through a symbolic link), fsynced, then renamed into place.

    A ``.safetensors`` file source is restored as a ``.safetensors`` file with its header metadata. A
    source file whose exact bytes were kept (``source.files[].exact``) comes back byte for byte (sha256
    checked), unless ``only``, ``transform`` or ``map_location`` asks for a different file; hardlinks in
    a folder source come back as hardlinks.

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        output: the ``.pt`` file or folder to create.
        force: replace an existing output (only after the new one is complete).
        only: restore part of the state (``"model"``: the weights alone, for inference) as a ``.pt``.
        fallback: when ``latest`` fails its checks, restore the newest older generation that verifies.
        map_location: move torch tensors there (default: CPU). jobs: decoder threads.
        transform: applied to a file source's state before it is saved (used by ``--policy session``).
        consolidate: for a torch.distributed.checkpoint (DCP) folder source, also write its whole state
            as one ``torch.save`` file at this path (``sources/dcp.py: consolidate_dcp``).
        allow: plain-data classes to rebuild where a file must be re-serialised (``"module.Class"``).
        data_ids: the resuming session's data ids (a value, or a JSON/YAML/TOML/.txt path): compared, key
            order aside, with the ids packed with the generation (:mod:`ckpt_archive.ops.data_identity`)
            before anything is written. The result's ``extra["data_ids"]`` holds the comparison.
        allow_data_change: restore even when the data ids differ (the differences become a warning).
        unverified: restore a ``partial`` or ``damaged`` generation anyway (``--restore-unverified``;
            refused otherwise, exit 2). Every byte is still checked against its manifest, and the result's
            first warning says loudly what was restored.
        folder_rewrite: for a folder source, re-serialise the files it changes (``--policy session``:
            ``training.folder_session.session_folder_rewrite(cfg)``; see
            :func:`ckpt_archive.ops.folder_policy.rewrite_folder_files`). Its report goes to
            ``extra["folder_rewrite"]``; each rewritten file, no longer byte-identical, is a warning.
        on_bytes: progress callback, called with raw bytes decoded and checked, then with bytes written; one
            with ``phase(name, total)`` is told each phase (``decode and check``, then ``write``; a folder
            or byte-exact file source decodes and writes in one ``decode, check and write`` phase), with
            the generation's raw size (manifest summary) as total (none for ``only``).
        **store_options: for URL repositories.

    Returns:
        :class:`RestoreResult`.

    Whatever it decodes, the rest of the generation is checked before the output is put in place (stored
    bytes of every member and object not decoded, the tensor index: docs/FORMAT.md, "One status rule"); a
    failure is recorded (``CHECK-FAILED.json``), so later readers and ``list`` see the generation damaged.

    Raises:
        OutputExists (exit 2) without ``force``; InsufficientSpace (exit 2); IntegrityError (exit 1): a
            member, object or record of the generation fails a check (also one recorded by an earlier reader);
        UsageError (exit 2): no output, or an output that would destroy the repository or the current folder,
            or one that is a FIFO, device or socket (with or without ``force``: not ours to replace);
            ``folder_rewrite`` for a generation that does not restore to a folder.
        DataIdentityMismatch (exit 1): ``data_ids`` differ from the archived ones (changed, added and removed
            entries listed) and ``allow_data_change`` is False; nothing is written.
        NotUsable (exit 2): a partial or damaged generation without ``unverified``.
        UnsafePath (exit 1): a path of the manifest resolves outside the output folder.

    Example:
        >>> import os, torch, ckpt_archive, tempfile
        >>> repo, out = tempfile.mkdtemp(), os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> _ = ckpt_archive.pack({"w": torch.ones(2), "step": 1}, repo)
        >>> r = ckpt_archive.restore(repo, output=out)
        >>> r.generation, torch.load(out, weights_only=True)["step"]
        (1, 1)
    """
    if output is None:
        raise UsageError("restore needs an output path (--output)")
    if only is not None:
        from ckpt_archive.repo.reader import check_only

        check_only(only)  # "" or "model//w" would select the whole state, or another place than written
    out = Path(output).expanduser().absolute()
    refuse_special_output(out)
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExists("exists; pass --force to replace it (nothing was written)", where=str(out))
    r = open_repo(repo, **store_options)
    notes: list[str] = []
    gen0 = r.resolve(generation, copied=True)
    latest_recorded = gen0.found_damaged_here and str(generation) == "latest"  # refused by with_fallback's rule
    if not latest_recorded:
        refuse_unusable(r, gen0, unverified=unverified, action="restore", override="--restore-unverified")
    gen0 = require_readable(r, gen0, allow_noted=unverified or latest_recorded)
    ids_check = None
    if data_ids is not None:
        from ckpt_archive.ops.data_identity import check_data_ids

        ids_check = check_data_ids(r, gen0.number, data_ids, allow_change=allow_data_change)
    layout = gen0.manifest["source"]["layout"]
    first0 = (gen0.manifest["source"].get("files") or [{}])[0]
    one_pass = transform is None and map_location is None and (
        (layout == "file" and not only and bool(first0.get("exact"))) or _torch_output(layout, only, first0))
    # exact bytes, or a torch.save file written in one pass (ops/restore_torch.py): once, in place, from the
    # decoded chunks (the output's size); otherwise the output plus the spill files tensors are mapped from
    # while torch.save writes it (checked again if the one-pass writer declines the state)
    _check_space(out, int(gen0.manifest["summary"]["raw_bytes"] * (1.05 if one_pass else 2.05)) + (1 << 20))
    _check_output_target(out, r, writes_folder=(layout == "folder" and not only))
    if consolidate is not None:
        if layout != "folder" or only or "" not in (gen0.manifest["source"].get("info") or {}).get("dcp", {}):
            raise UsageError("--consolidate applies to a torch.distributed.checkpoint (DCP) folder source only "
                             f"(this generation's source is {gen0.manifest['source']['format']})")
        consolidate = Path(consolidate).expanduser().absolute()
        refuse_special_output(consolidate)
        if consolidate.exists() and not force:
            raise OutputExists("exists; pass --force to replace it (nothing was written)", where=str(consolidate))
    if folder_rewrite is not None and (layout != "folder" or only):
        raise UsageError("folder_rewrite applies to a folder source restored whole (this generation restores "
                         "to a file; pass transform= instead)")
    from ckpt_archive.store.fs import Staging

    stage = Staging(out)  # the output's folder (created if absent), leftovers of killed restores removed
    staged = stage.entry  # the output being written, in the private staging folder
    rewritten: dict = {}
    passed: list[str] = []  # latest passing over newer damaged generations, a fallback taken

    def write(gen: Generation, reader: ArchiveReader) -> int:
        stage.reset()  # a --fallback retry starts from nothing
        raw = None if only else gen.manifest["summary"].get("raw_bytes")
        if layout == "folder" and not only:
            phase(on_bytes, f"decode, check and write generation {gen.number}", raw)
            stage.dir.mkdir(stage.name)
            with stage.dir.sub(stage.name) as dest:
                nbytes = _restore_folder(reader, gen.manifest, dest, map_location, on_bytes)
                if folder_rewrite is not None:
                    from ckpt_archive.ops.folder_policy import rewrite_folder_files

                    delta, rewritten["report"] = rewrite_folder_files(reader, gen.manifest, dest, folder_rewrite,
                                                                      map_location=map_location)
                    nbytes += delta
            return nbytes
        first = (gen.manifest["source"].get("files") or [{}])[0]
        if layout == "file" and not only and transform is None and map_location is None and first.get("exact"):
            phase(on_bytes, f"decode, check and write generation {gen.number}", raw)
            return _restore_exact(reader, first, staged, on_bytes)  # [issue 11] the source file byte for byte
        src_files = gen.manifest["source"].get("files") or [{}]
        if _torch_output(layout, only, src_files[0]) and transform is None and map_location is None:
            from ckpt_archive.ops.restore_torch import write_torch_file
            from ckpt_archive.repo.reader import subtree

            tree = reader.tree()
            nbytes = write_torch_file(reader, subtree(tree, only) if only is not None else tree, staged, on_bytes,
                                      on_start=lambda: phase(on_bytes, f"decode, check and write generation "
                                                                       f"{gen.number}", raw))
            if nbytes is not None:
                return nbytes
            _check_space(out, int(gen.manifest["summary"]["raw_bytes"] * 2.05) + (1 << 20))
        # tensors over memory-mapped spill files next to the output: anonymous memory stays bounded
        phase(on_bytes, f"decode and check generation {gen.number}", raw)
        state = reader.load(only, map_location=map_location, spill_dir=stage.dir, on_bytes=on_bytes)
        phase(on_bytes, f"write {out.name}", raw)  # the tensors' raw bytes: nearly all of the file
        if transform is not None:
            state = transform(state)
        if layout == "file" and not only and src_files[0].get("kind") == "safetensors":
            from safetensors.torch import save_file

            os.close(staged.create())  # the name is ours (O_EXCL) before the library writes it by path
            save_file(state, staged.path, metadata=src_files[0].get("metadata") or None)
            size = stage.dir.finish_file(stage.name)
            if on_bytes:
                on_bytes(size)  # safetensors writes in one call: reported when done
            return size
        with os.fdopen(staged.create(), "wb") as fh:
            _torch_save(state, _Counted(fh, on_bytes) if on_bytes else fh, out, part=bool(only))
        return stage.dir.finish_file(stage.name)

    from ckpt_archive.format.allowlist import allowing
    from ckpt_archive.repo.publish import phase

    with stage:  # on any exception the staging folder is removed; the output is untouched
        with allowing(allow):
            gen, nbytes = with_fallback(r, generation, fallback, write, unverified=unverified, action="restore",
                                        override="--restore-unverified", notes=notes, warnings=passed, jobs=jobs)
        if layout == "file" and not only and transform is None:  # the source file itself: its permission bits
            apply_mode(stage.dir, stage.name, (gen.manifest["source"].get("files") or [{}])[0])
        refuse_special_output(out)  # again: one may have been put there while we wrote
        # one rename through the output folder's descriptor (a folder, or a file replacing a folder,
        # through .NAME.old-PID-<hex>); the folder fsynced
        try:
            stage.commit(replace=force)
        except FileExistsError:  # put there while we wrote: never replaced without --force
            raise OutputExists("appeared while restoring; pass --force to replace it (nothing was written)",
                               where=str(out)) from None
    result = RestoreResult(gen.number, str(out), nbytes, "folder" if (layout == "folder" and not only) else "file", only,
                           warnings=list(notes) + passed)
    if notes:
        result.extra["unverified"] = True
    if ids_check is not None:
        result.extra["data_ids"] = ids_check
        if ids_check.get("warning"):
            result.warnings.append(ids_check["warning"])
    if "report" in rewritten:
        result.extra["folder_rewrite"] = rewritten["report"]
        result.warnings.extend(rewritten["report"]["warnings"])
    if result.layout == "file":  # [issue 26] how the file just written loads, read from the file itself
        from ckpt_archive.ops.meta import restored_file_loading

        plain = None if only else (gen.manifest.get("instructions") or {}).get("plain_parts")
        result.extra["loading"] = restored_file_loading(out, plain_parts=plain)
    note = copied_note(r, gen)
    if note:
        result.warnings.append(note)
    if consolidate is not None:
        from ckpt_archive.sources.dcp import consolidate_dcp

        target = consolidate_dcp(out, consolidate)
        result.extra["consolidated"] = str(target)
    return result


def _torch_output(layout: str, only: str | None, first: dict) -> bool:
    """Whether restore writes a ``torch.save`` file: a file source that was not a ``.safetensors`` file,
    or a part of any source (``only``)."""
    return bool(only) or (layout == "file" and first.get("kind") != "safetensors")


def _check_output_target(out: Path, r: Repository, *, writes_folder: bool) -> None:
    """Refuse outputs that would destroy something: the repository itself (or a folder holding it, or a
    path inside it), or a folder replaced by a file / a file by a folder, even with ``--force``.

    Raises:
        UsageError (exit 2): naming the output and why; nothing is written.
    """
    real = Path(os.path.realpath(out))
    local_root = r.store.local_path("")
    if local_root is not None:
        repo_root = Path(os.path.realpath(local_root))
        if real == repo_root or repo_root in real.parents or real in repo_root.parents:
            raise UsageError("refusing to restore over or inside the repository being restored from "
                             f"({repo_root}); choose an output outside it", where=str(out))
    if real == Path(os.path.realpath(os.getcwd())) or real in Path(os.path.realpath(os.getcwd())).parents:
        raise UsageError("refusing to replace the current folder or one of its parents", where=str(out))
    if out.is_dir() and not out.is_symlink() and not writes_folder:
        raise UsageError("is a folder; this generation restores to a file (give a file path, e.g. out.pt)",
                         where=str(out))
    if out.exists() and not out.is_dir() and writes_folder:
        raise UsageError("is a file; this generation restores to a folder (a folder source)", where=str(out))
    if out.is_dir() and writes_folder and any(out.iterdir()):
        # --force replacing a folder: only one that looks like an earlier restore of a folder source
        if (out / "repository.json").exists() or (out / "generations").is_dir():
            raise UsageError("holds a ckpt-archive repository; refusing to replace it", where=str(out))


def _restore_folder(reader: ArchiveReader, manifest: dict, dest: Dir, map_location=None, on_bytes=None) -> int:
    """Recreate a folder source in the fresh folder ``dest`` (inside the staging folder): torch files via
    torch.save, safetensors files via safetensors with their metadata, raw/opaque files byte for byte.
    Every name is created exclusively through ``dest``'s descriptor, each folder on the way opened
    ``O_NOFOLLOW``: nothing a manifest says can reach outside ``dest``. Returns bytes written."""
    tree = reader.tree()
    total = 0
    for f in manifest["source"]["files"]:
        # the path rule again (format/paths.py: plain relative names), then a walk that follows no link
        check_relpath(f["relpath"], where=f"manifest.json: source.files {f['relpath']!r}", what="source file")
        target = f"{dest.display()}/{f['relpath']}"
        parts = f["relpath"].split("/")
        try:
            with dest.walk(parts[:-1], create=True) as folder:
                _restore_folder_file(reader, tree, f, dest, folder, parts[-1], map_location, on_bytes)
                total += apply_mode(folder, parts[-1], f)
        except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
            # the manifest's relpaths are distinct and none lies inside another (format/manifest.py): a
            # file system that folds names (case, Unicode normalisation) made two of them one
            raise CannotCheck(f"source file {f['relpath']!r} collides with a file or folder already restored "
                              f"here ({exc.strerror}); this file system treats two names of the archive as "
                              f"one (case or Unicode normalisation?)", where=str(target),
                              hint="restore to a folder on a case-sensitive file system") from None
    return total


def apply_mode(folder: Dir, name: str, f: dict) -> int:
    """Give a restored source file the permission bits recorded at pack (``source.files[].mode``), less this
    process's umask, as ``tar`` does for a user who is not root: a 0600 file comes back 0600, a 0755 script
    executable, and an archive can never make a file wider than the umask allows (nor setuid: only the
    0o777 bits are read). A manifest without ``mode`` (written before it was recorded) leaves the default.
    The file is fsynced; returns its size in bytes."""
    mode = f.get("mode")
    return folder.finish_file(name, mode & 0o777 & ~_umask() if type(mode) is int else None)


def _umask() -> int:
    """This process's umask (read from /proc where it can be, since ``os.umask`` can only be read by setting it)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _restore_folder_file(reader: ArchiveReader, tree: Any, f: dict, dest: Dir, folder: Dir, name: str,
                         map_location, on_bytes) -> None:
    """One file of a folder source, created exclusively (``O_EXCL | O_NOFOLLOW``) in ``folder``, inside the
    fresh staging folder ``dest``: a name already there is ``FileExistsError``, never a file silently
    written over another."""
    if f.get("hardlink_of"):  # [issue 11] hardlinks come back as hardlinks
        src = f["hardlink_of"]
        check_relpath(src, where=f"manifest.json: hardlink_of {src!r}", what="hardlink_of")
        with dest.walk(src.split("/")[:-1]) as src_folder:
            src_folder.link(src.split("/")[-1], name, folder)
    elif f.get("exact") and map_location is None:  # [issue 11] byte for byte (format/exact_bytes.py: O_EXCL)
        _restore_exact(reader, f, folder.entry(name), on_bytes)
    elif f["kind"] in ("raw", "opaque"):
        rec = reader.by_path[f["member"]]
        with os.fdopen(folder.create(name), "wb") as fh:
            for _, chunk in reader.iter_member(rec, on_bytes=on_bytes):
                fh.write(chunk)
    else:
        fd = folder.create(name)  # the name is ours from here
        try:
            node = _folder_node(tree, f["relpath"])
            obj = reader.load_node(node, map_location=map_location, on_bytes=on_bytes)
        except BaseException:
            os.close(fd)
            raise
        if f["kind"] == "safetensors":
            from safetensors.torch import save_file

            os.close(fd)
            save_file(obj, folder.path_of(name), metadata=f.get("metadata") or None)
        else:
            with os.fdopen(fd, "wb") as fh:
                _torch_save(obj, fh, folder.display(name))


def _torch_save(state: Any, dest, out, *, part: bool = False) -> None:
    """``torch.save(state, dest)``; a state torch.save itself refuses is :class:`CannotCheck` (exit 2) naming
    why, never a failed check of the generation.

    torch refuses views of one storage as two dtypes (``RuntimeError``) and the dtypes it has no storage
    type for, ``uint1``-``uint7`` / ``int1``-``int7`` (``KeyError`` "dtype ... is not recognized", from
    ``torch/storage.py: _pickle_storage_type``) -- both of which pack and ``load`` take. ``part``: the state
    is already a part (``--only``), so the hint does not offer that again.
    """
    import torch  # only when re-serialising: the exact-bytes path never imports it

    try:
        torch.save(state, dest)
    except (RuntimeError, KeyError) as exc:
        if isinstance(exc, KeyError) and "not recognized" not in str(exc):
            raise
        # (a KeyError's str() is its repr, quotes included: its argument is the message)
        first = first_line(str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else exc, 300)
        raise CannotCheck(f"torch.save cannot write this state as a .pt file: {first}", where=str(out),
                          hint="ckpt_archive.load(...) rebuilds it in memory" + (
                              "" if part else "; --only restores a part of it as a .pt")) from None


def _restore_exact(reader: ArchiveReader, f: dict, target: Entry, on_bytes=None) -> int:
    """[issue 11] Rebuild a decomposed source file byte for byte from its skeleton member and the tensor
    entries (format/exact_bytes.py); its sha256 is checked against the source's. Returns bytes written."""
    from ckpt_archive.format import exact_bytes

    skeleton = reader.by_path.get(f["exact"]["member"])
    if skeleton is None:
        raise IntegrityError(f"manifest lists no member {f['exact']['member']!r}", where="manifest.json")

    # [issue 29] chunk by chunk (memory does not grow with a tensor's size), and every byte is checked once,
    # end to end: the rebuilt file's sha256 against the source's, taken as it is written. The stored chunks'
    # sha256 and the entries' fingerprints would check the same bytes again (~0.5 ns/B); a mismatch removes
    # the output and `verify --deep` names the damaged chunk.
    def entry_pieces(wanted: set):
        for m in reader.manifest["members"]:
            mine = wanted & set(m.get("entries") or ()) if m["role"] == "tensors" else set()
            if mine:
                for key, _, offset, piece in reader.iter_entry_pieces(m, wanted=mine, on_bytes=on_bytes,
                                                                      checked_by_caller=True):
                    yield key, offset, piece

    skeleton_chunks = reader.iter_member(skeleton, on_bytes=on_bytes, check_whole=False, verify_chunks=False)
    return exact_bytes.rebuild(target, f, (chunk for _, chunk in skeleton_chunks), entry_pieces)


class _Counted:
    """A binary file that reports each write to a progress callback (``torch.save`` writes through it)."""

    def __init__(self, fh, on_bytes):
        self._fh, self._on_bytes = fh, on_bytes

    def write(self, data) -> int:
        n = self._fh.write(data)
        self._on_bytes(memoryview(data).nbytes)
        return n

    def flush(self) -> None:
        self._fh.flush()


def _folder_node(tree: Any, relpath: str) -> Any:
    if isinstance(tree, dict) and "$t" not in tree:
        if relpath in tree:
            return tree[relpath]
    elif isinstance(tree, dict) and tree.get("$t") in ("dict", "odict"):
        for k, v in tree["items"]:
            if k == relpath:
                return v
    raise IntegrityError(f"state tree has no entry for source file {relpath!r}", where="tree.json")


__all__ = ["restore", "RestoreResult"]
