"""The public API: ``pack``, ``load``, ``verify``, ``restore``, ``inspect``, ``list_generations``.

Each function accepts a repository path/URL or an open :class:`~ckpt_archive.repo.repository.Repository`.
Errors are :mod:`ckpt_archive.errors` classes; each carries its CLI exit code.
"""
from __future__ import annotations

import dataclasses
import json
import errno
import os
import uuid
from pathlib import Path
from typing import Any, Callable

from ckpt_archive import __version__

from ckpt_archive.store import faults as faults
from ckpt_archive.repo.archive import ArchiveReader, Problem, write_members
from ckpt_archive.format.codec import DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL
from ckpt_archive.errors import (CkptArchiveError, InsufficientSpace, IntegrityError, NoUsableGeneration, OutputExists,
                     SourceError, StoreError, UsageError)
from ckpt_archive.format.manifest import FORMAT, FORMAT_VERSION, dumps, sha256_hex, validate
from ckpt_archive.ops.meta import code_identity, default_instructions, environment, find_progress, value_or_file
from ckpt_archive.repo.repository import (MANIFEST, Generation, Repository, gen_key, host_record, iso, raise_if_problems, utcnow)

RepoLike = "str | os.PathLike | Repository"


def _repo(repo, *, create: bool = False, **store_options) -> Repository:
    if isinstance(repo, Repository):
        return repo
    return Repository.open(repo, create=create, **store_options)


# ------------------------------------------------------------------------------------------------
# pack
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PackResult:
    """What :func:`pack` made.

    Attributes:
        generation: the new generation's number.
        status: ``"usable"`` (pack returns only after the marker is written).
        path: the generation's location (``REPO/generations/00000007``).
        manifest: the manifest as written.
        warnings: notes worth reading (e.g. a file of a folder kept opaque, naming why).
        leftovers: non-usable generations found (interrupted writes; ``ckpt-archive gc`` removes them).
        retention: what retention removed/kept, when a policy ran.
    """

    generation: int
    status: str
    path: str
    manifest: dict
    warnings: list[str]
    leftovers: list[str]
    retention: dict | None = None
    trial_reload: dict | None = None

    def to_json(self) -> dict:
        m = self.manifest
        return {"generation": self.generation, "status": self.status, "path": self.path,
                "archive_id": m["archive_id"], "step": m["progress"].get("step"),
                "raw_bytes": m["summary"]["raw_bytes"], "stored_bytes": m["summary"]["stored_bytes"],
                "tensor_count": m["summary"]["tensor_count"], "source_format": m["source"]["format"],
                "warnings": self.warnings, "leftovers": self.leftovers, "retention": self.retention,
                "trial_reload": self.trial_reload}


def _instructions(instructions: Any, source) -> dict:
    top = [str(k) for k in source.state.keys()] if isinstance(source.state, dict) else []
    base = default_instructions(source.format, source.layout, top)
    if instructions is None:
        return base
    if isinstance(instructions, dict):
        return {"text": str(instructions.get("text", base["text"])),
                "snippet": str(instructions.get("snippet", base["snippet"]))}
    p = Path(str(instructions))
    try:
        text = p.read_text(encoding="utf-8") if p.is_file() else str(instructions)
    except UnicodeDecodeError:
        raise SourceError("instructions file is not UTF-8 text", where=str(p)) from None
    return {"text": text, "snippet": base["snippet"]}


