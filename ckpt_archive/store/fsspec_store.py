"""A :class:`~ckpt_archive.store.base.Store` over any fsspec URL (``s3://bucket/prefix`` through s3fs, and
whatever else fsspec offers), with the same publish protocol as a local folder.

Object stores have no atomic rename, so nothing here renames: members are *write-once* objects, the
generation number is claimed by an exclusive create of an empty object, and the ``USABLE`` marker,
written last by the repository, is the commit. A reader ignores any generation without a matching
marker, so a half-written generation is harmless.

Write-once on S3 uses S3 conditional writes (``If-None-Match: *`` on ``PutObject`` and
``CompleteMultipartUpload``), which s3fs sends for ``open(path, "xb")`` and ``pipe_file(...,
mode="create")``. Every write-once also checks for an existing object first, so a store that ignores the
condition header still does not overwrite in the ordinary case (only a race between two writers of the
same key could then slip through, and one writer per repository is enforced by the lock).

Credentials, region and endpoint: whatever botocore already reads is used unchanged, i.e.
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` with
``~/.aws/config`` and ``~/.aws/credentials``, ``AWS_DEFAULT_REGION`` / ``AWS_REGION``, and the
service endpoint ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (botocore >= 1.31). The only addition
is the ``endpoint_url`` argument (the CLI's ``--endpoint-url``), which wins over the environment. Any
other s3fs option (server-side encryption through ``s3_additional_kwargs``, ``requester_pays``, ...)
goes through ``storage_options`` or fsspec's own ``FSSPEC_S3='{"s3_additional_kwargs": {...}}'``
environment variable. Transient errors are retried by s3fs and botocore; this module adds no retry loop.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
from pathlib import Path
from typing import IO, Iterator

from ckpt_archive.errors import CkptArchiveError, NotFound, StoreError
from ckpt_archive.format.paths import check_relpath

_CREDENTIAL_HINT = ("check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), the bucket "
                    "policy, and the endpoint (--endpoint-url / AWS_ENDPOINT_URL)")


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


class FsspecStore:
    """A store rooted at an fsspec URL; keys are ``/``-separated paths relative to that root.

    Args:
        url: ``s3://bucket/prefix`` (or any fsspec URL with a scheme).
        endpoint_url: an S3-compatible endpoint (MinIO, Ceph, R2, ...); overrides ``AWS_ENDPOINT_URL``.
        storage_options: extra keyword arguments for the fsspec filesystem (for s3fs e.g.
            ``{"s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "..."}}``).

    Raises:
        StoreError: the URL's scheme has no fsspec implementation installed (e.g. ``s3fs`` missing),
            or the filesystem cannot be set up (unknown profile, bad options).

    Example:
        >>> store = FsspecStore("s3://my-bucket/runs/a")          # doctest: +SKIP
        >>> store.write_bytes_once("hello.txt", b"hi")            # doctest: +SKIP
        >>> store.read_bytes("hello.txt")                          # doctest: +SKIP
        b'hi'
    """

    is_local = False  # informational; callers use local_path() / writer_lock(), never this flag

    def __init__(self, url: str, *, endpoint_url: str | None = None, storage_options: dict | None = None):
        import fsspec

        protocol, _ = fsspec.core.split_protocol(url)
        if not protocol:
            raise StoreError(f"not a URL with a scheme: {url!r}", where=url)
        self.protocol = protocol
        opts = dict(storage_options or {})
        if protocol in ("s3", "s3a"):
            if endpoint_url:
                client_kwargs = dict(opts.get("client_kwargs") or {})
                client_kwargs["endpoint_url"] = endpoint_url
                opts["client_kwargs"] = client_kwargs
            # A reader must see what another process just wrote (a marker, a new generation): no
            # listing cache. Our own instance, never a cached one built with other credentials.
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("skip_instance_cache", True)
        elif endpoint_url:
            raise StoreError(f"--endpoint-url applies to s3:// URLs only, not {protocol}://", where=url)
        self.endpoint_url = endpoint_url
        try:
            cls = fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            extra = " (pip install 'ckpt-archive[s3]')" if protocol in ("s3", "s3a") else ""
            raise StoreError(f"no filesystem for {protocol}:// URLs: {exc}{extra}", where=url) from None
        try:
            self.fs = cls(**opts)
        except Exception as exc:  # noqa: BLE001 - e.g. botocore ProfileNotFound, bad option names
            raise StoreError(f"cannot open the store: {type(exc).__name__}: {exc}", where=url,
                             hint=_CREDENTIAL_HINT) from None
        self.root = cls._strip_protocol(url).rstrip("/")
        self.location = f"{protocol}://{self.root}"

    # --- paths and errors ------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        # the one path rule (format/paths.py), before any request: no '..', absolute, empty part, '\\'
        if not key:
            return self.root
        check_relpath(key, where=self.location, what="store key")
        return f"{self.root}/{key}"

    @contextlib.contextmanager
    def _errors(self, key: str, action: str) -> Iterator[None]:
        """Translate store failures as :class:`~ckpt_archive.store.local.LocalStore` reports them: missing ->
        :class:`NotFound`, write-once collision -> :class:`StoreError`; and credentials, permissions,
        network -> :class:`StoreError` with a hint (all exit 2)."""
        try:
            yield
        except CkptArchiveError:
            raise
        except FileNotFoundError:
            if action in ("writing", "claiming"):  # S3 answers NoSuchBucket with 404 on a PUT
                raise StoreError(f"cannot write ({action} {key}): the bucket does not exist or is not visible "
                                 f"with these credentials (create it first)", where=self.location) from None
            raise NotFound(f"missing at {self.location}", where=key) from None
        except FileExistsError:
            raise StoreError(f"refusing to overwrite a write-once member at {self.location}",
                             where=key) from None
        except PermissionError as exc:
            raise StoreError(f"access denied ({action} {key or '/'}): {exc}", where=self.location,
                             hint=_CREDENTIAL_HINT) from None
        except Exception as exc:  # noqa: BLE001 - botocore/aiohttp errors have no common base we own
            raise self._translate_other(exc, key, action) from None

    def _translate_other(self, exc: Exception, key: str, action: str) -> Exception:
        name = type(exc).__name__
        what = f"({action} {key or '/'})"
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                    "ProfileNotFound", "NoAuthTokenError", "InvalidConfigError"):
            return StoreError(f"no usable credentials {what}: {exc}", where=self.location, hint=_CREDENTIAL_HINT)
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                    "ConnectionClosedError", "ClientConnectorError", "ServerDisconnectedError") \
                or isinstance(exc, (ConnectionError, TimeoutError)):
            return StoreError(f"cannot reach the store after retries {what}: {exc}", where=self.location,
                              hint="check the endpoint (--endpoint-url / AWS_ENDPOINT_URL) and the network")
        if isinstance(exc, OSError):
            return StoreError(f"{action} {key or '/'} failed: {exc.strerror or exc}", where=self.location)
        module = type(exc).__module__ or ""
        if module.startswith(("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec")):
            return StoreError(f"{action} {key or '/'} failed: {name}: {exc}", where=self.location)
        return exc

    # --- reading ---------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """True when an object (or a non-empty prefix) exists at ``key``."""
        with self._errors(key, "checking"):
            return bool(self.fs.exists(self._path(key)))

    def listdir(self, key: str = "") -> list[str]:
        """Names (not paths) of the objects and prefixes directly below ``key``, sorted; ``[]`` when
        nothing is there."""
        path = self._path(key)
        with self._errors(key, "listing"):
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        names = set()
        for entry in entries:
            entry = entry.rstrip("/")
            if entry == path:
                continue
            names.add(posixpath.basename(entry))
        return sorted(names)

    def size(self, key: str) -> int:
        """Size of the object at ``key`` in bytes. Raises :class:`NotFound` when absent."""
        with self._errors(key, "sizing"):
            info = self.fs.info(self._path(key))
        if info.get("type") == "directory":
            raise NotFound(f"missing at {self.location} (a prefix, not an object)", where=key)
        return int(info["size"])

    def open_read(self, key: str) -> IO[bytes]:
        """A binary file object reading the object at ``key`` (sequential reads are read ahead)."""
        with self._errors(key, "reading"):
            return _ReadWrapper(self.fs.open(self._path(key), "rb"), self, key)

    def read_bytes(self, key: str) -> bytes:
        """The whole object at ``key``. Raises :class:`NotFound` when absent."""
        with self._errors(key, "reading"):
            return self.fs.cat_file(self._path(key))

    # --- writing ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def write_once(self, key: str) -> Iterator[IO[bytes]]:
        """Create the object ``key`` exclusively, streaming (multipart above the block size).

        The object appears only when the block exits without an exception; on an exception the upload
        is aborted and nothing is created.

        Raises:
            StoreError: the object already exists (checked before the upload and, where the store
                supports conditional writes, atomically at commit); or the store refused the write.
        """
        path = self._path(key)
        with self._errors(key, "writing"):
            if self.fs.exists(path):
                raise FileExistsError(errno.EEXIST, "exists", path)
            f = self.fs.open(path, "xb")
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # aborts a multipart upload; a one-shot PUT was never sent
            f.closed = True
            raise
        with self._errors(key, "writing"):
            try:
                f.close()  # the commit: one PUT, or CompleteMultipartUpload, both If-None-Match
            except BaseException:
                with contextlib.suppress(Exception):
                    f.discard()
                raise

    def write_new(self, key: str):
        """Atomic exclusive create: on an object store :meth:`write_once` already is (the object appears
        only at the commit, conditionally)."""
        return self.write_once(key)

    def new_object(self, folder: str, hint: str) -> "_FsspecPending":
        """Start an object whose key is decided when it is complete: uploaded to ``folder/.HINT.tmp-PID-<hex>``
        (:func:`ckpt_archive.store.fs.temp_name`, the same names as on a local disk), then copied
        (server-side) to its final key at :meth:`_FsspecPending.commit` and the temporary object deleted;
        ``abort`` discards the upload."""
        from ckpt_archive.store.fs import temp_name

        tmp = f"{folder}/{temp_name(hint)}"
        cm = self.write_once(tmp) if not self.exists(tmp) else None
        if cm is None:
            self.remove(tmp)  # left by a killed writer of this name (the lock is held)
            cm = self.write_once(tmp)
        return _FsspecPending(self, tmp, cm)

    def write_bytes_once(self, key: str, data: bytes) -> None:
        """Create the object ``key`` holding ``data``, exclusively. Raises :class:`StoreError` if it exists."""
        path = self._path(key)
        with self._errors(key, "writing"):
            if self.fs.exists(path):
                raise FileExistsError(errno.EEXIST, "exists", path)
            self.fs.pipe_file(path, bytes(data), mode="create")

    def replace_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key``, replacing any object there (a single PUT: readers see old or new)."""
        with self._errors(key, "writing"):
            self.fs.pipe_file(self._path(key), bytes(data))

    def claim(self, key: str) -> bool:
        """Exclusively create an empty object at ``key``; False when it already exists."""
        path = self._path(key)
        with self._errors(key, "claiming"):
            if self.fs.exists(path):
                return False
            try:
                self.fs.pipe_file(path, b"", mode="create")
            except FileExistsError:
                return False
        return True

    def remove(self, key: str) -> None:
        """Delete the object at ``key``; absent is fine."""
        with self._errors(key, "deleting"):
            try:
                self.fs.rm_file(self._path(key))
            except FileNotFoundError:
                pass

    def remove_prefix(self, key: str) -> None:
        """Delete every object below ``key`` (and ``key`` itself); absent is fine."""
        path = self._path(key)
        with self._errors(key, "deleting"):
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

    def abort_uploads(self, key: str) -> list[str]:
        """Abort the multipart uploads in progress below ``key`` and return their keys (relative to the root).

        A writer killed mid-upload leaves its parts behind: invisible (no object appears), but billed
        until aborted. Only the caller's own keys are touched: call it with a prefix that holds the
        writer lock's generation. A store without multipart uploads returns ``[]``.

        Raises:
            StoreError: the store refused the listing or the abort.
        """
        if self.protocol not in ("s3", "s3a"):
            return []
        bucket, _, prefix = self._path(key).partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        aborted: list[str] = []
        with self._errors(key, "aborting unfinished uploads below"):
            marker: dict = {}
            while True:
                resp = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
                for upload in resp.get("Uploads") or []:
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                    UploadId=upload["UploadId"])
                    aborted.append(upload["Key"][len(self.root.partition("/")[2]):].lstrip("/"))
                if not resp.get("IsTruncated"):
                    break
                marker = {"KeyMarker": resp.get("NextKeyMarker"), "UploadIdMarker": resp.get("NextUploadIdMarker")}
        return sorted(aborted)

    def fsync_dir(self, key: str = "") -> None:
        """No-op: an object store's PUT is durable once it returns."""

    def free_bytes(self) -> int | None:
        """``None``: an object store does not say how much room is left."""
        return None

    def local_path(self, key: str = "") -> None:
        """``None``: not a local folder."""
        return None

    def _lock_place(self) -> tuple[Path, str]:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ckpt-archive" / "locks"
        return cache, hashlib.sha256(self.location.encode()).hexdigest()[:24] + ".lock"

    def lock_file(self) -> Path:
        """A file in the user's cache keyed by the URL (``~/.cache/ckpt-archive/locks``): one writer per
        machine (an object store offers no lock the kernel would release for a killed writer). For
        messages; :meth:`writer_lock` takes it."""
        folder, name = self._lock_place()
        folder.mkdir(parents=True, exist_ok=True)  # the user's cache (a link on its path is the user's choice)
        return folder / name

    def writer_lock(self):
        """The writer lock: the machine's lock on :meth:`lock_file`, through the file layer
        (:class:`ckpt_archive.store.fs.WriterLock`: opened ``O_NOFOLLOW`` relative to the cache folder, created
        if absent; a link planted at the lock or owner file is refused, never followed), then the lease lock
        in the repository itself (:class:`ckpt_archive.store.lease_lock.StoreWriterLock`)."""
        from ckpt_archive.errors import LockError
        from ckpt_archive.store import fs

        def refuse(rel: str, root: str) -> Exception:  # the user's cache, not an archive: could not lock (exit 2)
            return LockError(f"{rel} is a symbolic link; the writer lock is never taken or recorded through one "
                             f"(remove the link by hand if it is yours)", where=root)

        from ckpt_archive.store.lease_lock import StoreWriterLock

        folder, name = self._lock_place()
        # the machine's lock first (cheap, freed by the kernel when a holder dies), then the repository's own
        # lease lock, so that two machines never both hold it (docs/FORMAT.md, "The writer lock")
        return StoreWriterLock(fs.WriterLock(folder, name, create_folder=True, refuse=refuse), self)

    def __repr__(self) -> str:
        return f"FsspecStore({self.location!r})"


class _ReadWrapper:
    """A read-only file that turns store errors raised mid-read into the same errors as ``_errors``."""

    def __init__(self, f, store: FsspecStore, key: str):
        self._f = f
        self._store = store
        self._key = key

    def read(self, n: int = -1) -> bytes:
        with self._store._errors(self._key, "reading"):
            return self._f.read(n)

    def readinto(self, b) -> int:
        with self._store._errors(self._key, "reading"):
            return self._f.readinto(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _FsspecPending:
    """A :meth:`FsspecStore.new_object` in progress: ``fh`` to write, then ``commit(key)`` or ``abort()``."""

    def __init__(self, store: FsspecStore, tmp: str, cm):
        self.store, self.tmp, self.cm = store, tmp, cm
        self.fh = cm.__enter__()

    def commit(self, key: str, *, sync_dir: bool = True, replace: bool = False) -> bool:
        """Upload, then copy to ``key`` unless it exists (False; ``replace=True`` copies over it: one PUT,
        readers see the old object or the new one); the temporary object is deleted (``sync_dir``:
        nothing to do on an object store)."""
        try:
            self.cm.__exit__(None, None, None)
            if self.store.exists(key) and not replace:
                return False
            with self.store._errors(key, "writing"):
                self.store.fs.copy(self.store._path(self.tmp), self.store._path(key))
            return True
        finally:
            self.store.remove(self.tmp)

    def abort(self) -> None:
        import contextlib as _cl

        with _cl.suppress(Exception):
            self.cm.__exit__(RuntimeError, RuntimeError("aborted"), None)
        with _cl.suppress(Exception):
            self.store.remove(self.tmp)


__all__ = ["FsspecStore"]
