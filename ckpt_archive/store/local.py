"""A local (or mounted) folder as a :class:`~ckpt_archive.store.base.Store`.

Every operation goes through the file layer (:mod:`ckpt_archive.store.fs`): the root is resolved once per
operation (it may be the user's symbolic link to another disk); below it each folder is opened
``O_NOFOLLOW | O_DIRECTORY`` relative to its parent's descriptor and each file ``O_NOFOLLOW``, so nothing is
read, written, renamed or deleted through a link inside the repository. A link in the repository's own
skeleton (``repository.json``, ``generations``, ``objects``, ``.lock``) is
:class:`~ckpt_archive.errors.LinkInRepository` (exit 2); one deeper (a generation folder, a member, an
object) is :class:`~ckpt_archive.errors.UnsafePath` (exit 1). Temporary files are created ``O_EXCL`` under
unpredictable names. :class:`LocalStore` fsyncs every file it writes and the folders it changes; its
writer lock is ``REPO/.lock``. The protocol, :func:`~ckpt_archive.store.base.open_store` and
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
from ckpt_archive.store import fs
from ckpt_archive.store.base import Store, has_scheme, open_store  # noqa: F401  (re-exported)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Create or replace the file ``path`` with ``data`` atomically (:func:`ckpt_archive.store.fs.write_file_atomic`:
    a fresh ``O_EXCL`` temporary file beside it, fsync, rename, fsync of the folder).

    Raises:
        OSError: the write or the rename failed; ``path`` is unchanged and no temporary file is left.
    """
    fs.write_file_atomic(path, data)


