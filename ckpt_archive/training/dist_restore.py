"""Reading a generation written by several ranks: one rank's view, resharded to the live layout, or the
whole state consolidated on one process (docs/checkpointer.md, "Restore and resharding").

A rank's **view** is the state it saved: its tree (``ranks[r]``), where each sharded leaf (a DTensor's local
shard) is replaced by the tensor the *target* needs:

* a live DTensor at the same place (the ``get_state_dict`` of the live model/optimizer): its local chunk,
  cut from the saved pieces that overlap it, wrapped with the live mesh and placements. Any saved
  sharding -> any live sharding, any world size (each rank reads only the pieces its chunk overlaps);
* no live DTensor there (one process, a DDP model, no model given): the full tensor, assembled.

Values saved per rank (RNG states, anything not sharded) come from the same rank when it existed; a rank
beyond the saved world size takes saved rank 0's and the report says so (not bitwise-resumable then).
"""
from __future__ import annotations

import math
from typing import Any

from ckpt_archive.errors import AllGenerationsDamaged, IntegrityError, NoUsableGeneration
from ckpt_archive.ops.dist_pack import is_distributed_tree


def _leaf_of(key: str) -> str:
    return key.split("/", 1)[1] if key.startswith("rank") and "/" in key else key


def _refs(tree) -> list[str]:
    from ckpt_archive.format.tree_walk import walk_refs

    return list(walk_refs(tree))


def assemble(rec: dict, pieces: dict, offsets: list[int], sizes: list[int]):
    """The box ``[offsets, offsets + sizes)`` of a sharded tensor, cut from the saved pieces.

    Args:
        rec: the tree's ``sharded[leaf]`` record (shape, dtype, pieces with key/offsets/sizes).
        pieces: piece key -> loaded tensor. offsets, sizes: the box wanted.

    Returns:
        a tensor of shape ``sizes``.

    Raises:
        IntegrityError: the pieces do not cover the box (an incomplete generation), or a piece has another shape.
    """
    import torch

    from ckpt_archive.format.tensor_bytes import torch_dtype

    out = torch.empty(sizes, dtype=torch_dtype(rec["dtype"]), device="cpu")
    covered = torch.zeros(sizes, dtype=torch.bool, device="cpu")
    for p in rec["pieces"]:
        lo = [max(a, b) for a, b in zip(offsets, p["offsets"])]
        hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, p["offsets"], p["sizes"])]
        if any(lo_i >= hi_i for lo_i, hi_i in zip(lo, hi)) and sizes:
            continue
        t = pieces.get(p["key"])
        if t is None:
            continue
        if list(t.shape) != list(p["sizes"]):
            raise IntegrityError(f"piece {p['key']} has shape {list(t.shape)}, the tree says {p['sizes']}")
        src = tuple(slice(a - b, c - b) for a, b, c in zip(lo, p["offsets"], hi))
        dst = tuple(slice(a - b, c - b) for a, b, c in zip(lo, offsets, hi))
        out[dst] = t[src]
        covered[dst] = True
    if not bool(covered.all()):
        raise IntegrityError(f"the saved pieces cover {int(covered.sum())} of {math.prod(sizes)} elements of the "
                             f"part wanted (offsets {offsets}, sizes {sizes}): the generation is incomplete")
    return out


def _replace(obj: Any, by_id: dict) -> Any:
    import collections

    if id(obj) in by_id:
        return by_id[id(obj)]
    if isinstance(obj, collections.OrderedDict):
        new = collections.OrderedDict((k, _replace(v, by_id)) for k, v in obj.items())
        for name, val in vars(obj).items():
            setattr(new, name, val)
        return new
    if isinstance(obj, dict):
        return {k: _replace(v, by_id) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace(v, by_id) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replace(v, by_id) for v in obj)
    return obj


def template_dtensors(template: dict) -> dict:
    """Leaf path (as the archive names it) -> live DTensor, for every DTensor in ``template``."""
    from torch.distributed.tensor import DTensor

    out: dict = {}
    stack = [((), template)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, DTensor):
            out["/".join(str(p) for p in path)] = node
        elif isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((path + (i,), v) for i, v in enumerate(node))
    return out


