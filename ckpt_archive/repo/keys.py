"""The keys a repository is opened with: the encryption key file, the signing key, the trusted public keys.

Each comes from an argument or, when that is None, from the environment, so every command and the
library read them the same way (docs/FORMAT.md, "Encrypted repositories" and "Signatures"):

* ``CKPT_ARCHIVE_KEY_FILE``: the key file of an encrypted repository (its secret: a passphrase or the
  line ``ckpt-archive key new --encryption`` writes);
* ``CKPT_ARCHIVE_SIGN_KEY``: an Ed25519 private key; every generation published through this repository
  object is signed with it;
* ``CKPT_ARCHIVE_TRUST``: public key files (``PATH.pub``), separated by ``os.pathsep``; with them, a
  generation that is unsigned or signed by another key is refused (exit 1).

Key material is never logged, never put in ``--json``, a report, a manifest or an exception message.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpt_archive.errors import NewerFormatError, UsageError
from ckpt_archive.format import crypto, signature

ENV_KEY_FILE = "CKPT_ARCHIVE_KEY_FILE"
ENV_SIGN_KEY = "CKPT_ARCHIVE_SIGN_KEY"
ENV_TRUST = "CKPT_ARCHIVE_TRUST"


def _read_small(path: str | os.PathLike, what: str, limit: int = 1 << 16) -> bytes:
    """A user's key file (outside any repository: read with a plain open, bounded)."""
    p = Path(path).expanduser()
    try:
        # a key file the user named, never a repository path. O_NONBLOCK: opening a FIFO (or a device)
        # must not wait for a writer forever; anything but a regular file is refused before it is read
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise UsageError(f"{what} {p} does not exist") from None
    except OSError as exc:
        raise UsageError(f"{what} {p} cannot be read: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{what} {p} is not a regular file (a directory, FIFO, socket or device)")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"{what} {p} cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UsageError(f"{what} {p} is larger than {limit} bytes: not a key file")
    return data


def key_material(key_file: str | os.PathLike | None | bool) -> tuple[bytes | None, bool]:
    """The encryption secret: from ``key_file``, else from ``$CKPT_ARCHIVE_KEY_FILE``; ``False``: none, the
    environment not read.

    Returns:
        ``(material or None, explicit)``: ``explicit`` is True when the caller named the file (an
        environment default does not make a plain repository an error).

    Raises:
        UsageError: the file is missing, unreadable or not a key file. KeyRefused: empty.
    """
    if key_file is False:  # explicitly none (an export destination given no key): the environment is not read
        return None, False
    explicit = key_file is not None
    path = key_file if explicit else os.environ.get(ENV_KEY_FILE) or None
    if path is None:
        return None, False
    data = _read_small(path, "key file", crypto.MAX_KEY_FILE_BYTES)
    return crypto.read_key_material(data, str(path)), explicit


def new_encryption(material: bytes, repo_id: str) -> dict:
    """The ``encryption`` block of a new encrypted repository's ``repository.json`` (a fresh data key,
    wrapped by the user's key)."""
    return {"cipher": crypto.CIPHER_NAME, "segment_bytes": crypto.SEGMENT_BYTES,
            "keys": [crypto.wrap_data_key(crypto.new_data_key(), material, repo_id)]}


