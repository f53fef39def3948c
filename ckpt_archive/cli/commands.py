"""One module per CLI command (borg's ``archiver/*_cmd.py`` habit).

Each module defines ``register(app)`` that adds its command(s) to the Typer app. :mod:`ckpt_archive.cli.app`
imports the modules listed in :data:`COMMAND_MODULES`; a module that is absent is skipped.
"""
COMMAND_MODULES = (
    "pack", "verify", "restore", "list", "inspect", "demo", "check_resume",
    "forget", "gc", "prune", "backup", "export",
)
