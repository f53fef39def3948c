"""Shared objects (format 3): a tensor entry's stored chunks kept once per repository, by fingerprint.

The rules are docs/FORMAT.md, "Shared objects". In short: a tensors member's *stored stream* is its
chunks' stored bytes in order (``chunks[].stored_offset`` tiles it, as in format 2); ``members[].objects``
names the ranges of that stream kept in ``objects/<hh>/<raw hex>-<stored hex>.ckz`` (the entry's BLAKE3
raw fingerprint and the ``sha256-chunks`` digest of the object's stored chunks: :func:`object_id`), and
the member's own file holds the rest, in order. This module is pure (no I/O): it
checks an objects table against its member (:func:`check_objects`), splits a member into the files that
hold its stream (:func:`parts`), and lists what a manifest references (:func:`refs`).
"""
from __future__ import annotations

import dataclasses
import re

from ckpt_archive.errors import IntegrityError

OBJECT_DIR = "objects"
_FP_RE = re.compile(r"^blake3:([0-9a-f]{64})$")
_OID_RE = re.compile(r"^([0-9a-f]{64})-([0-9a-f]{64})$")
_NAME_RE = re.compile(r"^([0-9a-f]{64}-[0-9a-f]{64})\.ckz$")
#: Entries with at least this many raw bytes are shared (docs/FORMAT.md: smaller ones cost more as a
#: file each than they save).
DEFAULT_SHARE_MIN_BYTES = 1 << 20


def check_fp(fp: str) -> str:
    """The 64 hex digits of a shared object's raw fingerprint ``blake3:<hex>``.

    Raises:
        IntegrityError: anything else (a hostile manifest cannot name another path through it).
    """
    m = _FP_RE.match(fp) if isinstance(fp, str) else None
    if m is None:
        raise IntegrityError(f"shared object fingerprint {fp!r} is not blake3:<64 hex digits>")
    return m.group(1)


def object_id(fp: str, chunks) -> str:
    """A shared object's name: ``<raw hex>-<stored hex>``, the BLAKE3 of its raw bytes and the
    ``sha256-chunks`` digest of its stored chunks (docs/FORMAT.md, "Shared objects"). The same tensor
    encoded two ways (another codec, level, chunk size or zstd build) is two objects, never one name
    for two contents."""
    from ckpt_archive.format import fingerprint

    stored = fingerprint.sha256_chunks(c["stored_sha256"] for c in chunks).partition(":")[2]
    return f"{check_fp(fp)}-{stored}"


def object_key(oid: str) -> str:
    """The store key of shared object ``oid`` (``objects/<hh>/<raw hex>-<stored hex>.ckz``).

    Raises:
        IntegrityError: ``oid`` is not ``<64 hex>-<64 hex>``.
    """
    if not (isinstance(oid, str) and _OID_RE.match(oid)):
        raise IntegrityError(f"shared object name {oid!r} is not <64 hex digits>-<64 hex digits>")
    return f"{OBJECT_DIR}/{oid[:2]}/{oid}.ckz"


def raw_fp_of(oid: str) -> str:
    """The raw fingerprint (``blake3:<hex>``) of shared object ``oid``."""
    return f"blake3:{oid[:64]}"


def oid_of_name(folder: str, name: str) -> str | None:
    """The object a file ``objects/<folder>/<name>`` holds (its name), or None (not an object name)."""
    m = _NAME_RE.match(name)
    if m is None or m.group(1)[:2] != folder:
        return None
    return m.group(1)


def misplaced_oid(folder: str, name: str) -> str | None:
    """The object a file ``objects/<folder>/<name>`` is named after when that is not its folder (a shared
    object moved out of ``objects/<oid[:2]>/``: no reader ever looks there), else None."""
    m = _NAME_RE.match(name)
    if m is None or m.group(1)[:2] == folder:
        return None
    return m.group(1)


@dataclasses.dataclass(frozen=True)
class Part:
    """One file holding part of a member's stored stream.

    Attributes:
        fp: the shared object's raw fingerprint, or None for the member's own file.
        oid: the shared object's name (:func:`object_id`), or None for the member's own file.
        stored_bytes: the file's size (bytes).
        record: a standalone chunk table for this file (``raw_bytes``, ``stored_bytes``, ``chunks`` with
            offsets rebased to the file), checkable like a format-2 member by the codec's checkers.
        index: the positions of its chunks in the member's chunk table.
    """

    fp: str | None
    stored_bytes: int
    record: dict
    index: tuple[int, ...]
    oid: str | None = None


def own_stored_bytes(rec: dict) -> int:
    """Bytes of the member's own file: its stored stream minus the ranges kept in shared objects."""
    return rec["stored_bytes"] - sum(o["stored_bytes"] for o in rec.get("objects") or ())


