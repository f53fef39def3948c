"""The malicious-archive suite, declared-size bombs (issue 24): a few KB on disk that declare, or really decode
to, gigabytes -- in every kind of file a reader reads (the state tree, the data ids, a tensors member's
safetensors header and chunk table, a raw file member, the manifest, the marker, ``repository.json``, a
failed-check note) and every chunk count (one huge chunk, many big chunks, many tiny chunks summing huge).

Each bomb is run against every reader -- verify, verify --deep, inspect, restore, restore --only, load, list
-- each in its own process, and must end with a clean one-line refusal and the documented exit code, never a
traceback, with a peak RSS under :data:`BOUND`. Before the bounded reader these peaked at 1-7 GB (the tree of
32 chunks of 64 MiB at 4.2 GB: every chunk was joined before the size limit looked). Each command meets the
damage itself (``fresh``: failed-check notes an earlier command recorded are removed first); ``list`` runs
last and shows the generation damaged.

Cost: the bombs are crafted once per module and every command of every bomb runs in one driver interpreter
that imports torch once and forks a child per command (tests/hostile_archive.py: ``run_many``), whose own
peak (``VmHWM``, reset in the child) is measured. The chunk-count variants run under ``-m slow``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch

import ckpt_archive
from ckpt_archive.format import limits

from hostile_archive import (bomb_member, bomb_pieces, edit_manifest, folder_source, gen_dir, json_bomb, member,
                             put_member_chunks, reseal, run_many)

#: Peak RSS any command may reach on a hostile repository (bytes); the interpreter with torch takes ~170-300 MB.
BOUND = 600 << 20
MiB = 1 << 20
#: every reader, in the order run (``list`` last: it must show what the others found)
COMMANDS = ("verify", "verify --deep", "inspect", "restore", "restore --only", "load", "list")
#: a generation whose manifest declares what no reader holds: damaged at listing, every reader refuses it
#: unread (verify and inspect exit 1; restore and load refuse a damaged generation, exit 2)
#: a generation whose manifest, tree or marker is refused as it is listed is damaged for every reader: exit 1 (found
#: wrong), restore and load included (they said 2 while verify said 1: break test)
REFUSED_AT_PARSE = {"verify": 1, "verify --deep": 1, "inspect": 1, "restore": 1, "restore --only": 1, "load": 1,
                    "list": 0}


@dataclasses.dataclass
class Bomb:
    """One hostile repository: how it is made, what each command must exit with, words its refusals name."""

    make: Callable[[Path], Path]
    expect: dict
    words: tuple = ()
    listed: str | None = "damaged"
    fresh: bool = True
    only: str = "model"
    slow: bool = False
    #: the commands the fast suite runs (all of them under ``-m slow``); None: all
    fast: tuple | None = None


def _pack(root: Path, *, data_ids: bool = False, exact: bool = True) -> Path:
    p = root / "ck.pt"
    torch.save({"model": {"w": torch.randn(32, 32), "b": torch.zeros(4)}, "step": 3}, p)
    ids = None
    if data_ids:
        ids = root / "ids.json"
        ids.write_text(json.dumps({"a": 1, "b": 2}))
    repo = root / "repo"
    ckpt_archive.pack(str(p), repo, annotations=ckpt_archive.Annotations(data_ids=str(ids) if ids else None))
    return repo


def _tree_raw(repo: Path) -> bytes:
    from ckpt_archive.repo.reader import ArchiveReader
    from ckpt_archive.repo.repository import Repository

    r = Repository.open(repo)
    g = r.generation(1)
    return bytes(ArchiveReader(r.store, g.key, g.manifest).read_member_bytes(g.manifest["tree_member"],
                                                                              limit=limits.MAX_TREE_BYTES))


def _decoded(path: Path, rec: dict) -> bytes:
    from ckpt_archive.format.codec import decode_chunk

    stored = path.read_bytes()
    return b"".join(bytes(decode_chunk(stored[c["stored_offset"]:c["stored_offset"] + c["stored_bytes"]], c["codec"],
                                       c["raw_bytes"])) for c in rec["chunks"])


# --- the bombs ------------------------------------------------------------------------------------------
def tree_bomb(chunk_raw: int, chunks: int):
    """The tree's JSON followed by gigabytes of spaces (valid JSON), every fingerprint recomputed."""
    def make(root: Path) -> Path:
        repo = _pack(root)
        head = _tree_raw(repo)
        edit_manifest(repo, lambda m: bomb_member(repo, member(m, "tree"), m, chunk_raw=chunk_raw, chunks=chunks,
                                                  head=head))
        return repo
    return make


