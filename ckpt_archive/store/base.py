"""The Store protocol: where a repository's bytes live. One interface; every store passes one contract
test suite (tests/test_store_contract.py).

Keys are POSIX paths relative to the store root (``generations/00000001/manifest.json``). Members
are write-once (exclusive create); the marker is the commit (object stores have no atomic rename),
so :meth:`Store.replace_bytes` is used only for the marker and ``repository.json``.

What callers outside the stores may rely on, and nothing else (no ``isinstance`` checks, no branching
on the kind of store):

* durability: :meth:`Store.fsync_dir` makes the directory entries below a key durable where that
  means anything (a local folder) and is a no-op elsewhere (an object store's PUT is durable);
* free space: :meth:`Store.free_bytes` (``None`` when the store cannot tell);
* unfinished uploads: :meth:`Store.abort_uploads` aborts the multipart uploads a killed writer left
  below a key (``[]`` where there are none, e.g. a local folder);
* a local path: :meth:`Store.local_path` (``None`` for stores that are not a local folder), for
  callers that must refuse to write into the repository itself;
* locking: :meth:`Store.writer_lock`, the OS lock (``flock``, :class:`ckpt_archive.store.fs.WriterLock`)
  that serialises writers, on :meth:`Store.lock_file`: inside a local repository (the kernel releases it
  when the holder dies), or in the user's cache keyed by the URL for a remote one (one writer per
  machine); either way opened through the file layer, never through a link.

Every local file the stores touch goes through :mod:`ckpt_archive.store.fs` (folder descriptors,
``O_NOFOLLOW``, ``O_EXCL`` temporary files under unpredictable names).

:func:`open_store` picks the store for a path or URL: a local path (or ``file://``) is a
:class:`~ckpt_archive.store.local.LocalStore`, a URL with a scheme (``s3://bucket/prefix``,
``memory://...``) an :class:`~ckpt_archive.store.fsspec_store.FsspecStore`.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Protocol

from ckpt_archive.errors import StoreError


class Store(Protocol):
    """What every store offers (see the module docstring).

    Attributes:
        location: the store's root as a user writes it (a folder path, or ``s3://bucket/prefix``).
    """

    location: str

    def exists(self, key: str) -> bool: ...
    def listdir(self, key: str) -> list[str]: ...
    def size(self, key: str) -> int: ...
    def open_read(self, key: str) -> BinaryIO: ...
    def read_bytes(self, key: str) -> bytes: ...
    def write_once(self, key: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def write_new(self, key: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def new_object(self, folder: str, hint: str): ...
    def write_bytes_once(self, key: str, data: bytes) -> None: ...
    def replace_bytes(self, key: str, data: bytes) -> None: ...
    def remove(self, key: str) -> None: ...
    def remove_prefix(self, key: str) -> None: ...
    def claim(self, key: str) -> bool: ...
    def fsync_dir(self, key: str) -> None: ...
    def abort_uploads(self, key: str) -> list[str]: ...
    def free_bytes(self) -> int | None: ...
    def local_path(self, key: str = "") -> Path | None: ...
    def lock_file(self) -> Path: ...
    def writer_lock(self): ...


def has_scheme(url: str) -> bool:
    """True for ``s3://...`` style URLs (a Windows drive letter ``C:\\`` is not a scheme).

    Args:
        url: a path or URL.

    Returns:
        whether ``url`` starts with a scheme of two or more characters followed by ``://``.
    """
    head, sep, _ = str(url).partition("://")
    return bool(sep) and len(head) > 1 and head.replace("+", "").replace("-", "").isalnum()


def open_store(url: str | os.PathLike, **options) -> Store:
    """Open the store for a path or URL.

    Args:
        url: a local path (``str`` or path-like) or a URL with a scheme (``s3://bucket/prefix``).
        **options: for URL stores, e.g. ``endpoint_url=``, ``storage_options=``.

    Returns:
        a :class:`~ckpt_archive.store.local.LocalStore` or an
        :class:`~ckpt_archive.store.fsspec_store.FsspecStore`.

    Raises:
        StoreError: a URL scheme without an fsspec implementation installed (e.g. s3 without s3fs).
    """
    from ckpt_archive.store.local import LocalStore

    text = os.fspath(url)
    if text.startswith("file://"):
        return LocalStore(text[len("file://"):])
    if has_scheme(text):
        try:
            from ckpt_archive.store.fsspec_store import FsspecStore
        except ModuleNotFoundError as exc:
            raise StoreError(f"remote stores need the fsspec backend ({exc.name} is missing)", where=text) from None
        return FsspecStore(text, **options)
    return LocalStore(text)


__all__ = ["Store", "has_scheme", "open_store"]
