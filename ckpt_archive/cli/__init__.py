"""The ``ckpt-archive`` command line: parsing and rendering only; the work is done by :mod:`ckpt_archive.ops`."""


__all__ = []
