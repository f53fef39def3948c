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


_FRAMES: dict = {}
_FPS: dict = {}


def _frame(raw: bytes) -> bytes:
    """One zstandard frame of ``raw`` (cached: bombs repeat the same chunk)."""
    import zstandard

    key = (len(raw), hashlib.sha256(raw).digest())
    if key not in _FRAMES:
        _FRAMES[key] = zstandard.ZstdCompressor(level=19).compress(raw)
    return _FRAMES[key]


def bomb_member(repo: Path, rec: dict, m: dict, *, chunk_raw: int, chunks: int, head: bytes = b"",
                fill: bytes = b" ", number: int = 1) -> None:
    """Make ``rec`` (a member record of manifest ``m``) a *declared-size bomb* that tells the truth: ``chunks``
    zstandard chunks that really decode to ``chunk_raw`` bytes each -- ``head`` then ``fill`` repeated -- a
    few KB on disk, with every fingerprint recomputed (chunk sha256s, the derived stored fingerprint, the raw
    fingerprint of all the decoded bytes in the member's own algorithm), so that only the *size* is hostile.
    The caller writes the manifest (:func:`edit_manifest` does) and reseals.

    A tree whose JSON is followed by gigabytes of spaces is still valid JSON: a reader that decodes before
    it checks the declared size holds all of it.
    """
    from ckpt_archive.format import fingerprint

    first = (head + fill * (chunk_raw // len(fill) + 1))[:chunk_raw]
    rest = (fill * (chunk_raw // len(fill) + 1))[:chunk_raw]
    frames = [_frame(first)] + [_frame(rest)] * (chunks - 1)
    stored = b"".join(frames)
    g = gen_dir(repo, number)
    path = g / rec["stored_path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()  # a hard-linked shared object is never written through
    path.write_bytes(stored)
    out, pos = [], 0
    for i, fr in enumerate(frames):
        out.append({"raw_offset": i * chunk_raw, "raw_bytes": chunk_raw, "stored_offset": pos,
                    "stored_bytes": len(fr), "stored_sha256": hashlib.sha256(fr).hexdigest(), "codec": "zstd"})
        pos += len(fr)
    total = chunk_raw * chunks
    alg = (fingerprint.raw_fp(rec) or "blake3:").partition(":")[0]
    alg = "blake3" if alg not in ("sha256", "blake3") else alg
    key = (alg, hashlib.sha256(first).digest(), hashlib.sha256(rest).digest(), chunks)
    if key not in _FPS:
        h = fingerprint.new(alg)
        h.update(first)
        for _ in range(chunks - 1):
            h.update(rest)
        _FPS[key] = f"{alg}:{h.hexdigest()}"
    rec.update(raw_bytes=total, stored_bytes=len(stored), chunk_codecs=["zstd"], chunks=out)
    if "raw_fp" in rec or m.get("format_version", 1) >= 2:
        rec.update(raw_fp=_FPS[key], stored_fp=fingerprint.sha256_chunks(c["stored_sha256"] for c in out))
        rec.pop("raw_sha256", None)
        rec.pop("stored_sha256", None)
    else:
        rec.update(raw_sha256=_FPS[key].partition(":")[2], stored_sha256=hashlib.sha256(stored).hexdigest())
    m["summary"]["raw_bytes"] = sum(r["raw_bytes"] for r in m["members"])
    m["summary"]["stored_bytes"] = sum(r["stored_bytes"] for r in m["members"])


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
