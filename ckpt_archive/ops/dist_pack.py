"""The repository side of a distributed save (docs/checkpointer.md): what many ranks do to one generation.

The protocol and the exchanges are :mod:`ckpt_archive.training.distributed`'s; this module holds what they
do to the repository, as the operation that owns it (training uses ops, never repo):

* the tree of a generation written by several ranks (:data:`DIST_KEY`, :func:`combined_tree`) and where each
  rank's members live (:func:`rank_prefix`);
* each rank's members (:func:`write_rank_members`) and their trial reload (:func:`reload_rank`);
* rank 0's half, the publish lifecycle of :mod:`ckpt_archive.repo.publish` with steps that exchange with the
  other ranks (:func:`publish_rank0`), and the other ranks' half (:func:`follow_rank0`).

Exchanges, in order (every rank takes part in each, or the group is broken):
(2) number claimed -> (3) members written, records gathered -> (4) sealed -> (5) trial reloads gathered
-> (6) outcome. When rank 0 fails part-way, ``_DistSteps.abort`` sends the remaining exchanges with a
failure, so every other rank stops at the same point with rank 0's message. ``w.comm`` is the writer's
exchange (``from_rank0``, ``all_gather``, ``broken``); nothing here imports torch.
"""
from __future__ import annotations

import errno
from typing import Any

from ckpt_archive.errors import CannotCheck, CkptArchiveError, IntegrityError, StoreError
from ckpt_archive.format.codec import DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL, default_jobs
from ckpt_archive.format.manifest import seal_bytes
from ckpt_archive.ops.pack import PackResult, build_manifest
from ckpt_archive.repo.publish import PACK_POINTS, Lifecycle
from ckpt_archive.repo.reader import ArchiveReader, Problem
from ckpt_archive.repo.repository import MANIFEST, gen_key, host_record, iso, raise_if_problems, utcnow
from ckpt_archive.repo.trial_reload import trial_reload
from ckpt_archive.repo.writer import TREE_MEMBER, GenerationWriter, write_tensor_members, write_tree_and_data_ids

DIST_KEY = "ckpt_archive_distributed"


def is_distributed_tree(tree: Any) -> bool:
    """True for the tree of a generation written by several ranks (see the module docstring)."""
    return isinstance(tree, dict) and tree.get(DIST_KEY) == 1 and isinstance(tree.get("ranks"), list)


def rank_prefix(rank: int) -> str:
    """The folder of rank ``rank``'s members and the prefix of its keys (``rank00001/``). Never raises."""
    return f"rank{rank:05d}/"


def write_rank_members(repo, number: int, table, rank: int, options) -> tuple[list, dict]:
    """Write one rank's tensor entries into generation ``number`` under ``rank0000R/``.

    Args:
        repo: the Repository. number: the claimed generation. table: the rank's
            :class:`~ckpt_archive.format.state_tree.TensorTable` (keys already prefixed). rank: the writer.
        options: the :class:`~ckpt_archive.ops.pack.PackOptions` (``level``, ``jobs``, ``chunk_bytes``).

    Returns:
        ``(member records, tensor records)`` for the manifest.

    Raises:
        StoreError / OSError: a member could not be written (disk full, read-only, a fault injected).
    """
    members, tensors = write_tensor_members(
        repo.store, gen_key(number), table, prefix=rank_prefix(rank),
        level=options.level or DEFAULT_LEVEL, jobs=options.jobs,
        chunk_bytes=options.chunk_bytes or DEFAULT_CHUNK_BYTES, faults=repo.faults)
    return members, tensors


def combined_tree(results: list[dict]) -> dict:
    """The generation's tree from every rank's result (see the module docstring)."""
    sharded: dict[str, dict] = {}
    for res in results:
        for leaf, piece in res["shards"].items():
            s = sharded.setdefault(leaf, {"shape": piece["shape"], "dtype": piece["dtype"], "pieces": []})
            p = {"key": piece["key"], "offsets": piece["offsets"], "sizes": piece["sizes"]}
            if p not in s["pieces"]:
                s["pieces"].append(p)
    return {DIST_KEY: 1, "world_size": len(results), "ranks": [r["tree"] for r in results], "sharded": sharded}


