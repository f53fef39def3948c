"""A frozen format-1 archive (tests/fixtures/v1-basic) must stay readable by every later version.

Never regenerate the fixture: a change that breaks this test broke old archives people keep.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import ckpt_archive
from tests.fixture_state import fixture_state
from tests.helpers import assert_same

FIXTURE = Path(__file__).parent / "fixtures" / "v1-basic"


def test_frozen_v1_archive_loads_exactly(tmp_path):
    repo = tmp_path / "v1"
    shutil.copytree(FIXTURE, repo)
    # Copied to a new place: listed as copied until a deep verify proves it here.
    rep = ckpt_archive.verify(repo, "1", deep=True)
    assert rep.ok, rep.problems
    assert rep.marked_usable
    assert_same(fixture_state(), ckpt_archive.load(repo, "latest"))


def test_frozen_v1_manifest_still_validates():
    from ckpt_archive.format.manifest import parse

    doc = parse((FIXTURE / "generations" / "00000001" / "manifest.json").read_bytes())
    assert doc["format_version"] == 1 and doc["tags"] == ["frozen"] and doc["config"] == {"lr": 0.001, "batch": 4}
