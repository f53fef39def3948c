"""Write one generation's members: tensor shards, source files, the state tree, data ids.

Writing streams: every tensor entry's bytes go straight from the (memory-mapped) source through the
chunk encoder to the store, one tensor at a time; nothing holds the whole checkpoint. Each member is
write-once, fingerprinted on the way (stored and raw sha256, per chunk and whole); the records come
back for the manifest (docs/FORMAT.md, "Write order" step 2). Each role is hashed once: sha256 per
stored chunk (the member's stored fingerprint is derived from those), BLAKE3 per tensor entry (the
tensors member's raw fingerprint is derived from those), sha256 of each source file in its one read. The manifest itself is written by
:mod:`ckpt_archive.repo.publish` (seal).
"""
from __future__ import annotations

import json
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping

from ckpt_archive.errors import FormatError, SourceError
from ckpt_archive.format import fingerprint
from ckpt_archive.format.fingerprint import BLAKE3, SHA256
from ckpt_archive.format.objects import own_stored_bytes
from ckpt_archive.format.text import shown
from ckpt_archive.format.read_lease import check_leases
from ckpt_archive.format.codec import DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL, default_jobs
from ckpt_archive.format.member_writer import MemberWriter
from ckpt_archive.format.shard import encode_header
from ckpt_archive.format.state_tree import TensorTable, encode
from ckpt_archive.format.tensor_bytes import FLOAT_ST
from ckpt_archive.store.faults import NO_FAULTS, Faults

SHARD_BYTES = 4 << 30          # split tensors into shards of at most this many raw bytes
FILE_READ_BYTES = 8 << 20      # read raw/opaque source files in pieces of this size
TREE_MEMBER = "tree.json"


def _hint(st_dtype: str) -> str:
    size = FLOAT_ST.get(st_dtype)
    return f"bg{size}" if size in (2, 4, 8) else "zstd"


def stored_name(path: str) -> str:
    return path + ".ckz"



class GenerationWriter:
    """Writes the members of one generation, one write-once object each (see :func:`write_members`)."""

    def __init__(self, store, gen_key: str, *, level: int, jobs: int, chunk_bytes: int, on_bytes,
                 faults: Faults = NO_FAULTS):
        self.store = store
        self.faults = faults
        self.gen_key = gen_key
        self.level = level
        self.jobs = jobs
        self.chunk_bytes = chunk_bytes
        self.on_bytes = on_bytes
        self.pool = ThreadPoolExecutor(jobs, thread_name_prefix="ckpt-enc")
        self.hash_pool = ThreadPoolExecutor(max(1, jobs), thread_name_prefix="ckpt-hash")
        #: [issue 29] every write of the generation, in order, on one thread (MemberWriter's io_pool)
        self.io_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self.members: list[dict] = []
        #: member path -> CRC-32 per chunk as written (MemberWriter.written_crc), for pack's trial reload
        self.written_crc: dict[str, list[int | None]] = {}
        #: source files' reads by file identity (exact_bytes.ScanJob), whose range fingerprints entries take
        self.scans: dict = {}
        #: entry key -> the raw fingerprint its bytes had when the source was first read (a second read of it,
        #: pack's retry, must give the same bytes: :func:`_checked_again`); None on a first read
        self.expect: "Mapping[str, str] | None" = None
        #: the source's path, named when a second read finds other bytes
        self.source_path: Any = None

    def member(self, path: str, role: str, pieces: Iterator[tuple[Any, str]], *, raw_alg: str | None = BLAKE3,
               **extra) -> dict:
        """Write one member; ``raw_alg``: its whole-raw fingerprint's algorithm (None: the caller derives it)."""
        key = f"{self.gen_key}/{stored_name(path)}"
        with self.store.write_once(key) as fh:
            w = MemberWriter(fh, level=self.level, jobs=self.jobs, chunk_bytes=self.chunk_bytes,
                             on_bytes=self.on_bytes, pool=self.pool, raw_alg=raw_alg, io_pool=self.io_pool)
            try:
                for i, piece in enumerate(pieces):
                    data, hint = piece[0], piece[1]
                    share = piece[2] if len(piece) > 2 else None
                    if share is None:
                        w.add(data, hint)
                    elif share[1] is None:
                        w.add(data, hint, sink=share[0])   # a new shared object
                    else:
                        w.add_reused(share[0], share[1])   # an object a usable generation vouches for
                    if i == 1:
                        self.faults.point("member-write")
                rec = w.finish()
                self.written_crc[path] = w.written_crc
            except BaseException:
                w.abort()
                raise
        record = {"path": path, "stored_path": stored_name(path), "role": role, **rec, **extra}
        self.members.append(record)
        return record

    def close(self):
        self.pool.shutdown(wait=True)
        self.hash_pool.shutdown(wait=True)
        self.io_pool.shutdown(wait=True)


