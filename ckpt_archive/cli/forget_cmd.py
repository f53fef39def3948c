"""``ckpt-archive forget REPO@GEN``: remove one generation, marker first, under the lock."""
from __future__ import annotations

import typer

from ckpt_archive.cli.common import EXIT_CODES_HELP, JSON_OPTION, Output, command, split_repo_spec
from ckpt_archive.cli.prune_cmd import WAIT


def forget_generation(repo_url: str, spec: str, *, force: bool = False, wait: float = 0.0) -> dict:
    """Remove one generation (any status) in reverse publish order, holding the lock.

    Args:
        repo_url: repository path or URL.
        spec: a generation number, ``latest`` or ``tag:NAME``.
        force: allow removing the newest usable generation.
        wait: seconds to wait for the writer lock.

    Returns:
        ``{"repository", "generation", "status", "newest_usable"}`` (``status`` before removal;
        ``newest_usable`` the newest usable generation afterwards, or ``None``).

    Raises:
        NotFound: no such generation. UsageError: it is the newest usable one and ``force`` is false.
        LockError: another writer holds the lock.
    """
    from ckpt_archive.errors import UsageError
    from ckpt_archive.repo.repository import Repository

    repo = Repository.open(repo_url)
    with repo.lock(wait=wait):
        gen = repo.resolve(spec)
        usable = [g.number for g in repo.usable()]
        if usable and gen.number == usable[-1] and not force:
            older = f" (the next newest usable would be {usable[-2]})" if len(usable) > 1 else \
                " (it is the only usable generation)"
            raise UsageError(f"refusing to forget generation {gen.number}: it is the newest usable generation"
                             f"{older}; pass --force to remove it anyway", where=repo.location)
        status = gen.status
        repo.remove_generation(gen.number)
        remaining = [g.number for g in repo.usable()]
    return {"repository": repo.location, "generation": gen.number, "status": status,
            "newest_usable": remaining[-1] if remaining else None}


def register(app: typer.Typer) -> None:
    @app.command("forget", help="Remove one generation: its USABLE marker first (from that instant it is not "
                 "usable), then its members, manifest and folder, holding the repository lock. Refuses the "
                 "newest usable generation unless --force. " + EXIT_CODES_HELP)
    @command
    def forget_cmd(
        spec: str = typer.Argument(..., metavar="REPO@GEN", help="Repository and generation: number, latest or "
                                   "tag:NAME (REPO alone means latest)."),
        force: bool = typer.Option(False, "--force", help="Also remove the newest usable generation."),
        wait: float = WAIT,
        json_output: bool = JSON_OPTION,
    ) -> None:
        out = Output(json_output)
        repo, gen = split_repo_spec(spec)
        result = forget_generation(repo, gen, force=force, wait=wait)
        newest = result["newest_usable"]
        out.say(f"forgot generation {result['generation']} (was {result['status']}); newest usable now: "
                f"{newest if newest is not None else 'none'}")
        out.json({"ok": True, **result})