def pack(state_or_path: Any, repo, *, config: Any = None, metrics: Any = None, data_ids: Any = None,
         instructions: Any = None, code_version: str | None = None, tags=(), progress: dict | None = None,
         fmt: str | None = None, allow_numpy: bool = False, jobs: int | None = None, level: int | None = None,
         retention: Any = None, on_bytes: Callable[[int], None] | None = None, wait: float = 0.0,
         chunk_bytes: int | None = None, allow=()) -> PackResult:
    """Pack a checkpoint into a new generation of ``repo``; return only once it is usable.

    Lifecycle (docs/FORMAT.md): claim -> write members -> seal (manifest) -> verify (re-read: sizes,
    sha256) -> trial reload (every tensor decoded one at a time: raw sha256, dtype, shape; tree rebuilt)
    -> publish (``USABLE.json`` last) -> retention (only after publish).

    Args:
        state_or_path: a nested state (dict/list/tuple with tensors, NumPy arrays/scalars and plain
            values) or a path to a ``torch.save`` file or a checkpoint folder.
        repo: repository path/URL (created if absent) or an open Repository.
        config, metrics: dict, or path of a JSON/YAML/TOML file (types kept).
        data_ids: list/dict, or a path (JSON/YAML/TOML, or ``.txt`` one id per line): stored as a member
            and fingerprinted (sha256).
        instructions: text, a path to a text file, or ``{"text", "snippet"}``; generated when None.
        code_version: free text; git commit and dirty flag are recorded when run in a work tree.
        tags: labels (``tag:NAME`` selects the newest usable generation so tagged).
        progress: ``{"step", "epoch", "cursor"}`` overriding what is found in the state.
        fmt: force a source reader (see :data:`ckpt_archive.sources.READERS`).
        allow_numpy: admit NumPy's own types in a ``.pt`` (narrow allowlist; never other classes).
        allow: plain-data classes to admit, as ``"module.Class"`` names or classes (``argparse.Namespace``;
            see :mod:`ckpt_archive.format.allowlist`): read from files and stored as the same class.
        jobs: threads (default: cores). level: zstd level (default 3). chunk_bytes: raw bytes per chunk.
        retention: a retention policy (dict with restic's names: keep_last, keep_daily, ...) applied after
            publish; None uses the repository's default policy, if any; ``{}`` means no retention even
            when the repository has a default (``backup`` runs retention itself after its own checks).
        on_bytes: progress callback, raw bytes processed.
        wait: seconds to wait for the writer lock.

    Returns:
        :class:`PackResult`.

    Raises:
        SourceError / RefusedPickle: unreadable or refused input (exit 2). LockError: another writer.
        IntegrityError: the new generation failed verify or trial reload (exit 1; left partial).
        StoreError: the store failed (disk full, read-only, permissions) (exit 2; left partial).

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> r = ckpt_archive.pack({"model": {"w": torch.ones(2)}, "step": 3}, tempfile.mkdtemp())
        >>> r.status, r.manifest["progress"]["step"]
        ('usable', 3)
    """
    from ckpt_archive.format.allowlist import allowing
    from ckpt_archive.sources import from_object, read_source

    with allowing(allow) as allowed:  # [issue 11] plain-data classes admitted for reading and encoding
        if isinstance(state_or_path, (str, os.PathLike)):
            source = read_source(state_or_path, fmt, allow_numpy=allow_numpy)
        else:
            source = from_object(state_or_path)
        from ckpt_archive.format.state_tree import encode

        encoded = encode(source.state)
    config_v = value_or_file(config, what="config file")
    metrics_v = value_or_file(metrics, what="metrics file")
    ids_v = value_or_file(data_ids, what="data-ids file")
    found = find_progress(source.state) if source.layout == "file" else {}
    if metrics_v is None and source.layout == "file":  # [issue 11] nanoGPT best_val_loss, timm metric
        from ckpt_archive.ops.meta import find_metrics

        metrics_v = find_metrics(source.state) or None
    prog = {**found, **(source.progress or {}), **{k: v for k, v in (progress or {}).items() if v is not None}}
    prog = {k: prog.get(k) for k in ("step", "epoch", "cursor")}
    # Everything that can refuse the input runs before a generation number is claimed, so a refusal
    # leaves nothing behind in the repository.
    if level is not None and not -7 <= int(level) <= 22:
        raise UsageError(f"zstd level must be between -7 and 22, not {level}")
    if jobs is not None and int(jobs) < 1:
        raise UsageError(f"--jobs must be at least 1, not {jobs}")
    if isinstance(tags, (str, bytes)):
        tags = (tags,)  # tags="nightly" is one tag, not seven one-letter tags
    if isinstance(retention, dict):
        from ckpt_archive.retention.policy import RetentionPolicy

        # a misspelt field (keep_lasts) refuses the pack here, in the training loop's first call,
        # instead of a warning on every pack while the disk fills
        RetentionPolicy.from_dict(retention)
    for name, value in (("step", prog.get("step")), ("epoch", prog.get("epoch")), ("cursor", prog.get("cursor"))):
        if value is not None and value < 0:
            raise UsageError(f"progress {name} must not be negative ({value})")
    from ckpt_archive.format.state_tree import encode_value

    config_enc = encode_value(config_v) if config_v is not None else {}
    metrics_enc = encode_value(metrics_v) if metrics_v is not None else {}
    if not isinstance(metrics_enc, dict) or "$t" in metrics_enc:
        raise UsageError("metrics must be a mapping of names to values (a JSON object)")
    try:
        json.dumps(ids_v, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"data ids must be plain JSON values: {exc}") from None
    instr = _instructions(instructions, source)
    r = _repo(repo, create=True)
    with r.lock(wait):
        gens = r.generations()
        leftovers = [f"generation {g.number} is {g.status}: {g.reason}" for g in gens
                     if g.status in ("partial", "damaged")]
        number = r.claim_next()
        key = gen_key(number)
        faults.point("claim")
        step = "write members"
        try:
            body = write_members(r.store, key, source, data_ids=ids_v, level=level or DEFAULT_LEVEL, jobs=jobs,
                                 chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES, on_bytes=on_bytes,
                                 encoded=encoded)
            warnings = body.pop("warnings")
            if allowed:
                body["source"]["allow"] = sorted(allowed)
            from ckpt_archive.format.state_tree import encode_value

            manifest = {
                "format": FORMAT, "format_version": FORMAT_VERSION, "archive_id": uuid.uuid4().hex,
                "generation": number, "created": iso(utcnow()),
                "tool": {"name": "ckpt-archive", "version": __version__},
                "source": body["source"], "progress": prog,
                "config": config_enc, "metrics": metrics_enc,
                "data": body["data"], "instructions": instr,
                "code": code_identity(code_version), "environment": environment(),
                "tags": [str(t) for t in tags], "tree_member": body["tree_member"],
                "members": body["members"], "tensors": body["tensors"], "summary": body["summary"],
            }
            step = "seal"
            validate(manifest, where=f"{key}/{MANIFEST}")
            raw = dumps(manifest)
            r.store.write_bytes_once(f"{key}/{MANIFEST}", raw)
            r.store.fsync_dir(key)
            faults.point("after-seal")
            step = "verify"
            reader = ArchiveReader(r.store, key, manifest, jobs=jobs)
            problems: list[Problem] = []
            # sizes here; every chunk's stored sha256 is checked by the trial reload's single read
            reader.check_stored(problems, hash_files=False)
            raise_if_problems("verify", problems, number)
            verified = {"when": iso(utcnow()), "result": "ok", "members": len(manifest["members"])}
            faults.point("after-verify")
            step = "trial reload"
            stats = reader.trial_reload(problems)
            raise_if_problems("trial reload", problems, number)
            faults.point("after-trial-reload")
            step = "publish"
            trial = {**host_record(r.location), "result": "ok", **stats}
            r.write_marker(number, sha256_hex(raw), manifest["archive_id"], {"verified": verified, "trial_reload": trial})
        except CkptArchiveError as exc:
            if not exc.message.startswith("pack failed"):
                exc.message = f"pack failed at step '{step}' (generation {number} left partial): {exc.message}"
            raise
        except OSError as exc:
            why = {errno.ENOSPC: "disk full", errno.EROFS: "read-only destination",
                   errno.EACCES: "permission denied", errno.EDQUOT: "quota exceeded"}.get(exc.errno, "I/O error")
            raise StoreError(f"pack failed at step '{step}' ({why}: {exc.strerror or exc}); generation {number} "
                             f"left partial, earlier generations untouched; `ckpt-archive gc` removes it",
                             where=getattr(exc, "filename", None) or r.location) from None
        # Published: from here on the new generation is usable whatever happens, so later failures are
        # warnings, never "left partial".
        retention_result = None
        try:
            faults.point("after-publish")
            policy = retention if retention is not None else r.config.get("retention")
            if policy:
                faults.point("retention")
                from ckpt_archive.retention import policy as _retention

                retention_result = _retention.apply_after_pack(r, policy, verified=(number,))
                warnings += list(retention_result.get("warnings", []) if isinstance(retention_result, dict) else [])
        except (CkptArchiveError, OSError) as exc:
            warnings.append(f"generation {number} is usable, but retention did not run to completion: {exc}")
    return PackResult(number, "usable", f"{r.location}/{key}", manifest, warnings, leftovers, retention_result, trial)


