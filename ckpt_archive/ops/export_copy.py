"""The bytes an export moves: a generation's stored files (its members' own files and, format 3, the shared
objects they reference), copied with the source's bytes checked on the way and re-read at DEST.

Split from :mod:`ckpt_archive.ops.export` (the lifecycle and the proof) so that each stays readable.
The rules for shared objects (docs/FORMAT.md, "Shared objects"; docs/export.md):

* each object is copied **once per destination** in a run (:class:`SharedCopies` remembers what this run
  copied and re-read there), atomically (``store.write_new``: a reader never sees a partial object);
* an object already at DEST with the recorded size is **not copied** (its bytes are counted as skipped);
  its bytes are still re-read there before the marker (size and every chunk's sha256), and the trial
  reload decodes them. One that fails that re-read is never trusted: it is replaced from the source
  (whose bytes are checked as they are copied) and re-read again. One of another size (a truncated copy)
  is replaced at once;
* an object's name is its raw fingerprint *and* the digest of its stored chunks, so the same tensor
  encoded otherwise (another repository, chunk size, codec or zstd build) is another object and both
  live side by side at DEST; an object is only ever replaced by the bytes its name promises;
* a run starts by removing what a killed run left below ``objects/`` at DEST: unfinished multipart
  uploads and temporary files of an atomic create (the writer lock is held, so no writer owns them).
"""
from __future__ import annotations

import dataclasses

from ckpt_archive.errors import IntegrityError, NotFound

COPY_PIECE_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class StoredFile:
    """One file holding (part of) a member's stored stream.

    Attributes:
        key: its store key (``generations/N/<stored_path>`` or ``objects/<hh>/<name>.ckz``).
        fp: the shared object's name (``<raw hex>-<stored hex>``, docs/FORMAT.md), or None for a member's own file.
        rec: a record checkable like a format-2 member (``stored_bytes``, ``chunks``, ``stored_fp``, ``path``).
        member: the path of the member that references it (the first one, for an object used twice).
    """

    key: str
    fp: str | None
    rec: dict
    member: str


def files_of(manifest: dict, gen_key: str) -> list[StoredFile]:
    """Every stored file a generation needs, each object once: members' own files and shared objects.

    Args:
        manifest: the parsed (checked) manifest. gen_key: the generation folder key.

    Returns:
        :class:`StoredFile` objects in manifest order (a member's own file, then its objects).
    """
    from ckpt_archive.format.objects import stored_files

    out, seen = [], set()
    for member in manifest["members"]:
        for key, fp, rec in stored_files(member, gen_key):
            if fp is not None:
                if fp in seen:
                    continue
                seen.add(fp)
            out.append(StoredFile(key, fp, rec, member["path"]))
    return out


def unique_stored_bytes(manifests: list[dict]) -> int:
    """Stored bytes of a set of generations with every shared object counted once (what a copy moves at most)."""
    from ckpt_archive.format.objects import own_stored_bytes, refs

    total, objects = 0, {}
    for m in manifests:
        total += sum(own_stored_bytes(rec) for rec in m["members"])
        objects.update(refs(m))
    return total + sum(objects.values())


@dataclasses.dataclass
class SharedCopies:
    """What one export run did with shared objects at DEST (every generation of the run consults it).

    Attributes:
        verified: ``{fp: (sha256 of the object as re-read at DEST, generation it was re-read with)}``.
        cleaned: what was removed below ``objects/`` before copying (``aborted_uploads``, ``removed``),
            or None before :func:`clean_objects` ran.
    """

    verified: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    cleaned: dict | None = None


def clean_objects(dst) -> dict:
    """Remove what a killed run left below ``objects/`` at DEST (the caller holds DEST's writer lock):
    unfinished multipart uploads (invisible, billed) and temporary files of an atomic create.

    Returns:
        ``{"aborted_uploads": [keys], "removed": [keys]}``.
    """
    from ckpt_archive.format.objects import OBJECT_DIR
    from ckpt_archive.repo.objects import all_objects

    aborted = dst.store.abort_uploads(OBJECT_DIR)
    removed = []
    for key in all_objects(dst.store)[1]:
        dst.store.remove(key)
        removed.append(key)
    return {"aborted_uploads": aborted, "removed": removed}


