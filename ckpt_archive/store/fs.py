"""The one file layer: every byte ckpt-archive writes, renames or deletes in a repository, or in a restore
or export target, goes through this module (restic keeps file access behind ``internal/fs``, borg behind
``platform/``: one place that knows how to touch a file safely, so that a new feature has no other way).
``tests/test_file_layer.py`` scans the package and fails on a raw file operation anywhere else.

The rules, each enforced here and nowhere else:

* **Relative to an open folder.** A *root* (a repository folder, the folder that holds a restore or
  export target, the user's lock cache) is resolved once, by its path: it may be reached through the
  user's own symbolic link (``backups/`` pointing at another disk). Everything below a root is reached
  through folder descriptors: ``os.open(name, flags, dir_fd=fd)``, ``os.rename(..., src_dir_fd=,
  dst_dir_fd=)``, ``os.link``, ``os.unlink(name, dir_fd=)``, ``os.mkdir(name, dir_fd=)``,
  ``shutil.rmtree(name, dir_fd=)``. A folder swapped for a link after it was opened changes nothing.
* **No symbolic link below a root is ever followed.** Each folder on the way is opened ``O_NOFOLLOW |
  O_DIRECTORY``, each file ``O_NOFOLLOW``; a link met is refused by the root's *refuse* rule
  (:class:`~ckpt_archive.errors.UnsafePath`, exit 1, unless the root says otherwise: a repository's own
  skeleton is :class:`~ckpt_archive.errors.LinkInRepository`, exit 2). Removing a link removes the link,
  never what it points to; a rename over a link replaces the link.
* **Temporary files are created ``O_CREAT | O_EXCL | O_NOFOLLOW`` under unpredictable names**,
  ``.NAME.tmp-PID-<16 hex digits>`` (:func:`temp_name`, from ``secrets.token_hex``). A name planted in
  advance can only make a create fail (it is retried under a fresh name), never redirect it. The
  ``.NAME.tmp-`` prefix is kept so ``gc`` and restore recognise leftovers (:data:`TEMP_NAME`, which also
  matches the ``.NAME.tmp-PID`` names of earlier versions).
* **Durable**: a file is fsynced before it is linked or renamed to its name, and its folder after.
* **What is only read is not a root.** A source (a checkpoint being packed, a trainer's checkpoint folder
  being snapshot into its staging folder) is read by its path and may follow its owner's links, as the
  source readers do; :meth:`Dir.link_from` and :meth:`Dir.copy_from` take such a file by path, while the
  name they create is on the write side like any other (exclusive, never followed).

What a target needs beyond that (a staging folder, the final rename, ``--force``) is :class:`Staging`;
the repository's writer lock is :class:`WriterLock`. POSIX only (directory descriptors, ``flock``).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ckpt_archive.errors import LockError, ReadOnlyRepository, UnsafePath, UsageError

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_NOFOLLOW | O_CLOEXEC

#: A temporary name this layer (or an earlier version: ``.NAME.tmp-PID``) created, and the ``.NAME.old-...``
#: name a replaced target has for a moment; group ``pid`` is the creating process.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-[0-9a-f]{16})?$")

#: A temporary file of an atomic write, left where a writer was killed: what ``gc`` removes in a repository.
TEMP_FILE = re.compile(r"^\..+\.tmp-\d+(?:-[0-9a-f]{16})?$")

#: ``refuse(relpath, root) -> exception`` for a symbolic link met at ``relpath`` below ``root``.
Refuse = Callable[[str, str], Exception]


def temp_name(name: str, kind: str = "tmp") -> str:
    """An unpredictable temporary name beside ``name``: ``.NAME.tmp-PID-<16 hex digits>``.

    The pid says which process made it (restore removes leftovers of processes that are gone); the 64
    random bits make it impossible to plant a link at the name in advance.

    Args:
        name: the final name. kind: ``"tmp"`` (being written) or ``"old"`` (being replaced).
    """
    return f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(8)}"


def is_temp_name(name: str) -> bool:
    """True for a name :func:`temp_name` makes (``.NAME.tmp-...``; earlier versions' ``.NAME.tmp-PID`` too)."""
    return bool(TEMP_FILE.match(name))


def open_stream(fd: int) -> BinaryIO:
    """The binary file object every write of the layer goes through (``os.fdopen(fd, "wb")``); tests replace
    it to make the disk fill up part-way (ENOSPC) at any write."""
    return os.fdopen(fd, "wb")


def refuse_link(rel: str, root: str) -> Exception:
    """The default rule for a symbolic link below a root: :class:`UnsafePath` (exit 1)."""
    return UnsafePath(f"{rel} is a symbolic link; nothing is written, read or deleted through one here "
                      f"(remove the link by hand if it is yours)", where=root)


def _rmtree_at(parent_fd: int, name: str) -> None:
    """Remove the folder ``name`` of ``parent_fd`` with everything in it, never following a link inside:
    ``shutil.rmtree(name, dir_fd=)`` (Python >= 3.11), else the same walk by descriptors."""
    if sys.version_info >= (3, 11):
        shutil.rmtree(name, dir_fd=parent_fd)
        return
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        with os.scandir(fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for child, is_dir in names:
            if is_dir:
                _rmtree_at(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class Dir:
    """An open folder: every operation on a name in it is relative to its descriptor, never follows a
    symbolic link, and refuses one through ``refuse``.

    Open a root with :meth:`open`, a folder below with :meth:`sub` or :meth:`walk`; close with
    :meth:`close` or ``with``.

    Attributes:
        fd: the folder's descriptor (``O_RDONLY | O_DIRECTORY``).
        path: its path, for messages only (never used to reach it again).
        rel: its path relative to the root (``""`` for the root).
    """

    def __init__(self, fd: int, path: str, rel: str = "", refuse: Refuse = refuse_link, root: str | None = None):
        self.fd, self.path, self.rel, self.refuse = fd, path, rel, refuse
        self.root = path if root is None else root

    # -- opening --------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False, refuse: Refuse = refuse_link) -> "Dir":
        """Open a root folder by its path, once (a link on that path is the user's choice and is followed).

        Args:
            path: the folder. create: create it and its parents when absent.
            refuse: the rule for links met below it (:func:`refuse_link` by default).

        Raises:
            FileNotFoundError / NotADirectoryError: absent (without ``create``), or not a folder.
        """
        p = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if create:
            os.makedirs(p, exist_ok=True)
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC)
        return cls(fd, p, "", refuse)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Dir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a Dir dropped without close (an exception path): no descriptor leaks
        with contextlib.suppress(Exception):
            self.close()

    def _rel(self, name: str) -> str:
        return f"{self.rel}/{name}" if self.rel else name

    def display(self, name: str = "") -> str:
        """``path/name``, for messages."""
        return os.path.join(self.path, name) if name else self.path

    def _refused(self, name: str) -> Exception:
        return self.refuse(self._rel(name), self.root)

    def check_link(self, name: str) -> None:
        """Raise the refusal when ``name`` in this folder is a symbolic link (called after an open failed)."""
        if _is_link(self.fd, name):
            raise self._refused(name) from None

    def sub(self, name: str, *, create: bool = False, mode: int = 0o777) -> "Dir":
        """Open the folder ``name`` in this one (``O_NOFOLLOW``), creating it with ``create``.

        Raises:
            the refusal (a link); FileNotFoundError (absent); NotADirectoryError (not a folder).
        """
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=self.fd)
            return self.sub(name)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                self.check_link(name)
            raise
        return Dir(fd, self.display(name), self._rel(name), self.refuse, self.root)

    def walk(self, parts, *, create: bool = False) -> "Dir":
        """Open the folder ``parts`` (a sequence of names) below this one, each step ``O_NOFOLLOW``; a new
        :class:`Dir` (this one for no parts, duplicated)."""
        cur = Dir(os.dup(self.fd), self.path, self.rel, self.refuse, self.root)
        for part in parts:
            try:
                nxt = cur.sub(part, create=create)
            finally:
                cur.close()
            cur = nxt
        return cur

    # -- looking --------------------------------------------------------------------------------------
    def lstat(self, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` here; None when absent."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def listdir(self) -> list[str]:
        """The names in this folder, sorted."""
        return sorted(os.listdir(self.fd))

    def path_of(self, name: str) -> str:
        """A path to ``name`` here for libraries that only take a path (``torch.save``, safetensors, zipfile):
        through this folder's descriptor (``/proc/self/fd/N/NAME`` on Linux), so no rename or link of a
        folder on the way can redirect it; elsewhere the plain path. Use it only in a folder this process
        made (a :class:`Staging` folder, mode 0700), after creating ``name`` itself exclusively."""
        proc = f"/proc/self/fd/{self.fd}"
        if os.path.isdir(proc):
            return f"{proc}/{name}"
        return self.display(name)

    def entry(self, name: str) -> "Entry":
        """The :class:`Entry` ``name`` of this folder."""
        return Entry(self, name)

    def read_file(self, name: str, max_bytes: int) -> bytes | None:
        """The content of the regular file ``name`` here, opened ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks).

        Args:
            name: the file. max_bytes: the largest content accepted, in bytes (never more is read).

        Returns:
            the bytes; None when ``name`` is absent, is not a regular file, or holds more than ``max_bytes``.

        Raises:
            the refusal: ``name`` is a symbolic link. OSError: it cannot be read.
        """
        try:
            fd = self.open_file(name, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                return None
            data = b""
            while len(data) <= max_bytes:
                chunk = os.read(fd, max_bytes + 1 - len(data))
                if not chunk:
                    break
                data += chunk
            return None if len(data) > max_bytes else data
        finally:
            os.close(fd)

    # -- files ----------------------------------------------------------------------------------------
    def open_file(self, name: str, flags: int, mode: int = 0o644) -> int:
        """``os.open(name, flags | O_NOFOLLOW | O_CLOEXEC, dir_fd=...)``: a descriptor (the caller closes it).

        Raises:
            the refusal (``name`` is a link); OSError as ``os.open``.
        """
        try:
            return os.open(name, flags | O_NOFOLLOW | O_CLOEXEC, mode, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EEXIST, errno.ENOTDIR):  # a link, refused as one
                self.check_link(name)
            raise

    def create(self, name: str, mode: int = 0o644) -> int:
        """Create ``name`` exclusively (``O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW``); its descriptor.

        Raises:
            FileExistsError: something (not a link) is there. The refusal: a link is there.
        """
        return self.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def create_temp(self, name: str, mode: int = 0o644, *, readable: bool = False) -> tuple[str, int]:
        """Create a fresh temporary file for ``name`` (:func:`temp_name`, ``O_EXCL``): ``(its name, descriptor)``,
        open for writing (``readable``: reading too, e.g. to map it)."""
        access = os.O_RDWR if readable else os.O_WRONLY
        for _ in range(100):
            tmp = temp_name(name)
            try:
                return tmp, os.open(tmp, access | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode,
                                    dir_fd=self.fd)
            except FileExistsError:
                continue  # a name planted or left there: another random name
        raise FileExistsError(errno.EEXIST, "no free temporary name", self.display(name))

    def mkdir(self, name: str, mode: int = 0o777) -> None:
        """Create the folder ``name`` here (FileExistsError when anything, a link included, is there)."""
        os.mkdir(name, mode, dir_fd=self.fd)

    def make_temp_dir(self, name: str) -> str:
        """Create a private folder (mode 0700) under a fresh temporary name for ``name``; returns its name."""
        for _ in range(100):
            tmp = temp_name(name)
            try:
                os.mkdir(tmp, 0o700, dir_fd=self.fd)
                return tmp
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free temporary name", self.display(name))

    def link(self, src: str, dst: str, dst_dir: "Dir | None" = None) -> None:
        """Hard-link ``src`` here to ``dst`` (in ``dst_dir``, default here), never following a link;
        FileExistsError when ``dst`` exists (anything, a link included: it is never replaced)."""
        os.link(src, dst, src_dir_fd=self.fd, dst_dir_fd=(dst_dir or self).fd, follow_symlinks=False)

    def link_from(self, src: str | os.PathLike, name: str) -> None:
        """Hard-link the file at the path ``src`` to the new name ``name`` here (a snapshot of a trainer's checkpoint
        folder: no byte copied).

        ``src`` is the read side (a folder this process only reads, such as a trainer's checkpoint folder): it is
        reached by its path and a symbolic link there is followed, so ``name`` becomes the file a reader of ``src``
        sees (``linkat(AT_SYMLINK_FOLLOW)``). ``name`` is the write side and is never followed: the new name is
        created by the kernel exclusively, so anything there, a symbolic link included, is FileExistsError and is
        never replaced or written through.

        Raises:
            FileExistsError: something is at ``name``. OSError: the link cannot be made (EXDEV: ``src`` is on
            another file system; EPERM / EOPNOTSUPP: no hard links there): :meth:`copy_from` copies instead.
        """
        os.link(os.fspath(src), name, dst_dir_fd=self.fd, follow_symlinks=True)

    def copy_from(self, src: str | os.PathLike, name: str) -> int:
        """Copy the regular file at the path ``src`` to a new file ``name`` here, where :meth:`link_from` cannot link.

        ``src`` is read by its path, a symbolic link there followed (the read side, as in :meth:`link_from`).
        ``name`` is created ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:meth:`create`): anything there, a link included, is
        refused, never followed or replaced. The copy keeps the source's permission bits and access and
        modification times (what ``shutil.copy2`` keeps, less extended attributes). A copy that fails part-way
        is removed. It is written at its final name and not fsynced: meant for a private folder this process
        fills and removes (a snapshot), which nothing reads after a crash.

        Returns:
            the bytes copied.

        Raises:
            FileExistsError / the refusal: something (a link) is at ``name``. OSError: ``src`` is absent or is not
            a regular file (EINVAL), or a read or write failed (ENOSPC).
        """
        sfd = os.open(os.fspath(src), os.O_RDONLY | os.O_NONBLOCK | O_CLOEXEC)
        try:
            st = os.fstat(sfd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", os.fspath(src))
            dfd = self.create(name, 0o600)
            try:
                with os.fdopen(sfd, "rb", closefd=False) as fin, open_stream(dfd) as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
                    fout.flush()
                    os.fchmod(fout.fileno(), stat.S_IMODE(st.st_mode))
                    os.utime(fout.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
                    return st.st_size
            except BaseException:
                with contextlib.suppress(OSError):
                    self.unlink(name, missing_ok=True)
                raise
        finally:
            os.close(sfd)

    def symlink(self, target: str, name: str) -> None:
        """Create the symbolic link ``name`` here pointing at ``target`` (stored as given: creating a link follows
        nothing; a snapshot recreates a trainer's link to a folder, which the folder reader then does not follow).

        Raises:
            FileExistsError: something, a link included, is at ``name`` (never replaced).
        """
        os.symlink(target, name, dir_fd=self.fd)

    def rename(self, src: str, dst: str, dst_dir: "Dir | None" = None) -> None:
        """Rename ``src`` here to ``dst`` (in ``dst_dir``, default here), replacing a file or link there
        (the link itself, never what it points to)."""
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=(dst_dir or self).fd)

    def unlink(self, name: str, *, missing_ok: bool = False) -> None:
        """Remove the file or link ``name`` (a link is removed, never followed)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmdir(self, name: str) -> None:
        os.rmdir(name, dir_fd=self.fd)

    def remove_tree(self, name: str) -> bool:
        """Remove ``name`` whatever it is: a link or file is unlinked, a folder removed with everything in it
        (``shutil.rmtree(dir_fd=)``, which never follows a link inside). False when nothing was there."""
        st = self.lstat(name)
        if st is None:
            return False
        if stat.S_ISDIR(st.st_mode):
            _rmtree_at(self.fd, name)
        else:
            self.unlink(name, missing_ok=True)
        return True

    def fsync(self) -> None:
        """Make this folder's entries durable (best effort: a file system without folder fsync is skipped)."""
        with contextlib.suppress(OSError):
            os.fsync(self.fd)

    def finish_file(self, name: str, mode: int | None = None) -> int:
        """Set ``name``'s permission bits (``fchmod``, when ``mode`` is given) and fsync it; its size in bytes."""
        fd = self.open_file(name, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            os.fsync(fd)
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def rewrite(self, name: str) -> Iterator[BinaryIO]:
        """Write the existing file ``name`` over in place (truncated; hardlinks to it see the new bytes),
        fsynced on success. Raises FileNotFoundError when absent."""
        fh = open_stream(self.open_file(name, os.O_WRONLY | os.O_TRUNC))
        with fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())

    @contextlib.contextmanager
    def atomic_file(self, name: str, *, exclusive: bool = False) -> Iterator[BinaryIO]:
        """Write ``name`` atomically: a fresh temporary file (:meth:`create_temp`), fsynced, then renamed over
        ``name`` (``exclusive``: hard-linked to it, FileExistsError when ``name`` exists), then the folder
        fsynced. A reader sees the old file or the whole new one; on an exception nothing is left.

        Yields:
            the temporary file, open for writing.
        """
        tmp, fd = self.create_temp(name)
        try:
            with open_stream(fd) as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            if exclusive:
                try:
                    self.link(tmp, name)
                except FileExistsError:
                    self.check_link(name)
                    raise
            else:
                self.rename(tmp, name)
                tmp = None
        finally:
            if tmp is not None:
                self.unlink(tmp, missing_ok=True)
        self.fsync()

    def write_atomic(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """:meth:`atomic_file` with ``data`` as the whole content."""
        with self.atomic_file(name, exclusive=exclusive) as fh:
            fh.write(data)


class Entry:
    """One name in an open folder, for a writer that is handed "the file to write" (restore's one-pass
    torch writer, the exact-bytes rebuild): it creates, reopens and removes it through the folder.

    Attributes:
        dir: the folder. name: the name in it.
    """

    def __init__(self, folder: Dir, name: str):
        self.dir, self.name = folder, name

    @property
    def path(self) -> str:
        """A path for libraries that only take one (:meth:`Dir.path_of`)."""
        return self.dir.path_of(self.name)

    def create(self, mode: int = 0o644) -> int:
        """Create it exclusively; its descriptor."""
        return self.dir.create(self.name, mode)

    def open(self, flags: int) -> int:
        """Open it (``O_NOFOLLOW``); its descriptor."""
        return self.dir.open_file(self.name, flags)

    def exists(self) -> bool:
        return self.dir.lstat(self.name) is not None

    def remove(self) -> None:
        """Remove it if there (a folder with its content)."""
        self.dir.remove_tree(self.name)

    def __str__(self) -> str:
        return self.dir.display(self.name)


def write_file_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Create or replace the file ``path`` (a target: ``export --report``, ``status --state``) with ``data``,
    atomically, through its folder's descriptor (created if absent; :meth:`Dir.write_atomic`).

    Raises:
        OSError: the write or the rename failed; ``path`` is unchanged and no temporary file is left.
    """
    p = Path(path).expanduser().absolute()
    with Dir.open(p.parent, create=True) as d:
        d.write_atomic(p.name, data)


def pid_alive(pid) -> bool | None:
    """Whether process ``pid`` of this machine is alive (``kill(pid, 0)``): True, False (no such process), or
    None when ``pid`` is not a process id at all (not a positive int: a hand-edited owner or lease record).
    A process of another user counts as alive (the kill is refused, not answered "no such process")."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except (OverflowError, ValueError):
        return None
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_name() -> str:
    """This machine's host name, as ``socket.gethostname()`` gives it (both read the kernel's ``uname``
    node name on POSIX), without importing ``socket`` (~5 ms of every command's start-up; issue 29's
    ``verify`` <= 0.3 s). Lock owners and lease records are stamped with it, and compared with it before a
    process id is taken as this machine's."""
    uname = getattr(os, "uname", None)
    if uname is not None:
        return uname().nodename
    import socket  # pragma: no cover - not POSIX

    return socket.gethostname()  # pragma: no cover


class Staging:
    """A target (a file or a folder) being written beside where it goes, then renamed into place.

    The target's folder is opened once (created if absent; a link on its path is the user's choice); in it
    a private staging folder (mode 0700, ``.NAME.tmp-PID-<hex>``) holds the entry being written, named
    ``NAME``. :meth:`commit` renames it to the target's name through the folder's descriptor; without a
    commit (an exception, :meth:`abort`) the staging folder is removed. Leftovers of killed processes
    (``.NAME.tmp-PID...`` and ``.NAME.old-PID...`` of a pid that is gone) are removed when the next
    :class:`Staging` for the same target starts.

    Args:
        target: the file or folder to produce.

    Attributes:
        parent: the target's folder. name: the target's name. dir: the staging folder.
        entry: the staged entry (``dir``/``name``).

    Raises:
        OSError: the folder cannot be created or opened.
    """

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target).expanduser().absolute()
        self.name = self.target.name
        self.parent = Dir.open(self.target.parent, create=True)
        try:
            self._remove_stale()
            self.dir_name = self.parent.make_temp_dir(self.name)
            self.dir = self.parent.sub(self.dir_name)
        except BaseException:
            self.parent.close()
            raise
        self.entry = self.dir.entry(self.name)
        self._done = False
        #: the staged entry was renamed to the target's name (complete there; the folder fsync may not be done)
        self.placed = False

    @property
    def path(self) -> str:
        """Where the staged entry is, for libraries that only take a path (:meth:`Dir.path_of`)."""
        return self.entry.path

    def _remove_stale(self) -> None:
        for name in self.parent.listdir():
            m = TEMP_NAME.match(name)
            if m and m.group("name") == self.name and int(m.group("pid")) != os.getpid() \
                    and pid_alive(int(m.group("pid"))) is False:
                with contextlib.suppress(OSError):
                    self.parent.remove_tree(name)

    def reset(self) -> None:
        """Remove what was staged so far (a retry, e.g. restore ``--fallback`` writing an older generation)."""
        self.entry.remove()

    def target_kind(self) -> str | None:
        """What is at the target now: ``"file"``, ``"folder"``, ``"link"``, ``"special"`` or None."""
        st = self.parent.lstat(self.name)
        if st is None:
            return None
        m = st.st_mode
        return ("link" if stat.S_ISLNK(m) else "folder" if stat.S_ISDIR(m) else "file" if stat.S_ISREG(m)
                else "special")

    def commit(self, *, replace: bool) -> None:
        """Rename the staged entry to the target's name, then fsync the folder and remove the staging folder.

        Nothing there: one rename. ``replace`` and a file or link there replaced by a file: one atomic
        rename over it (the link itself is replaced, never what it points to). A folder on either side:
        the old one is first renamed to ``.NAME.old-PID-<hex>``, then removed once the new one is in place.

        Raises:
            FileExistsError: something is there and ``replace`` is False (nothing changed).
            UsageError: what is there is a FIFO, device or socket (never replaced; nothing changed).
        """
        kind = self.target_kind()
        new_is_dir = stat.S_ISDIR(os.stat(self.name, dir_fd=self.dir.fd, follow_symlinks=False).st_mode)
        if kind is not None and not replace:
            raise FileExistsError(errno.EEXIST, "exists", str(self.target))
        if kind == "special":
            raise UsageError("is a FIFO, device or socket, not a regular file or folder; refusing to replace it; "
                             "nothing was written", where=str(self.target))
        if kind in ("folder",) or (kind is not None and new_is_dir):
            old = temp_name(self.name, "old")
            self.parent.rename(self.name, old)
            try:
                self.dir.rename(self.name, self.name, self.parent)
            except BaseException:
                self.parent.rename(old, self.name)  # the old target back under its name
                raise
            self.placed = True
            with contextlib.suppress(OSError):
                self.parent.remove_tree(old)
        else:
            self.dir.rename(self.name, self.name, self.parent)
        self.placed = True
        self.parent.fsync()
        self._done = True
        self.close()

    def abort(self) -> None:
        """Remove the staging folder and what it holds (the target is untouched)."""
        self.close()

    def close(self) -> None:
        """Remove the staging folder (if still there) and close the descriptors."""
        if self.parent.fd < 0:
            return
        with contextlib.suppress(OSError):
            self.parent.remove_tree(self.dir_name)
        self.dir.close()
        self.parent.close()

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def staged_file(target: str | os.PathLike) -> Iterator[str]:
    """Yield a path (:meth:`Staging.path`) for a library that writes a whole file by path (DCP's
    ``dcp_to_torch_save``); on success fsync it and rename it over ``target`` (:meth:`Staging.commit`); on an
    exception nothing is left and ``target`` is unchanged."""
    with Staging(target) as st:
        os.close(st.entry.create())  # the name is ours (O_EXCL | O_NOFOLLOW) before the library opens it
        yield st.path
        st.dir.finish_file(st.name)
        st.commit(replace=True)


class WriterLock:
    """A writer lock: an OS lock (``flock``) on ``FOLDER/NAME``, opened ``O_NOFOLLOW`` relative to the
    folder's descriptor, plus an owner file ``NAME.owner`` saying who holds it.

    Not filelock: its ``UnixFileLock`` takes a path, not a folder descriptor, and releases of filelock
    before 4.x opened it following links with ``O_TRUNC`` (a planted ``.lock`` link truncated the file it
    pointed to). ``flock`` is what filelock uses underneath: the kernel releases it when the holder dies,
    and two opens conflict even within one process.

    Args:
        folder: the folder holding the lock (a repository root, or the user's lock cache).
        name: the lock file's name. create_folder: create ``folder`` when absent (the cache).
        refuse: the rule for a link at the lock or owner file.

    Attributes:
        path: ``folder/name``, for messages.
    """

    POLL_S = 0.05

    def __init__(self, folder: str | os.PathLike, name: str, *, create_folder: bool = False,
                 refuse: Refuse = refuse_link):
        self.folder, self.name, self.create_folder, self.refuse = Path(folder), name, create_folder, refuse
        self.path = self.folder / name
        self.owner_name = name + ".owner"
        self._dir: Dir | None = None
        self._fd = -1

    def acquire(self, timeout: float) -> bool:
        """Take the lock, waiting up to ``timeout`` seconds (0: one try). True when held.

        Raises:
            ReadOnlyRepository: the lock file cannot be created or opened for writing on a read-only file system or
                folder (the caller decides what may still be done without it).
            the refusal: the lock file is a link. LockError: it is not a regular file.
            OSError: the folder cannot be opened.
        """
        d = Dir.open(self.folder, create=self.create_folder, refuse=self.refuse)
        try:
            try:
                fd = d.open_file(self.name, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
            except OSError as exc:
                if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise ReadOnlyRepository(f"cannot open the writer lock {self.path} for writing ({exc.strerror}): "
                                             f"the repository is read-only here", where=str(self.folder)) from None
                if exc.errno == errno.EISDIR:
                    raise LockError(f"{self.path} is a folder, not a regular file; the writer lock cannot be "
                                    f"taken (remove it by hand)", where=str(self.folder)) from None
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise LockError(f"{self.path} is not a regular file; the writer lock cannot be taken "
                                    f"(remove it by hand)", where=str(self.folder))
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        import fcntl

                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            os.close(fd)
                            d.close()
                            return False
                        time.sleep(min(self.POLL_S, left))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
        except BaseException:
            d.close()
            raise
        self._dir, self._fd = d, fd
        return True

    def read_owner(self, max_bytes: int = 1 << 16) -> bytes | None:
        """The owner file's bytes (at most ``max_bytes``), or None when absent, unreadable or not a regular file."""
        try:
            with Dir.open(self.folder, refuse=self.refuse) as d:
                fd = d.open_file(self.owner_name, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        return None
                    return os.read(fd, max_bytes)
                finally:
                    os.close(fd)
        except (OSError, UnsafePath):
            return None

    def write_owner(self, data: bytes) -> None:
        """Write the owner file atomically (fresh temporary name, rename over); held lock only."""
        if self._dir is not None:
            self._dir.write_atomic(self.owner_name, data)

    def release(self) -> None:
        """Remove the owner file and release the lock (never raises for the owner file)."""
        if self._dir is None:
            return
        try:
            with contextlib.suppress(OSError):
                self._dir.unlink(self.owner_name, missing_ok=True)
        finally:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor releases the flock
            self._dir.close()
            self._dir, self._fd = None, -1


__all__ = ["Dir", "pid_alive", "host_name", "Entry", "Staging", "WriterLock", "TEMP_NAME", "TEMP_FILE", "temp_name", "is_temp_name",
           "refuse_link", "write_file_atomic", "staged_file"]
