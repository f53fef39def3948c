"""Helpers every command uses: REPO@GEN parsing, output (human on stderr, JSON on stdout), exit codes,
progress bars with phases. Commands stay thin: parse, call the library, report.

Output modes, the same for every command:

* default: human lines on stderr; a progress bar (phase, IEC bytes, MiB/s, ETA where the total is
  known) when stderr is a terminal;
* ``--json``: one JSON object on stdout and nothing on stderr -- errors too are that JSON object
  (``ok: false``, ``error``, ``reason``, ``exit_code``);
* ``--quiet`` (for cron): only warnings and errors on stderr, no progress.

``--quiet`` is added to every command by :func:`command`, which also maps exceptions to exit codes and
turns Ctrl-C into exit 130 with a line naming what was left and the command that cleans it.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from typing import Any, Callable

import typer

from ckpt_archive.errors import EXIT_MEANINGS, CkptArchiveError, UsageError, exit_code_for


def exit_codes_help(meanings: dict[int, str] | None = None, codes: tuple[int, ...] = (0, 1, 2)) -> str:
    """The exit-code paragraph of one command's ``--help``: the codes it returns, in its own words.

    A paragraph of its own (after a blank line), so the top-level ``--help`` shows only each command's
    first paragraph. Ctrl-C (130) is always listed.

    Args:
        meanings: ``{code: what it means for this command}``; codes not given use
            :data:`ckpt_archive.errors.EXIT_MEANINGS`.
        codes: the codes this command returns besides 130 (default 0, 1, 2).

    Returns:
        ``"\n\nExit codes: 0 ...; 1 ...; 2 ...; 130 ..."``.
    """
    meanings = dict(meanings or {})
    wanted = sorted(set(codes) | set(meanings) | {130})
    parts = [f"{c} {meanings.get(c, EXIT_MEANINGS[c])}" for c in wanted]
    return "\n\nExit codes: " + "; ".join(parts) + "."


# REPO@GEN parsing lives in ops (the integrations parse it too; nothing imports cli): the name stays here
from ckpt_archive.ops.common import split_repo_spec  # noqa: E402,F401


#: ``--quiet`` of the command now running (set by :func:`command`; read by :class:`Output`).
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_archive_quiet", default=False)


def _unicode_only(obj):
    """``obj`` with every str that holds lone surrogates (a path in bytes that are not UTF-8) written with
    ``\\x`` escapes: JSON's ``\\udcXX`` for a lone surrogate is refused by strict parsers."""
    if isinstance(obj, str):
        from ckpt_archive.format.text import shown

        return shown(obj)
    if isinstance(obj, dict):
        return {_unicode_only(k): _unicode_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_unicode_only(v) for v in obj]
    return obj


class Output:
    """Human lines to stderr (rich, no tracebacks); one JSON object to stdout in ``--json`` mode.

    In ``--json`` mode nothing goes to stderr (the JSON object carries the warnings and the error);
    with ``--quiet`` only warnings and errors do.

    Args:
        json_mode: ``--json`` was given.
        quiet: ``--quiet`` was given (default: the running command's, see :func:`command`).
    """

    def __init__(self, json_mode: bool, quiet: bool | None = None):
        from rich.console import Console

        self.json_mode = json_mode
        self.quiet = _QUIET.get() if quiet is None else quiet
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        if not self.err.is_terminal and "COLUMNS" not in __import__("os").environ:
            self.err.width = 200  # logs and pipes: do not cut paths and reasons at 80 columns

    def say(self, text: str = "", style: str | None = None) -> None:
        """An information line (not in ``--json`` or ``--quiet`` mode)."""
        if not (self.json_mode or self.quiet):
            self.err.print(text, style=style, markup=False)

    def warn(self, text: str) -> None:
        """A warning (not in ``--json`` mode, where the JSON object carries it)."""
        if not self.json_mode:
            self.err.print(f"warning: {text}", style="yellow", markup=False)

    def error(self, text: str) -> None:
        """An error line (not in ``--json`` mode, where the JSON object carries it)."""
        if not self.json_mode:
            self.err.print(text, style="red", markup=False)

    def table(self, table) -> None:
        if not (self.json_mode or self.quiet):
            self.err.print(table)

    def json(self, obj: dict) -> None:
        if self.json_mode:
            from ckpt_archive.format.jsonio import dumps

            sys.stdout.write(dumps(_unicode_only(obj), indent=2, ensure_ascii=True, default=str).decode("utf-8"))
            sys.stdout.flush()

    def progress(self, total: int | None, description: str):
        """A progress bar (phase, bytes in IEC units, MiB/s, ETA when ``total`` is known) when stderr is a
        terminal and neither ``--json`` nor ``--quiet`` is given; else a no-op. The returned object is a
        context manager, a callable ``advance(nbytes)`` and has ``phase(name, total)``."""
        return make_progress(total, description,
                             enabled=not (self.json_mode or self.quiet) and self.err.is_terminal)


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, nbytes: int) -> None:
        pass

    def phase(self, name: str, total: int | None = None) -> None:
        pass