def _file_pieces(path):
    """A raw/opaque source file in pieces; the member writer's sha256 of them is the file's fingerprint
    (taken during this one read)."""
    with open(path, "rb") as fh:
        while True:
            piece = fh.read(FILE_READ_BYTES)
            if not piece:
                break
            yield piece, "zstd"


def write_members(store, gen_key: str, source, *, data_ids: Any = None, level: int = DEFAULT_LEVEL,
                  jobs: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  on_bytes: Callable[[int], None] | None = None, encoded: tuple | None = None,
                  faults: Faults = NO_FAULTS, shared=None, scans: "Mapping[tuple, Any] | None" = None,
                  expect: "Mapping[str, str] | None" = None) -> dict:
    """Write every member of a generation from a :class:`~ckpt_archive.sources.SourceCheckpoint`.

    ``encoded`` is ``state_tree.encode(source.state)`` when the caller already encoded it (pack does,
    before claiming a generation number, so that refused input leaves nothing behind).

    Args:
        store: the repository's :class:`~ckpt_archive.store.local.Store`.
        gen_key: the generation's folder key (``generations/00000007``).
        source: what to pack.
        data_ids: optional data identity (any strict-JSON value) stored as member ``data-ids.json``.
        level: zstandard level; jobs: encoder threads; chunk_bytes: raw bytes per chunk.
        on_bytes: progress callback (raw bytes).
        faults: the repository's fault-injection hook (points ``member-write``, ``after-members``).
        shared: a :class:`ckpt_archive.repo.objects.SharedWriter` (format 3: large entries stored once per
            repository, docs/FORMAT.md "Shared objects"), or None to store every entry in the member.
        scans: reads of source files a caller started earlier (:class:`~ckpt_archive.format.exact_bytes.ScanJob`),
            by :func:`~ckpt_archive.format.exact_bytes.file_identity`; files not in it are read here.
        expect: ``{entry key: raw fingerprint}`` the entries had when the source was read before (pack's retry
            reads it a second time): each entry's bytes are hashed and compared before they are stored,
            so bytes of a source changed since never reach a member or a shared object.

    Returns:
        the manifest's archive part: ``members``, ``tensors``, ``tree_member``, ``source``, ``data``,
        ``summary``, plus ``warnings`` (list of str, popped by the caller).

    Raises:
        SourceError: a value that cannot be archived (names its path). SourceChanged: with ``expect``, an
            entry's bytes are no longer those first read. OSError from the store.
    """
    jobs = jobs or default_jobs()
    tree, table = encoded[:2] if encoded is not None else encode(source.state)
    if encoded is not None and len(encoded) > 2:
        tree = encoded[2]  # its bytes, already checked by pack before it claimed the generation
    w = GenerationWriter(store, gen_key, level=level, jobs=jobs, chunk_bytes=chunk_bytes, on_bytes=on_bytes, faults=faults)
    w.expect = expect
    w.source_path = source.files[0].path if len(source.files) == 1 and source.files[0].path else source.root
    scan_pools: list[ThreadPoolExecutor] = []
    try:
        jobs_by_file = _start_scans(source, scans, scan_pools)
        w.scans = {job.identity: job for job in jobs_by_file.values() if job.identity is not None}
        tensors = _write_tensors(w, table, shared=shared)
        if shared is not None:
            shared.sync()  # the new objects' names are durable before any manifest references them
        files_meta = []
        stored_entries = _entries_by_sha(w.members)
        for sf in source.files:
            files_meta.append(_file_entry(w, sf, files_meta, stored_entries, jobs_by_file))
        data = write_tree_and_data_ids(w, tree, data_ids)
        for entry in files_meta:
            if hasattr(entry["sha256"], "result"):
                entry["sha256"] = entry["sha256"].result()
    finally:
        w.close()
        for pool in scan_pools:
            pool.shutdown(wait=True, cancel_futures=True)
    faults.point("after-members")
    members = w.members
    return {
        "tree_member": TREE_MEMBER,
        "members": members,
        "tensors": tensors,
        "source": {"format": source.format, "layout": source.layout,
                   # where it was packed from, for people: a name that is not UTF-8 is kept with \\x escapes
                   "path": shown(str(source.root)) if source.root else None, "files": files_meta,
                   "info": source.info or {}},
        "data": data,
        "summary": _summary(members, tensors, shared),
        "warnings": list(table.warnings) + list(getattr(source, "warnings", []) or []),
        "written_crc": w.written_crc,
    }


