"""The one temp-file-then-rename writer (``ckpt_archive.store.local.write_atomic`` / ``atomic_path``)."""
from __future__ import annotations

import pytest

from ckpt_archive.store.local import LocalStore, atomic_path, write_atomic


def test_a_failed_atomic_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path):
    target = tmp_path / "report.json"
    write_atomic(target, b"old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half of the n")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_write_atomic_creates_missing_folders_and_replaces_the_whole_content(tmp_path):
    target = tmp_path / "a" / "b" / "f.bin"
    write_atomic(target, b"x" * 10)
    write_atomic(target, b"y")
    assert target.read_bytes() == b"y" and sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]


def test_local_store_replace_uses_a_temporary_name_gc_recognises(tmp_path, monkeypatch):
    # gc removes ".NAME.tmp-PID" leftovers; a writer using another temporary name would leave garbage
    # that gc never finds
    from ckpt_archive.ops.gc import TMP_NAME
    from ckpt_archive.store import local

    seen = []
    real = local.temp_sibling
    monkeypatch.setattr(local, "temp_sibling", lambda p: seen.append(real(p)) or real(p))
    LocalStore(str(tmp_path)).replace_bytes("USABLE.json", b"{}\n")
    assert len(seen) == 1 and TMP_NAME.match(seen[0].name)
