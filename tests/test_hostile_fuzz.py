"""A seeded mutation fuzzer over a real archive (issue 17): it mutates manifests, markers, state trees and
member bytes of a real generation -- fingerprints recomputed, so only the mutation is wrong -- and runs
the commands a user would run on it. Each run must end with a documented exit code (0, 1, 2), never a
traceback or an "internal error", never write outside its scratch folder, and stay within a memory bound.
A flipped member byte (fingerprints *not* recomputed) must always be found by ``verify``.

Each runs on a plain, an encrypted (key file) and a signed repository read with ``--trust`` (issue 28). The
mutations are made on the plaintext and sealed *with the key* (and a resealed marker signed again), so
what refuses them is the checks behind decryption and the signature; a flipped byte hits the ciphertext
of an encrypted member and must be damage naming that member (exit 1), never 0 or 2.

The fast suite runs FUZZ_FAST cases on a plain repository and one of each kind of mutation on each of the
others (a few seconds each); ``-m slow`` runs FUZZ_SLOW more on each (``CKPT_FUZZ_SLOW``, default 300). Set
``CKPT_FUZZ_SEED`` to replay a seed; a failure
names its seed, mode and mutation.
"""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_archive.cli.app import app

from hostile_archive import (MODES, bomb_member, folder_source, gen_dir, is_encrypted, make_keys, member,
                             cheap_kdf, mode_env, put_member_bytes, read_plain, reseal, use_mode, write_plain)

FUZZ_FAST = 12
FUZZ_SLOW = int(os.environ.get("CKPT_FUZZ_SLOW", "300"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "17"))
ESCAPE = "ckpt-fuzz-escape"
runner = CliRunner()


def _values(rng: random.Random):
    deep: list = []
    cur = deep
    for _ in range(rng.choice([10, 600])):  # deeper: test_a_state_tree_nested_100k_deep
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    return rng.choice([None, -1, 0, 2 ** 63, 2 ** 70, 1e308, -0.0, "", ".", "..", f"../../../{ESCAPE}",
                       f"/tmp/{ESCAPE}-{os.getpid()}", "a\\b", "a\x00b", "x" * 5000, True, [], {}, [1, 2, 3],
                       {"$t": "tensor", "key": "nope"}, {"$t": "float", "v": "inf"}, {"$t": "bogus"}, deep,
                       "store", "zstd", "bg4+zstd", "tensors", "folder", 1 << 31, 64 << 20])


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _mutate_doc(doc, rng: random.Random) -> str:
    paths = [p for p in _paths(doc) if p]
    path = rng.choice(paths)
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    action = rng.choice(["set", "set", "set", "delete"])
    if action == "delete" and isinstance(parent, dict):
        del parent[last]
        return f"delete {'/'.join(map(str, path))}"
    value = _values(rng)
    parent[last] = value
    shown = repr(value)[:40]
    return f"set {'/'.join(map(str, path))} = {shown}"


def _bomb(repo: Path, rng: random.Random) -> str:
    """[issue 24] A declared-size bomb that tells the truth: a member (tree, raw file, skeleton, tensors)
    replaced by chunks of spaces that really decode to what they declare -- one huge chunk, a few big ones
    or many tiny ones -- every fingerprint recomputed. Members read whole are refused from their declared
    size; streamed ones stay bounded (128 MiB at most here: restore writes what they hold)."""
    m = json.loads(read_plain(gen_dir(repo) / "manifest.json"))
    rec = rng.choice(m["members"])
    chunk_raw, chunks = rng.choice([(64 << 20, 1), (64 << 20, 2), (1 << 20, 128), (16 << 10, 4096), (64 << 20, 32)])
    if rec["role"] != "tree":
        chunk_raw, chunks = min(chunk_raw, 1 << 20), min(chunks, 128)
    bomb_member(repo, rec, m, chunk_raw=chunk_raw, chunks=chunks, head=b"{}" if rec["role"] == "tree" else b"")
    reseal(repo, manifest_bytes=json.dumps(m, indent=1).encode())
    return f"bomb: {rec['path']} as {chunks} chunks of {chunk_raw} bytes"


def _declare(repo: Path, rng: random.Random) -> str:
    """[issue 24] A chunk that declares more raw bytes than its frame holds (up to the 64 MiB chunk limit, or
    past it), the chunk table still tiling the member: refused at parse or at the first decode, in bounded
    memory."""
    m = json.loads(read_plain(gen_dir(repo) / "manifest.json"))
    rec = rng.choice([r for r in m["members"] if r.get("chunks")])
    i = rng.randrange(len(rec["chunks"]))
    grow = rng.choice([1 << 20, 63 << 20, 64 << 20, 1 << 40])
    rec["chunks"][i]["raw_bytes"] += grow
    for c in rec["chunks"][i + 1:]:
        c["raw_offset"] += grow
    rec["raw_bytes"] += grow
    reseal(repo, manifest_bytes=json.dumps(m, indent=1).encode())
    return f"declare: chunk {i} of {rec['path']} + {grow} raw bytes"