# ------------------------------------------------------------------------------------------------
# verify
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class VerifyReport:
    """Result of :func:`verify`.

    Attributes:
        ok: True when nothing is wrong.
        generation: the generation checked.
        status: its status before the check (``usable``, ``copied``, ...).
        deep: whether members were decoded and every tensor rebuilt (trial reload).
        problems: what is wrong, each naming the member and/or field.
        warnings: notes that do not fail the check (completeness lint, policy audit, ...).
        fallback: when ``@latest`` fails: the newest older generation that verifies, else None.
        marked_usable: a ``copied`` generation that passed ``--deep`` and was marked usable here.
    """

    ok: bool
    generation: int
    status: str
    deep: bool
    problems: list[Problem]
    warnings: list[str] = dataclasses.field(default_factory=list)
    fallback: int | None = None
    marked_usable: bool = False
    stats: dict | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"ok": self.ok, "generation": self.generation, "status": self.status, "deep": self.deep,
                "problems": [p.to_json() for p in self.problems], "warnings": self.warnings,
                "fallback_generation": self.fallback, "marked_usable": self.marked_usable, "stats": self.stats,
                **self.extra}


def _check_generation(r: Repository, gen: Generation, deep: bool, jobs: int | None = None,
                      on_bytes=None) -> tuple[list[Problem], dict | None]:
    problems: list[Problem] = []
    if gen.manifest is None:
        if gen.error is not None and not isinstance(gen.error, IntegrityError) and gen.error.exit_code == 2:
            raise gen.error
        problems.append(Problem(f"not usable: {gen.reason}", member=MANIFEST))
        return problems, None
    if gen.status == "damaged":
        problems.append(Problem(gen.reason or "damaged", member="USABLE.json"))
    elif gen.status == "partial":
        problems.append(Problem(f"not usable: {gen.reason}", member="USABLE.json"))
    reader = ArchiveReader(r.store, gen.key, gen.manifest, jobs=jobs)
    stats = None
    if deep:
        stats = reader.trial_reload(problems, on_bytes=on_bytes)
    else:
        reader.check_stored(problems, on_bytes=on_bytes)
    problems.extend(_source_layout_problems(gen.manifest))
    return problems, stats


