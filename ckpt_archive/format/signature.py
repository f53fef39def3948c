"""Signed generations: the on-disk contract (docs/FORMAT.md, "Signatures"). Pure: bytes in, bytes out; the
key files are read and written by :mod:`ckpt_archive.ops.keys`.

A marker (``USABLE.json``) may carry ``signature``: an Ed25519 signature (RFC 8032, through
``cryptography``) over a *statement* of what was published::

    {"format": "ckpt-archive-signature", "version": 1, "manifest_sha256": ..., "archive_id": ...,
     "generation": N, "trial_reload": {...}}

written as canonical JSON (sorted keys, no spaces, ASCII) and prefixed with ``ckpt-archive signature
v1\\n`` before signing, so the bytes signed can never be mistaken for another protocol's. The manifest's
sha256 covers every member's fingerprint, the state tree's, the config, metrics, data ids, progress and
tags, so the signature covers the whole content and every claim made about it. ``trial_reload`` is the
record of the trial reload that proved the generation where it was packed (where, host, when, tool
version, counts): the signer vouches that it ran. It deliberately does *not* cover the marker's
``location``: a signature covers content, not place, so it travels with ``export`` and ``adopt`` (the
new place's own trial-reload record sits beside it, unsigned).

Public keys are OpenSSH ``ssh-ed25519 AAAA...`` lines; a key's fingerprint is ``SHA256:<base64>`` of
its key blob, as ``ssh-keygen -l`` prints it.
"""
from __future__ import annotations

import base64
import hashlib
import json

from ckpt_archive.errors import CheckFailed

__all__ = ["PREFIX", "statement", "statement_bytes", "sign", "check", "fingerprint", "public_line",
           "load_public", "load_private", "new_private_pem", "SignatureProblem"]

PREFIX = b"ckpt-archive signature v1\n"
ALG = "ed25519"


class SignatureProblem(CheckFailed):
    """A signature is absent where trust is required, does not verify, or is by a key not trusted (exit 1)."""


def statement(manifest_sha256: str, archive_id: str, generation: int, trial_reload: dict) -> dict:
    """What a signature covers (module docstring)."""
    return {"format": "ckpt-archive-signature", "version": 1, "manifest_sha256": manifest_sha256,
            "archive_id": archive_id, "generation": generation, "trial_reload": trial_reload}


def statement_bytes(stmt: dict) -> bytes:
    """The exact bytes signed: :data:`PREFIX` + canonical JSON of ``stmt``."""
    return PREFIX + json.dumps(stmt, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                               allow_nan=False).encode("ascii")


def new_private_pem() -> bytes:
    """A new Ed25519 private key, PKCS#8 PEM, unencrypted (the file is created mode 0600)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption())


def load_private(pem: bytes, where: str):
    """An Ed25519 private key from PEM (PKCS#8 or OpenSSH).

    Raises:
        SignatureProblem: not an Ed25519 private key (exit 1 would be wrong here: callers turn it into a
            usage error naming the file).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        if pem.lstrip().startswith(b"-----BEGIN OPENSSH PRIVATE KEY"):
            key = serialization.load_ssh_private_key(pem, password=None)
        else:
            key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureProblem(f"not a usable private key ({exc})", where=where) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureProblem("not an Ed25519 private key", where=where)
    return key


def public_line(public_key) -> str:
    """The OpenSSH line of a public key: ``ssh-ed25519 AAAA...``."""
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def load_public(text: str, where: str):
    """An Ed25519 public key from its OpenSSH line (a trailing comment is allowed).

    Raises:
        SignatureProblem: not an Ed25519 public key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    parts = text.strip().split()
    if len(parts) < 2 or parts[0] != "ssh-ed25519":
        raise SignatureProblem("not an ssh-ed25519 public key line", where=where)
    try:
        key = serialization.load_ssh_public_key(f"{parts[0]} {parts[1]}".encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise SignatureProblem(f"not a usable public key ({exc})", where=where) from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureProblem("not an Ed25519 public key", where=where)
    return key


def fingerprint(public_key) -> str:
    """``SHA256:<base64 without padding>`` of the key blob, as ``ssh-keygen -l`` prints it."""
    blob = base64.b64decode(public_line(public_key).split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def sign(private_key, stmt: dict) -> dict:
    """The marker's ``signature`` field for ``stmt``: ``{"alg", "key", "fingerprint", "statement", "sig"}``."""
    pub = private_key.public_key()
    return {"alg": ALG, "key": public_line(pub), "fingerprint": fingerprint(pub), "statement": stmt,
            "sig": base64.b64encode(private_key.sign(statement_bytes(stmt))).decode("ascii")}


def check(sig: object, *, manifest_sha256: str, archive_id: str | None, generation: int,
          trusted: dict | None = None) -> str:
    """Check a marker's ``signature`` field against the generation it sits in.

    Args:
        sig: the field as read (hostile until checked).
        manifest_sha256, archive_id, generation: what the generation really is (the manifest as stored).
        trusted: ``{fingerprint: public key}`` of the keys the caller trusts, or None (any valid key:
            the signature is still checked and its key's fingerprint returned).

    Returns:
        the signing key's fingerprint.

    Raises:
        SignatureProblem: (exit 1) malformed, a statement about another manifest/archive/generation, a
            signature that does not verify, or a key not in ``trusted``.
    """
    from cryptography.exceptions import InvalidSignature

    if not isinstance(sig, dict) or sig.get("alg") != ALG or not isinstance(sig.get("statement"), dict) \
            or not isinstance(sig.get("key"), str) or not isinstance(sig.get("sig"), str):
        raise SignatureProblem("the signature is malformed (needs alg ed25519, key, statement, sig)")
    stmt = sig["statement"]
    want = {"manifest_sha256": manifest_sha256, "archive_id": archive_id, "generation": generation}
    for field, value in want.items():
        if stmt.get(field) != value:
            raise SignatureProblem(f"the signature is about {field} {stmt.get(field)!r}, this generation's is "
                                   f"{value!r}: the manifest was changed or the signature was moved here")
    if stmt.get("format") != "ckpt-archive-signature" or stmt.get("version") != 1:
        raise SignatureProblem("the signed statement is not a ckpt-archive signature of version 1")
    key = load_public(sig["key"], "signature key")
    fp = fingerprint(key)
    try:
        raw = base64.b64decode(sig["sig"].encode("ascii"), validate=True)
        key.verify(raw, statement_bytes(stmt))
    except (ValueError, UnicodeEncodeError, InvalidSignature, TypeError):
        raise SignatureProblem(f"the signature by key {fp} does not verify: the marker's signed statement "
                               f"was changed, or it was not made by that key") from None
    if trusted is not None and fp not in trusted:
        raise SignatureProblem(f"signed by key {fp}, which is not among the trusted keys "
                               f"({', '.join(sorted(trusted)) or 'none'})")
    return fp
