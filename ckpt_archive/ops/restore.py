"""``restore``: write an archived generation back as the files it came from (a ``torch.save`` file, a
``.safetensors`` file, or a checkpoint folder), atomically, never over the repository itself."""
from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ckpt_archive.errors import (CannotCheck, InsufficientSpace, IntegrityError, OutputExists, UsageError,
                                 first_line)
from ckpt_archive.format.paths import check_relpath
from ckpt_archive.format.tree_walk import folder_file_node
from ckpt_archive.ops.common import (RepoLike, copied_note, open_repo, refuse_special_output, refuse_unusable,
                                     require_readable, take_options)
from ckpt_archive.ops.load import with_fallback
from ckpt_archive.repo.publish import note_complete, note_interrupt, phase
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


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """How :func:`restore` writes a generation back (``ckpt-archive restore``'s options, one name each).

    Attributes:
        force: replace an existing output (only after the new one is complete).
        only: restore part of the state (``"model"``: the weights alone, for inference) as a ``.pt``.
        fallback: when ``latest`` fails its checks, restore the newest older generation that verifies.
        unverified: restore a ``partial`` or ``damaged`` generation anyway (``--restore-unverified``;
            refused otherwise, exit 2). Every byte is still checked against its manifest, and the result's
            first warning says loudly what was restored.
        map_location: move torch tensors there (default: CPU).
        jobs: decoder threads (default: cores).
        allow: plain-data classes to rebuild where a file must be re-serialised (``"module.Class"``).
        transform: applied to a file source's state before it is saved (used by ``--policy session``).
        folder_rewrite: for a folder source, re-serialise the files it changes (``--policy session``:
            ``training.folder_session.session_folder_rewrite(cfg)``; see
            :func:`ckpt_archive.ops.folder_policy.rewrite_folder_files`). Its report goes to
            ``extra["folder_rewrite"]``; each rewritten file, no longer byte-identical, is a warning.
        consolidate: for a torch.distributed.checkpoint (DCP) folder source, also write its whole state
            as one ``torch.save`` file at this path (``sources/dcp.py: consolidate_dcp``).
        data_ids: the resuming session's data ids (a value, or a JSON/YAML/TOML/.txt path): compared, key
            order aside, with the ids packed with the generation (:mod:`ckpt_archive.ops.data_identity`)
            before anything is written. The result's ``extra["data_ids"]`` holds the comparison.
        allow_data_change: restore even when the data ids differ (the differences become a warning).

    Example:
        >>> RestoreOptions(only="model", force=True).only
        'model'
    """

    force: bool = False
    only: str | None = None
    fallback: bool = False
    unverified: bool = False
    map_location: Any = None
    jobs: int | None = None
    allow: Sequence[Any] = ()
    transform: Callable[[Any], Any] | None = None
    folder_rewrite: Callable | None = None
    consolidate: str | os.PathLike | None = None
    data_ids: Any = None
    allow_data_change: bool = False


