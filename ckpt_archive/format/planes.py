"""Byte planes of float chunks: byte grouping, the sign rotation of format 3, and the buffers they use.

By concern: the array work on a chunk's bytes, used by :mod:`ckpt_archive.format.codec` (which encodes
and decodes chunks with it) and by readers that need an anonymous buffer. The encodings are defined in docs/FORMAT.md, "Member encoding"; measurements in
benchmarks/README.md ("Sign rotation"). Everything here is vectorised NumPy on whole chunks.
"""
from __future__ import annotations

import threading

_UINT = {2: "<u2", 4: "<u4", 8: "<u8"}
#: Scratch arrays are at least this large (the default chunk size), so one serves every chunk.
SCRATCH_BYTES = 4 << 20

_tls = threading.local()


def anon_buffer(nbytes: int):
    """A writable, zero-filled ``numpy.uint8`` array of ``nbytes`` over private anonymous memory (``mmap``),
    whose pages are taken only as they are written, 4 KiB at a time.

    Why not ``numpy.empty``/``zeros``: NumPy advises the kernel to back arrays of 4 MiB or more with
    transparent huge pages (``madvise(MADV_HUGEPAGE)``); where memory is fragmented the first touch then
    compacts and zeroes 2 MiB at a time. Measured on the 2-core benchmark machine: filling a fresh
    256 MiB ``numpy.empty`` took 4.2-5.3 s (2.0-2.5 s CPU), the same without the advice 0.24-0.32 s.
    """
    import mmap

    import numpy as np

    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # pragma: no cover - Windows
        return np.zeros(nbytes, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)


#: ``madvise`` advice that takes a range's pages at once, as writing them would (Linux 5.14+); Python 3.11's
#: ``mmap`` module does not name it.
_MADV_POPULATE_WRITE = 23


def populate(buf, start: int, nbytes: int) -> bool:
    """Take the pages of bytes ``[start, start + nbytes)`` of an :func:`anon_buffer` now, in one system call
    (``madvise(MADV_POPULATE_WRITE)``), just before they are written.

    Why: the first write to each fresh 4 KiB page otherwise traps into the kernel once per page. Measured on
    the 2-core benchmark machine (issue 29, 20261202): ungrouping a load's 4 MiB chunks into fresh memory
    took 1.30 ns per byte with a fault per page, 0.96 with each chunk's range populated first, 0.57 into
    pages already taken (median of 8; benchmarks/README.md, "load against torch.load").

    Args:
        buf: the array :func:`anon_buffer` returned (whole, not a slice); anything else is left alone.
        start: first byte. nbytes: bytes from there (the range is widened down to a page boundary).

    Returns:
        True when the pages were taken; False when ``buf`` is not such a buffer or the kernel does not
        offer the advice (its pages are then taken by faults as they are written, as before). Never raises.
    """
    import mmap

    mm = getattr(getattr(buf, "base", None), "obj", None)
    if not isinstance(mm, mmap.mmap) or nbytes <= 0 or start < 0 or start + nbytes > len(mm) \
            or len(mm) != getattr(buf, "nbytes", -1) or not hasattr(mm, "madvise"):
        return False
    lo = start - start % mmap.PAGESIZE
    try:
        mm.madvise(_MADV_POPULATE_WRITE, lo, start + nbytes - lo)
    except (OSError, ValueError):  # before Linux 5.14 (EINVAL), or memory the kernel cannot give now
        return False
    return True


def scratch(slot: str, nbytes: int):
    """A thread-local ``numpy.uint8`` work array of ``nbytes``, reused across chunks (never returned to a
    caller who keeps it). A fresh 4 MiB array costs a page fault per 4 KiB on first touch, ~0.2 ns per
    byte: as much as the rotation itself. Sizes above 16 MiB (unusual ``chunk_bytes``) are not kept.

    Args:
        slot: the name of the reuse slot (one array per slot and thread). nbytes: bytes needed.

    Returns:
        a ``numpy.uint8`` array of at least ``nbytes`` (its first ``nbytes`` are the caller's until the
        next call for the same slot on this thread); allocating may raise MemoryError.
    """
    if nbytes > (16 << 20):
        return anon_buffer(nbytes)
    bufs = getattr(_tls, "scratch", None)
    if bufs is None:
        bufs = _tls.scratch = {}
    a = bufs.get(slot)
    if a is None or len(a) < nbytes:
        a = bufs[slot] = anon_buffer(max(nbytes, SCRATCH_BYTES))
    return a[:nbytes]


