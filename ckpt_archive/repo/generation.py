"""One generation of a repository as a reader sees it (:class:`Generation`), and how generations are named:
``generations/NNNNNNNN``, eight digits (:func:`gen_key`, :data:`GEN_NAME`, :data:`MAX_GENERATION`). Listed and
judged by :class:`ckpt_archive.repo.repository.Repository`, which re-exports these names.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import re

from ckpt_archive.errors import CkptArchiveError
from ckpt_archive.format.metrics import read_metrics
from ckpt_archive.format.times import iso, parse_time

GEN_DIR = "generations"
#: A generation folder's name: eight digits (any other name in ``generations/`` is no generation).
GEN_NAME = re.compile(r"^\d{8}$")
#: The highest generation number a folder can carry (``gen_key``: 8 digits; ``GEN_NAME``, so every reader,
#: sees no other name). A claim that would need more is refused, never a 9-digit folder nobody lists.
MAX_GENERATION = 99_999_999


def gen_key(number: int) -> str:
    """The store key of generation ``number``'s folder (``generations/00000007``)."""
    return f"{GEN_DIR}/{number:08d}"


@dataclasses.dataclass
class Generation:
    """One generation as a reader sees it.

    Attributes:
        number: the generation number (1, 2, ...).
        status: ``usable`` (marker matches, at this location), ``partial`` (no marker: interrupted or
            being deleted), ``copied`` (marker matches but names another location: proven there, not
            here; restore and load read it anyway, checking every byte, and ``adopt`` makes it usable
            here), ``damaged`` (manifest or marker unreadable, or the manifest changed after publish).
        reason: why it is not usable (None when usable).
        manifest: the parsed manifest, or None.
        marker: the parsed marker, or None.
        manifest_sha256: sha256 of ``manifest.json`` as stored, or None.
    """

    number: int
    status: str
    reason: str | None = None
    manifest: dict | None = None
    marker: dict | None = None
    manifest_sha256: str | None = None
    error: CkptArchiveError | None = None
    check_failed: dict | None = None  # the CHECK-FAILED.json note that made it ``damaged``, if one did
    #: ``damaged`` only by a recorded failed check, and its marker names this place (it was usable here):
    #: ``@latest`` still stops at it, and readers refuse it naming the newest that verifies (--fallback)
    found_damaged_here: bool = False
    #: fingerprint (``SHA256:...``) of the key whose valid signature the marker carries, or None (unsigned)
    signer: str | None = None

    def __repr__(self) -> str:
        return (f"Generation({self.number}, {self.status!r}, step={self.step!r}, "
                f"archive_id={(self.manifest or {}).get('archive_id')!r})")

    @property
    def key(self) -> str:
        return gen_key(self.number)

    path = key

    @property
    def created(self) -> dt.datetime | None:
        return parse_time(self.manifest.get("created")) if self.manifest else None

    @property
    def step(self) -> int | None:
        return (self.manifest or {}).get("progress", {}).get("step")

    @property
    def tags(self) -> list[str]:
        return list((self.manifest or {}).get("tags", []))

    @property
    def found_wrong(self) -> bool:
        """``damaged`` because something of it was read and found wrong (a manifest or marker that breaks its
        rules, a changed manifest, a recorded failed check): what ``verify`` of it reports with exit 1. Not a
        manifest this reader cannot judge (a newer format: exit 2, nothing was found wrong)."""
        from ckpt_archive.errors import EXIT_CHECK_FAILED

        return self.status == "damaged" and getattr(self.error, "exit_code", EXIT_CHECK_FAILED) == EXIT_CHECK_FAILED

    @property
    def metrics(self) -> dict:
        """The manifest's metrics as plain JSON values (old manifests' tagged values read here, once:
        :func:`ckpt_archive.format.metrics.read_metrics`)."""
        return read_metrics((self.manifest or {}).get("metrics"))

    @property
    def raw_bytes(self) -> int | None:
        return (self.manifest or {}).get("summary", {}).get("raw_bytes")

    @property
    def stored_bytes(self) -> int | None:
        return (self.manifest or {}).get("summary", {}).get("stored_bytes")

    @property
    def usable(self) -> bool:
        return self.status == "usable"

    @property
    def readable(self) -> bool:
        """Usable here, or ``copied`` (published and proven at another place): what restore and load read."""
        return self.status in ("usable", "copied")

    def to_json(self) -> dict:
        created = self.created
        return {"generation": self.number, "status": self.status, "reason": self.reason, "step": self.step,
                "epoch": (self.manifest or {}).get("progress", {}).get("epoch"),
                "created": iso(created) if created else None, "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes, "tags": self.tags, "metrics": self.metrics,
                "archive_id": (self.manifest or {}).get("archive_id"),
                "source_format": (self.manifest or {}).get("source", {}).get("format"), "signed_by": self.signer}


__all__ = ["GEN_DIR", "GEN_NAME", "MAX_GENERATION", "gen_key", "Generation"]
