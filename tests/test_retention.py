"""Retention policy as a pure function: the issue's cases, golden files for a realistic multi-week
schedule, and property tests for the invariants.

Golden files live in ``tests/golden/retention/``; regenerate them only on purpose with
``UPDATE_GOLDEN=1 python -m pytest tests/test_retention.py`` and review the diff.
"""
from __future__ import annotations

import json
import math
import os
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_archive.errors import UsageError
from ckpt_archive.retention.policy import (
    NEWEST_USABLE, GenerationFacts, RetentionPolicy, apply_policy, metric_value, parse_best_by, parse_within,
)

GOLDEN = Path(__file__).parent / "golden" / "retention"
T0 = datetime(2026, 11, 2, 0, 0, tzinfo=timezone.utc)  # a Monday, ISO week 2026-W45


def gens_with_losses(losses, *, start=T0, step=timedelta(hours=1)):
    return [GenerationFacts(i, start + step * (i - 1), metrics={"val_loss": v})
            for i, v in enumerate(losses, start=1)]


# ---------------------------------------------------------------------------------------------- issue case
def test_keep_best_keeps_the_best_and_the_newest_not_only_the_best():
    gens = gens_with_losses([0.9, 0.5, 0.7, 0.8, 0.85])
    d = apply_policy(gens, RetentionPolicy(keep_last=1, keep_best=1, best_by="val_loss:min"), T0)
    assert sorted(d.keep_numbers) == [2, 5]
    assert sorted(d.remove_numbers) == [1, 3, 4]
    reasons = dict(d.keep)
    assert reasons[5][0] == NEWEST_USABLE and any(r.startswith("last 1") for r in reasons[5])
    assert any(r.startswith("best 1 of 1 by val_loss:min") for r in reasons[2])


def test_when_the_newest_is_also_best_only_it_stays():
    gens = gens_with_losses([0.9, 0.5, 0.7, 0.8, 0.4])
    d = apply_policy(gens, RetentionPolicy(keep_last=1, keep_best=1, best_by="val_loss:min"), T0)
    assert d.keep_numbers == [5]
    assert sorted(d.remove_numbers) == [1, 2, 3, 4]


def test_keep_best_alone_never_removes_the_newest_usable():
    gens = gens_with_losses([0.9, 0.5, 0.7, 0.8, 0.85])
    d = apply_policy(gens, RetentionPolicy(keep_best=1, best_by="val_loss:min"), T0)
    assert sorted(d.keep_numbers) == [2, 5]
    assert dict(d.keep)[5] == [NEWEST_USABLE]


def test_best_by_max_picks_the_highest():
    gens = [GenerationFacts(i, T0 + timedelta(hours=i), metrics={"acc": a})
            for i, a in enumerate([0.1, 0.9, 0.5, 0.2], start=1)]
    d = apply_policy(gens, RetentionPolicy(keep_best=2, best_by="acc:max"), T0)
    assert sorted(d.keep_numbers) == [2, 3, 4]


def test_generation_without_metric_or_nan_is_never_best_but_another_rule_may_keep_it():
    gens = [
        GenerationFacts(1, T0, metrics={"val_loss": 0.7}),
        GenerationFacts(2, T0 + timedelta(hours=1), metrics={"val_loss": float("nan")}),
        GenerationFacts(3, T0 + timedelta(hours=2), metrics={}),
        GenerationFacts(4, T0 + timedelta(hours=3), metrics={"val_loss": "0.1"}),  # a string is no number
        GenerationFacts(5, T0 + timedelta(hours=4), metrics={"val_loss": 0.9}),
    ]
    d = apply_policy(gens, RetentionPolicy(keep_best=1, best_by="val_loss:min", keep_tag=()), T0)
    assert sorted(d.keep_numbers) == [1, 5]
    d2 = apply_policy(gens, RetentionPolicy(keep_last=3, keep_best=1, best_by="val_loss:min"), T0)
    keep = dict(d2.keep)
    assert sorted(keep) == [1, 3, 4, 5]
    assert not any("best" in r for r in keep[3] + keep[4])


def test_metric_lookup_follows_dotted_paths_and_rejects_non_numbers():
    assert metric_value({"val": {"loss": 0.25}}, "val.loss") == 0.25
    assert metric_value({"val.loss": 0.5}, "val.loss") == 0.5
    assert metric_value({"ok": True}, "ok") is None
    assert metric_value({"x": float("inf")}, "x") is None
    assert metric_value(None, "x") is None


