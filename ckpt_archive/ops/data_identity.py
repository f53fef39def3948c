"""Data identity: the archived data ids against the resuming session's.

A run's *data identity* is what its sample ids mean: a label map (``{"cat": 0, "person": 3}``), a
tokenizer or dataset fingerprint, a list of file names. It is packed with ``--data-ids`` (member
``data-ids.json``). A resumed run that rebuilt its label map in another order (set iteration order changes
between interpreter runs) or uses another tokenizer trains on the right tensors with the wrong meaning;
nothing crashes. :func:`compare_data_ids` names each difference; :func:`check_data_ids` reads the
archived ids of a generation and refuses (:class:`DataIdentityMismatch`, exit 1) unless told otherwise.

The comparison is key-order-insensitive: two maps with the same entries in another order are the same
identity, and so is their fingerprint (:func:`canonical_bytes`: JSON with sorted keys). Lists stay
ordered (a list's order is its meaning).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from ckpt_archive.errors import CheckFailed, IntegrityError
from ckpt_archive.format.data_ids import _plain, canonical_bytes, fingerprint

#: At most this many changed/added/removed entries are listed in a message (all are counted).
MAX_LISTED = 10


class DataIdentityMismatch(CheckFailed):
    """The resuming session's data ids differ from the archived ones (exit 1)."""


@dataclasses.dataclass
class DataIdsDiff:
    """What differs between archived and session data ids (:func:`compare_data_ids`).

    Attributes:
        changed: ``(key, archived, session)`` for keys of both maps whose values differ.
        added: keys only the session has (with its value).
        removed: keys only the archive has (with its value).
        other: one line when the ids are not both maps (two lists, or a map and a list) and differ.
    """

    changed: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)
    added: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    removed: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    other: str | None = None

    @property
    def same(self) -> bool:
        """True when the identities are equal (key order aside)."""
        return not (self.changed or self.added or self.removed or self.other)

    def lines(self) -> list[str]:
        """One line per difference (``person: archived 3, now 1``), at most :data:`MAX_LISTED` of each kind."""
        out: list[str] = []
        for k, a, s in self.changed[:MAX_LISTED]:
            out.append(f"{k}: archived {_short(a)}, now {_short(s)}")
        if len(self.changed) > MAX_LISTED:
            out.append(f"... and {len(self.changed) - MAX_LISTED} more changed")
        for k, s in self.added[:MAX_LISTED]:
            out.append(f"{k}: added (now {_short(s)}, not in the archive)")
        if len(self.added) > MAX_LISTED:
            out.append(f"... and {len(self.added) - MAX_LISTED} more added")
        for k, a in self.removed[:MAX_LISTED]:
            out.append(f"{k}: removed (archived {_short(a)}, not in this session)")
        if len(self.removed) > MAX_LISTED:
            out.append(f"... and {len(self.removed) - MAX_LISTED} more removed")
        if self.other:
            out.append(self.other)
        return out

    def summary(self) -> str:
        """``3 changed, 1 added, 0 removed`` (or the ``other`` line)."""
        if self.other and not (self.changed or self.added or self.removed):
            return self.other
        return f"{len(self.changed)} changed, {len(self.added)} added, {len(self.removed)} removed"

    def to_json(self) -> dict:
        """Strict JSON: ``same``, ``changed`` [{key, archived, session}], ``added``, ``removed``, ``other``."""
        return {"same": self.same,
                "changed": [{"key": k, "archived": a, "session": s} for k, a, s in self.changed],
                "added": [{"key": k, "session": s} for k, s in self.added],
                "removed": [{"key": k, "archived": a} for k, a in self.removed],
                "other": self.other}