def tree_cost_bomb(root: Path) -> Path:
    """A 60 MiB tree (under the size limit) whose ``"pad": [[],[],...]`` parses into ~1.5 GB."""
    repo = _pack(root)
    raw = _tree_raw(repo).rstrip()
    raw = raw[:-1] + b',"pad":' + json_bomb(60 * MiB) + b"}"
    assert len(raw) < limits.MAX_TREE_BYTES
    edit_manifest(repo, lambda m: put_member_chunks(repo, m, member(m, "tree"), [raw]))
    return repo


def data_ids_bomb(root: Path) -> Path:
    """Data ids then 2 GiB of spaces (valid JSON), in 32 real chunks (the raw fingerprint is not recomputed:
    the declared size refuses it first, and hashing 2 GiB would only slow the test)."""
    repo = _pack(root, data_ids=True)
    edit_manifest(repo, lambda m: put_member_chunks(repo, m, member(m, "data-ids"),
                                                    bomb_pieces(64 * MiB, 32, head=b'{"a": 1, "b": 2}'), raw_fp=False))
    return repo


def data_ids_cost_bomb(root: Path) -> Path:
    """96 MiB of ``[[],...]`` data ids (under the 256 MiB size limit) that parse into ~2.3 GB."""
    repo = _pack(root, data_ids=True)
    half = json_bomb(48 * MiB)
    edit_manifest(repo, lambda m: put_member_chunks(repo, m, member(m, "data-ids"), [half[:-1] + b",", half[1:]]))
    return repo


def header_bomb(root: Path) -> Path:
    """The tensors member's safetensors header grown to 2 GiB: its JSON then spaces, in 32 real chunks of
    64 MiB (chunk sha256s recomputed; the raw fingerprint is not: a reader gathered and copied the whole
    header before any fingerprint could fail)."""
    repo = _pack(root)
    from ckpt_archive.format.shard import encode_header

    def edit(m):
        rec = member(m, "tensors")
        data = _decoded(gen_dir(repo) / rec["stored_path"], rec)[rec["header_bytes"]:]
        total = 32 * 64 * MiB
        body = encode_header(rec["entries"], {"format": "ckpt-archive"})[8:]
        head = struct.pack("<Q", total - 8) + body
        put_member_chunks(repo, m, rec, bomb_pieces(64 * MiB, 32, head=head) + [data], raw_fp=False)
        rec["header_bytes"] = total
    edit_manifest(repo, edit)
    return repo


