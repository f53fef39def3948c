"""One exception hierarchy and every exit code of ckpt-archive, in one place.

Every error says what is wrong, where (file, member, field) and, where it helps, what to do. Each
class carries the CLI exit code it maps to (borg's ``helpers/errors.py`` habit). The codes:

* :data:`EXIT_OK` ``0`` ok;
* :data:`EXIT_CHECK_FAILED` ``1`` something was examined and found wrong (:class:`CheckFailed` and its
  subclasses, or a result whose ``ok`` is false);
* :data:`EXIT_CANNOT_CHECK` ``2`` the operation could not be carried out (:class:`CannotCheck` and its
  subclasses, an ``OSError``, an unexpected error);
* :data:`EX_TEMPFAIL` ``75`` a temporary failure, retry later (``backup`` of a checkpoint still being
  written; sysexits.h's ``EX_TEMPFAIL``);
* :data:`EXIT_INTERRUPTED` ``130`` interrupted (Ctrl-C; 128 + SIGINT, the shell's convention).

Codes are never reused for another meaning. :func:`exit_code_for` is the one rule that turns a result
or an exception into its code; the CLI uses nothing else.
"""
from __future__ import annotations

from typing import Any, Mapping

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_CANNOT_CHECK = 2
EX_TEMPFAIL = 75
EXIT_INTERRUPTED = 130

#: What each exit code means in general; each command's ``--help`` lists the codes it can return, in its
#: own words where they say more (``ckpt_archive.cli.common.exit_codes_help``).
EXIT_MEANINGS = {
    EXIT_OK: "ok",
    EXIT_CHECK_FAILED: "something was examined and found wrong",
    EXIT_CANNOT_CHECK: "could not be carried out (bad arguments, missing path, refused access, lock held)",
    EX_TEMPFAIL: "temporary failure: retry later",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); the message names what was left and the command that cleans it",
}


class CkptArchiveError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with; ``where`` names the file/member/field."""

    exit_code = EXIT_CANNOT_CHECK

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


class CheckFailed(CkptArchiveError):
    """Something was examined and found wrong (exit 1)."""

    exit_code = EXIT_CHECK_FAILED


class IntegrityError(CheckFailed):
    """A stored member is corrupt, tampered with, truncated or missing."""


class ManifestInvalid(CheckFailed):
    """A manifest or marker is not valid JSON or breaks its schema (it was examined and is wrong)."""


class InvalidJSON(ManifestInvalid, ValueError):
    """A JSON document read from an archive or repository is not strict JSON (RFC 8259), repeats a key,
    holds NaN/Infinity, or is nested deeper or larger than allowed. Also a ``ValueError``, so code that
    treats "not JSON" as one case keeps doing so."""


class UnsafePath(CheckFailed):
    """A path read from an archive, a repository or a source is not a relative path of plain names, or
    resolves outside its folder, or goes through a symbolic link (exit 1; ``format/paths.py``)."""


class LinkInRepository(UnsafePath):
    """A repository's own structure (``repository.json``, ``generations/``, a generation folder, the lock)
    is a symbolic link: the operation is not carried out through it (exit 2: could not be carried out
    safely; nothing was read, written or deleted through the link)."""

    exit_code = EXIT_CANNOT_CHECK


class ImplausibleSize(CheckFailed):
    """A manifest declares sizes that cannot be true (a chunk larger than any writer makes, raw bytes of a
    ``store`` chunk different from its stored bytes, more memory than the machine has): refused before
    anything is allocated (exit 1)."""


class TooLargeHere(ImplausibleSize):
    """A buffer a manifest declares is larger than the memory this machine has: refused before allocating
    (exit 1), but no evidence that the generation is damaged -- a larger machine may read it, so readers
    record no failed check for it (docs/FORMAT.md, "One status rule")."""


class IncoherentState(CheckFailed):
    """The parts of a state do not describe the same instant, or a structure does not match."""


class ResumeDivergence(CheckFailed):
    """A resumed run did not match the continuous one, or a negative control did not diverge."""


class CannotCheck(CkptArchiveError):
    """The operation could not be carried out (exit 2)."""

    exit_code = EXIT_CANNOT_CHECK


class SourceError(CannotCheck):
    """The input is unreadable, not a checkpoint, or refused (e.g. it would need unpickling code)."""


class SourceChanged(SourceError):
    """The source file was replaced, rewritten or touched while it was being packed: its tensors and its
    bytes may come from different versions, so nothing was kept (exit 2; ``backup`` reports it busy, 75)."""


class RefusedPickle(SourceError):
    """A pickle references a class or function outside the allowlist; we never unpickle code."""


class FormatError(CannotCheck):
    """The archive's manifest or layout cannot be read at all (schema broken, unknown layout)."""


class MalformedTree(IntegrityError, FormatError):
    """A node of a generation's state tree cannot be rebuilt (a hostile or damaged archive: a bad number,
    an unknown tag, torch refusing a rebuild's arguments). A FormatError that was examined and found
    wrong: exit 1, as ``verify`` reports the same tree, in ``restore`` and ``load`` too."""


class NewerFormatError(CannotCheck):
    """The archive was written by a newer format version than this reader knows."""


class NotFound(CannotCheck):
    """A repository, generation, path or member named by the user does not exist."""


class NotUsable(CannotCheck):
    """The generation asked for is ``partial`` or ``damaged``: restore, load and export refuse it unless
    the caller passes the explicit override (exit 2)."""


class NoUsableGeneration(CannotCheck):
    """The repository holds no usable generation matching the request."""


