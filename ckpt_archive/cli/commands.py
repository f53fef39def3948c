"""One module per CLI command (borg's ``archiver/*_cmd.py`` habit).

Each module defines ``register(app)`` that adds its command(s) to the Typer app. :mod:`ckpt_archive.cli.app`
imports every module listed in :data:`COMMAND_MODULES`; one that fails to import fails the CLI (a packaging
error is never a silently missing command).
"""
COMMAND_MODULES = (
    "pack", "verify", "restore", "list", "inspect", "demo", "check_resume",
    "forget", "gc", "prune", "backup", "export",
    "adopt", "status", "key",
)


__all__ = ["COMMAND_MODULES"]