def _source_layout_problems(manifest: dict) -> list[Problem]:
    """DCP folders in a folder source: every shard the ``.metadata`` references is among the archived
    files and long enough for the byte ranges it reads (``sources/dcp.py: check_dcp_folder``)."""
    src = manifest.get("source") or {}
    info = src.get("info") or {}
    if not info.get("dcp"):
        return []
    from ckpt_archive.sources.dcp import check_dcp_folder

    present = {f["relpath"]: f["raw_bytes"] for f in src.get("files", []) if f.get("raw_bytes") is not None}
    return [Problem(line, member=line.split(":", 1)[0], field="source.info.dcp")
            for line in check_dcp_folder(present, info)]


def _find_fallback(r: Repository, newer_than_bad: int, deep: bool, jobs=None) -> int | None:
    for g in reversed(r.usable()):
        if g.number >= newer_than_bad:
            continue
        problems, _ = _check_generation(r, g, deep, jobs)
        if not problems:
            return g.number
    return None


def verify(repo, generation: str | int = "latest", *, deep: bool = False, jobs: int | None = None,
           on_bytes=None, fallback: bool = False, **store_options) -> VerifyReport:
    """Check a generation.

    Shallow: manifest (schema, version), marker, every stored member's size and sha256. Deep
    (``deep=True``): the trial reload as well -- every chunk decoded, raw sha256 of every member and
    tensor, dtype and shape, the tree rebuilt and every tensor reference resolved. A ``copied``
    generation that passes a deep check is marked usable at this location.

    When ``generation`` is ``"latest"`` and it fails, the report names the newest older generation
    that verifies (``fallback``); with ``fallback=True`` that one is checked and reported instead.

    Raises:
        NotFound / NoUsableGeneration / NewerFormatError: could not check (exit 2).
    """
    r = _repo(repo, **store_options)
    gen = r.resolve(generation)
    problems, stats = _check_generation(r, gen, deep, jobs, on_bytes)
    report = VerifyReport(not problems, gen.number, gen.status, deep, problems, stats=stats)
    if not problems and deep and gen.status == "copied":
        trial = {**host_record(r.location), "result": "ok", **(stats or {})}
        r.write_marker(gen.number, gen.manifest_sha256, gen.manifest["archive_id"],
                       {"verified": {"when": iso(utcnow()), "result": "ok"}, "trial_reload": trial,
                        "copied_from": (gen.marker or {}).get("location")})
        report.marked_usable = True
    if problems and str(generation) == "latest":
        fb = _find_fallback(r, gen.number, deep, jobs)
        report.fallback = fb
        if fb is not None:
            report.warnings.append(f"generation {gen.number} (latest) does not verify; the newest generation "
                                   f"that verifies is {fb} (use --fallback)")
            if fallback:
                fb_gen = r.generation(fb)
                fb_problems, fb_stats = _check_generation(r, fb_gen, deep, jobs)
                report = VerifyReport(not fb_problems, fb, fb_gen.status, deep, fb_problems,
                                      warnings=report.warnings, fallback=fb, stats=fb_stats)
    return report


