"""One module per CLI command (borg's ``archiver/*_cmd.py`` habit).

Each module defines ``register(app)`` that adds its command(s) to the Typer app; each registers the command
spelt as its module's name with ``-`` for ``_``. :mod:`ckpt_archive.cli.app` imports the module of the command
a command line names, and every module listed in :data:`COMMAND_MODULES` for anything else (``--help``, a
mistyped command); one that fails to import fails the CLI then (a packaging error is never a silently missing
command), and tests/test_cli_startup.py builds each alone and all together.
"""
COMMAND_MODULES = (
    "pack", "verify", "restore", "list", "inspect", "demo", "check_resume",
    "forget", "gc", "prune", "backup", "export",
    "adopt", "status", "key",
)


__all__ = ["COMMAND_MODULES"]
