"""Progress in a checkpoint: the keys that mean step, epoch and data cursor, and where they are found.

One table for every reader: ``pack`` (the manifest's ``progress``) and the policy audit (the counters
it compares with the optimizer and scheduler) name the same keys. The first key of a list that holds
a usable value wins, so the more specific names come first and the plurals (``steps``, ``epochs``),
which some trainers use for a total, last.
"""
from __future__ import annotations

from typing import Any

#: Keys that hold the number of optimizer updates done.
STEP_KEYS = ("step", "global_step", "iteration", "iter", "num_updates", "update", "optimizer_step", "steps")
#: Keys that hold the epoch index.
EPOCH_KEYS = ("epoch", "current_epoch", "epochs")
#: Keys that hold the position in the epoch's sample order.
CURSOR_KEYS = ("cursor", "data_cursor", "batch_idx", "sample_idx", "position")
#: Sub-dicts of a checkpoint that :func:`find_progress` also looks into, after the top level.
PROGRESS_PLACES = ("progress", "trainer_state", "data", "sampler", "loader")


def find_progress(state: Any) -> dict:
    """Progress (step / epoch / cursor) found at conventional places of a checkpoint dict.

    Looks at the top level, then at the :data:`PROGRESS_PLACES` sub-dicts, for the keys of
    :data:`STEP_KEYS`, :data:`EPOCH_KEYS` and :data:`CURSOR_KEYS`. Only ints (also one-element
    integer tensors) are taken, and a float epoch.

    Args:
        state: a nested checkpoint; anything but a dict gives ``{}``.

    Returns:
        ``{"step": int, "epoch": int | float, "cursor": int}`` with the fields not found left out.

    Example:
        >>> find_progress({"global_step": 40, "progress": {"epoch": 2}})
        {'step': 40, 'epoch': 2}
    """
    found: dict = {}
    if not isinstance(state, dict):
        return found
    places = [state] + [state[k] for k in PROGRESS_PLACES if isinstance(state.get(k), dict)]
    for place in places:
        for names, field in ((STEP_KEYS, "step"), (EPOCH_KEYS, "epoch"), (CURSOR_KEYS, "cursor")):
            if field in found:
                continue
            for name in names:
                v = place.get(name)
                if isinstance(v, bool):
                    continue
                if isinstance(v, int) or (field == "epoch" and isinstance(v, float)):
                    found[field] = v
                    break
                if hasattr(v, "numel") and getattr(v, "numel")() == 1 and not v.is_floating_point():
                    found[field] = int(v.item())
                    break
    return found
