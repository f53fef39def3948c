"""Encrypted repositories: the on-disk contract (docs/FORMAT.md, "Encrypted repositories"). Pure: bytes in,
bytes out; the store wrapper that applies it to every file is :mod:`ckpt_archive.store.encrypted`.

restic's design (``doc/design.rst``, "Keys, Encryption and MAC") is the model: a random *data key* encrypts
everything; the user's key only wraps the data key, so the user's key can be changed by re-wrapping 32
bytes, never by re-encrypting the repository. What differs, and why:

* **Files are sealed in segments** (:data:`SEGMENT_BYTES` of plaintext each, AES-256-GCM), so a reader can
  decrypt any byte range (a chunk of a member, a shared object) without reading the whole file, and the
  plaintext size follows from the ciphertext size alone (:func:`plaintext_size`). This is the STREAM
  construction (Hoang, Reyhanitabar, Rogaway, Vizár 2015; used by Tink's streaming AEAD and age):
* **a nonce is never reused under a key, by construction**: each file starts with a random 32-byte salt,
  its segment key is HKDF-SHA256(data key, salt) — a fresh key per file — and the nonce of segment *i* is
  *i* (11 bytes, big-endian) followed by a last-segment flag byte. Within one file every nonce differs;
  across files the keys differ (two equal salts have probability 2**-256). The flag makes a file cut at a
  segment boundary fail (its new last segment was sealed as not-last), and a segment moved to another
  index fails its tag.
* **Object names are keyed** (:class:`NameCipher`), so equal tensors in two repositories get unrelated
  names: an object's name ``<raw hex>-<stored hex>`` is sealed with AES-SIV (deterministic: the same
  object always gets the same name under one data key, which dedup needs; reversible, which listing
  needs) and its two-hex-digit folder is relabelled by a keyed permutation of the 256 folder names.

What stays in the clear, by design: ``repository.json`` (it says the repository is encrypted, and holds
the wrapped data keys and their KDF parameters — never a key), the generation folder numbers, member
file names inside a generation (fixed names: ``manifest.json``, ``tensors-00000.safetensors.ckz``,
``exact/<relpath>.ckz`` — a source file's relative path is visible), and every file's size (to
about one segment tag per MiB).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from ckpt_archive.errors import CannotCheck, IntegrityError

__all__ = ["MAGIC", "SALT_BYTES", "HEADER_BYTES", "SEGMENT_BYTES", "TAG_BYTES", "KEY_BYTES", "CIPHER_NAME",
           "encrypted_size", "plaintext_size", "FileCipher", "NameCipher", "RepoKeys", "new_data_key",
           "wrap_data_key", "unwrap_data_key", "KeyRefused", "read_key_material", "new_key_file_text"]

#: First bytes of every encrypted file (8 bytes: name, format version of the file layout, reserved).
MAGIC = b"CKAENC\x01\x00"
SALT_BYTES = 32
HEADER_BYTES = len(MAGIC) + SALT_BYTES
#: Plaintext bytes per sealed segment (the last one may be shorter, possibly empty).
SEGMENT_BYTES = 1 << 20
TAG_BYTES = 16
KEY_BYTES = 32
#: The cipher named in ``repository.json`` (``encryption.cipher``).
CIPHER_NAME = "aes-256-gcm-stream-v1"
_SEGMENT_INFO = b"ckpt-archive segment key v1"
_AAD = b"ckpt-archive encrypted file v1"
#: scrypt parameters for the user's key (restic's defaults are tuned per machine; these cost ~0.1 s and
#: 32 MiB, enough for a key file of random bytes and for a passphrase of some length)
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1
_WRAP_AAD = b"ckpt-archive data key v1"


class KeyRefused(CannotCheck):
    """The key given does not open this repository (or no key was given for an encrypted one): exit 2."""


def _segments(n: int) -> int:
    """How many segments hold ``n`` plaintext bytes (an empty file is one empty, final segment)."""
    return max(1, -(-n // SEGMENT_BYTES))


def encrypted_size(n: int) -> int:
    """Bytes on disk of a file holding ``n`` plaintext bytes: header + plaintext + one tag per segment."""
    return HEADER_BYTES + n + TAG_BYTES * _segments(n)


def plaintext_size(m: int) -> int:
    """Plaintext bytes of an encrypted file of ``m`` bytes on disk (the inverse of :func:`encrypted_size`).

    Raises:
        IntegrityError: no plaintext size gives ``m`` (a truncated or extended file).
    """
    body = m - HEADER_BYTES
    if body < TAG_BYTES:
        raise IntegrityError(f"encrypted file of {m} bytes is shorter than its header and one segment tag")
    full = SEGMENT_BYTES + TAG_BYTES
    k, rest = divmod(body, full)
    if rest == 0:
        n = k * SEGMENT_BYTES  # k full segments, the last of them final
    elif rest >= TAG_BYTES:
        n = k * SEGMENT_BYTES + rest - TAG_BYTES
    else:
        raise IntegrityError(f"encrypted file of {m} bytes does not end on a segment boundary (cut or extended)")
    if encrypted_size(n) != m:
        raise IntegrityError(f"encrypted file of {m} bytes does not end on a segment boundary (cut or extended)")
    return n


def _hkdf(key: bytes, salt: bytes | None, info: bytes, length: int = KEY_BYTES) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(key)


class FileCipher:
    """Seals and opens the segments of one encrypted file.

    Args:
        data_key: the repository's 32-byte data key.
        salt: the file's 32-byte salt (a new file: ``None`` draws a random one).
    """

    def __init__(self, data_key: bytes, salt: bytes | None = None):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
        if len(self.salt) != SALT_BYTES:
            raise ValueError("salt must be 32 bytes")
        self._aead = AESGCM(_hkdf(data_key, self.salt, _SEGMENT_INFO))

    @property
    def header(self) -> bytes:
        """The file's first :data:`HEADER_BYTES`: magic and salt."""
        return MAGIC + self.salt

    @staticmethod
    def salt_of(header: bytes, where: str) -> bytes:
        """The salt in a file's header.

        Raises:
            IntegrityError: not an encrypted file of this format (names ``where``).
        """
        if len(header) != HEADER_BYTES or header[:len(MAGIC)] != MAGIC:
            raise IntegrityError("not an encrypted file of this repository (bad header): damaged, or written "
                                 "without encryption", where=where)
        return header[len(MAGIC):]

    @staticmethod
    def _nonce(index: int, last: bool) -> bytes:
        return index.to_bytes(11, "big") + (b"\x01" if last else b"\x00")

    def seal(self, index: int, plaintext: bytes | memoryview, last: bool) -> bytes:
        """Segment ``index`` (0-based) sealed: ciphertext and its 16-byte tag."""
        return self._aead.encrypt(self._nonce(index, last), bytes(plaintext), _AAD)

    def open(self, index: int, sealed: bytes, last: bool, where: str) -> bytes:
        """Segment ``index`` opened.

        Raises:
            IntegrityError: the tag does not match (the bytes were changed, cut, moved or sealed under
                another key): names ``where`` and the segment.
        """
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(self._nonce(index, last), sealed, _AAD)
        except InvalidTag:
            raise IntegrityError(f"encrypted segment {index} fails its authentication tag (changed, cut or "
                                 f"moved since it was written)", where=where) from None

    @staticmethod
    def segment_span(index: int, total_plain: int) -> tuple[int, int, bool]:
        """``(ciphertext offset, sealed length, last)`` of segment ``index`` of a file of ``total_plain``
        plaintext bytes."""
        count = _segments(total_plain)
        last = index == count - 1
        plain = (total_plain - index * SEGMENT_BYTES) if last else SEGMENT_BYTES
        return HEADER_BYTES + index * (SEGMENT_BYTES + TAG_BYTES), plain + TAG_BYTES, last