def declared_not_held(chunks: int, per_chunk: int):
    """``model/w``'s entry grows to ``chunks * per_chunk`` bytes, each chunk declaring ``per_chunk`` while its
    zstandard frame holds 4 KiB (incompressible, so the declared ratio is one a frame can have); header, entries,
    tensor record agree; the exact-bytes record is dropped (the file is then rebuilt by torch.save)."""
    def make(root: Path) -> Path:
        import zstandard

        from ckpt_archive.format import fingerprint
        from ckpt_archive.format.shard import encode_header

        repo = _pack(root)

        def edit(m):
            rec = member(m, "tensors")
            key, total = "model/w", chunks * per_chunk
            raw = _decoded(gen_dir(repo) / rec["stored_path"], rec)
            base = rec["header_bytes"]
            order = sorted(rec["entries"], key=lambda k: rec["entries"][k]["data_offsets"][0])
            kept = {k: raw[base + rec["entries"][k]["data_offsets"][0]:base + rec["entries"][k]["data_offsets"][1]]
                    for k in order}
            pos, entries = 0, {}
            for k in order:
                e = dict(rec["entries"][k])
                size = total if k == key else len(kept[k])
                e["data_offsets"] = [pos, pos + size]
                if k == key:
                    e["shape"] = [total // 4]
                entries[k] = e
                pos += size
            header = encode_header(entries, {"format": "ckpt-archive"})
            cctx = zstandard.ZstdCompressor()
            frame = cctx.compress(os.urandom(4096))
            table, stored, spos, rpos = [], [], 0, 0
            for raw_len, data in [(len(header), cctx.compress(header))] + [
                    (per_chunk, frame) if k == key else (len(kept[k]), cctx.compress(kept[k]))
                    for k in order for _ in range(chunks if k == key else 1)]:
                table.append({"raw_offset": rpos, "raw_bytes": raw_len, "stored_offset": spos,
                              "stored_bytes": len(data), "stored_sha256": hashlib.sha256(data).hexdigest(),
                              "codec": "zstd"})
                stored.append(data)
                spos, rpos = spos + len(data), rpos + raw_len
            (gen_dir(repo) / rec["stored_path"]).write_bytes(b"".join(stored))
            rec.update(entries=entries, header_bytes=len(header), raw_bytes=rpos, stored_bytes=spos, chunks=table,
                       chunk_codecs=["zstd"], stored_fp=fingerprint.sha256_chunks(c["stored_sha256"] for c in table))
            m["tensors"][key]["shape"] = [total // 4]
            for f in m["source"]["files"]:
                f.pop("exact", None)
            m["members"] = [r for r in m["members"] if r["role"] != "exact"]
            m["summary"]["raw_bytes"] = sum(r["raw_bytes"] for r in m["members"])
            m["summary"]["stored_bytes"] = sum(r["stored_bytes"] for r in m["members"])
        edit_manifest(repo, edit)
        return repo
    return make


def raw_file_stream(root: Path) -> Path:
    """An honest raw file member of a folder source that decodes to 256 MiB (4 chunks of 64 MiB, the largest
    chunk a reader accepts), its source record made to agree (size, sha256)."""
    repo = root / "repo"
    ckpt_archive.pack(str(folder_source(root)), repo)
    pieces = bomb_pieces(64 * MiB, 4, head=b"hello")
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)

    def edit(m):
        put_member_chunks(repo, m, member(m, "files/notes.txt"), pieces)
        for f in m["source"]["files"]:
            if f["relpath"] == "notes.txt":
                f.update(raw_bytes=4 * 64 * MiB, sha256=h.hexdigest())
    edit_manifest(repo, edit)
    return repo


def manifest_bomb(size: int):
    def make(root: Path) -> Path:
        repo = _pack(root)
        raw = (gen_dir(repo) / "manifest.json").read_bytes().rstrip()
        reseal(repo, manifest_bytes=raw[:-1] + b', "pad": ' + json_bomb(size) + b"}")
        return repo
    return make


def file_bomb(name: str):
    """``name`` (relative to the generation folder, or ``../../repository.json``) replaced by 100 MB of JSON
    that parses into ~2.4 GB."""
    def make(root: Path) -> Path:
        repo = _pack(root)
        (gen_dir(repo) / name).write_bytes(b'{"pad": ' + json_bomb(100 * MiB) + b"}")
        return repo
    return make


RAW_FILE = "raw file: 4 honest chunks of 64 MiB"
BOMBS = {
    # members read whole: refused from the manifest's numbers, before a byte is read
    "tree: 32 chunks of 64 MiB": Bomb(tree_bomb(64 * MiB, 32), REFUSED_AT_PARSE,
                                      ("tree.json", str(limits.MAX_TREE_BYTES))),
    "tree: 2048 chunks of 1 MiB": Bomb(tree_bomb(MiB, 2048), REFUSED_AT_PARSE,
                                       ("tree.json", str(limits.MAX_TREE_BYTES)), slow=True),
    "tree: 60 MiB that parse into 1.5 GB": Bomb(tree_cost_bomb, {c: 0 if c == "list" else 1 for c in COMMANDS},
                                                ("tree.json", "memory"), fast=("verify", "restore", "load", "list")),
    "data ids: 32 chunks of 64 MiB": Bomb(data_ids_bomb, {**REFUSED_AT_PARSE, "restore --data-ids": 1},
                                          ("data-ids.json",), slow=True),
    "data ids: 96 MiB that parse into 2.3 GB": Bomb(data_ids_cost_bomb, {"verify": 0, "verify --deep": 1,
                                                                         "restore --data-ids": 1, "list": 0},
                                                    ("data-ids.json", "memory"), slow=True),
    "safetensors header: 32 chunks of 64 MiB": Bomb(header_bomb, REFUSED_AT_PARSE,
                                                    ("tensors-00000", str(limits.MAX_MEMBER_HEADER_BYTES)),
                                                    fast=("verify --deep", "load", "list")),
    # members read as a stream: allocated by what is decoded, refused at the first chunk that lies
    "tensors: 32 chunks declaring 64 MiB, holding 4 KiB": Bomb(
        declared_not_held(32, 64 * MiB), {"verify": 1, "verify --deep": 1, "inspect": 0, "restore": 1,
                                          "restore --only": 1, "load": 1, "list": 0}, ("tensors-00000",)),
    "tensors: 4096 chunks declaring 512 KiB, holding 4 KiB": Bomb(
        declared_not_held(4096, 512 << 10), {"verify": 1, "verify --deep": 1, "inspect": 0, "restore": 1,
                                             "restore --only": 1, "load": 1, "list": 0}, ("tensors-00000",),
        slow=True),
    RAW_FILE: Bomb(raw_file_stream, {c: 0 for c in COMMANDS}, listed="usable",
                                                only="model.pt", slow=True),
    # whole files held in memory: read at most limit + 1 bytes, parse cost counted first
    "manifest: 150 MB": Bomb(manifest_bomb(150 * MiB), REFUSED_AT_PARSE, ("manifest.json",),
                             fast=("verify", "load", "list")),
    "manifest: 100 MB that parse into 2.4 GB": Bomb(manifest_bomb(100 * MiB), REFUSED_AT_PARSE,
                                                    ("manifest.json", "memory"), slow=True),
    "marker: 100 MB": Bomb(file_bomb("USABLE.json"), {**REFUSED_AT_PARSE, "inspect": 0}, ("USABLE",),
                           fast=("verify", "list")),
    "repository.json: 100 MB": Bomb(file_bomb("../../repository.json"), {c: 1 for c in COMMANDS},
                                    ("repository.json", str(limits.MAX_SMALL_DOC_BYTES)), listed=None,
                                    fast=("list",)),
    # a note that cannot be read is still a failed check; verify --deep (last) checks again and removes it
    "failed-check note: 100 MB": Bomb(file_bomb("CHECK-FAILED.json"),
                                      {"verify": 1, "inspect": 1, "restore": 1, "restore --only": 1, "load": 1,
                                       "list": 0, "verify --deep": 0}, fresh=False, slow=True),
}


def _commands(bomb: Bomb, slow: bool) -> list[str]:
    order = COMMANDS if bomb.fresh else ("verify", "inspect", "restore", "restore --only", "load", "list",
                                         "verify --deep")
    return [c for c in order + ("restore --data-ids",)
            if c in bomb.expect and (slow or bomb.fast is None or c in bomb.fast)]


def _job(name: str, repo: Path, out: Path, bomb: Bomb) -> dict:
    spec = f"{repo}@1"
    table = {"verify": ["verify", spec], "verify --deep": ["verify", spec, "--deep"], "inspect": ["inspect", spec],
             "restore": ["restore", spec, "-o", str(out / "o.pt")],
             "restore --only": ["restore", spec, "-o", str(out / "p.pt"), "--only", bomb.only],
             "list": ["list", str(repo), "--all", "--json"],
             "restore --data-ids": ["restore", spec, "-o", str(out / "d.pt"), "--data-ids",
                                    str(repo.parent / "ids.json")]}
    job = {"load": [str(repo), 1]} if name == "load" else {"cli": table[name]}
    return {**job, "repo": str(repo), "fresh": bomb.fresh and name != "list"}


def _selected(session) -> list[str]:
    """The bombs whose test this session runs (``-m "not slow"``, ``-k``, a node id: only those are made)."""
    names = {item.callspec.params["name"] for item in session.items
             if getattr(item, "originalname", None) == "test_a_size_bomb_is_refused_cleanly_by_every_reader_in_bounded_memory"}
    if any(getattr(item, "originalname", None) == "test_the_honest_raw_file_of_256_MiB_came_back_whole"
           for item in session.items):
        names.add(RAW_FILE)
    return [n for n in BOMBS if n in names]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, request) -> dict:
    """Every selected bomb crafted, then every command of every bomb run in one driver: ``{bomb: [(command,
    result)]}`` plus the output folder of each."""
    names = _selected(request.session)
    slow = any(BOMBS[n].slow for n in names)  # the slow suite runs every command of every bomb
    jobs, index = [], {}
    for name in names:
        root = tmp_path_factory.mktemp("bomb")
        repo = BOMBS[name].make(root)
        out = root / "out"
        out.mkdir()
        cmds = _commands(BOMBS[name], slow)
        index[name] = (len(jobs), cmds, out)
        jobs += [_job(c, repo, out, BOMBS[name]) for c in cmds]
    if not jobs:
        return {}
    results = run_many(jobs, tmp_path_factory.mktemp("run"), timeout=1800)
    return {name: ([(c, results[start + i]) for i, c in enumerate(cmds)], out)
            for name, (start, cmds, out) in index.items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if b.slow else []) for n, b in BOMBS.items()])
