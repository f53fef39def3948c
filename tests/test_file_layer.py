"""The one file layer (``ckpt_archive/store/fs.py``): nothing outside ``store/`` touches a file any other way;
what the layer guarantees (links refused, a full disk at a repository's creation, a read-only repository).

The scan parses every module of the package (``ast``, not grep: a comment or a string never counts, and
``text.replace(a, b)`` is not ``Path.replace``) and lists each raw file operation outside ``store/``:
``open(...)``, ``os.open/replace/rename/link/unlink/remove/mkdir/makedirs/...``, ``shutil.rmtree/move/copy*``,
``tempfile.*``, ``Path.mkdir/unlink/rmdir/write_bytes/write_text/open/rename/replace/touch``. Each must be in
the allowlist below, which says why it touches no repository and no restore/export target. A new raw write
in a repository or a target fails here: route it through :mod:`ckpt_archive.store.fs` instead.
"""
from __future__ import annotations

import ast
import errno
import os
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpt_archive.cli.app import app
from ckpt_archive.store import fs

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_archive"

_OS_OPS = {"open", "replace", "rename", "renames", "link", "symlink", "unlink", "remove", "rmdir", "removedirs",
           "mkdir", "makedirs", "truncate", "mkfifo", "mknod", "chmod", "chown"}
_SHUTIL_OPS = {"rmtree", "move", "copy", "copy2", "copyfile", "copytree", "copymode", "copystat"}
_READ_FLAGS = {"O_RDONLY", "O_NONBLOCK", "O_NOFOLLOW", "O_CLOEXEC", "O_DIRECTORY"}
_MODE = re.compile(r"^[rwxabt+]+$")

#: Reads outside the store, by module: a read changes no byte. The store reads the repository; these read
#: what the user hands in (a source checkpoint), /proc, or read back a file restore just staged (through
#: its staging folder's descriptor, ``Entry.path``).
READS = {
    "ckpt_archive/sources/": "a source checkpoint (what pack and backup read)",
    "ckpt_archive/repo/writer.py": "a source file's bytes, read into members",
    "ckpt_archive/ops/backup.py": "backup's completeness check of a source file",
    "ckpt_archive/format/exact_bytes.py": "a source file's scan; a staged restore file read back (Entry.path)",
    "ckpt_archive/format/fingerprint.py": "sha256 of a source file, or of a staged restore file (Entry.path)",
    "ckpt_archive/format/shard.py": "a source safetensors file's header",
    "ckpt_archive/format/limits.py": "/proc/meminfo",
    "ckpt_archive/format/ordered_writes.py": "a restore target read back through /proc/self/fd of our own descriptor",
    "ckpt_archive/format/read_lease.py": "a source file opened read-only under a read lease (pack's readers map or pread it)",
    "ckpt_archive/ops/meta.py": "the installed torch's version.py (environment facts without importing torch)",
    "ckpt_archive/repo/keys.py": "a key or trust file the user names (bounded read; never a repository path)",
    "ckpt_archive/ops/restore.py": "/proc/self/status (the umask)",
    "ckpt_archive/ops/restore_torch.py": "the zip restore staged, read back through Entry.path",
}

#: Writes outside the store that touch no repository and no restore/export target, each with why.
WRITES = {
    ("ckpt_archive/cli/process.py", "GuardedStream._lose"): (
        {"os.open(write)"}, "/dev/null, dup'ed over the CLI's own stdout once its reader went away"),
    ("ckpt_archive/cli/process.py", "_reopen_closed_std_fds"): (
        {"os.open(write)"}, "/dev/null on a standard descriptor 0-2 that was closed when the CLI started"),
    ("ckpt_archive/cli/process.py", "guard_std_streams"): (
        {"open(write)"}, "a text stream over descriptor 1 or 2 itself (open(fd, closefd=False)), never a path"),
    ("ckpt_archive/demo/train.py", "main"): (
        {"os.replace"}, "the demo's own training script saving its checkpoint in its scratch folder"),
    ("ckpt_archive/format/manifest.py", "_mark_validated"): (
        {"Path.mkdir", "os.open(write)"}, "the user's cache of validated manifest digests (an empty marker, "
                                         "opened O_NOFOLLOW)"),
    ("ckpt_archive/resume/runner.py", "prepare_output"): (
        {"Path.mkdir"}, "check-resume's output folder, refused unless absent or empty"),
    ("ckpt_archive/resume/runner.py", "run_command"): (
        {"Path.mkdir", "open(write)"}, "a run's log files in a folder check-resume creates (exist_ok=False)"),
    ("ckpt_archive/ops/keys.py", "_create_private"): (
        {"os.open(write)"}, "a new key file at a path the user names: O_EXCL|O_NOFOLLOW, never a repository file"),
    ("ckpt_archive/resume/check.py", "check_resume"): (
        {"Path.mkdir"}, "a folder check-resume creates (exist_ok=False) in its own output folder"),
    ("ckpt_archive/resume/check.py", "_run_controls"): (
        {"Path.unlink"}, "a perturbed checkpoint check-resume wrote in its own output folder"),
    ("ckpt_archive/resume/trajectory.py", "Trajectory.__init__"): (
        {"Path.mkdir"}, "the folder a training script names for its trajectory (the file goes through the layer)"),
}


