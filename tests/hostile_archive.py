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


# --- a repository's files as its readers see them (plain, encrypted or signed) ------------------------------
# The attacks below are crafted on the *plaintext* a reader sees. In an encrypted repository (issue 28) that
# plaintext is sealed: an attacker without the key can only flip ciphertext (damage, exit 1), so to prove the
# checks behind decryption still run, the hostile document is sealed *with the key*, read from
# $CKPT_ARCHIVE_KEY_FILE as every reader reads it. Where the marker is signed and $CKPT_ARCHIVE_SIGN_KEY is set,
# :func:`reseal` signs again, so the checks behind the signature run too (without it, a resealed marker's
# signature is bad and the generation is damaged for that reason alone).
_REPO_KEYS: dict = {}


def _repo_root(path: Path) -> Path | None:
    for parent in Path(path).absolute().parents:
        if (parent / "repository.json").is_file():
            return parent
    return None


def _sealed_store(path: Path):
    """``(store, key)`` to read and write ``path`` as plaintext, or None where its repository is not encrypted."""
    import os

    root = _repo_root(path)
    if root is None:
        return None
    config = json.loads((root / "repository.json").read_text())
    if "encryption" not in config:
        return None
    from ckpt_archive.format import crypto
    from ckpt_archive.store.base import open_store
    from ckpt_archive.store.encrypted import EncryptedStore

    material = crypto.read_key_material(Path(os.environ["CKPT_ARCHIVE_KEY_FILE"]).read_bytes(), "key file")
    cache = (config["id"], material)
    if cache not in _REPO_KEYS:
        _REPO_KEYS[cache] = crypto.RepoKeys(crypto.unwrap_data_key(config["encryption"]["keys"], material,
                                                                   config["id"])[0])
    rel = Path(path).absolute().relative_to(root).as_posix()
    return EncryptedStore(open_store(str(root)), _REPO_KEYS[cache]), rel


def read_plain(path: Path) -> bytes:
    """The bytes of a repository file as a reader sees them (decrypted with the key where encrypted)."""
    sealed = _sealed_store(path)
    if sealed is None:
        return Path(path).read_bytes()
    store, key = sealed
    return store.read_bytes(key)


def write_plain(path: Path, data: bytes) -> None:
    """Write a repository file as its writer would (sealed with the key where encrypted)."""
    sealed = _sealed_store(path)
    if sealed is None:
        Path(path).write_bytes(data)
        return
    store, key = sealed
    store.replace_bytes(key, data)


def is_encrypted(repo: Path) -> bool:
    return "encryption" in json.loads((Path(repo) / "repository.json").read_text())


def _resign(marker: dict, sha: str) -> None:
    """Sign the marker again for its new manifest sha256, with $CKPT_ARCHIVE_SIGN_KEY (when set)."""
    import os

    if not isinstance(marker.get("signature"), dict) or not os.environ.get("CKPT_ARCHIVE_SIGN_KEY"):
        return
    from ckpt_archive.format import signature

    key = signature.load_private(Path(os.environ["CKPT_ARCHIVE_SIGN_KEY"]).read_bytes(), "sign key")
    stmt = dict(marker["signature"].get("statement") or {})
    stmt["manifest_sha256"] = sha
    marker["signature"] = signature.sign(key, stmt)


#: The repositories every attack is tried on: plain, encrypted (a key file) and signed (read with --trust).
MODES = ("plain", "encrypted", "signed")
_ENV = ("CKPT_ARCHIVE_KEY_FILE", "CKPT_ARCHIVE_SIGN_KEY", "CKPT_ARCHIVE_TRUST")


def make_keys(root: Path) -> dict:
    """A repository key file and a signing key pair under ``root``: ``{"key_file", "sign_key", "trust"}``."""
    from ckpt_archive.format import crypto
    from ckpt_archive.ops.keys import new_key

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "repo.key").write_bytes(crypto.new_key_file_text())
    signer = new_key(root / "signer")
    return {"key_file": str(root / "repo.key"), "sign_key": str(signer.path), "trust": str(signer.public_path)}


