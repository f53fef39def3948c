"""Scheduled backups: ``ckpt-archive backup SOURCE --repo REPO`` for cron and systemd timers.

A cron tick must be cheap and safe:

* **cheap**: the decision is made from ``size``, ``mtime_ns`` and ``inode`` of every file of the
  checkpoint first (remembered in ``REPO/backup-state.json``, replaced atomically). Only when those
  changed are the files read (sha256), and only when the content differs from the newest usable
  generation's source (``manifest.source.files[].sha256``) is anything packed.
* **safe**: a checkpoint still being written is never packed. It must be unchanged over a short
  settle window (``settle`` seconds: no size/mtime/inode change, no entry added or removed) and
  complete (a ``torch.save`` zip whose central directory is whole, a safetensors file whose size
  matches its header, every shard an index names, parseable JSON, no temporary names; a
  ``checkpoint-N/`` folder holding every training-state file its newest complete older sibling holds,
  :func:`sibling_problem`). Otherwise it is not packed and the run exits 75 (``EX_TEMPFAIL``) so cron
  reports it and the next tick retries; meanwhile the newest complete checkpoint is packed when no
  usable generation holds it yet (``BackupResult.busy`` names the newer one).
  A file that changes while it is being packed makes the new generation be withdrawn before it is
  published (pack's before-publish hook; exit 75).
* **never stuck**: an incomplete checkpoint that has not changed for longer than ``stale_after``
  (default ``max(600 s, 10 x settle)``, judged by its newest mtime) is not being written, it is
  broken (a trainer killed mid-save): it is skipped with a warning naming it and why, and the newest
  complete checkpoint in SOURCE is backed up instead; when there is none, the run fails with exit 2.
  Exit 75 is kept for a checkpoint that is incomplete *and* recent, so a scheduled backup never
  returns "still being written" forever.

SOURCE is a checkpoint file, a checkpoint folder, or a training output folder, from which the
newest checkpoint is picked: the ``checkpoint-N/`` folder with the highest N (Hugging Face Trainer),
else the ``*.pt``/``*.pth``/``*.ckpt`` file (top level or ``checkpoints/``) holding the highest step,
not the one written last: a stray older-step file copied in later must not become ``@latest``. When the
newest file holds a lower step than the newest usable generation, the run warns and says what it chose.
"""
from __future__ import annotations

import dataclasses
import os
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ckpt_archive.errors import EX_TEMPFAIL, EXIT_OK, CheckFailed, NotFound, SourceChanged, SourceError
from ckpt_archive.format import jsonio
from ckpt_archive.format.shard import file_problem
from ckpt_archive.ops.checkpoint_pick import CKPT_DIR, TEMP_NAME, checkpoint_candidates, file_steps, find_checkpoint
from ckpt_archive.ops.common import RepoLike, human_seconds, leftover_note, open_repo, take_options

#: An incomplete checkpoint unchanged for longer than this is broken, not being written (seconds);
#: the default is ``max(STALE_AFTER_MIN, STALE_AFTER_SETTLES * settle)``.
STALE_AFTER_MIN = 600.0
STALE_AFTER_SETTLES = 10
STATE_KEY = "backup-state.json"
STATE_VERSION = 1



# --------------------------------------------------------------------------------------------------
# stat snapshot, settle, completeness
def _walk_files(root: Path) -> list[tuple[str, Path]]:
    """Every regular file under a folder, as (POSIX relpath, path), sorted; a file gives [("", file)]."""
    if root.is_file():
        return [("", root)]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_file():  # as the folder reader: regular files (or links to them) only
                out.append((p.relative_to(root).as_posix(), p))
    return out


def stat_snapshot(checkpoint: Path) -> list[list]:
    """``[[relpath, size, mtime_ns, inode], ...]`` for every file and sub-folder of the checkpoint.

    Folders are included (size ``-1``) so that an entry being added or removed changes the snapshot.
    Reads no file content.
    """
    snap: list[list] = []
    if checkpoint.is_file():
        st = checkpoint.stat()
        return [["", st.st_size, st.st_mtime_ns, st.st_ino]]
    for dirpath, dirnames, filenames in os.walk(checkpoint):
        dirnames.sort()
        d = Path(dirpath)
        st = d.stat()
        snap.append([d.relative_to(checkpoint).as_posix() + "/", -1, st.st_mtime_ns, st.st_ino])
        for name in sorted(filenames):
            p = d / name
            st = p.stat()
            snap.append([p.relative_to(checkpoint).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino])
    return snap