def _classify(call: ast.Call) -> str | None:
    """The raw file operation ``call`` is, or None."""
    f = call.func
    if isinstance(f, ast.Name) and f.id == "open":
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        if mode is None or (isinstance(mode, ast.Constant) and isinstance(mode.value, str)
                            and set(mode.value) <= set("rbt")):
            return "open(read)"
        return "open(write)"
    if not isinstance(f, ast.Attribute):
        return None
    base, attr, npos = f.value, f.attr, len(call.args)
    if isinstance(base, ast.Name) and base.id == "os" and attr in _OS_OPS:
        if attr == "open":
            flags = call.args[1] if npos > 1 else None
            names = {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)} if flags is not None else set()
            return "os.open(read)" if names and names <= _READ_FLAGS else "os.open(write)"
        return f"os.{attr}"
    if isinstance(base, ast.Name) and base.id == "shutil" and attr in _SHUTIL_OPS:
        return f"shutil.{attr}"
    if isinstance(base, ast.Name) and base.id == "tempfile":
        return f"tempfile.{attr}"
    # pathlib methods, told from look-alikes by their arguments: str.replace(a, b) has two,
    # Path.replace(target) one; the layer's Dir.unlink(name)/mkdir(name)/rmdir(name) name what they act on
    if attr in ("write_bytes", "write_text", "touch", "symlink_to", "hardlink_to"):
        return f"Path.{attr}"
    if attr in ("unlink", "rmdir", "mkdir") and npos == 0:
        return f"Path.{attr}"
    if attr in ("rename", "replace") and npos == 1 and not call.keywords:
        return f"Path.{attr}"
    if attr == "open" and (npos == 0 or (isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
                                         and _MODE.match(call.args[0].value))):
        return "Path.open"
    return None


def scan_source(source: str, filename: str = "<src>") -> list[tuple[str, str, int]]:
    """``[(function qualname, operation, line)]`` of every raw file operation in ``source``."""
    found = []

    class Visitor(ast.NodeVisitor):
        def __init__(self):
            self.stack: list[str] = []

        def _scoped(self, node):
            self.stack.append(node.name)
            self.generic_visit(node)
            self.stack.pop()

        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

        def visit_Call(self, node: ast.Call):
            op = _classify(node)
            if op:
                found.append((".".join(self.stack) or "<module>", op, node.lineno))
            self.generic_visit(node)

    Visitor().visit(ast.parse(source, filename))
    return found