# ------------------------------------------------------------------------------------------------
# load / restore
# ------------------------------------------------------------------------------------------------
def _pick(r: Repository, generation, fallback: bool) -> Generation:
    gen = r.resolve(generation)
    if gen.manifest is None:
        if gen.error is not None:
            raise gen.error
        raise NoUsableGeneration(f"generation {gen.number} is {gen.status}: {gen.reason}", where=r.location)
    return gen


def _check_present(r: Repository, gen: Generation) -> None:
    """Every member present with its recorded size (a stat each, no read): a generation missing any
    member is damaged, even when the part asked for does not need that member."""
    for rec in gen.manifest["members"]:
        key = f"{gen.key}/{rec['stored_path']}"
        if not r.store.exists(key):
            raise IntegrityError(f"missing: {rec['stored_path']} is not in generation {gen.number}", where=rec["path"])
        size = r.store.size(key)
        if size != rec["stored_bytes"]:
            raise IntegrityError(f"{size} bytes stored, manifest says {rec['stored_bytes']}", where=rec["path"])


def _with_fallback(r: Repository, generation, fallback: bool, fn):
    gen = _pick(r, generation, fallback)

    def checked(g: Generation):
        _check_present(r, g)
        return fn(g)

    try:
        return gen, checked(gen)
    except IntegrityError as exc:
        if str(generation) != "latest":
            raise
        fb = _find_fallback(r, gen.number, deep=False)
        if fallback and fb is not None:
            return r.generation(fb), checked(r.generation(fb))
        hint = (f"the newest generation that verifies is {fb}: use --fallback or @{fb}" if fb is not None
                else "no older usable generation verifies either")
        raise IntegrityError(f"generation {gen.number} (latest) does not verify: {exc.message}; {hint}",
                             where=exc.where) from None


def load(repo, generation: str | int = "latest", *, only: str | None = None, fallback: bool = False,
         map_location=None, jobs: int | None = None, allow=(), **store_options) -> Any:
    """Rebuild the archived state in memory, checking every chunk and tensor on the way.

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        only: a ``/``-separated path into the state (``"model"``) to load just that part.
        fallback: when ``latest`` fails its checks, use the newest older generation that verifies.
        map_location: move torch tensors there (default: CPU).
        allow: plain-data classes to rebuild (``"module.Class"``); ``argparse.Namespace`` needs none.

    Returns:
        the nested state, equal to what was packed in structure, types, dtypes, shapes and bits.

    Raises:
        IntegrityError (exit 1) -- never returns wrong data; NotFound / NoUsableGeneration (exit 2).
    """
    from ckpt_archive.format.allowlist import allowing

    r = _repo(repo, **store_options)
    with allowing(allow):
        _, state = _with_fallback(r, generation, fallback,
                                  lambda g: ArchiveReader(r.store, g.key, g.manifest, jobs=jobs).load(
                                      only, map_location=map_location))
    return state


@dataclasses.dataclass
class RestoreResult:
    """What :func:`restore` wrote: ``output`` path, ``generation``, ``bytes_written``, ``layout``."""

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


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _check_space(path: Path, need: int) -> None:
    import shutil

    p = path.parent
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < need:
        raise InsufficientSpace(f"needs about {need} bytes, {free} free", where=str(p))


