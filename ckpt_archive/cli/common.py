"""Helpers every command uses: REPO@GEN parsing, output (human on stderr, JSON on stdout), exit codes,
progress bars. Commands stay thin: parse, call the library, report.
"""
from __future__ import annotations

import functools
import re
import sys
from typing import Any, Callable

import typer

from ckpt_archive.errors import CkptArchiveError, UsageError, exit_code_for

#: Shown in every command's --help (each command may add its own).
EXIT_CODES_HELP = ("Exit codes: 0 ok; 1 something was examined and found wrong (corrupt, tampered or "
                   "missing member, incoherent state, divergent resume); 2 could not be carried out "
                   "(unreadable or refused input, missing path, bad arguments, newer format, lock not "
                   "obtained).")

_GEN_SUFFIX = re.compile(r"^([0-9]+|latest|tag:[^/@]+)$", re.ASCII)


def split_repo_spec(spec: str) -> tuple[str, str]:
    """Split ``REPO[@GEN]`` at the last ``@`` only when what follows is digits, ``latest`` or ``tag:NAME``.

    Paths and URLs may contain ``@`` (``s3://user@host/...``, ``runs/exp@2``): those stay whole.

    Returns:
        (repo, gen) where gen is ``"latest"`` when none was given.

    Example:
        >>> split_repo_spec("runs/a@b/repo@12")
        ('runs/a@b/repo', '12')
        >>> split_repo_spec("s3://u@bucket/p")
        ('s3://u@bucket/p', 'latest')
    """
    if "@" in spec:
        head, _, tail = spec.rpartition("@")
        if head and _GEN_SUFFIX.match(tail):
            return head, tail
        import os

        from ckpt_archive.store.local import has_scheme

        if head and not has_scheme(spec) and not os.path.exists(spec) and os.path.exists(head):
            raise UsageError(f"bad generation {tail!r} in {spec!r}: use REPO@N, REPO@latest or REPO@tag:NAME")
    if not spec:
        raise UsageError("empty repository argument")
    return spec, "latest"


class Output:
    """Human lines to stderr (rich, no tracebacks); one JSON object to stdout in ``--json`` mode."""

    def __init__(self, json_mode: bool):
        from rich.console import Console

        self.json_mode = json_mode
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        if not self.err.is_terminal and "COLUMNS" not in __import__("os").environ:
            self.err.width = 200  # logs and pipes: do not cut paths and reasons at 80 columns

    def say(self, text: str = "", style: str | None = None) -> None:
        self.err.print(text, style=style, markup=False)

    def warn(self, text: str) -> None:
        self.err.print(f"warning: {text}", style="yellow", markup=False)

    def table(self, table) -> None:
        self.err.print(table)

    def json(self, obj: dict) -> None:
        if self.json_mode:
            from ckpt_archive.format.jsonio import dumps

            sys.stdout.write(dumps(obj, indent=2, ensure_ascii=True, default=str).decode("utf-8"))
            sys.stdout.flush()

    def progress(self, total: int | None, description: str):
        """A bytes/s progress bar when stderr is a terminal and not in JSON mode; else a no-op."""
        return make_progress(total, description, enabled=(not self.json_mode) and self.err.is_terminal)


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, nbytes: int) -> None:
        pass


class _RichProgress:
    def __init__(self, total, description):
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                           TransferSpeedColumn(), TimeRemainingColumn(),
                           console=__import__("rich.console").console.Console(stderr=True), transient=True)
        self._total = total
        self._desc = description

    def __enter__(self):
        self._p.__enter__()
        self._task = self._p.add_task(self._desc, total=self._total)
        return self

    def __exit__(self, *exc):
        return self._p.__exit__(*exc)

    def __call__(self, nbytes: int) -> None:
        self._p.advance(self._task, nbytes)


def make_progress(total: int | None, description: str, enabled: bool):
    """Return a context manager that is also a callable ``advance(nbytes)``."""
    return _RichProgress(total, description) if enabled else _NoProgress()


__all__ = ["EXIT_CODES_HELP", "JSON_OPTION", "Output", "command", "exit_code_for", "exit_with", "human_bytes",
           "make_progress", "split_repo_spec"]


def exit_with(result: Any) -> None:
    """End a command with the exit code :func:`ckpt_archive.errors.exit_code_for` gives ``result``.

    Returns normally (exit 0) when the result is ok; raises ``typer.Exit(code)`` otherwise.
    """
    code = exit_code_for(result)
    if code:
        raise typer.Exit(code)


def command(fn: Callable) -> Callable:
    """Wrap a command body: map any exception to its exit code (:func:`~ckpt_archive.errors.exit_code_for`),
    never show a traceback.

    The wrapped function must accept ``json_output: bool`` as a keyword argument.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> Any:
        json_mode = bool(kwargs.get("json_output", False))
        out = Output(json_mode)
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except CkptArchiveError as exc:
            code = exit_code_for(exc)
            out.say(f"error: {exc}", style="red")
            if json_mode:
                out.json({"ok": False, **exc.to_json(), "exit_code": code})
            raise typer.Exit(code)
        except KeyboardInterrupt as exc:
            out.say("interrupted", style="red")
            raise typer.Exit(exit_code_for(exc))
        except OSError as exc:
            code = exit_code_for(exc)
            where = getattr(exc, "filename", None)
            reason = f"{where}: {exc.strerror or exc}" if where else str(exc)
            out.say(f"error: {reason}", style="red")
            if json_mode:
                out.json({"ok": False, "error": type(exc).__name__, "where": where, "reason": str(exc),
                          "exit_code": code})
            raise typer.Exit(code)
        except Exception as exc:  # last resort: still no traceback for a user, but say it is a bug
            code = exit_code_for(exc)
            out.say(f"internal error ({type(exc).__name__}): {exc}. This is a bug in ckpt-archive; "
                    f"set CKPT_ARCHIVE_DEBUG=1 for a traceback.", style="red")
            import os

            if os.environ.get("CKPT_ARCHIVE_DEBUG"):
                raise
            if json_mode:
                out.json({"ok": False, "error": type(exc).__name__, "reason": str(exc), "exit_code": code})
            raise typer.Exit(code)

    return wrapper


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else there.")