def _package_findings() -> list[tuple[str, str, str, int]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel.startswith("ckpt_archive/store/"):
            continue  # the layer itself
        out += [(rel, q, op, line) for q, op, line in scan_source(path.read_text(encoding="utf-8"), rel)]
    return out


def _allowed(rel: str, qualname: str, op: str) -> bool:
    if op in ("open(read)", "os.open(read)"):
        return any(rel.startswith(prefix) for prefix in READS)
    ops, _ = WRITES.get((rel, qualname), (set(), ""))
    return op in ops


def test_no_module_outside_the_store_writes_renames_or_deletes_a_file_any_other_way():
    """Fault guarded: a raw write, rename or delete (``open(p, "wb")``, ``os.replace``, ``Path.unlink``,
    ``tempfile.mkstemp``, ...) in a repository or a restore/export target, outside the file layer: it would
    follow a planted symbolic link or use a predictable temporary name (issue 24 item 2)."""
    bad = [f"{rel}:{line} {qualname}: {op}" for rel, qualname, op, line in _package_findings()
           if not _allowed(rel, qualname, op)]
    assert not bad, ("raw file operations outside ckpt_archive/store/ (route them through ckpt_archive.store.fs, "
                     "or, if they touch no repository and no target, add them to the allowlist with why):\n"
                     + "\n".join(bad))


def test_the_allowlist_has_no_entry_that_is_no_longer_needed():
    """An allowlist entry nothing uses any more would silently admit a future raw write there."""
    found = _package_findings()
    used_writes = {(rel, q) for rel, q, op, _ in found if op not in ("open(read)", "os.open(read)")}
    used_reads = {prefix for prefix in READS for rel, _, op, _ in found
                  if op in ("open(read)", "os.open(read)") and rel.startswith(prefix)}
    assert set(WRITES) <= used_writes, set(WRITES) - used_writes
    assert set(READS) == used_reads, set(READS) - used_reads
    for (rel, q), (ops, why) in WRITES.items():
        assert why and ops == {op for r, qq, op, _ in found if (r, qq) == (rel, q)}, (rel, q)


@pytest.mark.parametrize("code, op", [
    ("open(p, 'wb')", "open(write)"),
    ("open(p, mode='xb')", "open(write)"),
    ("open(p, 'rb')", "open(read)"),
    ("os.open(p, os.O_WRONLY | os.O_CREAT)", "os.open(write)"),
    ("os.open(p, os.O_RDONLY)", "os.open(read)"),
    ("os.replace(a, b)", "os.replace"),
    ("os.rename(a, b)", "os.rename"),
    ("os.link(a, b)", "os.link"),
    ("os.unlink(a)", "os.unlink"),
    ("os.remove(a)", "os.remove"),
    ("os.makedirs(a, exist_ok=True)", "os.makedirs"),
    ("shutil.rmtree(a)", "shutil.rmtree"),
    ("shutil.copy2(a, b)", "shutil.copy2"),
    ("shutil.move(a, b)", "shutil.move"),
    ("tempfile.mkstemp(dir=d)", "tempfile.mkstemp"),
    ("p.mkdir(parents=True, exist_ok=True)", "Path.mkdir"),
    ("p.unlink(missing_ok=True)", "Path.unlink"),
    ("p.write_bytes(b'x')", "Path.write_bytes"),
    ("p.write_text('x')", "Path.write_text"),
    ("p.touch()", "Path.touch"),
    ("p.rename(q)", "Path.rename"),
    ("p.replace(q)", "Path.replace"),
    ("p.open('wb')", "Path.open"),
    ("p.open()", "Path.open"),
    # look-alikes that are no file operation
    ("s.replace('a', 'b')", None),
    ("t.replace(tzinfo=utc)", None),
    ("zf.open(name)", None),
    ("folder.unlink(name)", None),
    ("folder.mkdir(name)", None),
    ("Repository.open(url)", None),
])
def test_the_scan_recognises_each_raw_operation_and_no_look_alike(code, op):
    """The scan is only as good as what it recognises: each raw operation is found (so a new one fails the
    test above), and a string's ``replace`` or the layer's own methods are not."""
    found = scan_source(f"def f():\n    {code}\n")
    assert [o for _, o, _ in found] == ([op] if op else [])
    assert all(q == "f" for q, _, _ in found)


# --- what the layer guarantees, through the commands --------------------------------------------------
runner = CliRunner()


def cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    text = res.stdout + (res.stderr or "")
    assert "Traceback" not in text and "internal error" not in text, text
    return res


class _FillsUp:
    """A file on a disk that is full after ``room`` more bytes: the write that crosses it writes what fits
    and raises ENOSPC (as ``write(2)`` does)."""

    def __init__(self, fh, room: int):
        self.fh, self.room = fh, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.fh.write(data[:self.room])
            self.fh.flush()
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


@pytest.mark.parametrize("room", [0, 10])
def test_a_full_disk_when_the_repository_is_created_leaves_no_half_repository_json(tmp_path, monkeypatch, room):
    """Fault (issue 24 item 6): ``repository.json``'s first write was a plain exclusive create, so a full disk
    left a 0-byte (or half) file; after space was freed every command failed with "not valid JSON". Now it
    is written like every other file (a temporary name, then linked): absent or whole, never half."""
    ckpt = tmp_path / "ck.pt"
    torch.save({"w": torch.ones(4), "step": 1}, ckpt)
    repo = tmp_path / "repo"
    monkeypatch.setattr(fs, "open_stream", lambda fd: _FillsUp(os.fdopen(fd, "wb"), room))
    res = cli("pack", ckpt, "--repo", repo)
    assert res.exit_code == 2 and "disk full" in res.stderr, res.stderr
    monkeypatch.undo()  # space freed
    assert not (repo / "repository.json").exists()
    assert [p.name for p in repo.iterdir()] == [] if repo.exists() else True  # no temporary file left
    assert cli("list", repo).exit_code == 2  # not a repository (yet): said so, not "not valid JSON"
    for argv in (["pack", ckpt, "--repo", repo], ["gc", repo], ["list", repo],
                 ["export", repo, "--to", tmp_path / "dest"], ["pack", ckpt, "--repo", tmp_path / "dest"]):
        res = cli(*argv)
        assert res.exit_code == 0, (argv, res.stderr)


def _read_only(monkeypatch):
    """Make the file layer behave as on a read-only mount: every create, write, rename, link, mkdir and
    delete fails with EROFS (reads work). Running as root, permission bits would not stop a write."""
    def erofs(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    real_open = fs.Dir.open_file

    def open_file(self, name, flags, mode=0o644):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            erofs()
        return real_open(self, name, flags, mode)

    monkeypatch.setattr(fs.Dir, "open_file", open_file)
    for name in ("create_temp", "mkdir", "make_temp_dir", "rename", "link", "unlink", "remove_tree"):
        monkeypatch.setattr(fs.Dir, name, erofs)


def _copied(tmp_path, *, damage: bool = False):
    import shutil

    ckpt = tmp_path / "ck.pt"
    torch.save({"w": torch.arange(64.0), "step": 1}, ckpt)
    assert cli("pack", ckpt, "--repo", tmp_path / "repo").exit_code == 0
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "repo", copy)  # proven at repo, copied here
    if damage:
        from hostile_archive import member, read_manifest

        stored = copy / "generations" / "00000001" / member(read_manifest(copy), "tensors")["stored_path"]
        data = bytearray(stored.read_bytes())
        data[-1] ^= 1
        stored.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("damage", [False, True])
def test_verify_deep_of_a_copied_generation_on_a_read_only_repository_checks_it(tmp_path, monkeypatch, damage):
    """Fault (issue 24 item 8): ``verify --deep`` of a ``copied`` generation on a read-only repository
    exited 2 at ``.lock`` instead of checking. Now it checks (exit 0, or 1 for a damaged copy) and says it
    could not mark the generation usable here because the repository is read-only."""
    copy = _copied(tmp_path, damage=damage)
    _read_only(monkeypatch)
    res = cli("verify", f"{copy}@1", "--deep")
    assert res.exit_code == (1 if damage else 0), res.stderr
    assert "could not be marked usable here: the repository is read-only" in res.stderr, res.stderr
    monkeypatch.undo()
    from ckpt_archive.repo.repository import Repository

    assert Repository.open(copy).generation(1).status == "copied"  # nothing recorded
    assert not (copy / "generations" / "00000001" / "CHECK-FAILED.json").exists()


def test_writers_on_a_read_only_repository_stop_with_exit_2_saying_so(tmp_path, monkeypatch):
    copy = _copied(tmp_path)
    _read_only(monkeypatch)
    for argv in (["adopt", copy], ["gc", copy], ["pack", tmp_path / "ck.pt", "--repo", copy]):
        res = cli(*argv)
        assert res.exit_code == 2 and "read-only" in res.stderr, (argv, res.stderr)


def test_a_lock_file_that_is_a_fifo_or_a_folder_is_refused_not_waited_on(tmp_path):
    ckpt = tmp_path / "ck.pt"
    torch.save({"step": 1}, ckpt)
    repo = tmp_path / "repo"
    assert cli("pack", ckpt, "--repo", repo).exit_code == 0
    (repo / ".lock").unlink()
    os.mkfifo(repo / ".lock")
    res = cli("pack", ckpt, "--repo", repo)
    assert res.exit_code == 2 and "not a regular file" in res.stderr, res.stderr


def test_dir_refuses_links_on_the_way_and_at_the_end_and_removes_a_link_not_its_target(tmp_path):
    """The layer's own rules, one by one: a folder on the way that is a link, a file that is a link, an
    exclusive create over a link, a removal of a link (its target stays), a rename over a link."""
    from ckpt_archive.errors import UnsafePath

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"keep")
    root = tmp_path / "root"
    root.mkdir()
    (root / "sub").symlink_to(outside)
    (root / "file").symlink_to(outside / "f")
    with fs.Dir.open(root) as d:
        with pytest.raises(UnsafePath, match="sub is a symbolic link"):
            d.walk(["sub"])
        with pytest.raises(UnsafePath, match="sub is a symbolic link"):
            d.walk(["sub", "deeper"], create=True)
        with pytest.raises(UnsafePath, match="file is a symbolic link"):
            d.open_file("file", os.O_RDONLY)
        with pytest.raises(UnsafePath, match="file is a symbolic link"):
            d.create("file")
        d.write_atomic("file", b"new")  # rename over the link: the link is replaced
        assert (root / "file").read_bytes() == b"new" and not (root / "file").is_symlink()
        assert d.remove_tree("sub") and not os.path.lexists(root / "sub")
    assert (outside / "f").read_bytes() == b"keep" and sorted(p.name for p in outside.iterdir()) == ["f"]


