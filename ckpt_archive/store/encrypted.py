"""An encrypted repository as a wrapper around any :class:`~ckpt_archive.store.base.Store`.

Everything above the store (pack, verify, trial reload, dedup, retention, export, ``--deep``) works on
plaintext bytes, unchanged; this wrapper seals every file it writes and opens every file it reads, with
the format of :mod:`ckpt_archive.format.crypto` (docs/FORMAT.md, "Encrypted repositories"), and gives
shared objects keyed names. Like the fault-injection and dry-run habits (restic's backend wrappers), it
is a layer, not a set of ``if encrypted`` branches in the callers.

What is sealed: every file but ``repository.json`` (which says the repository is encrypted and holds the
wrapped data keys), the empty ``CLAIM`` files and the lock files. Sizes seen through the wrapper are
plaintext sizes (computed from the ciphertext size, :func:`~ckpt_archive.format.crypto.plaintext_size`),
so the manifest's stored sizes and sha256s are those of the plaintext a writer handed down.

A file whose bytes were changed fails its segment's authentication tag as
:class:`~ckpt_archive.errors.IntegrityError` naming the key (exit 1: damage); a file that is not
encrypted where it should be fails the same way (bad header).
"""
from __future__ import annotations

import contextlib
import io
import os
import secrets
import threading
from typing import BinaryIO, Callable, Iterator

from ckpt_archive.errors import IntegrityError
from ckpt_archive.format import crypto

#: Files kept in the clear (by their last path component).
PLAIN_NAMES = frozenset({"repository.json", "CLAIM", ".lock", ".lock.owner"})
_OBJECTS = "objects"


def _plain(key: str) -> bool:
    return key.rpartition("/")[2] in PLAIN_NAMES


