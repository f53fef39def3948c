"""Hand-editing a real generation the way an attacker would: change the manifest (or a member) and
recompute every fingerprint that would give the edit away -- member and chunk sha256s, the manifest's
sha256 in the ``USABLE.json`` marker -- so that plain ``verify`` has nothing to complain about
except what the edit itself makes wrong.

Used by tests/test_hostile_archives.py and tests/test_hostile_fuzz.py.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

GEN = "00000001"


def gen_dir(repo: Path, number: int = 1) -> Path:
    return Path(repo) / "generations" / f"{number:08d}"


def read_manifest(repo: Path, number: int = 1) -> dict:
    return json.loads((gen_dir(repo, number) / "manifest.json").read_text())


def reseal(repo: Path, number: int = 1, manifest_bytes: bytes | None = None) -> None:
    """Write ``manifest_bytes`` (if given) and make the marker vouch for the manifest as it now is."""
    g = gen_dir(repo, number)
    if manifest_bytes is not None:
        (g / "manifest.json").write_bytes(manifest_bytes)
    sha = hashlib.sha256((g / "manifest.json").read_bytes()).hexdigest()
    marker_path = g / "USABLE.json"
    if marker_path.exists():
        marker = json.loads(marker_path.read_text())
        marker["manifest_sha256"] = sha
        marker_path.write_text(json.dumps(marker, indent=1))


def edit_manifest(repo: Path, edit: Callable[[dict], None], number: int = 1) -> dict:
    """Apply ``edit`` to the parsed manifest, write it back, recompute the marker's fingerprint."""
    m = read_manifest(repo, number)
    edit(m)
    reseal(repo, number, json.dumps(m, indent=1).encode())
    return m


def edit_manifest_text(repo: Path, edit: Callable[[str], str], number: int = 1) -> None:
    """Edit the manifest as text (for what json.dumps cannot write: 1e999, duplicate keys)."""
    g = gen_dir(repo, number)
    reseal(repo, number, edit((g / "manifest.json").read_text()).encode())


def member(m: dict, role_or_path: str) -> dict:
    return next(r for r in m["members"] if r["role"] == role_or_path or r["path"] == role_or_path)


