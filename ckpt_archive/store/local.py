"""Stores: where a repository's bytes live. One interface, every store passes one contract test suite.

Keys are POSIX paths relative to the store root (``generations/00000001/manifest.json``). Members
are write-once (exclusive create); the marker is the commit (object stores have no atomic rename),
so :meth:`Store.replace_bytes` is used only for the marker and ``repository.json``.

:class:`LocalStore` also fsyncs every file it writes and the folders it changes. URLs with a scheme
(``s3://bucket/prefix``, ``memory://...``) go to :mod:`ckpt_archive.store.fsspec_store`.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol

from ckpt_archive.errors import NotFound, StoreError


class Store(Protocol):
    """What every store offers (see module docstring)."""

    location: str
    is_local: bool

    def exists(self, key: str) -> bool: ...
    def listdir(self, key: str) -> list[str]: ...
    def size(self, key: str) -> int: ...
    def open_read(self, key: str) -> BinaryIO: ...
    def read_bytes(self, key: str) -> bytes: ...
    def write_once(self, key: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def write_bytes_once(self, key: str, data: bytes) -> None: ...
    def replace_bytes(self, key: str, data: bytes) -> None: ...
    def remove(self, key: str) -> None: ...
    def remove_prefix(self, key: str) -> None: ...
    def claim(self, key: str) -> bool: ...
    def fsync_dir(self, key: str) -> None: ...


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_sibling(path: Path) -> Path:
    """The temporary name an atomic replace of ``path`` writes first: ``.NAME.tmp-PID`` beside it
    (``ckpt-archive gc`` removes such leftovers of an interrupted write)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success fsync it, rename it over ``path`` and
    fsync the folder, so a reader sees the old file or the whole new one, never a part.

    The folder is created if absent. On an exception the temporary file is removed and ``path`` is
    left as it was.

    Args:
        path: the file to create or replace.

    Yields:
        The temporary path (``.NAME.tmp-PID`` beside ``path``); the caller writes the whole file there.

    Raises:
        OSError: the temporary file was not written, or the rename failed.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(p)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(p.parent)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Create or replace the file ``path`` with ``data`` atomically (temporary sibling, fsync, rename,
    fsync of the folder): the one temp-file-then-rename writer.

    Args:
        path: the file to write.
        data: its whole new content.

    Raises:
        OSError: the write or the rename failed; ``path`` is unchanged and no temporary file is left.
    """
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)  # atomic_path fsyncs it before the rename


class LocalStore:
    """A folder on a local (or mounted) file system.

    Args:
        root: the repository folder; need not exist yet (writes create parents).
    """

    is_local = True

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().absolute()
        self.location = str(self.root)

    def path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def listdir(self, key: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(key)))
        except FileNotFoundError:
            return []

    def size(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound("missing", where=key) from None

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self.path(key), "rb")
        except FileNotFoundError:
            raise NotFound("missing", where=key) from None

    def read_bytes(self, key: str) -> bytes:
        with self.open_read(key) as fh:
            return fh.read()

    @contextlib.contextmanager
    def write_once(self, key: str) -> Iterator[BinaryIO]:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            fh = open(p, "xb")
        except FileExistsError:
            raise StoreError("refusing to overwrite a write-once member", where=key) from None
        try:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            fh.close()

    def write_bytes_once(self, key: str, data: bytes) -> None:
        with self.write_once(key) as fh:
            fh.write(data)

    def replace_bytes(self, key: str, data: bytes) -> None:
        """Atomic replace: write a temporary sibling, fsync, rename over, fsync the folder (:func:`write_atomic`)."""
        write_atomic(self.path(key), data)

    def remove(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass

    def remove_prefix(self, key: str) -> None:
        p = self.path(key)
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        _fsync_dir(p.parent)

    def claim(self, key: str) -> bool:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.fsync(fd)
        os.close(fd)
        _fsync_dir(p.parent)
        _fsync_dir(p.parent.parent)
        return True

    def fsync_dir(self, key: str) -> None:
        _fsync_dir(self.path(key))

    def free_bytes(self) -> int | None:
        p = self.root
        while not p.exists() and p != p.parent:
            p = p.parent
        return shutil.disk_usage(p).free


def has_scheme(url: str) -> bool:
    """True for ``s3://...`` style URLs (a Windows drive letter ``C:\\`` is not a scheme)."""
    head, sep, _ = str(url).partition("://")
    return bool(sep) and len(head) > 1 and head.replace("+", "").replace("-", "").isalnum()


def open_store(url: str | os.PathLike, **options) -> Store:
    """Open the store for a path or URL.

    Args:
        url: a local path (``str`` or path-like) or a URL with a scheme (``s3://bucket/prefix``).
        **options: for URL stores, e.g. ``endpoint_url=``, ``storage_options=``.

    Raises:
        StoreError: a URL scheme without an fsspec implementation installed (e.g. s3 without s3fs).
    """
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