class AllGenerationsDamaged(NoUsableGeneration):
    """No generation is usable because every one that could have been picked (every published one: a
    ``partial`` generation never is) was examined and found damaged (exit 1, as ``verify``/``restore`` of each
    of them say). An empty repository, only partial generations, or one that cannot be judged here (a newer
    format, a ``copied`` generation not yet adopted) stays :class:`NoUsableGeneration` (exit 2). A
    :class:`NoUsableGeneration`, so callers that treat "nothing usable" as one case keep doing so."""

    exit_code = EXIT_CHECK_FAILED

    def for_resume(self) -> "AllGenerationsDamaged":
        """This error as a resume gives it instead of None ("nothing usable yet, start fresh": a training script
        would restart from step 0 without a word, its next saves beside generations that might still be
        recovered), with what to look at and how to start fresh on purpose."""
        return AllGenerationsDamaged(f"{self.message}; a resume does not start fresh over them", where=self.where,
                                     hint="see what is wrong with `ckpt-archive list --all` and `ckpt-archive "
                                          "verify`; resume from an exported copy, or start fresh on purpose in a "
                                          "new repository")


class LockError(CannotCheck):
    """The repository's writer lock could not be obtained (another writer, or a stale lock)."""


class ReadOnlyRepository(LockError):
    """The writer lock cannot be taken because the repository is read-only here (a read-only mount, no
    write permission): a writer stops (exit 2); a reader that only wanted to record a result goes on
    without it and says what it could not record."""


class OutputExists(CannotCheck):
    """The output path exists and ``--force`` was not given; nothing was overwritten."""


class InsufficientSpace(CannotCheck):
    """The destination has not enough free space for the output."""


class UsageError(CannotCheck):
    """Bad arguments (a malformed REPO@GEN, an empty retention policy, conflicting flags)."""


class Unreadable(CannotCheck):
    """A member or shared object of a generation is there but cannot be read here (permissions): the
    generation could not be checked (exit 2); ``--fallback`` may still use an older one that verifies."""


class StoreError(CannotCheck):
    """A destination store refused or failed an operation (credentials, permissions, network)."""


def first_line(exc: BaseException | str, limit: int | None = None) -> str:
    """The first non-blank line of an exception's message or of a text (an exception's type name, or
    ``"?"``, when it has none), cut to ``limit`` characters: the one-line reason a refusal quotes from a
    library (torch, safetensors, a config parser), whose messages often run to many lines."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else "?" if isinstance(exc, str) else type(exc).__name__)[:limit]


def exit_code_for(result: Any) -> int:
    """The one rule from a result (or an exception) to the CLI's exit code.

    In order:

    * a :class:`CkptArchiveError` -> its class's ``exit_code`` (1 or 2);
    * ``KeyboardInterrupt`` -> :data:`EXIT_INTERRUPTED` (130);
    * any other exception (``OSError``, a bug) -> :data:`EXIT_CANNOT_CHECK` (2);
    * a result carrying an explicit ``exit_code`` (attribute or mapping key; e.g. ``BackupResult``,
      whose 75 means "retry later") -> that code;
    * a result with ``ok`` (attribute or key; for a resume-check report ``all_checks_passed``) ->
      0 when true, :data:`EXIT_CHECK_FAILED` (1) when false;
    * a bool -> 0 / 1.

    Args:
        result: a typed result (``VerifyReport``, ``ExportResult``, ``PruneResult``, ``BackupResult``),
            a report dict, a bool, or an exception.

    Returns:
        The exit code (0, 1, 2, 75 or 130).

    Raises:
        TypeError: ``result`` carries none of ``exit_code``, ``ok``, ``all_checks_passed`` (a
            programming error: every result must say whether it is ok).

    Example:
        >>> exit_code_for(IntegrityError("sha256 mismatch")), exit_code_for(NotFound("no repo"))
        (1, 2)
        >>> exit_code_for({"ok": False}), exit_code_for(True)
        (1, 0)
    """
    if isinstance(result, CkptArchiveError):
        return int(result.exit_code)
    if isinstance(result, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(result, BaseException):
        return EXIT_CANNOT_CHECK
    if isinstance(result, bool):
        return EXIT_OK if result else EXIT_CHECK_FAILED
    if isinstance(result, Mapping):
        code = result.get("exit_code")
        ok = result.get("ok", result.get("all_checks_passed"))
    else:
        code = getattr(result, "exit_code", None)
        ok = getattr(result, "ok", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    if ok is None:
        raise TypeError(f"{type(result).__name__} says neither ok nor exit_code: cannot map it to an exit code")
    return EXIT_OK if ok else EXIT_CHECK_FAILED


__all__ = ["EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_CANNOT_CHECK", "EX_TEMPFAIL", "EXIT_INTERRUPTED", "EXIT_MEANINGS",
           "CkptArchiveError", "CheckFailed", "IntegrityError", "ManifestInvalid", "InvalidJSON", "UnsafePath",
           "LinkInRepository", "ImplausibleSize", "TooLargeHere", "IncoherentState", "ResumeDivergence", "CannotCheck",
           "SourceError", "SourceChanged", "RefusedPickle", "FormatError", "MalformedTree", "NewerFormatError",
           "NotFound", "NotUsable", "NoUsableGeneration", "AllGenerationsDamaged", "LockError", "ReadOnlyRepository", "OutputExists",
           "InsufficientSpace", "UsageError", "Unreadable", "StoreError", "first_line", "exit_code_for"]