# ---------------------------------------------------------------------------------------------- invariants
def test_not_usable_generations_never_count_and_are_left_for_gc():
    gens = gens_with_losses([0.9, 0.5, 0.7, 0.8, 0.85])
    # the newest and the best are partial: they must neither be kept by a rule nor removed by prune
    gens[4] = GenerationFacts(5, gens[4].created, usable=False, metrics={"val_loss": 0.01}, status="partial")
    gens[1] = GenerationFacts(2, gens[1].created, usable=False, metrics={"val_loss": 0.02}, status="damaged")
    d = apply_policy(gens, RetentionPolicy(keep_last=1, keep_best=1, best_by="val_loss:min"), T0)
    assert sorted(d.keep_numbers) == [3, 4]  # #4 newest usable/last 1, #3 best usable
    assert d.remove_numbers == [1]
    nu = dict(d.not_usable)
    assert sorted(nu) == [2, 5]
    assert "partial" in nu[5][0] and "gc" in nu[5][0] and "never removed by prune" in nu[5][0]


def test_not_usable_generation_does_not_take_a_daily_bucket_from_a_usable_one():
    day2 = T0 + timedelta(days=1)
    gens = [GenerationFacts(1, T0, usable=True), GenerationFacts(2, T0 + timedelta(hours=5), usable=True),
            GenerationFacts(3, day2, usable=True), GenerationFacts(4, day2 + timedelta(hours=1), usable=False,
                                                                  status="partial")]
    d = apply_policy(gens, RetentionPolicy(keep_daily=2), day2 + timedelta(hours=2))
    assert sorted(d.keep_numbers) == [2, 3]
    assert d.remove_numbers == [1]


def test_empty_policy_is_refused():
    with pytest.raises(UsageError, match="empty retention policy"):
        apply_policy(gens_with_losses([0.1]), RetentionPolicy(), T0)
    with pytest.raises(UsageError):
        apply_policy(gens_with_losses([0.1]), {}, T0)


def test_policy_that_would_remove_every_generation_is_refused():
    gens = gens_with_losses([0.3, 0.2, 0.1])
    with pytest.raises(UsageError, match="keeps none of the 3 usable"):
        apply_policy(gens, RetentionPolicy(keep_tag=("release",)), T0)
    with pytest.raises(UsageError, match="keeps none"):  # a typo in the metric name
        apply_policy(gens, RetentionPolicy(keep_best=1, best_by="val_los:min"), T0)


def test_no_usable_generation_removes_nothing():
    gens = [GenerationFacts(1, T0, usable=False, status="partial")]
    d = apply_policy(gens, RetentionPolicy(keep_last=1), T0)
    assert d.keep == [] and d.remove == [] and [n for n, _ in d.not_usable] == [1]


def test_duplicate_generation_numbers_are_refused():
    with pytest.raises(UsageError, match="more than once"):
        apply_policy([GenerationFacts(1, T0), GenerationFacts(1, T0)], RetentionPolicy(keep_last=1), T0)


# ---------------------------------------------------------------------------------------------- rules
def test_calendar_buckets_are_utc_not_local_time():
    # 23:30 at UTC-05:00 is 04:30 UTC the next day: daily buckets must use the UTC date
    eastern = timezone(timedelta(hours=-5))
    a = GenerationFacts(1, datetime(2026, 11, 2, 20, 0, tzinfo=eastern))   # 2026-11-03 01:00Z
    b = GenerationFacts(2, datetime(2026, 11, 2, 23, 30, tzinfo=eastern))  # 2026-11-03 04:30Z
    d = apply_policy([a, b], RetentionPolicy(keep_daily=5), T0 + timedelta(days=3))
    keep = dict(d.keep)
    assert any(r == "daily 2026-11-03" for r in keep[2])
    assert 1 in keep and keep[1] == ["oldest daily 2026-11-03"]  # restic's oldest rule, same UTC day


def test_weekly_buckets_are_iso_weeks():
    # Sunday 2026-11-08 belongs to ISO week 45 with Monday 2026-11-02; Monday 2026-11-09 starts W46
    gens = [GenerationFacts(1, datetime(2026, 11, 2, 1, tzinfo=timezone.utc)),
            GenerationFacts(2, datetime(2026, 11, 8, 23, tzinfo=timezone.utc)),
            GenerationFacts(3, datetime(2026, 11, 9, 0, tzinfo=timezone.utc))]
    d = apply_policy(gens, RetentionPolicy(keep_weekly=2), T0 + timedelta(days=8))
    assert sorted(d.keep_numbers) == [2, 3]
    assert dict(d.keep)[2] == ["weekly 2026-W45"]