def reload_rank(repo, number: int, manifest: dict, rank: int, jobs) -> tuple[list, dict]:
    """Trial-reload the members rank ``rank`` wrote (and the tree, every reference resolved).

    Args:
        repo: the Repository. number: the generation (sealed). manifest: its manifest. rank: whose members.
        jobs: decoder threads (None: all cores).

    Returns:
        ``(problems as JSON, counts)``.

    Raises:
        StoreError / CkptArchiveError: the store could not be read (a damaged member is a problem, not an error).
    """
    pre = rank_prefix(rank)
    mine = [m for m in manifest["members"] if m["path"].startswith(pre) or m["path"] == manifest["tree_member"]]
    sub = {**manifest, "members": mine}
    reader = ArchiveReader(repo.store, gen_key(number), sub, jobs=jobs)
    problems: list = []
    reader.check_stored(problems, hash_files=False)
    counts = trial_reload(reader, problems) if not problems else {"tensors": 0, "bytes": 0, "members": len(mine)}
    counts["members"] = len([m for m in mine if m["path"].startswith(pre)])
    return [p.to_json() for p in problems], counts


class _DistSteps:
    def __init__(self, w, plan, options, intact=None):
        self.w, self.plan, self.options, self.intact = w, plan, options, intact
        self.stage = 1
        self.number: int | None = None
        self.manifest: dict | None = None
        self.warnings: list[str] = []

    # -- Steps ------------------------------------------------------------------------------------------------
    def claim(self, repo) -> int:
        self.number = repo.claim_next()
        self.w.comm.from_rank0({"number": self.number})
        self.stage = 2
        return self.number

    def write_members(self, repo, number: int) -> None:
        own_error = None
        try:
            mine = self.plan.write(repo, number, self.options)
        except (CkptArchiveError, OSError) as exc:
            own_error = exc
            mine = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results = self.w.comm.all_gather(mine)
        self.stage = 3
        if own_error is not None:
            raise own_error
        bad = [(r, x["error"]) for r, x in enumerate(results) if not x["ok"]]
        if bad:
            raise CannotCheck(f"rank {bad[0][0]} could not write its part: {bad[0][1]}")
        o, p = self.options, self.plan.prep
        tree = combined_tree(results)
        members = [m for res in results for m in res["members"]]
        tensors = {k: v for res in results for k, v in res["tensors"].items()}
        gw = GenerationWriter(repo.store, gen_key(number), level=o.level or DEFAULT_LEVEL,
                              jobs=o.jobs or default_jobs(), chunk_bytes=o.chunk_bytes or DEFAULT_CHUNK_BYTES,
                              on_bytes=None, faults=repo.faults)
        try:
            data = write_tree_and_data_ids(gw, tree, p.data_ids)
            members += gw.members
        finally:
            gw.close()
        repo.faults.point("after-members")
        self.warnings = sorted({wn for res in results for wn in res["warnings"]})
        body = {"tree_member": TREE_MEMBER, "members": members, "tensors": tensors, "data": data,
                "source": {"format": p.source.format, "layout": p.source.layout, "path": None, "files": [],
                           "info": {"distributed": {"world_size": self.w.world, "writer": "ckpt_archive.Checkpointer"}}},
                "summary": {"raw_bytes": sum(m["raw_bytes"] for m in members),
                            "stored_bytes": sum(m["stored_bytes"] for m in members),
                            "tensor_count": len(tensors), "member_count": len(members)}}
        self.manifest = build_manifest(p, number, body)

    def seal(self, repo, number: int):
        key = gen_key(number)
        raw = seal_bytes(self.manifest, where=f"{key}/{MANIFEST}")  # checked as read back; verdict remembered
        repo.write_manifest(number, raw)  # atomic: a failure leaves no manifest.json, the generation partial
        return self.manifest, raw

    def verify(self, repo, number: int, reader) -> dict:
        self.w.comm.from_rank0({"ok": True})  # sealed and fsynced: the others may reload their parts
        self.stage = 4
        problems: list[Problem] = []
        reader.check_stored(problems, hash_files=False)  # sizes of every rank's members
        raise_if_problems("verify", problems, number)
        return {"when": iso(utcnow()), "result": "ok", "members": len(self.manifest["members"])}

    def trial_reload(self, reader, problems: list[Problem]) -> dict:
        try:
            own, counts = reload_rank(self.w.repo, self.number, self.manifest, 0, self.options.jobs)
        except CkptArchiveError as exc:
            own, counts = [{"message": str(exc), "member": exc.where}], {}
        reason = self.intact() if self.intact is not None else None  # rank 0's snapshot: read for the last time
        if reason:
            own = [*own, {"message": f"the snapshot is not what was copied: {reason}", "member": None}]
        results = self.w.comm.all_gather({"problems": own, "counts": counts})
        self.stage = 5
        total = {"tensors": 0, "bytes": 0}
        for r, res in enumerate(results):
            for pr in res["problems"]:
                problems.append(Problem(f"rank {r}: {pr.get('message')}", member=pr.get("member"),
                                        field=pr.get("field")))
            for k in total:
                total[k] += int(res["counts"].get(k, 0))
        return {**total, "members": len(self.manifest["members"]), "ranks": self.w.world}

    def reloaded(self, problems, counts) -> None:
        pass

    def record(self, repo, counts: dict) -> dict:
        return {"trial_reload": {**host_record(repo.location), "result": "ok", **counts}}

    # -- failure ----------------------------------------------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        """Send the exchanges not yet made, each saying rank 0 failed (unless the group is broken)."""
        comm = self.w.comm
        if comm.broken:
            return
        msg = f"{type(exc).__name__}: {exc}"
        try:
            if self.stage < 2:
                comm.from_rank0({"number": None, "error": msg})
                return
            if self.stage == 2:
                comm.all_gather({"ok": False, "error": msg})
                self.stage = 3
            if self.stage == 3:
                comm.from_rank0({"ok": False, "error": msg})
                return
            if self.stage == 4:
                comm.all_gather({"problems": [{"message": msg}], "counts": {}})
                self.stage = 5
            if self.stage == 5:
                comm.from_rank0({"ok": False, "error": msg})
        except CkptArchiveError:
            pass  # the group broke while saying so: the others fail on their own collective
        finally:
            self.stage = 6


