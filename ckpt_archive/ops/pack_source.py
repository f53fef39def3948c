"""Pack's reads of its source: the first phase's progress, and the proofs that the bytes archived are those of
one version of the source -- its scans saw the file unchanged, and a retry's second read gave what the first
did (else :class:`~ckpt_archive.errors.SourceChanged`, naming the file). Used by :mod:`ckpt_archive.ops.pack`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpt_archive.errors import SourceChanged, SourceError


class ReadProgress:
    """[issue 26] The first phase of packing a file or folder, ``read and hash NAME``: while ``torch.load``
    parses the source, the bytes its early scan (:class:`~ckpt_archive.format.exact_bytes.ScanJob`: sha256,
    range fingerprints, zip CRCs) has read are reported to ``on_bytes`` every 0.2 s from one helper thread,
    which is stopped (joined) before pack reports anything else, so calls never overlap. A source without a
    scan (a folder, a legacy pickle) has its phase named, without a total. Nothing for a state given as an
    object, or without a callback."""

    def __init__(self, on_bytes, source: Any, scan) -> None:
        import threading

        self.on_bytes, self.scan, self._sent, self._thread = on_bytes, scan, 0, None
        self._stop = threading.Event()
        if on_bytes is None or not isinstance(source, (str, os.PathLike)):
            return
        from ckpt_archive.repo.publish import phase

        name = Path(source).name or str(source)
        if scan is None:
            phase(on_bytes, f"read {name}")
            return
        try:
            size = scan.path.stat().st_size
        except OSError:
            size = None
        phase(on_bytes, f"read and hash {name}", size)
        self._thread = threading.Thread(target=self._feed, name="ckpt-read-progress", daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        while not self._stop.wait(0.2):
            self._send()

    def _send(self) -> None:
        done = self.scan.progress[0]
        if done > self._sent:
            delta, self._sent = done - self._sent, done
            self.on_bytes(delta)

    def stop(self) -> None:
        """End the phase: the helper thread is joined and what was read meanwhile reported (idempotent)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._send()


def raw_total(p: Any) -> int | None:
    """Raw bytes the write phase handles: the state's tensor entries and the files stored as they are."""
    try:
        total = sum(e.nbytes for e in p.encoded[1].entries.values())
        for sf in p.source.files:
            if sf.kind in ("raw", "opaque") and sf.path is not None and not getattr(sf, "link_of", None):
                total += sf.path.stat().st_size
        return total
    except (AttributeError, IndexError, TypeError, OSError):
        return None


def source_fingerprints(manifest: dict) -> dict:
    """What a write read of the source, as fingerprints: every tensor entry's and leaf's raw fingerprint, every
    member made of a source file's bytes (a raw file, a skeleton), every source file's size and sha256."""
    members = manifest["members"]
    return {"entries": {k: v.get("raw_fp") for m in members if m["role"] == "tensors"
                        for k, v in (m.get("entries") or {}).items()},
            "members": {m["path"]: (m.get("raw_bytes"), m.get("raw_fp")) for m in members if m["role"] == "file"},
            "tensors": {leaf: rec.get("raw_fp") for leaf, rec in manifest["tensors"].items()},
            "files": {f["relpath"]: (f.get("raw_bytes"), f.get("sha256"))
                      for f in manifest["source"].get("files") or []}}


def same_source(first: dict, again: dict, source: Any) -> None:
    """[break] The retry's read of the source must have given the bytes of the first: else SourceChanged, naming
    the file, before the manifest is sealed (the generation is withdrawn: never old and new bytes in one)."""
    from ckpt_archive.format.read_lease import changed

    if first == again:
        return
    root = Path(source.root) if getattr(source, "root", None) else None
    where = next((sf.path for sf in source.files if sf.path is not None and len(source.files) == 1), None)
    for rel, fps in again["files"].items():
        if first["files"].get(rel) != fps:
            where = next((sf.path for sf in source.files if sf.relpath == rel and sf.path is not None), where)
            break
    raise changed(where or root or "the source", "it was rewritten after pack read it, before the retry read it "
                                                  "again")


def raise_if_changed(scans) -> None:
    """SourceChanged when a source file the pack read (``scans``: ScanJobs) is no longer the file its read
    began on."""
    for scan in scans:
        if not scan.unchanged():
            raise SourceChanged("the file changed while it was being packed (replaced, rewritten or touched): "
                                "its tensors and its bytes may come from different versions; nothing was "
                                "kept -- pack it again once it is complete", where=str(scan.path))


def crc_reason_first(scan) -> None:
    """The source was unreadable: if the early scan finds a record that fails its CRC, that more precise
    reason is raised instead (SourceError); any other outcome of the scan leaves the caller's error."""
    if scan is None:
        return
    try:
        scan.checked()
    except SourceError:
        raise
    except Exception:  # noqa: BLE001 - the file's own error (being raised by the caller) stands
        pass


__all__ = ["ReadProgress", "raw_total", "source_fingerprints", "same_source", "raise_if_changed",
           "crc_reason_first"]
