"""``ckpt-archive key``: make a signing key pair or a repository key file; change an encrypted repository's key."""
from __future__ import annotations

from pathlib import Path

import typer

from ckpt_archive.cli.common import JSON_OPTION, Output, command, exit_codes_help


def register(app: typer.Typer) -> None:
    key_app = typer.Typer(help="Keys: signing key pairs (--sign-key / --trust) and repository key files "
                               "(--key-file). docs/FORMAT.md, 'Signatures' and 'Encrypted repositories'.",
                          short_help="Make signing key pairs and repository key files; change a key.",
                          no_args_is_help=True)
    app.add_typer(key_app, name="key")

    @key_app.command("new", help="Write a new Ed25519 signing key to PATH (mode 0600) and its public key to "
                                 "PATH.pub (an ssh-ed25519 line: give it to --trust); with --encryption, a "
                                 "repository key file instead (32 random bytes, base64). A key is never "
                                 "overwritten. Keep a copy: an encrypted repository cannot be read without its key."
                     + exit_codes_help({0: "written", 2: "PATH exists or cannot be written"}, codes=(0, 2)))
    @command
    def key_new(
        path: Path = typer.Argument(..., metavar="PATH"),
        encryption: bool = typer.Option(False, "--encryption", help="A repository key file, not a signing key."),
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.keys import new_key

        out = Output(json_output)
        res = new_key(path, encryption=encryption)
        if res.kind == "signing":
            out.say(f"signing key {res.path} (keep it private); public key {res.public_path}: {res.fingerprint}",
                    style="green")
        else:
            out.say(f"repository key file {res.path} (mode 0600); keep a copy elsewhere: without it the "
                    f"repository cannot be read", style="green")
        out.json(res.to_json())

    @key_app.command("change", help="Change an encrypted repository's key: its data key is re-wrapped under "
                                    "NEW_KEY_FILE and no longer opens with --key-file; no archive is rewritten."
                     + exit_codes_help({0: "changed", 2: "the old key does not open the repository, a key file "
                                                          "is unreadable, not encrypted, or the lock is held"},
                                       codes=(0, 2)))
    @command
    def key_change(
        repo: str = typer.Argument(..., metavar="REPO"),
        key_file: Path = typer.Option(..., "--key-file", metavar="PATH", help="The key that opens it now."),
        new_key_file: Path = typer.Option(..., "--new-key-file", metavar="PATH", help="The key that will."),
        wait: float = typer.Option(0.0, "--wait", metavar="SECONDS", help="Wait for another writer's lock."),
        json_output: bool = JSON_OPTION,
    ) -> None:
        from ckpt_archive.ops.keys import change_repository_key

        out = Output(json_output)
        res = change_repository_key(repo, key_file, new_key_file, wait=wait)
        out.say(f"{res['location']}: now opens with {new_key_file} (not with {key_file})", style="green")
        out.json(res)


__all__ = ["register"]
