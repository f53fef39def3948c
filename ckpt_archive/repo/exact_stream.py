"""verify --deep's sha256 of each exact-bytes source file, taken in the trial reload's one read.

A source file kept as exact bytes (docs/FORMAT.md, "Exact bytes") is its skeleton member with tensor entries
cut in at its ``segments``; restore checks the rebuilt file's sha256 against ``source.files[].sha256``, so
``verify --deep`` checks the same sha256 (issue 24, item 8). Rebuilding the file in file order by reading
each segment's entry again (:func:`ckpt_archive.repo.trial_reload.rebuilt_sha256`) decodes and hashes every
tensor byte a second time (issue 29: ``verify --deep`` at 2x its earlier time). Here the file's sha256 is fed
from the tensors member's decoded chunks as the trial reload streams them (``ArchiveReader.iter_entries``'
``tap``, on a thread of its own, beside the raw BLAKE3): the skeleton, held whole (it is small: the pickle
and the zip's headers), fills the gaps, and an entry the file needs again later, or before an entry that
comes earlier in the member (a deduplicated storage), is kept until then.

Which files can be hashed so is decided from the manifest alone (:func:`plan`): the skeleton at most
:data:`SKELETON_WHOLE_BYTES`, the entries kept at most :data:`KEPT_BYTES`, each entry key in one tensors member.
A file whose segments span several tensors members (the shards of a state over ``SHARD_BYTES``, 4 GiB) is fed
by each in turn, in manifest order, the order the trial reload reads them. Any other file, and any file whose stream did not complete (a chunk or an entry failed,
an entry skipped), is rebuilt the old way, which names what fails: this is a faster path to the same sha256,
never a weaker check.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ckpt_archive.errors import CkptArchiveError, FormatError, StoreError
from ckpt_archive.format.fingerprint import entries_in_order

#: The largest skeleton member held whole to fill a streamed file's gaps (raw bytes; a larger one: rebuilt).
SKELETON_WHOLE_BYTES = 32 << 20
#: The most raw bytes of entries kept for a later segment, per tensors member (more: the file is rebuilt).
KEPT_BYTES = 32 << 20


class _Incomplete(Exception):
    """The stream cannot give this member's files their sha256 (they are rebuilt instead)."""


@dataclasses.dataclass
class _File:
    """One streamed source file: its sha256 so far, its next segment, and where it stands in its skeleton."""

    index: int
    segments: list
    skeleton: bytearray
    size: int
    h: object = dataclasses.field(default_factory=lambda: hashlib.sha256())
    next: int = 0   # index of the next segment to feed
    pos: int = 0    # file bytes fed so far
    skel: int = 0   # skeleton bytes fed so far

    def gap_to(self, start: int) -> bool:
        """Feed the skeleton bytes up to file offset ``start``; False when the skeleton is too short."""
        n = start - self.pos
        if n < 0 or self.skel + n > len(self.skeleton):
            return False
        if n:
            self.h.update(memoryview(self.skeleton)[self.skel:self.skel + n])
        self.skel += n
        self.pos = start
        return True


class _Files:
    """What the streams of one or more tensors members share: the files they feed (their sha256 so far), the
    entries kept for a later segment, the entries arrived, and how far the members' streams got (in manifest
    order: a file's segments may go on in the next member, the next shard of a state over ``SHARD_BYTES``)."""

    def __init__(self, files: list, kept: set[str], n_members: int):
        self.files = [_File(i, [tuple(s) for s in f["exact"]["segments"]], skel, int(f["raw_bytes"]))
                      for i, f, skel in files]
        self.kept_keys = kept
        self.kept: dict[str, bytearray] = {}
        self.arrived: set[str] = set()
        self.n_members = n_members
        self.completed = 0   # members whose stream completed, in order
        self.failed = False

    def results(self) -> dict[int, str]:
        """``{index in source.files: sha256 hex}`` of each file complete once every member's stream completed."""
        if self.failed or self.completed != self.n_members:
            return {}
        out = {}
        for f in self.files:
            if f.next == len(f.segments) and f.gap_to(f.size) and f.skel == len(f.skeleton):
                out[f.index] = f.h.hexdigest()
        return out


