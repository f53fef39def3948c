"""Timestamps as the tool writes and reads them: UTC, RFC 3339.

One writer (:func:`iso` of :func:`utcnow`: ``2026-12-01T10:00:00.123456Z``) for every time the tool records
(a manifest's ``created``, a marker's and a note's ``when``, the lock owner's ``since``), and THE parser of a
time read from an archive (:func:`parse_time`: hostile text gives None, "unknown", never a crash).
"""
from __future__ import annotations

import datetime as dt
import re


def utcnow() -> dt.datetime:
    """Now, as an aware UTC datetime (what :func:`iso` writes)."""
    return dt.datetime.now(dt.timezone.utc)


def iso(t: dt.datetime) -> str:
    """``t`` (an aware datetime) in UTC as RFC 3339 with ``Z``: the one way the tool writes a time into a
    manifest, a marker, a note or a lock owner file.

    Example:
        >>> iso(dt.datetime(2026, 12, 1, 11, 0, tzinfo=dt.timezone(dt.timedelta(hours=1))))
        '2026-12-01T10:00:00Z'
    """
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})$")


def parse_time(text: str | None) -> dt.datetime | None:
    """THE parser of a timestamp read from an archive (a manifest's ``created``, a marker's times):
    RFC 3339 (``T``/``t`` or a space between date and time, ``Z``/``z`` or an offset), returned in UTC.
    Anything else, including a time without an offset, is None ("unknown"), never a crash.

    Example:
        >>> parse_time("2026-12-01t10:00:00z") == parse_time("2026-12-01T11:00:00+01:00")
        True
        >>> parse_time("2026-12-01T10:00:00") is None
        True
    """
    if not text or not isinstance(text, str) or not _RFC3339.match(text):
        return None
    norm = text[:10] + "T" + text[11:]
    if norm[-1] in "Zz":
        norm = norm[:-1] + "+00:00"
    try:
        return dt.datetime.fromisoformat(norm).astimezone(dt.timezone.utc)
    except (ValueError, OverflowError):  # a hostile manifest's "created" is shown as unknown, never a crash
        return None


__all__ = ["utcnow", "iso", "parse_time"]
