"""The safetensors header: the one writer and the one parser in ckpt-archive.

A safetensors file is ``<u64 little-endian N> <N bytes of JSON header> <tensor bytes>``; the header
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
end of the header) plus an optional ``"__metadata__"`` of str -> str. ckpt-archive writes its tensor
shards in this layout (docs/FORMAT.md, "Tensor shards"), with the header padded with spaces to a
multiple of 8 bytes as the safetensors library does.

Used by the member writer (:func:`encode_header`), the reader (:func:`check_header`, which compares a
stored shard's header with the manifest) and ``backup``'s completeness check of a source file
(:func:`file_problem`). Everything read is hostile: sizes are bounded before anything is allocated.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping

from ckpt_archive.errors import IntegrityError
from ckpt_archive.format import jsonio
# A header larger than MAX_HEADER_BYTES is refused: one limit for sources and archives (format/limits.py).
from ckpt_archive.format.limits import MAX_HEADER_BYTES, MAX_HEADER_COST

LENGTH_BYTES = 8


def encode_header(entries: Mapping[str, Mapping[str, Any]], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes that precede the tensor data of a safetensors file: length prefix and padded JSON header.

    Args:
        entries: ``{name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}}`` in file order.
        metadata: the ``__metadata__`` map (str -> str), or None for none.

    Returns:
        ``struct.pack("<Q", N) + header_json`` where ``N % 8 == 0`` (padded with spaces).
    """
    head: dict[str, Any] = {}
    if metadata is not None:
        head["__metadata__"] = dict(metadata)
    head.update(entries)
    header_json = json.dumps(head, separators=(",", ":")).encode("utf-8")
    header_json += b" " * (-len(header_json) % 8)   # safetensors: header padded to 8 bytes
    return struct.pack("<Q", len(header_json)) + header_json


def header_length(head: bytes) -> int:
    """The JSON header's length from the first 8 bytes of a safetensors file.

    Raises:
        ValueError: fewer than 8 bytes.
    """
    if len(head) < LENGTH_BYTES:
        raise ValueError(f"{len(head)} bytes, a safetensors file starts with an 8-byte length")
    return struct.unpack("<Q", head[:LENGTH_BYTES])[0]


def parse_header(prefix: bytes) -> tuple[dict[str, Any], dict[str, str]]:
    """Split a safetensors prefix (length + JSON header) into the tensor entries and ``__metadata__``.

    Args:
        prefix: the first ``8 + N`` bytes of the file (more is ignored).

    Returns:
        ``(entries, metadata)``: ``{name: {"dtype", "shape", "data_offsets"}}`` and the metadata map.

    Raises:
        ValueError: the length is missing, the header (cut at the bytes given) is not UTF-8 JSON
            (an object), or ``__metadata__`` does not map str to str. The message says which.
    """
    n = header_length(prefix)
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header claims {n} bytes, more than {MAX_HEADER_BYTES}")
    try:  # a length beyond the bytes given leaves a truncated JSON text: refused below
        header = jsonio.loads(prefix[LENGTH_BYTES:LENGTH_BYTES + n], where="safetensors header",
                              max_bytes=MAX_HEADER_BYTES, max_cost=MAX_HEADER_COST)
    except ValueError as exc:
        raise ValueError(f"safetensors header is not valid JSON ({getattr(exc, 'message', exc)})") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not valid JSON")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("safetensors __metadata__ must map str to str")
    return header, meta


def check_header(prefix: bytes, entries: Mapping[str, Mapping[str, Any]], member: str) -> None:
    """Check a stored shard's header against the manifest's record of its entries.

    Args:
        prefix: the shard's first ``header_bytes`` raw bytes.
        entries: the manifest's ``members[].entries`` for this shard.
        member: the member's path, named in the error.

    Raises:
        IntegrityError: the header does not parse, or disagrees (dtype, shape, offsets) for an entry.
    """
    try:
        header, _ = parse_header(prefix)
    except ValueError as exc:
        raise IntegrityError(str(exc), where=member) from None
    for k, e in entries.items():
        h = header.get(k)
        try:
            same = (h is not None and h["dtype"] == e["dtype"] and list(h["shape"]) == list(e["shape"])
                    and list(h["data_offsets"]) == list(e["data_offsets"]))
        except (KeyError, TypeError):
            same = False
        if not same:
            raise IntegrityError(f"safetensors header disagrees with the manifest for {k!r}", where=member)


def file_problem(path: str | os.PathLike) -> str | None:
    """Why a safetensors file on disk is not whole yet (``backup``'s completeness check), or None.

    Reads only the header (bounded by :data:`MAX_HEADER_BYTES`): the file's size must equal
    ``8 + N + `` the largest end offset.

    Args:
        path: the file.

    Returns:
        one line saying what is wrong, or None when the size matches the header.
    """
    size = os.stat(path).st_size
    with open(path, "rb") as fh:
        head = fh.read(LENGTH_BYTES)
        if len(head) < LENGTH_BYTES:
            return f"safetensors file of {size} bytes has no header"
        n = header_length(head)
        if n > size - LENGTH_BYTES or n > MAX_HEADER_BYTES:
            return f"safetensors header claims {n} bytes but the file has {size}"
        try:
            header = jsonio.loads(fh.read(n), where=str(path), max_bytes=MAX_HEADER_BYTES, max_cost=MAX_HEADER_COST)
        except ValueError:
            return "safetensors header is not whole JSON"
    end = 0
    for key, meta in (header.items() if isinstance(header, dict) else ()):
        if key != "__metadata__" and isinstance(meta, dict):
            offsets = meta.get("data_offsets", [0, 0])
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
                return f"safetensors header entry {key!r} has data_offsets {offsets!r}"
            end = max(end, offsets[1])
    if LENGTH_BYTES + n + end != size:
        return f"safetensors data ends at byte {LENGTH_BYTES + n + end} but the file has {size} bytes"
    return None


__all__ = ["encode_header", "parse_header", "check_header", "file_problem", "header_length", "MAX_HEADER_BYTES"]