class FileOrderHasher:
    """The sha256 of exact-bytes files fed with a tensors member's decoded chunks in stream order (:meth:`feed`,
    called on one thread, in order), then :meth:`finish`. A file whose segments span several tensors members
    (the shards of a state over ``SHARD_BYTES``) is fed by one of these per member, sharing ``group``, the members
    read in manifest order; its sha256 comes from the last member's :meth:`finish`.

    Args:
        rec: the tensors member's record. files: ``[(index in source.files, its record, its skeleton's raw
            bytes)]`` (with ``group`` None). kept: entry keys whose bytes a later segment needs again (from
            :func:`plan`). group: the state shared with the other members' hashers (None: this member alone).
            position: this member's place among the group's members (0-based, manifest order).
    """

    def __init__(self, rec: dict, files: list, kept: set[str], group: _Files | None = None, position: int = 0):
        self.rec = rec
        self.base = rec["header_bytes"]
        self.ranges = [(self.base + e["data_offsets"][0], self.base + e["data_offsets"][1], k)
                       for k, e in entries_in_order(rec)]
        self.group = group if group is not None else _Files(files, kept, 1)
        self.position = position
        self.total = 0
        self.ri = 0
        self.live: list[_File] = []
        self.failed = False

    @property
    def files(self) -> list:
        return self.group.files

    def feed(self, off: int, chunk) -> None:
        """The member's decoded bytes at raw offset ``off`` (the next in order; a gap fails the stream)."""
        if self.failed:
            return
        try:
            self._feed(off, chunk)
        except Exception:  # noqa: BLE001 - a surprise only sends these files to the full rebuild, which names it
            self.failed = True

    def _feed(self, off: int, chunk) -> None:
        if off != self.total or self.group.completed != self.position:  # a gap, or an earlier member unfinished
            self.failed = True
            return
        mv = memoryview(chunk).cast("B")
        self.total += len(mv)
        pos = off
        while len(mv) or (self.ri < len(self.ranges) and self.ranges[self.ri][0] == self.ranges[self.ri][1] == pos):
            if pos < self.base:
                n = min(len(mv), self.base - pos)
                mv, pos = mv[n:], pos + n
                continue
            if self.ri >= len(self.ranges):
                self.failed = True  # longer than its entries: the raw check names it
                return
            start, end, key = self.ranges[self.ri]
            if pos == start:
                self._begin(key, end - start)
            n = min(len(mv), end - pos)
            if n:
                self._piece(key, mv[:n], pos - start)
                mv, pos = mv[n:], pos + n
            if pos == end:
                self._end(key, end - start)
                self.ri += 1

    def _begin(self, key: str, size: int) -> None:
        """An entry starts: the files whose next segment it is get their skeleton gap, then its bytes live."""
        self.live = []
        for f in self.files:
            if f.next < len(f.segments) and f.segments[f.next][2] == key:
                if not f.gap_to(f.segments[f.next][0]):
                    raise _Incomplete("the skeleton is shorter than the file")
                self.live.append(f)
        if key in self.group.kept_keys:
            self.group.kept[key] = bytearray(size)

    def _piece(self, key: str, piece, at: int) -> None:
        for f in self.live:
            f.h.update(piece)
        if key in self.group.kept:
            self.group.kept[key][at:at + len(piece)] = piece

    def _end(self, key: str, size: int) -> None:
        """An entry ends: the files fed it move past it, then through every segment whose entry has come."""
        kept = self.group.kept
        self.group.arrived.add(key)
        for f in self.live:
            f.pos += size
            f.next += 1
            while f.next < len(f.segments) and f.segments[f.next][2] in self.group.arrived:
                start, length, k = f.segments[f.next]
                if k not in kept or not f.gap_to(start):
                    raise _Incomplete("an entry needed again was not kept")
                f.h.update(kept[k])
                f.pos += length
                f.next += 1
        self.live = []

    def finish(self) -> dict[int, str]:
        """This member's stream is complete: ``{index in source.files: sha256 hex}`` of each file the group's
        streams completed, from the group's last member (none from the others, and none when a stream did not
        complete: those files are rebuilt)."""
        if self.failed or self.total != self.rec["raw_bytes"] or self.group.completed != self.position:
            self.group.failed = True
            return {}
        self.group.completed += 1
        return self.group.results() if self.position == self.group.n_members - 1 else {}


def _owners(manifest: dict) -> dict[str, dict]:
    """Entry key -> the tensors member a rebuild reads it from (the last that has it, as the rebuild's map)."""
    return {k: m for m in manifest["members"] if m["role"] == "tensors" for k in m.get("entries") or ()}


def _kept_entries(order: list[str], sizes: dict[str, int], files: list[list]) -> set[str] | None:
    """The entries that must be kept for a later segment when the member's entries come in ``order`` and each
    file takes its segments' entries (``files``: each file's entry keys in file order) live or from what was
    kept; None when some file cannot be completed so or more than :data:`KEPT_BYTES` would be kept."""
    arrived: set[str] = set()
    kept: set[str] = set()
    nxt = [0] * len(files)
    for key in order:
        arrived.add(key)
        for i, segs in enumerate(files):
            if nxt[i] < len(segs) and segs[nxt[i]] == key:
                nxt[i] += 1
                while nxt[i] < len(segs) and segs[nxt[i]] in arrived:
                    kept.add(segs[nxt[i]])
                    nxt[i] += 1
    if any(n != len(segs) for n, segs in zip(nxt, files)) or sum(sizes[k] for k in kept) > KEPT_BYTES:
        return None
    return kept