def test_keep_within_counts_from_the_newest_usable_not_from_now():
    gens = [GenerationFacts(i, T0 + timedelta(days=i)) for i in range(1, 6)]
    # a month after training stopped: the window is still anchored at generation 5
    d = apply_policy(gens, RetentionPolicy(keep_within="2d"), T0 + timedelta(days=40))
    assert sorted(d.keep_numbers) == [4, 5]


def test_keep_within_ignores_a_creation_time_in_the_future():
    gens = [GenerationFacts(i, T0 + timedelta(days=i)) for i in range(1, 5)]
    gens.append(GenerationFacts(5, T0 + timedelta(days=400)))  # clock skew on the writer
    d = apply_policy(gens, RetentionPolicy(keep_within="1d12h"), T0 + timedelta(days=4, hours=1))
    assert sorted(d.keep_numbers) == [3, 4, 5]


def test_keep_tag_lists_need_every_tag():
    gens = [GenerationFacts(1, T0, tags=("release",)), GenerationFacts(2, T0, tags=("release", "eval")),
            GenerationFacts(3, T0, tags=("eval",)), GenerationFacts(4, T0)]
    d = apply_policy(gens, RetentionPolicy(keep_tag=("release,eval",)), T0)
    assert sorted(d.keep_numbers) == [2, 4]
    d = apply_policy(gens, RetentionPolicy(keep_tag=("release", "eval")), T0)
    assert sorted(d.keep_numbers) == [1, 2, 3, 4]


def test_keep_last_counts_generation_numbers_not_creation_times():
    # a clock that went backwards does not make an older generation "newer"
    gens = [GenerationFacts(1, T0 + timedelta(days=3)), GenerationFacts(2, T0), GenerationFacts(3, T0)]
    d = apply_policy(gens, RetentionPolicy(keep_last=2), T0 + timedelta(days=5))
    assert sorted(d.keep_numbers) == [2, 3]


@pytest.mark.parametrize("text, expected", [
    ("2d3h", "2d3h"), ("1w", "1w"), ("1y6m", "1y6m"), ("36H", "36h"), ("1d1d", "2d"),
])
def test_parse_within_accepts_restic_durations(text, expected):
    assert str(parse_within(text)) == expected


@pytest.mark.parametrize("text", ["", "2", "d", "2x", "1.5d", "-1d", "0d", "2 d"])
def test_parse_within_rejects_garbage_with_a_reason(text):
    with pytest.raises(UsageError, match="duration"):
        parse_within(text)


def test_keep_within_months_are_calendar_months():
    ref = datetime(2026, 3, 31, 12, tzinfo=timezone.utc)
    assert parse_within("1m").before(ref) == datetime(2026, 2, 28, 12, tzinfo=timezone.utc)
    assert parse_within("1y").before(ref) == datetime(2025, 3, 31, 12, tzinfo=timezone.utc)


@pytest.mark.parametrize("kwargs, message", [
    ({"keep_best": 1}, "--best-by"),
    ({"best_by": "val_loss:min"}, "--keep-best"),
    ({"keep_best": 1, "best_by": "val_loss"}, "METRIC:min"),
    ({"keep_best": 1, "best_by": ":min"}, "METRIC:min"),
    ({"keep_last": -1}, ">= 0"),
    ({"keep_tag": ("",)}, "empty tag"),
])
def test_bad_policy_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(UsageError, match=message):
        RetentionPolicy(**kwargs)


def test_parse_best_by():
    assert parse_best_by("val/loss:MAX") == ("val/loss", "max")
    assert parse_best_by("a:b:min") == ("a:b", "min")


# ---------------------------------------------------------------------------------------------- (de)serialisation
def test_policy_round_trips_through_repository_json_dict():
    pol = RetentionPolicy(keep_last=3, keep_daily=7, keep_weekly=4, keep_monthly=6, keep_hourly=2,
                          keep_within="2d3h", keep_tag=("release", "a,b"), keep_best=2, best_by="val_loss:min")
    data = json.loads(json.dumps(pol.to_dict()))
    assert RetentionPolicy.from_dict(data) == pol
    assert RetentionPolicy.from_dict({}).is_empty()
    assert RetentionPolicy.from_dict(None).to_dict() == {}
    assert RetentionPolicy.from_dict({"keep_tag": "release"}).keep_tag == ("release",)


