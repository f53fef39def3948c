"""``inspect``: what a generation holds, from its manifest and marker (reads no member)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, TypedDict

from ckpt_archive.ops.common import RepoLike, open_repo, pick


class InspectInfo(TypedDict):
    """What :func:`inspect` returns (a plain dict, so it serialises as is).

    Keys:
        generation, status, reason: the generation and its status (``reason`` None when usable).
        location: the repository. manifest: the parsed manifest. marker: the parsed marker or None.
        opaque_members: relpaths of source files archived as opaque bytes (e.g. a pickle never loaded).
        exact_bytes: per source file, whether its exact bytes are kept
            (:func:`ckpt_archive.format.exact_bytes.exact_summary`).
        shared: what the generation keeps in shared objects and with which generations it shares them
            (:func:`shared_summary`).
        numpy: where the state holds NumPy values (:func:`numpy_summary`): what a reader of the restored file
            needs NumPy's allowlist for.
        policy: the LR audit and completeness lint of the generation
            (:class:`~ckpt_archive.ops.policy_check.PolicyVerdict`, ``.to_json()`` for JSON), or None when not
            asked for (``policy=False``).
        ok, exit_code, problems: whether the state tree it reports on (for the policy audit) could be read
            and matches the tensor index (:func:`state_problems`): ``exit_code`` 1 when something there is
            damaged, 2 when it could not be read here, 0 otherwise; ``problems`` say what.
    """

    generation: int
    status: str
    reason: Optional[str]
    location: str
    manifest: dict
    marker: Optional[dict]
    opaque_members: list
    exact_bytes: Any
    shared: dict
    numpy: dict
    policy: Any
    ok: bool
    exit_code: int
    problems: list


def shared_summary(manifest: dict, number: int, users: dict[str, list[int]]) -> dict:
    """What generation ``number`` keeps in shared objects (docs/FORMAT.md, "Shared objects").

    Args:
        manifest: its parsed manifest. number: its number.
        users: ``{oid: [generation numbers]}`` of every readable manifest
            (:func:`ckpt_archive.repo.objects.users_of`).

    Returns:
        ``{"objects": [{"key", "fp", "oid", "stored_bytes", "raw_bytes", "entries": ["member:entry", ...],
        "generations": [every generation referencing it]}], "object_bytes"`` (stored bytes of the objects
        it references, each once), ``"shared_bytes"`` (of those, the bytes another generation references
        too), ``"shared_with": {"<generation>": stored bytes shared with it}`` (str keys, as in JSON),
        ``"new_stored_bytes"`` (what it stored itself; its ``stored_bytes`` when not recorded),
        ``"stored_bytes"`` (its whole stored stream), ``"only_here_bytes"`` (its own files plus the objects
        no other generation references: what forgetting it would free)}.
    """
    from ckpt_archive.format.objects import object_key, parts

    objects: dict[str, dict] = {}
    for m in manifest.get("members") or ():
        entry_at = {(m.get("header_bytes", 0) + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0]): k
                    for k, e in (m.get("entries") or {}).items()}
        oids = {p.fp: p.oid for p in parts(m) if p.oid is not None} if m.get("objects") else {}
        for o in m.get("objects") or ():
            oid = oids[o["fp"]]
            row = objects.setdefault(oid, {
                "key": object_key(oid), "fp": o["fp"], "oid": oid, "stored_bytes": o["stored_bytes"],
                "raw_bytes": o["raw_bytes"], "entries": [],
                "generations": sorted(set(users.get(oid, [])) | {number})})
            row["entries"].append(f"{m['path']}:{entry_at.get((o['raw_offset'], o['raw_bytes']), '?')}")
    shared_with: dict[str, int] = {}
    shared_bytes = 0
    for row in objects.values():
        others = [n for n in row["generations"] if n != number]
        if others:
            shared_bytes += row["stored_bytes"]
        for n in others:
            shared_with[str(n)] = shared_with.get(str(n), 0) + row["stored_bytes"]
    summary = manifest.get("summary") or {}
    from ckpt_archive.format.objects import own_stored_bytes

    own = sum(own_stored_bytes(m) for m in manifest.get("members") or ())
    object_bytes = sum(r["stored_bytes"] for r in objects.values())
    return {"objects": list(objects.values()), "object_bytes": object_bytes,
            "shared_bytes": shared_bytes,
            # what this generation alone holds: forgetting it frees this much (its files and the objects no
            # other generation references), whoever wrote them
            "only_here_bytes": own + object_bytes - shared_bytes,
            "shared_with": {k: shared_with[k] for k in sorted(shared_with, key=int)},
            "new_stored_bytes": summary.get("new_stored_bytes", summary.get("stored_bytes")),
            "stored_bytes": summary.get("stored_bytes")}


def numpy_summary(manifest: dict) -> dict:
    """Where a generation's state holds NumPy values, from its manifest (reads no member).

    Returns:
        ``{"arrays": [tensor-index keys of NumPy arrays], "scalars": {"count", "paths"} | None}``: ``scalars`` are
        the NumPy scalars and dtypes pack found (``np.float64(0.5)``, the ``np.int64`` of a legacy RNG tuple),
        the first 100 paths recorded; None for a generation packed before they were recorded (issue 27).
        Restored, these come back as the same NumPy types, so ``torch.load(weights_only=True)`` of the file needs
        NumPy's allowlist (``ckpt-archive pack --allow-numpy`` admitted them on the way in).
    """
    arrays = sorted(k for k, t in (manifest.get("tensors") or {}).items()
                    if isinstance(t, dict) and t.get("kind") == "numpy")
    info = ((manifest.get("source") or {}).get("info") or {})
    found = info.get("numpy_values")
    if isinstance(found, dict) and isinstance(found.get("count"), int) and isinstance(found.get("paths"), list):
        scalars = {"count": found["count"], "paths": [str(p) for p in found["paths"]]}
    else:
        scalars = None
    return {"arrays": arrays, "scalars": scalars}


def inspect(repo: RepoLike, generation: str | int = "latest", *, policy: bool = True,
            store_options: Mapping[str, Any] | None = None) -> InspectInfo:
    """The manifest and marker of a generation plus a summary, and its LR policy audit.

    The summary reads no member. The audit (``policy=True``, as ``ckpt-archive inspect`` shows it) reads the
    state tree and the tensors of at most 8 elements (step counters), never the weights
    (:func:`ckpt_archive.ops.policy_check.policy_verdict`); a state that cannot be read for it is said in
    ``policy.skipped``, never an exception.

    Args:
        repo: repository path/URL or Repository.
        generation: ``"latest"``, a number, or ``"tag:NAME"``.
        policy: run the LR policy audit and completeness lint (default).
        store_options: for URL repositories (``{"endpoint_url": ..., "storage_options": {...}}``).

    Besides the manifest, the state tree is read (bounded, ``limits.MAX_TREE_BYTES``) and checked against the
    tensor index (:func:`state_problems`): what ``inspect`` reports from the state must be readable, so a
    tree that is damaged makes the result's ``exit_code`` 1 (and is recorded as a failed check: ``list``
    then says damaged), one that cannot be read here 2 -- never 0 with a warning.

    Returns:
        :class:`InspectInfo`.

    Raises:
        NotFound / NoUsableGeneration / ManifestInvalid / NewerFormatError: nothing to show.
        TypeError: an unknown keyword argument (store options go in ``store_options``).

    Example:
        >>> import torch, ckpt_archive, tempfile
        >>> repo = tempfile.mkdtemp()
        >>> _ = ckpt_archive.pack({"w": torch.ones(2), "step": 5}, repo)
        >>> info = ckpt_archive.inspect(repo)
        >>> info["generation"], info["status"], info["manifest"]["progress"]["step"]
        (1, 'usable', 5)
    """
    r = open_repo(repo, **dict(store_options or {}))
    gen = pick(r, generation, False)
    m = gen.manifest
    opaque = [f["relpath"] for f in m["source"]["files"] if f["kind"] == "opaque"]
    from ckpt_archive.format.exact_bytes import exact_summary
    from ckpt_archive.format.objects import refs

    users: dict[str, list[int]] = {}
    if refs(m):  # reads every generation's manifest (which others reference the same objects)
        from ckpt_archive.repo.objects import users_of

        users = users_of(r)
    problems, code = state_problems(r, gen)
    return {"generation": gen.number, "status": gen.status, "reason": gen.reason, "location": r.location,
            "manifest": m, "marker": gen.marker, "opaque_members": opaque, "exact_bytes": exact_summary(m),
            "shared": shared_summary(m, gen.number, users), "numpy": numpy_summary(m),
            "policy": _policy(r, gen.number) if policy else None, "ok": code == 0, "exit_code": code,
            "problems": [p.to_json() for p in problems]}


def _policy(r: Any, number: int) -> Any:
    from ckpt_archive.ops.policy_check import policy_verdict

    return policy_verdict(r, number)


def state_problems(r, gen) -> tuple[list, int]:
    """[issue 24] Whether the state ``inspect`` reports on can be read: the state tree (read whole, its
    declared size checked first: ``limits.MAX_TREE_BYTES``, every chunk and its fingerprint checked) and its
    agreement with the tensor index (:func:`ckpt_archive.repo.trial_reload.index_problems`: no tensor bytes
    are decoded). Damage found is recorded as a failed check (:func:`ckpt_archive.ops.common.note_damage`).

    Args:
        r: the repository. gen: the generation (its manifest parsed).

    Returns:
        ``(problems, exit code)``: ``([], 0)``; damage: ``(problems, 1)``; not readable here (a store that
        fails, a file this process may not read): ``([problem], 2)``.
    """
    from ckpt_archive.errors import CannotCheck, CheckFailed
    from ckpt_archive.ops.common import note_damage
    from ckpt_archive.repo.reader import ArchiveReader, Problem
    from ckpt_archive.repo.trial_reload import index_problems

    tree_member = gen.manifest["tree_member"]
    reader = ArchiveReader(r.store, gen.key, gen.manifest)
    try:
        problems = index_problems(reader, reader.tree())
    except CheckFailed as exc:
        problems = [Problem.of(exc, member=tree_member)]
    except (CannotCheck, OSError) as exc:
        why = getattr(exc, "message", None) or getattr(exc, "strerror", None) or str(exc)
        return [Problem(f"the state tree could not be read here: {why}", member=tree_member)], 2
    except (KeyError, TypeError, IndexError) as exc:
        problems = [Problem(f"the manifest is malformed where it is read ({type(exc).__name__}: {exc})",
                            member="manifest.json")]
    if problems:
        note_damage(r, gen, problems, by="inspect")
    return problems, 1 if problems else 0


__all__ = ["inspect", "InspectInfo", "shared_summary", "numpy_summary", "state_problems"]