def _snapshot_or_none(checkpoint: Path) -> list[list] | None:
    """:func:`stat_snapshot`, or ``None`` when a file vanished meanwhile (compares unequal to any snapshot)."""
    try:
        return stat_snapshot(checkpoint)
    except FileNotFoundError:
        return None


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"zip is not whole ({exc}): still being written?"
    if not infos:
        return "zip holds no entries"
    return None


def completeness_problem(checkpoint: Path) -> str | None:
    """Return why the checkpoint is not complete yet, or ``None`` when it looks whole.

    Checks (cheap, bounded reads): no empty files, no temporary names (``*.tmp``, ``*.part``, ``~``,
    ``tmp-*``); a ``torch.save`` zip opens (its central directory, written last, is there); a
    ``.safetensors`` file's size matches its header; an ``*.index.json`` names only shards that
    exist; small ``*.json`` files parse; a DCP folder has its ``.metadata``.
    """
    files = _walk_files(checkpoint)
    if not files:
        return "folder holds no files yet"
    rels = {rel for rel, _ in files}
    for rel, p in files:
        problem = _one_file_problem(rel, p, rels)
        if problem:
            return f"{rel or p.name}: {problem}"
    if any(rel.endswith(".distcp") for rel in rels) and not any(rel.endswith(".metadata") for rel in rels):
        return "DCP folder without its .metadata (written last): still being written?"
    return None


def _one_file_problem(rel: str, p: Path, rels: set[str]) -> str | None:
    """Why one file of a checkpoint is not complete yet (:func:`completeness_problem`), or None. ``rel``: its
    path in the checkpoint ("" for a file checkpoint); ``rels``: every file's."""
    name = p.name
    if TEMP_NAME.search(name):
        return "temporary file name: a write is in progress"
    size = p.stat().st_size
    if size == 0:
        return "empty file: still being written?"
    with open(p, "rb") as fh:
        head = fh.read(4)
    if head[:4] == b"PK\x03\x04":
        return _zip_problem(p)
    if name.endswith(".safetensors"):
        return file_problem(p)
    if name.endswith(".json") and size <= (16 << 20):
        try:
            data = jsonio.loads(p.read_bytes(), where=rel or name, allow_nonfinite=True)
        except ValueError:
            return "JSON does not parse: still being written?"
        if name.endswith(".index.json") and isinstance(data, dict) and isinstance(data.get("weight_map"), dict):
            return _missing_shard(rel, data["weight_map"], rels)
    return None


def _missing_shard(rel: str, weight_map: dict, rels: set[str]) -> str | None:
    """The first shard an ``*.index.json`` at ``rel`` names that is not among ``rels`` (not written yet)."""
    base = Path(rel).parent
    for shard in sorted(set(map(str, weight_map.values()))):
        shard_rel = (base / shard).as_posix() if str(base) != "." else shard
        if shard_rel not in rels:
            return f"names shard {shard} which is not there yet"
    return None


def resume_part_files(checkpoint: Path) -> dict[str, str]:
    """The files of a checkpoint folder that hold a part a resume needs besides the weights, by the names
    the completeness lint (``verify --strict``) finds parts by (:data:`~ckpt_archive.training.parts.ALIASES`:
    ``optimizer.pt`` -> optimizer, ``rng_state_1.pth`` -> rng, ``trainer_state.json`` -> progress,
    ``scheduler.bin``, ``scaler.pt``, ``random_states_0.pkl``, ``sampler.bin``): ``{relpath: part}``.
    Reads no file content."""
    from ckpt_archive.training.parts import ALIASES, norm_key

    by_name = {alias: part for part, aliases in ALIASES.items() if part != "model" for alias in aliases}
    if not checkpoint.is_dir():
        return {}
    return {rel: by_name[norm_key(rel)] for rel, _ in _walk_files(checkpoint) if norm_key(rel) in by_name}


def sibling_problem(checkpoint: Path, reference: Path | None) -> str | None:
    """Why a ``checkpoint-N/`` folder is not complete yet although every file in it is whole: it lacks a
    training-state file its complete older sibling ``reference`` has (a Hugging Face Trainer writes the
    weights first and ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` and ``trainer_state.json``
    after). ``None`` when it has them all, or there is no sibling to compare with."""
    if reference is None or not checkpoint.is_dir():
        return None
    mine = resume_part_files(checkpoint)
    missing = {rel: part for rel, part in resume_part_files(reference).items() if rel not in mine}
    if not missing:
        return None
    names = ", ".join(f"{rel} ({part})" for rel, part in sorted(missing.items()))
    return f"lacks {names}, which {reference.name} has: still being written?"