@pytest.mark.parametrize("data, where", [
    ({"keep_lats": 3}, "retention"),
    ({"keep_last": "3"}, "retention.keep_last"),
    ({"keep_within": 5}, "retention.keep_within"),
    ({"keep_tag": [1]}, "retention.keep_tag"),
    ({"keep_last": True}, "retention.keep_last"),
])
def test_from_dict_names_the_bad_field(data, where):
    with pytest.raises(UsageError) as info:
        RetentionPolicy.from_dict(data)
    assert info.value.where == where


def test_describe_is_one_readable_line():
    pol = RetentionPolicy(keep_last=1, keep_best=1, best_by="val_loss:min")
    assert pol.describe() == "keep last 1, best 1 by val_loss:min"


# ---------------------------------------------------------------------------------------------- golden files
def realistic_schedule() -> list[GenerationFacts]:
    """Five weeks of a training run (2026-10-26 .. 2026-11-29, crossing a month end): a backup every
    3 hours while training runs, a two-day pause, every 13th write interrupted (partial), an evaluation
    tag every day at noon, a `release` tag twice, a noisy decreasing val_loss, and a few generations
    whose metrics lack val_loss or hold NaN."""
    rng = random.Random(20261026)
    start = datetime(2026, 10, 26, 0, 0, tzinfo=timezone.utc)
    gens: list[GenerationFacts] = []
    number = 0
    t = start
    end = start + timedelta(weeks=5)
    while t < end:
        paused = datetime(2026, 11, 10, tzinfo=timezone.utc) <= t < datetime(2026, 11, 12, tzinfo=timezone.utc)
        if not paused:
            number += 1
            progress = (t - start) / (end - start)
            loss = round(2.0 * math.exp(-3 * progress) + rng.uniform(-0.08, 0.08), 4)
            metrics: dict = {"val_loss": loss, "train": {"loss": round(loss * 0.9, 4)}}
            if number % 17 == 0:
                metrics = {"train": {"loss": 0.5}}
            if number % 23 == 0:
                metrics["val_loss"] = float("nan")
            tags = []
            if t.hour == 12:
                tags.append("eval")
            if number in (40, 200):
                tags.append("release")
            usable = number % 13 != 0
            jitter = timedelta(seconds=rng.randint(0, 600))
            gens.append(GenerationFacts(number, t + jitter, usable=usable, tags=tuple(tags), metrics=metrics,
                                        status="usable" if usable else "partial"))
        t += timedelta(hours=3)
    return gens


GOLDEN_POLICIES = {
    "restic_style": RetentionPolicy(keep_last=3, keep_daily=7, keep_weekly=4, keep_monthly=2),
    "hourly_and_tags": RetentionPolicy(keep_hourly=6, keep_tag=("release", "eval")),
    "within_and_best": RetentionPolicy(keep_within="2d", keep_best=3, best_by="val_loss:min"),
    "last_and_best": RetentionPolicy(keep_last=1, keep_best=1, best_by="val_loss:min"),
    "weekly_and_train_loss": RetentionPolicy(keep_weekly=10, keep_best=2, best_by="train.loss:min"),
}
GOLDEN_NOW = datetime(2026, 11, 30, 6, 0, tzinfo=timezone.utc)