#: Elements per block of :func:`byte_group` / :func:`byte_ungroup`: a block's work arrays (256 KiB of
#: fp32 elements, its planes, one temporary) stay in the core's L2 cache while every pass runs over them.
#: Measured on the 2-core benchmark machine, 4 MiB fp32 chunks, sign-rotated: grouping 0.52 -> 0.29 ns/B,
#: ungrouping into fresh memory 0.89 -> 0.65 ns/B (benchmarks/README.md, "Blocked byte planes").
BLOCK_ELEMS = 1 << 16


def byte_group(raw, n: int, rotate: bool = False, out=None):
    """Split ``raw`` (length a multiple of ``n``) into ``n`` planes: byte k of every element -> plane k.

    Args:
        raw: bytes-like, a whole number of ``n``-byte elements.
        n: element size in bytes (2, 4 or 8 when ``rotate``).
        rotate: first rotate every element, read as a little-endian ``n``-byte unsigned integer, left
            by one bit (the sign bit of an IEEE float goes to bit 0; for bf16/fp32 the top byte is then
            the whole exponent).
        out: optional writable buffer of ``len(raw)`` bytes to write the planes into.

    Returns:
        a contiguous ``numpy.uint8`` array of ``len(raw)`` bytes (planes back to back; over ``out`` if
        given); bytes-like. Up to :data:`SMALL_PLANES_BYTES` without ``out``: a 1-D ``memoryview`` of the
        same bytes, made without NumPy (:func:`_group_small`).
    """
    if out is None and len(memoryview(raw).cast("B")) <= SMALL_PLANES_BYTES:
        return _group_small(raw, n, rotate)
    import numpy as np

    a = np.frombuffer(raw, dtype=np.uint8)
    dest = np.empty(len(a), dtype=np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
    if len(dest) != len(a):
        raise ValueError(f"out has {len(dest)} bytes, raw {len(a)}")
    if not len(a):
        return dest
    planes = dest.reshape(n, -1)
    if n in (2, 4):
        # plane k = the low byte of a shift of each element (a SIMD shift, then a truncating cast), one
        # cache-sized block at a time; rotated: byte k of (u <<< 1) is bits 8k-1 .. 8k+6 of u for k >= 1,
        # byte 0 is bits 0..6 of u moved up one, with the sign bit below them
        u = a.view(_UINT[n])
        tmp = scratch("tmp", min(len(u), BLOCK_ELEMS) * n).view(_UINT[n])
        for s in range(0, len(u), BLOCK_ELEMS):
            e = min(len(u), s + BLOCK_ELEMS)
            ub, tb = u[s:e], tmp[:e - s]
            for k in range(n - 1, 0, -1):
                np.right_shift(ub, 8 * k - 1 if rotate else 8 * k, out=tb)
                np.copyto(planes[k, s:e], tb, casting="unsafe")
            if rotate:
                np.left_shift(ub, 1, out=tb)
                np.copyto(planes[0, s:e], tb, casting="unsafe")
                np.right_shift(ub, 8 * n - 1, out=tb)
                np.bitwise_or(planes[0, s:e], tb, out=planes[0, s:e], casting="unsafe")
            else:
                np.copyto(planes[0, s:e], ub, casting="unsafe")
        return planes
    if rotate:
        u = a.view(_UINT[n])
        r = scratch("rot", len(a)).view(_UINT[n])
        tmp = scratch("tmp", len(a)).view(_UINT[n])
        np.left_shift(u, 1, out=r)
        np.right_shift(u, 8 * n - 1, out=tmp)
        np.bitwise_or(r, tmp, out=r)
        a = r.view(np.uint8)
    np.copyto(planes, a.reshape(-1, n).T)
    return planes


def _rotr1_inplace(u, n: int, low=None) -> None:
    """Rotate each unsigned ``n``-byte element of ``u`` right by one bit, in place (undoes the rotation
    of :func:`byte_group`). ``low``: a work array like ``u`` (else a thread-local scratch one)."""
    import numpy as np

    if low is None:
        low = scratch("tmp", u.nbytes).view(u.dtype)
    np.left_shift(u, 8 * n - 1, out=low)
    u >>= 1
    u |= low


def byte_ungroup(planes, n: int, out=None, rotate: bool = False) -> memoryview:
    """Inverse of :func:`byte_group`: interleave ``n`` planes back into elements.

    Args:
        planes: bytes-like, ``n`` planes back to back.
        out: optional writable buffer of ``len(planes)`` bytes to write into (no allocation).
        rotate: the planes were grouped with ``rotate=True``: rotate every element back right by one bit.

    Returns:
        a 1-D ``memoryview`` (format ``B``) over ``out`` or a fresh writable array.

    Raises:
        ValueError: ``out`` has the wrong size, or ``len(planes)`` is not a multiple of ``n``.
    """
    if len(memoryview(planes).cast("B")) <= SMALL_PLANES_BYTES:
        return _ungroup_small(planes, n, out, rotate)
    import numpy as np

    a = np.frombuffer(planes, dtype=np.uint8)
    if len(a) % n:
        raise ValueError(f"{len(a)} bytes of planes are not a multiple of {n}")
    p = a.reshape(n, -1)
    dest = np.empty(len(a), dtype=np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
    if len(dest) != len(a):
        raise ValueError(f"out has {len(dest)} bytes, planes {len(a)}")
    if n in (2, 4):
        # each element built as (p[n-1] << 8 | ... ) | p[0] on unsigned integers (SIMD), then rotated
        # back, one cache-sized block at a time: the destination is written by one pass per block while
        # its lines are in the cache (a strided per-plane copy is ~4x slower)
        u = dest.view(_UINT[n])
        tmp = scratch("tmp", min(len(u), BLOCK_ELEMS) * n).view(_UINT[n]) if rotate else None
        for s in range(0, len(u), BLOCK_ELEMS):
            e = min(len(u), s + BLOCK_ELEMS)
            ob = u[s:e]
            np.copyto(ob, p[n - 1, s:e])
            for k in range(n - 2, -1, -1):
                ob <<= 8
                ob |= p[k, s:e]
            if rotate:
                _rotr1_inplace(ob, n, tmp[:e - s])
        return memoryview(dest)
    rows = dest.reshape(-1, n)
    for k in range(n):  # one column at a time: ~4x the transposed copy
        rows[:, k] = p[k]
    if rotate and len(dest):
        _rotr1_inplace(dest.view(_UINT[n]), n)
    return memoryview(dest)


#: Planes up to this many bytes are put back without NumPy (:func:`_ungroup_small`): a command that reads
#: only a few small tensors (the policy audit of ``verify`` and ``inspect``) then does not import it (~0.1 s).
SMALL_PLANES_BYTES = 64 << 10


def _group_small(raw, n: int, rotate: bool = False) -> memoryview:
    """:func:`byte_group` in plain Python for small inputs (what :func:`_ungroup_small` undoes): the rotation
    done on the whole chunk as one integer (each element's top bit moved to its bit 0, the rest shifted up
    one bit, with masks repeated per element), then each plane taken with one extended slice."""
    src = bytes(memoryview(raw).cast("B"))
    if len(src) % n:
        raise ValueError(f"{len(src)} bytes are not a multiple of {n}")
    m = len(src) // n
    if rotate and m:
        x = int.from_bytes(src, "little")
        top = int.from_bytes((b"\x00" * (n - 1) + b"\x80") * m, "little")
        rest = int.from_bytes((b"\xff" * (n - 1) + b"\x7f") * m, "little")
        src = (((x & rest) << 1) | ((x & top) >> (8 * n - 1))).to_bytes(len(src), "little")
    return memoryview(b"".join(src[k::n] for k in range(n)))


def _ungroup_small(planes, n: int, out=None, rotate: bool = False) -> memoryview:
    """:func:`byte_ungroup` in plain Python for small inputs: each plane put back with one extended-slice
    assignment, the rotation undone on the whole chunk as one integer (each element's lowest bit moved to
    its top, the rest shifted down one bit, with masks repeated per element)."""
    src = bytes(memoryview(planes).cast("B"))
    if len(src) % n:
        raise ValueError(f"{len(src)} bytes of planes are not a multiple of {n}")
    m = len(src) // n
    dest = bytearray(len(src))
    for k in range(n):
        dest[k::n] = src[k * m:(k + 1) * m]
    if rotate and m:
        x = int.from_bytes(dest, "little")
        low = int.from_bytes((b"\x01" + b"\x00" * (n - 1)) * m, "little")
        keep = int.from_bytes((b"\xff" * (n - 1) + b"\x7f") * m, "little")
        dest = bytearray((((x >> 1) & keep) | ((x & low) << (8 * n - 1))).to_bytes(len(src), "little"))
    if out is None:
        return memoryview(dest)
    view = memoryview(out).cast("B")
    if len(view) != len(dest):
        raise ValueError(f"out has {len(view)} bytes, planes {len(dest)}")
    view[:] = dest
    return view


__all__ = ["SCRATCH_BYTES", "anon_buffer", "populate", "BLOCK_ELEMS", "byte_group", "byte_ungroup", "SMALL_PLANES_BYTES"]