KINDS = ("manifest", "text", "marker", "tree", "flip", "bomb", "declare")


def _mutate(repo: Path, rng: random.Random, kind: str | None = None) -> tuple[str, bool | str]:
    """Apply one mutation; return (description, whether verify must fail: for a flipped byte, the path of the
    member flipped, which verify and restore must name)."""
    g = gen_dir(repo)
    kind = kind or rng.choice(["manifest", "manifest", "manifest", "text", "marker", "tree", "flip", "bomb", "declare"])
    if kind == "bomb":
        return _bomb(repo, rng), False
    if kind == "declare":
        return _declare(repo, rng), True
    if kind in ("manifest", "text"):
        m = json.loads(read_plain(g / "manifest.json"))
        if kind == "manifest":
            what = _mutate_doc(m, rng)
            reseal(repo, manifest_bytes=json.dumps(m, indent=1).encode())
        else:
            text = json.dumps(m, indent=1)
            what = rng.choice(["1e999", "dup", "nan", "cut"])
            text = {"1e999": lambda t: t.replace('"metrics": {}', '"metrics": {"x": 1e999}'),
                    "dup": lambda t: t.replace('"tags": []', '"tags": [], "tags": [1]'),
                    "nan": lambda t: t.replace('"metrics": {}', '"metrics": {"x": NaN}'),
                    "cut": lambda t: t[:len(t) // 2]}[what](text)
            reseal(repo, manifest_bytes=text.encode())
        return f"{kind}: {what}", False
    if kind == "marker":
        marker = json.loads(read_plain(g / "USABLE.json"))
        what = _mutate_doc(marker, rng)
        write_plain(g / "USABLE.json", json.dumps(marker).encode())  # a hostile marker: not signed again
        return f"marker: {what}", False
    if kind == "tree":
        m = json.loads(read_plain(g / "manifest.json"))
        rec = member(m, "tree")
        import zstandard

        stored = read_plain(g / rec["stored_path"])
        raw = b"".join(zstandard.ZstdDecompressor().decompress(
            stored[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]],
            max_output_size=c["raw_bytes"]) if c["codec"] != "store" else
            stored[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]]
            for c in rec["chunks"])
        from ckpt_archive.format import fingerprint

        assert fingerprint.digest_like(raw, fingerprint.raw_fp(rec)) == fingerprint.raw_fp(rec)
        tree = json.loads(raw)
        what = _mutate_doc({"root": tree}, rng) if isinstance(tree, (dict, list)) else "none"
        put_member_bytes(repo, m, rec, json.dumps(tree).encode())
        reseal(repo, manifest_bytes=json.dumps(m, indent=1).encode())
        return f"tree: {what}", False
    m = json.loads(read_plain(g / "manifest.json"))
    rec = rng.choice([r for r in m["members"] if r["stored_bytes"]])
    p = g / rec["stored_path"]
    data = bytearray(p.read_bytes())  # the bytes on disk: the ciphertext, where the repository is encrypted
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    p.write_bytes(data)
    return f"flip: byte {i} of {rec['path']}", rec["path"]


@pytest.fixture(scope="module", params=MODES)
def pristine(tmp_path_factory, request):
    """``(repository, mode, keys)``: one small folder packed into a plain, an encrypted or a signed repository."""
    root = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    keys = make_keys(root / "keys")
    src = folder_source(root)
    repo = root / "repo"
    with pytest.MonkeyPatch.context() as mp:
        cheap_kdf(mp)
        res = runner.invoke(app, ["pack", str(src), "--repo", str(repo)], env=mode_env(request.param, keys))
    assert res.exit_code == 0, res.stdout
    assert is_encrypted(repo) == (request.param == "encrypted")
    return repo, request.param, keys


def _key_args(mode: str, keys: dict) -> list[str]:
    """What a user types to read the repository of ``mode``: its key file, or the signer it must trust."""
    return {"plain": [], "encrypted": ["--key-file", keys["key_file"]], "signed": ["--trust", keys["trust"]]}[mode]


