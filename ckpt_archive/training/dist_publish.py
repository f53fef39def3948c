"""Rank 0's half of a distributed save: the publish lifecycle of :mod:`ckpt_archive.repo.publish`, with steps
that exchange with the other ranks (see :mod:`ckpt_archive.training.distributed` for the protocol).

Exchanges, in order (every rank takes part in each, or the group is broken):
(2) number claimed -> (3) members written, records gathered -> (4) sealed -> (5) trial reloads gathered
-> (6) outcome. When rank 0 fails part-way, :meth:`_DistSteps.abort` sends the remaining exchanges with a
failure, so every other rank stops at the same point with rank 0's message.
"""
from __future__ import annotations

import errno

from ckpt_archive.errors import CannotCheck, CkptArchiveError, StoreError
from ckpt_archive.format.manifest import seal_bytes
from ckpt_archive.repo.publish import PACK_POINTS, Lifecycle
from ckpt_archive.repo.reader import Problem
from ckpt_archive.repo.repository import MANIFEST, gen_key, host_record, iso, raise_if_problems, utcnow


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
        from ckpt_archive.format.codec import DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL, default_jobs
        from ckpt_archive.ops.pack import build_manifest
        from ckpt_archive.repo.writer import TREE_MEMBER, GenerationWriter, write_tree_and_data_ids
        from ckpt_archive.training.distributed import combined_tree

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
        repo.store.write_bytes_once(f"{key}/{MANIFEST}", raw)
        return self.manifest, raw

    def verify(self, repo, number: int, reader) -> dict:
        self.w.comm.from_rank0({"ok": True})  # sealed and fsynced: the others may reload their parts
        self.stage = 4
        problems: list[Problem] = []
        reader.check_stored(problems, hash_files=False)  # sizes of every rank's members
        raise_if_problems("verify", problems, number)
        return {"when": iso(utcnow()), "result": "ok", "members": len(self.manifest["members"])}

    def trial_reload(self, reader, problems: list[Problem]) -> dict:
        from ckpt_archive.training.distributed import reload_own

        try:
            own, counts = reload_own(self.w.repo, self.number, self.manifest, 0, self.options.jobs)
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


def _publish_rank0(w, plan, options, retention, intact=None):
    from ckpt_archive.ops.pack import PackResult

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
