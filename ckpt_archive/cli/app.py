"""The ``ckpt-archive`` command line: a thin Typer shell over the library.

Commands live one per module in :mod:`ckpt_archive.cli.commands` (``main`` builds only the one a command line
names: :func:`app_for`); each maps library errors to exit codes
through :func:`ckpt_archive.cli.common.command`. Results go to stdout, notes, warnings, errors and
progress to stderr; ``--json`` prints one object on stdout (:class:`ckpt_archive.cli.common.Output`).
"""
from __future__ import annotations

import gc
import signal
import sys

from ckpt_archive.cli import process  # standard library only: answers a Ctrl-C during the imports below

try:
    import importlib

    import typer
    from typer.core import TyperCommand, TyperGroup

    from ckpt_archive.cli.commands import COMMAND_MODULES
except KeyboardInterrupt:  # [break] a Ctrl-C in the first ~0.1 s (Typer's import) showed a traceback
    if not process.is_cli_process():  # a program importing the CLI's modules keeps its own Ctrl-C
        raise
    sys.exit(process.interrupted_at_start())


def _tidy_params(params: list) -> list:
    """Metavars a person can read: on/off flags take no value and show none (Typer prints ``<bool>``
    otherwise); a repeatable option shows its value's name (``--tag TAG``), never the annotation
    (``<list[str]>``); a variadic argument shows only its own metavar (``-- CMD...``)."""
    for p in params:
        if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
            p.metavar = ""
        elif getattr(p, "multiple", False) and getattr(p, "metavar", None) is None:
            p.metavar = (p.name or "value").upper()
        elif getattr(p, "param_type_name", "") == "argument" and getattr(p, "nargs", 1) != 1:
            p.display_type_rich = lambda ctx: None  # the metavar says it all (Typer would add <list[str]>)
        _coerce_plain_values_without_pydantic(p)
    return params


class _PlainCoercion:
    """[issue 29] The values Typer needs no conversion for, without Pydantic; anything else goes to Typer's own.

    Typer (>= 0.26) converts every parameter's value that is not a boolean through a Pydantic ``TypeAdapter``
    it builds on first use, even an absent option's ``None``: importing Pydantic and building the adapters
    was ~0.1 s of CPU of every ``list``, ``verify`` and ``status`` (a third of their run). This gives, for
    the two cases where that conversion is the identity, the very value Typer would: an absent value
    (``None``; ``()`` for a repeatable option or a variadic argument) and a ``str`` given to a ``str``
    parameter. Any other value (a number, a path, a choice, a list given) makes the parameter drop this
    object and convert through Typer's own, with Typer's checks and messages.
    """

    def __init__(self, annotation):
        self.annotation = annotation

    def coerce(self, value, param, ctx):
        multi = bool(getattr(param, "multiple", False)) or getattr(param, "nargs", 1) == -1
        if value is None:
            return () if multi else None
        if self.annotation is str and type(value) is str and not multi:
            return value
        param._runtime_param = None  # Typer's own conversion, built now (it imports Pydantic) and kept
        return param.get_runtime_param().coerce(value, param=param, ctx=ctx)


def _coerce_plain_values_without_pydantic(p) -> None:
    """Give a Typer parameter :class:`_PlainCoercion` until a value needs Typer's conversion. Only where
    Typer's parameter has the lazily built conversion this replaces (its ``get_runtime_param``, unbuilt);
    other Typer versions (before 0.26 none imports Pydantic) are left as they are."""
    if getattr(p, "_runtime_param", False) is None and callable(getattr(p, "get_runtime_param", None)):
        descriptor = getattr(p, "type_descriptor", None)
        p._runtime_param = _PlainCoercion(getattr(descriptor, "annotation", None))


def _plain_usage(pieces: list[str]) -> list[str]:
    """Usage pieces in the Unix convention: a required argument bare (``SOURCE``, not Typer's ``{source}``),
    an optional one in brackets."""
    import re

    pieces = [re.sub(r"^\{(.+)\}((\.\.\.)?)$", r"\1\2", piece) for piece in pieces]
    return [re.sub(r"^\[(.+\.\.\.)\]\.\.\.$", r"[\1]", piece) for piece in pieces]  # [-- CMD...]... -> [-- CMD...]


#: Below this many columns Typer's boxed option tables cut names and words ("--instructio…",
#: "(JSON/YAML/TO…"): help is then Click's plain layout, wrapped to the terminal's width.
RICH_HELP_MIN_COLUMNS = 80


