"""Shared objects in a repository (format 3): what the writer reuses, how readers see a member through
its objects, and which objects a deletion may remove (docs/FORMAT.md, "Shared objects").

* :class:`ObjectIndex` -- built under the writer lock from every generation's manifest: the objects
  usable generations vouch for (reusable, with their chunk records), every generation referencing
  each object, and the generations whose manifests cannot be read (then nothing is deleted);
* :class:`SharedWriter` -- the writer's decision per entry: reference (after hashing the object's stored
  bytes now: :func:`check_object`), create (repairing a damaged object in place), or keep it inline;
* :class:`MemberStream` -- a member's stored stream read from its own file and its objects, with
  positional reads when every part is a local file (so chunks still decode in parallel);
* :func:`sweep` -- delete objects no remaining manifest references, under the lock, last in delete order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from typing import Iterable

from ckpt_archive.errors import CkptArchiveError, IntegrityError, NotFound
from ckpt_archive.format.member_writer import ChunkSink
from ckpt_archive.format.objects import (OBJECT_DIR, check_fp, misplaced_oid, object_id, object_key, oid_of_name,
                                         parts, rebase)
from ckpt_archive.format.objects import refs as manifest_refs
from ckpt_archive.store.fs import TEMP_FILE as _TMP_NAME  # the file layer's temporary names


@dataclasses.dataclass
class ObjectIndex:
    """What the repository's manifests say about shared objects (read under the lock).

    Attributes:
        usable: ``{raw fp: (oid, chunk records rebased to the object)}`` for objects a ``usable``
            generation references (what a writer may reference).
        users: ``{oid: [generation numbers]}`` of every generation whose manifest references the object.
        unreadable: ``[(number, reason)]``: generations with a manifest this reader cannot parse (their
            references are unknown, so no object may be deleted while they exist).
    """

    usable: dict[str, tuple[str, list[dict]]]
    users: dict[str, list[int]]
    unreadable: list[tuple[int, str]]

    @classmethod
    def build(cls, repo, gens=None, *, exclude: Iterable[int] = ()) -> "ObjectIndex":
        """Index every generation of ``repo`` (or ``gens``), leaving out the numbers in ``exclude``."""
        skip = set(exclude)
        usable: dict[str, tuple[str, list[dict]]] = {}
        users: dict[str, list[int]] = {}
        unreadable: list[tuple[int, str]] = []
        for g in (repo.generations() if gens is None else gens):
            if g.number in skip:
                continue
            if g.manifest is None:
                # a partial one (never published) whose manifest cannot be read blocks nothing: it can never be
                # published, and gc removes it (repository.Repository._unreadable)
                if g.status == "damaged" and g.error is not None:
                    unreadable.append((g.number, g.reason or "manifest cannot be read"))
                continue
            for m in g.manifest.get("members") or ():
                if not m.get("objects"):
                    continue
                for p in parts(m):
                    if p.oid is None:
                        continue
                    users.setdefault(p.oid, [])
                    if g.number not in users[p.oid]:
                        users[p.oid].append(g.number)
                    if g.status == "usable" and p.fp not in usable:
                        usable[p.fp] = (p.oid, p.record["chunks"])
        return cls(usable, users, unreadable)


class SharedWriter:
    """The writer's side of sharing for one generation (the caller holds the repository lock).

    Args:
        store: the repository's store. index: :meth:`ObjectIndex.build` of the repository now.
        min_bytes: entries with fewer raw bytes are not shared. faults: the repository's fault hook
            (points ``object-write``: an object written, not yet linked; ``object-commit``: linked).
    """

    def __init__(self, store, index: ObjectIndex, *, min_bytes: int, faults=None, distrust: Iterable[str] = (),
                 jobs: int | None = None):
        self.store = store
        self.index = index
        self.min_bytes = min_bytes
        self.faults = faults
        self.jobs = jobs
        #: objects (oids) found damaged: never referenced on trust; written again (replacing the file)
        self.distrust: set[str] = set(distrust)
        self._made: dict[str, tuple[str, list[dict]]] = {}   # raw fp -> objects this generation created
        self._open: set[str] = set()
        self._lock = threading.Lock()
        self.new_stored_bytes = 0
        #: names (oids) of objects referenced because a usable generation vouches for them
        self.reused: set[str] = set()
        #: the reuse check (:func:`check_object`) of each object a usable generation vouches for, made once
        #: per pack before it is referenced: oid -> None (every stored byte matched) or what is wrong
        self.checked: dict[str, str | None] = {}
        #: objects the reuse check found damaged (oid -> what is wrong), written again from the state
        self.repaired: dict[str, str] = {}
        #: objects whose stored bytes passed the reuse check: oid -> the chunk table they were checked
        #: against, a usable generation's (see :meth:`proven`)
        self._hashed: dict[str, list[dict]] = {}
        #: objects found as something other than a regular file (a folder, FIFO, link): oid -> what; removed
        #: and written in their place
        self.replaced: dict[str, str] = {}
        self._folders: set[str] = set()
        self._pool = None

    def close(self) -> None:
        """Stop the reuse check's threads (idempotent; the caller's ``finally``)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _sound(self, oid: str, chunks: list[dict]) -> bool:
        """The reuse check: whether the stored bytes of object ``oid`` match ``chunks`` (a usable generation's
        chunk table of it) now, hashed once per pack (never decoded). A failure is remembered in
        :attr:`repaired` and :attr:`distrust`: the entry is then written again from the state."""
        if oid not in self.checked:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                from ckpt_archive.format.codec import default_jobs

                self._pool = ThreadPoolExecutor(self.jobs or default_jobs(), thread_name_prefix="ckpt-reuse")
            why = check_object(self.store, oid, rebase(chunks), pool=self._pool)
            self.checked[oid] = why
            if why is None:
                self._hashed[oid] = chunks
            else:
                self.distrust.add(oid)
                self.repaired[oid] = why
        return self.checked[oid] is None

    def proven(self, manifest: dict) -> frozenset[str]:
        """The objects ``manifest`` (the new generation's) references that need no second decode by its
        trial reload (docs/FORMAT.md, "Write order", step 5): their stored bytes were hashed by this pack
        (every chunk's sha256 matched) and the chunk table the manifest lists for them is, chunk for chunk
        (codec, raw and stored size, stored sha256), the one a usable generation's trial reload proved
        decodes to the object's raw fingerprint. Any other object is decoded and checked in full."""
        out = set()
        for m in manifest.get("members") or ():
            if not m.get("objects"):
                continue
            for p in parts(m):
                table = self._hashed.get(p.oid) if p.oid is not None else None
                if table is not None and same_chunks(p.record["chunks"], table):
                    out.add(p.oid)
        return frozenset(out)

    def sync(self) -> None:
        """Make the new objects' names durable: one fsync per folder they were linked in, then
        ``objects/`` and the repository root (a folder created here); before the manifest names them."""
        if not self._folders:
            return
        for folder in sorted(self._folders):
            self.store.fsync_dir(folder)
        self.store.fsync_dir(OBJECT_DIR)
        self.store.fsync_dir("")

    def wants(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` raw bytes is shared (its fingerprint is needed before writing)."""
        return self.min_bytes > 0 and nbytes >= self.min_bytes

    def sink(self, fp: str, nbytes: int) -> tuple[ChunkSink, list[dict] | None] | None:
        """Decide for one entry: ``(sink, chunks)`` to reference an object whose chunks are known,
        ``(sink, None)`` to create a new object through ``sink``, or None to keep the entry inline.

        Referenced: only objects a usable generation references, no check found damaged, and whose stored
        bytes pass the reuse check now (every chunk's sha256, :meth:`_sound`; a rotted, truncated, missing
        or replaced one is written again from the state instead, which repairs it for every generation
        that references it). Any other entry is written as a new object; if a file of its name exists it
        is replaced when no manifest references it or it was found damaged, else kept and checked in full
        by the trial reload (the same name promises the same stored bytes). Something that is not a
        regular file where the object belongs (a folder, FIFO, link) is removed and the object written in
        its place."""
        with self._lock:
            made = self._made.get(fp)  # written by this generation (checked in full by its trial reload)
        usable = None if made is not None else self.index.usable.get(fp)
        if usable is not None and (usable[0] in self.distrust or (
                sum(c["raw_bytes"] for c in usable[1]) == nbytes and not self._sound(*usable))):
            usable = None
        known = made or usable
        if known is not None and sum(c["raw_bytes"] for c in known[1]) == nbytes:
            oid, chunks = known
            if made is None:
                self.reused.add(oid)
            return ChunkSink(fp, reused=True), chunks
        if fp in self._open or known is not None:
            return None  # being written by this generation right now: the entry stays in the member file
        hexd = check_fp(fp)
        pending = self.store.new_object(f"{OBJECT_DIR}/{hexd[:2]}", hexd)
        self._open.add(fp)

        def commit(chunks: list[dict]) -> None:
            table = rebase(chunks)
            rebased, stored = table["chunks"], table["stored_bytes"]
            oid = object_id(fp, rebased)
            key = object_key(oid)
            if self.faults is not None:
                self.faults.point("object-write")
            # a file of this name: left by an interrupted pack (no manifest references it) or found damaged
            # -> atomically replaced (the name promises these very stored bytes, so this also repairs the
            # generations that reference it); else kept as it is, and this generation's trial reload
            # checks every byte of it (the lock is held: nothing else writes here)
            replace = oid not in self.index.users or oid in self.distrust
            odd = not_a_file(self.store, key)
            if odd is not None:
                # a folder, FIFO or symbolic link where the object belongs is not the object: it is removed (a
                # link itself, never what it points to) and the object written in its place
                self.store.remove_prefix(key)
                replace = True
            pending.commit(key, sync_dir=False, replace=replace)  # folders fsynced once, by sync()
            with self._lock:
                if odd is not None:
                    self.replaced[oid] = odd
                self._folders.add(key.rsplit("/", 1)[0])
                self._made[fp] = (oid, rebased)
                self._open.discard(fp)
                self.new_stored_bytes += stored
            if self.faults is not None:
                self.faults.point("object-commit")

        def abort() -> None:
            with self._lock:
                self._open.discard(fp)
            pending.abort()

        return ChunkSink(fp, fh=pending.fh, commit=commit, abort=abort), None


def same_chunks(a: list[dict], b: list[dict]) -> bool:
    """Whether two chunk tables of one object list the same chunks: codec, raw and stored size, stored
    sha256 (what decoding depends on, and what the stored bytes are checked against), in order."""
    fields = ("codec", "raw_bytes", "stored_bytes", "stored_sha256")
    return len(a) == len(b) and all(all(x.get(f) == y.get(f) for f in fields) for x, y in zip(a, b))


def not_a_file(store, key: str) -> str | None:
    """What stands at ``key`` when it is neither absent nor a regular file (a folder, FIFO, device or
    symbolic link: the store refuses to read it, :class:`~ckpt_archive.errors.UnsafePath`), else None.
    Only a local store can hold such a thing (an object store holds keys)."""
    from ckpt_archive.errors import UnsafePath

    if store.local_path("") is None:
        return None
    try:
        with store.open_read(key):
            return None
    except UnsafePath as exc:
        return exc.message
    except (NotFound, OSError):
        return None  # absent, or a regular file this process may not read (replaced by a rename anyway)


def check_object(store, oid: str, table: dict, *, pool=None) -> str | None:
    """Hash the stored bytes of shared object ``oid`` now (sha256 of every chunk; nothing decoded).

    Args:
        store: the repository's store. oid: the object's name.
        table: its chunk table as a manifest lists it, rebased to the object (``raw_bytes``,
            ``stored_bytes``, ``chunks`` with ``stored_offset`` from 0 and each chunk's ``stored_sha256``).
        pool: an executor to hash a local file's chunks on in parallel (else one sequential read).

    Returns:
        None when every stored byte matches, else what is wrong, one line: missing; not a regular file (a
        folder, FIFO or symbolic link; never read through); unreadable here; another size; the first chunk
        whose sha256 differs.
    """
    import stat as stat_

    from ckpt_archive.errors import UnsafePath
    from ckpt_archive.format.codec import StoredStream, submit_chunk_checks

    key = object_key(oid)
    try:
        fh = store.open_read(key)
    except NotFound:
        return f"missing: {key} is not in the repository"
    except UnsafePath as exc:
        return f"not a regular file: {exc.message}"
    except OSError as exc:
        return f"cannot be read here: {exc.strerror or exc}"
    with fh:
        try:
            fd = fh.fileno()
            fd = fd if stat_.S_ISREG(os.fstat(fd).st_mode) else None
        except (AttributeError, OSError, ValueError, Exception):
            fd = None
        try:
            size = os.fstat(fd).st_size if fd is not None else store.size(key)
        except (NotFound, OSError):
            return f"missing: {key} is not in the repository"
        want = table["stored_bytes"]
        if size != want:
            return f"{'truncated' if size < want else 'longer than recorded'}: {size} bytes stored, {want} expected"
        if fd is not None and pool is not None:
            futs = submit_chunk_checks(fd, table, member=key, pool=pool)
            if futs is not None and all([fut.result() for _, fut in futs]):
                return None
        check = StoredStream({**table, "path": key}, key)
        try:
            fh.seek(0)
            while piece := fh.read(8 << 20):
                check.update(piece)
        except OSError as exc:
            return f"cannot be read here: {exc.strerror or exc}"
        bad = check.finish()
        return None if bad is None else f"stored bytes do not match: {bad}"


def damaged_objects(store, reader_manifest: dict, oids: Iterable[str]) -> dict[str, str]:
    """Of ``oids`` (objects a manifest references), those whose stored bytes fail :func:`check_object` now
    (missing, not a regular file, another size, a chunk failing its stored sha256), each with what is wrong
    (read only on a failure path: after a trial reload failed).

    Args:
        store: the repository's store. reader_manifest: a manifest referencing the objects (their chunk
            tables). oids: the objects to check.
    """
    want = set(oids)
    tables: dict[str, dict] = {}
    for m in reader_manifest.get("members") or ():
        if m.get("objects"):
            for p in parts(m):
                if p.oid in want:
                    tables[p.oid] = p.record
    bad: dict[str, str] = {}
    for oid, table in sorted(tables.items()):
        try:
            why = check_object(store, oid, table)
        except CkptArchiveError as exc:
            why = exc.message
        if why is not None:
            bad[oid] = why
    return bad


class MemberStream:
    """A format-3 member's stored stream, read from its own file and its shared objects.

    ``read(n)`` reads sequentially; ``pread(n, offset)`` reads one chunk at its offset in the stream
    (only whole chunks: every read the codec makes) when ``positional`` (every part a local file).

    Raises (on open):
        IntegrityError: a part is missing ("missing: objects/..."; names the member).
    """

    def __init__(self, store, gen_key: str, rec: dict):
        self.rec = rec
        self._parts = parts(rec)
        self._files = []
        self._fds: list[int | None] = []
        self._keys = []
        try:
            for p in self._parts:
                key = f"{gen_key}/{rec['stored_path']}" if p.oid is None else object_key(p.oid)
                self._keys.append(key)
                try:
                    fh = store.open_read(key)
                except NotFound:
                    what = rec["stored_path"] if p.oid is None else f"{key} (shared object)"
                    raise IntegrityError(f"missing: {what} is not in the repository", where=rec["path"]) from None
                self._files.append(fh)
                try:
                    fd = fh.fileno()
                    os.fstat(fd)
                except (AttributeError, OSError, ValueError, Exception):
                    fd = None
                self._fds.append(fd)
        except BaseException:
            self.close()
            raise
        self.positional = all(fd is not None for fd in self._fds)
        # stored offset of each chunk in the stream -> (part, offset in that part's file)
        self._where: dict[int, tuple[int, int]] = {}
        chunks = rec.get("chunks") or []
        self._chunk_at = {c["stored_offset"]: i for i, c in enumerate(chunks)}
        for pi, p in enumerate(self._parts):
            for ci, local in zip(p.index, p.record["chunks"]):
                self._where[chunks[ci]["stored_offset"]] = (pi, local["stored_offset"])
        self._segs = sorted((off, chunks[ci]["stored_bytes"], pi, local)
                            for off, (pi, local) in self._where.items()
                            for ci in [self._chunk_at[off]])
        self._starts = [sg[0] for sg in self._segs]
        self._pos = 0

    def size(self) -> int:
        """Bytes actually stored in all parts (equals ``stored_bytes`` when nothing is missing or extra)."""
        total = 0
        for fd, fh in zip(self._fds, self._files):
            if fd is not None:
                total += os.fstat(fd).st_size
            else:
                cur = fh.tell()
                total += fh.seek(0, 2)
                fh.seek(cur)
        return total

    def pread(self, n: int, offset: int) -> bytes:
        pi, local = self._where.get(offset, (None, None))
        if pi is None:
            raise IntegrityError(f"no chunk starts at stored byte {offset}", where=self.rec["path"])
        fd = self._fds[pi]
        return os.pread(fd, n, local)

    def seek(self, pos: int) -> int:
        """Move the sequential read position to stored byte ``pos`` of the stream."""
        self._pos = pos
        return pos

    def read(self, n: int = -1) -> bytes:
        import bisect

        if n is None or n < 0:
            n = self.rec["stored_bytes"] - self._pos
        out = []
        while n > 0 and self._pos < self.rec["stored_bytes"]:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            start, length, pi, local = self._segs[i]
            fh = self._files[pi]
            fh.seek(local + (self._pos - start))
            data = fh.read(min(n, start + length - self._pos))
            if not data:
                break
            out.append(data)
            self._pos += len(data)
            n -= len(data)
        if n > 0 and self._pos >= self.rec["stored_bytes"]:
            # bytes beyond the recorded stream (a longer file): the caller reports "longer than its chunks"
            for fh, p in zip(self._files, self._parts):
                fh.seek(p.stored_bytes)
                extra = fh.read(1)
                if extra:
                    out.append(extra)
                    break
        return b"".join(out)

    def close(self) -> None:
        for fh in self._files:
            with contextlib.suppress(Exception):
                fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclasses.dataclass(frozen=True)
class ProvenRange:
    """In a member's decoded stream (:func:`decode_around`), in place of a proven object's chunks: its raw
    size (bytes), raw fingerprint and name (``ArchiveReader.proven_objects``)."""

    nbytes: int
    fp: str
    oid: str


class StreamWindow:
    """Stored bytes ``[start, start + length)`` of a member's stream (a :class:`MemberStream`), seen as a file
    of their own: positional reads when the stream has them, else sequential reads that stop at its end."""

    def __init__(self, fh, start: int, length: int):
        self._fh, self._start, self._len, self._pos = fh, start, length, 0
        self.positional = bool(getattr(fh, "positional", False))

    def pread(self, n: int, offset: int) -> bytes:
        return self._fh.pread(n, self._start + offset)

    def size(self) -> int:
        return self._len

    def read(self, n: int = -1) -> bytes:
        left = self._len - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        self._pos += len(data)
        return data


def decode_around(fh, rec: dict, proven: frozenset, *, jobs: int, verify_chunks: bool = True,
                  skip_sha: frozenset = frozenset(), written_crc=None):
    """The codec's ``iter_decoded`` over a member's chunks except those of the ``proven`` objects: each run of
    other chunks is decoded as a stream of its own (a :class:`StreamWindow` on the member's stream); each
    proven object yields one ``(raw offset, ProvenRange)`` instead, in stream order (never read).

    Args:
        fh: the member's stream (:func:`open_member`). rec: its manifest record. proven: object names.
        jobs: decoder threads. verify_chunks, skip_sha, written_crc: as ``iter_decoded`` takes them, for
            the whole member (sliced here for each run).

    Raises:
        IntegrityError: the chunk table does not tile the member, its stream has another size, or a chunk
            fails its check or decode (named as ``iter_decoded`` names it, within its run).
    """
    from ckpt_archive.format.codec import iter_decoded
    from ckpt_archive.format.limits import check_chunk_table

    member = rec["path"]
    check_chunk_table(rec, member)
    chunks = rec["chunks"]
    size = fh.size() if hasattr(fh, "size") else None
    if size is not None and size != rec["stored_bytes"]:
        raise IntegrityError(f"stored stream holds {size} bytes, manifest says {rec['stored_bytes']}", where=member)
    at = {p.index[0]: p for p in parts(rec) if p.oid in proven and p.index}
    i, n = 0, len(chunks)
    while i < n:
        p = at.get(i)
        if p is not None:
            yield chunks[i]["raw_offset"], ProvenRange(p.record["raw_bytes"], p.fp, p.oid)
            i = p.index[-1] + 1  # an object's chunks are consecutive in the stream
            continue
        j = i + 1
        while j < n and j not in at:
            j += 1
        run = rebase(chunks[i:j])
        raw0, stored0 = chunks[i]["raw_offset"], chunks[i]["stored_offset"]
        for off, chunk in iter_decoded(StreamWindow(fh, stored0, run["stored_bytes"]), run, member=member, jobs=jobs,
                                       verify_chunks=verify_chunks,
                                       skip_sha=frozenset(k - i for k in skip_sha if i <= k < j),
                                       written_crc=None if written_crc is None else written_crc[i:j]):
            yield raw0 + off, chunk
        i = j


def object_entries(rec: dict) -> dict[str, str]:
    """``{object name (oid): entry key}`` of a format-3 tensors member: the one entry each object holds."""
    base = rec.get("header_bytes", 0)
    start_of = {base + e["data_offsets"][0]: k for k, e in (rec.get("entries") or {}).items()
                if e["data_offsets"][1] > e["data_offsets"][0]}
    out = {}
    for p, o in zip(parts(rec)[1:], rec.get("objects") or ()):
        key = start_of.get(o["raw_offset"])
        if key is not None and p.oid is not None:
            out[p.oid] = key
    return out


def open_member(store, gen_key: str, rec: dict):
    """The member's stored bytes: its own file, or a :class:`MemberStream` over its file and objects.

    Raises:
        NotFound: the member's own file is missing (no objects). IntegrityError: a part is missing.
    """
    if not rec.get("objects"):
        return store.open_read(f"{gen_key}/{rec['stored_path']}")
    return MemberStream(store, gen_key, rec)


@dataclasses.dataclass
class SweepResult:
    """What :func:`sweep` did (or, with ``dry_run``, would do).

    Attributes:
        removed: store keys of the objects deleted (``objects/<hh>/<name>.ckz``), in deletion order.
        freed_bytes: their total size (bytes).
        kept: why no object was deleted at all (a manifest that cannot be read), or None.
        in_use: ``{oid: [generation numbers]}`` of the candidates kept because a remaining generation's
            manifest still references them (only for explicit candidates: ``gc`` does not list them).
    """

    removed: list[str] = dataclasses.field(default_factory=list)
    kept: str | None = None
    freed_bytes: int = 0
    in_use: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: objects (or object folders) left alone because they are not what a repository holds there (a
    #: symbolic link: never deleted through), each with why
    skipped: list[str] = dataclasses.field(default_factory=list)

    def merge(self, other: "SweepResult") -> "SweepResult":
        """This result plus ``other`` (the first ``kept`` reason wins)."""
        in_use = {**self.in_use, **other.in_use}
        return SweepResult(self.removed + other.removed, self.kept or other.kept,
                           self.freed_bytes + other.freed_bytes, in_use, self.skipped + other.skipped)

    def describe(self, dry_run: bool = False) -> str | None:
        """One line for humans, or None when there was nothing to say (no shared object concerned)."""
        if self.kept:
            return self.kept
        parts_ = []
        if self.removed:
            parts_.append(f"{'would free' if dry_run else 'freed'} {len(self.removed)} shared object(s), "
                          f"{self.freed_bytes} bytes")
        if self.skipped:
            parts_.append(f"left {len(self.skipped)} object path(s) alone: {self.skipped[0]}"
                          + (f" (and {len(self.skipped) - 1} more)" if len(self.skipped) > 1 else ""))
        if self.in_use:
            gens = sorted({n for users in self.in_use.values() for n in users})
            parts_.append(f"kept {len(self.in_use)} shared object(s) still referenced by generation(s) "
                          f"{', '.join(map(str, gens))}")
        return "; ".join(parts_) or None

    def to_json(self) -> dict:
        """``{"removed": [keys], "removed_count", "freed_bytes", "kept_reason", "in_use": {fp: [numbers]}}``."""
        return {"removed": list(self.removed), "removed_count": len(self.removed), "freed_bytes": self.freed_bytes,
                "kept_reason": self.kept, "in_use": {fp: list(n) for fp, n in sorted(self.in_use.items())},
                "skipped": list(self.skipped)}


def refs_of(repo, number: int) -> set[str] | None:
    """The names (oids) of the shared objects generation ``number``'s manifest references, or None when
    that is unknown (no manifest, or one that cannot be read: it may have referenced any object)."""
    try:
        g = repo.generation(number)
    except (CkptArchiveError, OSError):  # unknown references are treated as unknown, never guessed
        return None
    if g.manifest is None:
        return None
    return set(manifest_refs(g.manifest))


def all_objects(store, skipped: list[str] | None = None,
                misplaced: list[tuple[str, str]] | None = None) -> tuple[list[str], list[str]]:
    """``(object names (oids), leftover temporary keys)`` stored under ``objects/``. A folder that cannot
    be listed without following a symbolic link is left out (and named in ``skipped`` when given); a file
    named after an object that belongs to another folder is appended to ``misplaced`` as ``(key, oid)``."""
    from ckpt_archive.errors import UnsafePath

    fps, tmps = [], []
    try:
        if not store.exists(OBJECT_DIR):
            return fps, tmps
        folders = store.listdir(OBJECT_DIR)
    except UnsafePath as exc:  # (LinkInRepository is one too)
        if skipped is not None:
            skipped.append(exc.message)
        return fps, tmps
    for folder in folders:
        if not re.fullmatch(r"[0-9a-f]{2}", folder):
            continue
        try:
            names = store.listdir(f"{OBJECT_DIR}/{folder}")
        except UnsafePath as exc:
            if skipped is not None:
                skipped.append(exc.message)
            continue
        for name in names:
            oid = oid_of_name(folder, name)
            if oid is not None:
                fps.append(oid)
            elif _TMP_NAME.match(name):
                tmps.append(f"{OBJECT_DIR}/{folder}/{name}")
            elif misplaced is not None and misplaced_oid(folder, name) is not None:
                misplaced.append((f"{OBJECT_DIR}/{folder}/{name}", misplaced_oid(folder, name)))
    return fps, tmps


def sweep(repo, candidates: Iterable[str] | None = None, *, dry_run: bool = False,
          exclude: Iterable[int] = ()) -> SweepResult:
    """Delete shared objects that no generation's manifest references (the caller holds the lock).

    Run after the generations that referenced them are removed (objects go last: the reverse of the write
    order). Every generation with a manifest counts, whatever its status (usable, partial, copied,
    damaged); a generation being written holds the lock, so none is. If any generation's manifest cannot
    be read, its references are unknown and nothing is deleted (``kept`` says why). Fault point
    ``object-delete`` is reached before each deletion.

    Args:
        repo: the repository. candidates: object names (oids) to consider (those of generations just removed);
            None considers every object in the store (``gc``, or a removed generation whose references
            were unknown).
        dry_run: decide and report only.
        exclude: generation numbers to treat as already removed (a dry run's forecast).

    Returns:
        :class:`SweepResult`.

    Raises:
        OSError, StoreError: a deletion failed; earlier deletions stand (what is left, ``gc`` removes).
    """
    index = ObjectIndex.build(repo, exclude=exclude)
    if index.unreadable:
        n, why = index.unreadable[0]
        return SweepResult([], f"generation {n}'s manifest cannot be read ({why}), so which shared objects it "
                               f"references is unknown: no shared object was deleted (forget or repair "
                               f"generation {n}, then run `ckpt-archive gc {repo.location}`)")
    from ckpt_archive.errors import UnsafePath

    explicit = candidates is not None
    out = SweepResult()
    misplaced: list[tuple[str, str]] = []
    if candidates is None:
        candidates = all_objects(repo.store, out.skipped, misplaced)[0]
        _sweep_misplaced(repo, index, misplaced, out, dry_run)
    for fp in sorted(set(candidates)):
        if fp in index.users:
            if explicit:
                out.in_use[fp] = sorted(index.users[fp])
            continue
        key = object_key(fp)
        try:
            if not repo.store.exists(key):
                continue
            size = repo.store.size(key)
        except NotFound:
            continue
        except UnsafePath as exc:  # a link on the way: never deleted through; the rest is still swept
            out.skipped.append(exc.message)
            continue
        if not dry_run:
            repo.faults.point("object-delete")
            if repo.locked:
                repo.check_lock()  # fencing: a writer that lost its lease deletes nothing
            try:
                repo.store.remove(key)
            except IsADirectoryError:  # a folder where an object belongs: not ours to delete; named, left alone
                out.skipped.append(f"{key} is a folder, not a shared object: left alone")
                continue
        out.removed.append(key)
        out.freed_bytes += size
    return out


def _sweep_misplaced(repo, index: ObjectIndex, misplaced: list[tuple[str, str]], out: SweepResult,
                     dry_run: bool) -> None:
    """[break] Files named after a shared object but lying in another folder (moved there: no reader ever
    looks for them there). One whose object no manifest references is deleted like any unreferenced object
    (by its own key: the object in its right place, if any, is another file); one whose object a generation
    references is left alone and named -- it may be the only copy of that object (put it back in
    ``objects/<oid[:2]>/``)."""
    for key, oid in misplaced:
        if oid in index.users:
            gens = ", ".join(map(str, sorted(index.users[oid])))
            out.skipped.append(f"{key} is shared object {oid[:16]}... outside its folder {OBJECT_DIR}/{oid[:2]}/, "
                               f"and generation(s) {gens} reference that object: left alone (move it back if "
                               f"{object_key(oid)} is missing)")
            continue
        try:
            size = repo.store.size(key)
        except (NotFound, IntegrityError):
            size = 0
        if not dry_run:
            repo.faults.point("object-delete")
            if repo.locked:
                repo.check_lock()  # fencing: a writer that lost its lease deletes nothing
            repo.store.remove(key)
        out.removed.append(key)
        out.freed_bytes += size


def users_of(repo) -> dict[str, list[int]]:
    """``{oid: [generation numbers]}`` of every shared object referenced by a readable manifest."""
    return ObjectIndex.build(repo).users


__all__ = ["ObjectIndex", "SharedWriter", "MemberStream", "open_member", "sweep", "SweepResult", "all_objects",
           "users_of", "manifest_refs", "refs_of", "check_object", "damaged_objects", "not_a_file", "same_chunks",
           "ProvenRange", "StreamWindow", "decode_around", "object_entries"]
