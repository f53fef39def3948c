"""Data identity (issue 12): the resuming session's data ids against the archived ones, key order aside."""
from __future__ import annotations

import json

import pytest
import torch

import ckpt_archive
from ckpt_archive.format.data_ids import fingerprint
from ckpt_archive.ops.data_identity import DataIdentityMismatch, compare_data_ids

from tests.helpers import cli_in_process


def _cli(*args):
    return cli_in_process(*args)  # what the commands say; the process boundary is not what these tests are about


def _packed(tmp_path, ids):
    repo = tmp_path / "repo"
    ckpt_archive.pack({"model": {"w": torch.ones(2)}, "step": 3}, str(repo),
                      annotations=ckpt_archive.ops.pack.Annotations(data_ids=ids))
    return repo


LABELS = {"cat": 0, "dog": 1, "person": 3, "car": 2}


def test_label_map_fingerprint_changes_when_only_the_key_order_changes(tmp_path):
    reordered = dict(reversed(list(LABELS.items())))
    assert fingerprint(LABELS) == fingerprint(reordered)
    a = ckpt_archive.inspect(str(_packed(tmp_path / "a", LABELS))).manifest["data"]["fingerprint"]
    b = ckpt_archive.inspect(str(_packed(tmp_path / "b", reordered))).manifest["data"]["fingerprint"]
    assert a == b == fingerprint(LABELS)


def test_rebuilt_label_map_with_changed_entry_is_restored_silently(tmp_path):
    repo = _packed(tmp_path, LABELS)
    now = {"car": 2, "cat": 0, "person": 1, "dog": 1, "bird": 4}
    del now["dog"]
    with pytest.raises(DataIdentityMismatch) as exc:
        ckpt_archive.restore(str(repo), output=str(tmp_path / "out.pt"),
                             options=ckpt_archive.RestoreOptions(data_ids=now))
    text = str(exc.value)
    assert "person: archived 3, now 1" in text
    assert "bird: added" in text and "dog: removed" in text
    assert not (tmp_path / "out.pt").exists()  # refused before anything was written


def test_identical_label_map_in_another_key_order_is_refused_or_warned(tmp_path):
    repo = _packed(tmp_path, LABELS)
    res = ckpt_archive.restore(str(repo), output=str(tmp_path / "out.pt"),
                               options=ckpt_archive.RestoreOptions(
                                   data_ids=dict(sorted(LABELS.items(), key=lambda kv: -kv[1]))))
    assert res.warnings == []
    assert res.extra["data_ids"]["checked"] and res.extra["data_ids"]["same"]


def test_changed_data_ids_pass_the_cli_restore_with_exit_0(tmp_path):
    repo = _packed(tmp_path, LABELS)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({**LABELS, "person": 1}))
    r = _cli("restore", str(repo), "-o", str(tmp_path / "out.pt"), "--data-ids", str(ids))
    assert r.returncode == 1, r.stderr
    assert "person: archived 3, now 1" in r.stderr and "--allow-data-change" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out.pt").exists()
    r = _cli("restore", str(repo), "-o", str(tmp_path / "out.pt"), "--data-ids", str(ids), "--allow-data-change",
             "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["data_ids"]["diff"]["changed"] == [{"key": "person", "archived": 3, "session": 1}]
    assert r.stderr == "" and "person: archived 3, now 1" in r.stdout  # --json: the warning is in the JSON


def test_tokenizer_fingerprint_change_is_not_noticed(tmp_path):
    repo = _packed(tmp_path, {"tokenizer": "sha256:aaa", "dataset": "sha256:bbb"})
    with pytest.raises(DataIdentityMismatch, match="tokenizer: archived sha256:aaa, now sha256:ccc"):
        ckpt_archive.restore(str(repo), output=str(tmp_path / "o.pt"),
                             options=ckpt_archive.RestoreOptions(
                                 data_ids={"dataset": "sha256:bbb", "tokenizer": "sha256:ccc"}))


def test_archive_without_data_ids_claims_they_matched(tmp_path):
    repo = tmp_path / "repo"
    ckpt_archive.pack({"w": torch.ones(1)}, str(repo))
    res = ckpt_archive.restore(str(repo), output=str(tmp_path / "o.pt"),
                               options=ckpt_archive.RestoreOptions(data_ids={"a": 1}))
    assert res.extra["data_ids"]["checked"] is False
    assert any("holds no data ids" in w for w in res.warnings)


def test_list_ids_compare_by_position_not_as_a_set():
    d = compare_data_ids(["a.jpg", "b.jpg"], ["b.jpg", "a.jpg"])
    assert not d.same and d.lines()[0] == "[0]: archived a.jpg, now b.jpg"


def test_old_archive_with_unsorted_data_ids_member_still_verifies_and_compares(tmp_path):
    """An archive written before the canonical form holds the ids in their given order."""
    from unittest import mock

    import ckpt_archive.format.data_ids as di

    unsorted = {"z": 1, "a": 2}
    with mock.patch.object(di, "canonical_bytes",
                           lambda v: json.dumps(v, allow_nan=False, ensure_ascii=False).encode("utf-8")):
        repo = _packed(tmp_path, unsorted)
    assert ckpt_archive.verify(str(repo), options=ckpt_archive.VerifyOptions(deep=True)).ok
    res = ckpt_archive.restore(str(repo), output=str(tmp_path / "o.pt"),
                               options=ckpt_archive.RestoreOptions(data_ids={"a": 2, "z": 1}))
    assert res.extra["data_ids"]["same"]