def _short(v: Any) -> str:
    s = json.dumps(v, ensure_ascii=False, sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def compare_data_ids(archived: Any, session: Any) -> DataIdsDiff:
    """Compare archived and session data ids, key order aside.

    Maps are compared entry by entry (nested maps by their canonical JSON); lists element by element
    (order matters: position is the id); anything else by value.

    Args:
        archived: the ids packed with the generation (any strict-JSON value).
        session: the resuming session's ids.

    Returns:
        :class:`DataIdsDiff` (``same`` when equal).
    """
    a, s = _plain(archived), _plain(session)
    diff = DataIdsDiff()
    if isinstance(a, dict) and isinstance(s, dict):
        for k in sorted(set(a) | set(s)):
            if k not in s:
                diff.removed.append((k, a[k]))
            elif k not in a:
                diff.added.append((k, s[k]))
            elif canonical_bytes(a[k]) != canonical_bytes(s[k]):
                diff.changed.append((k, a[k], s[k]))
        return diff
    if isinstance(a, list) and isinstance(s, list):
        for i in range(max(len(a), len(s))):
            if i >= len(s):
                diff.removed.append((f"[{i}]", a[i]))
            elif i >= len(a):
                diff.added.append((f"[{i}]", s[i]))
            elif canonical_bytes(a[i]) != canonical_bytes(s[i]):
                diff.changed.append((f"[{i}]", a[i], s[i]))
        return diff
    if canonical_bytes(a) != canonical_bytes(s):
        diff.other = f"archived {type(a).__name__} {_short(a)}, now {type(s).__name__} {_short(s)}"
    return diff


def archived_data_ids(repo: Any, generation: str | int = "latest") -> tuple[Any, dict | None, int]:
    """The data ids packed with a generation (member checked while read).

    Returns:
        ``(ids or None, the manifest's data section or None, generation number)``.

    Raises:
        IntegrityError (exit 1) / NotFound (exit 2): as reading any member.
    """
    from ckpt_archive.format.jsonio import loads
    from ckpt_archive.format.limits import MAX_DATA_IDS_BYTES, MAX_DATA_IDS_COST
    from ckpt_archive.ops.common import note_damage, open_repo, pick
    from ckpt_archive.repo.reader import ArchiveReader, Problem

    r = open_repo(repo)
    gen = pick(r, generation, False)
    data = gen.manifest.get("data") or None
    if not data or not data.get("ids_member"):
        return None, data, gen.number
    reader = ArchiveReader(r.store, gen.key, gen.manifest)
    try:
        raw = reader.read_member_bytes(data["ids_member"], limit=MAX_DATA_IDS_BYTES)  # refused unread when larger
        return loads(raw, where=data["ids_member"], max_bytes=MAX_DATA_IDS_BYTES, max_cost=MAX_DATA_IDS_COST), \
            data, gen.number
    except ValueError as exc:  # the member passed its fingerprints: what it holds is damaged, not the input
        err = IntegrityError(f"data ids are not valid JSON ({getattr(exc, 'message', exc)})", where=data["ids_member"])
    except CheckFailed as exc:
        err = exc
    note_damage(r, gen, [Problem.of(err, member=data["ids_member"])], by="restore --data-ids")  # issue 24
    raise err


def check_data_ids(repo: Any, generation: str | int, session_ids: Any, *, allow_change: bool = False
                   ) -> dict:
    """Compare a generation's archived data ids with the session's; refuse a difference.

    Args:
        repo: repository location or Repository.
        generation: ``"latest"``, a number or a tag.
        session_ids: the resuming session's ids (a value, or a JSON/YAML/TOML/.txt path).
        allow_change: report a difference instead of raising.

    Returns:
        ``{"checked": bool, "same": bool|None, "diff": {...}|None, "fingerprint": {"archived", "session"},
        "warning": str|None}``; ``checked`` False (with a warning) when the archive holds no data ids.

    Raises:
        DataIdentityMismatch (exit 1): the ids differ and ``allow_change`` is False; the message lists the
            changed, added and removed entries.
    """
    from ckpt_archive.ops.meta import value_or_file

    session = value_or_file(session_ids, what="data-ids file")
    archived, data, number = archived_data_ids(repo, generation)
    out: dict = {"checked": False, "same": None, "diff": None,
                 "fingerprint": {"archived": None, "session": fingerprint(session)}, "warning": None}
    if archived is None:
        out["warning"] = (f"generation {number} holds no data ids (packed without --data-ids): the session's "
                          f"data identity could not be compared")
        return out
    out["fingerprint"]["archived"] = fingerprint(archived)
    diff = compare_data_ids(archived, session)
    out.update(checked=True, same=diff.same, diff=diff.to_json())
    if not diff.same:
        text = "; ".join(diff.lines())
        msg = (f"the session's data ids differ from those archived with generation {number} "
               f"({diff.summary()}): {text}")
        if not allow_change:
            raise DataIdentityMismatch(msg, hint="the resumed run would read its sample ids with another meaning; "
                                                 "fix the data pipeline, or pass --allow-data-change "
                                                 "(allow_data_change=True) if the change is intended")
        out["warning"] = msg + " (allowed with --allow-data-change)"
    return out


__all__ = ["DataIdentityMismatch", "DataIdsDiff", "archived_data_ids", "canonical_bytes", "check_data_ids",
           "compare_data_ids", "fingerprint"]
