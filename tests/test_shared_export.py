"""Shared objects (issue 15) seen from export, list, inspect and verify.

A LoRA-like run: a frozen base (two tensors above ``share_min_bytes``, stored once as shared objects) and
an adapter with its Adam state that change every step (small: kept in each generation's own files).
Destinations: a local folder, fsspec's ``memory://`` and moto's S3 server (tests/s3server.py): the copy
goes through each store's own create (an atomic link locally, a conditional PUT on S3).
"""
from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from ckpt_archive.format.objects import object_key, own_stored_bytes, refs
from ckpt_archive.ops.export import ExportOptions, export
from ckpt_archive.repo.repository import Repository
from s3server import s3_env, s3_server, s3_url  # noqa: F401  (pytest fixtures)
from helpers import assert_same as _assert_bit_equal

SHARE = 64 << 10   # entries of at least 64 KiB are shared (the default is 1 MiB; small here for speed)
OPTIONS = ca.PackOptions(chunk_bytes=32 << 10, share_min_bytes=SHARE)


def _base() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"q": torch.randn(192, 256, generator=g), "emb": torch.randn(300, 128, generator=g).to(torch.bfloat16)}


def _state(step: int, base: dict) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    a = torch.randn(8, 256, generator=g)
    return {"model": {**base, "lora_a": a, "lora_b": torch.randn(192, 8, generator=g)},
            "optimizer": {"state": {0: {"exp_avg": torch.randn(8, 256, generator=g), "step": torch.tensor(float(step))}},
                          "param_groups": [{"lr": 1e-4, "params": [0]}]},
            "step": step}


def _pack(repo, step: int, base: dict) -> dict:
    st = _state(step, base)
    ca.pack(st, repo, OPTIONS, ca.Annotations(progress={"step": step}))
    return st


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


class CopyMeter:
    """A progress callback that counts the bytes the copy phase moves (told by ``phase``), apart from the
    re-read and trial-reload phases: what was really sent, measured outside the export's own accounting."""

    def __init__(self):
        self.current = ""
        self.copied = 0

    def phase(self, name: str, total) -> None:
        self.current = name

    def __call__(self, n: int) -> None:
        if self.current.startswith("copy of generation"):
            self.copied += n


def _own_bytes(manifest: dict) -> int:
    return sum(own_stored_bytes(m) for m in manifest["members"])


@pytest.fixture
def lora(tmp_path):
    """A source repository with two generations sharing a frozen base (2 shared objects)."""
    repo = tmp_path / "src"
    base = _base()
    states = {n: _pack(repo, n, base) for n in (1, 2)}
    gens = Repository.open(repo).generations()
    assert all(g.usable for g in gens)
    assert refs(gens[0].manifest) == refs(gens[1].manifest) and len(refs(gens[0].manifest)) == 2
    return repo, base, states


def _dest(kind: str, tmp_path, request) -> str:
    if kind == "local":
        return str(tmp_path / "dst")
    if kind == "memory":
        return f"memory://shared-export-{uuid.uuid4().hex}/dst"
    return request.getfixturevalue("s3_url")


# --- export ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_second_export_of_a_lora_run_moves_only_the_changed_bytes(lora, kind, tmp_path, request):
    repo, base, states = lora
    dest = _dest(kind, tmp_path, request)
    src = Repository.open(repo)
    m1, m2 = src.generation(1).manifest, src.generation(2).manifest
    shared = sum(refs(m1).values())

    first_meter = CopyMeter()
    first = export(repo, dest, ExportOptions(generations="1"), on_bytes=first_meter)
    assert first.ok and first.bytes_copied == _own_bytes(m1) + shared == first_meter.copied
    assert first.bytes_skipped == 0

    meter = CopyMeter()
    second = export(repo, dest, ExportOptions(generations="2"), on_bytes=meter)
    assert second.ok and [(g.generation, g.status) for g in second.generations] == [(2, "exported")]
    # only generation 2's own files moved: the frozen base's objects were already there
    assert meter.copied == second.bytes_copied == _own_bytes(m2)
    assert second.bytes_skipped == shared
    assert meter.copied * 10 < shared
    actions = {o["key"]: o["action"] for o in second.generations[0].members if o["object"]}
    assert actions == {object_key(fp): "present" for fp in refs(m2)}

    dst = Repository.open(dest)
    assert [(g.number, g.status) for g in dst.generations()] == [(1, "usable"), (2, "usable")]
    for fp, size in refs(m2).items():
        assert dst.store.size(object_key(fp)) == size
    for n in (1, 2):  # bit-exact from the destination, each generation through the same objects
        _assert_bit_equal(states[n], ca.load(dest, str(n)))
        assert ca.verify(dest, str(n), options=ca.VerifyOptions(deep=True)).ok


