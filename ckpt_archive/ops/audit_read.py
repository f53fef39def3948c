"""Reading a generation for the policy audit: the state tree with only its small tensors decoded.

The audit needs the structure of the state, the LRs and the optimizer's ``step`` counters, never the
weights. :func:`state_for_audit` reads the state tree member and decodes only tensors of at most
:data:`SMALL_TENSOR_ELEMENTS` elements, from the smallest members first, within a byte budget; every
other tensor is a :class:`~ckpt_archive.format.tensor_stub.TensorStub`. The analysis itself is pure and
lives in :mod:`ckpt_archive.training`.
"""
from __future__ import annotations

import math
from typing import Any

from ckpt_archive.format.tensor_stub import TensorStub

#: Tensors up to this many elements are decoded for the audit (optimizer ``step`` scalars, tensor LRs).
SMALL_TENSOR_ELEMENTS = 8

#: At most this many raw bytes of tensor members are decoded to reach those small tensors (smallest
#: members first). Step scalars of a large optimizer are spread over its multi-GiB shards: past the
#: budget they stay :class:`TensorStub` and the counters say how many were read.
AUDIT_DECODE_BUDGET = 256 << 20


def state_for_audit(repo: Any, generation: str | int = "latest", *, budget: int = AUDIT_DECODE_BUDGET,
                    info: dict | None = None) -> tuple[Any, dict, int]:
    """The archived state with only small tensors decoded (others are :class:`TensorStub`).

    Reads the state tree member and the tensors of at most :data:`SMALL_TENSOR_ELEMENTS` elements from
    the smallest tensor members whose raw sizes add up to at most ``budget`` bytes (every chunk checked on
    the way). Enough for the policy audit, the completeness lint and the session comparison
    (:mod:`ckpt_archive.training`).

    Args:
        repo: a repository location or :class:`~ckpt_archive.repo.repository.Repository`.
        generation: ``"latest"``, a number, or a tag, as :func:`ckpt_archive.load` takes.
        budget: raw bytes of tensor members that may be decoded.
        info: if given, receives ``small_tensors`` (found), ``small_tensors_decoded`` and ``budget``.

    Returns:
        ``(state, manifest, generation_number)``.

    Raises:
        IntegrityError (exit 1), NotFound / NoUsableGeneration (exit 2): as :func:`ckpt_archive.load`.
    """
    from ckpt_archive.ops.common import open_repo as _repo, pick as _pick
    from ckpt_archive.repo.reader import ArchiveReader
    from ckpt_archive.format.state_tree import decode

    r = _repo(repo)
    gen = _pick(r, generation, False)
    reader = ArchiveReader(r.store, gen.key, gen.manifest)
    tree = reader.tree()
    recs = gen.manifest["tensors"]
    from ckpt_archive.errors import FormatError, MalformedTree
    from ckpt_archive.format.tree_walk import walk_refs

    try:
        refs = list(walk_refs(tree))
    except FormatError as exc:  # a tensor node whose key is not text (it crashed here with TypeError)
        raise MalformedTree(exc.message, where=gen.manifest.get("tree_member")) from None
    small = sorted({k for k in refs if k in recs
                    and math.prod(int(x) for x in recs[k].get("shape", ())) <= SMALL_TENSOR_ELEMENTS})
    by_member: dict[str, list[str]] = {}
    for k in small:
        by_member.setdefault(recs[k]["member"], []).append(k)
    chosen: list[str] = []
    spent = 0
    for member in sorted(by_member, key=lambda m: reader.by_path.get(m, {}).get("raw_bytes", 0)):
        size = int(reader.by_path.get(member, {}).get("raw_bytes", 0))
        if spent + size > budget:
            break
        spent += size
        chosen.extend(by_member[member])
    loaded = _decode_small(reader, tree, chosen, recs) if chosen else {}
    if info is not None:
        info.update(small_tensors=len(small), small_tensors_decoded=len(loaded), budget=budget)

    def get(key: str) -> Any:
        return loaded[key] if key in loaded else TensorStub(recs.get(key, {}))

    return decode(tree, get, where=gen.manifest.get("tree_member")), gen.manifest, gen.number


