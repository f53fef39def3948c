"""Garbage collection: remove what interrupted writes left behind, holding the repository lock."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: A temporary file left by an interrupted atomic write (the file layer's ``.NAME.tmp-PID-<hex>``, and
#: ``.NAME.tmp-PID`` of earlier versions): :data:`ckpt_archive.store.fs.TEMP_FILE`, the one definition.
from ckpt_archive.store.fs import TEMP_FILE as TMP_NAME
from ckpt_archive.ops.common import RepoLike

__all__ = ["GcResult", "gc", "TMP_NAME"]


@dataclass
class GcResult:
    """What :func:`gc` removed (or, with ``dry_run``, would remove) and what it left in place.

    Attributes:
        repository: the repository's location.
        dry_run: True when nothing was removed on purpose.
        removed: partial generations, ``[{"generation": N, "reason": str}]``.
        removed_files: store keys of temporary files of interrupted atomic replaces.
        removed_files: store keys of temporary files of interrupted atomic replaces and of shared
            objects being written (``objects/<hh>/.NAME.tmp-PID``).
        kept_not_usable: generations that are not usable but are not leftovers (damaged, copied),
            ``[{"generation", "status", "reason"}]``: reported, never removed here.
        removed_objects: store keys of shared objects no manifest references (left by an interrupted
            pack, or by the partial generations removed here).
        freed_object_bytes: their total size (bytes).
        objects_kept: why no shared object was deleted (a manifest that cannot be read), or None.
        objects_skipped: object paths left alone (a symbolic link on the way: never deleted through),
            each with why.
        skipped_keys: store keys whose path is unsafe (``generations/00000002/../x`` on an object store),
            each with why: skipped with a warning, never read or deleted; the cleanup goes on.
    """

    repository: str
    dry_run: bool
    removed: list[dict[str, Any]] = field(default_factory=list)
    removed_files: list[str] = field(default_factory=list)
    kept_not_usable: list[dict[str, Any]] = field(default_factory=list)
    removed_objects: list[str] = field(default_factory=list)
    freed_object_bytes: int = 0
    objects_kept: str | None = None
    objects_skipped: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Always True: finding leftovers is not a failure (a failed removal raises instead)."""
        return True

    def to_json(self) -> dict[str, Any]:
        """``{"repository", "dry_run", "removed", "removed_files", "kept_not_usable", "removed_objects",
        "freed_object_bytes", "objects_kept", "objects_skipped", "skipped_keys"}`` (JSON-ready)."""
        return {"repository": self.repository, "dry_run": self.dry_run, "removed": list(self.removed),
                "removed_files": list(self.removed_files), "kept_not_usable": list(self.kept_not_usable),
                "removed_objects": list(self.removed_objects), "freed_object_bytes": self.freed_object_bytes,
                "objects_kept": self.objects_kept, "objects_skipped": list(self.objects_skipped),
                "skipped_keys": list(self.skipped_keys)}


def gc(repo: RepoLike, *, dry_run: bool = False, wait: float = 0.0) -> GcResult:
    """Remove what interrupted writes left behind.

    Leftovers are ``partial`` generations (claimed but never published, or half-removed by an
    interrupted forget/prune: no ``USABLE.json``) and temporary files of an interrupted atomic replace
    (``.NAME.tmp-PID-<hex>``, or ``.NAME.tmp-PID`` of earlier versions) at the repository root, in generation folders and under ``objects/``; then (last,
    the reverse of the write order) shared objects that no generation's manifest references, unless
    some manifest cannot be read (``objects_kept`` says so). Holding the writer lock
    guarantees no write is in progress on this machine. ``damaged`` generations (a marker that no longer
    matches its manifest) are evidence, not leftovers: they are reported, never removed here (use
    ``forget``); ``copied`` ones become usable with ``verify --deep``. Nothing is read, listed or deleted
    through a symbolic link (a generation folder that is one is reported as damaged and left alone).

    Args:
        repo: repository path or URL.
        dry_run: list what would be removed; remove nothing (the lock is still taken, so the listing
            does not race a writer).
        wait: seconds to wait for the writer lock.

    Returns:
        A :class:`GcResult`.

    Raises:
        NotFound: no repository. LockError: another writer holds the lock.
        OSError, StoreError: a removal failed; earlier removals stand.

    Example:
        >>> import ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp() + "/repo"
        >>> _ = ckpt_archive.pack({"step": 1}, repo)
        >>> ckpt_archive.gc(repo).removed
        []
    """
    from ckpt_archive.errors import UnsafePath
    from ckpt_archive.repo.objects import all_objects, sweep
    from ckpt_archive.repo.repository import gen_key
    from ckpt_archive.ops.common import open_repo

    r = open_repo(repo)
    removed, removed_files, kept = [], [], []
    with r.lock(wait=wait):
        for g in r.generations():
            if g.status == "partial":
                removed.append({"generation": g.number, "reason": g.reason})
                if not dry_run:
                    r.remove_generation(g.number, sweep=False)  # one sweep of every object below
            else:
                if g.status != "usable":
                    kept.append({"generation": g.number, "status": g.status, "reason": g.reason})
                if isinstance(g.error, UnsafePath):
                    continue  # e.g. a generation folder that is a symbolic link: never listed through
                for name in r.safe_listdir(gen_key(g.number)):
                    if TMP_NAME.match(name):
                        removed_files.append(f"{gen_key(g.number)}/{name}")
        for name in r.safe_listdir(""):
            if TMP_NAME.match(name):
                removed_files.append(name)
        removed_files += all_objects(r.store, [])[1]  # objects whose write was interrupted before the link
        if not dry_run:
            for key in removed_files:
                r.store.remove(key)
        swept = sweep(r, None, dry_run=dry_run, exclude=[x["generation"] for x in removed])
    return GcResult(repository=r.location, dry_run=dry_run, removed=removed, removed_files=removed_files,
                    kept_not_usable=kept, removed_objects=swept.removed, freed_object_bytes=swept.freed_bytes,
                    objects_kept=swept.kept, objects_skipped=swept.skipped, skipped_keys=list(r.unsafe_keys))
