"""Many processes, one generation: the Checkpointer's path under torch.distributed (docs/checkpointer.md).

Every rank snapshots its own state (model and optimizer state as ``get_state_dict`` gives them: full
tensors under DDP, DTensor shards under FSDP2 / tensor parallel), then, in each rank's background thread:

1. prepare: encode the state (as pack does) and fingerprint every stored entry (sha256); all ranks
   exchange the fingerprints (collective 1). **Who writes what** is decided from them, the same on every
   rank: entries with the same key, bytes and leaf records on several ranks (replicated tensors: a DDP
   model, a replicated DTensor placement) are written once, by the holder with the fewest bytes assigned
   so far (largest first; ties to the lowest rank), the load-balancing rule of DCP's ``dedup_save_plans``;
   everything else (a DTensor's local shard, per-rank RNG states) by its own rank. Keys are made unique
   per writer (``rank00001/model/w``), each rank's tree points at the writer's key.
2. rank 0 takes the repository lock, claims the number and tells the others (2); every rank writes its
   members under ``rank0000R/``; the records are exchanged (3).
3. rank 0 writes the tree (``{"ckpt_archive_distributed": 1, "world_size", "ranks": [tree per rank],
   "sharded": {leaf: {shape, dtype, pieces: [{key, offsets, sizes}]}}}``) and the manifest (seal), fsyncs,
   and says so (4); every rank trial-reloads what it wrote (and the tree, every reference resolved); the
   results are gathered (5); rank 0 writes the marker only if every rank succeeded, then tells the
   others the outcome (6), then runs retention.

A rank that fails sends its failure at the next exchange and every rank stops there; a rank that dies
breaks the group: the others' collectives fail (or time out) and the generation stays partial (no
marker: no reader lists it; ``ckpt-archive gc`` removes it). Rank 0 runs the publish lifecycle of
:mod:`ckpt_archive.repo.publish` with these steps, so order, lock, fsync, verify and marker are pack's.
Exchanges use a dedicated gloo group (created at construction, on every rank) and JSON, never pickle.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any, Callable

from ckpt_archive.errors import CannotCheck, CkptArchiveError, IntegrityError
from ckpt_archive.format.state_tree import _Encoder

DIST_KEY = "ckpt_archive_distributed"


def is_distributed_tree(tree: Any) -> bool:
    """True for the tree of a generation written by several ranks (see the module docstring)."""
    return isinstance(tree, dict) and tree.get(DIST_KEY) == 1 and isinstance(tree.get("ranks"), list)


def rank_prefix(rank: int) -> str:
    return f"rank{rank:05d}/"


class _ShardAwareEncoder(_Encoder):
    """state_tree's encoder, noting which leaf key each DTensor's local-shard copy got."""

    def __init__(self, notes: dict):
        super().__init__()
        self.notes = notes
        self.shard_of: dict[str, dict] = {}

    def enc(self, obj: Any, path: tuple) -> Any:
        node = super().enc(obj, path)
        meta = self.notes.get(id(obj))
        if meta is not None and isinstance(node, dict) and node.get("$t") == "tensor":
            self.shard_of[node["key"]] = meta
        return node


def _rewrite_refs(tree: Any, mapping: dict) -> Any:
    if isinstance(tree, list):
        return [_rewrite_refs(v, mapping) for v in tree]
    if isinstance(tree, dict):
        if tree.get("$t") in ("tensor", "ndarray") and isinstance(tree.get("key"), str):
            return {**tree, "key": mapping[tree["key"]]}
        return {k: _rewrite_refs(v, mapping) for k, v in tree.items()}
    return tree


def assign_writers(fingerprints: list[dict]) -> dict[tuple[int, str], int]:
    """Decide which rank writes each entry (the rule in the module docstring).

    Args:
        fingerprints: per rank, ``{entry key: {"sha256", "nbytes", "leaves": {leaf: record}}}``.

    Returns:
        ``(rank, entry key) -> writer rank`` for every entry of every rank.
    """
    groups: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    for rank, entries in enumerate(fingerprints):
        for key, fp in entries.items():
            gid = (key, fp["sha256"], json.dumps(fp["leaves"], sort_keys=True))
            groups.setdefault(gid, []).append(rank)
            size[gid] = fp["nbytes"]
    load = [0] * len(fingerprints)
    out: dict[tuple[int, str], int] = {}
    for gid in sorted(groups, key=lambda g: (-size[g], g[0], min(groups[g]), g[1])):
        holders = groups[gid]
        writer = min(holders, key=lambda r: (load[r], r))
        load[writer] += size[gid]
        for r in holders:
            out[(r, gid[0])] = writer
    return out


class _Comm:
    """JSON exchanges over a gloo group; once one fails, the group is treated as broken.

    Every exchange is labelled with the operation it belongs to (:attr:`context`: ``"save #K"`` for a
    Checkpointer's K-th save call, ``"restore"``) and its number within it; every rank checks that every
    other rank sent the same label. Collectives pair up by order alone, so two ranks out of step (one rank
    skipped an exchange, or a whole save) would otherwise mix one save's payloads with another's.
    """

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.broken: str | None = None
        self.context = "init"
        self.count = 0

    def begin(self, context: str) -> None:
        """Label the exchanges that follow (see the class docstring)."""
        self.context, self.count = context, 0

    def _guard(self, fn):
        if self.broken:
            raise CannotCheck(f"distributed save: the process group is broken ({self.broken})")
        try:
            return fn()
        except CkptArchiveError:
            raise
        except Exception as exc:  # gloo: a peer died (connection closed) or the timeout passed
            self.broken = f"{type(exc).__name__}: {exc}"
            raise CannotCheck(f"distributed save: a rank stopped answering ({self.broken}); the generation "
                              f"stays partial, `ckpt-archive gc` removes it") from None

    def all_gather(self, obj: Any) -> list:
        import torch
        import torch.distributed as dist

        self.count += 1
        label = [self.context, self.count]

        def run():
            data = json.dumps({"label": label, "v": obj}, allow_nan=False, separators=(",", ":")).encode("utf-8")
            n = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(sizes, n, group=self.group)
            most = max(int(s.item()) for s in sizes)
            buf = torch.zeros(max(most, 1), dtype=torch.uint8)
            if data:
                buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            outs = [torch.zeros(max(most, 1), dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(outs, buf, group=self.group)
            return [json.loads(bytes(o[:int(s.item())].numpy()).decode("utf-8")) for o, s in zip(outs, sizes)]

        got = self._guard(run)
        labels = [g.get("label") if isinstance(g, dict) else None for g in got]
        if any(lb != label for lb in labels):
            self.broken = ("the ranks are out of step: " +
                           ", ".join(f"rank {r} at {lb[0]} exchange {lb[1]}" if lb else f"rank {r} unlabelled"
                                     for r, lb in enumerate(labels)))
            raise CannotCheck(f"distributed save: {self.broken}; nothing is published from here on (every rank "
                              f"must call save/wait/restore/close the same number of times, in the same order); "
                              f"restart the job from the last usable generation")
        return [g["v"] for g in got]

    def from_rank0(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (an all-gather keeps one code path; the payloads are small)."""
        return self.all_gather(obj if self.rank == 0 else None)[0]

    def barrier(self) -> None:
        self.all_gather(None)


class DistributedWriter:
    """The many-process half of :class:`~ckpt_archive.training.checkpointer.Checkpointer` (construct on
    every rank, in the same order as every other collective).

    Args:
        repo: repository path/URL or Repository, the same on every rank (shared filesystem / object store).
        process_group: the ranks that save together (None: the default group).
        timeout: seconds any exchange may wait for the other ranks.

    Raises:
        CannotCheck: rank 0 could not open or create the repository (every rank raises).
    """

    def __init__(self, repo, process_group=None, *, timeout: float = 600.0):
        import torch.distributed as dist

        from ckpt_archive.ops.common import open_repo

        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.comm = _Comm(group, self.rank, self.world)
        self.group = group
        err = None
        if self.rank == 0:
            try:
                self.repo = open_repo(repo, create=True)
            except CkptArchiveError as exc:
                err = str(exc)
        err = self.comm.from_rank0(err)
        if err:
            raise CannotCheck(f"rank 0 could not open the repository: {err}")
        if self.rank != 0:
            self.repo = open_repo(repo)

    # -- background ----------------------------------------------------------------------------------------
    def write(self, snap: Any, options, notes, retention, shards: "ShardNotes | None" = None,
              intact: "Callable[[], str | None] | None" = None, *, seq: int = 0, step: Any = None):
        """Write this rank's part of one generation; rank 0 publishes it (see the module docstring).

        Args:
            snap: this rank's snapshot. options, notes, retention: as :func:`~ckpt_archive.ops.pack.pack`.
            shards: the layouts of the DTensors whose local shards ``snap`` holds (taken with the snapshot).
            intact: called once this rank has read ``snap`` for the last time (members written), before
                its trial-reload result is sent: a reason (str) why the snapshot may not be what was copied
                (its buffers changed hands), or None. A reason fails the generation on every rank.
            seq: which save call of this rank's Checkpointer this is (the K of the ``"save #K"`` exchanges;
                every rank's call K must be the same save). step: its step; every rank must save the same.

        Returns:
            a :class:`~ckpt_archive.ops.pack.PackResult` (on ranks other than 0: ``retention`` None,
            ``trial_reload`` this rank's counts).

        Raises:
            IntegrityError: a rank's trial reload failed. CannotCheck: another rank failed (names it and
            its message), had nothing to save for this call (:meth:`skip`), saved another step, or stopped
            answering. The errors of pack (SourceError, StoreError, LockError).
        """
        from ckpt_archive.ops.pack import _prepare

        self.comm.begin(f"save #{seq}")

        enc_holder: dict = {}

        by_id = shards.by_id if shards is not None else {}

        def encoder(state):
            enc = _ShardAwareEncoder(by_id)
            tree = enc.enc(state, ())
            enc.finish_tensors()
            enc_holder["enc"] = enc
            return tree, enc.table

        plan = None
        try:
            prep = _prepare(snap, options, notes, retention, encoder=encoder)
            fps = _fingerprints(prep.encoded[1], enc_holder["enc"].shard_of)
            mine = {"ok": True, "fingerprints": fps, "step": step}
        except Exception as exc:  # noqa: BLE001 - sent, so that every rank stops here, not at a timeout
            prep, mine = None, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "step": step}
        everyone = self.comm.all_gather(mine)  # (1)
        failed = [(r, x["error"]) for r, x in enumerate(everyone) if not x["ok"]]
        if failed:
            if not mine["ok"]:
                raise CannotCheck(f"rank {self.rank} could not prepare its state: {mine['error']}")
            raise CannotCheck(f"distributed save of step {step} refused by rank {failed[0][0]}: {failed[0][1]}")
        steps = [x.get("step") for x in everyone]
        if any(s != step for s in steps):
            raise CannotCheck(f"distributed save #{seq}: the ranks saved different steps ("
                              + ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
                              + "); nothing is published for it: every rank must save the same step")
        plan = _Plan(self.rank, self.world, prep, enc_holder["enc"].shard_of,
                     assign_writers([x["fingerprints"] for x in everyone]))
        if self.rank == 0:
            return _publish_rank0(self, plan, options, retention, intact)
        return _follow(self, plan, options, intact)

    def skip(self, seq: int, step: Any, why: str) -> None:
        """Take part in save call ``seq``'s exchanges with nothing to save (this rank's ``save`` raised before
        its copy was handed over): the others' save of that call stops at its first exchange, on every rank,
        and nothing is published for it.

        Raises:
            CannotCheck: the group is broken or out of step.
        """
        self.comm.begin(f"save #{seq}")
        self.comm.all_gather({"ok": False, "step": step,
                              "error": f"its save of step {step} handed no copy over ({why}), so no rank publishes "
                                       f"that step"})  # (1)

    def restore(self, generation, **kwargs):
        """Restore this rank's part (see :func:`ckpt_archive.training.dist_restore.restore_distributed`)."""
        from ckpt_archive.training.dist_restore import restore_distributed

        self.comm.begin("restore")  # (no count: a restore interrupted before its exchange is retried as the same)
        return restore_distributed(self, generation, **kwargs)

    def close(self) -> None:
        import torch.distributed as dist

        if self.comm.broken is None and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - the group may already be gone with the default one
                pass