def restore(repo: RepoLike, generation: str | int = "latest", output: str | os.PathLike | None = None,
            options: RestoreOptions | None = None, *, on_bytes=None,
            store_options: Mapping[str, Any] | None = None) -> RestoreResult:
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
        options: :class:`RestoreOptions` (default: all off: no replacing, the whole state, no fallback).
        on_bytes: progress callback, called with raw bytes decoded and checked, then with bytes written; one
            with ``phase(name, total)`` is told each phase (``decode and check``, then ``write``; a folder
            or byte-exact file source decodes and writes in one ``decode, check and write`` phase), with
            the generation's raw size (manifest summary) as total (none for ``only``).
        store_options: for URL repositories, one mapping (``{"endpoint_url": ..., "storage_options": {...}}``;
            :func:`~ckpt_archive.ops.common.open_repo`).

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
        NotUsable (exit 2): a partial generation (or one in a newer format) without ``unverified``;
        IntegrityError (exit 1): a damaged one (its manifest or marker found wrong) without it.
        UnsafePath (exit 1): a path of the manifest resolves outside the output folder.
        TypeError: an unknown keyword argument or store option (every option of the restore itself is a field
            of :class:`RestoreOptions`: ``restore(repo, gen, out, force=True)`` is refused); ``options`` that is
            not a :class:`RestoreOptions`.

    Example:
        >>> import os, torch, ckpt_archive, tempfile
        >>> repo, out = tempfile.mkdtemp(), os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> _ = ckpt_archive.pack({"w": torch.ones(2), "step": 1}, repo)
        >>> r = ckpt_archive.restore(repo, output=out)
        >>> r.generation, torch.load(out, weights_only=True)["step"]
        (1, 1)
    """
    opts = take_options(options, RestoreOptions, "restore", generation=generation)
    out = _check_output(output, opts)
    r = open_repo(repo, store_options)
    plan = _plan(r, generation, out, opts)
    from ckpt_archive.store.fs import Staging

    job = _Job(r, out, opts, plan.layout, Staging(out), on_bytes)  # the output's folder (created if absent),
    notes: list[str] = []  # leftovers of killed restores removed
    passed: list[str] = []  # latest passing over newer damaged generations, a fallback taken
    from ckpt_archive.format.allowlist import allowing

    try:
        with job.stage:  # on any exception the staging folder is removed; the output is untouched
            with allowing(opts.allow):
                gen, nbytes = with_fallback(r, generation, opts.fallback, job.write, unverified=opts.unverified,
                                            action="restore", override="--restore-unverified", notes=notes,
                                            warnings=passed, jobs=opts.jobs)
            job.commit(gen)
    except KeyboardInterrupt as exc:
        if job.placed:  # [break] the rename was done: the output is complete, not interrupted
            note_complete(exc, f"{out} is restored and complete (generation {gen.number})")
        else:  # [break] not the pack's words about partial generations: a restore only reads the repository
            note_interrupt(exc, f"nothing was written to {out} (its temporary copy was removed); the repository "
                                f"was only read", None)
        raise
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            raise
        raise InsufficientSpace(f"disk full while restoring to {out} ({exc.strerror}); nothing was written there: "
                                f"free space or restore elsewhere", where=str(out)) from None
    try:
        return _result(job, gen, nbytes, plan, notes, passed)
    except KeyboardInterrupt as exc:
        if plan.consolidate is None:
            note_complete(exc, f"{out} is restored and complete (generation {gen.number})")
        else:
            note_interrupt(exc, f"{out} is restored and complete (generation {gen.number}), but the consolidated "
                                f"file {plan.consolidate} was not written",
                           "restore again with --force to write it")
        raise


@dataclasses.dataclass
class _Plan:
    """What :func:`restore` learnt before writing: the layout of the source, the data-ids comparison, and
    where the consolidated DCP file goes."""

    layout: str
    ids_check: dict | None
    consolidate: Path | None


def _check_output(output: str | os.PathLike | None, opts: RestoreOptions) -> Path:
    """The absolute output path, after the checks that need no repository.

    Raises:
        UsageError: no output; an ``only`` that selects no single place; a FIFO, device or socket there.
        OutputExists: the output exists and ``opts.force`` is off.
    """
    if output is None:
        raise UsageError("restore needs an output path (--output)")
    if opts.only is not None:
        from ckpt_archive.format.tree_paths import check_only

        check_only(opts.only)  # "" or "model//w" would select the whole state, or another place than written
    out = Path(output).expanduser().absolute()
    refuse_special_output(out)
    if (out.exists() or out.is_symlink()) and not opts.force:
        raise OutputExists("exists; pass --force to replace it (nothing was written)", where=str(out))
    return out


def _plan(r: Repository, generation: str | int, out: Path, opts: RestoreOptions) -> _Plan:
    """Resolve and check the generation before anything is written: usable (or ``unverified``), readable, its
    data ids as the session's, room for the output, an output that destroys nothing, options that apply.

    Raises:
        what :func:`restore` raises before writing.
    """
    gen0 = r.resolve(generation, copied=True)
    latest_recorded = gen0.found_damaged_here and str(generation) == "latest"  # refused by with_fallback's rule
    if not latest_recorded:
        refuse_unusable(r, gen0, unverified=opts.unverified, action="restore", override="--restore-unverified")
    gen0 = require_readable(r, gen0, allow_noted=opts.unverified or latest_recorded)
    ids_check = None
    if opts.data_ids is not None:
        from ckpt_archive.ops.data_identity import check_data_ids

        ids_check = check_data_ids(r, gen0.number, opts.data_ids, allow_change=opts.allow_data_change)
    layout = gen0.manifest["source"]["layout"]
    first0 = _first_file(gen0)
    one_pass = opts.transform is None and opts.map_location is None and (
        (layout == "file" and not opts.only and bool(first0.get("exact"))) or _torch_output(layout, opts.only, first0))
    # exact bytes, or a torch.save file written in one pass (ops/restore_torch.py): once, in place, from the
    # decoded chunks (the output's size); otherwise the output plus the spill files tensors are mapped from
    # while torch.save writes it (checked again if the one-pass writer declines the state)
    _check_space(out, int(gen0.manifest["summary"]["raw_bytes"] * (1.05 if one_pass else 2.05)) + (1 << 20))
    _check_output_target(out, r, writes_folder=(layout == "folder" and not opts.only))
    consolidate = _consolidate_target(gen0, layout, opts)
    if opts.folder_rewrite is not None and (layout != "folder" or opts.only):
        raise UsageError("folder_rewrite applies to a folder source restored whole (this generation restores "
                         "to a file; pass transform= instead)")
    return _Plan(layout, ids_check, consolidate)


def _first_file(gen: Generation) -> dict:
    """The first source file of a generation's manifest (a file source's only one), ``{}`` when none."""
    return (gen.manifest["source"].get("files") or [{}])[0]


def _consolidate_target(gen0: Generation, layout: str, opts: RestoreOptions) -> Path | None:
    """Where ``opts.consolidate`` writes the consolidated DCP state, checked; None when not asked.

    Raises:
        UsageError: the generation is not a DCP folder restored whole; a FIFO, device or socket there.
        OutputExists: the file exists and ``opts.force`` is off.
    """
    if opts.consolidate is None:
        return None
    if layout != "folder" or opts.only or "" not in (gen0.manifest["source"].get("info") or {}).get("dcp", {}):
        raise UsageError("--consolidate applies to a torch.distributed.checkpoint (DCP) folder source only "
                         f"(this generation's source is {gen0.manifest['source']['format']})")
    target = Path(opts.consolidate).expanduser().absolute()
    refuse_special_output(target)
    if target.exists() and not opts.force:
        raise OutputExists("exists; pass --force to replace it (nothing was written)", where=str(target))
    return target


class _Job:
    """One restore being written: the staging folder and the writers for each kind of output.

    :meth:`write` is what :func:`~ckpt_archive.ops.load.with_fallback` runs on the picked generation (again on
    an older one with ``fallback``); :meth:`commit` puts the staged output in place.
    """

    def __init__(self, r: Repository, out: Path, opts: RestoreOptions, layout: str, stage: Any, on_bytes):
        self.r, self.out, self.opts, self.layout, self.on_bytes = r, out, opts, layout, on_bytes
        self.stage = stage
        self.staged = stage.entry  # the output being written, in the private staging folder
        self.rewritten: dict = {}
        #: the output was renamed into place, complete (a Ctrl-C after this is not a failure)
        self.placed = False

    @property
    def writes_folder(self) -> bool:
        return self.layout == "folder" and not self.opts.only

    def _as_is(self) -> bool:
        """Nothing asks for a different file than the one packed (no transform, no map_location)."""
        return self.opts.transform is None and self.opts.map_location is None

    def write(self, gen: Generation, reader: ArchiveReader) -> int:
        """Write ``gen`` into the staging folder; returns bytes written."""
        self.stage.reset()  # a --fallback retry starts from nothing
        raw = None if self.opts.only else gen.manifest["summary"].get("raw_bytes")
        first = _first_file(gen)
        if self.writes_folder:
            phase(self.on_bytes, f"decode, check and write generation {gen.number}", raw)
            return self._write_folder(gen, reader)
        if self.layout == "file" and not self.opts.only and self._as_is() and first.get("exact"):
            phase(self.on_bytes, f"decode, check and write generation {gen.number}", raw)
            return _restore_exact(reader, first, self.staged, self.on_bytes)  # [issue 11] the file byte for byte
        if _torch_output(self.layout, self.opts.only, first) and self._as_is():
            nbytes = self._write_torch_one_pass(gen, reader, raw)
            if nbytes is not None:
                return nbytes
            _check_space(self.out, int(gen.manifest["summary"]["raw_bytes"] * 2.05) + (1 << 20))
        return self._write_decoded(gen, reader, raw, first)

    def _write_folder(self, gen: Generation, reader: ArchiveReader) -> int:
        """A folder source, whole, then the files ``folder_rewrite`` changes."""
        stage, opts = self.stage, self.opts
        stage.dir.mkdir(stage.name)
        with stage.dir.sub(stage.name) as dest:
            nbytes = _restore_folder(reader, gen.manifest, dest, opts.map_location, self.on_bytes)
            if opts.folder_rewrite is not None:
                from ckpt_archive.ops.folder_policy import rewrite_folder_files

                delta, self.rewritten["report"] = rewrite_folder_files(reader, gen.manifest, dest, opts.folder_rewrite,
                                                                       map_location=opts.map_location)
                nbytes += delta
        return nbytes

    def _write_torch_one_pass(self, gen: Generation, reader: ArchiveReader, raw: int | None) -> int | None:
        """A ``torch.save`` file written in one pass from the decoded chunks (:mod:`ops.restore_torch`); None
        when that writer declines the state."""
        from ckpt_archive.ops.restore_torch import write_torch_file
        from ckpt_archive.format.tree_paths import subtree

        tree = reader.tree()
        only = self.opts.only
        return write_torch_file(reader, subtree(tree, only) if only is not None else tree, self.staged,
                                self.on_bytes, on_start=lambda: phase(
                                    self.on_bytes, f"decode, check and write generation {gen.number}", raw))

    def _write_decoded(self, gen: Generation, reader: ArchiveReader, raw: int | None, first: dict) -> int:
        """The state decoded (tensors over memory-mapped spill files next to the output: anonymous memory stays
        bounded), transformed if asked, then saved as a ``.safetensors`` or ``torch.save`` file."""
        stage, opts, on_bytes = self.stage, self.opts, self.on_bytes
        phase(on_bytes, f"decode and check generation {gen.number}", raw)
        state = reader.load(opts.only, map_location=opts.map_location, spill_dir=stage.dir, on_bytes=on_bytes)
        phase(on_bytes, f"write {self.out.name}", raw)  # the tensors' raw bytes: nearly all of the file
        if opts.transform is not None:
            state = opts.transform(state)
        if self.layout == "file" and not opts.only and first.get("kind") == "safetensors":
            from safetensors.torch import save_file

            os.close(self.staged.create())  # the name is ours (O_EXCL) before the library writes it by path
            save_file(state, self.staged.path, metadata=first.get("metadata") or None)
            size = stage.dir.finish_file(stage.name)
            if on_bytes:
                on_bytes(size)  # safetensors writes in one call: reported when done
            return size
        with os.fdopen(self.staged.create(), "wb") as fh:
            _torch_save(state, _Counted(fh, on_bytes) if on_bytes else fh, self.out, part=bool(opts.only))
        return stage.dir.finish_file(stage.name)

    def commit(self, gen: Generation) -> None:
        """Put the staged output in place: its permission bits (a file source written as packed), then one
        rename through the output folder's descriptor (a folder, or a file replacing a folder, through
        ``.NAME.old-PID-<hex>``); the folder fsynced.

        Raises:
            OutputExists: an output appeared while restoring and ``force`` is off.
            UsageError: a FIFO, device or socket was put at the output meanwhile.
        """
        stage = self.stage
        if self.layout == "file" and not self.opts.only and self.opts.transform is None:
            apply_mode(stage.dir, stage.name, _first_file(gen))  # the source file itself: its permission bits
        refuse_special_output(self.out)  # again: one may have been put there while we wrote
        try:
            stage.commit(replace=self.opts.force)
        except FileExistsError:  # put there while we wrote: never replaced without --force
            raise OutputExists("appeared while restoring; pass --force to replace it (nothing was written)",
                               where=str(self.out)) from None
        except KeyboardInterrupt:
            self.placed = stage.placed
            raise
        self.placed = True
        self.r.faults.point("restore-placed")


def _result(job: _Job, gen: Generation, nbytes: int, plan: _Plan, notes: list[str],
            passed: list[str]) -> RestoreResult:
    """The :class:`RestoreResult` of a restore put in place, with what the caller must know: the loud note of
    an unverified generation (``notes``) and the generations passed over first, the data-ids comparison, the
    folder rewrite's report, how the file loads, a copied generation's note, the consolidated DCP file
    (written now)."""
    opts, out = job.opts, job.out
    result = RestoreResult(gen.number, str(out), nbytes, "folder" if job.writes_folder else "file", opts.only,
                           warnings=list(notes) + passed)
    if notes:
        result.extra["unverified"] = True
    ids_check = plan.ids_check
    if ids_check is not None:
        result.extra["data_ids"] = ids_check
        if ids_check.get("warning"):
            result.warnings.append(ids_check["warning"])
    if "report" in job.rewritten:
        result.extra["folder_rewrite"] = job.rewritten["report"]
        result.warnings.extend(job.rewritten["report"]["warnings"])
    if result.layout == "file":  # [issue 26] how the file just written loads, read from the file itself
        from ckpt_archive.ops.meta import restored_file_loading

        plain = None if opts.only else (gen.manifest.get("instructions") or {}).get("plain_parts")
        result.extra["loading"] = restored_file_loading(out, plain_parts=plain)
    note = copied_note(job.r, gen)
    if note:
        result.warnings.append(note)
    if plan.consolidate is not None:
        from ckpt_archive.sources.dcp import consolidate_dcp

        result.extra["consolidated"] = str(consolidate_dcp(out, plan.consolidate))
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
            node = folder_file_node(tree, f["relpath"])
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

    # [issue 29] chunk by chunk (memory does not grow with a tensor's size). Every raw byte is checked once,
    # end to end: the rebuilt file's sha256 against the source's, taken as it is written (the entries' own
    # fingerprints would check the same bytes again). The stored chunks' sha256 is taken on the decoder pool
    # in this same read: vouch() must check every stored byte of the generation before the output is handed
    # out, and without it would read and hash these members a second time (check_unread).
    def entry_pieces(wanted: set):
        for m in reader.manifest["members"]:
            mine = wanted & set(m.get("entries") or ()) if m["role"] == "tensors" else set()
            if mine:
                for key, _, offset, piece in reader.iter_entry_pieces(m, wanted=mine, on_bytes=on_bytes,
                                                                      checked_by_caller=True, verify_stored=True):
                    yield key, offset, piece

    skeleton_chunks = reader.iter_member(skeleton, on_bytes=on_bytes, check_whole=False, verify_chunks=True)
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


__all__ = ["restore", "RestoreOptions", "RestoreResult", "apply_mode"]