def hash_files(checkpoint: Path, on_bytes: Callable[[int], None] | None = None) -> dict[str, str]:
    """sha256 of every file of the checkpoint: ``{relpath: hex}`` (``""`` for a single file).

    Reads every byte once, in 8 MiB pieces.
    """
    from ckpt_archive.format.fingerprint import file_sha256  # the same digest pack records as source.files[].sha256

    return {rel: file_sha256(p, on_bytes) for rel, p in _walk_files(checkpoint)}


def manifest_source_hashes(manifest: Mapping[str, Any] | None) -> dict[str, str] | None:
    """``{relpath: sha256}`` of a generation's source files as the manifest records them, or ``None``."""
    if not manifest:
        return None
    files = (manifest.get("source") or {}).get("files")
    if not isinstance(files, list) or not files:
        return None
    out = {}
    for f in files:
        if not isinstance(f, Mapping) or not isinstance(f.get("sha256"), str):
            return None
        out[str(f.get("relpath", ""))] = f["sha256"]
    return out


# --------------------------------------------------------------------------------------------------
# state file
def read_state(store: Any) -> dict[str, Any]:
    """Read ``backup-state.json`` from the repository's store; an absent or unreadable one is empty."""
    try:
        if not store.exists(STATE_KEY):
            return {"version": STATE_VERSION, "sources": {}}
        from ckpt_archive.format.limits import MAX_SMALL_DOC_BYTES
        from ckpt_archive.repo.repository import read_json

        data = read_json(store, STATE_KEY, MAX_SMALL_DOC_BYTES)  # bounded: read no more than the limit
    except (OSError, ValueError, CheckFailed):
        return {"version": STATE_VERSION, "sources": {}}
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION or not isinstance(data.get("sources"), dict):
        return {"version": STATE_VERSION, "sources": {}}
    return data


def write_state(store: Any, state: Mapping[str, Any]) -> None:
    """Replace ``backup-state.json`` atomically (the store's ``replace_bytes``)."""
    store.replace_bytes(STATE_KEY, jsonio.dumps(state, indent=1, sort_keys=True, ensure_ascii=True))


# --------------------------------------------------------------------------------------------------
# the run
@dataclasses.dataclass
class BackupResult:
    """What one backup run did.

    Attributes:
        action: ``"packed"`` (a new usable generation), ``"unchanged"`` (the source equals the newest
            usable generation's; nothing written) or ``"busy"`` (still being written; skipped).
        source: the SOURCE argument (absolute path).
        checkpoint: the checkpoint picked in it (absolute path).
        generation: the new generation (packed) or the matching one (unchanged); ``None`` when busy.
        reason: one line saying why.
        read_bytes: bytes of the source hashed by this run (0 when decided from stat alone).
        retention: what retention did (``{"policy", "kept", "removed", "warnings", ...}``) or ``None``.
        warnings: human-readable notes (broken checkpoints skipped, pack warnings, leftovers found).
        skipped: newer checkpoints skipped as broken (incomplete and unchanged for longer than the
            stale threshold): ``[{"checkpoint": path, "reason": str, "unchanged_s": seconds}]``.
        busy: when a newer checkpoint is still being written and the newest complete one was backed up
            instead (``action`` packed): ``{"checkpoint": path, "reason": str}``; the exit code is then 75
            (retry for the newer one). ``None`` otherwise.
    """

    action: str
    source: str
    checkpoint: str
    generation: int | None
    reason: str
    read_bytes: int = 0
    retention: dict | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)
    busy: dict | None = None

    @property
    def exit_code(self) -> int:
        """0 for packed/unchanged, 75 (EX_TEMPFAIL) for busy, or when a newer checkpoint is (``busy``)."""
        return EX_TEMPFAIL if self.action == "busy" or self.busy else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.exit_code == EXIT_OK, **dataclasses.asdict(self), "exit_code": self.exit_code}


def _settled(checkpoint: Path, settle: float, sleep: Callable[[float], None]) -> tuple[list[list] | None, str]:
    """Return (snapshot, "") when the checkpoint did not change over ``settle`` seconds, else (None, why)."""
    try:
        first = stat_snapshot(checkpoint)
        sleep(max(0.0, settle))
        second = stat_snapshot(checkpoint)
    except FileNotFoundError as exc:
        return None, f"{exc.filename}: vanished while being examined (being rewritten?)"
    if first != second:
        changed = sorted({row[0] or checkpoint.name for row in first + second
                          if row not in first or row not in second})
        return None, f"still being written: {', '.join(changed[:3])} changed within {settle:g} s"
    return second, ""


