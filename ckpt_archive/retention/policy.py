"""Retention policy: a pure function from generations + a policy to keep / remove, with reasons.

restic's ``ApplyPolicy`` habit (``internal/data/snapshot_policy.go``): the decision is computed from plain
facts with no I/O, so it is tested against golden files and property tests, and ``prune --dry-run``
simply prints it. Deleting is someone else's job (:mod:`ckpt_archive.ops.prune`).

Vocabulary (restic's): ``keep_last``, ``keep_hourly``, ``keep_daily``, ``keep_weekly``, ``keep_monthly``,
``keep_within``, ``keep_tag``, plus ``keep_best N`` with ``best_by "METRIC:min|max"``.

Rules, in the order they are applied:

* Only **usable** generations are counted. A generation that is not usable (partial, copied, damaged)
  never counts toward a keep rule, never takes a bucket from a usable one, and is never removed by
  prune: leftovers of interrupted writes are ``ckpt-archive gc``'s business. They are reported in
  :attr:`Decision.not_usable` with that reason (borg: a checkpoint archive never pushes out a complete one).
* Generations are walked newest first; "newest" means the highest generation number (the publish
  order), which is also the order ``@latest`` uses.
* ``keep_last N``: the N newest usable generations.
* ``keep_hourly/daily/weekly/monthly N``: walking newest first, the newest generation of each of the
  N most recent calendar buckets that hold a usable generation. Buckets are in UTC; weeks are ISO weeks
  (Monday first, ``2026-W48``). As restic does, when a bucket rule still has counts left at the oldest
  usable generation, that generation is kept too ("oldest daily"): the longest history is kept.
* ``keep_within DURATION`` (``"2d3h"``, ``"1w"``, ``"1y6m"``; units y, m = months, w, d, h): every
  usable generation created within DURATION before the newest usable generation's creation time (not
  before ``now``: a prune run long after training stopped cannot empty the window). A creation time in
  the future of ``now`` (clock skew) is not used as the reference.
* ``keep_tag [T, ...]``: every usable generation carrying one of the tags; an entry ``"a,b"`` needs
  both tags (restic's tag lists).
* ``keep_best N`` + ``best_by "val_loss:min"``: the N usable generations with the lowest (``min``) or
  highest (``max``) finite value of the metric; ties go to the newer. A generation without the metric,
  or with NaN/inf or a non-number there, is never "best" (another rule may still keep it). Metric
  names may be dotted paths into nested metrics (``"val.loss"``).

Invariants (each has a test):

* the newest usable generation is always kept (reason ``"newest usable"``);
* a policy whose rules keep none of the usable generations is refused (:class:`UsageError`) rather
  than leaving only the safety rule standing: that is nearly always a typo in a tag or metric name;
* an empty policy is refused (:class:`UsageError`).

Deleting is not done here: this module reads nothing and writes nothing (it imports no repository,
store or operation). :mod:`ckpt_archive.ops.prune` applies a decision under the repository lock and adds
one more rule, with I/O: **never leave nothing restorable** (``check_kept`` verifies the kept generations
newest first before anything is removed, and keeps the newest removed one that verifies when none of them
does; docs/retention.md).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping, Sequence

from ckpt_archive.errors import UsageError

__all__ = [
    "GenerationFacts", "RetentionPolicy", "Decision", "WithinDuration", "apply_policy",
    "parse_within", "parse_best_by", "metric_value", "NEWEST_USABLE",
]

NEWEST_USABLE = "newest usable"
NOT_USABLE_REASON = ("not usable ({status}): never counted by retention, never removed by prune; "
                     "`ckpt-archive gc` removes leftovers of interrupted writes")
NO_RULE = "matched no keep rule"


@dataclass(frozen=True)
class GenerationFacts:
    """What retention needs to know about one generation.

    Attributes:
        number: generation number (publish order; higher is newer).
        created: creation time, timezone-aware (converted to UTC); ``None`` when unknown (time-based
            rules then skip it, ``keep_last``/``keep_tag``/``keep_best`` still apply).
        usable: True when the generation's marker matches its manifest at this destination.
        tags: tags given at pack time.
        metrics: the manifest's metrics (nested dicts allowed); values should be numbers.
        status: the repository's status word (``usable``, ``partial``, ``copied``, ``damaged``),
            used only in reasons.
    """

    number: int
    created: datetime | None
    usable: bool = True
    tags: tuple[str, ...] = ()
    metrics: Mapping[str, Any] = field(default_factory=dict)
    status: str = ""

    @classmethod
    def from_generation(cls, gen: Any) -> "GenerationFacts":
        """Build facts from a :class:`ckpt_archive.repo.repository.Generation` (duck-typed).

        Reads ``number``, ``status``, ``created``, ``tags`` and ``metrics``; missing attributes count
        as unknown.
        """
        status = str(getattr(gen, "status", "") or "")
        created = getattr(gen, "created", None)
        if created is not None and created.tzinfo is None:
            created = created.replace(tzinfo=timezone.utc)
        return cls(number=int(gen.number), created=created, usable=(status == "usable"),
                   tags=tuple(getattr(gen, "tags", None) or ()), metrics=dict(getattr(gen, "metrics", None) or {}),
                   status=status)


_DUR_PART = re.compile(r"(\d+)([ymwdh])")
_DUR_FULL = re.compile(r"^(?:\d+[ymwdh])+$")


@dataclass(frozen=True)
class WithinDuration:
    """A calendar-aware duration: years, months, weeks, days, hours (restic's ``--keep-within``)."""

    years: int = 0
    months: int = 0
    weeks: int = 0
    days: int = 0
    hours: int = 0

    def is_zero(self) -> bool:
        return not (self.years or self.months or self.weeks or self.days or self.hours)

    def before(self, t: datetime) -> datetime:
        """Return ``t`` minus this duration (months/years by the calendar, day clamped to month end)."""
        total_months = t.year * 12 + (t.month - 1) - (self.years * 12 + self.months)
        year, month = divmod(total_months, 12)
        month += 1
        if year < 1:
            return datetime(1, 1, 1, tzinfo=t.tzinfo)
        import calendar

        day = min(t.day, calendar.monthrange(year, month)[1])
        shifted = t.replace(year=year, month=month, day=day)
        try:
            return shifted - timedelta(weeks=self.weeks, days=self.days, hours=self.hours)
        except OverflowError:
            return datetime(1, 1, 1, tzinfo=t.tzinfo)

    def __str__(self) -> str:
        parts = [(self.years, "y"), (self.months, "m"), (self.weeks, "w"), (self.days, "d"), (self.hours, "h")]
        return "".join(f"{n}{u}" for n, u in parts if n) or "0h"


def parse_within(text: str) -> WithinDuration:
    """Parse ``"2d3h"``, ``"1w"``, ``"1y6m"`` (y years, m months, w weeks, d days, h hours).

    Raises:
        UsageError: the text is not such a duration, or is zero.
    """
    s = str(text).strip().lower()
    if not _DUR_FULL.match(s):
        raise UsageError(f"bad duration {text!r}: expected e.g. '2d3h', '1w', '1y6m' "
                         "(units: y years, m months, w weeks, d days, h hours)", where="keep_within")
    values = {"y": 0, "m": 0, "w": 0, "d": 0, "h": 0}
    for num, unit in _DUR_PART.findall(s):
        values[unit] += int(num)
    dur = WithinDuration(years=values["y"], months=values["m"], weeks=values["w"], days=values["d"],
                         hours=values["h"])
    if dur.is_zero():
        raise UsageError(f"duration {text!r} is zero", where="keep_within")
    return dur


def parse_best_by(text: str) -> tuple[str, str]:
    """Parse ``"METRIC:min"`` / ``"METRIC:max"`` into ``(metric, direction)``.

    Raises:
        UsageError: no ``:min``/``:max`` suffix or an empty metric name.
    """
    metric, sep, direction = str(text).rpartition(":")
    direction = direction.strip().lower()
    if not sep or not metric.strip() or direction not in ("min", "max"):
        raise UsageError(f"bad --best-by {text!r}: expected METRIC:min or METRIC:max, e.g. val_loss:min",
                         where="best_by")
    return metric.strip(), direction


def metric_value(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    """Return the finite float value of metric ``name`` (a key, or a dotted path into nested dicts).

    Returns ``None`` when the metric is absent, not a number (bools and strings are not numbers),
    NaN or infinite: such a generation is never "best".
    """
    if not metrics:
        return None
    value: Any
    if name in metrics:
        value = metrics[name]
    else:
        value = metrics
        for part in name.split("."):
            if isinstance(value, Mapping) and part in value:
                value = value[part]
            else:
                return None
    if isinstance(value, Mapping) and value.get("$t") in ("npscalar", "int", "float"):
        # a tagged scalar: metrics packed as NumPy scalars (``np.mean(losses)``) or a big int
        from ckpt_archive.format.state_tree import decode

        try:
            value = decode(value, lambda key: None)
            value = value.item() if hasattr(value, "item") else value
        except Exception:  # noqa: BLE001 - a malformed tag is just not a number
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except (OverflowError, ValueError):
        return None
    return f if math.isfinite(f) else None


_COUNT_FIELDS = ("keep_last", "keep_hourly", "keep_daily", "keep_weekly", "keep_monthly", "keep_best")
_ALL_FIELDS = _COUNT_FIELDS + ("keep_within", "keep_tag", "best_by")


@dataclass(frozen=True)
class RetentionPolicy:
    """A retention policy in restic's vocabulary. Counts are numbers of generations (0 = rule off).

    Attributes:
        keep_last: keep the N newest usable generations.
        keep_hourly, keep_daily, keep_weekly, keep_monthly: keep the newest generation of each of the N
            most recent UTC calendar buckets (ISO weeks).
        keep_within: keep all within this duration of the newest usable one (``"2d3h"``); ``None`` = off.
        keep_tag: keep all carrying one of these tags (``"a,b"`` = both a and b).
        keep_best: keep the N best by ``best_by``.
        best_by: ``"METRIC:min"`` or ``"METRIC:max"``; required with ``keep_best``.
    """

    keep_last: int = 0
    keep_hourly: int = 0
    keep_daily: int = 0
    keep_weekly: int = 0
    keep_monthly: int = 0
    keep_within: str | None = None
    keep_tag: tuple[str, ...] = ()
    keep_best: int = 0
    best_by: str | None = None

    def __post_init__(self) -> None:
        for name in _COUNT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"must be a whole number >= 0, got {value!r}", where=name)
        if isinstance(self.keep_tag, str):
            object.__setattr__(self, "keep_tag", (self.keep_tag,))
        tags = tuple(str(t).strip() for t in (self.keep_tag or ()))
        if any(not t or any(not p.strip() for p in t.split(",")) for t in tags):
            raise UsageError(f"empty tag in {list(tags)!r}", where="keep_tag")
        object.__setattr__(self, "keep_tag", tags)
        if self.keep_within is not None:
            if self.keep_within == "":
                object.__setattr__(self, "keep_within", None)
            else:
                object.__setattr__(self, "keep_within", str(parse_within(self.keep_within)))
        if self.best_by is not None:
            metric, direction = parse_best_by(self.best_by)
            object.__setattr__(self, "best_by", f"{metric}:{direction}")
        if self.keep_best and not self.best_by:
            raise UsageError("--keep-best needs --best-by METRIC:min|max (e.g. val_loss:min)", where="best_by")
        if self.best_by and not self.keep_best:
            raise UsageError("--best-by given without --keep-best N", where="keep_best")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, where: str = "retention") -> "RetentionPolicy":
        """Build a policy from a dict (``repository.json``'s ``retention``; ``pack(retention=...)``).

        Accepts the field names above; ``keep_tag`` may be a string or a list. ``None``/``{}`` gives an
        empty policy (check :meth:`is_empty`).

        Raises:
            UsageError: an unknown key or a value of the wrong type, naming the field.
        """
        if data is None:
            return cls()
        if isinstance(data, RetentionPolicy):
            return data
        if not isinstance(data, Mapping):
            raise UsageError(f"retention policy must be an object, got {type(data).__name__}", where=where)
        unknown = sorted(set(data) - set(_ALL_FIELDS))
        if unknown:
            raise UsageError(f"unknown retention field(s) {', '.join(unknown)}; known: {', '.join(_ALL_FIELDS)}",
                             where=where)
        kwargs: dict[str, Any] = {}
        for name in _COUNT_FIELDS:
            if data.get(name) is not None:
                kwargs[name] = data[name]
        for name in ("keep_within", "best_by"):
            value = data.get(name)
            if value is not None:
                if not isinstance(value, str):
                    raise UsageError(f"must be a string, got {value!r}", where=f"{where}.{name}")
                kwargs[name] = value
        tags = data.get("keep_tag")
        if tags is not None:
            if isinstance(tags, str):
                tags = [tags]
            if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
                raise UsageError(f"must be a list of strings, got {tags!r}", where=f"{where}.keep_tag")
            kwargs["keep_tag"] = tuple(tags)
        try:
            return cls(**kwargs)
        except UsageError as exc:
            raise UsageError(exc.message, where=f"{where}.{exc.where}" if exc.where else where) from None

    @classmethod
    def from_flags(cls, *, keep_last: int | None = None, keep_hourly: int | None = None,
                   keep_daily: int | None = None, keep_weekly: int | None = None,
                   keep_monthly: int | None = None, keep_within: str | None = None,
                   keep_tag: Sequence[str] | None = None, keep_best: int | None = None,
                   best_by: str | None = None) -> "RetentionPolicy":
        """Build a policy from CLI flags (``None`` = flag not given)."""
        return cls(keep_last=keep_last or 0, keep_hourly=keep_hourly or 0, keep_daily=keep_daily or 0,
                   keep_weekly=keep_weekly or 0, keep_monthly=keep_monthly or 0, keep_within=keep_within or None,
                   keep_tag=tuple(keep_tag or ()), keep_best=keep_best or 0, best_by=best_by or None)

    def to_dict(self) -> dict[str, Any]:
        """The policy as a JSON-ready dict holding only the rules that are on (round-trips :meth:`from_dict`)."""
        out: dict[str, Any] = {}
        for name in ("keep_last", "keep_hourly", "keep_daily", "keep_weekly", "keep_monthly"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        if self.keep_within:
            out["keep_within"] = self.keep_within
        if self.keep_tag:
            out["keep_tag"] = list(self.keep_tag)
        if self.keep_best:
            out["keep_best"] = self.keep_best
            out["best_by"] = self.best_by
        return out

    def is_empty(self) -> bool:
        """True when no rule is on."""
        return not self.to_dict()

    def describe(self) -> str:
        """One line for humans, e.g. ``keep last 3, daily 7, best 1 by val_loss:min``."""
        parts = []
        for name, word in (("keep_last", "last"), ("keep_hourly", "hourly"), ("keep_daily", "daily"),
                           ("keep_weekly", "weekly"), ("keep_monthly", "monthly")):
            if getattr(self, name):
                parts.append(f"{word} {getattr(self, name)}")
        if self.keep_within:
            parts.append(f"within {self.keep_within} of the newest")
        if self.keep_tag:
            parts.append("tag " + " or ".join(self.keep_tag))
        if self.keep_best:
            parts.append(f"best {self.keep_best} by {self.best_by}")
        return "keep " + ", ".join(parts) if parts else "(empty policy)"


@dataclass
class Decision:
    """The outcome of :func:`apply_policy`. Every list is newest first; every entry is
    ``(generation number, reasons)``.

    Attributes:
        keep: usable generations that stay, with the rules that keep them.
        remove: usable generations no rule keeps (``["matched no keep rule"]``).
        not_usable: generations that are not usable: not counted, not removed by prune (gc's business).
        policy: the policy applied.
    """

    keep: list[tuple[int, list[str]]]
    remove: list[tuple[int, list[str]]]
    not_usable: list[tuple[int, list[str]]]
    policy: RetentionPolicy

    @property
    def keep_numbers(self) -> list[int]:
        return [n for n, _ in self.keep]

    @property
    def remove_numbers(self) -> list[int]:
        return [n for n, _ in self.remove]

    def rows(self) -> list[tuple[int, str, list[str]]]:
        """All generations newest first as ``(number, "keep"|"remove"|"not usable", reasons)``."""
        rows = [(n, "keep", r) for n, r in self.keep] + [(n, "remove", r) for n, r in self.remove] + \
               [(n, "not usable", r) for n, r in self.not_usable]
        return sorted(rows, key=lambda row: -row[0])

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``policy``, ``keep``/``remove``/``not_usable`` as ``[{generation, reasons}]``."""
        def entries(items):
            return [{"generation": n, "reasons": list(r)} for n, r in items]

        return {"policy": self.policy.to_dict(), "keep": entries(self.keep), "remove": entries(self.remove),
                "not_usable": entries(self.not_usable)}


def _utc(t: datetime | None) -> datetime | None:
    if t is None:
        return None
    if t.tzinfo is None:
        return t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc)


def _bucket_hourly(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %Hh")


def _bucket_daily(t: datetime) -> str:
    return t.strftime("%Y-%m-%d")


def _bucket_weekly(t: datetime) -> str:
    year, week, _ = t.isocalendar()
    return f"{year}-W{week:02d}"


def _bucket_monthly(t: datetime) -> str:
    return t.strftime("%Y-%m")


_BUCKET_RULES = (
    ("keep_hourly", "hourly", _bucket_hourly),
    ("keep_daily", "daily", _bucket_daily),
    ("keep_weekly", "weekly", _bucket_weekly),
    ("keep_monthly", "monthly", _bucket_monthly),
)


def _has_tags(gen_tags: Iterable[str], spec: str) -> bool:
    have = set(gen_tags)
    return all(part.strip() in have for part in spec.split(","))


def apply_policy(generations: Sequence[GenerationFacts], policy: RetentionPolicy,
                 now: datetime | None = None) -> Decision:
    """Decide which generations a retention policy keeps and which it removes, and why.

    Pure: no I/O, no clock (``now`` is passed in). See the module docstring for the rules.

    Args:
        generations: every generation of the repository, any order, usable or not.
        policy: a :class:`RetentionPolicy` (build one with :meth:`RetentionPolicy.from_dict` or
            :meth:`RetentionPolicy.from_flags`).
        now: the time of the decision, timezone-aware (default: the current UTC time). Only used so
            that a creation time in the future (clock skew) is not taken as ``keep_within``'s reference.

    Returns:
        A :class:`Decision`; every input generation appears in exactly one of its three lists.

    Raises:
        UsageError: the policy is not a :class:`RetentionPolicy` or is empty; two generations share a
            number; or the rules keep none of the usable generations (the policy would remove every generation).

    Example:
        >>> from datetime import datetime, timedelta, timezone
        >>> t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
        >>> gens = [GenerationFacts(i, t0 + timedelta(hours=i), metrics={"val_loss": v})
        ...         for i, v in zip(range(1, 6), [0.9, 0.5, 0.7, 0.8, 0.85])]
        >>> d = apply_policy(gens, RetentionPolicy(keep_last=1, keep_best=1, best_by="val_loss:min"))
        >>> d.keep_numbers, d.remove_numbers
        ([5, 2], [4, 3, 1])
    """
    if not isinstance(policy, RetentionPolicy):
        raise UsageError(f"a retention policy must be a RetentionPolicy, got {type(policy).__name__} (build one with "
                         "RetentionPolicy.from_dict or RetentionPolicy.from_flags)", where="retention")
    if policy.is_empty():
        raise UsageError("empty retention policy: give at least one of --keep-last, --keep-hourly, --keep-daily, "
                         "--keep-weekly, --keep-monthly, --keep-within, --keep-tag, --keep-best")
    now = _utc(now) or datetime.now(timezone.utc)
    numbers = [g.number for g in generations]
    if len(set(numbers)) != len(numbers):
        dup = sorted({n for n in numbers if numbers.count(n) > 1})
        raise UsageError(f"generation number(s) {dup} appear more than once")

    ordered = sorted(generations, key=lambda g: -g.number)
    usable = [g for g in ordered if g.usable]
    not_usable = [(g.number, [NOT_USABLE_REASON.format(status=g.status or "not usable")])
                  for g in ordered if not g.usable]
    if not usable:
        return Decision(keep=[], remove=[], not_usable=not_usable, policy=policy)

    reasons: dict[int, list[str]] = {g.number: [] for g in usable}

    # keep_last
    for rank, g in enumerate(usable[:policy.keep_last], start=1):
        reasons[g.number].append(f"last {rank} of {policy.keep_last}")

    # calendar buckets (UTC), restic's walk: newest first, a new bucket value takes one count
    timed = [(g, _utc(g.created)) for g in usable if g.created is not None]
    for fname, word, bucket_of in _BUCKET_RULES:
        count = getattr(policy, fname)
        if not count:
            continue
        last_value = None
        for idx, (g, t) in enumerate(timed):
            if count <= 0:
                break
            value = bucket_of(t)
            is_oldest = idx == len(timed) - 1
            if value != last_value:
                reasons[g.number].append(f"{word} {value}")
                last_value = value
                count -= 1
            elif is_oldest:
                # counts left at the oldest usable generation: keep it too (longest history, restic)
                reasons[g.number].append(f"oldest {word} {value}")

    # keep_within, counted back from the newest usable creation time that is not in the future
    if policy.keep_within:
        dur = parse_within(policy.keep_within)
        past = [t for _, t in timed if t <= now]
        if past:
            reference = max(past)
            cutoff = dur.before(reference)
            for g, t in timed:
                if cutoff < t:
                    reasons[g.number].append(f"within {policy.keep_within} of newest ({reference:%Y-%m-%d %H:%M}Z)")

    # keep_tag
    for spec in policy.keep_tag:
        for g in usable:
            if _has_tags(g.tags, spec):
                reasons[g.number].append(f"tag {spec}")

    # keep_best
    if policy.keep_best:
        metric, direction = parse_best_by(policy.best_by or "")
        scored = [(metric_value(g.metrics, metric), g) for g in usable]
        scored = [(v, g) for v, g in scored if v is not None]
        sign = 1.0 if direction == "min" else -1.0
        scored.sort(key=lambda vg: (sign * vg[0], -vg[1].number))
        for rank, (v, g) in enumerate(scored[:policy.keep_best], start=1):
            reasons[g.number].append(f"best {rank} of {policy.keep_best} by {metric}:{direction} ({v:.6g})")

    if not any(reasons[g.number] for g in usable):
        raise UsageError(f"policy '{policy.describe()}' keeps none of the {len(usable)} usable generation(s); "
                         "refusing a policy that would remove every generation (check tag and metric names)",
                         where="retention")

    newest = usable[0]
    reasons[newest.number].insert(0, NEWEST_USABLE)

    keep = [(g.number, reasons[g.number]) for g in usable if reasons[g.number]]
    remove = [(g.number, [NO_RULE]) for g in usable if not reasons[g.number]]
    return Decision(keep=keep, remove=remove, not_usable=not_usable, policy=policy)
