"""One rewritten field of a state (:class:`PolicyChange`) and writing a number into a state as its own type.

Shared by the session policy's rewrite (:mod:`.impose`) and the scheduler-specific rules (:mod:`.lr_bases`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ckpt_archive.training.values import as_float, fmt_value, jsonable


@dataclasses.dataclass
class PolicyChange:
    """One field rewritten by :func:`~ckpt_archive.training.impose.apply_session_policy` (``old`` -> ``new``;
    ``note``: why, where the rule is not a plain replacement, e.g. a ReduceLROnPlateau rescale that keeps the
    reductions)."""

    field: str
    old: Any
    new: Any
    note: str = ""

    def to_json(self) -> dict:
        """The fields as strict JSON (``note`` only where there is one)."""
        d = dataclasses.asdict(self)
        if not d["note"]:
            del d["note"]
        return jsonable(d)

    def __str__(self) -> str:
        tail = f" ({self.note})" if self.note else ""
        return f"{self.field}: {fmt_value(self.old)} -> {fmt_value(self.new)}{tail}"


def same_type(template: Any, value: float) -> Any:
    """``value`` as ``template``'s type: a tensor LR stays a tensor of its dtype and device (fused/capturable
    optimizers store ``lr`` as a 0-d tensor), anything else becomes the float."""
    if hasattr(template, "dtype") and hasattr(template, "device") and hasattr(template, "numel"):
        import torch

        return torch.tensor(value, dtype=template.dtype, device=template.device)
    return value


def put(container: Any, key: Any, value: float, field: str, changes: list, note: str = "") -> None:
    """``container[key] = value`` (keeping a tensor a tensor), recorded in ``changes`` when it differs; a field
    changed before keeps its first ``old``."""
    old = as_float(container[key])
    if old is None or old == value:
        return
    container[key] = same_type(container[key], value)
    for c in changes:
        if c.field == field:
            c.new = value
            return
    changes.append(PolicyChange(field, old, value, note))


def replace_change(changes: list[PolicyChange], field: str, old: float, new: float) -> None:
    """Record ``field: old -> new``, merging with an earlier change of the same field (keeps its ``old``; a field
    set back to its old value is no change)."""
    for c in changes:
        if c.field == field:
            c.new = new
            if c.new == c.old:  # rescaled, then set back by the closed form / the group's lr: no change
                changes.remove(c)
            return
    changes.append(PolicyChange(field, old, new))


__all__ = ["PolicyChange", "same_type", "put", "replace_change"]