def put_member_bytes(repo: Path, m: dict, rec: dict, raw: bytes, number: int = 1) -> None:
    """Replace a member's stored file by ``raw`` as one ``store`` chunk, and its record's fingerprints to
    match (the caller then writes the manifest: :func:`edit_manifest` does)."""
    g = gen_dir(repo, number)
    path = g / rec["stored_path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    sha = hashlib.sha256(raw).hexdigest()
    chunks = [{"raw_offset": 0, "raw_bytes": len(raw), "stored_offset": 0, "stored_bytes": len(raw),
               "stored_sha256": sha, "codec": "store"}] if raw else []
    rec.update(raw_bytes=len(raw), stored_bytes=len(raw), chunk_codecs=["store"], chunks=chunks)
    if m.get("format_version", 1) >= 2:  # format 2: "<alg>:<hex>", the stored one derived from the chunks
        from ckpt_archive.format import fingerprint

        rec.update(raw_fp=f"sha256:{sha}", stored_fp=fingerprint.sha256_chunks(c["stored_sha256"] for c in chunks))
    else:
        rec.update(raw_sha256=sha, stored_sha256=sha)
    m["summary"]["raw_bytes"] = sum(r["raw_bytes"] for r in m["members"])
    m["summary"]["stored_bytes"] = sum(r["stored_bytes"] for r in m["members"])


def set_tree(repo: Path, tree_json: bytes, number: int = 1) -> None:
    """Replace the state tree member by ``tree_json`` (raw bytes), fingerprints recomputed."""
    def edit(m):
        put_member_bytes(repo, m, member(m, "tree"), tree_json, number)
    edit_manifest(repo, edit, number)


_FPS: dict = {}


def put_member_chunks(repo: Path, m: dict, rec: dict, pieces: list, *, raw_fp: bool = True, number: int = 1) -> None:
    """Replace the stored file of ``rec`` (a member record of manifest ``m``) by one zstandard chunk per raw
    piece, every fingerprint recomputed -- chunk sha256s, the derived stored fingerprint and (``raw_fp``) the
    raw fingerprint of all the pieces in the member's own algorithm -- so that only what the pieces *are*
    is hostile. A piece repeated (the same object) is compressed once: 32 chunks of 64 MiB of spaces take a
    few KB on disk. The caller writes the manifest (:func:`edit_manifest` does).
    """
    import zstandard

    from ckpt_archive.format import fingerprint

    frames: dict[int, bytes] = {}
    cctx = zstandard.ZstdCompressor(level=3)
    stored, out, pos, raw_pos = [], [], 0, 0
    for piece in pieces:
        fr = frames.get(id(piece))
        if fr is None:
            fr = frames[id(piece)] = cctx.compress(piece)
        out.append({"raw_offset": raw_pos, "raw_bytes": len(piece), "stored_offset": pos,
                    "stored_bytes": len(fr), "stored_sha256": hashlib.sha256(fr).hexdigest(), "codec": "zstd"})
        stored.append(fr)
        pos += len(fr)
        raw_pos += len(piece)
    path = gen_dir(repo, number) / rec["stored_path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    path.write_bytes(b"".join(stored))
    rec.update(raw_bytes=raw_pos, stored_bytes=pos, chunk_codecs=["zstd"], chunks=out)
    fmt2 = "raw_fp" in rec or m.get("format_version", 1) >= 2
    if raw_fp:
        alg = (fingerprint.raw_fp(rec) or "blake3:").partition(":")[0]
        alg = alg if alg in ("sha256", "blake3") else "blake3"
        key = (alg, tuple(id(p) for p in pieces[:2]), len(pieces), raw_pos)
        if key not in _FPS:
            h = fingerprint.new(alg)
            for piece in pieces:
                h.update(piece)
            _FPS[key] = f"{alg}:{h.hexdigest()}"
        if fmt2:
            rec["raw_fp"] = _FPS[key]
        else:
            rec["raw_sha256"] = _FPS[key].partition(":")[2]
    if fmt2:
        rec["stored_fp"] = fingerprint.sha256_chunks(c["stored_sha256"] for c in out)
    else:
        rec["stored_sha256"] = hashlib.sha256(b"".join(stored)).hexdigest()
    m["summary"]["raw_bytes"] = sum(r["raw_bytes"] for r in m["members"])
    m["summary"]["stored_bytes"] = sum(r["stored_bytes"] for r in m["members"])


_PIECES: dict = {}


def bomb_pieces(chunk_raw: int, chunks: int, *, head: bytes = b"", fill: bytes = b" ") -> list:
    """``chunks`` raw pieces of ``chunk_raw`` bytes: ``head`` then ``fill`` repeated (one object reused, so a
    2 GiB bomb costs one 64 MiB piece in this process). A state tree followed by gigabytes of spaces is still
    valid JSON: a reader that decodes before it checks the declared size holds all of it."""
    key = (chunk_raw, fill)
    if key not in _PIECES:
        _PIECES[key] = (fill * (chunk_raw // len(fill) + 1))[:chunk_raw]
    rest = _PIECES[key]
    first = (head + rest)[:chunk_raw] if head else rest
    return [first] + [rest] * (chunks - 1)


def bomb_member(repo: Path, rec: dict, m: dict, *, chunk_raw: int, chunks: int, head: bytes = b"",
                fill: bytes = b" ", number: int = 1) -> None:
    """Make ``rec`` a *declared-size bomb* that tells the truth: ``chunks`` zstandard chunks that really decode
    to ``chunk_raw`` bytes each (:func:`bomb_pieces`), every fingerprint recomputed
    (:func:`put_member_chunks`), so that only the *size* is hostile."""
    put_member_chunks(repo, m, rec, bomb_pieces(chunk_raw, chunks, head=head, fill=fill), number=number)


def json_bomb(nbytes: int, unit: bytes = b"[],") -> bytes:
    """A JSON array of ``nbytes`` that costs a parser ~25 times its size (``[[],[],...]``): 3 bytes per list."""
    n = max(1, (nbytes - 2) // len(unit))
    return b"[" + unit * (n - 1) + unit.rstrip(b",") + b"]"


def forget_notes(repo: Path) -> None:
    """Remove every failed-check note (``CHECK-FAILED.json``) a reader recorded, so that the next command meets
    the damage itself, as the first reader did (docs/FORMAT.md, "One status rule": otherwise it refuses the
    generation as recorded, exit 2)."""
    for note in Path(repo).glob("generations/*/CHECK-FAILED.json"):
        note.unlink()


def folder_source(root: Path) -> Path:
    """A small checkpoint folder: one torch file, one raw file."""
    src = root / "src"
    src.mkdir(parents=True)
    torch.save({"w": torch.arange(16, dtype=torch.float32), "step": 3}, src / "model.pt")
    (src / "notes.txt").write_text("hello")
    return src


def run_cli(*args, env=None, timeout=300, measure_rss: bool = False):
    """Run the CLI in a fresh interpreter; with ``measure_rss`` also return its peak RSS in bytes.

    Returns:
        ``(returncode, stdout, stderr, peak_rss_bytes | None)``.
    """
    # VmHWM (this process's own peak, reset by exec), not ru_maxrss: Linux carries ru_maxrss across
    # exec from the forked parent, so a big pytest process would count as the child's peak
    code = ("import sys\n"
            "from ckpt_archive.cli.app import main\n"
            "try:\n    main()\n"
            "except SystemExit as e:\n"
            "    rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
            "    sys.stderr.write(f'\\nPEAK_RSS_KB={rss}\\n')\n"
            "    raise\n")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    rss = None
    err = proc.stderr
    if "PEAK_RSS_KB=" in err:
        err, _, tail = err.rpartition("PEAK_RSS_KB=")
        rss = int(tail.strip()) * 1024
    return proc.returncode, proc.stdout, err, rss if measure_rss else None


_DRIVER = r"""
import glob, json, os, sys, traceback
import torch  # noqa: F401 - preloaded once: each child starts as a CLI that imported it (~300 MB)
import ckpt_archive
from ckpt_archive.cli.app import main
jobs = json.load(sys.stdin)
for i, job in enumerate(jobs):
    if job.get("fresh"):  # each command meets the damage itself (docs/FORMAT.md, "One status rule")
        for note in glob.glob(os.path.join(job["repo"], "generations", "*", "CHECK-FAILED.json")):
            os.unlink(note)
    base = os.path.join(job["tmp"], str(i))
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            for fd, ext in ((1, ".out"), (2, ".err")):
                f = os.open(base + ext, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # the peak (VmHWM) starts again from what this child holds now
            try:
                if "cli" in job:
                    sys.argv = ["ckpt-archive", *job["cli"]]
                    main()
                    code = 0
                else:
                    ckpt_archive.load(*job["load"])
                    code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except ckpt_archive.errors.CkptArchiveError as exc:
                code = exc.exit_code
                sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) << 10
            with open(base + ".res", "w") as fh:
                json.dump({"rc": code, "peak": peak}, fh)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
"""


def run_many(jobs: list[dict], tmp: Path, *, timeout: float = 600) -> list[dict]:
    """Run commands in fresh processes and measure each one's peak RSS, cheaply: one driver interpreter
    imports torch and the CLI once, then forks a child per job that resets its peak (``/proc/self/clear_refs``)
    and runs the command; so each child starts where a CLI process that imports torch starts, and its
    ``VmHWM`` is that command's own peak.

    Args:
        jobs: ``{"cli": [args...]}`` (the CLI) or ``{"load": [repo, generation]}`` (``ckpt_archive.load``);
            ``"fresh": True`` removes recorded failed checks of ``"repo"`` first.
        tmp: a scratch folder.

    Returns:
        per job ``{"rc", "peak" (bytes), "out", "err"}``; ``rc`` 99 when it raised something unexpected.
    """
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    payload = [{**j, "tmp": str(tmp), "repo": str(j.get("repo", ""))} for j in jobs]
    proc = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(payload, default=str), text=True,
                          capture_output=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = []
    for i in range(len(jobs)):
        res = json.loads((tmp / f"{i}.res").read_text())
        res["out"] = (tmp / f"{i}.out").read_text(errors="replace")
        res["err"] = (tmp / f"{i}.err").read_text(errors="replace")
        out.append(res)
    return out


def snapshot(root: Path, skip: Path | None = None) -> dict[str, str]:
    """sha256 of every file below ``root`` (links not followed), to prove nothing outside changed."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        if p.is_symlink():
            out[str(p)] = "link:" + str(p.readlink())
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
