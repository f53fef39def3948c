"""The trial reload: decode every member of a generation and rebuild every tensor, one at a time.

This is what makes a generation *usable* (docs/FORMAT.md, "Write order" step 5): every chunk decoded,
every tensor rebuilt with its dtype and shape and its raw sha256 compared with the manifest, the
state tree rebuilt and every tensor reference resolved. Run by pack and export before the marker is
written, and by ``verify --deep``.
"""
from __future__ import annotations

import hashlib

from ckpt_archive.errors import CkptArchiveError, StoreError
from ckpt_archive.format.state_tree import decode
from ckpt_archive.repo.reader import ArchiveReader, Problem, check_leaf, entry_tensor, leaf_from_base, tensor_refs


def trial_reload(reader: ArchiveReader, problems: list[Problem], on_bytes=None) -> dict:
    """Decode every member of the generation ``reader`` reads; rebuild every tensor one at a time and
    check raw sha256, dtype, shape; rebuild the tree and resolve every tensor reference.

    Args:
        reader: the generation's :class:`~ckpt_archive.repo.reader.ArchiveReader` (over the store where
            the check must hold: the repository itself, or an export's destination).
        problems: what is wrong is appended here (each naming the member and/or tensor).
        on_bytes: progress callback (raw bytes decoded).

    Returns:
        counts: ``tensors`` checked, ``bytes`` decoded, ``members``.
    """
    tensors = reader.manifest["tensors"]
    by_entry: dict[str, list[str]] = {}
    for leaf, rec in tensors.items():
        by_entry.setdefault(rec["entry"], []).append(leaf)
    checked = 0
    decoded = 0
    for rec in reader.manifest["members"]:
        if rec["role"] == "tensors":
            # [codec/benchmarks helper] Fast path: the member's raw sha256 (checked by iter_member
            # at its end) covers every entry's bytes, so entries are not hashed one by one. Only
            # when that check fails is the member re-read entry by entry (below) to name the
            # tensor(s) at fault.
            fast: list[Problem] = []
            fast_checked = fast_decoded = 0
            try:
                for key, erec, buf in reader.iter_entries(rec, on_bytes=on_bytes, transient=True):
                    fast_decoded += len(buf)
                    fast_checked += _check_entry_leaves(reader, rec, erec, buf, by_entry.get(key, []),
                                                             erec.get("raw_sha256"), fast)
            except StoreError:
                raise  # the store failed (unreachable, refusing): could not check (exit 2), not a finding
            except CkptArchiveError as exc:
                if exc.message.startswith("raw sha256 mismatch"):
                    fast = None  # fall through to the entry-by-entry pass
                else:
                    fast.append(Problem(exc.message, member=exc.where or rec["path"]))
            if fast is not None:
                problems.extend(fast)
                checked += fast_checked
                decoded += fast_decoded
                continue
        try:
            if rec["role"] == "tensors":
                for key, erec, buf in reader.iter_entries(rec, on_bytes=on_bytes):
                    decoded += len(buf)
                    got = hashlib.sha256(buf).hexdigest()
                    if got != erec.get("raw_sha256"):
                        problems.append(Problem(f"tensor bytes sha256 mismatch: expected {erec.get('raw_sha256')}, "
                                                f"got {got}", member=rec["path"], field=f"tensors/{key}"))
                        continue
                    checked += _check_entry_leaves(reader, rec, erec, buf, by_entry.get(key, []), got, problems)
            else:
                for _, chunk in reader.iter_member(rec, on_bytes=on_bytes):
                    decoded += len(chunk)
        except StoreError:
            raise
        except CkptArchiveError as exc:
            problems.append(Problem(exc.message, member=exc.where or rec["path"]))
    try:
        tree = reader.tree()
        missing = [k for k in tensor_refs(tree) if k not in tensors]
        if missing:
            problems.append(Problem(f"state tree references {len(missing)} tensor(s) not in the manifest: "
                                    f"{', '.join(missing[:5])}", member=reader.manifest["tree_member"]))
        decode(tree, lambda k: None, objects="check")
        from ckpt_archive.format.exact_bytes import exact_problems  # [issue 11]

        problems.extend(Problem(p, field="source.files") for p in exact_problems(reader.manifest))
    except StoreError:
        raise
    except CkptArchiveError as exc:
        problems.append(Problem(exc.message, member=reader.manifest["tree_member"]))
    return {"tensors": checked, "bytes": decoded, "members": len(reader.manifest["members"])}

def _check_entry_leaves(reader, rec: dict, erec: dict, buf, leaves: list[str], entry_sha: str | None,
                        problems: list[Problem]) -> int:
    """Rebuild each tree leaf stored in one entry and check its dtype, shape and raw sha256.

    ``entry_sha`` is the entry's raw sha256, already known to hold for ``buf`` (hashed, or covered by
    the member's raw sha256): a leaf that is the entry itself is not hashed again. Returns the number
    of leaves that passed; appends a Problem per leaf that did not.
    """
    tensors = reader.manifest["tensors"]
    base = None
    passed = 0
    for leaf in leaves:
        lrec = tensors[leaf]
        try:
            if base is None:
                base = entry_tensor(buf, erec, lrec)
            t = leaf_from_base(base, lrec)
            check_leaf(t, lrec, leaf, known_sha=None if lrec.get("view") else entry_sha)
            passed += 1
        except CkptArchiveError as exc:
            problems.append(Problem(exc.message, member=rec["path"], field=f"tensors/{leaf}"))
    return passed