class NameCipher:
    """Keyed, deterministic, reversible names for shared objects (module docstring).

    ``objects/<hh>/<raw hex>-<stored hex>.ckz`` is stored as ``objects/<π(hh)>/<sealed>.ckz``, where
    ``sealed`` is the AES-SIV encryption of the 64 bytes the two hex digests spell (80 bytes, as 160 hex
    digits) and π a keyed permutation of the 256 two-hex-digit folder names.
    """

    def __init__(self, name_key: bytes):
        from cryptography.hazmat.primitives.ciphers.aead import AESSIV

        self._siv = AESSIV(name_key)  # 64 bytes: AES-256-SIV
        order = sorted(range(256), key=lambda i: hmac.new(name_key, b"folder %d" % i, hashlib.sha256).digest())
        self._fwd = {f"{i:02x}": f"{order[i]:02x}" for i in range(256)}
        self._back = {v: k for k, v in self._fwd.items()}

    def folder(self, plain: str) -> str:
        """The stored name of an object folder (``plain`` is two lower-case hex digits); other names unchanged."""
        return self._fwd.get(plain, plain)

    def folder_back(self, stored: str) -> str:
        return self._back.get(stored, stored)

    def name(self, plain: str) -> str | None:
        """The stored file name for ``<raw hex>-<stored hex>.ckz``, or None when ``plain`` is not an object name."""
        stem, dot, ext = plain.partition(".")
        raw, dash, stored = stem.partition("-")
        if not (dash and dot and ext == "ckz" and len(raw) == 64 and len(stored) == 64):
            return None
        try:
            blob = bytes.fromhex(raw) + bytes.fromhex(stored)
        except ValueError:
            return None
        return self._siv.encrypt(blob, [b"object name"]).hex() + ".ckz"

    def name_back(self, stored: str) -> str | None:
        """The object name a stored file name seals, or None (not a sealed name of this key: a leftover,
        a foreign or tampered file)."""
        from cryptography.exceptions import InvalidTag

        stem, dot, ext = stored.partition(".")
        if not (dot and ext == "ckz" and len(stem) == 160):
            return None
        try:
            blob = self._siv.decrypt(bytes.fromhex(stem), [b"object name"])
        except (ValueError, InvalidTag):
            return None
        return f"{blob[:32].hex()}-{blob[32:].hex()}.ckz"


