"""Read one archive (one generation's members) with every check on the way.

Every stored chunk's sha256, every member's raw sha256, every tensor's raw sha256, dtype and shape are
checked as the bytes stream by (docs/FORMAT.md, "Write order" steps 4 and 5); nothing wrong is ever
returned. :func:`ckpt_archive.repo.trial_reload.trial_reload` is the full check of a whole generation.

Over 600 lines: the shallow check (``check_stored`` and its per-file helpers) and the decoding reads share
``ArchiveReader``'s state; splitting the class would spread one reader over two modules.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from ckpt_archive.errors import (CkptArchiveError, FormatError, IntegrityError, NotFound, UnsafePath, UsageError,
                                 first_line)
from ckpt_archive.format import fingerprint, jsonio
from ckpt_archive.format.codec import StoredStream, fileno_of, default_jobs, iter_decoded, submit_chunk_checks
from ckpt_archive.format.objects import parts, stored_files
from ckpt_archive.repo.objects import ProvenRange, decode_around, object_entries, open_member
from ckpt_archive.format.leaf_checks import SizeOnly, check_leaf_bytes, check_tree_kinds
from ckpt_archive.format import limits as _limits
from ckpt_archive.format.limits import check_allocation, check_whole_read, frame_size_problem
from ckpt_archive.format.shard import check_header as _check_header
from ckpt_archive.repo.chunk_hashers import ChunkHashers
from ckpt_archive.repo.entries import EntryCutter
from ckpt_archive.format.leaves import entry_tensor, fp_words, leaf_from_base
from ckpt_archive.format.state_tree import decode
from ckpt_archive.format.tree_paths import check_only, subtree  # noqa: F401 - part selection, named here too


#: stored files whose chunk checks are in flight at once during a shallow check (bounds open files)
FILES_IN_FLIGHT = 16


@dataclasses.dataclass
class Problem:
    """One thing found wrong. ``member`` (archive member path) and/or ``field`` (manifest field) say where."""

    reason: str
    member: str | None = None
    field: str | None = None
    #: True when what failed is this machine or this reader, not the generation (a buffer larger than its
    #: memory: :class:`~ckpt_archive.errors.TooLargeHere`; a signer not among this reader's ``--trust``
    #: keys): reported, but never recorded as a failed check.
    local: bool = False

    def to_json(self) -> dict:
        return {"member": self.member, "field": self.field, "reason": self.reason}

    @classmethod
    def of(cls, exc: CkptArchiveError, *, member: str | None = None, field: str | None = None) -> "Problem":
        """The problem an error of the tool names (``exc.where`` when it names a place, else ``member``)."""
        from ckpt_archive.errors import TooLargeHere

        return cls(exc.message, member=exc.where or member, field=field, local=isinstance(exc, TooLargeHere))



class ArchiveReader:
    """Read one generation's members with every check on the way.

    Args:
        store: the repository's store.
        gen_key: the generation folder key.
        manifest: the parsed, schema-valid manifest.
        jobs: decoder threads.
    """

    def __init__(self, store, gen_key: str, manifest: dict, *, jobs: int | None = None):
        self.store = store
        self.gen_key = gen_key
        self.manifest = manifest
        self.jobs = jobs or default_jobs()
        self.by_path = {m["path"]: m for m in manifest["members"]}
        #: Shared objects (names) this generation references whose stored bytes pack hashed in this
        #: operation (every chunk's sha256 matched), under a chunk table that a usable generation's trial
        #: reload proved decodes to the object's raw fingerprint (docs/FORMAT.md, "Write order", step 5;
        #: :meth:`ckpt_archive.repo.objects.SharedWriter.proven`). The trial reload does not decode them
        #: again where it needs only their fingerprint (``iter_entries(skip_objects=...)``: an entry no view
        #: reads); elsewhere they are decoded without hashing their stored bytes a second time. Set by pack;
        #: empty otherwise (verify, export, adopt, load: everything decoded and hashed).
        self.proven_objects: frozenset[str] = frozenset()
        #: [issue 14: each role hashed once] Set by pack for the generation it has just written: member
        #: path -> the CRC-32 of each chunk's stored bytes as this process handed them to the store (None
        #: for a chunk it did not write: a reference to an existing shared object). The manifest's stored
        #: sha256 were taken from those very bytes, so a read that also checks the raw fingerprint of every
        #: byte it decodes (the trial reload) compares each such chunk read back with its CRC-32 (0.09 ns
        #: per byte) instead of hashing it a second time (0.5-0.9). The CRC covers the bytes decoding reads
        #: past (a zstd frame header's window descriptor and unused bit): usable still means the stored
        #: bytes are the manifest's. ``verify``, export's check at its destination and adopt hash every
        #: stored chunk (bytes someone else wrote).
        self.written_crc: dict[str, list] = {}
        #: [issue 24: one status rule] store keys of the stored files (member files and shared objects) whose
        #: every chunk's stored sha256 a completed read of this reader checked: :meth:`check_unread` checks
        #: the others, so a reader that used only part of a generation still vouches for all of it.
        self.verified_keys: set[str] = set()
        self._tree: Any = None  # the parsed state tree, once read (:meth:`tree`)
        self._parts: dict[str, tuple] = {}  # member path -> (its record, parts(record)): entry_pieces' files

    def key(self, rec: dict) -> str:
        return f"{self.gen_key}/{rec['stored_path']}"

    # -- shallow -----------------------------------------------------------------------------------
    def check_stored(self, problems: list[Problem], on_bytes=None, *, hash_files: bool = True,
                     skip: set[str] | frozenset = frozenset()) -> None:
        """Sizes and whole-file stored sha256 of every member (reads stored bytes, decodes nothing).

        ``hash_files=False`` checks sizes only: for callers that run :meth:`trial_reload` next, whose
        single read checks every chunk's stored sha256 (which implies the whole file's).
        ``skip``: store keys of stored files not to check (already checked by this reader).
        [codec/benchmarks helper: verify and trial reload share one read in pack]
        """
        files: list[tuple[dict, str]] = []
        seen: set[str] = set()
        for member in self.manifest["members"]:
            for key, fp, rec in stored_files(member, self.gen_key):
                if key in skip:
                    continue
                if fp is not None:
                    if fp in seen:
                        continue  # one object referenced twice by this generation is checked once
                    seen.add(fp)
                files.append((rec, key))
        if not hash_files:
            for rec, key in files:
                self._check_size(rec, key, problems)
            return
        # [issue 14] one pool for every file, the next files' chunks submitted before this one's are
        # collected: a generation of many one-chunk files (shared objects) keeps every core hashing.
        # Problems are still reported in file order.
        window: collections.deque = collections.deque()
        with ThreadPoolExecutor(self.jobs or default_jobs(), thread_name_prefix="ckpt-verify") as pool:
            try:
                for rec, key in files:
                    window.append(self._start_file(rec, key, pool))
                    while len(window) > FILES_IN_FLIGHT:
                        self._finish_file(window.popleft(), problems, on_bytes)
                while window:
                    self._finish_file(window.popleft(), problems, on_bytes)
            finally:
                for item in window:  # an error on the way: close what is still open
                    if item["fh_cm"] is not None:
                        item["fh_cm"].__exit__(None, None, None)

    def check_unread(self, problems: list[Problem]) -> None:
        """[issue 24: one status rule] What a shallow ``verify`` checks -- every stored file's size and every
        chunk's stored sha256 -- for the stored files this reader has not checked while decoding
        (:attr:`verified_keys`): a generation with one damaged member is damaged for every reader, whether
        or not it reads that member (``restore`` of a ``.pt`` kept as exact bytes never decodes the tree;
        ``load(only="model")`` never decodes the optimizer's shard)."""
        self.check_stored(problems, skip=frozenset(self.verified_keys))

    def _check_size(self, rec: dict, key: str, problems: list[Problem]) -> bool:
        """The stored file exists and has the recorded size (a problem is added when not)."""
        try:
            size = self.store.size(key)
        except NotFound:
            problems.append(Problem(f"missing: {rec['stored_path']} is not in the generation"
                                    if not key.startswith("objects/") else
                                    f"missing: shared object {key} is not in the repository", member=rec["path"]))
            return False
        except UnsafePath as exc:  # a symbolic link where the file must be: never read through it
            problems.append(Problem(f"not a file of this repository: {exc.message}", member=rec["path"]))
            return False
        if size != rec["stored_bytes"]:
            kind = "truncated" if size < rec["stored_bytes"] else "longer than recorded"
            problems.append(Problem(f"{kind}: {size} bytes stored, manifest says {rec['stored_bytes']}",
                                    member=rec["path"]))
            return False
        return True

    def _start_file(self, rec: dict, key: str, pool: ThreadPoolExecutor) -> dict:
        """Size check of one stored file, then its chunk checks submitted to ``pool`` (local files)."""
        item: dict = {"rec": rec, "key": key, "problems": [], "fh_cm": None, "fh": None, "futs": None,
                      "sized": False}
        if not self._check_size(rec, key, item["problems"]):
            return item
        try:
            cm = self.store.open_read(key)
            fh = cm.__enter__()
        except PermissionError as exc:  # there, but this process may not read it: reported, never skipped
            item["problems"].append(Problem(f"cannot be read here: {exc.strerror}", member=rec["path"], local=True))
            return item
        except UnsafePath as exc:  # a folder, a FIFO, a device where the file must be: never read
            item["problems"].append(Problem(f"not a file of this repository: {exc.message}", member=rec["path"]))
            return item
        except IntegrityError as exc:  # an encrypted file whose header or size fails its check
            item["problems"].append(Problem(exc.message, member=rec["path"]))
            return item
        item["sized"] = True
        item["fh_cm"], item["fh"] = cm, fh
        fd = fileno_of(fh)
        if fd is not None:
            item["futs"] = submit_chunk_checks(fd, rec, member=rec["path"], pool=pool) or False
        return item

    def _finish_file(self, item: dict, problems: list[Problem], on_bytes) -> None:
        """Collect one file's chunk checks (in order), then the slow paths that name what is wrong."""
        problems.extend(item["problems"])
        if not item["sized"]:
            return
        rec, key, fh = item["rec"], item["key"], item["fh"]
        try:
            futs = item["futs"]
            if futs is None:  # not a local file: no parallel positional reads
                fast = None
            elif futs is False:
                fast = False
            else:
                fast = True
                for n, fut in futs:
                    fast = fut.result() and fast
                    if on_bytes:
                        on_bytes(n)
            # [issue 17] sizes that cannot be true, from frame headers only (no body decoded)
            lie = frame_size_problem(fh, rec) if fast else None
        finally:
            cm, item["fh_cm"] = item["fh_cm"], None
            cm.__exit__(None, None, None)
        self._describe_file(rec, key, problems, on_bytes, fast, lie)

    def _describe_file(self, rec: dict, key: str, problems: list[Problem], on_bytes, fast, lie) -> None:
        """After the fast check of one stored file: nothing when it passed, else re-read it to name the fault."""
        if lie:
            problems.append(Problem(lie, member=rec["path"]))
            return
        if fast:
            return
        try:
            self._rehash_file(rec, key, problems, on_bytes, fast)
        except IntegrityError as exc:  # a store that authenticates (encrypted) names the damage itself
            problems.append(Problem(exc.message, member=rec["path"]))

    def _rehash_file(self, rec: dict, key: str, problems: list[Problem], on_bytes, fast) -> None:
        if "stored_fp" in rec:  # format 2: the chunks are the fingerprint; name the first bad one
            check = StoredStream(rec, rec["path"])
            with self.store.open_read(key) as fh:
                while piece := fh.read(8 << 20):
                    check.update(piece)
                    if on_bytes:
                        on_bytes(len(piece))
            bad = check.finish()
            if bad is not None:
                problems.append(Problem(f"stored bytes do not match: {bad}", member=rec["path"]))
            return
        h = hashlib.sha256()
        with self.store.open_read(key) as fh:
            while True:
                piece = fh.read(8 << 20)
                if not piece:
                    break
                h.update(piece)
                if on_bytes:
                    on_bytes(len(piece))
        got = h.hexdigest()
        if got != rec["stored_sha256"]:
            problems.append(Problem(f"stored sha256 mismatch: expected {rec['stored_sha256']}, got {got}"
                                    + _locate_bad_chunk(self.store, key, rec), member=rec["path"]))
        elif fast is False:
            problems.append(Problem("the file matches its sha256 but not its chunk table"
                                    + _locate_bad_chunk(self.store, key, rec), member=rec["path"]))

    # -- decoding ----------------------------------------------------------------------------------
    def iter_member(self, rec: dict, *, check_whole: bool = True, on_bytes=None,
                    verify_chunks: bool = True, into=None,
                    skip_objects: frozenset = frozenset(), tap=None) -> Iterator[tuple[int, bytes]]:
        """Decoded chunks of a member; checks chunk and whole-member sha256 (stored and raw).

        Chunks are bytes-like (``bytes`` or ``memoryview``); the consumer must not modify them.
        ``check_whole=False, verify_chunks=False``: no hashing at all -- only for a caller that
        hashes every byte it uses against the manifest (``load_node``'s per-tensor check).
        ``skip_objects``: shared objects among :attr:`proven_objects` not to read or decode at all: each
        yields one :class:`ProvenRange` (its raw offset, size and fingerprint) in place of its chunks, and
        the member's raw check takes that fingerprint for its entry (format 2 tensors members with the
        raw check on only; otherwise everything is decoded).
        ``tap``: called ``tap(raw offset, chunk)`` with every decoded chunk, in order, on a thread of its own
        (beside the raw fingerprint's: ``verify --deep`` takes an exact-bytes file's sha256 there,
        :mod:`ckpt_archive.repo.exact_stream`); it must not raise, and must not keep the chunk past its call
        unless it copies it. Proven shared objects (never decoded) are not given to it.
        """
        # The member's stored fingerprint is not recomputed here: iter_decoded checks every chunk's
        # stored sha256 and that the chunk table tiles the file (and derives format 2's), which implies
        # it. The raw fingerprint (whole, or per entry for a format-2 tensors member: each byte hashed
        # once) runs on its own thread so the consumer's thread stays free.
        raw_check = fingerprint.MemberRawCheck(rec) if check_whole else None
        total = 0
        try:
            fh = open_member(self.store, self.gen_key, rec)  # format 3: through its shared objects
        except NotFound:
            raise IntegrityError(f"missing: {rec['stored_path']} is not in the generation", where=rec["path"]) from None
        hashers = ChunkHashers(raw_check, tap, 2 * self.jobs)
        try:
            with fh:
                chunks, skip, crcs = self._decoded_chunks(fh, rec, raw_check, verify_chunks, into, skip_objects)
                for off, chunk in chunks:
                    if isinstance(chunk, ProvenRange):
                        hashers.skip(chunk, rec["path"])
                        if on_bytes:
                            on_bytes(chunk.nbytes)
                        yield off, chunk
                        continue
                    hashers.submit(off, chunk)
                    total += len(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
                    yield off, chunk
            hashers.drain()
        finally:
            hashers.shutdown()
        if raw_check is not None:
            bad = raw_check.problem()
            if bad is not None:
                raise IntegrityError(bad, where=rec["path"])
        if verify_chunks and not skip and crcs is None:  # every chunk's stored sha256 was checked here
            self.verified_keys.update(key for key, _, _ in stored_files(rec, self.gen_key))

    def _decoded_chunks(self, fh, rec: dict, raw_check, verify_chunks: bool, into, skip_objects):
        """:meth:`iter_member`'s decoder over ``fh``: around the proven shared objects it may skip, else every
        chunk (:func:`~ckpt_archive.format.codec.iter_decoded`).

        Returns:
            ``(chunks, skip, crcs)``: the iterator of ``(raw offset, chunk or ProvenRange)``; the chunks whose
            stored sha256 is not taken (proven objects, raw-checked here); the CRC-32s of the bytes this
            process wrote, compared instead of the sha256 (None when not known).
        """
        skip = frozenset()  # chunks decoded and raw-checked here, whose stored sha256 is not taken
        crcs = None         # chunks compared with the CRC-32 of the bytes pack wrote instead
        if raw_check is not None:
            written = self.written_crc.get(rec["path"])
            if written is not None and len(written) == len(rec["chunks"]):
                crcs = written
            if self.proven_objects and rec.get("objects"):
                skip = frozenset(i for p in parts(rec) if p.oid in self.proven_objects for i in p.index)
        proven = (frozenset(skip_objects) & self.proven_objects if raw_check is not None and into is None
                  and raw_check.alg == fingerprint.BLAKE3_ENTRIES and rec.get("objects") else frozenset())
        if proven:
            chunks = decode_around(fh, rec, proven, jobs=self.jobs, verify_chunks=verify_chunks,
                                   skip_sha=skip, written_crc=crcs)
        else:
            chunks = iter_decoded(fh, rec, member=rec["path"], jobs=self.jobs, verify_chunks=verify_chunks,
                                  into=into, skip_sha=skip, written_crc=crcs)
        return chunks, skip, crcs

    def read_member_bytes(self, path: str, *, limit: int) -> bytearray:
        """The whole raw bytes of a member a reader holds in memory (the state tree, the data ids), every
        chunk's stored sha256 and the member's raw fingerprint checked.

        Bounded before anything is read (docs/FORMAT.md, "Reading hostile archives"): the member's declared
        raw and stored sizes, in total and summed over its chunks, must fit ``limit``
        (:func:`~ckpt_archive.format.limits.check_whole_read`); the chunks are then decoded into one buffer
        of exactly the declared size (never joined), and the read stops at the first byte beyond it.

        Args:
            path: the member's path. limit: the most raw bytes held (e.g. ``limits.MAX_TREE_BYTES``).

        Returns:
            the raw bytes (a ``bytearray`` of the member's ``raw_bytes``).

        Raises:
            FormatError: the manifest lists no such member.
            ImplausibleSize: (exit 1) larger than ``limit``; names the member and the limit.
            IntegrityError: (exit 1) a chunk or the raw fingerprint fails.
        """
        rec = self.by_path.get(path)
        if rec is None:
            raise FormatError(f"manifest lists no member {path!r}", where="manifest.json")
        check_whole_read(rec, path, limit)
        buf = bytearray(rec["raw_bytes"])
        got = 0
        for _, chunk in self.iter_member(rec, into=buf if rec["raw_bytes"] else None):
            got += len(chunk)
            if got > len(buf):  # cannot happen with a tiling chunk table: checked on the real bytes anyway
                raise IntegrityError(f"decodes to more than its {len(buf)} raw bytes", where=path)
        return buf

    def iter_entries(self, rec: dict, *, wanted: set[str] | None = None, on_bytes=None,
                     checked_by_caller: bool = False, verify_stored: bool | None = None, into=None,
                     transient: bool = False, sizes_only: set[str] | frozenset = frozenset(),
                     skip_objects: frozenset = frozenset(), tap=None) -> Iterator[tuple[str, dict, Any]]:
        """Yield ``(entry key, entry record, raw bytes)`` of a tensors shard, one tensor at a time.

        Checks the shard's safetensors header against the manifest. With ``wanted``, other entries
        are skipped (their bytes are still read and checked: chunks are hashed as wholes). The raw
        bytes are writable and bytes-like: a zero-copy view of the decoded chunk when the entry lies
        in one writable chunk, else one preallocated ``bytearray`` (no growth by appending).
        ``verify_stored``: check every chunk's stored sha256 (default: unless ``checked_by_caller``); a reader
        that vouches for the whole generation afterwards (``load``) checks them in this one read rather than
        in a second one (:meth:`check_unread` skips the files checked here).
        ``checked_by_caller``: skip the chunk and member hashes because the caller checks the raw
        sha256 of every entry it receives (and receives every entry it returns data from).
        ``into``: a writable buffer of the member's raw size; chunks are decoded straight into it and
        every entry is a view of it (no copy at all; for loading a whole member into memory).
        ``tap``: given every decoded chunk on a thread of its own (:meth:`iter_member`; not with ``into``).
        ``sizes_only``: entry keys whose bytes the caller does not need (it checks only their length; the
        raw fingerprint is still checked on the way by the member's raw check): an entry spanning chunks
        is then not assembled and a :class:`SizeOnly` is yielded in place of its bytes.
        ``transient``: the caller drops each entry's bytes before asking for the next (trial reload),
        so entries spanning chunks are assembled in one reused buffer (no fresh pages per tensor).
        ``skip_objects``: shared objects among :attr:`proven_objects` whose entry is in ``sizes_only``
        are not read or decoded at all (:meth:`iter_member`); their entry comes as a
        :class:`~ckpt_archive.repo.entries.ProvenSize`.
        [codec/benchmarks helper: rewritten for zero copies; same checks and order]
        """
        verify = not checked_by_caller if verify_stored is None else verify_stored
        order = sorted(rec["entries"].items(), key=lambda kv: kv[1]["data_offsets"][0])
        if into is not None:
            if tap is not None:
                raise ValueError("iter_entries: tap is not taken with into")
            yield from self._entries_into(rec, order, wanted, on_bytes, checked_by_caller, verify, into)
            return
        skip = frozenset()
        if skip_objects and not checked_by_caller and rec.get("objects"):
            skip = frozenset(oid for oid, key in object_entries(rec).items()
                             if oid in skip_objects and key in sizes_only)
        cutter = EntryCutter(rec, order, wanted, sizes_only, transient)
        for off, chunk in self.iter_member(rec, on_bytes=on_bytes, check_whole=not checked_by_caller,
                                           verify_chunks=verify, skip_objects=skip, tap=tap):
            if isinstance(chunk, ProvenRange):
                yield from cutter.proven(off, chunk)
            else:
                yield from cutter.feed(chunk)
        yield from cutter.finish()

    def _entries_into(self, rec: dict, order: list, wanted, on_bytes, checked_by_caller: bool, verify: bool,
                      into) -> Iterator[tuple[str, dict, Any]]:
        """:meth:`iter_entries` with ``into``: chunks decoded straight into it, every entry a view of it."""
        entries, base = rec["entries"], rec["header_bytes"]
        idx = 0
        whole = memoryview(into).cast("B")
        header_checked = base == 0
        for off, chunk in self.iter_member(rec, on_bytes=on_bytes, check_whole=not checked_by_caller,
                                           verify_chunks=verify, into=into):
            frontier = off + len(chunk)
            if not header_checked:
                if frontier < base:
                    continue
                _check_header(bytes(whole[:base]), entries, rec["path"])
                header_checked = True
            while idx < len(order) and base + order[idx][1]["data_offsets"][1] <= frontier:
                k, e = order[idx]
                idx += 1
                if wanted is None or k in wanted:
                    start, end = e["data_offsets"]
                    yield k, e, (whole[base + start:base + end] if end > start else bytearray())
        if not header_checked:
            raise IntegrityError("shard ends inside its safetensors header", where=rec["path"])
        if idx != len(order):
            raise IntegrityError(f"shard ends before entry {order[idx][0]}", where=rec["path"])

    def entry_pieces(self, rec: dict, key: str, *, on_bytes=None) -> Iterator[memoryview]:
        """The raw bytes of one entry of a tensors member, in order, decoded from only the chunks that hold
        them, where they live (the member's file or its shared object), on the decoder pool with every chunk's
        stored sha256 checked first (:func:`~ckpt_archive.format.codec.iter_decoded` over that window of the
        file); the entry's raw fingerprint is checked once its last byte is out. Memory: the decoder's
        in-flight bound. For reading entries out of their data order (a source file's exact bytes rebuilt in
        file order, :func:`ckpt_archive.repo.trial_reload.rebuilt_sha256`).

        Raises:
            IntegrityError: a chunk is short, fails its sha256 or does not decode; the entry's fingerprint
                differs (names the member and the entry).
        """
        from ckpt_archive.format.objects import object_key

        e = rec["entries"][key]
        base = rec["header_bytes"]
        lo, hi = base + e["data_offsets"][0], base + e["data_offsets"][1]
        want = fingerprint.raw_fp(e)
        alg = fingerprint.split(want)[0] if want else None
        h = fingerprint.new(alg) if alg else None
        chunks = rec["chunks"]
        for part in self._parts_of(rec) if hi > lo else ():
            local = [(i, c) for i, c in zip(part.index, part.record["chunks"])
                     if chunks[i]["raw_offset"] < hi and chunks[i]["raw_offset"] + chunks[i]["raw_bytes"] > lo]
            if not local:
                continue
            first = local[0][1]
            window = {"raw_bytes": sum(c["raw_bytes"] for _, c in local),
                      "stored_bytes": sum(c["stored_bytes"] for _, c in local), "chunks": []}
            raw_at = {}
            for i, c in local:  # the entry's chunks, rebased to a file of their own
                raw_at[c["raw_offset"] - first["raw_offset"]] = chunks[i]["raw_offset"]
                window["chunks"].append({**c, "raw_offset": c["raw_offset"] - first["raw_offset"],
                                         "stored_offset": c["stored_offset"] - first["stored_offset"]})
            part_key = self.key(rec) if part.oid is None else object_key(part.oid)
            with self.store.open_read(part_key) as fh:
                view = _Window(fh, first["stored_offset"], window["stored_bytes"])
                for off, chunk in iter_decoded(view, window, member=rec["path"], jobs=self.jobs):
                    start = raw_at[off]
                    mv = memoryview(chunk).cast("B")
                    piece = mv[max(lo - start, 0):max(min(hi - start, len(mv)), 0)]
                    if h is not None:
                        h.update(piece)
                    if on_bytes:
                        on_bytes(len(piece))
                    yield piece
        if h is not None and f"{alg}:{h.hexdigest()}" != want:
            raise IntegrityError(f"tensor bytes fingerprint mismatch: expected {want}, got {alg}:{h.hexdigest()}",
                                 where=f"{rec['path']}:{key}")

    def _parts_of(self, rec: dict) -> list:
        """``parts(rec)``, worked out once per member (a member of many shared objects costs milliseconds each
        time; a rebuild reading each segment's entry asks once per entry)."""
        cached = self._parts.get(rec["path"])
        if cached is None or cached[0] is not rec:
            cached = self._parts[rec["path"]] = (rec, parts(rec))
        return cached[1]

    def iter_entry_pieces(self, rec: dict, *, wanted: set[str], on_bytes=None, checked_by_caller: bool = False,
                          verify_stored: bool | None = None
                          ) -> Iterator[tuple[str, dict, int, Any]]:
        """[issue 29] Yield ``(entry key, entry record, offset in the entry, piece)`` for the ``wanted``
        entries of a tensors shard, one decoded chunk's part at a time: nothing larger than a chunk is held,
        whatever the entry's size (a 40 GiB optimizer moment restores in the chunk pipeline's memory).

        Every chunk's stored sha256 and every entry's raw fingerprint (the member's raw check) are checked
        on the way, the header against the manifest first; the raw check's verdict comes when the member
        ends. So a caller that writes pieces as they come must not treat what it wrote as good before this
        iterator is exhausted (restore writes a temporary file, removed on any error). Pieces are read-only
        bytes-like views of decoded chunks (each chunk its own buffer, never reused).
        ``checked_by_caller``: neither the chunks' stored sha256 nor the entries' raw fingerprints are taken
        here -- only for a caller that checks every byte it receives end to end itself (an exact-bytes
        restore checks the whole rebuilt file's sha256 against the source's). ``verify_stored``: check every
        chunk's stored sha256 all the same (default: unless ``checked_by_caller``), as :meth:`iter_entries`
        does: a reader that vouches for the whole generation afterwards then checks them in this one read, not
        in a second one (:meth:`check_unread` skips the files checked here).

        Raises:
            IntegrityError: a chunk, the header or an entry fails its check; names the member.
        """
        entries = rec["entries"]
        base = rec["header_bytes"]
        order = [(k, e) for k, e in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]) if k in wanted]
        header = bytearray()
        i = 0
        verify = not checked_by_caller if verify_stored is None else verify_stored
        for off, chunk in self.iter_member(rec, on_bytes=on_bytes, check_whole=not checked_by_caller,
                                           verify_chunks=verify):
            mv = memoryview(chunk).cast("B")
            end = off + len(mv)
            if len(header) < base:
                header += mv[:base - off] if off < base else b""
                if len(header) >= base:
                    _check_header(bytes(header[:base]), entries, rec["path"])
            while i < len(order):
                key, e = order[i]
                start, stop = base + e["data_offsets"][0], base + e["data_offsets"][1]
                if start >= end:
                    break
                lo, hi = max(start, off), min(stop, end)
                if hi > lo:
                    yield key, e, lo - start, mv[lo - off:hi - off]
                if stop > end:
                    break
                i += 1
        if len(header) < base:
            raise IntegrityError("shard ends inside its safetensors header", where=rec["path"])
        while i < len(order) and order[i][1]["data_offsets"][1] == order[i][1]["data_offsets"][0]:
            i += 1  # empty entries at the very end: nothing to yield
        if i != len(order):
            raise IntegrityError(f"shard ends before entry {order[i][0]}", where=rec["path"])

    def _spilled_entries(self, rec: dict, wanted: set, spill_dir, on_bytes=None
                         ) -> Iterator[tuple[str, dict, memoryview]]:
        """Like :meth:`iter_entries` (``wanted`` only) but over a spilled, memory-mapped member."""
        mm = _spill_member(self, rec, spill_dir, on_bytes)
        view = memoryview(mm)
        base = rec["header_bytes"]
        _check_header(bytes(view[:base]), rec["entries"], rec["path"])
        for k, e in sorted(rec["entries"].items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if k in wanted:
                start, end = e["data_offsets"]
                yield k, e, view[base + start:base + end]

    def tree(self) -> Any:
        """The parsed state tree (its member read whole, bounded: :data:`~ckpt_archive.format.limits.MAX_TREE_BYTES`
        raw bytes, :data:`~ckpt_archive.format.limits.MAX_TREE_COST` of parse). Read once per reader: later
        calls return the same object, which callers must not modify.

        Raises:
            ImplausibleSize: (exit 1) the tree member declares more than the limit (nothing read).
            IntegrityError: (exit 1) a chunk or fingerprint fails; not strict JSON; too costly to parse.
        """
        if self._tree is not None:
            return self._tree
        # the limits as format/limits.py holds them now: pack refuses by the same ones (limits.tree_read_problem)
        max_bytes, max_cost = _limits.MAX_TREE_BYTES, _limits.MAX_TREE_COST
        data = self.read_member_bytes(self.manifest["tree_member"], limit=max_bytes)
        try:  # the one strict reader: depth, duplicate keys, non-finite numbers, size, cost (format/jsonio.py)
            self._tree = jsonio.loads(data, where=self.manifest["tree_member"], max_bytes=max_bytes,
                                      max_cost=max_cost)
        except ValueError as exc:
            raise IntegrityError(f"state tree is not valid JSON ({getattr(exc, 'message', exc)})",
                                 where=self.manifest["tree_member"]) from None
        return self._tree

    # -- load ------------------------------------------------------------------------------------------
    def load(self, only: str | None = None, *, map_location=None, on_bytes=None, spill_dir=None) -> Any:
        """Rebuild the nested state (or the sub-tree at ``only``, a ``/``-separated path).

        Raises:
            IntegrityError: a member fails a check on the way (nothing wrong is ever returned).
            NotFound: ``only`` names no part of the state.
        """
        tree = self.tree()
        if only is not None:
            tree = subtree(tree, only)
        return self.load_node(tree, map_location=map_location, on_bytes=on_bytes, spill_dir=spill_dir)

    def load_node(self, tree: Any, *, map_location=None, on_bytes=None, spill_dir=None) -> Any:
        """Rebuild an encoded (sub-)tree, decoding only the tensors it references.

        ``spill_dir``: a folder on a real disk. Each tensors member is then decoded into a file there
        (unlinked as soon as it is mapped) and tensors are built over a private memory map of it, so
        their bytes are file pages the kernel can drop, not anonymous memory: ``restore`` of a state
        larger than RAM stays within the chunk pipeline's memory. Needs free space for the raw bytes.
        [codec/benchmarks helper]
        """
        wanted_leaves = set(tensor_refs(tree))
        tensors = self.manifest["tensors"]
        check_tree_kinds(tree, tensors)
        wanted_entries: dict[str, set] = {}
        for leaf in wanted_leaves:
            lrec = tensors.get(leaf)
            if lrec is None:
                raise IntegrityError(f"state tree references tensor {leaf!r}, not in the manifest",
                                     where=self.manifest["tree_member"])
            wanted_entries.setdefault(lrec["member"], set()).add(lrec["entry"])
        built: dict[str, Any] = {}
        bases: dict[str, Any] = {}
        by_entry: dict[str, list[str]] = {}
        for leaf in wanted_leaves:
            by_entry.setdefault(tensors[leaf]["entry"], []).append(leaf)
        checks: list = []
        hash_pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="ckpt-loadhash")
        try:
            built = self._build(wanted_entries, by_entry, tensors, built, bases, checks, hash_pool,
                                map_location, on_bytes, spill_dir)
            for path, key, erec, fut in checks:
                got = fut.result()
                if got != fingerprint.raw_fp(erec):
                    raise IntegrityError(f"tensor bytes {fp_words(got)} mismatch: expected {fingerprint.raw_fp(erec)}, "
                                         f"got {got} (`ckpt-archive verify` names damaged chunks)",
                                         where=f"{path}:{key}")
        finally:
            hash_pool.shutdown(wait=True, cancel_futures=True)
        return decode(tree, built.__getitem__, where=self.manifest["tree_member"])

    def _build(self, wanted_entries, by_entry, tensors, built, bases, checks, hash_pool, map_location,
               on_bytes, spill_dir) -> dict:
        for path, entries in wanted_entries.items():
            rec = self.by_path[path]
            # [codec/benchmarks helper] In memory, every returned tensor's bytes are hashed against
            # the manifest on a thread pool (parallel, unlike one member hash), and nothing else is:
            # a damaged byte anywhere in a returned tensor still fails the load, before it returns.
            # Spilled members are checked whole (chunks and member raw sha256) while spilling.
            # A member wanted whole is decoded straight into one buffer that its tensors then view.
            if spill_dir is not None:
                source = self._spilled_entries(rec, entries, spill_dir, on_bytes)
            else:
                into = None
                if set(rec["entries"]) <= entries:
                    from ckpt_archive.format.planes import anon_buffer

                    check_allocation(rec["raw_bytes"], rec["path"])  # pages taken as decoded, 4 KiB ones
                    into = anon_buffer(rec["raw_bytes"])
                source = self.iter_entries(rec, wanted=entries, on_bytes=on_bytes, checked_by_caller=True,
                                           verify_stored=True,  # [issue 24] the stored check, in this read
                                           into=into)
            for key, erec, buf in source:
                entry_fp = fingerprint.raw_fp(erec)
                if spill_dir is None:
                    checks.append((path, key, erec, hash_pool.submit(fingerprint.digest_like, buf, entry_fp)))
                for leaf in by_entry[key]:
                    lrec = tensors[leaf]
                    # the trial reload's checks of each leaf against its entry (dtype, shape, a view's
                    # bounds and own bytes): what is returned is what the trial reload proved; the
                    # entry's bytes themselves are checked against entry_fp by the hash pool
                    check_leaf_bytes(buf, erec, lrec, leaf, entry_fp)
                    try:
                        if key not in bases:
                            bases[key] = entry_tensor(buf, erec, lrec)
                        t = leaf_from_base(bases[key], lrec)
                    except (RuntimeError, ValueError, TypeError) as exc:  # torch refuses what the record says
                        raise IntegrityError(f"cannot be built as its manifest record says: "
                                             f"{first_line(exc, 200)}", where=leaf) from None
                    if map_location is not None and lrec["kind"] == "torch":
                        t = t.to(map_location)
                    built[leaf] = t
        return built