def help_columns() -> int:
    """The help's width in columns: ``TERMINAL_WIDTH`` (Typer's own override), else ``COLUMNS``, else the
    terminal's; 80 when none is known."""
    import os
    import shutil

    width = os.environ.get("TERMINAL_WIDTH")
    return int(width) if width and width.isdigit() else shutil.get_terminal_size((80, 24)).columns


def narrow_terminal() -> bool:
    """:func:`help_columns` is below :data:`RICH_HELP_MIN_COLUMNS`."""
    return help_columns() < RICH_HELP_MIN_COLUMNS


def _plain_help(command, format_help, ctx, formatter) -> None:
    """Typer's help of ``command`` without rich (its ``rich_markup_mode`` None meanwhile: Click's layout)."""
    mode = command.rich_markup_mode
    command.rich_markup_mode = None
    formatter.width = max(min(formatter.width, help_columns() - 2), 40)  # Click's own rule, whatever forced 80
    try:
        format_help(ctx, formatter)
    finally:
        command.rich_markup_mode = mode


class _Command(TyperCommand):
    def get_params(self, ctx):
        return _tidy_params(super().get_params(ctx))

    def collect_usage_pieces(self, ctx):
        return _plain_usage(super().collect_usage_pieces(ctx))

    def format_help(self, ctx, formatter):
        if narrow_terminal():  # [break] readable at 60 columns, not cut
            return _plain_help(self, super().format_help, ctx, formatter)
        return super().format_help(ctx, formatter)


class _Group(TyperGroup):
    def get_params(self, ctx):
        return _tidy_params(super().get_params(ctx))

    def collect_usage_pieces(self, ctx):
        return _plain_usage(super().collect_usage_pieces(ctx))

    def format_help(self, ctx, formatter):
        if narrow_terminal():
            return _plain_help(self, super().format_help, ctx, formatter)
        return super().format_help(ctx, formatter)


#: The Typer app with every command: built on first use (module ``__getattr__``, :func:`build_app`); ``main``
#: builds only the command a command line names (:func:`app_for`).
app: typer.Typer


def _version(value: bool) -> None:
    if value:
        from ckpt_archive import __version__

        typer.echo(f"ckpt-archive {__version__}")
        raise typer.Exit()