class ShardNotes:
    """The layouts of the DTensors one snapshot holds the local shards of (one per save: the save owns it).

    :meth:`add` is the Snapshotter's ``on_dtensor``; ``by_id`` maps ``id(local shard copy)`` to
    ``{"shape", "dtype", "offsets", "sizes"}`` (the copies are kept alive here, so ids stay unique until the
    save is written).
    """

    def __init__(self):
        self.by_id: dict[int, dict] = {}
        self._keep: list = []

    def add(self, local_copy, dtensor) -> None:
        """Record a DTensor's layout for its local shard's copy.

        Raises:
            CannotCheck: a DTensor with several local chunks (uneven/strided sharding).
        """
        chunks = dtensor.__create_chunk_list__()
        if len(chunks) != 1:
            raise CannotCheck(f"a DTensor with {len(chunks)} local chunks is not supported (uneven/strided "
                              f"sharding); placements {dtensor.placements}")
        self._keep.append(local_copy)
        self.by_id[id(local_copy)] = {"shape": [int(x) for x in dtensor.shape],
                                      "dtype": str(dtensor.dtype).replace("torch.", ""),
                                      "offsets": [int(x) for x in chunks[0].offsets],
                                      "sizes": [int(x) for x in chunks[0].sizes]}


def _fingerprints(table, shard_of: dict) -> dict:
    by_entry: dict[str, dict] = {}
    for leaf, rec in table.leaves.items():
        rec = dict(rec)
        if leaf in shard_of:
            rec["shard"] = shard_of[leaf]
        by_entry.setdefault(rec["entry"], {})[leaf] = rec
    out = {}
    for key, entry in table.entries.items():
        data = entry.source()
        out[key] = {"sha256": hashlib.sha256(data).hexdigest(), "nbytes": int(entry.nbytes),
                    "leaves": by_entry.get(key, {})}
    return out