class _Window:
    """A contiguous range ``[base, base + length)`` of an open stored file, read as a file of its own:
    positional reads on the decoder pool when the file is local (``pread``/``size``, as
    :func:`~ckpt_archive.format.codec.iter_decoded` takes them), else sequential reads from ``base``."""

    def __init__(self, fh, base: int, length: int):
        self.fh, self.base, self.length, self._pos = fh, base, length, 0
        self._fd = fileno_of(fh)
        self.positional = self._fd is not None

    def size(self) -> int:
        import os

        return max(0, min(os.fstat(self._fd).st_size - self.base, self.length))

    def pread(self, n: int, offset: int) -> bytes:
        import os

        return os.pread(self._fd, max(0, min(n, self.length - offset)), self.base + offset)

    def read(self, n: int = -1) -> bytes:
        n = self.length - self._pos if n is None or n < 0 else min(n, self.length - self._pos)
        if n <= 0:
            return b""
        self.fh.seek(self.base + self._pos)
        data = self.fh.read(n) or b""
        self._pos += len(data)
        return data


def _spill_member(reader: "ArchiveReader", rec: dict, spill_dir, on_bytes=None):
    """Decode a member into an unlinked file in ``spill_dir`` (a :class:`~ckpt_archive.store.fs.Dir`, e.g.
    restore's staging folder, or a folder path); return a private (copy-on-write) mmap of it.

    The spill file is created through the file layer (``O_EXCL | O_NOFOLLOW``, an unpredictable name). The
    member's raw sha256 is checked (by iter_member) before the map is returned.
    """
    import mmap
    import os

    from ckpt_archive.store.fs import Dir

    folder = spill_dir if isinstance(spill_dir, Dir) else Dir.open(spill_dir)
    name, fd = folder.create_temp("ckpt-archive-spill", mode=0o600, readable=True)
    try:
        with os.fdopen(fd, "wb", closefd=False) as fh:
            for _, chunk in reader.iter_member(rec, on_bytes=on_bytes):
                fh.write(chunk)
        if rec["raw_bytes"] == 0:
            return memoryview(bytearray())
        return mmap.mmap(fd, rec["raw_bytes"], flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        folder.unlink(name)
        if folder is not spill_dir:
            folder.close()



def tensor_refs(tree) -> list[str]:
    """The tensor keys an encoded state tree references, in walk order."""
    from ckpt_archive.format.tree_walk import walk_refs

    return list(walk_refs(tree))


def _locate_bad_chunk(store, key: str, rec: dict) -> str:
    """Name the first chunk whose stored sha256 fails (for a precise report)."""
    try:
        with store.open_read(key) as fh:
            for i, c in enumerate(rec["chunks"]):
                data = fh.read(c["stored_bytes"])
                if hashlib.sha256(data).hexdigest() != c["stored_sha256"]:
                    return f"; first bad chunk {i} at stored bytes {c['stored_offset']}..{c['stored_offset'] + c['stored_bytes']}"
    except Exception:  # locating is best effort; the mismatch itself is already reported
        return ""
    return ""


__all__ = ["FILES_IN_FLIGHT", "Problem", "ArchiveReader", "SizeOnly", "tensor_refs", "subtree", "check_only"]