def _summary(members: list[dict], tensors: dict, shared) -> dict:
    """The manifest's ``summary``: raw and stored bytes (``new_stored_bytes`` too where shared objects are used),
    tensor and member counts."""
    summary = {"raw_bytes": sum(m["raw_bytes"] for m in members),
               "stored_bytes": sum(m["stored_bytes"] for m in members),
               "tensor_count": len(tensors), "member_count": len(members)}
    if shared is not None and any(m.get("objects") for m in members):
        summary["new_stored_bytes"] = sum(own_stored_bytes(m) for m in members) + shared.new_stored_bytes
    return summary


def _start_scans(source, scans: "Mapping[tuple, Any] | None", pools: list) -> dict[int, Any]:
    """The reads of decomposed source files (tensor-range fingerprints + the file's sha256, a torch zip's CRCs),
    on their own threads while the tensors are encoded, or started before the source was parsed (``scans``).

    Returns:
        ``{id(source file): ScanJob}``; a pool started here is appended to ``pools`` (the caller shuts it down).
    """
    from ckpt_archive.format import exact_bytes

    jobs_by_file: dict[int, Any] = {}
    for sf in source.files:
        if sf.kind in ("raw", "opaque") or sf.path is None or getattr(sf, "link_of", None):
            continue
        job = (scans or {}).get(exact_bytes.file_identity(sf.path))
        if job is None or job.kind != sf.kind:
            if not pools:
                pools.append(ThreadPoolExecutor(2, thread_name_prefix="ckpt-scan"))
            job = exact_bytes.ScanJob(sf.path, sf.kind, BLAKE3, pool=pools[0],  # a torch zip's CRCs too
                                      check_crc=sf.kind == "torch")
        jobs_by_file[id(sf)] = job
    return jobs_by_file


def _file_entry(w: GenerationWriter, sf, files_meta: list[dict], stored_entries, jobs_by_file: dict) -> dict:
    """The manifest's ``source.files[]`` entry of one source file, its member or skeleton written (its
    ``sha256`` may still be a future, resolved by the caller).

    Raises:
        SourceError / OSError: the file cannot be read, or changed while read. OSError from the store.
    """
    entry = {"relpath": sf.relpath, "kind": sf.kind, "member": None, "raw_bytes": None, "sha256": None}
    if sf.path is not None:  # its permission bits: a 0600 file (tokens, HF's weights) stays 0600
        entry["mode"] = stat.S_IMODE(sf.path.stat().st_mode) & 0o777
    if sf.metadata is not None:
        entry["metadata"] = dict(sf.metadata)
    if getattr(sf, "link_of", None):  # [issue 11] a hardlink of an earlier file: restored as a link
        entry["hardlink_of"] = sf.link_of
        entry["raw_bytes"] = sf.path.stat().st_size
        earlier = next((f for f in files_meta if f["relpath"] == sf.link_of), None)
        # the same inode as an earlier file: its fingerprint is that file's (read once)
        entry["sha256"] = (earlier["sha256"] if earlier is not None and earlier.get("sha256")
                           else w.hash_pool.submit(fingerprint.file_sha256, sf.path))
    elif sf.kind in ("raw", "opaque"):
        rec = w.member(f"files/{sf.relpath}", "file", _file_pieces(sf.path), raw_alg=SHA256,
                       opaque=(sf.kind == "opaque"))
        entry.update(member=rec["path"], raw_bytes=rec["raw_bytes"], sha256=fingerprint.split(rec["raw_fp"])[1])
    elif sf.path is not None:
        entry["raw_bytes"] = sf.path.stat().st_size
        entry["exact"], entry["sha256"] = _write_skeleton(w, sf, stored_entries, jobs_by_file[id(sf)].result())
    return entry