def default_stale_after(settle: float) -> float:
    """The default stale threshold in seconds: ``max(600, 10 * settle)``."""
    return max(STALE_AFTER_MIN, STALE_AFTER_SETTLES * float(settle))


def unchanged_for(snapshot: list[list], now: float | None = None) -> float:
    """Seconds since the newest mtime in a :func:`stat_snapshot` (files and folders), by this machine's clock.

    Negative when an mtime lies in the future (a file server whose clock is ahead).
    """
    newest_ns = max(row[2] for row in snapshot)
    return (time.time() if now is None else now) - newest_ns / 1e9


@dataclasses.dataclass
class _Examined:
    kind: str  # "ready" | "busy" | "broken"
    reason: str = ""
    snap: list[list] | None = None
    hashes: dict[str, str] | None = None
    recorded: dict | None = None
    read_bytes: int = 0
    unchanged_s: float = 0.0


def _broken_reason(problem: str, age: float, stale_after: float) -> str:
    problem = problem.replace(": still being written?", "")
    return (f"not complete ({problem}) and unchanged for {human_seconds(age)} "
            f"(longer than --stale-after {stale_after:g} s): broken, not being written")


def _examine(checkpoint: Path, entry: Mapping[str, Any], *, settle: float, stale_after: float,
             sleep: Callable[[float], None], on_bytes: Callable[[int], None] | None,
             reference: Path | None = None) -> _Examined:
    """Decide whether one checkpoint can be backed up now: ``ready`` (with its hashes), ``busy`` (being
    written: changed within the settle window, or incomplete and recent) or ``broken`` (incomplete and
    unchanged for longer than ``stale_after``). Incomplete: :func:`completeness_problem`, or (a
    ``checkpoint-N/`` folder) lacking a training-state file its complete older sibling ``reference`` has
    (:func:`sibling_problem`)."""
    snap_now = _snapshot_or_none(checkpoint)
    if snap_now is None:
        return _Examined("busy", "vanished while being examined (rotated?)")
    recorded = dict(entry) if entry.get("checkpoint") == str(checkpoint) and entry.get("stat") == snap_now else None
    if recorded is not None and isinstance(recorded.get("files"), dict):
        return _Examined("ready", snap=snap_now, hashes=recorded["files"], recorded=recorded)
    # Always observe the window (two stats `settle` seconds apart) rather than trusting an old
    # mtime: on network file systems mtimes come from another machine's clock.
    snap, why = _settled(checkpoint, settle, sleep)
    if snap is None:
        return _Examined("busy", why)
    counter = [0]

    def count(n):
        counter[0] += n
        if on_bytes:
            on_bytes(n)

    try:
        problem = completeness_problem(checkpoint) or sibling_problem(checkpoint, reference)
        if problem:
            # Unchanged over the settle window and incomplete: a trainer pausing between writes, or one
            # killed mid-save. Only the age tells them apart: a checkpoint nobody touched for longer than
            # the stale threshold is broken, and must not block backups forever.
            age = unchanged_for(snap)
            if age > stale_after:
                return _Examined("broken", _broken_reason(problem, age, stale_after), unchanged_s=round(age, 3))
            return _Examined("busy", f"not complete: {problem}")
        hashes = hash_files(checkpoint, count)
    except FileNotFoundError as exc:  # e.g. the trainer's rotation removed it meanwhile
        return _Examined("busy", f"{exc.filename}: vanished while being read (rotated or rewritten?)",
                         read_bytes=counter[0])
    if _snapshot_or_none(checkpoint) != snap:
        return _Examined("busy", "changed while being read: still being written", read_bytes=counter[0])
    return _Examined("ready", snap=snap, hashes=hashes, read_bytes=counter[0])