def test_a_root_reached_through_the_users_own_link_works(tmp_path):
    """The repository root itself may be a user's link (``backups/`` on another disk): resolved once."""
    real = tmp_path / "disk" / "backups"
    real.mkdir(parents=True)
    (tmp_path / "backups").symlink_to(real)
    ckpt = tmp_path / "ck.pt"
    torch.save({"step": 1}, ckpt)
    assert cli("pack", ckpt, "--repo", tmp_path / "backups").exit_code == 0
    assert cli("verify", tmp_path / "backups", "--deep").exit_code == 0
    assert cli("gc", tmp_path / "backups").exit_code == 0
    assert (real / "repository.json").is_file()


def test_link_copy_and_symlink_into_a_dir_never_follow_or_replace_a_link_at_the_new_name(tmp_path, monkeypatch):
    """The layer's operations for a snapshot of a trainer's folder (issue 27 met issue 24): the source is read by
    its path (a link there followed, as the folder reader does), the new name is created exclusively, so a link
    planted at it is an error, never followed or replaced; a copy keeps mode and times and leaves nothing when it
    fails part-way; ``read_file`` refuses a link and never blocks on a FIFO."""
    from ckpt_archive.errors import UnsafePath

    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    (src_dir / "f").write_bytes(b"data" * 1000)
    os.chmod(src_dir / "f", 0o640)
    os.utime(src_dir / "f", ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    (src_dir / "via-link").symlink_to(src_dir / "f")
    root = tmp_path / "root"
    root.mkdir()
    (root / "planted").symlink_to(outside)
    with fs.Dir.open(root) as d:
        for op in (lambda n: d.link_from(src_dir / "f", n), lambda n: d.symlink("anywhere", n)):
            with pytest.raises(FileExistsError):
                op("planted")
        with pytest.raises(UnsafePath, match="planted is a symbolic link"):
            d.copy_from(src_dir / "f", "planted")
        d.link_from(src_dir / "via-link", "linked")  # the source's link followed: the file it points to
        assert os.stat(root / "linked").st_ino == os.stat(src_dir / "f").st_ino
        assert d.copy_from(src_dir / "via-link", "copied") == 4000
        st, src = os.stat(root / "copied"), os.stat(src_dir / "f")
        assert (root / "copied").read_bytes() == b"data" * 1000 and st.st_ino != src.st_ino
        assert (stat_mode(st), st.st_mtime_ns) == (0o640, src.st_mtime_ns)
        monkeypatch.setattr(fs, "open_stream", lambda fd: _FillsUp(os.fdopen(fd, "wb"), 100))
        with pytest.raises(OSError, match="No space"):
            d.copy_from(src_dir / "f", "half")
        monkeypatch.undo()
        assert not (root / "half").exists()
        with pytest.raises(UnsafePath):
            d.read_file("planted", 100)
        os.mkfifo(root / "fifo")
        assert d.read_file("fifo", 100) is None and d.read_file("absent", 100) is None
        assert d.read_file("copied", 3999) is None and d.read_file("copied", 4000) == b"data" * 1000
    assert outside.read_bytes() == b"keep" and (root / "planted").is_symlink()


def stat_mode(st: os.stat_result) -> int:
    import stat

    return stat.S_IMODE(st.st_mode)