def mode_env(mode: str, keys: dict) -> dict:
    """The environment every command and library call of a test reads its keys from, for ``mode`` (the
    variables of the other modes set to None: unset)."""
    want = {"plain": {}, "encrypted": {"CKPT_ARCHIVE_KEY_FILE": keys["key_file"]},
            "signed": {"CKPT_ARCHIVE_SIGN_KEY": keys["sign_key"], "CKPT_ARCHIVE_TRUST": keys["trust"]}}[mode]
    return {name: want.get(name) for name in _ENV}


def cheap_kdf(monkeypatch) -> None:
    """Repositories created from here on wrap their data key with scrypt at n=2**10 (recorded in their
    repository.json, so every reader, CLI processes included, derives the key cheaply): each open costs
    ~1 ms instead of ~0.7 s. What is under test is the checks behind the key, not the key derivation's
    strength (tests/test_crypto_format.py tests that)."""
    from ckpt_archive.format import crypto

    monkeypatch.setattr(crypto, "SCRYPT_N", 1 << 10)


def use_mode(monkeypatch, mode: str, keys: dict) -> str:
    """Set the environment of ``mode`` (:func:`mode_env`) for the rest of the test, with a cheap key derivation
    (:func:`cheap_kdf`) for the repositories it creates; returns ``mode``."""
    cheap_kdf(monkeypatch)
    for name, value in mode_env(mode, keys).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return mode


def gen_dir(repo: Path, number: int = 1) -> Path:
    return Path(repo) / "generations" / f"{number:08d}"


def read_manifest(repo: Path, number: int = 1) -> dict:
    return json.loads(read_plain(gen_dir(repo, number) / "manifest.json"))


def reseal(repo: Path, number: int = 1, manifest_bytes: bytes | None = None) -> None:
    """Write ``manifest_bytes`` (if given) and make the marker vouch for the manifest as it now is (signed
    again where it was signed and the signing key is known: see the note above)."""
    g = gen_dir(repo, number)
    if manifest_bytes is not None:
        write_plain(g / "manifest.json", manifest_bytes)
    sha = hashlib.sha256(read_plain(g / "manifest.json")).hexdigest()
    marker_path = g / "USABLE.json"
    if marker_path.exists():
        marker = json.loads(read_plain(marker_path))
        marker["manifest_sha256"] = sha
        _resign(marker, sha)
        write_plain(marker_path, json.dumps(marker, indent=1).encode())


def edit_manifest(repo: Path, edit: Callable[[dict], None], number: int = 1) -> dict:
    """Apply ``edit`` to the parsed manifest, write it back, recompute the marker's fingerprint."""
    m = read_manifest(repo, number)
    edit(m)
    reseal(repo, number, json.dumps(m, indent=1).encode())
    return m


def edit_manifest_text(repo: Path, edit: Callable[[str], str], number: int = 1) -> None:
    """Edit the manifest as text (for what json.dumps cannot write: 1e999, duplicate keys)."""
    g = gen_dir(repo, number)
    reseal(repo, number, edit(read_plain(g / "manifest.json").decode()).encode())


def member(m: dict, role_or_path: str) -> dict:
    return next(r for r in m["members"] if r["role"] == role_or_path or r["path"] == role_or_path)


def put_member_bytes(repo: Path, m: dict, rec: dict, raw: bytes, number: int = 1) -> None:
    """Replace a member's stored file by ``raw`` as one ``store`` chunk, and its record's fingerprints to
    match (the caller then writes the manifest: :func:`edit_manifest` does)."""
    g = gen_dir(repo, number)
    path = g / rec["stored_path"]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_plain(path, raw)
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
    write_plain(path, b"".join(stored))
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
