"""``status``: a watchdog for scheduled backups -- a live process is not a healthy one.

``ckpt-archive status REPO --max-age 2h`` answers, for cron or a systemd timer that alerts on a
non-zero exit: is the newest usable generation recent enough, and has training moved on since the
last check?

* **too old**: the newest usable generation was created longer than ``max_age`` ago (a backup job
  that stopped, a trainer that stopped saving, a destination that stopped accepting);
* **not advancing**: a generation newer than the one the last check saw does not hold a later step
  (a trainer in a crash loop, resuming from the same checkpoint and saving it again);
* **dated in the future**: the newest usable generation's ``created`` lies more than
  :data:`CLOCK_SKEW_TOLERANCE_S` (5 minutes) after now (a trainer host with a fast clock, or a
  hand-edited manifest): its age would be negative forever and ``--max-age`` would never fire, so it is
  unhealthy, and it never counts as the step advancing;
* nothing usable at all.

Each of these is exit 1 ("examined and found wrong"); a repository that cannot be read is exit 2.

The state of the last check is kept **outside the repository**, so the watchdog only reads the
repository and runs with read-only credentials: by default
``$XDG_STATE_HOME/ckpt-archive/status/<sha256 of the repository's place>.json`` (``~/.local/state/...``),
or the file given as ``state``. It holds the generation, step and time the last check saw.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Mapping

from ckpt_archive.errors import UsageError
from ckpt_archive.format import jsonio
from ckpt_archive.format.durations import check_seconds
from ckpt_archive.ops.common import RepoLike, human_seconds, open_repo
from ckpt_archive.repo.repository import iso, utcnow

STATE_VERSION = 1
#: How far (seconds) a generation's ``created`` may lie after now before it counts as clock skew: a few
#: minutes of drift between the trainer's host and the watchdog's is normal, more is not.
CLOCK_SKEW_TOLERANCE_S = 300.0
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(w|d|h|min|s)")


def parse_age(text: str | float | int) -> float:
    """A duration in seconds: ``"2h"``, ``"90min"``, ``"1d12h"``, ``"45s"``, or a number of seconds.

    Units: ``w`` weeks, ``d`` days, ``h`` hours, ``min`` minutes, ``s`` seconds (``m`` alone is refused:
    months in retention policies, minutes elsewhere).

    Raises:
        UsageError: not such a duration, or not positive and finite (``inf``, ``nan`` refused).

    Example:
        >>> parse_age("1h30min"), parse_age("2d"), parse_age(90)
        (5400.0, 172800.0, 90.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower().replace(" ", "")
        try:
            seconds = float(s)
        except ValueError:
            if not s or _DURATION_PART.sub("", s):
                raise UsageError(f"bad duration {text!r}: use e.g. 2h, 90min, 1d12h, 45s (w d h min s)") from None
            mult = {"w": 604800, "d": 86400, "h": 3600, "min": 60, "s": 1}
            seconds = sum(float(n) * mult[u] for n, u in _DURATION_PART.findall(s))
    if not seconds > 0:
        raise UsageError(f"bad duration {text!r}: must be positive")
    try:  # inf, 1e400, 9...9h: a limit that never fires
        return check_seconds(seconds, "duration", allow_zero=False)
    except UsageError:
        raise UsageError(f"bad duration {text!r}: must be finite") from None


def default_state_file(location: str) -> Path:
    """Where the last check of a repository is remembered by default (see the module docstring)."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "ckpt-archive" / "status" / (hashlib.sha256(location.encode()).hexdigest()[:24] + ".json")


@dataclasses.dataclass
class StatusReport:
    """Result of :func:`status`.

    Attributes:
        location: the repository's place.
        ok: healthy (exit 0) or not (exit 1).
        problems: why not, one line each.
        generation, step, created, age_s: the newest usable generation (None when there is none).
        max_age_s: the limit checked (None: not checked).
        previous: what the last check saw (``{"generation", "step", "checked"}``) or None (first check).
        state_file: where this check was remembered (None with ``record=False``).
        counts: generations by status.
    """

    location: str
    ok: bool
    problems: list[str]
    generation: int | None
    step: int | None
    created: str | None
    age_s: float | None
    max_age_s: float | None
    previous: dict | None
    state_file: str | None
    counts: dict

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def status(repo: RepoLike, *, max_age: str | float | None = None, state: str | os.PathLike | None = None,
           record: bool = True, now: dt.datetime | None = None,
           store_options: Mapping[str, Any] | None = None) -> StatusReport:
    """Check that a repository's newest usable generation is fresh and advancing (the watchdog).

    Args:
        repo: repository path/URL or Repository (only read).
        max_age: the oldest the newest usable generation may be (seconds, or ``"2h"``; see
            :func:`parse_age`); None: age not checked.
        state: the file remembering the last check (default :func:`default_state_file`).
        record: remember this check for the next one (the step check compares with it).
        now: the time to judge by (default now, UTC).
        store_options: for URL repositories, one mapping (``{"endpoint_url": ..., "storage_options": {...}}``;
            :func:`~ckpt_archive.ops.common.open_repo`).

    Returns:
        :class:`StatusReport` (``ok`` False: exit 1).

    Raises:
        NotFound / StoreError: the repository cannot be read (exit 2). UsageError: a bad ``max_age``, or a
            ``state`` path that is a FIFO, device or socket. TypeError: an unknown keyword argument or store
            option.

    Example:
        >>> import torch, ckpt_archive, tempfile, os
        >>> repo = tempfile.mkdtemp(); st = os.path.join(tempfile.mkdtemp(), "st.json")
        >>> _ = ckpt_archive.pack({"w": torch.ones(2), "step": 5}, repo)
        >>> r = status(repo, max_age="1h", state=st)
        >>> r.ok, r.generation, r.step
        (True, 1, 5)
    """
    limit = parse_age(max_age) if max_age is not None else None
    r = open_repo(repo, store_options)
    now = now or utcnow()
    gens = r.generations()
    counts: dict[str, int] = {}
    for g in gens:
        counts[g.status] = counts.get(g.status, 0) + 1
    newest, untrusted = _newest_trusted(r, gens)
    state_path = Path(state) if state is not None else default_state_file(r.location)
    from ckpt_archive.ops.common import refuse_special_output

    refuse_special_output(state_path, option="--state")  # a FIFO would block the read, then be replaced
    previous = _read_previous(state_path, r.location)
    created = newest.created if newest else None
    age = (now - created).total_seconds() if created else None
    problems = _problems(r.location, newest, counts, age, limit, previous)
    problems += [f"generation {n}: {why}" for n, why in sorted(untrusted.items())
                 if newest is None or n > newest.number]
    report = StatusReport(r.location, not problems, problems, newest.number if newest else None,
                          newest.step if newest else None, iso(created) if created else None,
                          round(age, 3) if age is not None else None, limit, previous,
                          str(state_path) if record else None, counts)
    future = age is not None and age < -CLOCK_SKEW_TOLERANCE_S
    if record and newest is not None and not future:  # a future-dated one never becomes the baseline
        _remember(state_path, r.location, {"generation": newest.number, "step": newest.step,
                                           "checked": iso(now)})
    return report


def _newest_trusted(r, gens: list) -> tuple[Any, dict[int, str]]:
    """The newest usable generation and, with ``--trust``, ``{number: why}`` of the usable ones no trusted
    key signed: those are not one this watchdog may call healthy."""
    from ckpt_archive.ops.common import untrusted_reason

    untrusted = {g.number: why for g in gens if (why := untrusted_reason(r, g)) is not None}
    usable = [g for g in gens if g.usable and g.number not in untrusted]
    return (usable[-1] if usable else None), untrusted


def _problems(location: str, newest: Any, counts: dict, age: float | None, limit: float | None,
              previous: dict | None) -> list[str]:
    """Why the repository is not healthy, one line each: no usable generation; the newest dated in the future
    (beyond :data:`CLOCK_SKEW_TOLERANCE_S`); older than ``limit`` seconds; its step not advancing, or it going
    back, since the ``previous`` check."""
    if newest is None:
        text = "no usable generation"
        if counts.get("copied"):
            text += f" ({counts['copied']} copied: `ckpt-archive adopt {location}` makes them usable here)"
        return [text]
    if age is not None and age < -CLOCK_SKEW_TOLERANCE_S:
        # A future date (a fast clock on the trainer's host, a hand-edit) would stay "fresh" forever and
        # says nothing about progress either: unhealthy, and not compared with the last check's step.
        return [f"the newest usable generation ({newest.number}, step {newest.step}) is dated "
                f"{iso(newest.created)}, {_human_age(-age)} in the future (clock skew of more than "
                f"{_human_age(CLOCK_SKEW_TOLERANCE_S)} between the host that wrote it and this one, or an "
                f"edited manifest): its age cannot be judged"]
    problems: list[str] = []
    if limit is not None and (age is None or age > limit):
        problems.append(f"the newest usable generation ({newest.number}, step {newest.step}) is "
                        f"{_human_age(age)} old, more than --max-age {_human_age(limit)}")
    return problems + _progress_problems(newest, previous)


def _progress_problems(newest: Any, previous: dict | None) -> list[str]:
    """The step did not advance with a newer generation, or the newest went back, since the last check."""
    if not previous or not isinstance(previous.get("generation"), int):
        return []
    if newest.number > previous["generation"]:
        before, after = previous.get("step"), newest.step
        if isinstance(before, int) and isinstance(after, int) and after <= before:
            return [f"the step did not advance: generation {newest.number} holds step {after}, the "
                    f"last check ({previous.get('checked')}) saw generation {previous['generation']} "
                    f"at step {before}"]
    if newest.number < previous["generation"]:
        return [f"the newest usable generation went back from {previous['generation']} to "
                f"{newest.number} since the last check ({previous.get('checked')})"]
    return []


def _read_previous(path: Path, location: str) -> dict | None:
    try:
        doc = jsonio.loads(path.read_bytes(), where=str(path))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise UsageError(f"the status state file is not valid JSON ({exc}); remove it to start over",
                         where=str(path)) from None
    entry = (doc.get("repositories") or {}).get(location) if isinstance(doc, dict) else None
    return entry if isinstance(entry, dict) else None


def _remember(path: Path, location: str, entry: dict) -> None:
    from ckpt_archive.store.fs import write_file_atomic

    try:
        doc = jsonio.loads(path.read_bytes(), where=str(path))
    except (FileNotFoundError, ValueError):
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    doc["format"] = "ckpt-archive-status"
    doc["version"] = STATE_VERSION
    doc.setdefault("repositories", {})[location] = entry
    # the folder created if absent, a fresh O_EXCL temporary beside the file, renamed over it (the file layer)
    write_file_atomic(path, jsonio.dumps(doc, indent=1, sort_keys=True, ensure_ascii=True))


def _human_age(seconds: float | None) -> str:
    if seconds is None:
        return "of unknown age"
    return human_seconds(seconds)


__all__ = ["status", "StatusReport", "parse_age", "default_state_file", "CLOCK_SKEW_TOLERANCE_S"]
