"""A local (or mounted) folder as a :class:`~ckpt_archive.store.base.Store`.

:class:`LocalStore` fsyncs every file it writes and the folders it changes; its writer lock is
``REPO/.lock``. The protocol, :func:`~ckpt_archive.store.base.open_store` and
:func:`~ckpt_archive.store.base.has_scheme` live in :mod:`ckpt_archive.store.base` (re-exported here).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

from ckpt_archive.errors import InsufficientSpace, LinkInRepository, NotFound, StoreError, UnsafePath
from ckpt_archive.format.paths import check_relpath
from ckpt_archive.store.base import Store, has_scheme, open_store  # noqa: F401  (re-exported)


def fsync_directory(path: str | os.PathLike) -> None:
    """Make a local folder's entries (files created, renamed or removed in it) durable.

    Best effort: a folder that cannot be opened (absent, or a platform without directory fsync) is
    skipped silently, as there is nothing more to make durable.

    Args:
        path: the folder.
    """
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
    fsync_directory(p.parent)


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


@contextlib.contextmanager
def _disk_full_named(step: str, path: Path) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT into :class:`InsufficientSpace` naming the step and the path (exit 2)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            raise InsufficientSpace(f"disk full while {step} {path}: {exc.strerror}", where=str(path)) from None
        raise


class LocalStore:
    """A folder on a local (or mounted) file system.

    Args:
        root: the repository folder; need not exist yet (writes create parents).
    """

    is_local = True  # informational; callers use local_path() / lock_file(), never this flag

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().absolute()
        self.location = str(self.root)

    def path(self, key: str, *, final_link_ok: bool = False) -> Path:
        """The file system path of ``key``, checked before any I/O: ``key`` is a relative path of plain
        names (:func:`~ckpt_archive.format.paths.check_relpath`) and no part of it below the root is a
        symbolic link, so nothing read, written or deleted through a key leaves the repository.

        Raises:
            UnsafePath: (exit 1) the key breaks the path rule or goes through a link inside a generation.
            LinkInRepository: (exit 2) it goes through a link in the repository's own skeleton.
        """
        if not key:
            return self.root
        check_relpath(key, where=self.location, what="store key")
        cur = self.root
        parts = key.split("/")
        for i, part in enumerate(parts):
            cur = cur / part
            if final_link_ok and i == len(parts) - 1:
                break  # removing a link itself (never what it points to) is allowed
            try:
                mode = os.lstat(cur).st_mode
            except (FileNotFoundError, NotADirectoryError):
                break
            except OSError:
                break  # unreadable here: the operation itself reports it
            if stat.S_ISLNK(mode):
                rel = cur.relative_to(self.root)
                # the repository's own skeleton (repository.json, generations/, the lock): the operation cannot
                # be carried out (exit 2); a generation folder or member that is a link: that generation is
                # damaged here (exit 1)
                cls = LinkInRepository if len(rel.parts) == 1 else UnsafePath
                raise cls(f"{rel} is a symbolic link; a repository is never read, written or deleted through one "
                          f"(remove the link by hand if it is yours)", where=self.location)
        return self.root / key

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def listdir(self, key: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(key)))
        except (FileNotFoundError, NotADirectoryError):  # a file where a folder should be: nothing in it
            return []

    def size(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound("missing", where=key) from None

    def open_read(self, key: str) -> BinaryIO:
        """Open ``key`` for reading: a regular file only.

        Raises:
            NotFound: absent (or a file stands where one of its folders should be).
            UnsafePath: (exit 1) not a regular file -- a FIFO, device, socket or folder planted where a
                member should be is refused before any read (a FIFO would block the reader forever).
        """
        p = self.path(key)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound("missing", where=key) from None
        except OSError as exc:
            if exc.errno in (errno.ENXIO, errno.ELOOP, errno.EOPNOTSUPP):  # a socket, a link, a device gone
                raise UnsafePath(f"{key} is not a regular file ({exc.strerror}); a repository is only read "
                                 f"through regular files", where=self.location) from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                        else "a device or socket")
                raise UnsafePath(f"{key} is {kind}, not a regular file; a repository is only read through "
                                 f"regular files", where=self.location)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

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
            with _disk_full_named("writing", p):
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            with contextlib.suppress(OSError):
                fh.close()

    @contextlib.contextmanager
    def write_new(self, key: str) -> Iterator[BinaryIO]:
        """Create ``key`` atomically and exclusively: written under ``.NAME.tmp-PID``, fsynced, then
        hard-linked to its name (fails if it exists) and the temporary name removed; the folder is
        fsynced. A reader never sees a partial file; on an exception nothing is left.

        Raises:
            StoreError: ``key`` already exists. OSError: the write failed.
        """
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(p)
        fh = open(tmp, "wb")
        try:
            with _disk_full_named("writing", p):
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            fh.close()
            try:
                os.link(tmp, p)
            except FileExistsError:
                raise StoreError("refusing to overwrite a write-once object", where=key) from None
        finally:
            with contextlib.suppress(OSError):
                fh.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
        fsync_directory(p.parent)

    def new_object(self, folder: str, hint: str) -> "_LocalPending":
        """Start a file whose name is decided when it is complete (a content-addressed object): written
        under ``folder/.HINT.tmp-PID``; :meth:`PendingObject.commit` fsyncs it and hard-links it to its
        final key (never replacing one), :meth:`PendingObject.abort` removes it.

        Raises:
            OSError: the temporary file cannot be created.
        """
        tmp = self.path(f"{folder}/.{hint}.tmp-{os.getpid()}")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        return _LocalPending(self, tmp, open(tmp, "wb"))

    def write_bytes_once(self, key: str, data: bytes) -> None:
        with self.write_once(key) as fh:
            fh.write(data)

    def replace_bytes(self, key: str, data: bytes) -> None:
        """Atomic replace: write a temporary sibling, fsync, rename over, fsync the folder (:func:`write_atomic`)."""
        p = self.path(key)
        with _disk_full_named("replacing", p):
            write_atomic(p, data)

    def remove(self, key: str) -> None:
        try:
            self.path(key, final_link_ok=True).unlink()  # a symbolic link is unlinked, never followed
        except FileNotFoundError:
            pass

    def remove_prefix(self, key: str) -> None:
        p = self.path(key, final_link_ok=True)
        if p.is_symlink():
            p.unlink()  # the link itself; what it points to is never touched
        elif p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        fsync_directory(p.parent)

    def claim(self, key: str) -> bool:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.fsync(fd)
        os.close(fd)
        fsync_directory(p.parent)
        fsync_directory(p.parent.parent)
        return True

    def fsync_dir(self, key: str) -> None:
        fsync_directory(self.path(key))

    def abort_uploads(self, key: str) -> list[str]:
        """``[]``: a local write has no hidden upload (a cut-off file is visible and replaced by its writer)."""
        return []

    def free_bytes(self) -> int | None:
        """Free bytes on the file system holding the folder (its nearest existing parent)."""
        p = self.root
        while not p.exists() and p != p.parent:
            p = p.parent
        return shutil.disk_usage(p).free

    def local_path(self, key: str = "") -> Path:
        """The file system path of ``key`` (the root for ``""``)."""
        return self.path(key)

    def lock_file(self) -> Path:
        """``REPO/.lock``: an OS lock the kernel releases when the holder dies."""
        return self.root / ".lock"

    def __repr__(self) -> str:
        return f"LocalStore({self.location!r})"


class _LocalPending:
    """A :meth:`LocalStore.new_object` in progress: ``fh`` to write, then ``commit(key)`` or ``abort()``."""

    def __init__(self, store: "LocalStore", tmp: Path, fh):
        self.store, self.tmp, self.fh = store, tmp, fh

    def commit(self, key: str, *, sync_dir: bool = True, replace: bool = False) -> bool:
        """Make the file visible as ``key``: True, or False when ``key`` already exists (nothing replaced,
        the temporary file removed). ``replace=True``: an existing ``key`` is replaced atomically
        (rename over it: a reader sees the old file or the new one). ``sync_dir=False`` leaves the
        folder's fsync to the caller (one :meth:`LocalStore.fsync_dir` for many objects). Raises OSError
        (the temporary file is removed)."""
        try:
            with _disk_full_named("writing", self.tmp):
                self.fh.flush()
                os.fsync(self.fh.fileno())
            self.fh.close()
            p = self.store.path(key)
            p.parent.mkdir(parents=True, exist_ok=True)
            if replace:
                os.replace(self.tmp, p)
            else:
                try:
                    os.link(self.tmp, p)
                except FileExistsError:
                    return False
            if sync_dir:
                fsync_directory(p.parent)
            return True
        finally:
            with contextlib.suppress(OSError):
                self.fh.close()
            with contextlib.suppress(OSError):
                self.tmp.unlink()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


__all__ = ["LocalStore", "fsync_directory", "Store", "has_scheme", "open_store"]
