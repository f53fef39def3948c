"""``inspect``: what a generation holds, from its manifest and marker (reads no member)."""
from __future__ import annotations

from typing import Any, Optional, TypedDict

from ckpt_archive.ops.common import RepoLike, open_repo, pick


class InspectInfo(TypedDict):
    """What :func:`inspect` returns (a plain dict, so it serialises as is).

    Keys:
        generation, status, reason: the generation and its status (``reason`` None when usable).
        location: the repository. manifest: the parsed manifest. marker: the parsed marker or None.
        opaque_members: relpaths of source files archived as opaque bytes (e.g. a pickle never loaded).
        exact_bytes: per source file, whether its exact bytes are kept
            (:func:`ckpt_archive.format.exact_bytes.exact_summary`).
    """

    generation: int
    status: str
    reason: Optional[str]
    location: str
    manifest: dict
    marker: Optional[dict]
    opaque_members: list
    exact_bytes: Any


def inspect(repo: RepoLike, generation: str | int = "latest", **store_options: Any) -> InspectInfo:
    """The manifest and marker of a generation plus a summary (reads no member).

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        **store_options: for URL repositories.

    Returns:
        :class:`InspectInfo`.

    Raises:
        NotFound / NoUsableGeneration / ManifestInvalid / NewerFormatError: nothing to show.

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"w": torch.ones(2), "step": 5}, repo)
        >>> info = ckpt_archive.inspect(repo)
        >>> info["generation"], info["status"], info["manifest"]["progress"]["step"]
        (1, 'usable', 5)
    """
    r = open_repo(repo, **store_options)
    gen = pick(r, generation, False)
    m = gen.manifest
    opaque = [f["relpath"] for f in m["source"]["files"] if f["kind"] == "opaque"]
    from ckpt_archive.format.exact_bytes import exact_summary

    return {"generation": gen.number, "status": gen.status, "reason": gen.reason, "location": r.location,
            "manifest": m, "marker": gen.marker, "opaque_members": opaque, "exact_bytes": exact_summary(m)}


__all__ = ["inspect", "InspectInfo"]
