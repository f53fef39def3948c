"""``pack``: a checkpoint into a new generation, returned only once it is usable.

The input is checked and encoded first (anything that refuses it runs before a generation number is
claimed, so a refusal leaves nothing behind); then the one publish lifecycle runs
(:mod:`ckpt_archive.repo.publish`: claim -> members -> seal -> verify -> trial reload -> marker, under
the lock); then retention, still under the lock, only after the new generation is usable.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ckpt_archive import __version__
from ckpt_archive.errors import CkptArchiveError, SourceError, StoreError, UsageError
from ckpt_archive.format.codec import DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL
from ckpt_archive.format.exact_bytes import early_scan
from ckpt_archive.format.read_lease import lease_scope
from ckpt_archive.format.manifest import FORMAT, seal_bytes, version_for
from ckpt_archive.format.objects import DEFAULT_SHARE_MIN_BYTES
from ckpt_archive.format.metrics import metrics_to_json
from ckpt_archive.ops.common import RepoLike, check_option_values, open_repo, take_options
from ckpt_archive.ops.pack_source import (ReadProgress, crc_reason_first, raise_if_changed, raw_total,
                                          same_source, source_fingerprints)
from ckpt_archive.ops.meta import (code_identity, default_instructions, environment, find_metrics, find_progress,
                                   needs_by_part, value_or_file)
from ckpt_archive.repo.publish import PACK_POINTS, BeforePublish, Lifecycle, Withdrawn
# re-exported: the Checkpointer (training/, which uses ops) records what it publishes as the CLI does
from ckpt_archive.repo.publish import record_publishes  # noqa: F401
from ckpt_archive.repo.reader import ArchiveReader, Problem
from ckpt_archive.repo.repository import MANIFEST, Repository, gen_key, host_record, iso, raise_if_problems, utcnow
from ckpt_archive.repo.writer import write_members

if TYPE_CHECKING:
    from ckpt_archive.retention.policy import RetentionPolicy


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """How to read the source and write the generation (none of it is recorded as the archive's meaning).

    Attributes:
        level: zstd level, -7..22 (default 3).
        jobs: encoder/decoder threads (default: cores).
        chunk_bytes: raw bytes per compressed chunk (default 4 MiB).
        wait: seconds to wait for another writer's lock (0: fail at once with LockError).
        source_format: force a source reader (see :data:`ckpt_archive.sources.READERS`); None detects it.
        allow_numpy: admit NumPy's own types in a ``.pt`` (a narrow allowlist; never other classes).
        allow: plain-data classes to admit, as ``"module.Class"`` names or classes (``argparse.Namespace``;
            see :mod:`ckpt_archive.format.allowlist`): read from files and stored as the same class
            (CLI ``--allow``); a str is one name.
        share_min_bytes: tensor entries of at least this many raw bytes are stored once per repository
            and referenced by later generations whose bytes are equal (docs/FORMAT.md, "Shared
            objects"; default 1 MiB); 0 stores every entry in its generation (CLI ``--no-share``).
    """

    level: int | None = None
    jobs: int | None = None
    chunk_bytes: int | None = None
    wait: float = 0.0
    source_format: str | None = None
    allow_numpy: bool = False
    allow: tuple = ()
    share_min_bytes: int = DEFAULT_SHARE_MIN_BYTES


@dataclasses.dataclass(frozen=True)
class Annotations:
    """What the manifest records about the checkpoint besides its state.

    Attributes:
        config: the experiment's parameters: a dict, or the path of a JSON/YAML/TOML file (types kept).
        metrics: a dict (NumPy scalars become numbers; non-finite floats the strings "nan", "inf",
            "-inf"; see :mod:`ckpt_archive.format.metrics`), or the path of such a file.
        data_ids: list/dict, or a path (JSON/YAML/TOML, or ``.txt`` one id per line): stored as a member
            and fingerprinted (sha256).
        tags: labels (``tag:NAME`` selects the newest usable generation so tagged); a str is one tag.
        code_version: free text; the git commit and dirty flag are recorded when run in a work tree.
        instructions: text, a path to a text file, or ``{"text", "snippet"}``; generated when None.
        progress: ``{"step", "epoch", "cursor"}`` overriding what is found in the state (None values
            are ignored).
    """

    config: Any = None
    metrics: Any = None
    data_ids: Any = None
    tags: tuple[str, ...] | str = ()
    code_version: str | None = None
    instructions: Any = None
    progress: Mapping[str, int | None] | None = None


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
        trial_reload: the marker's trial-reload record (where, when, host, counts).
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


def _instructions(instructions: Any, source, allowed: list[str] | None = None) -> dict:
    top = [str(k) for k in source.state.keys()] if isinstance(source.state, dict) else []
    # [issue 26] from what the restored .pt needs: the globals to allow, the parts that need none
    needs = needs_by_part(source.state) if source.layout == "file" else None
    base = default_instructions(source.format, source.layout, top, needs, allowed)
    if needs is not None:
        base["plain_parts"] = needs["plain_parts"]
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


@dataclasses.dataclass
class _Prepared:
    """The input, read, checked and encoded before anything is claimed."""

    source: Any
    encoded: tuple
    progress: dict
    config: Any
    metrics: dict
    data_ids: Any
    tags: list[str]
    instructions: dict
    code_version: str | None
    allowed: list[str] = dataclasses.field(default_factory=list)


def prepare(source_or_path: Any, options: PackOptions, notes: Annotations, retention: Any,
            encoder: Callable[[Any], tuple] | None = None, *, zip_crc_checked: bool = False) -> _Prepared:
    """Everything pack decides before it claims a generation: the source read, the state encoded (tree +
    tensor table), the annotations read and bounded, progress and metrics found.

    Args:
        source_or_path: a checkpoint path or an in-memory state. options, notes, retention: as :func:`pack`.
        encoder: replaces ``state_tree.encode`` (the distributed checkpointer's shard-aware encoder).
        zip_crc_checked: the caller checks a ``torch.save`` file's zip records itself (pack's early scan).

    Returns:
        the prepared state (``source``, ``encoded``, ``data_ids``, ...), for ``build_manifest`` and the writers.

    Raises:
        UsageError: a bad option (``retention`` not a RetentionPolicy, ``chunk_bytes`` out of range).
        SourceError / RefusedPickle: the source cannot be read or encoded exactly.
    """
    from ckpt_archive.sources import from_object, read_source

    if retention is not None:
        from ckpt_archive.retention.policy import RetentionPolicy

        if not isinstance(retention, RetentionPolicy):
            raise UsageError(f"retention must be a RetentionPolicy or None, not {type(retention).__name__} "
                             f"(RetentionPolicy.from_dict({retention!r}) reads a dict)")
    source, encoded, allowed = _read_and_encode(source_or_path, options, encoder, zip_crc_checked)
    # a tree no reader would read back (limits.tree_read_problem) is refused here, before a generation is
    # claimed, not by the trial reload after everything was written; its checked bytes go to the writer
    from ckpt_archive.repo.writer import tree_json

    tree_raw = tree_json(encoded[0])
    if encoder is None:  # (the distributed checkpointer's writer checks the combined tree again)
        encoded = (encoded[0], encoded[1], tree_raw)
    _note_numpy_values(source, encoded)
    from ckpt_archive.format.limits import MAX_ANNOTATION_BYTES, MAX_DATA_IDS_BYTES

    config_v = value_or_file(notes.config, what="config file", max_bytes=MAX_ANNOTATION_BYTES)
    metrics_v = value_or_file(notes.metrics, what="metrics file", max_bytes=MAX_ANNOTATION_BYTES)
    ids_v = value_or_file(notes.data_ids, what="data-ids file", max_bytes=MAX_DATA_IDS_BYTES)
    _check_numbers(options)
    if metrics_v is None and source.layout == "file":  # [issue 11] nanoGPT best_val_loss, timm metric
        metrics_v = find_metrics(source.state) or None
    prog = _progress_of(source, notes)
    tags = notes.tags
    if isinstance(tags, (str, bytes)):
        tags = (tags,)  # tags="nightly" is one tag, not seven one-letter tags
    config_enc, metrics_plain = _sized_annotations(config_v, metrics_v, ids_v)
    prepared = _Prepared(source, encoded, prog, config_enc, metrics_plain, ids_v, [str(t) for t in tags],
                         _instructions(notes.instructions, source, sorted(allowed or ())),
                         None if notes.code_version is None else str(notes.code_version),  # the schema's string
                         sorted(allowed or ()))
    # the manifest and members are UTF-8 JSON: text that is not (lone surrogates, as os.fsdecode gives for
    # bytes that are not UTF-8, e.g. from a shell argument) is refused here, before a generation is claimed
    from ckpt_archive.format.text import first_not_utf8, shown

    for what, value in (("tag", prepared.tags), ("code version", prepared.code_version),
                        ("metrics", metrics_plain), ("data ids", ids_v), ("instructions", prepared.instructions),
                        ("source info", source.info)):
        bad = first_not_utf8(value)
        if bad is not None:
            raise UsageError(f"{what} holds text that is not UTF-8: {shown(bad)!r}; give it as UTF-8 text")
    # a tag is a one-line label that list/inspect print: an escape sequence in it (--tag $'\\e]0;...\\a')
    # would be stored and then reach every reader's terminal, so it is refused, shown escaped
    from ckpt_archive.format.text import has_control, printable

    for tag in prepared.tags:
        if has_control(tag):
            raise UsageError(f"tag '{printable(tag, keep='')}' holds a control character (shown as \\xNN); "
                             f"give a tag of printable characters")
    return prepared


def _read_and_encode(source_or_path: Any, options: PackOptions, encoder: Callable[[Any], tuple] | None,
                     zip_crc_checked: bool) -> tuple[Any, tuple, Any]:
    """The source read (a path) or taken (an object) and its state encoded, with the plain-data classes
    ``options.allow`` admits: ``(source, encoded, the classes admitted)``."""
    from ckpt_archive.format.allowlist import allowing
    from ckpt_archive.format.pt_encode import encode  # state_tree's, also for a file read without torch
    from ckpt_archive.sources import from_object, read_source

    allow = (options.allow,) if isinstance(options.allow, (str, type)) else tuple(options.allow or ())
    with allowing(allow) as allowed:  # [issue 11] plain-data classes admitted for reading and encoding
        if isinstance(source_or_path, (str, os.PathLike)):
            extra = {"zip_crc_checked": True} if zip_crc_checked else {}
            # [issue 29] a torch.save file whose pickle holds only plain containers and dense tensors is read
            # without importing torch (format/pt_pickle.py); anything else through torch.load(weights_only=True)
            source = read_source(source_or_path, options.source_format, allow_numpy=options.allow_numpy,
                                 torch_free=encoder is None, **extra)
        else:
            source = from_object(source_or_path)
        encoded = (encoder or encode)(source.state)
    return source, encoded, allowed


def _check_numbers(options: PackOptions) -> None:
    """Refuse a chunk size readers refuse, a zstd level out of range, fewer than one job (UsageError); also on the
    distributed path, which reaches :func:`prepare` without :func:`pack`."""
    from ckpt_archive.format.limits import MAX_CHUNK_RAW_BYTES

    if options.chunk_bytes is not None and not 1 <= int(options.chunk_bytes) <= MAX_CHUNK_RAW_BYTES:
        raise UsageError(f"chunk_bytes must be between 1 and {MAX_CHUNK_RAW_BYTES} (readers refuse larger chunks), "
                         f"not {options.chunk_bytes}")
    if options.level is not None and not -7 <= int(options.level) <= 22:
        raise UsageError(f"zstd level must be between -7 and 22, not {options.level}")
    check_option_values(options)  # jobs, wait, allow_numpy: the rule every options object follows (ops/common.py)


def _progress_of(source: Any, notes: Annotations) -> dict:
    """``{"step", "epoch", "cursor"}``: found in a file source's state, then the source's own, then given in
    ``notes.progress`` (each later one wins); a NaN or infinite counter is left out (None).

    Raises:
        UsageError: a negative counter.
    """
    found = find_progress(source.state) if source.layout == "file" else {}
    given = {k: v for k, v in (notes.progress or {}).items() if v is not None}
    prog = {**found, **(source.progress or {}), **given}
    prog = {k: prog.get(k) for k in ("step", "epoch", "cursor")}
    # a NaN or infinite counter (a float epoch taken from a checkpoint) says nothing, and strict JSON can
    # only write it as a tagged object, which the manifest schema refuses: it is left out
    prog = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in prog.items()}
    for name in ("step", "epoch", "cursor"):
        value = prog.get(name)
        if value is not None and value < 0:
            raise UsageError(f"progress {name} must not be negative ({value})")
    return prog


def _sized_annotations(config_v: Any, metrics_v: Any, ids_v: Any) -> tuple[Any, dict]:
    """The config encoded and the metrics as plain JSON, after refusing annotations a reader would not read:
    data ids that are not plain JSON or cost too much to parse, and any of the three over its size limit.

    Raises:
        UsageError: naming which and the limit.
    """
    import json

    from ckpt_archive.format.jsonio import parse_cost
    from ckpt_archive.format.limits import MAX_ANNOTATION_BYTES, MAX_DATA_IDS_BYTES, MAX_DATA_IDS_COST
    from ckpt_archive.format.state_tree import encode_value

    config_enc = encode_value(config_v) if config_v is not None else {}
    metrics_plain = metrics_to_json(metrics_v)
    try:
        ids_text = json.dumps(ids_v, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"data ids must be plain JSON values: {exc}") from None
    ids_size = len(ids_text)
    if ids_size <= MAX_DATA_IDS_BYTES and parse_cost(ids_text) > MAX_DATA_IDS_COST:  # no reader would read them
        raise UsageError(f"data ids of {ids_size} bytes are refused: reading them back would take about "
                         f"{parse_cost(ids_text)} bytes of memory, more than the {MAX_DATA_IDS_COST} a reader "
                         f"allows (docs/FORMAT.md, 'Reading hostile archives'); a larger dataset identity "
                         f"belongs in a file of the checkpoint folder")
    # every `list` reads every manifest: config and metrics stay small (data ids live in a member)
    for name, value, limit in (("config", config_enc, MAX_ANNOTATION_BYTES), ("metrics", metrics_plain,
                               MAX_ANNOTATION_BYTES), ("data ids", None, MAX_DATA_IDS_BYTES)):
        size = ids_size if value is None else len(json.dumps(value, default=str))
        if size > limit:
            raise UsageError(f"{name} of {size} bytes (as JSON) is refused: the limit is {limit} bytes"
                             + (" (data ids are stored as a member; a larger dataset identity belongs in a "
                                "file of the checkpoint folder)" if value is None else
                                " (it is stored in the manifest, which every `list` reads; put large records "
                                "in a file of the checkpoint folder)"))
    return config_enc, metrics_plain


#: At most this many paths of NumPy scalars/dtypes are recorded in a manifest (all are counted).
MAX_NUMPY_PATHS = 100


def _note_numpy_values(source, encoded) -> None:
    """[issue 27] Record where the state holds NumPy scalars and dtypes (``source.info["numpy_values"]``: count and
    the first :data:`MAX_NUMPY_PATHS` paths), so ``inspect`` can say which values came in as NumPy types (admitted
    with ``--allow-numpy`` or by a trainer's RNG-file allowlist) without reading the tree."""
    found = getattr(encoded[1], "numpy_values", None) if isinstance(encoded, tuple) and len(encoded) > 1 else None
    if found:
        source.info = dict(source.info or {})
        source.info["numpy_values"] = {"count": len(found), "paths": [p[:512] for p in found[:MAX_NUMPY_PATHS]]}


def build_manifest(p: _Prepared, number: int, body: dict) -> dict:
    """The manifest of generation ``number`` from the prepared input and the writer's archive part
    (``members``, ``tensors``, ``tree_member``, ``source``, ``data``, ``summary``); shared by pack and the
    distributed checkpointer so both write the same fields."""
    if p.allowed:
        body["source"]["allow"] = p.allowed
    return {
        "format": FORMAT, "format_version": version_for(body["members"]), "archive_id": uuid.uuid4().hex,
        "generation": number, "created": iso(utcnow()),
        "tool": {"name": "ckpt-archive", "version": __version__},
        "source": body["source"], "progress": p.progress,
        "config": p.config, "metrics": p.metrics,
        "data": body["data"], "instructions": p.instructions,
        "code": code_identity(p.code_version), "environment": environment(),
        "tags": p.tags, "tree_member": body["tree_member"],
        "members": body["members"], "tensors": body["tensors"], "summary": body["summary"],
    }


class _PackSteps:
    """The publish lifecycle's steps for a source packed here (see :class:`ckpt_archive.repo.publish.Steps`)."""

    def __init__(self, prep: _Prepared, options: PackOptions, on_bytes):
        self.prep = prep
        self.options = options
        self.on_bytes = on_bytes
        self.manifest: dict | None = None
        self.warnings: list[str] = []
        self.shared = None
        self.distrust: set[str] = set()  # shared objects found damaged: written again, not referenced
        self.repaired: dict[str, str | None] = {}  # those, each with what was wrong (None: not known)
        self.retried = False  # the lifecycle ran a second time, the damaged objects it found written again
        self.generations = None  # the repository's generations as pack read them under the lock, once
        self.scans: dict | None = None  # source files' reads started before parsing (exact_bytes.ScanJob)
        self.written_crc: dict = {}  # member path -> CRC-32 of each chunk as written (MemberWriter.written_crc)
        self.leases = None  # this pack's read leases (format/read_lease.py LeaseScope), given back once read
        self.first_read: dict | None = None  # the source's fingerprints as the first write read them

    def claim(self, repo: Repository) -> int:
        return repo.claim_next()

    def write_members(self, repo: Repository, number: int) -> None:
        p, o = self.prep, self.options
        again = self.first_read is not None  # the retry (a damaged shared object): the source is read again
        if again:
            self._take_source_again()
        shared = None
        if o.share_min_bytes and o.share_min_bytes > 0:
            from ckpt_archive.repo.objects import ObjectIndex, SharedWriter

            # under the lock: which objects usable generations vouch for, and which any manifest names
            # the generations pack read under this lock (a retry reads them again: it removed one)
            gens, self.generations = self.generations, None
            shared = SharedWriter(repo.store, ObjectIndex.build(repo, gens), min_bytes=o.share_min_bytes,
                                  faults=repo.faults, distrust=self.distrust, jobs=o.jobs)
        from ckpt_archive.repo.publish import phase

        phase(self.on_bytes, "write", raw_total(p))
        try:
            try:
                body = write_members(repo.store, gen_key(number), p.source, data_ids=p.data_ids,
                                     level=o.level or DEFAULT_LEVEL, jobs=o.jobs,
                                     chunk_bytes=o.chunk_bytes or DEFAULT_CHUNK_BYTES, on_bytes=self.on_bytes,
                                     encoded=p.encoded, faults=repo.faults, shared=shared, scans=self.scans,
                                     expect=self.first_read["entries"] if again else None)
                for scan in (self.scans or {}).values():
                    scan.checked()  # the CRC verdict, before the manifest is sealed, whether the writer used it
                    # or not; its read of the file (under the lease, which keeps writers out) is over too
            finally:
                # [break] the source's last read: the writer's threads have stopped, so its leases go back now
                # (maps dropped) -- a trainer's in-place save over the file waits neither for the verify, trial
                # reload, publish and retention below (up to the kernel's 45 s lease-break-time), nor, after a
                # broken lease or another failure, for the claimed generation to be withdrawn
                if self.leases is not None:
                    self.leases.give_back()
        except (CkptArchiveError, OSError):
            # a file rewritten under the reads is the reason for what failed, not its symptom
            raise_if_changed((self.scans or {}).values())
            raise
        finally:
            if shared is not None:
                shared.close()
                # objects the reuse check found damaged (rewritten from this state): reported once published
                self.repaired.update(shared.repaired)
                self.distrust |= set(shared.repaired)
        raise_if_changed((self.scans or {}).values())
        self.shared = shared
        self.warnings = body.pop("warnings")
        self.written_crc = body.pop("written_crc")
        self.manifest = build_manifest(p, number, body)
        read = source_fingerprints(self.manifest)
        if again:
            same_source(self.first_read, read, p.source)
        else:
            self.first_read = read

    def _take_source_again(self) -> None:
        """[break] Before the retry reads the source a second time (its leases went back after the first read):
        fresh leases, and the same files as first read (``fstat`` of each leased file, and the stat identity of
        each scanned one); the bytes are then checked against the first read's fingerprints as they are read.

        Raises:
            SourceChanged: naming the file that changed (the claimed generation is withdrawn).
        """
        try:
            if self.leases is not None:
                self.leases.take_again()
            raise_if_changed((self.scans or {}).values())
        except BaseException:
            if self.leases is not None:
                self.leases.give_back()  # refused: a writer waiting on a lease taken again goes on now
            raise

    def seal(self, repo: Repository, number: int) -> tuple[dict, bytes]:
        key = gen_key(number)
        raw = seal_bytes(self.manifest, where=f"{key}/{MANIFEST}")  # checked as read back; verdict remembered
        repo.write_manifest(number, raw)  # atomic: a failure leaves no manifest.json, the generation partial
        return self.manifest, raw

    def verify(self, repo: Repository, number: int, reader: ArchiveReader) -> dict:
        problems: list[Problem] = []
        # sizes here; the trial reload then reads every chunk back, compares it with the CRC-32 of the
        # bytes this pack wrote, decodes it and checks every raw byte against its fingerprint. The stored
        # sha256 were taken from those bytes and are not taken twice (issue 14; reader.written_crc);
        # verify, export and adopt hash every chunk
        reader.written_crc = self.written_crc
        if self.shared is not None:
            # reused objects whose stored bytes this pack hashed, under a chunk table a usable generation's
            # trial reload proved: not decoded a second time (docs/FORMAT.md, "Write order", step 5)
            reader.proven_objects = self.shared.proven(self.manifest)
        reader.check_stored(problems, hash_files=False)
        raise_if_problems("verify", problems, number)
        return {"when": iso(utcnow()), "result": "ok", "members": len(self.manifest["members"])}

    def reloaded(self, problems: list[Problem], counts: dict) -> None:
        pass

    def record(self, repo: Repository, counts: dict) -> dict:
        return {"trial_reload": {**host_record(repo.location), "result": "ok", **counts}}


def pack(source: Any, repo: RepoLike, options: PackOptions | None = None, annotations: Annotations | None = None,
         *, retention: "RetentionPolicy | None" = None, on_bytes: Callable[[int], None] | None = None,
         before_publish: BeforePublish | None = None) -> PackResult:
    """Pack a checkpoint into a new generation of ``repo``; return only once it is usable.

    Lifecycle (docs/FORMAT.md; :mod:`ckpt_archive.repo.publish`): claim -> write members -> seal
    (manifest) -> verify (re-read: sizes, sha256) -> trial reload (every tensor decoded one at a time:
    raw sha256, dtype, shape; tree rebuilt) -> publish (``USABLE.json`` last) -> retention (only after
    publish), all under the repository lock.

    Args:
        source: a nested state (dict/list/tuple with tensors, NumPy arrays/scalars and plain values)
            or a path to a ``torch.save`` file or a checkpoint folder.
        repo: repository path/URL (created if absent) or an open Repository.
        options: :class:`PackOptions` (compression, threads, lock wait, source reader).
        annotations: :class:`Annotations` (config, metrics, data ids, tags, code version, instructions,
            progress overrides).
        retention: a :class:`~ckpt_archive.retention.policy.RetentionPolicy` applied after publish;
            ``None`` applies the repository's default policy, if any; an empty ``RetentionPolicy()``
            applies none even when the repository has a default (``backup`` runs retention itself).
        on_bytes: progress callback, bytes processed: a source file's bytes read and hashed (phase ``read and
            hash NAME``; these calls come from one helper thread, never at the same time as another call),
            raw bytes written (``write``), then decoded by the trial reload; one with a ``phase(name, total)``
            method is told when each phase starts.
        before_publish: called under the lock with the checked generation before its marker is written
            (:data:`~ckpt_archive.repo.publish.BeforePublish`); a returned reason withdraws it.

    Returns:
        :class:`PackResult`.

    Raises:
        SourceError / RefusedPickle: unreadable or refused input (exit 2). UsageError: bad options, or a
        ``retention`` that is not a RetentionPolicy (exit 2). TypeError: ``options`` that is not a
        :class:`PackOptions` or ``annotations`` that is not an :class:`Annotations`; an unknown keyword argument. LockError: another writer.
        IntegrityError: the new generation failed verify or trial reload (exit 1; left partial).
        StoreError: the store failed (disk full, read-only, permissions) (exit 2; left partial).
        Withdrawn: ``before_publish`` withdrew the generation (removed; exit 2).

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> from ckpt_archive.ops.pack import Annotations
        >>> r = ckpt_archive.pack({"model": {"w": torch.ones(2)}, "step": 3}, tempfile.mkdtemp(),
        ...                       annotations=Annotations(metrics={"val_loss": 0.25}, tags=("nightly",)))
        >>> r.status, r.manifest["progress"]["step"], r.manifest["metrics"]
        ('usable', 3, {'val_loss': 0.25})
    """
    options = take_options(options, PackOptions, "pack")
    annotations = Annotations() if annotations is None else annotations
    if not isinstance(annotations, Annotations):
        raise TypeError(f"pack's annotations must be an Annotations, not {type(annotations).__name__}")
    # [break] the source's read leases are this pack's (format/read_lease.py): given back once the members are
    # written (the source's last read), and whatever is left when pack returns (never left to the collector)
    with lease_scope() as leases, ThreadPoolExecutor(1, thread_name_prefix="ckpt-scan") as scan_pool:
        # [issue 14] a source file's own reads (its sha256, its tensor ranges' fingerprints and, for a zip
        # torch.save file, every record's CRC-32) start now, beside `import torch` and torch.load
        scan = early_scan(source, scan_pool) if isinstance(source, (str, os.PathLike)) else None
        reading = ReadProgress(on_bytes, source, scan)  # [issue 26] the bar moves from the first second
        # What can refuse the input runs before a generation number is claimed, except the scan's verdict:
        # it is awaited before the manifest is sealed (encoding starts at once), and a record that fails
        # its CRC, or a file that changed meanwhile, withdraws the claimed generation (_pack_prepared).
        # Either way a refusal leaves nothing behind in the repository.
        try:
            try:
                prep = prepare(source, options, annotations, retention,
                                zip_crc_checked=scan is not None and scan.crc_checked)
            except SourceError:
                raise_if_changed([scan] if scan is not None else [])
                crc_reason_first(scan)
                raise
            finally:
                reading.stop()
            return _pack_prepared(prep, repo, options, on_bytes, before_publish, retention,
                                  {scan.identity: scan} if scan is not None else None, leases)
        except BaseException:
            if scan is not None:
                scan.cancel()
            raise


def _pack_prepared(prep: _Prepared, repo: RepoLike, options: PackOptions, on_bytes, before_publish, retention,
                   scans: dict | None, leases=None) -> PackResult:
    """:func:`pack` once its input is read and checked: the lifecycle under the lock, then retention.
    ``leases``: the pack's :class:`~ckpt_archive.format.read_lease.LeaseScope`, given back once written."""
    r = open_repo(repo, create=True)
    steps = _PackSteps(prep, options, on_bytes)
    steps.scans = scans
    steps.leases = leases
    with r.lock(options.wait):
        gens = r.generations()  # read once under the lock: the leftovers here, the object index at write
        steps.generations = gens
        leftovers = [f"generation {g.number} is {g.status}: {g.reason}" for g in gens
                     if g.status in ("partial", "damaged")]
        published = _run_lifecycle(r, steps, options, on_bytes, before_publish, leftovers)
        number = published.number
        warnings = steps.warnings + _object_notes(steps, published.manifest, number)
        # Published: from here on the new generation is usable whatever happens, so later failures are
        # warnings, never "left partial".
        retention_result = _retention_after(r, retention, number, warnings)
    return PackResult(number, "usable", f"{r.location}/{gen_key(number)}", published.manifest, warnings, leftovers,
                      retention_result, published.trial_reload)


def _run_lifecycle(r: Any, steps: "_PackSteps", options: PackOptions, on_bytes, before_publish,
                   leftovers: list[str]) -> Any:
    """Claim, write, verify, trial-reload and publish the generation (:class:`Lifecycle`), under the caller's
    lock; a failure says at which step and what it left.

    Raises:
        Withdrawn: ``before_publish`` withdrew it (its ``warnings`` and ``leftovers`` attached).
        SourceError: the source is refused (the claimed generation removed: nothing left behind).
        CkptArchiveError: ``pack failed at step '...' (generation N left partial)``.
        StoreError: an OSError after the claim (disk full, read-only, permission, quota), naming the step.
    """
    life = Lifecycle(r, steps, PACK_POINTS, before_publish=before_publish, wait=options.wait, jobs=options.jobs,
                     progress=on_bytes)
    try:
        try:
            return life.run()
        except CkptArchiveError:
            # a shared object this pack referenced on trust (a usable generation vouched for it) may
            # have rotted since: if the trial reload failed and one is damaged, this generation is
            # removed (never usable) and written once more without trusting it -- the object is
            # written again from the state, which repairs it for every generation that references it
            damaged = _damaged_reused(r, life, steps)
            if not damaged:
                raise
            r.remove_generation(life.number)
            steps.retried = True
            steps.distrust |= set(damaged)
            steps.repaired.update(damaged)
            life = Lifecycle(r, steps, PACK_POINTS, before_publish=before_publish, wait=options.wait,
                             jobs=options.jobs, progress=on_bytes)
            return life.run()
    except Withdrawn as exc:
        exc.warnings = steps.warnings
        exc.leftovers = leftovers
        raise
    except SourceError as exc:
        _withdraw_refused_source(r, life, exc)
        raise
    except CkptArchiveError as exc:
        if life.step != "claim" and not exc.message.startswith("pack failed"):
            exc.message = (f"pack failed at step '{life.step}' (generation {life.number} left partial): "
                           f"{exc.message}")
        raise
    except OSError as exc:
        if life.step == "claim":
            raise
        why = {errno.ENOSPC: "disk full", errno.EROFS: "read-only destination",
               errno.EACCES: "permission denied", errno.EDQUOT: "quota exceeded"}.get(exc.errno, "I/O error")
        raise StoreError(f"pack failed at step '{life.step}' ({why}: {exc.strerror or exc}); generation "
                         f"{life.number} left partial, earlier generations untouched; `ckpt-archive gc` "
                         f"removes it", where=getattr(exc, "filename", None) or r.location) from None


def _withdraw_refused_source(r: Any, life: Any, exc: SourceError) -> None:
    """The source itself is refused (the early scan found a record that fails its CRC): the input is what is
    wrong, not the repository -- the claimed generation is withdrawn, nothing is left behind, and the error's
    hint no longer names a partial generation."""
    if life.number is None:
        return
    note = life.left_note()
    r.remove_generation(life.number)
    if exc.hint == note:
        exc.hint = None
    elif exc.hint and exc.hint.endswith(f"; {note}"):
        exc.hint = exc.hint[:-len(note) - 2]


def _object_notes(steps: "_PackSteps", manifest: dict, number: int) -> list[str]:
    """What pack did about shared objects: damaged ones repaired or stored anew, ones that were not regular
    files replaced."""
    notes: list[str] = []
    if steps.repaired:
        notes.extend(_repair_notes(steps.repaired, steps.shared.index.users, manifest, number))
    if steps.shared is not None:
        from ckpt_archive.format.objects import object_key

        notes.extend(f"{object_key(oid)} was not a regular file ({what}): removed, and the shared object "
                     f"written in its place" for oid, what in steps.shared.replaced.items()
                     if oid not in steps.repaired)
    return notes


def _retention_after(r: Any, retention: Any, number: int, warnings: list[str]) -> dict | None:
    """Apply ``retention`` (the repository's default when None) after generation ``number`` is published;
    a failure is a warning appended to ``warnings``, never an error (the generation is usable)."""
    retention_result = None
    try:
        r.faults.point("after-publish")
        policy = retention if retention is not None else r.config.get("retention")
        if policy and not (hasattr(policy, "is_empty") and policy.is_empty()):
            r.faults.point("retention")
            from ckpt_archive.ops.prune import apply_after_pack

            retention_result = apply_after_pack(r, policy, verified=(number,))
            warnings += list(retention_result.get("warnings", []) if isinstance(retention_result, dict) else [])
    except (CkptArchiveError, OSError) as exc:
        warnings.append(f"generation {number} is usable, but retention did not run to completion: {exc}")
    return retention_result


def _repair_notes(damaged: Mapping[str, str | None], users: dict, manifest: dict, number: int) -> list[str]:
    """What pack did about each damaged object (``{oid: what was wrong}``, found by the reuse check or after a
    failed trial reload): written again under its own name (which repairs every generation that references
    it), or stored anew under another name (this pack encodes it otherwise: the damaged one stays, and the
    generations that reference it stay broken)."""
    from ckpt_archive.format.objects import object_key, refs

    now = refs(manifest)
    notes = []
    for oid, why in damaged.items():
        others = sorted(n for n in users.get(oid, ()) if n != number)
        gens = ", ".join(map(str, others))
        what = f" ({why})" if why else ""
        if oid in now:
            notes.append(f"shared object {object_key(oid)} failed its check{what}: damaged since it was written; "
                         f"generation {number} wrote it again from this state"
                         + (f", which also repairs generation(s) {gens} that reference it" if others else ""))
        else:
            notes.append(f"shared object {object_key(oid)} failed its check{what}: damaged since it was written; "
                         f"generation {number} stored the tensor anew (encoded otherwise by this pack's "
                         f"settings, under another name), so the damaged object stays"
                         + (f" and generation(s) {gens} that reference it stay broken: a pack with the "
                            f"settings that wrote them repairs them, or `ckpt-archive forget` them" if others
                            else ""))
    return notes


def _damaged_reused(r, life, steps) -> dict[str, str]:
    """After a failed lifecycle: the shared objects the new generation references whose files are damaged
    (referenced on trust, or kept because a generation not usable here named them; missing, another size
    or a chunk failing its sha256): only when the re-read (sizes) or the trial reload was the step that
    failed, and only once per pack."""
    shared = steps.shared
    if life.step not in ("verify", "trial reload") or shared is None or steps.manifest is None or steps.retried:
        return {}
    from ckpt_archive.format.objects import refs
    from ckpt_archive.repo.objects import damaged_objects

    return damaged_objects(r.store, steps.manifest, refs(steps.manifest))


__all__ = ["pack", "PackOptions", "Annotations", "PackResult"]