def golden_text(got: dict) -> str:
    """JSON with one generation per line, so a changed decision shows as a one-line diff."""
    lines = ["{"]
    head = [k for k in got if not isinstance(got[k], list)]
    for k in head:
        lines.append(f" {json.dumps(k)}: {json.dumps(got[k])},")
    lists = [k for k in got if isinstance(got[k], list)]
    for i, k in enumerate(lists):
        lines.append(f" {json.dumps(k)}: [")
        items = got[k]
        for j, item in enumerate(items):
            lines.append("  " + json.dumps(item) + ("," if j < len(items) - 1 else ""))
        lines.append(" ]" + ("," if i < len(lists) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", sorted(GOLDEN_POLICIES))
def test_decision_matches_golden_file_for_a_five_week_schedule(name):
    gens = realistic_schedule()
    decision = apply_policy(gens, GOLDEN_POLICIES[name], GOLDEN_NOW)
    got = {"now": GOLDEN_NOW.isoformat(), "generations": len(gens), **decision.to_json()}
    text = golden_text(got)
    path = GOLDEN / f"{name}.json"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1 once and review it"
    assert json.loads(path.read_text()) == json.loads(text), (
        f"retention decision for {name!r} changed; if intended, regenerate with UPDATE_GOLDEN=1 and review the diff")
    # the golden files themselves obey the invariants
    all_numbers = {g.number for g in gens}
    seen = [n for part in ("keep", "remove", "not_usable") for n in (e["generation"] for e in got[part])]
    assert sorted(seen) == sorted(all_numbers)
    newest_usable = max(g.number for g in gens if g.usable)
    assert got["keep"][0]["generation"] == newest_usable


def test_restic_style_golden_keeps_one_per_day_for_seven_days():
    d = apply_policy(realistic_schedule(), GOLDEN_POLICIES["restic_style"], GOLDEN_NOW)
    days = [r for _, reasons in d.keep for r in reasons if r.startswith("daily ")]
    assert len(days) == 7 and len(set(days)) == 7
    weeks = [r for _, reasons in d.keep for r in reasons if r.startswith("weekly ")]
    assert weeks == ["weekly 2026-W48", "weekly 2026-W47", "weekly 2026-W46", "weekly 2026-W45"]
    months = [r for _, reasons in d.keep for r in reasons if r.startswith("monthly ")]
    assert months == ["monthly 2026-11", "monthly 2026-10"]


# ---------------------------------------------------------------------------------------------- properties
metric_values = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32),
                          st.integers(-5, 5))
gen_strategy = st.lists(
    st.tuples(st.integers(0, 24 * 90),  # hours since T0
              st.booleans(),  # usable
              st.lists(st.sampled_from(["a", "b", "c"]), max_size=2, unique=True),
              metric_values),
    min_size=0, max_size=25,
)
policy_strategy = st.builds(
    RetentionPolicy,
    keep_last=st.integers(0, 4), keep_hourly=st.integers(0, 3), keep_daily=st.integers(0, 4),
    keep_weekly=st.integers(0, 3), keep_monthly=st.integers(0, 2),
    keep_within=st.sampled_from([None, "6h", "2d", "1w", "1m"]),
    keep_tag=st.sampled_from([(), ("a",), ("b,c",), ("a", "c")]),
).flatmap(lambda p: st.sampled_from([p, RetentionPolicy(**{**p.to_dict(), "keep_best": 2, "best_by": "m:min"}),
                                     RetentionPolicy(**{**p.to_dict(), "keep_best": 1, "best_by": "m:max"})]))


def build(raw, monotonic: bool):
    hours = sorted(h for h, *_ in raw) if monotonic else [h for h, *_ in raw]
    return [GenerationFacts(i + 1, T0 + timedelta(hours=h), usable=u, tags=tuple(tags),
                            metrics={} if m is None else {"m": m}, status="usable" if u else "partial")
            for i, (h, (_, u, tags, m)) in enumerate(zip(hours, raw))]


def decide(gens, pol):
    try:
        return apply_policy(gens, pol, T0 + timedelta(days=100))
    except UsageError as exc:
        return exc


PROP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(gen_strategy, policy_strategy, st.booleans())
def test_property_newest_usable_always_kept_and_every_generation_accounted_once(raw, pol, mono):
    gens = build(raw, mono)
    if pol.is_empty():
        assert isinstance(decide(gens, pol), UsageError)
        return
    d = decide(gens, pol)
    usable = [g.number for g in gens if g.usable]
    if isinstance(d, UsageError):
        assert "keeps none" in str(d) and usable  # only refused when there was something to remove
        return
    assert sorted(d.keep_numbers + d.remove_numbers + [n for n, _ in d.not_usable]) == [g.number for g in gens]
    if usable:
        assert max(usable) in d.keep_numbers and dict(d.keep)[max(usable)][0] == NEWEST_USABLE
        assert d.keep, "a policy must never remove every generation"
    assert not set(d.keep_numbers + d.remove_numbers) & {g.number for g in gens if not g.usable}


