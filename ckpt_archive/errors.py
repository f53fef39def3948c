"""One exception hierarchy for ckpt-archive.

Every error says what is wrong, where (file, member, field) and, where it helps, what to do. Each
class carries the CLI exit code it maps to, in one place (borg's ``helpers/errors.py`` habit):

* ``0`` ok;
* ``1`` something was examined and found wrong (:class:`CheckFailed` and its subclasses);
* ``2`` the operation could not be carried out (:class:`CannotCheck` and its subclasses).

Codes are never reused for another meaning.
"""
from __future__ import annotations


class CkptArchiveError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with; ``where`` names the file/member/field."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.hint = hint

    def __str__(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f" ({self.hint})"
        return text

    def to_json(self) -> dict:
        return {"error": type(self).__name__, "where": self.where, "reason": self.message, "hint": self.hint}


# --- exit code 1: examined and found wrong -------------------------------------------------------
class CheckFailed(CkptArchiveError):
    """Something was examined and found wrong (exit 1)."""

    exit_code = 1


class IntegrityError(CheckFailed):
    """A stored member is corrupt, tampered with, truncated or missing."""


class ManifestInvalid(CheckFailed):
    """A manifest or marker is not valid JSON or breaks its schema (it was examined and is wrong)."""


class IncoherentState(CheckFailed):
    """The parts of a state do not describe the same instant, or a structure does not match."""


class ResumeDivergence(CheckFailed):
    """A resumed run did not match the continuous one, or a negative control did not diverge."""


# --- exit code 2: could not be carried out ---------------------------------------------------------
class CannotCheck(CkptArchiveError):
    """The operation could not be carried out (exit 2)."""

    exit_code = 2


class SourceError(CannotCheck):
    """The input is unreadable, not a checkpoint, or refused (e.g. it would need unpickling code)."""


class RefusedPickle(SourceError):
    """A pickle references a class or function outside the allowlist; we never unpickle code."""


class FormatError(CannotCheck):
    """The archive's manifest or layout cannot be read at all (schema broken, unknown layout)."""


class NewerFormatError(CannotCheck):
    """The archive was written by a newer format version than this reader knows."""


class NotFound(CannotCheck):
    """A repository, generation, path or member named by the user does not exist."""


class NoUsableGeneration(CannotCheck):
    """The repository holds no usable generation matching the request."""


class LockError(CannotCheck):
    """The repository's writer lock could not be obtained (another writer, or a stale lock)."""


class OutputExists(CannotCheck):
    """The output path exists and ``--force`` was not given; nothing was overwritten."""


class InsufficientSpace(CannotCheck):
    """The destination has not enough free space for the output."""


class UsageError(CannotCheck):
    """Bad arguments (a malformed REPO@GEN, an empty retention policy, conflicting flags)."""


class StoreError(CannotCheck):
    """A destination store refused or failed an operation (credentials, permissions, network)."""