class EncryptedStore:
    """A store whose files are sealed with the repository's data key.

    Args:
        inner: the store that holds the ciphertext.
        keys: the repository's derived keys (:class:`~ckpt_archive.format.crypto.RepoKeys`).
    """

    encrypted = True

    def __init__(self, inner, keys: crypto.RepoKeys):
        self.inner = inner
        self.keys = keys
        self.location = inner.location

    # -- names ------------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        """The inner key of ``key``: shared objects' folders and names are keyed (module docstring)."""
        if not key.startswith(_OBJECTS + "/"):
            return key
        parts = key.split("/")
        parts[1] = self.keys.names.folder(parts[1])
        if len(parts) == 3:
            sealed = self.keys.names.name(parts[2])
            if sealed is not None:
                parts[2] = sealed
        return "/".join(parts)

    def listdir(self, key: str) -> list[str]:
        names = self.inner.listdir(self._key(key))
        if key == _OBJECTS:
            return sorted(self.keys.names.folder_back(n) for n in names)
        if key.startswith(_OBJECTS + "/") and key.count("/") == 1:
            out = []
            for n in names:
                back = self.keys.names.name_back(n)
                if back is not None:
                    # [break] also one sealed for another folder (moved here): its plain name says where it
                    # belongs (gc collects it by that name, which seals back to this file's; it was dropped)
                    out.append(back)
                else:
                    out.append(n)  # a leftover temporary file or a foreign name: listed as it is (gc's rules)
            return sorted(out)
        return names

    # -- reading ----------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.inner.exists(self._key(key))

    def size(self, key: str) -> int:
        n = self.inner.size(self._key(key))
        if _plain(key):
            return n
        try:
            return crypto.plaintext_size(n)
        except IntegrityError as exc:
            raise IntegrityError(exc.message, where=key) from None

    def open_read(self, key: str) -> BinaryIO:
        fh = self.inner.open_read(self._key(key))
        if _plain(key):
            return fh
        try:
            return _OpenedFile(fh, self.keys, key)
        except BaseException:
            fh.close()
            raise

    def read_bytes(self, key: str) -> bytes:
        with self.open_read(key) as fh:
            return fh.read()

    # -- writing ----------------------------------------------------------------------------------
    def _seal_all(self, key: str, data: bytes) -> bytes:
        if _plain(key):
            return data
        out = io.BytesIO()
        w = _SealingWriter(out, self.keys)
        w.write(data)
        w.finish()
        return out.getvalue()

    def write_once(self, key: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self._sealing(self.inner.write_once, key)

    def write_new(self, key: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self._sealing(self.inner.write_new, key)

    @contextlib.contextmanager
    def _sealing(self, open_inner: Callable, key: str) -> Iterator[BinaryIO]:
        """A writer of ``key`` through the inner store's ``open_inner`` (write_once / write_new): sealed
        (encrypted, authenticated segments) unless the key is one kept in the clear (``repository.json``)."""
        with open_inner(self._key(key)) as fh:
            if _plain(key):
                yield fh
                return
            w = _SealingWriter(fh, self.keys)
            yield w
            w.finish()

    def new_object(self, folder: str, hint: str) -> "_SealedPending":
        # the hint (a fingerprint's prefix) would name the tensor in the clear: a random one instead
        pending = self.inner.new_object(self._key(folder) if folder.startswith(_OBJECTS) else folder,
                                        secrets.token_hex(8))
        return _SealedPending(self, pending)

    def write_bytes_once(self, key: str, data: bytes) -> None:
        self.inner.write_bytes_once(self._key(key), self._seal_all(key, data))

    def replace_bytes(self, key: str, data: bytes) -> None:
        self.inner.replace_bytes(self._key(key), self._seal_all(key, data))

    # -- the rest passes through, names mapped -------------------------------------------------------
    def remove(self, key: str) -> None:
        self.inner.remove(self._key(key))

    def remove_prefix(self, key: str) -> None:
        self.inner.remove_prefix(self._key(key))

    def claim(self, key: str) -> bool:
        return self.inner.claim(self._key(key))

    def fsync_dir(self, key: str) -> None:
        self.inner.fsync_dir(self._key(key))

    def abort_uploads(self, key: str) -> list[str]:
        return self.inner.abort_uploads(self._key(key))

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def local_path(self, key: str = ""):
        """The inner store's path of ``key``: where the ciphertext lies. Only for identity and for refusing
        to write into the repository; never read through (a caller that reads a local path directly would
        get ciphertext: the readers only use :meth:`open_read`)."""
        return self.inner.local_path(self._key(key))

    def lock_file(self):
        return self.inner.lock_file()

    def __getattr__(self, name):  # store-specific extras (e.g. an fsspec store's ``fs``) of the inner store
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"EncryptedStore({self.inner!r})"


class _SealingWriter(io.RawIOBase):
    """A write-only stream that seals what is written to it, segment by segment, into ``fh``.

    A segment is sealed only once the next byte is known to exist, so the last segment (possibly empty)
    is sealed as last by :meth:`finish`. ``tell()`` counts plaintext bytes.
    """

    def __init__(self, fh, keys: crypto.RepoKeys):
        super().__init__()
        self._fh = fh
        self._cipher = keys.file_cipher()
        self._fh.write(self._cipher.header)
        self._buf = bytearray()
        self._index = 0
        self._written = 0
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self._done:
            raise ValueError("write to a finished encrypted file")
        mv = memoryview(data).cast("B")
        self._buf += mv
        self._written += len(mv)
        while len(self._buf) > crypto.SEGMENT_BYTES:
            seg = bytes(self._buf[:crypto.SEGMENT_BYTES])
            del self._buf[:crypto.SEGMENT_BYTES]
            self._fh.write(self._cipher.seal(self._index, seg, False))
            self._index += 1
        return len(mv)

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        self._fh.flush()

    def fileno(self) -> int:
        raise io.UnsupportedOperation("an encrypted file has no plaintext descriptor")

    def finish(self) -> None:
        """Seal the last segment. Called once, after the last write."""
        if not self._done:
            self._fh.write(self._cipher.seal(self._index, bytes(self._buf), True))
            self._buf = bytearray()
            self._done = True
            self._fh.flush()


class _SealedPending:
    """:meth:`EncryptedStore.new_object` in progress: ``fh`` seals; ``commit(key)`` finishes the last
    segment and commits the inner object under the keyed name."""

    def __init__(self, store: EncryptedStore, pending):
        self._store, self._pending = store, pending
        self.fh = _SealingWriter(pending.fh, store.keys)

    def commit(self, key: str, *, sync_dir: bool = True, replace: bool = False) -> bool:
        try:
            self.fh.finish()
        except BaseException:
            self._pending.abort()
            raise
        return self._pending.commit(self._store._key(key), sync_dir=sync_dir, replace=replace)

    def abort(self) -> None:
        self._pending.abort()


class _OpenedFile(io.RawIOBase):
    """A read-only, seekable plaintext view of an encrypted file: segments are opened (tag checked) as
    they are read; ``pread`` reads a range at an offset without moving the position (thread-safe), so
    members decode in parallel as from a plain local file."""

    positional = True

    def __init__(self, fh, keys: crypto.RepoKeys, key: str):
        super().__init__()
        self._fh, self._key = fh, key
        try:
            fd = fh.fileno()
            os.fstat(fd)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            fd = None
        self._fd = fd
        self._lock = threading.Lock()
        header = self._raw(0, crypto.HEADER_BYTES)
        self._cipher = keys.file_cipher(crypto.FileCipher.salt_of(header, key))
        total = self._raw_size()
        try:
            self._size = crypto.plaintext_size(total)
        except IntegrityError as exc:
            raise IntegrityError(exc.message, where=key) from None
        self._pos = 0
        self._cache: tuple[int, bytes] | None = None

    def _raw_size(self) -> int:
        if self._fd is not None:
            return os.fstat(self._fd).st_size
        with self._lock:
            cur = self._fh.tell()
            end = self._fh.seek(0, 2)
            self._fh.seek(cur)
            return end

    def _raw(self, offset: int, n: int) -> bytes:
        if self._fd is not None:
            parts, got = [], 0
            while got < n:
                b = os.pread(self._fd, n - got, offset + got)
                if not b:
                    break
                parts.append(b)
                got += len(b)
            return b"".join(parts)
        with self._lock:
            self._fh.seek(offset)
            return self._fh.read(n) or b""

    def _segment(self, index: int) -> bytes:
        cached = self._cache
        if cached is not None and cached[0] == index:
            return cached[1]
        off, length, last = crypto.FileCipher.segment_span(index, self._size)
        sealed = self._raw(off, length)
        if len(sealed) != length:
            raise IntegrityError(f"encrypted segment {index} is cut short", where=self._key)
        plain = self._cipher.open(index, sealed, last, self._key)
        self._cache = (index, plain)
        return plain

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` plaintext bytes at ``offset`` (fewer at the end of the file)."""
        n = max(0, min(n, self._size - offset))
        out, pos = [], offset
        while n > 0:
            index, within = divmod(pos, crypto.SEGMENT_BYTES)
            seg = self._segment(index)
            piece = seg[within:within + n]
            if not piece:
                break
            out.append(piece)
            pos += len(piece)
            n -= len(piece)
        return b"".join(out)

    def size(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._size - self._pos
        data = self.pread(n, self._pos)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        memoryview(b).cast("B")[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        raise io.UnsupportedOperation("an encrypted file has no plaintext descriptor")

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self._fh.close()
        super().close()


__all__ = ["EncryptedStore", "PLAIN_NAMES"]