@PROP
@given(gen_strategy, policy_strategy, st.booleans())
def test_property_not_usable_generations_never_change_the_decision_for_usable_ones(raw, pol, mono):
    gens = build(raw, mono)
    if pol.is_empty():
        return
    with_all = decide(gens, pol)
    only_usable = decide([g for g in gens if g.usable], pol)
    if isinstance(with_all, UsageError) or isinstance(only_usable, UsageError):
        assert type(with_all) is type(only_usable)
        return
    assert with_all.keep == only_usable.keep and with_all.remove == only_usable.remove


@PROP
@given(gen_strategy, policy_strategy, st.booleans())
def test_property_best_is_only_ever_a_finite_metric(raw, pol, mono):
    gens = build(raw, mono)
    d = decide(gens, pol) if not pol.is_empty() else None
    if d is None or isinstance(d, UsageError):
        return
    facts = {g.number: g for g in gens}
    for n, reasons in d.keep:
        if any(r.startswith("best ") for r in reasons):
            assert metric_value(facts[n].metrics, "m") is not None


@PROP
@given(gen_strategy, policy_strategy, st.booleans())
def test_property_pruning_twice_removes_nothing_more(raw, pol, mono):
    gens = build(raw, mono)
    if pol.is_empty():
        return
    first = decide(gens, pol)
    if isinstance(first, UsageError):
        return
    survivors = [g for g in gens if g.number not in set(first.remove_numbers)]
    second = decide(survivors, pol)
    assert not isinstance(second, UsageError)
    assert second.remove == [], "a second prune with the same policy must be a no-op"


@PROP
@given(gen_strategy, policy_strategy, st.booleans(), st.sampled_from(
    ["keep_last", "keep_hourly", "keep_daily", "keep_weekly", "keep_monthly"]))
def test_property_a_larger_count_never_keeps_less(raw, pol, mono, which):
    gens = build(raw, mono)
    if pol.is_empty():
        return
    small = decide(gens, pol)
    bigger = RetentionPolicy(**{**pol.to_dict(), which: getattr(pol, which) + 1})
    large = decide(gens, bigger)
    if isinstance(small, UsageError):
        return
    assert not isinstance(large, UsageError)
    assert set(small.keep_numbers) <= set(large.keep_numbers)


# ---------------------------------------------------------------------------------------------- never delete the only verified copy
class FakeRepo:
    """Generations 1..n, all usable; ``bad`` ones fail verify; records what is read and removed."""

    location = "fake-repo"

    def __init__(self, n, bad=()):
        self.numbers = list(range(1, n + 1))
        self.bad = set(bad)
        self.read: list[int] = []
        self.removed: list[int] = []

    def generations(self):
        return [self.generation(i) for i in self.numbers]

    def generation(self, number):
        from types import SimpleNamespace

        # a manifest without shared objects: the sweep after the removals has nothing to consider
        return SimpleNamespace(number=number, status="usable", manifest={"members": []}, error=None)

    def remove_generation(self, number, sweep=True):
        self.removed.append(number)
        self.numbers.remove(number)


@pytest.fixture
def fake_verify(monkeypatch):
    from ckpt_archive.ops import prune as prune_ops

    def verify_problems(repo, number):
        repo.read.append(number)
        return [f"tensors-00000.safetensors: stored sha256 mismatch (gen {number})"] if number in repo.bad else []

    monkeypatch.setattr(prune_ops, "_verify_problems", verify_problems)


def test_execute_prune_refuses_and_removes_nothing_when_no_generation_verifies(fake_verify):
    """Fault guarded: removing generations when none of those that would stay, nor any removed, verifies."""
    from ckpt_archive.errors import IntegrityError
    from ckpt_archive.ops.prune import execute_prune

    repo = FakeRepo(3, bad={1, 2, 3})
    decision = apply_policy(gens_with_losses([0.9, 0.8, 0.7]), RetentionPolicy(keep_last=1))
    with pytest.raises(IntegrityError, match=r"generation 3: tensors-00000.safetensors") as err:
        execute_prune(repo, decision)
    assert err.value.exit_code == 1 and "nothing was removed" in err.value.message
    assert "generation 1: " in err.value.message and "generation 2: " in err.value.message
    assert repo.removed == [] and repo.read == [3, 2, 1]