class _Plan:
    """This rank's share: the entries it writes (renamed) and its tree (pointing at the writers' keys)."""

    def __init__(self, rank: int, world: int, prep, shard_of: dict, writers: dict):
        from ckpt_archive.format.state_tree import Entry, TensorTable

        self.rank, self.world, self.prep = rank, world, prep
        tree, table = prep.encoded
        leaf_map: dict[str, str] = {}
        own = TensorTable(warnings=list(table.warnings))
        for leaf, rec in table.leaves.items():
            writer = writers[(rank, rec["entry"])]
            leaf_map[leaf] = rank_prefix(writer) + leaf
            if writer == rank:
                own.leaves[rank_prefix(rank) + leaf] = {**rec, "entry": rank_prefix(rank) + rec["entry"]}
                if leaf in table.leaf_bytes:
                    own.leaf_bytes[rank_prefix(rank) + leaf] = table.leaf_bytes[leaf]
        for key, e in table.entries.items():
            if writers[(rank, key)] == rank:
                k = rank_prefix(rank) + key
                own.entries[k] = Entry(k, e.st_dtype, e.shape, e.source, e.nbytes)
        self.table = own
        self.tree = _rewrite_refs(tree, leaf_map)
        # sharded leaves: leaf path -> this rank's piece (key of its writer)
        self.shards = {leaf: {**meta, "key": leaf_map[leaf]} for leaf, meta in shard_of.items()}
        self.written: dict = {}

    def write(self, repo, number: int, options) -> dict:
        from ckpt_archive.format.codec import DEFAULT_CHUNK_BYTES, DEFAULT_LEVEL
        from ckpt_archive.repo.repository import gen_key
        from ckpt_archive.repo.writer import write_tensor_members

        members, tensors = write_tensor_members(
            repo.store, gen_key(number), self.table, prefix=rank_prefix(self.rank),
            level=options.level or DEFAULT_LEVEL, jobs=options.jobs,
            chunk_bytes=options.chunk_bytes or DEFAULT_CHUNK_BYTES, faults=repo.faults)
        self.written = {"members": members, "tensors": tensors}
        return {"ok": True, "members": members, "tensors": tensors, "tree": self.tree, "shards": self.shards,
                "warnings": list(self.table.warnings)}


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


