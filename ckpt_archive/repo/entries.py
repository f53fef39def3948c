"""A tensors member's decoded stream cut into its entries, in data order.

:meth:`ckpt_archive.repo.reader.ArchiveReader.iter_entries` decodes a member chunk by chunk; :class:`EntryCutter`
turns those chunks into ``(entry key, entry record, raw bytes)``: the safetensors header checked against the
manifest's entries first, an entry that fills most of one chunk given as a view of it, any other assembled
in a buffer taken as its bytes arrive (or not kept at all: :class:`~ckpt_archive.format.leaf_checks.SizeOnly`),
and a shared object the reader did not decode at all (a proven one) taken as exactly one entry
(:class:`ProvenSize`). It reads nothing itself: the reader feeds it, and the member's chunk and raw checks
stay the reader's.
"""
from __future__ import annotations

from typing import Any, Iterator

from ckpt_archive.errors import IntegrityError
from ckpt_archive.format.leaf_checks import SizeOnly
from ckpt_archive.format.limits import lazy_buffer
from ckpt_archive.format.shard import check_header


class ProvenSize(SizeOnly):
    """An entry's bytes that were not decoded at all: a shared object whose stored bytes were hashed now,
    under a chunk table a usable generation's trial reload proved (:attr:`~ckpt_archive.repo.reader.ArchiveReader.proven_objects`);
    the entry's raw fingerprint is the object's."""

    __slots__ = ()


class EntryCutter:
    """Cuts a tensors member's decoded stream into its entries, in data order (:meth:`~ckpt_archive.repo.reader.ArchiveReader.iter_entries`
    without ``into``): the safetensors header checked first; an entry inside one chunk that fills most of it
    is a view, else it is assembled in a buffer taken lazily (one reused buffer when ``transient``; none for an
    entry not wanted or in ``sizes_only``, which comes as a :class:`SizeOnly`); a proven shared object
    (:class:`~ckpt_archive.repo.objects.ProvenRange`) must be exactly the next entry."""

    def __init__(self, rec: dict, order: list, wanted, sizes_only, transient: bool):
        self.rec, self.order, self.wanted, self.sizes_only, self.transient = rec, order, wanted, sizes_only, transient
        self.base = rec["header_bytes"]
        self.idx = 0
        self.cur = None       # bytearray being filled for an entry spanning chunks (None when skipped)
        self.filled = 0
        self.scratch = bytearray()
        self.header_buf = bytearray()
        self.header_checked = False

    def _empty_entries(self, upto: int | None = None) -> Iterator[tuple[str, dict, Any]]:
        """The empty entries next in order (those starting at or before raw byte ``upto``, when given)."""
        order = self.order
        while self.idx < len(order) and order[self.idx][1]["data_offsets"][0] == order[self.idx][1]["data_offsets"][1] \
                and (upto is None or self.base + order[self.idx][1]["data_offsets"][0] <= upto):
            k, e = order[self.idx]
            self.idx += 1
            if self.wanted is None or k in self.wanted:
                yield k, e, bytearray()

    def proven(self, off: int, chunk) -> Iterator[tuple[str, dict, Any]]:
        """An entry held whole by a proven shared object (never decoded here): it starts where the stream
        stands, at an entry boundary, and is exactly that entry.

        Raises:
            IntegrityError: it is not.
        """
        yield from self._empty_entries(off)
        k, e = self.order[self.idx] if self.idx < len(self.order) else (None, None)
        if (not self.header_checked or self.filled or e is None or self.base + e["data_offsets"][0] != off
                or e["data_offsets"][1] - e["data_offsets"][0] != chunk.nbytes):
            raise IntegrityError(f"shared object {chunk.oid} is not one entry of its member at raw byte {off}",
                                 where=self.rec["path"])
        self.idx += 1
        if self.wanted is None or k in self.wanted:
            yield k, e, ProvenSize(chunk.nbytes)

    def _header(self, mv) -> int | None:
        """Take the header's bytes from ``mv``; the position after them, or None while the header is incomplete.

        Raises:
            IntegrityError: the header does not match the manifest's entries.
        """
        need = self.base - len(self.header_buf)
        self.header_buf += mv[:need]
        if len(self.header_buf) < self.base:
            return None
        check_header(bytes(self.header_buf), self.rec["entries"], self.rec["path"])
        self.header_checked = True
        return min(len(mv), need)

    def _buffer_for(self, k: str, size: int, want: bool):
        """Where an entry spanning chunks is assembled (None: not kept)."""
        if not want or k in self.sizes_only:
            return None
        if self.transient:
            if len(self.scratch) < size:
                self.scratch = lazy_buffer(size, self.rec["path"])  # pages taken as bytes arrive
            return memoryview(self.scratch)[:size]
        return lazy_buffer(size, self.rec["path"])

    def feed(self, chunk) -> Iterator[tuple[str, dict, Any]]:
        """The entries that end in this decoded chunk (and the empty ones before the next)."""
        mv = memoryview(chunk).cast("B") if memoryview(chunk).format != "B" else memoryview(chunk)
        pos = 0
        if not self.header_checked:
            pos = self._header(mv)
            if pos is None:
                return
        order = self.order
        while self.idx < len(order):
            k, e = order[self.idx]
            start, end = e["data_offsets"]
            size = end - start
            want = self.wanted is None or k in self.wanted
            if size == 0:
                self.idx += 1
                if want:
                    yield k, e, bytearray()
                continue
            if pos >= len(mv):
                break
            # the whole entry is in this chunk and fills most of it: a view (a small entry would
            # keep its whole chunk alive, so it is copied)
            if self.filled == 0 and pos + size <= len(mv) and 2 * size >= len(mv):
                piece = mv[pos:pos + size]
                pos += size
                self.idx += 1
                if want:
                    yield k, e, (bytearray(piece) if piece.readonly else piece)
                continue
            if self.filled == 0:
                self.cur = self._buffer_for(k, size, want)
            take = min(size - self.filled, len(mv) - pos)
            if self.cur is not None:
                self.cur[self.filled:self.filled + take] = mv[pos:pos + take]
            self.filled += take
            pos += take
            if self.filled == size:
                self.idx += 1
                done, self.cur, self.filled = self.cur, None, 0
                if want:
                    yield k, e, (SizeOnly(size) if done is None else done)

    def finish(self) -> Iterator[tuple[str, dict, Any]]:
        """Empty entries at the very end (after a proven object); then every entry must have come.

        Raises:
            IntegrityError: the member ends inside its header or before an entry.
        """
        yield from self._empty_entries()
        if not self.header_checked and self.base:
            raise IntegrityError("shard ends inside its safetensors header", where=self.rec["path"])
        if self.idx != len(self.order):
            raise IntegrityError(f"shard ends before entry {self.order[self.idx][0]}", where=self.rec["path"])


__all__ = ["EntryCutter", "ProvenSize"]