def publish_rank0(w, plan, options, retention, intact=None):
    """Rank 0's half of a distributed save: the publish lifecycle (:class:`~ckpt_archive.repo.publish.Lifecycle`)
    with steps that exchange with the other ranks, then retention.

    Args:
        w: the :class:`~ckpt_archive.training.distributed.DistributedWriter` (``repo``, ``comm``, ``world``).
        plan: this rank's share (``write(repo, number, options)``, ``prep``: :func:`~ckpt_archive.ops.pack.prepare`'s).
        options, retention: as :func:`~ckpt_archive.ops.pack.pack`. intact: see ``DistributedWriter.write``.

    Returns:
        the :class:`~ckpt_archive.ops.pack.PackResult` of the published generation.

    Raises:
        CannotCheck: another rank failed. IntegrityError: a rank's trial reload failed. StoreError (disk
        full, read-only), LockError and the errors of pack; each names the step the generation was left
        partial at. Every other rank is told before rank 0 raises.
    """
    r = w.repo
    steps = _DistSteps(w, plan, options, intact)
    life = None
    leftovers: list[str] = []
    try:
        with r.lock(options.wait):
            leftovers = [f"generation {g.number} is {g.status}: {g.reason}" for g in r.generations()
                         if g.status in ("partial", "damaged")]
            life = Lifecycle(r, steps, PACK_POINTS, wait=options.wait, jobs=options.jobs)
            published = life.run()
            w.comm.from_rank0({"ok": True, "number": published.number})  # (6)
            steps.stage = 6
            warnings = list(steps.warnings)
            retention_result = None
            try:
                r.faults.point("after-publish")
                policy = retention if retention is not None else r.config.get("retention")
                if policy and not (hasattr(policy, "is_empty") and policy.is_empty()):
                    from ckpt_archive.ops.prune import apply_after_pack

                    retention_result = apply_after_pack(r, policy, verified=(published.number,))
            except (CkptArchiveError, OSError) as exc:
                warnings.append(f"generation {published.number} is usable, but retention did not run to "
                                f"completion: {exc}")
    except BaseException as exc:
        steps.abort(exc)
        step = life.step if life is not None else "lock"
        if isinstance(exc, CkptArchiveError) and step not in ("claim", "lock") \
                and not exc.message.startswith("distributed save failed"):
            exc.message = (f"distributed save failed at step '{step}' (generation {steps.number} left partial): "
                           f"{exc.message}")
        if isinstance(exc, OSError) and step not in ("claim", "lock"):
            why = {errno.ENOSPC: "disk full", errno.EROFS: "read-only destination"}.get(exc.errno, "I/O error")
            raise StoreError(f"distributed save failed at step '{step}' ({why}: {exc}); generation "
                             f"{steps.number} left partial", where=r.location) from None
        raise
    return PackResult(published.number, "usable", f"{r.location}/{gen_key(published.number)}", published.manifest,
                      warnings, leftovers, retention_result, published.trial_reload)