def reload_own(repo, number: int, manifest: dict, rank: int, jobs) -> tuple[list, dict]:
    """Trial-reload the members rank ``rank`` wrote (and the tree, every reference resolved).

    Returns:
        ``(problems as JSON, counts)``.
    """
    from ckpt_archive.repo.reader import ArchiveReader
    from ckpt_archive.repo.repository import gen_key
    from ckpt_archive.repo.trial_reload import trial_reload

    pre = rank_prefix(rank)
    mine = [m for m in manifest["members"] if m["path"].startswith(pre) or m["path"] == manifest["tree_member"]]
    sub = {**manifest, "members": mine}
    reader = ArchiveReader(repo.store, gen_key(number), sub, jobs=jobs)
    problems: list = []
    reader.check_stored(problems, hash_files=False)
    counts = trial_reload(reader, problems) if not problems else {"tensors": 0, "bytes": 0, "members": len(mine)}
    counts["members"] = len([m for m in mine if m["path"].startswith(pre)])
    return [p.to_json() for p in problems], counts


def _follow(w: DistributedWriter, plan: _Plan, options, intact=None):
    """A rank other than 0: the same exchanges, in the same order, as :func:`_publish_rank0`."""
    from ckpt_archive.ops.pack import PackResult
    from ckpt_archive.repo.repository import gen_key

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
        problems, counts = reload_own(w.repo, number, manifest, w.rank, options.jobs)
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


from ckpt_archive.training.dist_publish import _publish_rank0  # noqa: E402  (rank 0's half, split for length)

__all__ = ["DistributedWriter", "ShardNotes", "assign_writers", "combined_tree", "is_distributed_tree", "reload_own",
           "rank_prefix", "DIST_KEY"]
