"""``ckpt-archive gc REPO``: remove leftovers of interrupted writes, holding the lock, and say what went."""
from __future__ import annotations

import re

import typer

from ckpt_archive.cli.common import EXIT_CODES_HELP, JSON_OPTION, Output, command
from ckpt_archive.cli.prune_cmd import WAIT

#: A temporary sibling left by an interrupted atomic replace (``LocalStore.replace_bytes``).
_TMP = re.compile(r"^\..+\.tmp-\d+$")


def collect_garbage(repo_url: str, *, dry_run: bool = False, wait: float = 0.0) -> dict:
    """Remove what interrupted writes left behind.

    Leftovers are ``partial`` generations (claimed but never published, or half-removed by an
    interrupted forget/prune: no ``USABLE.json``) and temporary files of an interrupted atomic replace
    (``.NAME.tmp-PID``) at the repository root and in generation folders. Holding the writer lock
    guarantees no write is in progress on this machine. ``damaged`` generations (a marker that no longer
    matches its manifest) are evidence, not leftovers: they are reported, never removed here (use
    ``forget``); ``copied`` ones become usable with ``verify --deep``.

    Returns:
        ``{"repository", "dry_run", "removed": [{"generation", "reason"}], "removed_files": [key],
        "kept_not_usable": [{"generation", "status", "reason"}]}``.

    Raises:
        NotFound: no repository. LockError: another writer holds the lock.
    """
    from ckpt_archive.repo.repository import Repository, gen_key

    repo = Repository.open(repo_url)
    removed, removed_files, kept = [], [], []
    with repo.lock(wait=wait):
        for g in repo.generations():
            if g.status == "partial":
                removed.append({"generation": g.number, "reason": g.reason})
                if not dry_run:
                    repo.remove_generation(g.number)
            else:
                if g.status != "usable":
                    kept.append({"generation": g.number, "status": g.status, "reason": g.reason})
                for name in repo.store.listdir(gen_key(g.number)):
                    if _TMP.match(name):
                        removed_files.append(f"{gen_key(g.number)}/{name}")
        for name in repo.store.listdir(""):
            if _TMP.match(name):
                removed_files.append(name)
        if not dry_run:
            for key in removed_files:
                repo.store.remove(key)
    return {"repository": repo.location, "dry_run": dry_run, "removed": removed, "removed_files": removed_files,
            "kept_not_usable": kept}


def register(app: typer.Typer) -> None:
    @app.command("gc", help="Remove leftovers of interrupted writes (partial generations, temporary files), "
                 "holding the repository lock, and list what was removed. Damaged generations are reported, "
                 "not removed (use forget). " + EXIT_CODES_HELP)
    @command
    def gc_cmd(
        repo: str = typer.Argument(..., metavar="REPO", help="Repository path or URL."),
        dry_run: bool = typer.Option(False, "--dry-run", "-n", help="List what would be removed; remove nothing."),
        wait: float = WAIT,
        json_output: bool = JSON_OPTION,
    ) -> None:
        out = Output(json_output)
        result = collect_garbage(repo, dry_run=dry_run, wait=wait)
        verb = "would remove" if dry_run else "removed"
        for item in result["removed"]:
            out.say(f"{verb} generation {item['generation']}: partial ({item['reason']})")
        for key in result["removed_files"]:
            out.say(f"{verb} {key}: temporary file of an interrupted write")
        for item in result["kept_not_usable"]:
            out.warn(f"generation {item['generation']} is {item['status']} ({item['reason']}); not a leftover, "
                     f"left in place")
        if not result["removed"] and not result["removed_files"]:
            out.say("nothing to remove: no leftovers of interrupted writes")
        out.json({"ok": True, **result})
