"""``crc32(data, value=0) -> int``: the CRC-32 of zip records (:mod:`ckpt_archive.format.exact_bytes`) and of
stored chunks just written (the write check of :mod:`ckpt_archive.format.member_writer`, checked again by
:func:`ckpt_archive.format.codec.iter_decoded`). zlib's checksum at ISA-L's speed where python-isal is
installed (~5x zlib's here); its own module so that importing a fingerprint or a size limit (the CLI's
start-up) does not import ISA-L.
"""
from __future__ import annotations

try:  # ISA-L's CRC-32 (python-isal): the same checksum (zlib.crc32's signature)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without an isal wheel
    from zlib import crc32

__all__ = ["crc32"]
