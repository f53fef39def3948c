"""The one temp-file-then-rename writer (the file layer: ``ckpt_archive.store.fs.Dir.atomic_file`` /
``write_file_atomic``)."""
from __future__ import annotations

import pytest

from ckpt_archive.store.fs import Dir, write_file_atomic


def test_a_failed_atomic_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path):
    target = tmp_path / "report.json"
    write_file_atomic(target, b"old\n")
    with pytest.raises(RuntimeError), Dir.open(tmp_path) as folder:
        with folder.atomic_file("report.json") as fh:
            fh.write(b"half of the n")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_write_atomic_creates_missing_folders_and_replaces_the_whole_content(tmp_path):
    target = tmp_path / "a" / "b" / "f.bin"
    write_file_atomic(target, b"x" * 10)
    write_file_atomic(target, b"y")
    assert target.read_bytes() == b"y" and sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]


def test_local_store_replace_uses_a_temporary_name_gc_recognises_and_no_one_can_guess(tmp_path, monkeypatch):
    """gc removes ``.NAME.tmp-...`` leftovers: a writer using another temporary name would leave garbage gc
    never finds. And the name is random (``.NAME.tmp-PID`` could be planted as a link for every pid), so
    two writes of the same key never use the same temporary name."""
    from ckpt_archive.ops.gc import TMP_NAME
    from ckpt_archive.store import fs
    from ckpt_archive.store.local import LocalStore

    seen = []
    real = fs.temp_name
    monkeypatch.setattr(fs, "temp_name", lambda name, kind="tmp": seen.append(real(name, kind)) or seen[-1])
    store = LocalStore(str(tmp_path))
    store.replace_bytes("USABLE.json", b"{}\n")
    store.replace_bytes("USABLE.json", b"{}\n")
    assert len(seen) == 2 and all(TMP_NAME.match(n) for n in seen) and seen[0] != seen[1]
    assert seen[0].startswith(".USABLE.json.tmp-")