def _lower_step_note(candidates: list[Path], steps: dict, before, chosen: Path, now, *, packed: bool = False) -> list[str]:
    """[issue 26] The warning when the newest checkpoint file (by mtime) holds a lower step than the newest
    usable generation had before this run (``before``), saying what was chosen: a stray older-step file
    written later is not picked (:func:`checkpoint_candidates`), and when it is the only candidate and was
    packed, the new ``@latest`` goes back in steps -- never silently.

    Args:
        candidates: the checkpoints examined; steps: the steps read from the files (:func:`file_steps`).
        before: the newest usable generation before this run (or None); chosen: the checkpoint backed up;
        now: the generation that holds it (new or matching); packed: a new generation was written.
    """
    files = [c for c in candidates if c.is_file()]
    if before is None or before.step is None or not files:
        return []
    newest = max(files, key=lambda p: (p.stat().st_mtime_ns, p.name))
    hit = steps.get(str(newest))
    step = hit[3] if isinstance(hit, list) and len(hit) == 4 else None
    if newest == chosen and now is not None and now.step is not None:
        step = now.step
    if step is None or step >= before.step:
        return []
    written = datetime.fromtimestamp(newest.stat().st_mtime, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    head = (f"the newest file {newest} (written {written}) holds step {step}, lower than step {before.step} of "
            f"generation {before.number}, the newest usable one before this run")
    if newest != chosen:
        what = "packed as generation" if packed else "which is generation"
        return [f"{head}: not chosen; chose {chosen} (step {now.step if now is not None else '?'}) by step, "
                f"{what} {now.number if now is not None else '?'}"]
    if packed:
        return [f"{head}: it was the only checkpoint to back up and is now generation {now.number}, @latest, at "
                f"the lower step; `ckpt-archive restore REPO@{before.number}` restores step {before.step}"]
    return []


@dataclasses.dataclass(frozen=True)
class BackupOptions:
    """How :func:`backup` judges and packs a checkpoint (``ckpt-archive backup``'s options, one name each).

    Attributes:
        settle: seconds the checkpoint must stay unchanged (size, mtime_ns, inode, entries) before it is
            packed (``--settle``; >= 0, default 10).
        stale_after: seconds (by the newest mtime of its files) after which an incomplete checkpoint counts as
            broken rather than being written (``--stale-after``; > 0); ``None``: ``max(600, 10 * settle)``.
        tags: tags for a new generation (``--tag``); a str is one tag.
        allow: plain-data classes to admit when packing (``"argparse.Namespace"``; ``--allow``; see
            :class:`~ckpt_archive.ops.pack.PackOptions`); a str is one name.

    Example:
        >>> BackupOptions(settle=0, tags="nightly").settle
        0
    """

    settle: float = 10.0
    stale_after: float | None = None
    tags: Sequence[str] | str = ()
    allow: Sequence[Any] | str = ()


def backup(source: str | os.PathLike, repo: RepoLike, options: BackupOptions | None = None, *,
           retention: Any = None, wait: float = 0.0, on_bytes: Callable[[int], None] | None = None,
           store_options: Mapping[str, Any] | None = None, now: datetime | None = None,
           sleep: Callable[[float], None] = time.sleep) -> BackupResult:
    """Back up the newest complete checkpoint in SOURCE to REPO, if it changed.

    The newest checkpoint is examined first. Changed within ``settle`` seconds, or incomplete and
    changed within ``stale_after`` seconds: it is being written and not packed (exit 75); the older ones
    are examined for the newest complete one, packed when no usable generation holds it (``action``
    packed, ``busy`` naming the newer one), else the run is ``busy``. Incomplete and unchanged for longer
    than ``stale_after``: it is broken (a save that was killed); it is skipped with a warning and the next
    newest checkpoint is examined the same way.

    Args:
        source: a checkpoint file or folder, or a training output folder (see :func:`checkpoint_candidates`).
        repo: repository path or URL (created if absent), or an open Repository.
        options: :class:`BackupOptions` (default: 10 s settle window, no tags).
        retention: a retention policy (dict or :class:`~ckpt_archive.retention.policy.RetentionPolicy`) to
            apply after a new generation is usable, as ``pack(..., retention=)``; ``None`` uses the
            repository's default policy.
        wait: seconds to wait for the repository lock (0: fail at once with :class:`LockError`).
        on_bytes: progress callback, called with a byte count while hashing.
        store_options: for URL repositories, one mapping (``{"endpoint_url": ..., "storage_options": {...}}``;
            :func:`~ckpt_archive.ops.common.open_repo`).
        now: decision time for retention (default now, UTC), as ``prune(now=)``.
        sleep: the sleep function of the settle window (tests pass a fake).

    Returns:
        A :class:`BackupResult`; ``exit_code`` is 75 when the newest checkpoint was still being written.

    Raises:
        NotFound, SourceError: SOURCE missing or holding no checkpoint, or holding no complete one
            (every checkpoint in it is broken; exit 2, naming each and why).
        LockError: another writer holds the repository lock longer than ``wait`` (exit 2).
        UsageError: a malformed retention policy, a negative ``settle`` or a non-positive ``stale_after``.
        CheckFailed: the new generation failed verification or trial reload (nothing published).
        TypeError: an unknown keyword argument or store option; ``options`` that is not a
            :class:`BackupOptions` (``backup(src, repo, settle=0)`` is refused).
    """
    from ckpt_archive.format.durations import check_seconds
    from ckpt_archive.retention.policy import RetentionPolicy

    opts = take_options(options, BackupOptions, "backup")
    settle = check_seconds(opts.settle, "--settle")
    stale_after = default_stale_after(settle) if opts.stale_after is None else opts.stale_after
    stale_after = check_seconds(stale_after, "--stale-after", allow_zero=False)
    policy = None if retention is None else RetentionPolicy.from_dict(retention)
    run = _BackupRun(Path(source).absolute(), repo, wait, store_options)
    done = run.pick(settle=settle, stale_after=stale_after, sleep=sleep, on_bytes=on_bytes)
    if done is None:
        done = run.unchanged()
    if done is None:
        done = run.pack(policy, tags=_names(opts.tags), allow=_names(opts.allow), now=now)
    return done


def _names(value: Sequence[Any] | str) -> tuple:
    """``tags`` / ``allow`` as a tuple; a str is one name (never its characters)."""
    return (value,) if isinstance(value, str) else tuple(value)


class _BackupRun:
    """One :func:`backup` run, in its steps: open the repository and list the candidates (constructor), pick
    the checkpoint to back up (:meth:`pick`), stop when a usable generation holds it (:meth:`unchanged`), else
    pack it, withdrawn if the source moved meanwhile, and apply retention (:meth:`pack`).

    Raises:
        NotFound: SOURCE missing (before the repository is created for nothing).
    """

    def __init__(self, src: Path, repo: RepoLike, wait: float, store_options: Mapping[str, Any] | None = None):
        self.key, self.wait = str(src), wait
        if not src.exists():  # before the repository is created for nothing
            raise NotFound("no such file or folder", where=self.key)
        self.rep = open_repo(repo, store_options, create=True)  # an open Repository keeps its keys (issue 28)
        self.state = read_state(self.rep.store)
        self.entry = self.state["sources"].get(self.key) or {}
        steps = dict(self.entry["steps"]) if isinstance(self.entry.get("steps"), dict) else {}
        self.candidates = [c.absolute() for c in checkpoint_candidates(src, steps)]
        self.steps = {k: v for k, v in steps.items() if Path(k) in self.candidates}  # the files still there
        self.before = self.newest_usable()  # the newest usable generation before this run
        self.skipped: list[dict] = []
        self.warnings: list[str] = []
        self.busy: _Examined | None = None
        self.busy_at: Path | None = None
        self.seen: _Examined | None = None
        self.checkpoint: Path | None = None
        self.read_bytes = 0

    def newest_usable(self):
        gens = self.rep.usable()
        return gens[-1] if gens else None

    def reference_for(self, i: int) -> Path | None:
        """The newest older sibling of a ``checkpoint-N/`` candidate whose files are whole (what a complete
        checkpoint of this run holds), or None."""
        candidates = self.candidates
        if not candidates[i].is_dir() or not CKPT_DIR.match(candidates[i].name):
            return None
        for older in candidates[i + 1:]:
            try:
                if older.is_dir() and completeness_problem(older) is None:
                    return older
            except FileNotFoundError:  # rotated away meanwhile
                continue
        return None

    def result(self, action: str, checkpoint: Any, generation: int | None, reason: str, *, newer_busy: bool = True,
               **extra) -> BackupResult:
        """The run's :class:`BackupResult`, with its warnings, skipped checkpoints and (``newer_busy``) the newer
        checkpoint being written."""
        busy = {} if self.busy is None or not newer_busy else {
            "busy": {"checkpoint": str(self.busy_at), "reason": self.busy.reason}}
        return BackupResult(action, self.key, str(checkpoint), generation, reason, read_bytes=self.read_bytes,
                            warnings=self.warnings, skipped=self.skipped, **busy, **extra)

    def pick(self, *, settle: float, stale_after: float, sleep, on_bytes) -> BackupResult | None:
        """Examine the candidates newest first (:func:`_examine`) and keep the first complete one; a broken one
        is skipped with a warning, the newest busy one remembered (exit 75 whatever else happens). Returns the
        ``busy`` result when there is nothing to back up now.

        Raises:
            SourceError: every checkpoint is broken.
        """
        for i, checkpoint in enumerate(self.candidates):
            seen = _examine(checkpoint, self.entry, settle=settle, stale_after=stale_after, sleep=sleep,
                            on_bytes=on_bytes, reference=self.reference_for(i))
            if seen.kind == "ready":
                self.seen, self.checkpoint = seen, checkpoint
                self.read_bytes += seen.read_bytes
                self._skip_broken_files_ranked_below(i, stale_after)
                return self._prefer_newest_complete()
            if seen.kind == "broken":
                self.skipped.append({"checkpoint": str(checkpoint), "reason": seen.reason,
                                     "unchanged_s": seen.unchanged_s})
                self.warnings.append(f"skipped {checkpoint}: {seen.reason}")
                continue
            if self.busy is None:  # the newest being written: exit 75 whatever else happens; look for an older one
                self.busy, self.busy_at = seen, checkpoint
            self.read_bytes += seen.read_bytes
        if self.busy is not None:
            return self.result("busy", self.busy_at, None, self.busy.reason, newer_busy=False)
        names = "; ".join(f"{x['checkpoint']}: {x['reason']}" for x in self.skipped)
        raise SourceError(f"no complete checkpoint to back up: {names}", where=self.key,
                          hint="remove or repair the broken checkpoint(s); exit 75 is only for one still being written")

    def _skip_broken_files_ranked_below(self, i: int, stale_after: float) -> None:
        """A checkpoint file whose step cannot be read is ranked by mtime (``checkpoint_pick._by_step``): one
        older than every file whose step is known comes after them, so :meth:`pick` stopped at a complete one
        before reaching it. A truncated save of the newest step (``ckpt-300.pt``, killed mid-write an hour
        ago, beside complete ``ckpt-100.pt`` and ``ckpt-200.pt``) was passed over in silence (``skipped: []``,
        no warning); such a file, incomplete and unchanged for longer than ``stale_after``, is now skipped
        with a warning like any broken checkpoint (docs/retention.md)."""
        for checkpoint in self.candidates[i + 1:]:
            try:
                if not checkpoint.is_file() or (problem := completeness_problem(checkpoint)) is None:
                    continue
                snap = _snapshot_or_none(checkpoint)
            except OSError:  # rotated away meanwhile, unreadable: nothing to say about it
                continue
            age = unchanged_for(snap) if snap is not None else 0.0
            if age > stale_after:
                reason = _broken_reason(problem, age, stale_after) + "; its step could not be read"
                self.skipped.append({"checkpoint": str(checkpoint), "reason": reason, "unchanged_s": round(age, 3)})
                self.warnings.append(f"skipped {checkpoint}: {reason}")

    def _prefer_newest_complete(self) -> BackupResult | None:
        """With a newer checkpoint being written (exit 75: the next tick takes it), the newest complete one is
        backed up unless a usable generation already holds it: never nothing while a newer one is half written
        (a trainer that dies now would leave no backup of it), never an incomplete one."""
        if self.busy is not None:
            hashes = self.seen.hashes
            done = next((g for g in reversed(self.rep.usable()) if manifest_source_hashes(g.manifest) == hashes),
                        None)
            if done is not None:
                return self.result("busy", self.busy_at, None, self.busy.reason, newer_busy=False)
            self.warnings.append(f"{self.busy_at} is still being written ({self.busy.reason}); backing up the "
                                 f"newest complete checkpoint instead: {self.checkpoint} (exit 75: retry for the "
                                 f"newer one)")
        elif self.skipped:
            self.warnings.append(f"backing up the newest complete checkpoint instead: {self.checkpoint}")
        return None

    def remember(self, generation: int | None) -> None:
        """Record the checkpoint backed up, its stat and hashes (the next run decides from stat alone)."""
        self.state["sources"][self.key] = {"checkpoint": str(self.checkpoint), "stat": self.seen.snap,
                                           "files": self.seen.hashes, "generation": generation,
                                           "at": datetime.now(timezone.utc).isoformat(), "steps": self.steps}
        write_state(self.rep.store, self.state)

    def unchanged(self) -> BackupResult | None:
        """The ``unchanged`` result when the newest usable generation holds exactly the checkpoint picked."""
        newest = self.newest_usable()
        if newest is None or manifest_source_hashes(newest.manifest) != self.seen.hashes:
            return None
        recorded = self.seen.recorded
        if recorded is None or recorded.get("generation") != newest.number or self.entry.get("steps", {}) != self.steps:
            with self.rep.lock(wait=self.wait):
                self.remember(newest.number)
        self.warnings += _lower_step_note(self.candidates, self.steps, self.before, self.checkpoint, newest)
        return self.result("unchanged", self.checkpoint, newest.number,
                           f"source equals generation {newest.number}; nothing to do")

    def before_publish(self, candidate, withdrawn_as: dict[str, int]) -> str | None:
        """Pack's before-publish hook, under the lock: the source must not have moved while it was packed, so
        a generation of a moving source is withdrawn before it is ever usable; nor may a concurrent backup have
        published the same content just before."""
        hashes = self.seen.hashes
        packed = manifest_source_hashes(candidate.manifest)
        if _snapshot_or_none(self.checkpoint) != self.seen.snap or (packed is not None and packed != hashes):
            return "changed while being packed"
        earlier = [g for g in candidate.repo.usable() if g.number < candidate.number]
        if earlier and manifest_source_hashes(earlier[-1].manifest) == hashes:
            # a concurrent backup of the same content published just before us: keep theirs only
            withdrawn_as["duplicate_of"] = earlier[-1].number
            return f"a concurrent backup packed the same content as generation {earlier[-1].number}"
        return None

    def pack(self, policy: Any, *, tags, allow, now: datetime | None) -> BackupResult:
        """Pack the checkpoint picked (an empty retention policy inside pack), remember it, then apply
        ``policy`` (the repository's default when None)."""
        from ckpt_archive.ops import pack as pack_op
        from ckpt_archive.ops.pack import Annotations, PackOptions
        from ckpt_archive.ops.prune import apply_after_pack
        from ckpt_archive.repo.publish import Withdrawn
        from ckpt_archive.retention.policy import RetentionPolicy

        withdrawn_as: dict[str, int] = {}
        try:
            result = pack_op.pack(str(self.checkpoint), self.rep, PackOptions(wait=self.wait, allow=allow),
                                  Annotations(tags=tuple(tags)), retention=RetentionPolicy(),
                                  before_publish=lambda candidate: self.before_publish(candidate, withdrawn_as))
        except SourceChanged as exc:  # pack's own check of the file it read (withdrawn, nothing kept)
            return self.result("busy", self.checkpoint, None, f"changed while being packed: {exc.message}")
        except Withdrawn as exc:
            return self._withdrawn(exc, withdrawn_as)
        gen = result.generation
        self.warnings += list(result.warnings) + [leftover_note(x) for x in result.leftovers]
        with self.rep.lock(wait=max(self.wait, 60.0)):
            self.remember(gen)
            # pack verified and trial-reloaded `gen` moments ago: it counts as the kept verified copy unread
            ret = apply_after_pack(self.rep, policy.to_dict() if policy is not None else None, now=now,
                                   verified=(gen,))
        self.warnings += ret.get("warnings", [])
        self.warnings += _lower_step_note(self.candidates, self.steps, self.before, self.checkpoint,
                                          self.rep.generation(gen), packed=True)
        return self.result("packed", self.checkpoint, gen, f"packed as generation {gen}", retention=ret)

    def _withdrawn(self, exc: Any, withdrawn_as: dict[str, int]) -> BackupResult:
        """The generation was withdrawn before publishing: the source moved (``busy``), or a concurrent backup
        published the same content first (``unchanged``, theirs remembered)."""
        gen = exc.number
        self.warnings += list(exc.warnings) + [leftover_note(x) for x in exc.leftovers]
        if "duplicate_of" not in withdrawn_as:
            return self.result("busy", self.checkpoint, None,
                               f"changed while being packed: generation {gen} forgotten again")
        theirs = withdrawn_as["duplicate_of"]
        with self.rep.lock(wait=max(self.wait, 60.0)):
            self.remember(theirs)
        return self.result("unchanged", self.checkpoint, theirs,
                           f"a concurrent backup packed the same content as generation {theirs}; "
                           f"duplicate generation {gen} removed")


__all__ = ["STALE_AFTER_MIN", "STALE_AFTER_SETTLES", "STATE_KEY", "STATE_VERSION", "checkpoint_candidates",
           "file_steps", "find_checkpoint", "stat_snapshot", "completeness_problem", "resume_part_files",
           "sibling_problem", "hash_files", "manifest_source_hashes", "read_state", "write_state", "BackupResult",
           "default_stale_after", "unchanged_for", "backup", "BackupOptions"]
