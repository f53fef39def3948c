"""Keys: make a signing key pair or an encryption key file, and change an encrypted repository's key.

``ckpt-archive key new PATH`` writes an Ed25519 private key (mode 0600) and ``PATH.pub`` (an
``ssh-ed25519`` line); ``key new --encryption PATH`` a repository key file (32 random bytes, base64);
``key change REPO`` re-wraps the repository's data key under a new key file (docs/FORMAT.md, "Encrypted
repositories"): nothing but ``repository.json`` is rewritten.
"""
from __future__ import annotations

import dataclasses
import hmac
import os
from pathlib import Path

from ckpt_archive.errors import OutputExists, UsageError
from ckpt_archive.format import crypto, jsonio, signature
from ckpt_archive.ops.common import RepoLike


@dataclasses.dataclass
class KeyResult:
    """What :func:`new_key` wrote (never the key itself).

    Attributes:
        path: the private key or key file. public_path: ``PATH.pub`` (signing keys), else None.
        fingerprint: the public key's ``SHA256:...`` (signing keys), else None. kind: ``signing`` or ``encryption``.
    """

    path: str
    public_path: str | None
    fingerprint: str | None
    kind: str
    ok: bool = True

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _create_private(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` exclusively with ``mode`` (never replacing a key: a lost key loses every archive)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    except FileExistsError:
        raise OutputExists(f"{path} exists; a key is never overwritten (choose another path)") from None
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow what a key file is
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def new_key(path: str | os.PathLike, *, encryption: bool = False) -> KeyResult:
    """Write a new key.

    Args:
        path: where the private key (or key file) goes; created exclusively, mode 0600.
        encryption: a repository key file instead of a signing key pair.

    Returns:
        :class:`KeyResult`.

    Raises:
        OutputExists: ``path`` (or ``PATH.pub``) exists. UsageError: it cannot be created.
    """
    p = Path(path).expanduser()
    if encryption:
        _create_private(p, crypto.new_key_file_text(), 0o600)
        return KeyResult(str(p), None, None, "encryption")
    pem = signature.new_private_pem()
    key = signature.load_private(pem, str(p))
    pub = p.with_name(p.name + ".pub")
    if pub.exists() or pub.is_symlink():
        raise OutputExists(f"{pub} exists; a key is never overwritten (choose another path)")
    _create_private(p, pem, 0o600)
    _create_private(pub, (signature.public_line(key.public_key()) + "\n").encode(), 0o644)
    return KeyResult(str(p), str(pub), signature.fingerprint(key.public_key()), "signing")


def change_repository_key(repo: RepoLike, old_key_file: str | os.PathLike, new_key_file: str | os.PathLike,
                          *, wait: float = 0.0, **store_options) -> dict:
    """Re-wrap an encrypted repository's data key under ``new_key_file``; ``old_key_file`` stops opening it.

    Returns:
        ``{"ok": True, "location", "key_records"}``.

    Raises:
        KeyRefused: ``old_key_file`` does not open the repository. UsageError: not encrypted, or a key file
        is unreadable. LockError: another writer holds the lock.
    """
    from ckpt_archive.repo import keys
    from ckpt_archive.repo.repository import REPO_FILE, Repository

    r = repo if isinstance(repo, Repository) else Repository.open(repo, key_file=old_key_file, **store_options)
    old, _ = keys.key_material(old_key_file)
    new, _ = keys.key_material(new_key_file)
    if hmac.compare_digest(old, new):  # "now opens with K (not with K)" was reported, and K still opened it
        raise UsageError("the new key file holds the same key as the old one: nothing would change (give a "
                         "new key: `ckpt-archive key new --encryption PATH`)")
    with r.lock(wait):
        r.check_lock()  # fencing: a writer whose lease lapsed must not write an old repository.json back
        config = keys.change_key(r._read_config(r.store), old, new)
        r.store.replace_bytes(REPO_FILE, jsonio.dumps(config, indent=1, ensure_ascii=True))
        r.config = config
    return {"ok": True, "location": r.location, "key_records": len(config["encryption"]["keys"])}


__all__ = ["new_key", "change_repository_key", "KeyResult"]
