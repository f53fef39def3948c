"""Progress in a checkpoint: the keys that mean step, epoch and data cursor, and where they are found.

One table for every reader: ``pack`` (the manifest's ``progress``) and the policy audit (the counters
it compares with the optimizer and scheduler) name the same keys. The first key of a list that holds
a usable value wins, so the more specific names come first and the plurals (``steps``, ``epochs``),
which some trainers use for a total, last.
"""
from __future__ import annotations

from typing import Any

# Trainers covered (issue 11): nanoGPT saves ``iter_num`` (and ``best_val_loss``); timm's CheckpointSaver
# and torchvision's reference scripts ``epoch`` (timm also ``metric``); fairseq
# ``optimizer_history[-1]["num_updates"]`` and ``extra_state["train_iterator"]["epoch"]`` (and
# ``iterations_in_epoch``, a cursor).

#: Keys that hold the number of optimizer updates done.
STEP_KEYS = ("step", "global_step", "iteration", "iter", "iter_num", "num_updates", "update", "optimizer_step",
             "steps")
#: Keys that hold the epoch index.
EPOCH_KEYS = ("epoch", "current_epoch", "epochs")
#: Keys that hold the position in the epoch's sample order.
CURSOR_KEYS = ("cursor", "data_cursor", "batch_idx", "sample_idx", "position", "iterations_in_epoch")
#: Sub-dicts of a checkpoint that :func:`find_progress` also looks into, after the top level (then
#: fairseq's ``extra_state.train_iterator`` and last ``optimizer_history`` entry).
PROGRESS_PLACES = ("progress", "trainer_state", "data", "sampler", "loader", "extra_state")
#: Metrics trainers save next to progress: nanoGPT ``best_val_loss``, timm ``metric`` (the eval metric of
#: that epoch) and ``best_metric``, torchvision classification ``best_acc1`` (older scripts).
METRIC_KEYS = ("best_val_loss", "metric", "best_metric", "best_acc1", "best_loss", "val_loss")


def _places(state: dict) -> list:
    places = [state] + [state[k] for k in PROGRESS_PLACES if isinstance(state.get(k), dict)]
    extra = state.get("extra_state")
    if isinstance(extra, dict) and isinstance(extra.get("train_iterator"), dict):
        places.append(extra["train_iterator"])  # fairseq
    hist = state.get("optimizer_history")
    if isinstance(hist, list) and hist and isinstance(hist[-1], dict):
        places.append(hist[-1])  # fairseq: num_updates of the last optimizer
    return places


def _plain_scalar_tensor(v: Any) -> bool:
    """A dense, strided, non-quantized, non-meta one-element tensor (``.item()`` is safe and meaningful)."""
    return (hasattr(v, "numel") and getattr(v, "is_sparse", False) is False
            and getattr(v, "layout", None) is not None and str(v.layout) == "torch.strided"
            and not v.is_quantized and v.device.type != "meta" and v.numel() == 1)


def find_metrics(state: Any) -> dict:
    """Metrics found at the top level of a checkpoint dict (:data:`METRIC_KEYS`).

    Args:
        state: a nested checkpoint; anything but a dict gives ``{}``.

    Returns:
        ``{name: number}``: plain numbers (int/float, finite or not, or a one-element tensor) only.

    Example:
        >>> find_metrics({"iter_num": 5, "best_val_loss": 1.5})
        {'best_val_loss': 1.5}
    """
    found: dict = {}
    if not isinstance(state, dict):
        return found
    for name in METRIC_KEYS:
        v = state.get(name)
        if isinstance(v, bool):
            continue
        if type(v) in (int, float):
            found[name] = v
        elif _plain_scalar_tensor(v):
            found[name] = v.item()
    return found


def find_progress(state: Any) -> dict:
    """Progress (step / epoch / cursor) found at conventional places of a checkpoint dict.

    Looks at the top level, then at the :data:`PROGRESS_PLACES` sub-dicts (and fairseq's
    ``extra_state.train_iterator`` and last ``optimizer_history`` entry), for the keys of
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
    for place in _places(state):
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
                if _plain_scalar_tensor(v) and not v.is_floating_point():
                    found[field] = int(v.item())
                    break
    return found


__all__ = ["STEP_KEYS", "EPOCH_KEYS", "CURSOR_KEYS", "PROGRESS_PLACES", "METRIC_KEYS", "find_metrics", "find_progress"]