def load_view(reader, tree: dict, rank: int, live: dict | None = None) -> Any:
    """Rank ``rank``'s saved state, sharded leaves replaced as the module docstring says.

    Args:
        reader: the generation's ArchiveReader. tree: its (distributed) tree.
        rank: the saved rank whose view to load. live: leaf path -> live DTensor (from :func:`template_dtensors`).

    Returns:
        the state.

    Raises:
        IntegrityError: any check of the read, or pieces that do not cover what is wanted.
    """
    live = live or {}
    view = tree["ranks"][rank]
    sharded = tree.get("sharded") or {}
    wanted: dict[str, tuple] = {}
    for key in _refs(view):
        leaf = _leaf_of(key)
        if leaf not in sharded:
            continue
        t = live.get(leaf)
        if t is not None:
            chunk = t.__create_chunk_list__()[0]
            wanted[key] = (leaf, [int(x) for x in chunk.offsets], [int(x) for x in chunk.sizes], t)
        else:
            wanted[key] = (leaf, [0] * len(sharded[leaf]["shape"]), list(sharded[leaf]["shape"]), None)
    need = set(wanted)
    for key, (leaf, off, size, _) in wanted.items():
        for p in sharded[leaf]["pieces"]:
            if all(a < c + d and c < a + b for a, b, c, d in zip(off, size, p["offsets"], p["sizes"])):
                need.add(p["key"])
    got = reader.load_node({"view": view, "pieces": {k: {"$t": "tensor", "key": k} for k in sorted(need)}})
    pieces = got["pieces"]
    by_id = {}
    for key, (leaf, off, size, t) in wanted.items():
        part = assemble(sharded[leaf], pieces, off, size)
        if t is not None:
            from torch.distributed.tensor import DTensor

            part = DTensor.from_local(part.to(t.device), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        by_id[id(pieces[key])] = part
    return _replace(got["view"], by_id)


def load_consolidated(repo, generation: str | int = "latest", *, rank: int = 0, jobs: int | None = None) -> Any:
    """The state a distributed save wrote, on one process: every sharded tensor assembled in full, the
    per-rank values of saved rank ``rank``. A generation written by one process loads as ``load`` does.

    Args:
        repo: repository path/URL or Repository. generation: ``"latest"``, a number or ``"tag:NAME"``.
        rank: whose per-rank values (RNG states). jobs: decoder threads.

    Returns:
        the state (what rank ``rank`` saved, with full tensors where it held shards).

    Raises:
        IntegrityError: a check failed (nothing wrong is returned). NotFound / NoUsableGeneration.
        ValueError: no such saved rank.
    """
    from ckpt_archive.ops.common import open_reader, open_repo, pick

    r = open_repo(repo)
    gen = pick(r, generation)
    reader = open_reader(r, gen, jobs=jobs)
    tree = reader.tree()
    if not is_distributed_tree(tree):
        return reader.load_node(tree)
    if not 0 <= rank < len(tree["ranks"]):
        raise ValueError(f"generation {gen.number} was saved by {len(tree['ranks'])} ranks; no rank {rank}")
    return load_view(reader, tree, rank)


def apply_state(view: Any, *, model=None, optimizer=None, scheduler=None, scaler=None, policy="checkpoint",
                rng=True, session_lr=None, notes: list[str] | None = None):
    """Restore a (distributed-style) state into live objects: model and optimizer through
    ``torch.distributed.checkpoint.state_dict.set_state_dict`` (FQN-keyed, as ``get_state_dict`` saved them;
    DDP/FSDP/plain modules), then scheduler, scaler and RNG through ``restore_training_state``.

    Returns:
        the :class:`~ckpt_archive.training.restore.RestoreReport` (``restored`` lists every part).
    """
    from ckpt_archive.training.parts import find_parts
    from ckpt_archive.training.restore import restore_training_state, session_base_lrs, session_policy_kw
    from ckpt_archive.training.session import impose_lrs

    found = find_parts(view)
    msd = found["model"][0][1] if found.get("model") else None
    osd = found["optimizer"][0][1] if found.get("optimizer") else None
    bases = session_base_lrs(optimizer, session_lr, view, osd) if (policy == "session" and optimizer is not None) else None
    ssd = found["scheduler"][0][1] if found.get("scheduler") else None
    policy_kw = (session_policy_kw(view, {"optimizer": ("optimizer", osd), "scheduler": ("scheduler", ssd)},
                                    scheduler, bases, session_lr) if bases is not None else {})
    done = _set_model_and_optimizer(model, optimizer, msd, osd)
    skip = {id(x) for x in (msd, osd) if x is not None}
    rest = {k: v for k, v in view.items() if id(v) not in skip} if isinstance(view, dict) else view
    report = restore_training_state(rest, scheduler=scheduler, scaler=scaler, rng=rng, policy="checkpoint")
    if bases is not None:
        report.changes = impose_lrs(optimizer.param_groups, scheduler, bases, "optimizer", "scheduler", **policy_kw)
        report.policy = "session"
    if optimizer is not None:
        report.next_lrs = [float(g["lr"]) for g in optimizer.param_groups]
    report.restored[:0] = done
    for part in done:
        report.skipped.pop(part, None)
    for line in notes or []:
        report.warnings.append(line)
        report.bitwise_resumable = False
    return report


def _set_model_and_optimizer(model, optimizer, msd, osd) -> list[str]:
    """Model (and optimizer) state through ``set_state_dict`` (FQN-keyed, DDP/FSDP/plain modules).

    Returns:
        the parts restored (``["model", "optimizer"]``, ``["model"]`` or ``[]``).

    Raises:
        what ``torch.distributed.checkpoint`` raises for a state that does not fit the live objects.
    """
    if model is None or msd is None:
        return []
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is not None and osd is not None:
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        return ["model", "optimizer"]
    set_model_state_dict(model, msd)
    return ["model"]


def _pick_on_rank0(w, generation) -> dict:
    """Rank 0 picks the generation and tells every rank: ``{"number"}``, ``{"none": True}`` (nothing usable
    yet, ``latest``), ``{"damaged"}`` (every published generation found damaged: no fresh start) or ``{"error"}``. Raises CannotCheck when the group is broken."""
    choice = None
    if w.rank == 0:
        try:
            gen = w.repo.resolve(generation)
            choice = {"number": gen.number} if gen.usable else {"error": f"generation {gen.number} is {gen.status}"}
        except AllGenerationsDamaged as exc:  # never a fresh start over them (its for_resume)
            choice = {"damaged": exc.message, "where": exc.where}
        except NoUsableGeneration as exc:
            choice = {"none": True} if str(generation) == "latest" and not w.repo.usable() else {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised everywhere
            choice = {"error": f"{type(exc).__name__}: {exc}"}
    return w.comm.from_rank0(choice)


def _live_dtensors(tree: Any, model, optimizer) -> dict:
    """The live DTensors of ``model`` / ``optimizer`` under the names the saved state uses for its model and
    optimizer parts (``{}`` without a model)."""
    if model is None:
        return {}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpt_archive.training.parts import find_parts

    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    saved_parts = find_parts(tree["ranks"][0]) if is_distributed_tree(tree) else {}
    mname = "/".join(str(s) for s in saved_parts["model"][0][0]) if saved_parts.get("model") else "model"
    oname = "/".join(str(s) for s in saved_parts["optimizer"][0][0]) if saved_parts.get("optimizer") else "optimizer"
    return {**{f"{mname}/{k}": v for k, v in template_dtensors(msd).items()},
            **{f"{oname}/{k}": v for k, v in template_dtensors(osd).items()}}


def restore_distributed(w, generation, *, model=None, optimizer=None, scheduler=None, scaler=None,
                        policy="checkpoint", rng=True, session_lr=None):
    """Every rank restores its part of the same generation (rank 0 picks it and tells the others).

    Returns:
        :class:`~ckpt_archive.training.checkpointer.Restored`, or None on every rank when nothing is usable
        yet and ``generation="latest"``.

    Raises:
        IntegrityError / NotFound / NoUsableGeneration on every rank when rank 0 could not pick the generation;
        IntegrityError when this rank's read fails a check.
    """
    from ckpt_archive.errors import CannotCheck
    from ckpt_archive.ops.common import open_reader
    from ckpt_archive.training.restore import Restored

    choice = _pick_on_rank0(w, generation)
    if choice.get("none"):
        return None
    if "damaged" in choice:
        raise AllGenerationsDamaged(choice["damaged"], where=choice.get("where")).for_resume()
    if "error" in choice:
        raise CannotCheck(f"restore: rank 0 could not pick generation {generation!r}: {choice['error']}")
    gen = w.repo.generation(choice["number"])
    reader = open_reader(w.repo, gen)
    tree = reader.tree()
    notes: list[str] = []
    live = _live_dtensors(tree, model, optimizer)
    if is_distributed_tree(tree):
        saved_world = len(tree["ranks"])
        src = w.rank if w.rank < saved_world else 0
        if saved_world != w.world:
            notes.append(f"generation {gen.number} was saved by {saved_world} ranks and is restored on {w.world}: "
                         f"sharded tensors were resharded exactly; rank {w.rank} took the per-rank values "
                         f"(RNG states) saved by rank {src}")
        view = load_view(reader, tree, src, live)
    else:
        view = reader.load_node(tree)
        if live:
            view = _shard_like(view, live)
        if w.world > 1:
            notes.append(f"generation {gen.number} was saved by one process: every rank restores the same "
                         f"per-rank values (RNG states)")
    report = apply_state(view, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                         policy=policy, rng=rng, session_lr=session_lr, notes=notes)
    return Restored(gen.number, (gen.manifest.get("progress") or {}).get("step"), view, report)


def _shard_like(view: Any, live: dict) -> Any:
    """A one-process state's full tensors cut to the live DTensors' local chunks (same leaf paths)."""
    from torch.distributed.tensor import DTensor

    def walk(node, path):
        name = "/".join(str(p) for p in path)
        t = live.get(name)
        if t is not None and hasattr(node, "shape"):
            chunk = t.__create_chunk_list__()[0]
            sl = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            return DTensor.from_local(node[sl].contiguous().to(t.device), t.device_mesh, t.placements,
                                      run_check=False, shape=t.shape, stride=t.stride())
        if isinstance(node, dict):
            return type(node)((k, walk(v, path + (k,))) for k, v in node.items()) if type(node) is not dict \
                else {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, path + (i,)) for i, v in enumerate(node)]
        return node

    return walk(view, ())


__all__ = ["load_consolidated", "load_view", "assemble", "apply_state", "restore_distributed", "template_dtensors"]