@contextlib.contextmanager
def _disk_full_named(step: str, path) -> Iterator[None]:
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
        root: the repository folder; need not exist yet (writes create it and its parents).
    """

    is_local = True  # informational; callers use local_path() / writer_lock(), never this flag

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().absolute()
        self.location = str(self.root)

    # -- the layer -----------------------------------------------------------------------------------
    def _refuse(self, rel: str, root: str) -> Exception:
        # the repository's own skeleton (repository.json, generations/, objects/, the lock): the operation
        # cannot be carried out (exit 2); a generation folder or member that is a link: that generation is
        # damaged here (exit 1)
        cls = LinkInRepository if "/" not in rel else UnsafePath
        return cls(f"{rel} is a symbolic link; a repository is never read, written or deleted through one "
                   f"(remove the link by hand if it is yours)", where=self.location)

    def _root(self, create: bool = False) -> fs.Dir:
        return fs.Dir.open(self.root, create=create, refuse=self._refuse)

    def _parts(self, key: str) -> list[str]:
        check_relpath(key, where=self.location, what="store key")
        return key.split("/")

    @contextlib.contextmanager
    def _parent(self, key: str, *, create: bool = False) -> Iterator[tuple[fs.Dir, str]]:
        """The open folder holding ``key``'s last name, and that name (folders created with ``create``).

        Raises:
            FileNotFoundError / NotADirectoryError: a folder on the way is absent or is not a folder.
            UnsafePath / LinkInRepository: a folder on the way is a symbolic link.
        """
        parts = self._parts(key)
        with self._root(create) as root, root.walk(parts[:-1], create=create) as d:
            yield d, parts[-1]

    @contextlib.contextmanager
    def _folder(self, key: str, *, create: bool = False) -> Iterator[fs.Dir]:
        with self._root(create) as root, root.walk(self._parts(key) if key else [], create=create) as d:
            yield d

    def path(self, key: str) -> Path:
        """The file system path of ``key`` (for messages and for callers that must refuse to write into
        the repository), after the path rule; no I/O, never used to reach the file."""
        if not key:
            return self.root
        self._parts(key)
        return self.root / key

    # -- reading -------------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """True when something is at ``key``.

        Raises:
            UnsafePath / LinkInRepository: ``key`` or a folder on its way is a symbolic link.
        """
        if not key:
            return self.root.exists()
        try:
            with self._parent(key) as (d, name):
                st = d.lstat(name)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise self._refuse(key, self.location)
        return st is not None

    def listdir(self, key: str) -> list[str]:
        try:
            with self._folder(key) as d:
                return d.listdir()
        except (FileNotFoundError, NotADirectoryError):  # a file where a folder should be: nothing in it
            return []

    def size(self, key: str) -> int:
        try:
            with self._parent(key) as (d, name):
                st = d.lstat(name)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None:
            raise NotFound("missing", where=key)
        if stat.S_ISLNK(st.st_mode):
            raise self._refuse(key, self.location)
        return st.st_size

    def open_read(self, key: str) -> BinaryIO:
        """Open ``key`` for reading: a regular file only, never through a link.

        Raises:
            NotFound: absent (or a file stands where one of its folders should be).
            UnsafePath: (exit 1) a link, or not a regular file -- a FIFO, device, socket or folder planted
                where a member should be is refused before any read (a FIFO would block the reader forever).
            LinkInRepository: (exit 2) a link in the repository's skeleton (``repository.json``).
        """
        try:
            with self._parent(key) as (d, name):
                fd = d.open_file(name, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound("missing", where=key) from None
        except OSError as exc:
            if exc.errno in (errno.ENXIO, errno.ELOOP, errno.EOPNOTSUPP):  # a socket, a device gone
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

    # -- writing -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def write_once(self, key: str) -> Iterator[BinaryIO]:
        """Create ``key`` exclusively (``O_EXCL | O_NOFOLLOW``), streaming; fsynced when the block exits.

        Raises:
            StoreError: something is there already. InsufficientSpace: the disk is full.
        """
        with self._parent(key, create=True) as (d, name):
            try:
                fh = fs.open_stream(d.create(name))
            except FileExistsError:
                raise StoreError("refusing to overwrite a write-once member", where=key) from None
        try:
            with _disk_full_named("writing", self.root / key):
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            with contextlib.suppress(OSError):
                fh.close()

    @contextlib.contextmanager
    def write_new(self, key: str) -> Iterator[BinaryIO]:
        """Create ``key`` atomically and exclusively: written under a fresh ``O_EXCL`` temporary name
        (``.NAME.tmp-PID-<hex>``), fsynced, then hard-linked to its name (fails if anything is there) and the
        temporary name removed; the folder is fsynced. A reader never sees a partial file; on an exception
        (a full disk included) nothing is left.

        Raises:
            StoreError: ``key`` already exists. InsufficientSpace: the disk is full. OSError: the write failed.
        """
        with self._parent(key, create=True) as (d, name):
            try:
                with _disk_full_named("writing", self.root / key), d.atomic_file(name, exclusive=True) as fh:
                    yield fh
            except FileExistsError:
                raise StoreError("refusing to overwrite a write-once object", where=key) from None

    def new_object(self, folder: str, hint: str) -> "_LocalPending":
        """Start a file whose name is decided when it is complete (a content-addressed object): written
        under a fresh ``folder/.HINT.tmp-PID-<hex>`` (``O_EXCL``); :meth:`_LocalPending.commit` fsyncs it
        and hard-links it to its final key (never replacing one), :meth:`_LocalPending.abort` removes it.

        Raises:
            OSError: the temporary file cannot be created.
        """
        with self._root(create=True) as root:
            d = root.walk(self._parts(folder), create=True)
        try:
            tmp, fd = d.create_temp(hint)
        except BaseException:
            d.close()
            raise
        return _LocalPending(self, d, tmp, fs.open_stream(fd))

    def write_bytes_once(self, key: str, data: bytes) -> None:
        with self.write_once(key) as fh:
            fh.write(data)

    def replace_bytes(self, key: str, data: bytes) -> None:
        """Atomic replace: a fresh ``O_EXCL`` temporary file beside ``key``, fsync, rename over it (a link
        there is replaced, never followed), fsync of the folder.

        Raises:
            InsufficientSpace: the disk is full (``key`` unchanged, nothing left). OSError: the write failed.
        """
        with _disk_full_named("replacing", self.root / key), self._parent(key, create=True) as (d, name):
            d.write_atomic(name, data)

    def remove(self, key: str) -> None:
        """Remove the file at ``key`` (a link is unlinked, never followed); absent is fine.

        Raises:
            IsADirectoryError: a folder is there (use :meth:`remove_prefix`).
        """
        try:
            with self._parent(key) as (d, name):
                d.unlink(name, missing_ok=True)
        except (FileNotFoundError, NotADirectoryError):
            pass

    def remove_prefix(self, key: str) -> None:
        """Remove ``key`` and everything below it (a link is unlinked, never followed); absent is fine."""
        if not key:
            raise ValueError("remove_prefix needs a key below the root")
        try:
            with self._parent(key) as (d, name):
                d.remove_tree(name)
                d.fsync()
        except (FileNotFoundError, NotADirectoryError):
            pass

    def claim(self, key: str) -> bool:
        """Exclusively create an empty file at ``key``; False when anything (a link included) is there."""
        parts = self._parts(key)
        with self._root(create=True) as root, root.walk(parts[:-2], create=True) as gp, \
                gp.walk(parts[-2:-1], create=True) as d:
            try:
                fd = d.create(parts[-1])
            except (FileExistsError, UnsafePath):
                return False
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            d.fsync()
            gp.fsync()
        return True

    def fsync_dir(self, key: str) -> None:
        """Make the entries of the folder ``key`` durable (absent: nothing to do)."""
        try:
            with self._folder(key) as d:
                d.fsync()
        except (FileNotFoundError, NotADirectoryError):
            pass

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
        """The file system path of ``key`` (the root for ``""``): for messages and for callers that must
        refuse to write into the repository; never used to reach a file."""
        return self.path(key)

    def lock_file(self) -> Path:
        """``REPO/.lock`` (for messages; :meth:`writer_lock` takes it)."""
        return self.root / ".lock"

    def writer_lock(self) -> fs.WriterLock:
        """The writer lock on ``REPO/.lock``: an OS lock the kernel releases when the holder dies, opened
        ``O_NOFOLLOW`` relative to the root (a link there is :class:`LinkInRepository`); the root is created
        if absent."""
        return fs.WriterLock(self.root, ".lock", create_folder=True, refuse=self._refuse)

    def __repr__(self) -> str:
        return f"LocalStore({self.location!r})"


class _LocalPending:
    """A :meth:`LocalStore.new_object` in progress: ``fh`` to write, then ``commit(key)`` or ``abort()``."""

    def __init__(self, store: "LocalStore", folder: fs.Dir, tmp: str, fh):
        self.store, self.folder, self.tmp, self.fh = store, folder, tmp, fh

    def commit(self, key: str, *, sync_dir: bool = True, replace: bool = False) -> bool:
        """Make the file visible as ``key``: True, or False when ``key`` already exists (nothing replaced,
        the temporary file removed). ``replace=True``: an existing ``key`` is replaced atomically
        (rename over it: a reader sees the old file or the new one). ``sync_dir=False`` leaves the
        folder's fsync to the caller (one :meth:`LocalStore.fsync_dir` for many objects). Raises OSError
        (the temporary file is removed)."""
        try:
            with _disk_full_named("writing", self.folder.display(self.tmp)):
                self.fh.flush()
                os.fsync(self.fh.fileno())
            self.fh.close()
            with self.store._parent(key, create=True) as (d, name):
                if replace:
                    self.folder.rename(self.tmp, name, d)
                    self.tmp = None
                else:
                    try:
                        self.folder.link(self.tmp, name, d)
                    except FileExistsError:
                        d.check_link(name)  # a link planted at the object's name: refused, never kept
                        return False
                if sync_dir:
                    d.fsync()
            return True
        finally:
            self._cleanup()

    def abort(self) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                self.folder.unlink(self.tmp, missing_ok=True)
            self.tmp = None
        self.folder.close()


__all__ = ["LocalStore", "write_atomic", "Store", "has_scheme", "open_store"]