def _speed_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class IECSpeed(ProgressColumn):
        """Bytes per second in IEC units (MiB/s), like every size the tool prints."""

        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{human_bytes(int(speed))}/s", style="progress.data.speed")

    return IECSpeed()


def _size_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class IECSize(ProgressColumn):
        """``done / total`` in IEC units (``done`` alone while the total is unknown)."""

        def render(self, task) -> Text:
            done = human_bytes(int(task.completed))
            text = done if task.total is None else f"{done} / {human_bytes(int(task.total))}"
            return Text(text, style="progress.download")

    return IECSize()


class _RichProgress:
    def __init__(self, total, description):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), _size_column(), _speed_column(),
                           TimeElapsedColumn(), TimeRemainingColumn(),
                           console=Console(stderr=True), transient=True)
        self._total = total
        self._desc = description
        self._base = description.split(":", 1)[0]  # "pack: write" -> phases read "pack: trial reload"

    def __enter__(self):
        self._p.__enter__()
        self._task = self._p.add_task(self._desc, total=self._total)
        return self

    def __exit__(self, *exc):
        return self._p.__exit__(*exc)

    def __call__(self, nbytes: int) -> None:
        self._p.advance(self._task, nbytes)

    def phase(self, name: str, total: int | None = None) -> None:
        """A new phase of the work (``verify``, ``trial reload``, ``re-read``): the bar starts over."""
        self._p.reset(self._task, total=total, completed=0, description=f"{self._base}: {name}")
        self._p.refresh()  # show each phase at once, however short (not only at the next timed refresh)


def make_progress(total: int | None, description: str, enabled: bool):
    """Return a context manager that is also a callable ``advance(nbytes)`` with ``phase(name, total)``."""
    return _RichProgress(total, description) if enabled else _NoProgress()


__all__ = ["JSON_OPTION", "QUIET_OPTION", "Output", "command", "exit_code_for", "exit_codes_help",
           "exit_with", "human_bytes", "make_progress", "split_repo_spec"]


def exit_with(result: Any) -> None:
    """End a command with the exit code :func:`ckpt_archive.errors.exit_code_for` gives ``result``.

    Returns normally (exit 0) when the result is ok; raises ``typer.Exit(code)`` otherwise.
    """
    code = exit_code_for(result)
    if code:
        raise typer.Exit(code)


QUIET_OPTION = typer.Option(False, "--quiet", "-q", help="Only warnings and errors on stderr, no progress "
                                                         "(for cron).")


def interrupted_text(exc: BaseException) -> tuple[str, str | None, str | None]:
    """What a Ctrl-C left behind, from the notes the library attached to the ``KeyboardInterrupt``
    (``ckpt_left``: what was left, ``ckpt_cleanup``: the command that cleans it).

    Returns:
        ``(message, left, cleanup)``.
    """
    left = getattr(exc, "ckpt_left", None)
    cleanup = getattr(exc, "ckpt_cleanup", None)
    if left:
        text = f"interrupted: {left}"
        if cleanup:
            text += f"; {cleanup}"
    else:
        text = ("interrupted; nothing is known to be left half-written (`ckpt-archive list --all REPO` shows "
                "any partial generation, `ckpt-archive gc REPO` removes it)")
    return text, left, cleanup


def command(fn: Callable) -> Callable:
    """Wrap a command body: add ``--quiet``, map any exception to its exit code
    (:func:`~ckpt_archive.errors.exit_code_for`), never show a traceback.

    The wrapped function must accept ``json_output: bool`` as a keyword argument. In ``--json`` mode an
    error is the one JSON object on stdout (nothing on stderr). Ctrl-C exits 130 naming what was left and
    the command that cleans it.
    """
    sig = inspect.signature(fn)
    takes_quiet = "quiet" in sig.parameters

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> Any:
        import warnings

        from ckpt_archive.repo.publish import record_publishes

        quiet = bool(kwargs.get("quiet", False)) if takes_quiet else bool(kwargs.pop("quiet", False))
        json_mode = bool(kwargs.get("json_output", False))
        token = _QUIET.set(quiet)
        out = Output(json_mode, quiet)
        with record_publishes() as published, warnings.catch_warnings(record=True) as caught:
            try:
                _run_body(fn, args, kwargs, out, published)
                FINISHED.append(0)
            except typer.Exit as exc:
                FINISHED.append(exc.exit_code)
                raise
            finally:
                _QUIET.reset(token)
                _show_warnings(caught, out)

    if not takes_quiet:
        params = list(sig.parameters.values())
        quiet_param = inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, default=QUIET_OPTION, annotation=bool)
        wrapper.__signature__ = sig.replace(parameters=[*params, quiet_param])
    return wrapper


