"""What the CLI's own process adds around a command (never a library caller's): standard streams that a reader
who went away cannot turn into a traceback or a wrong exit code, and a Ctrl-C at any moment as exit 130.

Standard library only, and cheap to import: :mod:`ckpt_archive.cli.app` imports it before Typer, so that a
Ctrl-C during the start-up imports is already answered by it (:func:`interrupted_at_start`).

**A reader that goes away** (``ckpt-archive list R | head -1``, a watchdog closing its end, ``>&-``) stops the
output, never the command: what follows is dropped, the command finishes and exits with its own verdict (Python
ignores SIGPIPE, so the write fails with EPIPE; the signal module's "Note on SIGPIPE" recommends pointing the
descriptor at ``/dev/null`` so that the interpreter's last flush does not raise again). A pipe closed early is
never "check failed" (exit 1), and a ``verify`` that found damage still exits 1 when nobody reads its words.
Any other failure to write the result (``ENOSPC`` on a full disk, ``EIO``) means a reader got less than the
whole result: it is said on stderr, and an exit 0 becomes 2 (could not be carried out); a non-zero verdict
stays what it was (:func:`finish`).
"""
from __future__ import annotations

import errno
import os
import sys

#: The interrupted line for a Ctrl-C before the command's own handler was installed (during the imports):
#: nothing was read or written yet.
INTERRUPTED_AT_START = "interrupted before anything was done; nothing was read or written"


class GuardedStream:
    """``sys.stdout`` or ``sys.stderr`` of the CLI's process: writes and flushes that fail are never raised.

    EPIPE (the reader went away) or a descriptor closed before the start: :attr:`gone` is set and everything
    after is dropped. Any other ``OSError`` (``ENOSPC``, ``EIO``): :attr:`error` keeps the first and the rest is
    dropped. Either way the descriptor is pointed at ``/dev/null`` (buffered text and the interpreter's final
    flush go there instead of raising). Every other attribute is the wrapped stream's.
    """

    def __init__(self, stream, name: str, *, gone: str | None = None):
        self._stream = stream
        self.which = name  # not ``name``: that is the wrapped stream's own ("<stdout>")
        #: why the output has no reader: ``"closed"`` (the descriptor was closed before the start),
        #: ``"broken pipe"`` (EPIPE), or None
        self.gone = gone
        #: the first write error other than EPIPE (the output a reader got is incomplete), or None
        self.error: OSError | None = None
        #: characters that could not be written (after :attr:`gone` or :attr:`error`)
        self.dropped = 0

    @property
    def lost(self) -> bool:
        return self.gone is not None or self.error is not None

    def write(self, text: str) -> int:
        if self.lost:
            self.dropped += len(text)
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._lose(exc)
            self.dropped += len(text)
            return len(text)

    def flush(self) -> None:
        if self.lost:
            return
        try:
            self._stream.flush()
        except OSError as exc:
            self._lose(exc)

    def _lose(self, exc: OSError) -> None:
        if exc.errno in (errno.EPIPE, errno.ECONNRESET) or isinstance(exc, BrokenPipeError):
            self.gone = "broken pipe"
        else:
            self.error = exc
        try:  # Python's recommendation: the descriptor on /dev/null, so the exit's own flush cannot raise
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
            self._stream.flush()  # what stayed buffered goes to /dev/null now
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _reopen_closed_std_fds() -> set[int]:
    """Descriptors 0-2 that were closed when the process started, each opened on ``/dev/null`` now (as git and
    OpenSSH do): otherwise the next file this process opens (a lock, a restore's output) would get number 1 or
    2 and receive what was meant for stdout or stderr, as would a child's inherited stdout."""
    closed = set()
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
    if closed:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in closed:
            if fd != null:
                os.dup2(null, fd)
        if null in closed:
            os.set_inheritable(null, True)
        else:
            os.close(null)
    return closed


def guard_std_streams() -> tuple[GuardedStream, GuardedStream]:
    """Put :class:`GuardedStream` around ``sys.stdout`` and ``sys.stderr`` (once; a closed descriptor gets
    ``/dev/null`` first and its stream is marked gone). Returns ``(stdout, stderr)``."""
    if isinstance(sys.stdout, GuardedStream) and isinstance(sys.stderr, GuardedStream):
        return sys.stdout, sys.stderr
    closed = _reopen_closed_std_fds()
    guarded = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        gone = None
        if stream is None or fd in closed:  # Python leaves sys.stdout None when fd 1 was closed at start
            stream = open(fd, "w", closefd=False, encoding="utf-8", errors="backslashreplace")
            gone = "closed"
        if not isinstance(stream, GuardedStream):
            stream = GuardedStream(stream, name, gone=gone)
        setattr(sys, name, stream)
        guarded.append(stream)
    return guarded[0], guarded[1]


def finish(code: int, *, json_mode: bool = False) -> int:
    """The exit code once the output is flushed: ``code``, unless writing the result failed otherwise than by its
    reader going away (a full disk: the reader has less than the whole result), where an exit 0 becomes 2
    (said on stderr, even with ``--json``: stdout cannot carry it). A reader that went away changes nothing; a
    stdout closed before the start is said on stderr (not with ``--json``)."""
    out, err = sys.stdout, sys.stderr
    for stream in (out, err):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if not isinstance(out, GuardedStream):
        return code
    if out.error is not None:
        reason = out.error.strerror or str(out.error)
        _say(err, f"error: the result could not be written to stdout ({reason}): what stdout holds is incomplete"
                  + (" (the command's own work was done; only its report is short)" if code == 0 else ""))
        return 2 if code == 0 else code
    if out.gone == "closed" and out.dropped and not json_mode:
        _say(err, "warning: stdout is closed: the result was not written (the exit code is the command's verdict)")
    return code


def _say(stream, line: str) -> None:
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def interrupted_at_start(json_mode: bool | None = None, text: str = INTERRUPTED_AT_START) -> int:
    """Say that a Ctrl-C landed outside the command's own handler (the one line ``text``, by default that nothing
    was done yet; with ``--json`` the one JSON object, as a command's own interrupt is reported) and return 130."""
    if json_mode is None:
        json_mode = "--json" in sys.argv[1:]
    if json_mode:
        import json

        _say(sys.stdout, json.dumps({"ok": False, "error": "Interrupted", "reason": text, "left": None,
                                     "cleanup": None, "exit_code": 130}, indent=2))
    else:
        _say(sys.stderr, text)
    return 130


def is_cli_process() -> bool:
    """Whether this interpreter runs the ``ckpt-archive`` command (its console script, ``python -m ckpt_archive``
    or ``python -m ckpt_archive.cli.app``), not a program that imports the CLI's modules (tests, a notebook)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if getattr(spec, "name", None) in ("ckpt_archive.__main__", "ckpt_archive.cli.app"):
        return True
    name = os.path.basename(getattr(main, "__file__", None) or "")
    return name.removesuffix(".exe").removesuffix("-script.py") == "ckpt-archive"


__all__ = ["GuardedStream", "INTERRUPTED_AT_START", "finish", "guard_std_streams", "interrupted_at_start",
           "is_cli_process"]