def test_export_cli_json_reports_bytes_copied_and_skipped(lora, tmp_path):
    repo, _, states = lora
    dest = tmp_path / "dst"
    assert cli("export", f"{repo}@1", "--to", str(dest)).exit_code == 0
    res = cli("export", f"{repo}@2", "--to", str(dest), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    m2 = Repository.open(repo).generation(2).manifest
    assert doc["bytes_copied"] == _own_bytes(m2) and doc["bytes_skipped"] == sum(refs(m2).values())
    (g,) = doc["generations"]
    assert g["bytes_skipped"] == doc["bytes_skipped"]
    listed = {o["key"] for o in g["objects"] if o["object"]}   # the recovery proof lists the objects too
    assert listed == {object_key(fp) for fp in refs(m2)}
    human = cli("export", f"{repo}@2", "--to", str(tmp_path / "other"))
    assert human.exit_code == 0 and "skipped" in human.output


def test_one_run_copies_each_shared_object_once(lora, tmp_path):
    repo, base, states = lora
    states[3] = _pack(repo, 3, base)
    src = Repository.open(repo)
    manifests = [src.generation(n).manifest for n in (1, 2, 3)]
    meter = CopyMeter()
    res = export(repo, tmp_path / "dst", ExportOptions(generations="all"), on_bytes=meter)
    shared = sum(refs(manifests[0]).values())
    assert res.ok and meter.copied == res.bytes_copied == sum(map(_own_bytes, manifests)) + shared
    assert res.bytes_skipped == 0                           # nothing was at DEST before this run (issue 26)
    assert [g.bytes_skipped for g in res.generations] == [0, shared, shared]  # per generation: not copied again
    copied = [o["key"] for g in res.generations for o in g.members if o["object"] and o["action"] == "copied"]
    assert sorted(copied) == sorted(object_key(fp) for fp in refs(manifests[0]))
    _assert_bit_equal(states[3], ca.load(tmp_path / "dst"))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_corrupted_shared_object_at_the_source_is_refused_and_nothing_published(lora, kind, tmp_path, request):
    repo, _, _ = lora
    dest = _dest(kind, tmp_path, request)
    fp = sorted(refs(Repository.open(repo).generation(2).manifest))[0]
    victim = repo / object_key(fp)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x04  # same size: only the chunk hashes can tell
    victim.write_bytes(bytes(data))
    res = cli("export", f"{repo}@2", "--to", dest)
    assert res.exit_code == 1, res.output
    assert object_key(fp) in res.output and "source" in res.output
    dst = Repository.open(dest)
    assert not dst.store.exists("generations/00000002/USABLE.json")
    assert not dst.store.exists(object_key(fp))            # the bad copy was never committed
    assert [g.status for g in dst.generations()] == ["partial"]
    if kind == "local":  # nor left under a temporary name
        assert not [p for p in (tmp_path / "dst" / "objects").rglob(".*") if p.is_file()]


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes"])
def test_object_left_damaged_at_destination_by_an_interrupted_export_is_replaced_not_trusted(lora, damage, tmp_path,
                                                                                          monkeypatch):
    repo, _, states = lora
    dest = tmp_path / "dst"
    src = Repository.open(repo)
    m2 = src.generation(2).manifest
    # an interrupted export: the manifest and one object are there, no marker
    monkeypatch.setenv("CKPT_ARCHIVE_INJECT", "export-after-object=raise")
    with pytest.raises(RuntimeError):
        export(repo, dest, ExportOptions(generations="2"))
    monkeypatch.delenv("CKPT_ARCHIVE_INJECT")
    dst = Repository.open(dest)
    assert dst.generation(2).status == "partial"
    present = [fp for fp in refs(m2) if dst.store.exists(object_key(fp))]
    assert len(present) == 1
    path = dest / object_key(present[0])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3] if damage == "truncated"
                     else data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])

    res = export(repo, dest, ExportOptions(generations="2"))
    (g,) = res.generations
    assert g.status == "resumed"
    actions = {o["key"]: o["action"] for o in g.members if o["object"]}
    assert actions[object_key(present[0])] == "replaced"
    assert path.read_bytes() == (repo / object_key(present[0])).read_bytes()
    # nothing was trusted on its size alone: what counts as skipped is what the killed run left whole (checked)
    kept = [o for o in g.members if o["action"] == "present" and not o["key"].endswith("/manifest.json")]
    assert object_key(present[0]) not in {o["key"] for o in kept}
    assert res.bytes_skipped == g.bytes_skipped == sum(o["bytes"] for o in kept)
    assert Repository.open(dest).generation(2).usable
    _assert_bit_equal(states[2], ca.load(dest))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_export_killed_while_writing_a_shared_object_resumes_and_cleans_what_it_left(lora, kind, tmp_path, request):
    import subprocess
    import sys

    repo, _, states = lora
    dest = _dest(kind, tmp_path, request)
    env = {**os.environ, "CKPT_ARCHIVE_INJECT": "export-object-write=kill@2"}
    killed = subprocess.run([sys.executable, "-m", "ckpt_archive", "export", f"{repo}@2", "--to", dest], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    dst = Repository.open(dest)
    assert dst.generation(2).status == "partial"
    if kind == "local":  # the object being written lies under a temporary name, never its own
        leftovers = [p for p in (tmp_path / "dst" / "objects").rglob(".*") if p.is_file()]
        assert leftovers
    res = cli("export", f"{repo}@2", "--to", dest, "--json")
    assert res.exit_code == 0, res.output
    (g,) = json.loads(res.stdout)["generations"]
    assert g["status"] == "resumed"
    if kind == "local":
        assert sorted(g["cleaned"]["removed"]) == sorted(str(p.relative_to(tmp_path / "dst")) for p in leftovers)
        assert not [p for p in (tmp_path / "dst" / "objects").rglob(".*") if p.is_file()]
    acts = sorted(o["action"] for o in g["objects"] if o["object"])
    assert acts == ["copied", "present"]                     # the one finished before the kill is kept
    assert Repository.open(dest).generation(2).usable
    _assert_bit_equal(states[2], ca.load(dest))


@pytest.mark.slow
def test_rerun_aborts_the_multipart_upload_of_a_shared_object_a_killed_export_left(s3_server, s3_url, tmp_path,
                                                                                  monkeypatch):
    """A process killed mid-upload of a shared object leaves invisible, billed parts below ``objects/``:
    the re-run, holding DEST's lock, aborts them before copying the object again."""
    import subprocess
    import sys

    repo = tmp_path / "big"
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(3_000_000, generator=g), "step": 1}
    ca.pack(state, repo)   # an ~11 MiB entry: a shared object (default 1 MiB), uploaded in parts
    (fp,) = refs(Repository.open(repo).generation(1).manifest)
    monkeypatch.setenv("FSSPEC_S3", json.dumps({"default_block_size": 5 << 20}))
    env = {**os.environ, "CKPT_ARCHIVE_INJECT": "export-object-write=kill"}
    killed = subprocess.run([sys.executable, "-m", "ckpt_archive", "export", str(repo), "--to", s3_url], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    bucket, _, prefix = s3_url[len("s3://"):].partition("/")
    client = s3_server.client()
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == [f"{prefix}/{object_key(fp)}"]
    assert not Repository.open(s3_url).store.exists(object_key(fp))      # never visible half-written

    res = cli("export", str(repo), "--to", s3_url, "--json")
    assert res.exit_code == 0, res.output
    (eg,) = json.loads(res.stdout)["generations"]
    assert eg["status"] == "resumed" and eg["cleaned"]["aborted_uploads"] == [object_key(fp)]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    _assert_bit_equal(state, ca.load(s3_url))


def test_same_tensor_encoded_otherwise_at_destination_lives_beside_it_never_overwriting_it(lora, tmp_path):
    """Fault guarded: the same tensor encoded another way at DEST (another chunk size, codec or zstd build)
    either overwriting the bytes DEST's generations expect, or blocking the export. Object names cover the
    stored chunks, so both encodings live side by side."""
    repo, base, _ = lora
    dest = tmp_path / "dst"
    # DEST's own run packed the same frozen base with another chunk size: same raw bytes, other stored bytes
    for n in range(1, 4):
        ca.pack(_state(100 + n, base), dest, ca.PackOptions(chunk_bytes=16 << 10, share_min_bytes=SHARE))
    theirs = Repository.open(dest).generation(1).manifest
    mine = Repository.open(repo).generation(2).manifest
    assert {o[:64] for o in refs(theirs)} == {o[:64] for o in refs(mine)} and not set(refs(theirs)) & set(refs(mine))
    before = {o: (dest / object_key(o)).read_bytes() for o in refs(theirs)}
    for n in (3, 4):  # the source's generation 4: a number DEST does not hold yet
        _pack(repo, n, base)
    res = cli("export", f"{repo}@4", "--to", str(dest))
    assert res.exit_code == 0, res.output
    assert {o: (dest / object_key(o)).read_bytes() for o in refs(theirs)} == before   # never overwritten
    for n in (1, 2, 3, 4):
        assert ca.verify(dest, str(n), options=ca.VerifyOptions(deep=True)).ok


# --- list and inspect -------------------------------------------------------------------------------
def test_list_shows_each_generations_new_bytes_and_its_total(lora, tmp_path):
    repo, _, _ = lora
    res = cli("list", str(repo), "--json")
    assert res.exit_code == 0, res.output
    rows = {r["generation"]: r for r in json.loads(res.stdout)["generations"]}
    objects = sum(os.path.getsize(p) for p in (repo / "objects").rglob("*.ckz"))
    own = {n: sum(os.path.getsize(p) for p in (repo / "generations" / f"{n:08d}").glob("*.ckz")) for n in (1, 2)}
    # generation 1 wrote its own files and the base's objects; generation 2 only its own files
    assert rows[1]["new_stored_bytes"] == own[1] + objects
    assert rows[2]["new_stored_bytes"] == own[2]
    for n in (1, 2):  # the total is everything it references
        assert rows[n]["total_stored_bytes"] == rows[n]["stored_bytes"] == own[n] + objects
        assert rows[n]["shared_objects"] == 2
    text = cli("list", str(repo))
    assert text.exit_code == 0 and "new" in text.output


def test_list_of_a_generation_without_sharing_shows_new_equal_to_total(tmp_path):
    repo = tmp_path / "plain"
    ca.pack({"w": torch.ones(4)}, repo, ca.PackOptions(share_min_bytes=0))
    (row,) = json.loads(cli("list", str(repo), "--json").stdout)["generations"]
    assert row["new_stored_bytes"] == row["stored_bytes"] > 0 and row["shared_objects"] == 0


def test_inspect_shows_what_a_generation_shares_and_with_which_generations(lora):
    repo, base, _ = lora
    _pack(repo, 3, base)
    res = cli("inspect", f"{repo}@2", "--json")
    assert res.exit_code == 0, res.output
    sh = json.loads(res.stdout)["shared"]
    sizes = {p.stem: os.path.getsize(p) for p in (repo / "objects").rglob("*.ckz")}
    assert {o["oid"]: o["stored_bytes"] for o in sh["objects"]} == sizes
    assert all(o["generations"] == [1, 2, 3] for o in sh["objects"])
    entries = sorted(e for o in sh["objects"] for e in o["entries"])
    assert len(entries) == 2 and all(e.startswith("tensors-") for e in entries)
    assert sh["object_bytes"] == sh["shared_bytes"] == sum(sizes.values())
    assert sh["shared_with"] == {"1": sum(sizes.values()), "3": sum(sizes.values())}
    text = cli("inspect", f"{repo}@2").output
    # each object by the first 12 hex digits of its fingerprint, as git shortens commits (issue 26: 80 columns)
    assert "shared with generation(s) 1" in text and f"\n{sh['objects'][0]['oid'][:12]} " in text


# --- verify -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("damage", ["flipped", "missing"])
def test_verify_names_the_damaged_shared_object_and_every_generation_it_breaks(lora, deep, damage):
    repo, base, _ = lora
    _pack(repo, 3, base)
    fp = sorted(refs(Repository.open(repo).generation(3).manifest))[0]
    victim = repo / object_key(fp)
    if damage == "missing":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    args = ["verify", f"{repo}@2", "--json"] + (["--deep"] if deep else [])
    res = cli(*args)
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is False
    on_object = [p for p in doc["problems"] if p["member"] == object_key(fp)]
    assert on_object and "1, 2, 3" in on_object[0]["reason"]
    assert doc["shared_objects"] and {o["key"] for o in doc["shared_objects"]} == {object_key(fp)}
    assert all(o["generations"] == [1, 2, 3] for o in doc["shared_objects"])
    text = cli("verify", f"{repo}@2", *(["--deep"] if deep else []))
    assert text.exit_code == 1
    assert object_key(fp) in text.output and "generation(s) 1, 2, 3" in text.output


def test_verify_of_a_healthy_shared_generation_reports_no_shared_object_problem(lora):
    repo, _, _ = lora
    report = ca.verify(repo, "2")
    assert report.ok and report.to_json()["shared_objects"] == []


def test_a_generation_removed_at_the_source_during_its_export_is_could_not_not_damage(tmp_path, monkeypatch):
    """Fault guarded: a generation forgotten or pruned at the source (a Checkpointer's retention) while it
    was being exported made export exit 1 with "missing at the source", which reads as damage there; it
    is an export that could not be carried out (exit 2), and nothing is published at DEST."""
    from ckpt_archive.ops import export as export_mod

    repo, dest = tmp_path / "src", tmp_path / "dst"
    g = torch.Generator().manual_seed(5)
    ca.pack({"w": torch.randn(512, 1024, generator=g), "step": 1}, repo)
    ca.pack({"w": torch.randn(512, 1024, generator=g), "step": 2}, repo)
    real = export_mod.copy_file
    calls = []

    def copy_then_lose_the_source(src_store, dst_store, f, *args, **kw):
        if not calls:
            ca.forget(repo, 1)  # another process's retention, between two files of the export
        calls.append(f.key)
        return real(src_store, dst_store, f, *args, **kw)

    monkeypatch.setattr(export_mod, "copy_file", copy_then_lose_the_source)
    res = cli("export", f"{repo}@1", "--to", str(dest))
    assert res.exit_code == 2, res.output
    assert "removed at the source while it was being exported" in res.output
    assert not Repository.open(dest).usable()


def test_inspect_says_what_forgetting_a_generation_would_free_after_the_writer_is_gone(lora, tmp_path):
    """Fault guarded: once the generation that wrote a shared object is forgotten, nothing said which bytes
    the remaining generations hold alone ("new" stays what each wrote); only_here_bytes is what a forget
    frees, measured here by forgetting."""
    repo, base, _ = lora
    _pack(repo, 3, base)
    ca.forget(repo, 1)
    info = json.loads(cli("inspect", f"{repo}@2", "--json").stdout)["shared"]
    before = sum(p.stat().st_size for p in repo.rglob("*") if p.is_file())
    ca.forget(repo, 2)
    after = sum(p.stat().st_size for p in repo.rglob("*") if p.is_file())
    m2 = info  # measured against the bytes the forget freed (minus the small manifest, marker and claim)
    assert 0 <= (before - after) - m2["only_here_bytes"] < 64 << 10