#: Exit codes of the commands that finished in this process (a Ctrl-C landing after the command's body
#: returned must not turn its result into 130: :func:`ckpt_archive.cli.app.main` reads this).
FINISHED: list[int] = []


def _show_warnings(caught: list, out: Output) -> None:
    """Warnings raised through the ``warnings`` module while a command ran (torch's own, mostly), each once,
    as the tool's warnings; none under ``--quiet`` or ``--json``."""
    if out.quiet or out.json_mode:
        return
    seen: set[str] = set()
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"
        if text not in seen:
            seen.add(text)
            out.warn(text)


def published_text(published: list[tuple[str, int]], left: str | None) -> str:
    """The line for a Ctrl-C that landed after a generation was published (the command then exits 0)."""
    gens = ", ".join(f"generation {n} of {loc}" for loc, n in published)
    text = f"interrupted after {gens} was published: it is usable (`ckpt-archive list` shows it)"
    if left:
        text += f"; also: {left}"
    return text


def _run_body(fn: Callable, args: tuple, kwargs: dict, out: Output, published: list) -> None:
    """Run a command body; map every exception to its exit code and report it (see :func:`command`)."""
    try:
        fn(*args, **kwargs)
    except typer.Exit:
        raise
    except CkptArchiveError as exc:
        code = exit_code_for(exc)
        import os

        if os.environ.get("CKPT_ARCHIVE_DEBUG") and exc.__cause__ is not None \
                and not isinstance(exc.__cause__, CkptArchiveError):  # a wrapped unexpected error
            raise
        out.error(f"error: {exc}")
        out.json({"ok": False, **exc.to_json(), "exit_code": code})
        raise typer.Exit(code)
    except KeyboardInterrupt as exc:
        text, left, cleanup = interrupted_text(exc)
        if published:  # the interrupt came after the commit point: the work it was asked for is done
            text = published_text(published, getattr(exc, "ckpt_left", None))
            out.warn(text)
            out.json({"ok": True, "interrupted": True, "published": [n for _, n in published],
                      "reason": text, "left": left, "cleanup": cleanup, "exit_code": 0})
            return
        code = exit_code_for(exc)
        out.error(text)
        out.json({"ok": False, "error": "Interrupted", "reason": text, "left": left, "cleanup": cleanup,
                  "exit_code": code})
        raise typer.Exit(code)
    except OSError as exc:
        code = exit_code_for(exc)
        where = getattr(exc, "filename", None)
        reason = f"{where}: {exc.strerror or exc}" if where else str(exc)
        out.error(f"error: {reason}")
        out.json({"ok": False, "error": type(exc).__name__, "where": where, "reason": str(exc),
                  "exit_code": code})
        raise typer.Exit(code)
    except Exception as exc:  # last resort: still no traceback for a user, but say it is a bug
        code = exit_code_for(exc)
        import os

        if os.environ.get("CKPT_ARCHIVE_DEBUG"):
            raise
        notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))  # e.g. the partial generation left
        out.error(f"internal error ({type(exc).__name__}): {exc}{notes}. This is a bug in ckpt-archive; "
                  f"set CKPT_ARCHIVE_DEBUG=1 for a traceback.")
        out.json({"ok": False, "error": type(exc).__name__, "reason": f"{exc}{notes}", "exit_code": code})
        raise typer.Exit(code)


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


def seconds_callback(name: str, *, allow_zero: bool = True):
    """A Typer callback refusing ``inf``, ``nan``, negative (and, unless ``allow_zero``, zero) seconds as a
    usage error (exit 2) at parse time (:func:`ckpt_archive.format.durations.check_seconds`)."""

    def check(value):
        if value is None:
            return None
        from ckpt_archive.errors import UsageError
        from ckpt_archive.format.durations import check_seconds

        try:
            return check_seconds(value, name, allow_zero=allow_zero)
        except UsageError as exc:
            raise typer.BadParameter(str(exc)) from None

    return check


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout and nothing else there.")