def test_when_no_kept_generation_verifies_the_newest_one_removed_that_does_is_kept(fake_verify):
    """Fault guarded (issue 24 item 1): retention removed every generation that restores because the one it
    kept was damaged. The generations slated for removal are checked newest first; the newest that passes
    stays (the check says so: never silent) and the others go."""
    from ckpt_archive.ops.prune import check_kept, execute_prune

    repo = FakeRepo(5, bad={5, 4})
    decision = apply_policy(gens_with_losses([0.9] * 5), RetentionPolicy(keep_last=1))
    check = check_kept(repo, decision)
    assert repo.read == [5, 4, 3]
    assert check.ok and check.verified is None and check.rescued == 3
    assert [n for n, _ in check.failed] == [5] and [n for n, _ in check.rescue_failed] == [4]
    assert len(check.warnings()) == 1 and "generation 3, the newest that does, is kept" in check.warnings()[0]
    assert execute_prune(repo, decision, check=check) == [1, 2, 4]
    assert repo.numbers == [3, 5]


def test_check_kept_walks_kept_generations_newest_first_and_stops_at_the_first_that_verifies(fake_verify):
    from ckpt_archive.ops.prune import check_kept, execute_prune

    repo = FakeRepo(6, bad={6, 5})
    decision = apply_policy(gens_with_losses([0.9] * 6), RetentionPolicy(keep_last=4))
    check = check_kept(repo, decision)
    assert repo.read == [6, 5, 4]  # 3 is kept too, but 4 already verified
    assert check.ok and check.verified == 4 and [n for n, _ in check.failed] == [6, 5]
    assert [w.split(" does not")[0] for w in check.warnings()] == ["kept generation 6", "kept generation 5"]
    assert execute_prune(repo, decision, check=check) == [1, 2]


def test_check_kept_trusts_a_just_verified_generation_without_reading_it(fake_verify):
    from ckpt_archive.ops.prune import check_kept

    repo = FakeRepo(3, bad={3})  # even if it would fail now: pack verified it under this very lock
    decision = apply_policy(gens_with_losses([0.9, 0.8, 0.7]), RetentionPolicy(keep_last=1))
    check = check_kept(repo, decision, verified=(3,))
    assert check.ok and check.trusted and check.verified == 3 and repo.read == []


def test_check_kept_reads_nothing_when_nothing_is_removed(fake_verify):
    from ckpt_archive.ops.prune import check_kept, execute_prune

    repo = FakeRepo(3, bad={1, 2, 3})
    decision = apply_policy(gens_with_losses([0.9, 0.8, 0.7]), RetentionPolicy(keep_last=3))
    check = check_kept(repo, decision)
    assert check.ok and not check.needed and repo.read == []
    assert execute_prune(repo, decision, check=check) == []


def test_keep_best_reads_numpy_scalar_metrics_and_keeps_the_best_generation(tmp_path):
    # metrics={"val_loss": np.mean(losses)} is a NumPy float64: the manifest tags it, and keep-best
    # must still read it, or the best generation is the one retention deletes.
    import numpy as np
    import torch

    import ckpt_archive

    repo = str(tmp_path / "repo")
    policy = {"keep_best": 1, "best_by": "val_loss:min", "keep_last": 1}
    for loss in (np.mean([0.05]), np.float32(0.2), 0.3):
        ckpt_archive.pack({"w": torch.zeros(2)}, repo, annotations=ckpt_archive.Annotations(metrics={"val_loss": loss}), retention=ckpt_archive.RetentionPolicy.from_dict(policy))
    assert [g.number for g in ckpt_archive.list_generations(repo)] == [1, 3]
    assert metric_value({"val_loss": {"$t": "npscalar", "dtype": "<f4", "hex": "9a99993e"}}, "val_loss") \
        == pytest.approx(0.3)
    assert metric_value({"ok": {"$t": "npscalar", "dtype": "|b1", "hex": "01"}}, "ok") is None


def test_retention_policy_imports_no_repository_store_or_operation():
    # the pure policy once imported ops.api to verify kept generations: an import cycle, and I/O in
    # the function that golden files and property tests treat as pure
    import subprocess
    import sys

    code = ("import sys, ckpt_archive.retention.policy as p; "
            "print(sorted(m for m in sys.modules if m.startswith(('ckpt_archive.repo', 'ckpt_archive.store', "
            "'ckpt_archive.ops', 'ckpt_archive.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_apply_policy_refuses_a_dict_instead_of_guessing_what_it_means():
    with pytest.raises(UsageError, match="must be a RetentionPolicy"):
        apply_policy(gens_with_losses([0.1, 0.2]), {"keep_last": 1}, T0)