def plan(reader, on_bytes=None) -> tuple[dict[str, FileOrderHasher], set[str]]:
    """Which exact-bytes files of ``reader``'s generation are hashed in the trial reload's read, and how.

    Reads each such file's skeleton member (role ``file``) whole, every chunk's stored sha256 and its raw
    fingerprint checked, as the trial reload's own read of it would: a skeleton that fails is left to that
    read, which reports it, and its file to the rebuild. A manifest whose ``exact`` records are malformed
    plans nothing (the trial reload's index checks and the rebuild report them, as before).

    Returns:
        ``({tensors member path: its FileOrderHasher}, {skeleton member paths read and checked whole here})``.

    Raises:
        StoreError: the store failed (could not check).
    """
    from ckpt_archive.format.exact_bytes import exact_problems

    try:
        if exact_problems(reader.manifest):
            return {}, set()
        return _plan(reader, on_bytes)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError):
        return {}, set()


def _plan(reader, on_bytes) -> tuple[dict[str, FileOrderHasher], set[str]]:
    """:func:`plan` on ``exact`` records that fit their entries and skeletons (``exact_problems`` found none)."""
    files, skeletons = _streamable_files(reader, on_bytes)
    hashers: dict[str, FileOrderHasher] = {}
    for members, group_files in _groups(reader, files):
        recs = [reader.by_path[path] for path in members]
        try:
            orders = [[k for k, _ in entries_in_order(rec)] for rec in recs]
        except FormatError:
            continue
        order = [k for keys in orders for k in keys]
        if len(order) != len(set(order)):
            continue  # an entry key in two members: which one a segment means is the rebuild's question
        sizes = {k: e["data_offsets"][1] - e["data_offsets"][0] for rec in recs for k, e in rec["entries"].items()}
        kept = _kept_entries(order, sizes, [[k for _, _, k in f["exact"]["segments"]] for _, f, _ in group_files])
        if kept is None:
            continue
        shared = _Files(group_files, kept, len(recs))
        for position, rec in enumerate(recs):
            hashers[rec["path"]] = FileOrderHasher(rec, group_files, kept, shared, position)
    return hashers, set(skeletons)


def _groups(reader, files: list) -> list[tuple[list[str], list]]:
    """The streamable files grouped by the tensors members their segments span: members that share a file are
    one group (read one after the other, in manifest order). ``files``: ``[(member paths, (index, record,
    skeleton))]``. Returns ``[(member paths in manifest order, [(index, record, skeleton)])]``."""
    parent: dict[str, str] = {}

    def root(m: str) -> str:
        while parent.setdefault(m, m) != m:
            m = parent[m]
        return m

    for members, _ in files:
        first, *rest = sorted(members)
        for m in rest:
            parent[root(m)] = root(first)
    position = {m["path"]: i for i, m in enumerate(reader.manifest["members"])}
    groups: dict[str, tuple[set, list]] = {}
    for members, item in files:
        members_of, items = groups.setdefault(root(next(iter(members))), (set(), []))
        members_of.update(members)
        items.append(item)
    return [(sorted(ms, key=position.__getitem__), items) for ms, items in groups.values()]


def _streamable_files(reader, on_bytes) -> tuple[list, dict[str, bytearray]]:
    """The exact-bytes files whose skeleton (a ``file`` member of at most :data:`SKELETON_WHOLE_BYTES`) reads
    whole and checks: ``([(the tensors members its segments lie in, (index, file record, skeleton bytes))],
    {skeleton path: its bytes})``."""
    manifest = reader.manifest
    owners = _owners(manifest)
    out: list = []
    skeletons: dict[str, bytearray] = {}
    for i, f in enumerate((manifest.get("source") or {}).get("files") or []):
        ex = f.get("exact")
        if not ex or f.get("hardlink_of") or not ex.get("segments") or not isinstance(f.get("raw_bytes"), int):
            continue
        members = {owners[k]["path"] for _, _, k in ex["segments"]}
        skel = reader.by_path[ex["member"]]
        if skel["role"] != "file" or max(skel["raw_bytes"], skel["stored_bytes"]) > SKELETON_WHOLE_BYTES:
            continue
        if ex["member"] not in skeletons:
            data = _read_skeleton(reader, ex["member"])
            if data is None:
                continue
            skeletons[ex["member"]] = data
            if on_bytes:
                on_bytes(skel["raw_bytes"])
        out.append((members, (i, f, skeletons[ex["member"]])))
    return out, skeletons


def _read_skeleton(reader, path: str) -> bytearray | None:
    """A skeleton member's raw bytes, every check of its read passed; None when one failed (the trial reload's
    own read of the member reports it). Raises StoreError: the store failed."""
    try:
        return reader.read_member_bytes(path, limit=SKELETON_WHOLE_BYTES)
    except StoreError:
        raise
    except CkptArchiveError:
        return None


__all__ = ["SKELETON_WHOLE_BYTES", "KEPT_BYTES", "FileOrderHasher", "plan"]