def follow_rank0(w, plan, options, intact=None):
    """A rank other than 0: the same exchanges, in the same order, as :func:`publish_rank0`.

    Args: as :func:`publish_rank0` (``w.rank`` is not 0).

    Returns:
        a :class:`~ckpt_archive.ops.pack.PackResult` (``retention`` None, ``trial_reload`` this rank's counts).

    Raises:
        CannotCheck: rank 0 (or another rank) stopped the generation, or this rank could not write its part.
        IntegrityError: this rank's trial reload of its part failed.
    """
    comm = w.comm
    claim = comm.from_rank0()  # (2)
    if not claim or claim.get("number") is None:
        raise CannotCheck(f"distributed save: rank 0 could not start the generation: {(claim or {}).get('error')}")
    number = claim["number"]
    try:
        mine = plan.write(w.repo, number, options)
    except Exception as exc:  # noqa: BLE001 - sent, so that every rank stops here, not at a timeout
        mine = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    comm.all_gather(mine)  # (3)
    if not mine["ok"]:
        comm_failed = mine["error"]
        sealed = comm.from_rank0()  # (4): rank 0 stops too
        raise CannotCheck(f"rank {w.rank} could not write its part of generation {number}: {comm_failed}")
    sealed = comm.from_rank0()  # (4)
    if not sealed or not sealed.get("ok"):
        raise CannotCheck(f"distributed save: rank 0 stopped generation {number}: {(sealed or {}).get('error')}")
    manifest = w.repo.generation(number).manifest
    problems: list = []
    counts: dict = {}
    try:
        if manifest is None:
            raise IntegrityError("manifest.json unreadable after rank 0 sealed it", where=gen_key(number))
        problems, counts = reload_rank(w.repo, number, manifest, w.rank, options.jobs)
    except Exception as exc:  # noqa: BLE001 - a failed reload, sent (else rank 0 waits for it until the timeout)
        problems = [{"message": f"{type(exc).__name__}: {exc}", "member": getattr(exc, "where", None)}]
    reason = intact() if intact is not None else None  # the snapshot is no longer read after (3)
    if reason:
        problems = [*problems, {"message": f"the snapshot is not what was copied: {reason}", "member": None}]
    comm.all_gather({"problems": problems, "counts": counts})  # (5)
    outcome = comm.from_rank0()  # (6)
    if problems:
        raise IntegrityError(f"rank {w.rank}: trial reload of its part of generation {number} failed: "
                             f"{problems[0].get('message')}")
    if not outcome or not outcome.get("ok"):
        raise CannotCheck(f"distributed save: generation {number} was not published: {(outcome or {}).get('error')}")
    return PackResult(number, "usable", f"{w.repo.location}/{gen_key(number)}", manifest, [], [], None,
                      {"result": "ok", "rank": w.rank, **counts})


__all__ = ["DIST_KEY", "is_distributed_tree", "rank_prefix", "combined_tree", "write_rank_members", "reload_rank",
           "publish_rank0", "follow_rank0"]