def copy_file(src_store, dst_store, f: StoredFile, on_bytes, faults) -> None:
    """Stream one stored file from the source to DEST, checking the source's bytes on the way (every
    chunk's sha256 and the file's stored fingerprint): a source that does not match its manifest aborts
    the write, so no bad copy is committed. A member's own file is written write-once; a shared object
    atomically (``write_new``: never seen partial, as objects are shared by generations).

    Raises:
        IntegrityError: the source is missing or does not match (names the member or the object).
        StoreError: DEST refused the write (or the key exists there).
    """
    from ckpt_archive.format.codec import StoredStream

    rec = f.rec
    check = StoredStream(rec, rec["path"])
    try:
        fin = src_store.open_read(f.key)
    except NotFound:
        raise IntegrityError(f"missing at the source ({src_store.location})", where=rec["path"]) from None
    point = "export-member-write" if f.fp is None else "export-object-write"
    writer = dst_store.write_once(f.key) if f.fp is None else dst_store.write_new(f.key)
    with fin, writer as fout:
        first = True
        while True:
            piece = fin.read(COPY_PIECE_BYTES)
            if not piece:
                break
            fout.write(piece)
            check.update(piece)
            if on_bytes:
                on_bytes(len(piece))
            if first:
                faults.point(point)
                first = False
        bad = check.finish()
        if bad is not None:
            raise IntegrityError(f"the source copy does not match its manifest ({bad}); run ckpt-archive verify "
                                 f"on the source", where=rec["path"])


def check_at(store, key: str, rec: dict, on_bytes=None, whole: list | None = None) -> str | None:
    """Re-read a stored file: size, then sha256 of every chunk and the file's stored fingerprint.

    Args:
        store: where to read. key: the file's key. rec: its (sub-)record.
        on_bytes: progress, bytes re-read. whole: append the sha256 of the file as read there (for the
            proof: what ``sha256sum`` gives at the destination).

    Returns:
        None when all match, else the first thing wrong (one line).
    """
    from ckpt_archive.format.codec import StoredStream

    try:
        size = store.size(key)
    except NotFound:
        return f"missing: {rec['stored_path']}"
    if size != rec["stored_bytes"]:
        return f"{size} bytes stored, manifest says {rec['stored_bytes']}"
    check = StoredStream(rec, rec["path"], whole=whole is not None)
    with store.open_read(key) as fh:
        while rest := fh.read(COPY_PIECE_BYTES):
            check.update(rest)
            if on_bytes:
                on_bytes(len(rest))
    bad = check.finish()
    if whole is not None:
        whole.append(check.whole_sha256)
    return bad


def stored_digest(rec: dict) -> str:
    """A stored file's fingerprint for the report (format 1: its sha256; format 2: ``sha256-chunks:...``)."""
    from ckpt_archive.format.fingerprint import stored_fp

    fp = stored_fp(rec)
    return fp[len("sha256:"):] if fp.startswith("sha256:") else fp


def place_object(src, dst, f: StoredFile, shared: SharedCopies, on_bytes) -> str:
    """Make shared object ``f`` present at DEST: copy it, or keep the one there.

    Returns:
        ``present`` (already there with the recorded size, or copied and re-read earlier in this run:
        not copied), ``copied``, or ``replaced`` (one of another size was there: not trusted).
    """
    if f.fp in shared.verified:
        return "present"
    try:
        size = dst.store.size(f.key)
    except NotFound:
        size = None
    if size == f.rec["stored_bytes"]:
        return "present"  # its bytes are re-read at DEST and decoded by the trial reload before the marker
    action = "copied"
    if size is not None:
        dst.store.remove(f.key)  # a truncated or longer object (another tool's copy, an old bug): never trusted
        action = "replaced"
    copy_file(src.store, dst.store, f, on_bytes, dst.faults)
    dst.faults.point("export-after-object")
    return action


def recheck_object(src, dst, f: StoredFile, on_bytes, whole: list) -> str | None:
    """An object kept at DEST on its size failed its re-read: replace it from the source (checked on the
    way) and re-read it again. Returns the re-read's verdict (None: good now)."""
    dst.store.remove(f.key)
    copy_file(src.store, dst.store, f, on_bytes, dst.faults)
    dst.faults.point("export-after-object")
    whole.clear()
    return check_at(dst.store, f.key, f.rec, on_bytes, whole)


__all__ = ["StoredFile", "files_of", "unique_stored_bytes", "SharedCopies", "clean_objects", "copy_file",
           "check_at", "stored_digest", "place_object", "recheck_object", "COPY_PIECE_BYTES"]