def tree_json(tree: Any) -> bytes:
    """The bytes of the state tree member, refused when no reader would read them back.

    Pack calls it before claiming a generation (``ops/pack.py: prepare``), so the refusal leaves nothing
    behind; :func:`write_tree_and_data_ids` calls it again for a tree it is given unencoded (the distributed
    checkpointer's combined tree).

    Raises:
        SourceError: (exit 2) the tree is over the readers' limits (``limits.tree_read_problem``): names the
            size, the largest list in it and what to do (store a long sequence as a tensor or NumPy array).
    """
    from ckpt_archive.format.limits import tree_read_problem

    raw = json.dumps(tree, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    problem = tree_read_problem(raw)
    if problem is not None:
        path, n = _longest_list(tree)
        where = f"; its longest list holds {n} items, at {path!r}" if n else ""
        raise SourceError(f"this state cannot be archived: {problem}{where}. Store a long sequence (a data "
                          f"permutation, a list of ids) as a tensor or NumPy array (torch.tensor(values)), "
                          f"which the archive keeps as tensor bytes; nothing was written")
    return raw


def _longest_list(tree: Any) -> tuple[str, int]:
    """``(path, length)`` of the longest JSON array in ``tree`` (``("", 0)`` when none), for the refusal."""
    best, stack = ("", 0), [("", tree)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{path}/{k}" if k not in ("$t", "v") else path, v) for k, v in node.items())
        elif isinstance(node, list):
            if len(node) > best[1]:
                best = (path or "/", len(node))
            stack.extend((f"{path}/{i}", v) for i, v in enumerate(node) if isinstance(v, (dict, list)))
    return best


def write_tree_and_data_ids(w: GenerationWriter, tree: Any, data_ids: Any) -> dict:
    """Write the state tree member and, when given, the data-ids member; shared by pack and the
    distributed checkpointer so both record them alike.

    Returns:
        The manifest's ``data`` section: ``{}`` without data ids, else ``{"ids_member", "fingerprint"
        (sha256 hex of the canonical, sorted-key JSON), "count"}``.
    """
    tree_bytes = tree if isinstance(tree, bytes) else tree_json(tree)
    w.member(TREE_MEMBER, "tree", iter([(tree_bytes, "zstd")]))
    if data_ids is None:
        return {}
    # canonical JSON (sorted keys): the same map in another key order has the same fingerprint
    from ckpt_archive.format.data_ids import canonical_bytes

    rec = w.member("data-ids.json", "data-ids", iter([(canonical_bytes(data_ids), "zstd")]), raw_alg=SHA256)
    return {"ids_member": rec["path"], "fingerprint": fingerprint.split(rec["raw_fp"])[1],  # sha256 hex
            "count": len(data_ids) if isinstance(data_ids, (list, dict)) else None}


def _entries_by_sha(members: list[dict]) -> dict[str, tuple[int, str]]:
    """``{raw fingerprint: (raw bytes, entry key)}`` of every tensor entry written so far."""
    out: dict[str, tuple[int, str]] = {}
    for m in members:
        if m["role"] == "tensors":
            for key, e in m["entries"].items():
                start, end = e["data_offsets"]
                if end > start:
                    out.setdefault(e["raw_fp"], (end - start, key))
    return out


def _write_skeleton(w: GenerationWriter, sf, stored_entries: dict, scanned: tuple) -> tuple[dict, str]:
    """[issue 11] The skeleton member of a decomposed file (format/exact_bytes.py): its bytes minus the
    ranges that equal stored tensor entries. ``scanned``: :meth:`exact_bytes.ScanJob.result`. Returns the
    ``source.files[].exact`` record and the file's sha256 (taken in that same read)."""
    from ckpt_archive.format import exact_bytes

    ranges, file_sha = scanned
    segments = exact_bytes.plan(ranges, stored_entries)
    rec = w.member(f"exact/{sf.relpath or sf.path.name}", "file", exact_bytes.skeleton_pieces(sf.path, segments),
                   skeleton=True)
    return {"member": rec["path"], "segments": segments, "cut_bytes": sum(s[1] for s in segments)}, file_sha


def write_tensor_members(store, gen_key: str, table: TensorTable, *, prefix: str = "", level: int = DEFAULT_LEVEL,
                         jobs: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                         on_bytes: Callable[[int], None] | None = None, faults: Faults = NO_FAULTS
                         ) -> tuple[list[dict], dict]:
    """Write only the tensor shards of ``table`` (one rank's part of a distributed generation).

    Args:
        store, gen_key, level, jobs, chunk_bytes, on_bytes, faults: as :func:`write_members`.
        table: the tensors to write (``state_tree.encode``'s table, entry and leaf keys already unique
            across every writer of the generation).
        prefix: member path prefix (``rank00001/``), so several writers' shards never share a name.

    Returns:
        ``(members, tensors)``: the member records and the tensor index, as :func:`write_members` gives.

    Raises:
        OSError from the store; FormatError: a tensor changed size while being written.
    """
    w = GenerationWriter(store, gen_key, level=level, jobs=jobs or default_jobs(), chunk_bytes=chunk_bytes,
                         on_bytes=on_bytes, faults=faults)
    try:
        tensors = _write_tensors(w, table, prefix=prefix)
    finally:
        w.close()
    return w.members, tensors


#: Raw bytes of shared-candidate entries fingerprinted ahead of the encoder (their fingerprint decides
#: whether they are written at all); bounded so a non-contiguous tensor's copy does not pile up.
LOOKAHEAD_BYTES = 256 << 20


def _shared_pieces(w: GenerationWriter, entries, entry_sha: dict, shared) -> Iterator[tuple]:
    """The entries of one shard as ``(bytes, hint, share)`` pieces. Entries ``shared`` wants are
    fingerprinted a few ahead on the hash pool (in parallel with the encoder) and then referenced,
    written as a new object, or kept inline (:meth:`SharedWriter.sink`); the others are fingerprinted
    alongside as before."""
    import collections

    window: collections.deque = collections.deque()
    ahead = 0
    it = iter(entries)
    done = False
    while True:
        while not done and (not window or (ahead < LOOKAHEAD_BYTES and len(window) < 8)):
            e = next(it, None)
            if e is None:
                done = True
                break
            data = e.source()
            check_leases()  # [break] a mapped source someone truncates: SourceChanged, never SIGBUS
            if len(data) != e.nbytes:
                raise FormatError(f"tensor changed size while packing ({len(data)} != {e.nbytes} bytes)",
                                  where=e.key)
            if w.expect is not None:
                _checked_again(w, e, data)
            entry_sha[e.key] = _entry_fp(w, e, data)
            want = shared is not None and shared.wants(e.nbytes)
            window.append((e, data, want))
            ahead += e.nbytes
        if not window:
            return
        e, data, want = window.popleft()
        ahead -= e.nbytes
        share = None
        if want:
            share = shared.sink(entry_sha[e.key].result(), e.nbytes)
        yield data, _hint(e.st_dtype), share


def _checked_again(w: GenerationWriter, e, data) -> None:
    """[break] A second read of the source (pack's retry, after its leases were given back): the entry's bytes
    must be those the first read took, before anything stores them (a shared object written again is
    referenced by other generations too); a source rewritten meanwhile is refused, never mixed in.

    Raises:
        SourceChanged: naming the source file.
    """
    from ckpt_archive.format.read_lease import changed

    want = w.expect.get(e.key)
    if want is None or fingerprint.digest(data, want.split(":", 1)[0]) != want:
        scan = w.scans.get(getattr(e, "file_identity", None)) if getattr(e, "file_identity", None) else None
        raise changed(scan.path if scan is not None else (w.source_path or e.key),
                      f"entry {e.key} no longer holds the bytes pack read first: the file was rewritten after "
                      f"pack read it, before the retry read it again")


def _entry_fp(w: GenerationWriter, e, data):
    """A Future of an entry's raw fingerprint (BLAKE3). [issue 29] An entry that is a range of a source
    file whose scan is running (``FileEntry``, format/pt_encode.py) takes the scan's fingerprint of that
    range: its bytes are hashed once, while they are read. Whatever the source, the trial reload checks
    the stored bytes decode to this fingerprint, so a file changed between the two reads fails the pack
    (and SourceChanged names why), never stores a fingerprint that is not the bytes'."""
    from concurrent.futures import Future

    scan = w.scans.get(getattr(e, "file_identity", None)) if getattr(e, "file_identity", None) else None
    if scan is None:
        return w.hash_pool.submit(fingerprint.digest, data, BLAKE3)
    out: Future = Future()

    def settle(src) -> None:
        if src.exception() is not None:
            out.set_exception(src.exception())
        elif src.result() is not None:
            out.set_result(src.result())
        else:  # not a range the scan recognised: hash the bytes here
            w.hash_pool.submit(fingerprint.digest, data, BLAKE3).add_done_callback(settle)

    scan.range_fp(e.file_offset, e.nbytes).add_done_callback(settle)
    return out


def _write_tensors(w: GenerationWriter, table: TensorTable, *, prefix: str = "", shared=None) -> dict:
    shards: list[list] = [[]]
    size = 0
    for entry in table.entries.values():
        if shards[-1] and size + entry.nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    entry_sha: dict[str, Any] = {}
    entry_member: dict[str, str] = {}
    if not table.entries:
        shards = []
    for i, entries in enumerate(shards):
        path = f"{prefix}tensors-{i:05d}.safetensors"
        header: dict[str, Any] = {}
        offset = 0
        for e in entries:
            header[e.key] = {"dtype": e.st_dtype, "shape": e.shape, "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        # the shard's safetensors header (not ``prefix``, the members' path prefix: reusing that name made every
        # shard after the first a store key of header bytes, and a state over SHARD_BYTES could not be packed)
        head = encode_header(header, {"format": "ckpt-archive"})

        def pieces(entries=entries, head=head):
            yield head, "zstd"
            yield from _shared_pieces(w, entries, entry_sha, shared)

        rec = w.member(path, "tensors", pieces(), raw_alg=None, header_bytes=len(head),
                       entries={k: dict(v) for k, v in header.items()})
        rec["header_fp"] = fingerprint.digest(head, BLAKE3)
        for e in entries:
            entry_member[e.key] = path
    for key, fut in entry_sha.items():
        entry_sha[key] = fut.result()
    for m in w.members:
        if m["role"] == "tensors":
            for k, v in m["entries"].items():
                v["raw_fp"] = entry_sha[k]
            m["raw_fp"] = fingerprint.derived_member_raw_fp(m, m.pop("header_fp"))
    tensors = {}
    for leaf, rec in table.leaves.items():
        rec = dict(rec)
        rec["member"] = entry_member[rec["entry"]]
        if leaf in table.leaf_bytes:
            rec["raw_fp"] = fingerprint.digest_pieces(table.leaf_bytes[leaf](), BLAKE3)  # a view: pieces
        else:
            rec["raw_fp"] = entry_sha[rec["entry"]]
        tensors[leaf] = rec
    return tensors


__all__ = ["SHARD_BYTES", "FILE_READ_BYTES", "TREE_MEMBER", "stored_name", "GenerationWriter", "write_members",
           "write_tree_and_data_ids", "write_tensor_members", "LOOKAHEAD_BYTES"]