def restore(repo, generation: str | int = "latest", output: str | os.PathLike | None = None, *,
            force: bool = False, only: str | None = None, fallback: bool = False, map_location=None,
            jobs: int | None = None, transform: Callable[[Any], Any] | None = None,
            consolidate: str | os.PathLike | None = None, allow=(), **store_options) -> RestoreResult:
    """Write an archived generation back as a ``torch.save`` file (file sources) or a folder (folder
    sources), atomically: temporary name in the same folder, fsync, rename.

    Args:
        output: the ``.pt`` file or folder to create.
        force: replace an existing output (only after the new one is complete).
        only: restore part of the state (``"model"``: the weights alone, for inference) as a ``.pt``.
        transform: applied to a file source's state before it is saved (used by ``--policy session``).
        consolidate: for a torch.distributed.checkpoint (DCP) folder source, also write its whole state
            as one ``torch.save`` file at this path (``sources/dcp.py: consolidate_dcp``).
        allow: plain-data classes to rebuild where a file must be re-serialised (``"module.Class"``).

    A ``.safetensors`` file source is restored as a ``.safetensors`` file with its header metadata.

    Raises:
        OutputExists (exit 2) without ``force``; InsufficientSpace (exit 2); IntegrityError (exit 1).
    """
    import torch

    if output is None:
        raise UsageError("restore needs an output path (--output)")
    out = Path(output).expanduser().absolute()
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExists("exists; pass --force to replace it (nothing was written)", where=str(out))
    r = _repo(repo, **store_options)
    gen0 = _pick(r, generation, fallback)
    # the output plus the spill files tensors are mapped from while torch.save writes it
    _check_space(out, int(gen0.manifest["summary"]["raw_bytes"] * 2.05) + (1 << 20))
    layout = gen0.manifest["source"]["layout"]
    _check_output_target(out, r, writes_folder=(layout == "folder" and not only))
    if consolidate is not None:
        if layout != "folder" or only or "" not in (gen0.manifest["source"].get("info") or {}).get("dcp", {}):
            raise UsageError("--consolidate applies to a torch.distributed.checkpoint (DCP) folder source only "
                             f"(this generation's source is {gen0.manifest['source']['format']})")
        consolidate = Path(consolidate).expanduser().absolute()
        if consolidate.exists() and not force:
            raise OutputExists("exists; pass --force to replace it (nothing was written)", where=str(consolidate))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")

    def write(gen: Generation) -> int:
        reader = ArchiveReader(r.store, gen.key, gen.manifest, jobs=jobs)
        if layout == "folder" and not only:
            return _restore_folder(reader, gen.manifest, tmp, map_location)
        first = (gen.manifest["source"].get("files") or [{}])[0]
        if layout == "file" and not only and transform is None and map_location is None and first.get("exact"):
            return _restore_exact(reader, first, tmp)  # [issue 11] the source file byte for byte
        # tensors over memory-mapped spill files next to the output: anonymous memory stays bounded
        state = reader.load(only, map_location=map_location, spill_dir=tmp.parent)
        if transform is not None:
            state = transform(state)
        src_files = gen.manifest["source"].get("files") or [{}]
        if layout == "file" and not only and src_files[0].get("kind") == "safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp), metadata=src_files[0].get("metadata") or None)
            _fsync_file(tmp)
            return tmp.stat().st_size
        torch.save(state, tmp)
        _fsync_file(tmp)
        return tmp.stat().st_size

    from ckpt_archive.format.allowlist import allowing

    try:
        with allowing(allow):
            gen, nbytes = _with_fallback(r, generation, fallback, write)
    except BaseException:
        _remove(tmp)
        raise
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
    else:
        os.replace(tmp, out)
    from ckpt_archive.store.local import _fsync_dir

    _fsync_dir(out.parent)
    result = RestoreResult(gen.number, str(out), nbytes, "folder" if (layout == "folder" and not only) else "file", only)
    if consolidate is not None:
        from ckpt_archive.sources.dcp import consolidate_dcp

        target = consolidate_dcp(out, consolidate)
        result.extra["consolidated"] = str(target)
    return result


