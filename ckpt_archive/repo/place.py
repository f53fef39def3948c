"""Where a repository is, by identity: what a marker's ``location`` and ``identity`` are compared with.

A generation is usable only at the place its marker names (docs/FORMAT.md). "This location" is compared by
identity, not by spelling: a local repository is its resolved real path (symlinks and ``..`` resolved) plus
the device and inode of its root folder; a remote one its normalised URL (:func:`canonical_url`).
``repository.json`` itself is replaced atomically on every claim (a new inode each time), so the root
folder's inode is the stable one.
"""
from __future__ import annotations

import dataclasses
import os
import re

from ckpt_archive.store.base import Store


def canonical_url(url: str) -> str:
    """A remote location in one spelling: lower-case scheme (``s3a`` read as ``s3``), no repeated or
    trailing slashes. ``S3://b//p/`` and ``s3://b/p`` are the same place.

    Example:
        >>> canonical_url("S3A://bucket//runs/a/")
        's3://bucket/runs/a'
    """
    scheme, sep, rest = str(url).partition("://")
    if not sep:
        return str(url)
    scheme = scheme.lower()
    if scheme == "s3a":
        scheme = "s3"
    rest = re.sub(r"/{2,}", "/", rest).rstrip("/")
    return f"{scheme}://{rest}"


@dataclasses.dataclass
class Place:
    """Where a repository is, by identity (what a marker's ``location``/``identity`` are compared with).

    Attributes:
        location: a local repository's resolved real path, or a remote one's :func:`canonical_url`.
        local: True for a folder on this machine's file system.
    """

    location: str
    local: bool
    _stat: tuple[int, int] | None = None

    @classmethod
    def of(cls, store: Store) -> "Place":
        """The place of a store's root (:meth:`Store.local_path` decides local or remote)."""
        root = store.local_path("")
        if root is None:
            return cls(canonical_url(store.location), False)
        return cls(os.path.realpath(os.fspath(root)), True)

    def dev_ino(self) -> tuple[int, int] | None:
        """``(st_dev, st_ino)`` of the root folder; None for a remote place or a folder not there yet."""
        if not self.local:
            return None
        if self._stat is None:
            try:
                st = os.stat(self.location)
            except OSError:
                return None
            self._stat = (st.st_dev, st.st_ino)
        return self._stat

    def identity(self) -> dict:
        """What a marker records besides ``location``: ``{"dev", "ino"}`` of a local root, else ``{}``."""
        di = self.dev_ino()
        return {"dev": di[0], "ino": di[1]} if di else {}

    def holds(self, marker: dict) -> bool:
        """Whether a marker's ``location`` (and ``identity``) name this place.

        Remote: the normalised URLs are equal. Local: the marker's path, resolved here today, is this
        real path (a symlink, a ``..`` path, or a marker written before locations were resolved), or
        the marker's root folder has this device and inode (the folder was moved with ``mv``). A marker
        whose recorded inode differs from this root's names another copy even at the same path (a
        ``cp -a`` put in place of the original), unless the device changed too (a remount): copies
        are told by inode, not by path.
        """
        loc = marker.get("location")
        if not isinstance(loc, str) or not loc:
            return False
        if not self.local:
            return canonical_url(loc) == self.location
        if "://" in loc and not loc.startswith("file://"):
            return False
        path = loc[len("file://"):] if loc.startswith("file://") else loc
        ident = marker.get("identity") if isinstance(marker.get("identity"), dict) else {}
        ours = self.dev_ino()
        theirs = (ident.get("dev"), ident.get("ino"))
        same_path = os.path.realpath(path) == self.location
        if ours is None or not all(isinstance(x, int) for x in theirs):
            return same_path
        if theirs == ours:
            return True
        return same_path and theirs[1] == ours[1]


__all__ = ["Place", "canonical_url"]