def _decode_small(reader: Any, tree: Any, keys: list[str], recs: dict) -> dict:
    """[issue 29] The small tensors ``keys`` as :class:`~ckpt_archive.format.tensor_stub.SmallTensor` (values
    as Python numbers: no ``import torch``), with the checks ``load`` runs: every chunk's stored sha256 and
    every entry's raw fingerprint (the member's raw check), each leaf against its entry (dtype, shape, a
    view's bounds and own bytes). NumPy arrays, and the rare tensor read otherwise (float8, conj/neg bits,
    a view of part of its entry, a part of a sparse/quantized tensor or of a storage), are read by
    ``load_node`` as before.

    Raises:
        IntegrityError: a chunk, entry or leaf fails its check (nothing is returned then).
    """
    from ckpt_archive.format.tensor_stub import SmallTensor
    from ckpt_archive.format.tree_walk import iter_nodes, walk_refs
    from ckpt_archive.repo.trial_reload import check_tree_kinds

    check_tree_kinds(tree, recs)
    # the parts of a sparse/quantized tensor or of a storage value: rebuilt for real, as before (torch's
    # rebuild checks the node against them: a hostile node is found here, not only by verify --deep)
    rebuilt = {k for node in iter_nodes(tree) if node.get("$t") in ("rebuild", "storage") for k in walk_refs(node)}
    fast = [k for k in keys if recs[k].get("kind") == "torch" and SmallTensor.readable(recs[k].get("dtype"))
            and not recs[k].get("bits") and not recs[k].get("view") and k not in rebuilt]
    fast_set = set(fast)  # once: a set built per key made this quadratic (20k tensors: 29 s of 37 s in verify)
    slow = [k for k in keys if k not in fast_set]
    out = dict(zip(slow, reader.load_node([{"$t": "ndarray" if recs[k].get("kind") == "numpy" else "tensor",
                                             "key": k} for k in slow]))) if slow else {}
    by_member: dict[str, dict[str, list[str]]] = {}
    for k in fast:
        by_member.setdefault(recs[k]["member"], {}).setdefault(recs[k]["entry"], []).append(k)
    for member, entries in by_member.items():
        out.update(_small_of_member(reader, member, entries, recs))
    return out


def _small_of_member(reader: Any, member: str, entries: dict[str, list[str]], recs: dict) -> dict:
    """The plain small leaves of one tensors member (``entries``: ``{entry key: [leaves]}``) as
    :class:`~ckpt_archive.format.tensor_stub.SmallTensor`, each entry's bytes read once (the member's raw
    check passed: every entry's fingerprint) and every leaf checked against its entry.

    Raises:
        IntegrityError: the member is not a tensors member of the generation, it lacks an entry, or a leaf
            fails its check.
    """
    from ckpt_archive.errors import IntegrityError
    from ckpt_archive.format import fingerprint
    from ckpt_archive.format.tensor_stub import SmallTensor
    from ckpt_archive.repo.trial_reload import check_leaf_bytes

    rec = reader.by_path.get(member)
    if rec is None or rec.get("role") != "tensors":
        raise IntegrityError(f"tensor {entries[next(iter(entries))][0]!r} names member {member!r}, which is not a "
                             f"tensors member of this generation", where="manifest.json")
    got: dict[str, bytearray] = {key: bytearray() for key in entries}  # plain small leaves: small entries
    for key, _, _, piece in reader.iter_entry_pieces(rec, wanted=set(entries)):
        got[key] += piece
    out = {}
    for key, buf in got.items():  # the member's raw check (every entry's fingerprint) has passed
        erec = rec["entries"].get(key)
        if erec is None:
            raise IntegrityError(f"tensor {entries[key][0]!r} names entry {key!r}, which its member does not hold",
                                 where=member)
        for leaf in entries[key]:
            check_leaf_bytes(buf, erec, recs[leaf], leaf, fingerprint.raw_fp(erec))  # a plain leaf: its entry
            out[leaf] = SmallTensor.from_bytes(recs[leaf], buf)
    return out


__all__ = ["SMALL_TENSOR_ELEMENTS", "AUDIT_DECODE_BUDGET", "state_for_audit"]