class RepoKeys:
    """The keys derived from a repository's data key (never stored): ``data`` for file segments, and the
    name key of :class:`NameCipher`."""

    def __init__(self, data_key: bytes):
        if len(data_key) != KEY_BYTES:
            raise ValueError("a data key is 32 bytes")
        self.data = data_key
        self.names = NameCipher(_hkdf(data_key, None, b"ckpt-archive object names v1", 64))

    def file_cipher(self, salt: bytes | None = None) -> FileCipher:
        return FileCipher(self.data, salt)


def new_data_key() -> bytes:
    """32 random bytes (the OS's CSPRNG)."""
    return secrets.token_bytes(KEY_BYTES)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s, what: str) -> bytes:
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except (AttributeError, ValueError, UnicodeEncodeError):
        raise KeyRefused(f"repository.json: encryption {what} is not base64") from None


def _kek(material: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    return Scrypt(salt=salt, length=KEY_BYTES, n=n, r=r, p=p).derive(material)


def wrap_data_key(data_key: bytes, material: bytes, repo_id: str) -> dict:
    """One ``repository.json`` ``encryption.keys[]`` record: ``data_key`` sealed under a key derived from
    the user's key material (scrypt, a fresh salt each time, so each record has its own key and its
    random nonce is never reused under it). Bound to ``repo_id``: a record copied into another
    repository does not open there.

    Returns:
        ``{"id", "kdf": {"name": "scrypt", "salt", "n", "r", "p"}, "nonce", "wrapped"}`` (base64 fields).
    """
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    salt, nonce = secrets.token_bytes(16), secrets.token_bytes(12)
    kek = _kek(material, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    wrapped = AESGCM(kek).encrypt(nonce, data_key, _WRAP_AAD + repo_id.encode())
    return {"id": secrets.token_hex(8), "kdf": {"name": "scrypt", "salt": _b64(salt), "n": SCRYPT_N,
                                                "r": SCRYPT_R, "p": SCRYPT_P},
            "nonce": _b64(nonce), "wrapped": _b64(wrapped)}


#: At most this many ``encryption.keys`` records are read (``key change`` keeps one; a handful is generous).
MAX_KEY_RECORDS = 16
#: The most scrypt work (``n * r * p``, summed over the records) a reader spends opening a repository:
#: 64 times this writer's parameters (2**15 * 8 * 1), so a repository.json cannot make a reader derive for
#: minutes.
MAX_SCRYPT_WORK = 1 << 24


def _checked_kdf_params(records: list) -> list[tuple[int, int, int]]:
    """Every key record's scrypt ``(n, r, p)``, all checked before any key is derived (docs/FORMAT.md,
    "Encrypted repositories").

    Raises:
        KeyRefused: too many records, a record without scrypt parameters, parameters out of range, or
            more work in all than :data:`MAX_SCRYPT_WORK`.
    """
    if len(records) > MAX_KEY_RECORDS:
        raise KeyRefused(f"repository.json: {len(records)} encryption key records (at most {MAX_KEY_RECORDS})")
    params = []
    for rec in records:  # every record's parameters are checked before any key is derived
        kdf = rec.get("kdf") if isinstance(rec, dict) else None
        if not isinstance(kdf, dict) or kdf.get("name") != "scrypt":
            raise KeyRefused("repository.json: an encryption key record has no scrypt parameters")
        n, r, p = kdf.get("n"), kdf.get("r"), kdf.get("p")
        # bounded before use: hostile parameters must not make scrypt allocate gigabytes (128*n*r bytes)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (n, r, p)) \
                or not (2 <= n <= 1 << 20 and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16) \
                or 128 * n * r > 1 << 30:
            raise KeyRefused("repository.json: scrypt parameters out of range (n a power of two <= 2**20, "
                             "r <= 32, p <= 16, at most 1 GiB of memory)")
        params.append((n, r, p))
    # ... and their time is bounded too: scrypt's work is n*r*p, and a record count times p = 16 at
    # n = 2**20 would hold a reader for hours (not hang, refuse)
    if sum(n * r * p for n, r, p in params) > MAX_SCRYPT_WORK:
        raise KeyRefused(f"repository.json: the key records' scrypt work (n*r*p summed, "
                         f"{sum(n * r * p for n, r, p in params)}) exceeds {MAX_SCRYPT_WORK} "
                         f"(64 times the writer's own cost)")
    return params


def unwrap_data_key(records, material: bytes, repo_id: str) -> tuple[bytes, str]:
    """The data key the user's key material opens, and the id of the record that opened it.

    Raises:
        KeyRefused: (exit 2) no record opens with this key, or a record is malformed.
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not isinstance(records, list) or not records:
        raise KeyRefused("repository.json: encryption.keys is missing or empty")
    params = _checked_kdf_params(records)
    for rec, (n, r, p) in zip(records, params):
        kdf = rec["kdf"]
        kek = _kek(material, _unb64(kdf.get("salt"), "salt"), n, r, p)
        try:
            key = AESGCM(kek).decrypt(_unb64(rec.get("nonce"), "nonce"), _unb64(rec.get("wrapped"), "key"),
                                      _WRAP_AAD + repo_id.encode())
        except (InvalidTag, ValueError):
            continue
        if len(key) == KEY_BYTES:
            return key, str(rec.get("id"))
    raise KeyRefused("the key file does not open this repository (no key record of repository.json "
                     "opens with it); give the key file it was created or last changed with")


#: The most bytes of a key file read (a key file is a short secret, never a large file).
MAX_KEY_FILE_BYTES = 4096


def read_key_material(data: bytes, where: str) -> bytes:
    """The secret a key file holds: its bytes without a trailing newline (a passphrase or a
    :func:`new_key_file_text`). Refuses an empty or oversized file.

    Raises:
        KeyRefused: (exit 2) empty, or more than :data:`MAX_KEY_FILE_BYTES`.
    """
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyRefused(f"a key file holds at most {MAX_KEY_FILE_BYTES} bytes", where=where)
    material = data.rstrip(b"\r\n")
    if not material:
        raise KeyRefused("the key file is empty", where=where)
    return material


def new_key_file_text() -> bytes:
    """A new repository key file's content: 32 random bytes, base64, one line."""
    return _b64(secrets.token_bytes(KEY_BYTES)).encode() + b"\n"