def _check_output_target(out: Path, r: Repository, *, writes_folder: bool) -> None:
    """Refuse outputs that would destroy something: the repository itself (or a folder holding it, or a
    path inside it), or a folder replaced by a file / a file by a folder, even with ``--force``.

    Raises:
        UsageError (exit 2): naming the output and why; nothing is written.
    """
    real = Path(os.path.realpath(out))
    if getattr(r.store, "is_local", False):
        repo_root = Path(os.path.realpath(r.store.location))
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


def _remove(p: Path) -> None:
    import shutil

    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def _restore_folder(reader: ArchiveReader, manifest: dict, dest: Path, map_location=None) -> int:
    """Recreate a folder source: torch files via torch.save, safetensors files via safetensors with
    their metadata, raw/opaque files byte for byte. Returns bytes written."""
    import torch

    dest.mkdir(parents=True)
    tree = reader.tree()
    total = 0
    for f in manifest["source"]["files"]:
        target = dest / f["relpath"]
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.get("hardlink_of"):  # [issue 11] hardlinks come back as hardlinks
            os.link(dest / f["hardlink_of"], target)
        elif f.get("exact") and map_location is None:  # [issue 11] byte for byte
            _restore_exact(reader, f, target)
        elif f["kind"] in ("raw", "opaque"):
            rec = reader.by_path[f["member"]]
            with open(target, "wb") as fh:
                for _, chunk in reader.iter_member(rec):
                    fh.write(chunk)
        else:
            node = _folder_node(tree, f["relpath"])
            obj = reader.load_node(node, map_location=map_location)
            if f["kind"] == "safetensors":
                from safetensors.torch import save_file

                save_file(obj, str(target), metadata=f.get("metadata") or None)
            else:
                torch.save(obj, target)
        _fsync_file(target)
        total += target.stat().st_size
    return total


def _restore_exact(reader: ArchiveReader, f: dict, target: Path) -> int:
    """[issue 11] Rebuild a decomposed source file byte for byte from its skeleton member and the tensor
    entries (format/exact_bytes.py); its sha256 is checked against the source's. Returns bytes written."""
    from ckpt_archive.format import exact_bytes

    skeleton = reader.by_path.get(f["exact"]["member"])
    if skeleton is None:
        raise IntegrityError(f"manifest lists no member {f['exact']['member']!r}", where="manifest.json")

    def entry_bytes(wanted: set):
        for m in reader.manifest["members"]:
            mine = wanted & set(m.get("entries") or ()) if m["role"] == "tensors" else set()
            if mine:
                for key, _, buf in reader.iter_entries(m, wanted=mine):
                    yield key, buf

    return exact_bytes.rebuild(target, f, (chunk for _, chunk in reader.iter_member(skeleton)), entry_bytes)


def _folder_node(tree: Any, relpath: str) -> Any:
    if isinstance(tree, dict) and "$t" not in tree:
        if relpath in tree:
            return tree[relpath]
    elif isinstance(tree, dict) and tree.get("$t") in ("dict", "odict"):
        for k, v in tree["items"]:
            if k == relpath:
                return v
    raise IntegrityError(f"state tree has no entry for source file {relpath!r}", where="tree.json")


# ------------------------------------------------------------------------------------------------
# list / inspect
# ------------------------------------------------------------------------------------------------
def list_generations(repo, all: bool = False, **store_options) -> list[Generation]:
    """Generations oldest first: usable ones, or with ``all=True`` every one with its status and why."""
    r = _repo(repo, **store_options)
    gens = r.generations()
    return gens if all else [g for g in gens if g.usable]


def inspect(repo, generation: str | int = "latest", **store_options) -> dict:
    """The manifest and marker of a generation plus a summary (reads no member)."""
    r = _repo(repo, **store_options)
    gen = _pick(r, generation, False)
    m = gen.manifest
    opaque = [f["relpath"] for f in m["source"]["files"] if f["kind"] == "opaque"]
    from ckpt_archive.format.exact_bytes import exact_summary

    return {"generation": gen.number, "status": gen.status, "reason": gen.reason, "location": r.location,
            "manifest": m, "marker": gen.marker, "opaque_members": opaque, "exact_bytes": exact_summary(m)}