def test_a_size_bomb_is_refused_cleanly_by_every_reader_in_bounded_memory(outcomes, name):
    """Fault (issue 24, items 3 and 8): an 81 KB repository whose tree.json is its JSON then 2 GiB of spaces
    (every fingerprint recomputed) made verify, inspect, verify --deep, restore --only and load peak at 4.2 GB
    (7.4 GB at 16 GiB declared, then a misleading "chunk does not decode", and inspect exit 0); a 200 MB
    manifest, marker or repository.json cost 3-6x its size, a dense one ~25x. Now every reader refuses each
    bomb with its documented exit code, naming the file (and the limit), in bounded memory; ``list``
    afterwards says damaged."""
    bomb = BOMBS[name]
    runs, out = outcomes[name]
    for command, res in runs:
        text = res["out"] + res["err"]
        where = f"{name}: {command}: exit {res['rc']}, peak {res['peak'] >> 20} MiB: {text[-800:]}"
        assert "Traceback" not in text and "internal error" not in text and res["rc"] != 99, where
        assert res["rc"] == bomb.expect[command], where
        assert res["peak"] < BOUND, where
        if bomb.expect[command] and command != "list":
            assert all(w in text for w in bomb.words), where
        if command == "list" and bomb.listed is not None:
            assert json.loads(res["out"])["generations"][0]["status"] == bomb.listed, where
    for command, path in (("restore", "o.pt"), ("restore --only", "p.pt"), ("restore --data-ids", "d.pt")):
        if bomb.expect.get(command):  # nothing handed out from a refused generation
            assert not (out / path).exists(), f"{name}: {command} wrote its output"


