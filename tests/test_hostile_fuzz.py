"""A seeded mutation fuzzer over a real archive (issue 17): it mutates manifests, markers, state trees and
member bytes of a real generation -- fingerprints recomputed, so only the mutation is wrong -- and runs
the commands a user would run on it. Each run must end with a documented exit code (0, 1, 2), never a
traceback or an "internal error", never write outside its scratch folder, and stay within a memory bound.
A flipped member byte (fingerprints *not* recomputed) must always be found by ``verify``.

The fast suite runs FUZZ_FAST cases (a few seconds); ``-m slow`` runs FUZZ_SLOW more. Set
``CKPT_FUZZ_SEED`` to replay a seed; a failure names its seed and mutation.
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

from hostile_archive import bomb_member, folder_source, gen_dir, member, put_member_bytes, reseal

FUZZ_FAST = 12
FUZZ_SLOW = 300
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
    m = json.loads((gen_dir(repo) / "manifest.json").read_text())
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
    m = json.loads((gen_dir(repo) / "manifest.json").read_text())
    rec = rng.choice([r for r in m["members"] if r.get("chunks")])
    i = rng.randrange(len(rec["chunks"]))
    grow = rng.choice([1 << 20, 63 << 20, 64 << 20, 1 << 40])
    rec["chunks"][i]["raw_bytes"] += grow
    for c in rec["chunks"][i + 1:]:
        c["raw_offset"] += grow
    rec["raw_bytes"] += grow
    reseal(repo, manifest_bytes=json.dumps(m, indent=1).encode())
    return f"declare: chunk {i} of {rec['path']} + {grow} raw bytes"


def _mutate(repo: Path, rng: random.Random) -> tuple[str, bool]:
    """Apply one mutation; return (description, whether verify must fail)."""
    g = gen_dir(repo)
    kind = rng.choice(["manifest", "manifest", "manifest", "text", "marker", "tree", "flip", "bomb", "declare"])
    if kind == "bomb":
        return _bomb(repo, rng), False
    if kind == "declare":
        return _declare(repo, rng), True
    if kind in ("manifest", "text"):
        m = json.loads((g / "manifest.json").read_text())
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
        marker = json.loads((g / "USABLE.json").read_text())
        what = _mutate_doc(marker, rng)
        (g / "USABLE.json").write_text(json.dumps(marker))
        return f"marker: {what}", False
    if kind == "tree":
        m = json.loads((g / "manifest.json").read_text())
        rec = member(m, "tree")
        from ckpt_archive.repo.reader import ArchiveReader  # noqa: F401  (the tree is read by the tool below)
        import hashlib
        import zstandard

        raw = b"".join(zstandard.ZstdDecompressor().decompress(
            (g / rec["stored_path"]).read_bytes()[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]],
            max_output_size=c["raw_bytes"]) if c["codec"] != "store" else
            (g / rec["stored_path"]).read_bytes()[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]]
            for c in rec["chunks"])
        from ckpt_archive.format import fingerprint

        assert fingerprint.digest_like(raw, fingerprint.raw_fp(rec)) == fingerprint.raw_fp(rec)
        tree = json.loads(raw)
        what = _mutate_doc({"root": tree}, rng) if isinstance(tree, (dict, list)) else "none"
        put_member_bytes(repo, m, rec, json.dumps(tree).encode())
        reseal(repo, manifest_bytes=json.dumps(m, indent=1).encode())
        return f"tree: {what}", False
    m = json.loads((g / "manifest.json").read_text())
    rec = rng.choice([r for r in m["members"] if r["stored_bytes"]])
    p = g / rec["stored_path"]
    data = bytearray(p.read_bytes())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    p.write_bytes(data)
    return f"flip: byte {i} of {rec['path']}", True


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-source")
    src = folder_source(root)
    repo = root / "repo"
    res = runner.invoke(app, ["pack", str(src), "--repo", str(repo)])
    assert res.exit_code == 0, res.stdout
    return repo


def _check_one(pristine: Path, scratch: Path, rng: random.Random, case: int) -> None:
    repo = scratch / "repo"
    shutil.copytree(pristine, repo)
    what, must_fail = _mutate(repo, rng)
    commands = [["list", str(repo), "--all", "--json"], ["inspect", f"{repo}@1"], ["verify", f"{repo}@1"],
                ["verify", f"{repo}@1", "--deep"],
                ["restore", f"{repo}@1", "-o", str(scratch / "out"), "--restore-unverified"]]
    for args in commands:
        for note in repo.glob("generations/*/CHECK-FAILED.json"):
            note.unlink()  # each command meets the mutation itself (a recorded failed check is refused unread)
        res = runner.invoke(app, args)
        text = res.stdout + (res.stderr or "")
        where = f"seed {SEED} case {case} ({what}): {' '.join(args[:1] + args[2:])}"
        assert res.exception is None or isinstance(res.exception, SystemExit), f"{where}: {res.exception!r}"
        assert res.exit_code in (0, 1, 2), f"{where}: exit {res.exit_code}"
        assert "Traceback" not in text and "internal error" not in text, f"{where}: {text[-600:]}"
        if must_fail and args[0] == "verify":
            assert res.exit_code == 1, f"{where}: a flipped byte was not detected"
    for escaped in (Path(f"/tmp/{ESCAPE}-{os.getpid()}"), scratch.parent / ESCAPE, scratch.parent.parent / ESCAPE):
        assert not escaped.exists(), f"seed {SEED} case {case} ({what}): wrote {escaped}"


def _fuzz(pristine: Path, tmp_path: Path, cases: int) -> None:
    rng = random.Random(SEED)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    for case in range(cases):
        scratch = tmp_path / f"case-{case}"
        scratch.mkdir()
        _check_one(pristine, scratch, rng, case)
        shutil.rmtree(scratch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert peak - base < 1 << 30, f"memory grew by {(peak - base) >> 20} MiB over {cases} hostile archives"


def test_fuzzed_archives_end_in_documented_exit_codes_without_tracebacks_or_escapes(pristine, tmp_path):
    _fuzz(pristine, tmp_path, FUZZ_FAST)


@pytest.mark.slow
def test_fuzzed_archives_long_run(pristine, tmp_path):
    _fuzz(pristine, tmp_path, FUZZ_SLOW)