def _check_one(pristine: tuple, scratch: Path, rng: random.Random, case: int, kind: str | None) -> None:
    src, mode, keys = pristine
    repo = scratch / "repo"
    shutil.copytree(src, repo)
    what, must_fail = _mutate(repo, rng, kind)
    commands = [["list", str(repo), "--all", "--json"], ["inspect", f"{repo}@1"], ["verify", f"{repo}@1"],
                ["verify", f"{repo}@1", "--deep"],
                ["restore", f"{repo}@1", "-o", str(scratch / "out"), "--restore-unverified"]]
    for args in commands:
        for note in repo.glob("generations/*/CHECK-FAILED.json"):
            note.unlink()  # each command meets the mutation itself (a recorded failed check is refused unread)
        res = runner.invoke(app, args + _key_args(mode, keys))
        text = res.stdout + (res.stderr or "")
        where = f"seed {SEED} {mode} case {case} ({what}): {' '.join(args[:1] + args[2:])}"
        assert res.exception is None or isinstance(res.exception, SystemExit), f"{where}: {res.exception!r}"
        assert res.exit_code in (0, 1, 2), f"{where}: exit {res.exit_code}"
        assert "Traceback" not in text and "internal error" not in text, f"{where}: {text[-600:]}"
        if must_fail and args[0] == "verify":
            assert res.exit_code == 1, f"{where}: a flipped byte was not detected"
        if isinstance(must_fail, str) and args[0] in ("verify", "restore"):  # a flipped byte: damage (exit 1),
            assert res.exit_code == 1, f"{where}: exit {res.exit_code}: {text[-600:]}"  # never "could not check"
            assert args[0] == "restore" or must_fail in text, f"{where}: the member is not named: {text[-600:]}"
    for escaped in (Path(f"/tmp/{ESCAPE}-{os.getpid()}"), scratch.parent / ESCAPE, scratch.parent.parent / ESCAPE):
        assert not escaped.exists(), f"seed {SEED} case {case} ({what}): wrote {escaped}"


def _fuzz(pristine: tuple, tmp_path: Path, cases: int, monkeypatch, *, every_kind: bool = False) -> None:
    """``cases`` mutations of a copy of ``pristine``; with ``every_kind``, case i is of kind ``KINDS[i]`` (so a few
    cases still meet every kind of mutation)."""
    use_mode(monkeypatch, pristine[1], pristine[2])  # the helpers read and seal the plaintext with the key
    rng = random.Random(SEED)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    for case in range(cases):
        scratch = tmp_path / f"case-{case}"
        scratch.mkdir()
        _check_one(pristine, scratch, rng, case, KINDS[case % len(KINDS)] if every_kind else None)
        shutil.rmtree(scratch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert peak - base < 1 << 30, f"memory grew by {(peak - base) >> 20} MiB over {cases} hostile archives"


def test_fuzzed_archives_end_in_documented_exit_codes_without_tracebacks_or_escapes(pristine, tmp_path, monkeypatch):
    if pristine[1] == "plain":
        _fuzz(pristine, tmp_path, FUZZ_FAST, monkeypatch)
    else:  # each kind of mutation once (a flipped ciphertext byte, a sealed bomb, a re-signed manifest edit...)
        _fuzz(pristine, tmp_path, len(KINDS), monkeypatch, every_kind=True)


@pytest.mark.slow
def test_fuzzed_archives_long_run(pristine, tmp_path, monkeypatch):
    _fuzz(pristine, tmp_path, FUZZ_SLOW, monkeypatch)


def test_a_chunk_that_declares_more_raw_bytes_fails_a_shallow_verify_in_every_mode(pristine, tmp_path, monkeypatch):
    """Fault (CI, seed 17 case 106): on an encrypted repository a resealed manifest whose chunk declared 1 MiB
    more raw bytes than its zstandard frame holds passed a shallow ``verify`` (exit 0): the frame headers were
    compared with the declared sizes only for local plain files. Every store now says the same (exit 1)."""
    src, mode, keys = pristine
    use_mode(monkeypatch, mode, keys)  # the helpers read and seal the plaintext with the key
    repo = tmp_path / "repo"
    shutil.copytree(src, repo)
    m = json.loads(read_plain(gen_dir(repo) / "manifest.json"))
    rec, i = next((r, j) for r in m["members"] for j, c in enumerate(r.get("chunks") or [])
                  if c.get("codec") != "store" and c["raw_bytes"])
    rec["chunks"][i]["raw_bytes"] += 1 << 20
    for c in rec["chunks"][i + 1:]:
        c["raw_offset"] += 1 << 20
    rec["raw_bytes"] += 1 << 20
    reseal(repo, manifest_bytes=json.dumps(m, indent=1).encode())
    res = runner.invoke(app, ["verify", f"{repo}@1"] + _key_args(mode, keys))
    assert res.exit_code == 1, res.stdout + (res.stderr or "")
    assert "frame holds" in res.stdout + (res.stderr or "") and rec["path"] in res.stdout + (res.stderr or "")