@pytest.mark.slow
def test_the_honest_raw_file_of_256_MiB_came_back_whole(outcomes):
    _, out = outcomes[RAW_FILE]
    assert (out / "o.pt" / "notes.txt").stat().st_size == 4 * 64 * MiB


def test_limits_leave_room_for_a_state_of_100k_tensors():
    """The limits are sized on measured real states (docs/FORMAT.md, "Reading hostile archives"): the manifest
    of 100,000 tensors (57 MB, indent 1) estimates at ~430 MiB to parse, its tree (11 MB) at 75 MiB. A
    synthetic manifest and tree of that shape pass the limits; three times as many tensors do not."""
    from ckpt_archive.format.jsonio import parse_cost

    def docs(n: int) -> tuple[bytes, bytes]:
        fp = "blake3:" + "ab" * 32
        tensors = {f"model/layer{i}.weight": {"kind": "torch", "member": "tensors-00000.safetensors",
                                              "entry": f"model/layer{i}.weight", "dtype": "float32", "shape": [4],
                                              "raw_fp": fp} for i in range(n)}
        entries = {k: {"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * i + 16], "raw_fp": fp}
                   for i, k in enumerate(tensors)}
        manifest = json.dumps({"tensors": tensors, "members": [{"entries": entries}]}, indent=1).encode()
        tree = json.dumps({"model": {k: {"$t": "tensor", "key": k} for k in tensors}}, separators=(",", ":"))
        return manifest, tree.encode()

    manifest, tree = docs(100_000)
    assert len(manifest) < limits.MAX_MANIFEST_BYTES and parse_cost(manifest) < limits.MAX_MANIFEST_COST
    assert len(tree) < limits.MAX_TREE_BYTES and parse_cost(tree) < limits.MAX_TREE_COST
    assert 3 * parse_cost(manifest) > limits.MAX_MANIFEST_COST  # the cost is linear in the tensors


#: JSON the tool reads that is not an archive's or a repository's (a user's own input file, a source, the
#: tool's own schemas, bytes it has just encoded itself), each with why no parse-cost bound applies there
_INPUT_JSON = {
    ("ckpt_archive/ops/backup.py", "busy-source check of a source folder's .json (at most 16 MiB, read only when that small)"),
    ("ckpt_archive/ops/status.py", "the user's own status state file"),
    ("ckpt_archive/format/manifest.py", "the tool's schemas; a manifest just sealed (its cost checked first)"),
    ("ckpt_archive/repo/lock.py", "the lock owner file (64 KiB limit; the file layer's)"),
}


def test_every_archive_json_and_file_read_is_bounded_by_construction():
    """The bound is structural (issue 24): no module reads a repository file through ``store.read_bytes`` (only
    ``repository.read_small``/``read_json``, at most limit + 1 bytes), every strict-JSON parse of an archive or
    repository document passes a parse-cost bound (``max_cost``), and ``ArchiveReader.read_member_bytes`` has
    no default limit. A new reader cannot forget: this test names the call that does."""
    import ast
    import inspect as pyinspect

    from ckpt_archive.repo.reader import ArchiveReader

    root = Path(ckpt_archive.__file__).parent
    allowed = {f for f, _ in _INPUT_JSON}
    unbounded, raw_reads = [], []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            base = f.value if isinstance(f, ast.Attribute) else None
            if name == "read_bytes" and isinstance(base, ast.Attribute) and base.attr == "store" \
                    and not rel.startswith("ckpt_archive/store/"):
                raw_reads.append(f"{rel}:{node.lineno}")
            if name == "read_bytes" and isinstance(base, ast.Name) and base.id == "store" \
                    and not rel.startswith("ckpt_archive/store/"):
                raw_reads.append(f"{rel}:{node.lineno}")
            is_jsonio = (isinstance(base, ast.Name) and base.id == "jsonio") or (base is None and name == "loads")
            if name == "loads" and is_jsonio and rel.startswith(("ckpt_archive/repo/", "ckpt_archive/ops/",
                                                                  "ckpt_archive/format/manifest.py",
                                                                  "ckpt_archive/format/shard.py")):
                if not any(k.arg == "max_cost" for k in node.keywords) and rel not in allowed:
                    unbounded.append(f"{rel}:{node.lineno}")
    assert not raw_reads, f"repository files read whole without a limit (use repository.read_small): {raw_reads}"
    assert not unbounded, f"archive JSON parsed without a parse-cost bound (max_cost=): {unbounded}"
    limit = pyinspect.signature(ArchiveReader.read_member_bytes).parameters["limit"]
    assert limit.default is pyinspect.Parameter.empty and limit.kind is pyinspect.Parameter.KEYWORD_ONLY