def open_encrypted(store, config: dict, material: bytes | None, explicit: bool):
    """The store to use for a repository: ``store`` itself when the repository is not encrypted, else an
    :class:`~ckpt_archive.store.encrypted.EncryptedStore` over it, keyed with the data key ``material``
    unwraps.

    Raises:
        KeyRefused: (exit 2) encrypted and no key given ("encrypted; give --key-file"), or the key does
            not open it. UsageError: a key file named for a repository that is not encrypted.
        NewerFormatError: a cipher this reader does not know.
    """
    enc = config.get("encryption")
    if enc is None:
        if material is not None and explicit:
            raise UsageError(f"{store.location} is not encrypted (it was created without --key-file); "
                             f"drop --key-file, or export it to a new encrypted repository with "
                             f"`ckpt-archive export {store.location} --to NEW --to-key-file KEY`")
        if material is not None:
            # a key from the environment says "my repositories are encrypted": a plain repository.json where
            # one is expected may be a downgrade (someone who can write the bucket removed "encryption" and
            # planted plaintext generations, or waits for the next pack to write in the clear). Refuse
            # rather than read or write it as if it were the user's.
            raise UsageError(f"{store.location} is not encrypted, but {ENV_KEY_FILE} is set: if this repository "
                             f"should be encrypted, its repository.json was replaced (do not trust its "
                             f"generations); to use a plain repository, unset {ENV_KEY_FILE}")
        return store
    if not isinstance(enc, dict):
        raise crypto.KeyRefused("repository.json: encryption is not an object", where=store.location)
    if enc.get("cipher") != crypto.CIPHER_NAME or enc.get("segment_bytes") != crypto.SEGMENT_BYTES:
        raise NewerFormatError(f"encrypted with {enc.get('cipher')!r} (segments of {enc.get('segment_bytes')!r} "
                               f"bytes); this reader knows {crypto.CIPHER_NAME}", where=store.location)
    if material is None:
        raise crypto.KeyRefused(f"the repository is encrypted; give --key-file PATH (or set {ENV_KEY_FILE})",
                                where=store.location)
    from ckpt_archive.store.encrypted import EncryptedStore

    try:
        data_key, _ = crypto.unwrap_data_key(enc.get("keys"), material, str(config.get("id")))
    except crypto.KeyRefused as exc:
        exc.where = exc.where or store.location
        raise
    return EncryptedStore(store, crypto.RepoKeys(data_key))


def change_key(config: dict, old: bytes, new: bytes) -> dict:
    """``config`` with its data key re-wrapped under ``new`` (and no longer under ``old``): the user's key
    changes, the data (and every file) stays as it is.

    Raises:
        KeyRefused: ``old`` does not open the repository. UsageError: not encrypted.
    """
    enc = config.get("encryption")
    if not isinstance(enc, dict):
        raise UsageError("the repository is not encrypted: there is no key to change")
    data_key, used = crypto.unwrap_data_key(enc.get("keys"), old, str(config.get("id")))
    keep = [r for r in enc["keys"] if isinstance(r, dict) and r.get("id") != used]
    return {**config, "encryption": {**enc, "keys": keep + [crypto.wrap_data_key(data_key, new, str(config.get("id")))]}}


def load_signer(sign_key: str | os.PathLike | None):
    """The Ed25519 private key to sign with: ``sign_key``, else ``$CKPT_ARCHIVE_SIGN_KEY``; None for neither.

    Raises:
        UsageError: missing, unreadable or not an Ed25519 private key.
    """
    path = sign_key if sign_key is not None else os.environ.get(ENV_SIGN_KEY) or None
    if path is None:
        return None
    try:
        return signature.load_private(_read_small(path, "signing key"), str(path))
    except signature.SignatureProblem as exc:
        raise UsageError(f"signing key {path}: {exc.message}") from None


def load_trust(trust) -> dict | None:
    """``{fingerprint: public key}`` of the trusted keys: ``trust`` (a path, or a list of paths or
    already-loaded keys), else ``$CKPT_ARCHIVE_TRUST``; None when neither names any (no trust required).

    Raises:
        UsageError: a file missing, unreadable, or not an ssh-ed25519 public key line.
    """
    if trust is None:
        env = os.environ.get(ENV_TRUST) or ""
        trust = [p for p in env.split(os.pathsep) if p] or None
    if trust is None:
        return None
    if isinstance(trust, (str, os.PathLike)):
        trust = [trust]
    out = {}
    for item in trust:
        if isinstance(item, (str, os.PathLike)):
            text = _read_small(item, "trusted key").decode("utf-8", "replace")
            try:
                key = signature.load_public(text, str(item))
            except signature.SignatureProblem as exc:
                raise UsageError(f"trusted key {item}: {exc.message}") from None
        else:
            key = item
        out[signature.fingerprint(key)] = key
    if not out:
        raise UsageError("--trust names no key")
    return out


__all__ = ["key_material", "new_encryption", "open_encrypted", "change_key", "load_signer", "load_trust",
           "ENV_KEY_FILE", "ENV_SIGN_KEY", "ENV_TRUST"]