def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Pack a training checkpoint (a resume point) into a verified, trial-reloaded archive."""


#: One line per command in the top-level ``--help`` (each command's own ``--help`` has the whole text).
SHORT_HELP = {
    "pack": "Pack a checkpoint into a new verified, trial-reloaded generation.",
    "verify": "Check a generation's sizes and sha256 (--deep: the full trial reload).",
    "restore": "Write a generation back as a .pt file or a folder, atomically.",
    "list": "List a repository's generations (--all: also the unusable ones).",
    "inspect": "Show what a generation holds: progress, config, metrics, members.",
    "demo": "Prove an exact resume end to end on a tiny real training run.",
    "check-resume": "Prove that a training command resumes exactly from its archive.",
    "forget": "Remove one generation, marker first, under the lock.",
    "gc": "Remove leftovers of interrupted writes, under the lock.",
    "prune": "Apply a retention policy (--dry-run: show what would go, and why).",
    "backup": "Back up the newest checkpoint in a file or folder (for cron, timers).",
    "export": "Copy usable generations to a path or s3://, re-read and trial-reload there.",
    "adopt": "Make every copied generation of a moved repository usable here.",
    "status": "Watchdog: exit 1 when backups are missing, too old or not advancing.",
}

#: ``{command name: its module in COMMAND_MODULES}``: each module registers the command spelt as its name
#: with ``-`` for ``_`` (``check_resume`` -> ``check-resume``; ``key`` is the group of ``key new``, ``key change``).
COMMAND_NAMES = {name.replace("_", "-"): name for name in COMMAND_MODULES}


def build_app(modules=COMMAND_MODULES) -> typer.Typer:
    """A ``ckpt-archive`` Typer app with the commands of ``modules`` (names in :data:`COMMAND_MODULES`;
    default: all), each with this CLI's usage and metavar conventions and its one-line top-level help."""
    new = typer.Typer(
        name="ckpt-archive",
        cls=_Group,
        help="Pack a training checkpoint (a resume point) into a verified, trial-reloaded archive; "
             "verify, restore, rotate and export it. Each command's --help lists its options and exit codes "
             "(0 ok, 1 something was found wrong, 2 could not be carried out, 130 interrupted).",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    new.callback()(_root)
    for name in modules:
        importlib.import_module(f"ckpt_archive.cli.{name}_cmd").register(new)
    for info in new.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = _Command
        if info.short_help is None:
            info.short_help = SHORT_HELP.get(info.name or "")
    return new


def _every_command() -> typer.Typer:
    """:data:`app`, built once."""
    global app
    if "app" not in globals():
        app = build_app()
    return app


def __getattr__(name: str):
    if name == "app":  # every command: the top-level --help, tests, ``typer.testing``
        return _every_command()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def app_for(args: list[str]) -> typer.Typer:
    """The app a command line needs: only the command ``args[0]`` names, when it names one; else every command
    (``--help``, ``--version``, a mistyped command, which Typer answers with the names it knows).

    [issue 29] A command's parsing, help and errors involve no other command, and building all fifteen
    (importing their modules, Typer reading every function's parameters) was ~0.05 s of every start-up."""
    module = COMMAND_NAMES.get(args[0]) if args else None
    return build_app((module,)) if module is not None else _every_command()


def _usage_error_json(exc: Exception) -> int:
    """Print a command-line usage error (Typer's, raised with ``standalone_mode=False``) as the one JSON
    error object on stdout, the shape every other error has (:mod:`ckpt_archive.cli.common`); return its
    exit code. Typer's exceptions are told by class name: Typer vendors Click, never imported here."""
    from ckpt_archive.cli.common import Output

    names = {c.__name__ for c in type(exc).__mro__}
    code = getattr(exc, "exit_code", 2) if "ClickException" in names else 2
    fmt = getattr(exc, "format_message", None)
    reason = fmt() if callable(fmt) else str(exc)
    error = "UsageError" if "UsageError" in names else type(exc).__name__
    Output(json_mode=True).json({"ok": False, "error": error, "where": None, "reason": reason,
                                 "hint": "see `ckpt-archive COMMAND --help`", "exit_code": code})
    return code


def _run_json(cli: typer.Typer) -> int:
    """Run with ``--json`` somewhere in argv: usage errors too become the one JSON object on stdout."""
    try:
        rv = cli(standalone_mode=False)
    except typer.Abort:
        from ckpt_archive.cli.common import Output

        Output(json_mode=True).json({"ok": False, "error": "Aborted", "where": None, "reason": "aborted",
                                     "exit_code": 1})
        return 1
    except Exception as exc:  # noqa: BLE001 - Typer's usage errors (ClickException subclasses)
        if not any(c.__name__ == "ClickException" for c in type(exc).__mro__):
            raise
        return _usage_error_json(exc)
    # without standalone mode Typer returns the exit code a command raised, else the body's return value
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0


#: Set in the environment beside ``OPENBLAS_NUM_THREADS`` when :func:`quiet_blas_threads` set it, so the processes
#: this one starts for the user (check-resume's training runs) get the user's environment back.
BLAS_MARK = "CKPT_ARCHIVE_SET_OPENBLAS_NUM_THREADS"


def quiet_blas_threads() -> bool:
    """[issue 29] One OpenBLAS thread for NumPy in the CLI's own process (``OPENBLAS_NUM_THREADS=1``), where the
    user set no thread count and NumPy is not imported yet.

    NumPy's wheel loads OpenBLAS at import, which starts a thread per core that spins before it sleeps: 70-100 ms
    of CPU at every import of NumPy on the 2-core benchmark machine (`python -c "import numpy"`: 0.22-0.29 s of
    CPU against 0.13-0.20 s with one thread), and 1.4 % of a `verify --deep`'s CPU in `blas_thread_server`. This
    tool does no linear algebra. The variable goes out of the environment of the commands it runs for the user
    (:data:`BLAS_MARK`; ``resume/check.py``). Returns whether it was set. Source: OpenBLAS's README
    ("Setting the number of threads using environment variables").
    """
    import os
    import sys

    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS")
    if "numpy" in sys.modules or any(n in os.environ for n in names):
        return False
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ[BLAS_MARK] = "1"
    return True


def keep_freed_buffers() -> bool:
    """[issue 14] Ask glibc's allocator to keep freed multi-MiB buffers for reuse (``mallopt``).

    Every chunk this tool encodes, hashes or decodes passes through a few 4 MiB buffers. By default glibc
    serves such sizes with fresh ``mmap`` pages (its threshold rises to at most 32 MiB only as blocks are
    freed) and returns freed top-of-heap memory to the kernel (trim), so each chunk's buffers are paid
    again in page faults: ~0.5 s of kernel time per GiB packed here. Raising ``M_MMAP_THRESHOLD`` to
    64 MiB and ``M_TRIM_THRESHOLD`` / ``M_TOP_PAD`` keeps those pages; the peak stays what the in-flight
    chunks need (the benchmark's peak-anonymous-memory rows measure it). Only the CLI's own process does
    this; a library caller's allocator is never changed. Returns whether it was applied (glibc only).
    Source: mallopt(3).
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = mallopt(m_mmap_threshold, 64 << 20) == 1
    ok = mallopt(m_trim_threshold, 256 << 20) == 1 and ok
    ok = mallopt(m_top_pad, 16 << 20) == 1 and ok
    return ok


def main() -> None:
    """Console-script entry point.

    Exit codes are the commands' own; a Ctrl-C that lands after a command finished (Typer would turn it
    into a silent 130) keeps the code the command finished with, and one that lands before the command's own
    handler (start-up, parsing) is the one interrupted line and 130, never a traceback. A reader of stdout that
    goes away (``| head``, a closed descriptor) drops the rest of the output but never changes the exit code;
    any other failure to write the result makes an exit 0 a 2 (:mod:`ckpt_archive.cli.process`).
    """
    json_mode = "--json" in sys.argv[1:]
    try:
        process.guard_std_streams()
        code = _run(sys.argv[1:], json_mode)
    except KeyboardInterrupt:
        finished = getattr(sys.modules.get("ckpt_archive.cli.common"), "FINISHED", None)
        code = finished[-1] if finished else _interrupted(json_mode)
    try:
        code = process.finish(code, json_mode=json_mode)
        if sys.argv[1:2] and sys.argv[1] in _read_only_commands():
            # [issue 29] the interpreter's exit runs garbage collections over every object the command made:
            # 20-30 ms of a `verify`'s 0.3 s, and 0.9 s after a restore of 288 MiB had printed that it was done
            # (where a Ctrl-C turned its exit 0 into 130); these commands leave nothing that waits for a
            # collection (every file they write is closed, a restore's output renamed into place, before they
            # return), so their objects are left out of it (gc.freeze)
            gc.freeze()
    except KeyboardInterrupt:
        pass  # the verdict is decided: a Ctrl-C now keeps it
    if process.is_cli_process():  # [break] one during the interpreter's own exit (its collections, its last
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # flush) keeps it too, and shows no traceback
    sys.exit(code)


def _read_only_commands() -> frozenset:
    common = sys.modules.get("ckpt_archive.cli.common")
    return getattr(common, "READ_ONLY_COMMANDS", frozenset())


def _run(args: list[str], json_mode: bool) -> int:
    """Build the app ``args`` need and run it; its exit code."""
    from ckpt_archive.cli.common import FINISHED

    keep_freed_buffers()
    quiet_blas_threads()
    cli = app_for(args)
    if json_mode:
        code = _run_json(cli)
    else:
        try:
            cli()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if code == 130 and FINISHED:
        code = FINISHED[-1]
    elif code == 130:  # Typer's own conversion of a Ctrl-C outside the command's body (parsing): said here
        code = _interrupted(json_mode)
    return code


def _interrupted(json_mode: bool) -> int:
    """Report a Ctrl-C that no command handler reported; 130. Before a command's body started (imports,
    parsing): nothing was done. After (a second Ctrl-C while the first was being reported): what a command of
    its kind can have left (:func:`ckpt_archive.cli.common.interrupted_text`), never "nothing was done"."""
    common = sys.modules.get("ckpt_archive.cli.common")
    started = getattr(common, "STARTED", None)
    if started:
        return process.interrupted_at_start(json_mode, common.interrupted_text(KeyboardInterrupt(), started[-1])[0])
    return process.interrupted_at_start(json_mode)


__all__ = ["app", "app_for", "build_app", "COMMAND_NAMES", "SHORT_HELP", "RICH_HELP_MIN_COLUMNS", "help_columns",
           "keep_freed_buffers", "quiet_blas_threads", "BLAS_MARK", "main", "narrow_terminal"]


if __name__ == "__main__":
    main()