def check_objects(rec: dict, member: str) -> None:
    """Check a member's objects table (docs/FORMAT.md, "Shared objects"); no-op without one.

    Each range must start and end on chunk boundaries, come in stored order without overlap, and cover
    exactly one tensor entry's raw range whose ``raw_fp`` is the object's ``fp``.

    Raises:
        IntegrityError: naming the member and the object.
    """
    objs = rec.get("objects")
    if not objs:
        return
    if rec.get("role") != "tensors":
        raise IntegrityError("only a tensors member may keep bytes in shared objects", where=member)
    starts = {c["stored_offset"]: i for i, c in enumerate(rec.get("chunks") or [])}
    by_range = {}
    base = rec.get("header_bytes", 0)
    for key, e in (rec.get("entries") or {}).items():
        a, b = e["data_offsets"]
        by_range[(base + a, b - a)] = (key, e)
    prev_end = 0
    chunks = rec.get("chunks") or []
    for j, o in enumerate(objs):
        check_fp(o["fp"])
        where = f"{member}: objects[{j}]"
        if o["stored_offset"] < prev_end:
            raise IntegrityError("shared objects overlap or are out of stored order", where=where)
        i = starts.get(o["stored_offset"])
        if i is None:
            raise IntegrityError(f"object starts at stored byte {o['stored_offset']}, not at a chunk boundary",
                                 where=where)
        raw = stored = 0
        k = i
        while k < len(chunks) and stored < o["stored_bytes"]:
            raw += chunks[k]["raw_bytes"]
            stored += chunks[k]["stored_bytes"]
            k += 1
        if stored != o["stored_bytes"] or chunks[i]["raw_offset"] != o["raw_offset"] or raw != o["raw_bytes"]:
            raise IntegrityError(f"object ({o['stored_bytes']} stored / {o['raw_bytes']} raw bytes at raw "
                                 f"{o['raw_offset']}) does not end on a chunk boundary of its member", where=where)
        found = by_range.get((o["raw_offset"], o["raw_bytes"]))
        if found is None:
            raise IntegrityError(f"object covers raw bytes {o['raw_offset']}..+{o['raw_bytes']}, which is not "
                                 f"one tensor entry", where=where)
        if found[1].get("raw_fp") != o["fp"]:
            raise IntegrityError(f"object {o['fp']} holds entry {found[0]!r}, whose raw fingerprint is "
                                 f"{found[1].get('raw_fp')}", where=where)
        prev_end = o["stored_offset"] + o["stored_bytes"]


def rebase(chunks: list[dict]) -> dict:
    """A standalone chunk table of ``chunks`` (records copied, offsets from 0): ``{raw_bytes, stored_bytes,
    chunks}``, the table of one file or object holding them."""
    out, raw, stored = [], 0, 0
    for c in chunks:
        out.append({**c, "raw_offset": raw, "stored_offset": stored})
        raw += c["raw_bytes"]
        stored += c["stored_bytes"]
    return {"raw_bytes": raw, "stored_bytes": stored, "chunks": out}


def parts(rec: dict) -> list[Part]:
    """The files holding a member's stored stream: its own file first, then each shared object in order.

    A member without ``objects`` is one part (its own file, the record's own chunk table). The caller
    has checked the table (:func:`check_objects`, run when a manifest is parsed).
    """
    objs = rec.get("objects") or []
    if not objs:
        return [Part(None, rec["stored_bytes"], rec, tuple(range(len(rec.get("chunks") or []))))]
    chunks = rec.get("chunks") or []
    owner: list[int] = [-1] * len(chunks)
    j = 0
    for i, c in enumerate(chunks):
        while j < len(objs) and c["stored_offset"] >= objs[j]["stored_offset"] + objs[j]["stored_bytes"]:
            j += 1
        if j < len(objs) and objs[j]["stored_offset"] <= c["stored_offset"] < objs[j]["stored_offset"] + objs[j]["stored_bytes"]:
            owner[i] = j
    own = [i for i in range(len(chunks)) if owner[i] < 0]
    out = [Part(None, own_stored_bytes(rec), rebase([chunks[i] for i in own]), tuple(own))]
    for j, o in enumerate(objs):
        idx = [i for i in range(len(chunks)) if owner[i] == j]
        sub = rebase([chunks[i] for i in idx])
        out.append(Part(o["fp"], o["stored_bytes"], sub, tuple(idx), object_id(o["fp"], sub["chunks"])))
    return out


def stored_files(rec: dict, gen_key: str) -> list[tuple[str, str | None, dict]]:
    """``(store key, object name (oid) or None, record)`` for every file holding a member's stored stream.

    ``record`` checks that one file like a format-2 member: the member's own record when it has no
    objects; otherwise a rebased chunk table with its own derived ``stored_fp``, ``path`` and
    ``stored_path`` (for a shared object, its key).
    """
    from ckpt_archive.format import fingerprint

    out = []
    for p in parts(rec):
        key = f"{gen_key}/{rec['stored_path']}" if p.oid is None else object_key(p.oid)
        if p.record is rec:
            out.append((key, None, rec))
            continue
        sub = {**p.record, "stored_fp": fingerprint.sha256_chunks(c["stored_sha256"] for c in p.record["chunks"])}
        if p.oid is None:
            sub.update(path=rec["path"], stored_path=rec["stored_path"], role=rec.get("role"))
        else:
            sub.update(path=key, stored_path=key, role="object")
        out.append((key, p.oid, sub))
    return out


def refs(manifest: dict) -> dict[str, int]:
    """``{object name (oid): stored bytes}`` of every shared object a manifest references."""
    out: dict[str, int] = {}
    for m in manifest.get("members") or ():
        if m.get("objects"):
            for p in parts(m):
                if p.oid is not None:
                    out[p.oid] = p.stored_bytes
    return out


__all__ = ["OBJECT_DIR", "DEFAULT_SHARE_MIN_BYTES", "check_fp", "object_id", "object_key", "raw_fp_of", "oid_of_name", "misplaced_oid",
           "Part", "own_stored_bytes", "check_objects", "rebase", "parts", "stored_files", "refs"]
