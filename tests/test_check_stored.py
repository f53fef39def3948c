"""The shallow check's fast paths (issue 14): one hash pool over every stored file with several files in
flight, and manifests that passed their checks once not validated again in the process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt_archive
from ckpt_archive.errors import ManifestInvalid
from ckpt_archive.format import manifest as manifest_mod
from ckpt_archive.repo import reader as reader_mod


def _gen(repo: Path, n: int = 1) -> Path:
    return repo / "generations" / f"{n:08d}"


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_files_in_flight_still_report_every_damaged_file_in_member_order(tmp_path, monkeypatch):
    """With chunk checks of later files submitted before earlier ones are collected, a damaged file
    must still be found, each one named, and the problems listed in the manifest's member order."""
    repo = tmp_path / "repo"
    ckpt_archive.pack({"w": torch.arange(4096, dtype=torch.float32), "n": 3}, repo)
    gen = _gen(repo)
    members = [m for m in json.loads((gen / "manifest.json").read_text())["members"] if not m.get("objects")]
    assert len(members) >= 2
    first, last = members[0], members[-1]
    _flip_last_byte(gen / first["stored_path"])
    _flip_last_byte(gen / last["stored_path"])
    for in_flight in (1, 16):
        monkeypatch.setattr(reader_mod, "FILES_IN_FLIGHT", in_flight)
        rep = ckpt_archive.verify(repo, "1")
        assert not rep.ok
        named = [p.member for p in rep.problems]
        assert named[:2] == [first["path"], last["path"]], named


def test_manifest_bytes_changed_after_passing_are_checked_again(tmp_path):
    """The per-process cache of manifests that passed must be keyed by their bytes: a changed manifest
    (here breaking the schema) is refused even after the original passed, and every caller gets its own
    dict."""
    repo = tmp_path / "repo"
    ckpt_archive.pack({"w": torch.ones(8)}, repo)
    raw = (_gen(repo) / "manifest.json").read_bytes()
    a = manifest_mod.parse(raw)
    b = manifest_mod.parse(raw)
    assert a == b and a is not b
    a["members"].clear()
    assert manifest_mod.parse(raw)["members"]
    doc = json.loads(raw)
    doc["members"][0]["raw_bytes"] = "many"
    with pytest.raises(ManifestInvalid):
        manifest_mod.parse(json.dumps(doc).encode())
