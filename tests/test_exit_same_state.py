"""One state, one verdict: every command that meets a partial, damaged or newer-format generation (or a repository
whose every generation is damaged) exits with the same code (README: 1 something was found wrong, 2 could not
be carried out). In-process (tests/helpers.py: cli_in_process); tiny states."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckpt_archive
from ckpt_archive.errors import NoUsableGeneration
from tests.helpers import cli_in_process as cli

torch = pytest.importorskip("torch")


def make_repo(path: Path, n: int = 2, tags=()) -> Path:
    for i in range(1, n + 1):
        ckpt_archive.pack({"w": torch.full((3,), float(i)), "step": i}, path,
                          annotations=ckpt_archive.Annotations(tags=tuple(tags)))
    return path


def gen_dir(repo: Path, n: int) -> Path:
    return repo / "generations" / f"{n:08d}"


def edit_manifest(repo: Path, n: int, change) -> None:
    p = gen_dir(repo, n) / "manifest.json"
    m = json.loads(p.read_text())
    change(m)
    p.write_text(json.dumps(m))


def changed_after_publish(repo: Path, n: int) -> None:
    """Damage that is found by reading the manifest: it no longer matches its marker's sha256."""
    edit_manifest(repo, n, lambda m: m.update(code_version="edited"))


def codes(repo_spec: str, tmp_path: Path) -> dict[str, int]:
    out = tmp_path / "out.pt"
    dest = tmp_path / "dest"
    return {
        "verify": cli("verify", repo_spec).returncode,
        "restore": cli("restore", repo_spec, "-o", out).returncode,
        "export": cli("export", repo_spec, "--to", dest).returncode,
    }


def test_verify_of_a_partial_generation_exits_2_as_restore_and_export_do(tmp_path):
    """Fault (break test): `verify REPO@N` of a partial (never published) generation exited 1 ("found wrong")
    while `restore REPO@N` and `export` exited 2; a partial generation is nothing found wrong: exit 2 everywhere,
    and the library's verify raises the same error restore and load raise."""
    repo = make_repo(tmp_path / "r")
    (gen_dir(repo, 2) / "USABLE.json").unlink()
    assert codes(f"{repo}@2", tmp_path) == {"verify": 2, "restore": 2, "export": 2}
    res = cli("verify", f"{repo}@2")
    assert "partial" in res.stderr and "never published" in res.stderr, res.stderr
    with pytest.raises(ckpt_archive.errors.NotUsable):
        ckpt_archive.verify(repo, 2)
    with pytest.raises(ckpt_archive.errors.NotUsable):
        ckpt_archive.load(repo, 2)
    assert cli("verify", repo).returncode == 0  # latest is generation 1, untouched


def test_export_of_a_damaged_generation_exits_1_as_restore_and_verify_do(tmp_path):
    """Fault (break test): `export REPO@N` of a damaged generation exited 2 ("could not be carried out") while
    `restore`/`verify` of the same damage exit 1."""
    repo = make_repo(tmp_path / "r")
    changed_after_publish(repo, 2)
    assert codes(f"{repo}@2", tmp_path) == {"verify": 1, "restore": 1, "export": 1}
    res = cli("export", f"{repo}@2", "--to", tmp_path / "dest2", "--json")
    assert json.loads(res.stdout)["exit_code"] == 1 and res.returncode == 1


def test_latest_when_every_published_generation_is_damaged_exits_1_not_2(tmp_path):
    """Fault (break test): `restore REPO` (no generation named) when every generation was found damaged exited 2
    (NoUsableGeneration: "could not be carried out") while `restore REPO@N` of each exits 1. Every candidate
    found damaged is a failed check (1), for verify, restore, export and load; the library error says so with
    its exit code and is still a NoUsableGeneration (callers catching that keep working)."""
    repo = make_repo(tmp_path / "r")
    changed_after_publish(repo, 1)
    changed_after_publish(repo, 2)
    assert codes(str(repo), tmp_path) == {"verify": 1, "restore": 1, "export": 1}
    assert cli("export", repo, "--to", tmp_path / "d2", "--all-usable").returncode == 1
    with pytest.raises(NoUsableGeneration) as caught:
        ckpt_archive.load(repo)
    assert type(caught.value).__name__ == "AllGenerationsDamaged" and caught.value.exit_code == 1
    assert "damaged" in str(caught.value)


def test_no_usable_generation_without_damage_stays_exit_2(tmp_path):
    """The other side of the rule: an empty repository, one holding only partial generations, or a damaged one
    beside one in a newer format (which cannot be judged here) is not "every candidate found damaged": exit 2."""
    empty = tmp_path / "empty"
    ckpt_archive.Repository.open(empty, create=True)
    assert codes(str(empty), tmp_path) == {"verify": 2, "restore": 2, "export": 2}
    only_partial = make_repo(tmp_path / "p", 1)
    (gen_dir(only_partial, 1) / "USABLE.json").unlink()
    assert codes(str(only_partial), tmp_path) == {"verify": 2, "restore": 2, "export": 2}
    mixed = make_repo(tmp_path / "m")
    changed_after_publish(mixed, 1)
    edit_manifest(mixed, 2, lambda m: m.update(format_version=99))
    assert codes(str(mixed), tmp_path) == {"verify": 2, "restore": 2, "export": 2}


def test_a_tag_whose_every_generation_is_damaged_exits_1(tmp_path):
    repo = make_repo(tmp_path / "r", tags=("nightly",))
    changed_after_publish(repo, 1)
    changed_after_publish(repo, 2)
    assert codes(f"{repo}@tag:nightly", tmp_path) == {"verify": 1, "restore": 1, "export": 1}
    assert codes(f"{repo}@tag:weekly", tmp_path) == {"verify": 2, "restore": 2, "export": 2}  # no such tag


def test_restore_of_a_newer_format_generation_says_newer_format_and_upgrade_not_damaged(tmp_path):
    """Fault (break test): restore called a manifest written by a newer format "damaged" (and suggested
    --restore-unverified, which cannot read it either); verify says it is a newer format and to upgrade.
    Exit 2 from every command: nothing was found wrong."""
    repo = make_repo(tmp_path / "r")
    edit_manifest(repo, 2, lambda m: m.update(format_version=99))
    assert codes(f"{repo}@2", tmp_path) == {"verify": 2, "restore": 2, "export": 2}
    for args in (("restore", f"{repo}@2", "-o", tmp_path / "o.pt"), ("export", f"{repo}@2", "--to", tmp_path / "d")):
        res = cli(*args)
        assert "newer format" in res.stderr and "upgrade ckpt-archive" in res.stderr, res.stderr
        assert "damaged" not in res.stderr and "--restore-unverified" not in res.stderr, res.stderr
