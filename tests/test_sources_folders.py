"""A ``.safetensors`` model file, a folder of per-rank ``.pt`` files, and any other folder: detection,
what each file becomes (torch / safetensors / raw / opaque), refusals, and restore."""
from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_archive
from ckpt_archive.errors import SourceError
from ckpt_archive.sources import read_source
from tests.helpers import assert_same


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(10, 4, generator=g), "fc.weight": torch.randn(3, 4, generator=g).half(),
            "fc.bias": torch.zeros(3, dtype=torch.bfloat16), "steps": torch.tensor([7], dtype=torch.int64)}


# --- one .safetensors file -------------------------------------------------------------------------------
def test_safetensors_file_restores_as_safetensors_with_its_metadata(tmp_path):
    src = tmp_path / "model.safetensors"
    save_file(_weights(), src, metadata={"format": "pt", "note": "run-a"})
    s = read_source(src)
    assert s.format == "safetensors-file" and s.layout == "file"
    assert s.files[0].kind == "safetensors" and s.files[0].metadata == {"format": "pt", "note": "run-a"}
    repo = tmp_path / "repo"
    res = ckpt_archive.pack(src, repo)
    assert res.manifest["source"]["files"][0]["metadata"] == {"format": "pt", "note": "run-a"}
    out = tmp_path / "restored.safetensors"
    ckpt_archive.restore(repo, output=out)
    # Not a byte comparison: safetensors serialises __metadata__ from a hash map, so two saves of the same
    # tensors and metadata may order the metadata keys differently. Tensors bit-equal + metadata equal.
    from safetensors import safe_open

    with safe_open(str(out), "pt") as fh:
        assert fh.metadata() == {"format": "pt", "note": "run-a"}
    back = load_file(out)
    for k, v in _weights().items():
        assert_same(v, back[k], k)


def test_a_safetensors_file_loads_in_the_order_load_file_gives(tmp_path):
    """Fault guarded: ``load`` of a packed .safetensors file gave its tensors sorted by name, where
    ``safetensors.torch.load_file`` gives them in the file's order (by dtype alignment, then name)."""
    src = tmp_path / "m.safetensors"
    save_file({"zeta": torch.ones(2), "alpha": torch.ones(3, dtype=torch.float16),
               "mid": torch.ones(1, dtype=torch.int64)}, src)
    ckpt_archive.pack(src, tmp_path / "r")
    assert list(ckpt_archive.load(tmp_path / "r")) == list(load_file(src))


def test_truncated_safetensors_file_is_refused_naming_it(tmp_path):
    src = tmp_path / "model.safetensors"
    save_file(_weights(), src)
    src.write_bytes(src.read_bytes()[:-20])
    with pytest.raises(SourceError, match="model.safetensors.*unreadable safetensors"):
        ckpt_archive.pack(src, tmp_path / "repo")


# --- per-rank files --------------------------------------------------------------------------------------
def _rank_state(rank: int) -> dict:
    return {"model": {"w": torch.full((4,), float(rank))}, "optimizer": {"state": {}, "param_groups": []},
            "global_step": 12, "epoch": 1, "rank": rank}


def test_per_rank_files_pack_as_one_resume_point_and_restore_loadable(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    for r in range(3):
        torch.save(_rank_state(r), d / f"rank_{r}.pt")
    (d / "meta.json").write_text(json.dumps({"world_size": 3}))
    s = read_source(d)
    assert s.format == "rank-files" and s.progress == {"step": 12, "epoch": 1}
    assert s.info["ranks"] == {"0": "rank_0.pt", "1": "rank_1.pt", "2": "rank_2.pt"} and s.info["world_size"] == 3
    repo = tmp_path / "repo"
    ckpt_archive.pack(d, repo)
    out = tmp_path / "out"
    ckpt_archive.restore(repo, output=out)
    assert (out / "meta.json").read_bytes() == (d / "meta.json").read_bytes()
    for r in range(3):
        assert_same(_rank_state(r), torch.load(out / f"rank_{r}.pt", weights_only=True))


def test_a_missing_rank_file_is_refused_naming_the_rank(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    for r in (0, 2):
        torch.save(_rank_state(r), d / f"rank{r}-of-4-optimizer.pt")
    with pytest.raises(SourceError, match=r"rank\(s\) 1, 3 are missing.*2 of 4"):
        read_source(d)


def test_ranks_disagreeing_on_the_step_are_warned(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    torch.save(_rank_state(0), d / "rank0.pt")
    torch.save({**_rank_state(1), "global_step": 13}, d / "rank1.pt")
    s = read_source(d)
    assert "step" not in s.progress
    assert any("disagree on step" in w and "[12, 13]" in w for w in s.warnings)


def test_sharded_model_numbering_is_not_mistaken_for_ranks(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    for i in (1, 2):
        torch.save({"w": torch.ones(2)}, d / f"pytorch_model-0000{i}-of-00002.bin")
    assert read_source(d).format == "folder"


# --- any folder -----------------------------------------------------------------------------------------
def test_generic_folder_gives_each_file_its_kind_and_restores_it(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    torch.save({"w": torch.arange(4.0)}, d / "weights.pt")
    save_file(_weights(), d / "sub" / "ema.safetensors", metadata={"k": "v"})
    (d / "notes.md").write_text("step 4 of run A\n", encoding="utf-8")
    (d / "blob.dat").write_bytes(bytes(range(256)))
    (d / "plain.pkl").write_bytes(pickle.dumps({"a": 1}))  # a plain pickle, not torch.save: never loaded
    (d / ".hidden.json").write_text("{}")
    with zipfile.ZipFile(d / "logs.zip", "w") as zf:
        zf.writestr("log.txt", "hello")
    (d / "cut.zip").write_bytes((d / "logs.zip").read_bytes()[:30])  # a damaged zip that is no checkpoint
    s = read_source(d)
    assert s.format == "folder"
    kinds = {f.relpath: f.kind for f in s.files}
    assert kinds == {".hidden.json": "raw", "blob.dat": "opaque", "cut.zip": "opaque", "logs.zip": "opaque",
                     "notes.md": "raw",
                     "plain.pkl": "opaque", "sub/ema.safetensors": "safetensors", "weights.pt": "torch"}
    assert any(w.startswith("plain.pkl: kept opaque") for w in s.warnings)
    repo = tmp_path / "repo"
    ckpt_archive.pack(d, repo)
    assert ckpt_archive.verify(repo, options=ckpt_archive.VerifyOptions(deep=True)).ok
    out = tmp_path / "out"
    ckpt_archive.restore(repo, output=out)
    for rel in (".hidden.json", "blob.dat", "cut.zip", "logs.zip", "notes.md", "plain.pkl"):
        assert (out / rel).read_bytes() == (d / rel).read_bytes(), rel
    assert_same({"w": torch.arange(4.0)}, torch.load(out / "weights.pt", weights_only=True))
    back = load_file(out / "sub" / "ema.safetensors")
    assert all(torch.equal(v, back[k]) for k, v in _weights().items())


def test_empty_folder_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="empty folder"):
        read_source(tmp_path / "empty")


def test_empty_or_truncated_torch_file_in_a_folder_is_refused_naming_it(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "optimizer.pt").write_bytes(b"")
    with pytest.raises(SourceError, match=r"optimizer\.pt.*empty"):
        read_source(d)
    torch.save({"w": torch.ones(1000)}, d / "optimizer.pt")
    data = (d / "optimizer.pt").read_bytes()
    (d / "optimizer.pt").write_bytes(data[: len(data) - 300])
    with pytest.raises(SourceError, match=r"optimizer\.pt.*truncated"):
        read_source(d)


def test_numpy_in_a_folder_file_is_kept_opaque_unless_allowed(tmp_path):
    import numpy as np

    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({"seen": np.int64(5)}, d / "extra.pt")
    s = read_source(d)
    assert s.files[0].kind == "opaque"
    assert "--allow-numpy" in s.warnings[0] and s.warnings[0].startswith("extra.pt")
    s = read_source(d, allow_numpy=True)
    assert s.files[0].kind == "torch" and type(s.state["extra.pt"]["seen"]) is np.int64


def test_symlinked_file_is_archived_as_its_content_with_a_note(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (tmp_path / "real.json").write_text('{"a": 1}')
    (d / "link.json").symlink_to(tmp_path / "real.json")
    (d / "x.txt").write_text("x")
    s = read_source(d)
    assert {f.relpath: f.kind for f in s.files} == {"link.json": "raw", "x.txt": "raw"}
    assert any("link.json: symlink archived as the file it points to" in w for w in s.warnings)


def test_forced_format_that_does_not_fit_is_named(tmp_path):
    p = tmp_path / "w.pt"
    torch.save({"w": torch.ones(1)}, p)
    with pytest.raises(SourceError):
        read_source(p, fmt="dcp")
    with pytest.raises(SourceError, match="not a Lightning checkpoint"):
        read_source(p, fmt="lightning")
    assert read_source(p).format == "torch-file"
    assert Path(read_source(p).files[0].path) == p


def test_a_reader_module_that_is_missing_fails_the_import_instead_of_silently_dropping_its_format():
    # a packaging error (a reader module left out of the wheel) once made its format vanish from
    # detection without a word; now importing ckpt_archive.sources fails and names the module
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'ckpt_archive.sources.lightning':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import ckpt_archive.sources\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "ckpt_archive.sources.lightning" in proc.stderr


def test_source_modules_import_each_other_in_one_direction():
    # sources/__init__ <-> torchfile and dcp <-> folders once imported each other
    import ast

    pkg = Path(__file__).resolve().parents[1] / "ckpt_archive" / "sources"
    graph = {}
    for p in pkg.glob("*.py"):
        name = p.stem
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name.rsplit(".", 1)[-1] for a in node.names if a.name.startswith("ckpt_archive.sources."))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckpt_archive.sources"):
                deps.add(node.module.rsplit(".", 1)[-1] if node.module != "ckpt_archive.sources" else "__init__")
                if node.module == "ckpt_archive.sources":
                    deps.update(a.name for a in node.names)
        graph[name] = deps - {name}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and d in graph and reaches(d, b, seen + (d,))) for d in graph.get(a, ()))

    cycles = sorted(m for m in graph if reaches(m, m))
    assert cycles == []


def test_a_checkpoint_named_file_that_cannot_be_parsed_rode_along_opaque_without_a_word(tmp_path):
    """A folder's random.pt (random bytes) was kept opaque silently: the user thought it was a checkpoint."""
    import os

    import torch

    from ckpt_archive.sources import read_source

    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"model": {"w": torch.ones(2)}}, folder / "model.pt")
    (folder / "random.pt").write_bytes(os.urandom(4096))
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(512))
    src = read_source(folder)
    kinds = {f.relpath: f.kind for f in src.files}
    assert kinds["random.pt"] == "opaque" and kinds["image.png"] == "opaque"
    notes = [w for w in src.warnings if w.startswith("random.pt")]
    assert len(notes) == 1 and "kept opaque" in notes[0] and "never loaded" in notes[0]
    assert not any(w.startswith("image.png") for w in src.warnings)  # nothing was expected of it


def test_restored_files_keep_their_permission_bits_never_wider_than_the_umask(tmp_path):
    """Fault guarded: every restored file came back 0644 whatever it was: a 0600 file (HF writes weights
    and tokens 0600) was widened to world-readable, a 0755 script lost its execute bit. Modes are now
    recorded at pack and applied less the umask, so a hostile manifest cannot make a file wider or setuid."""
    import os
    import stat

    from hostile_archive import edit_manifest

    src = tmp_path / "run"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "model.pt")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "notes.txt").write_text("x")
    modes = {"model.pt": 0o600, "run.sh": 0o755, "notes.txt": 0o640}
    for name, mode in modes.items():
        os.chmod(src / name, mode)
    ckpt_archive.pack(src, tmp_path / "r")
    ckpt_archive.restore(tmp_path / "r", "latest", tmp_path / "out")
    assert {n: stat.S_IMODE((tmp_path / "out" / n).stat().st_mode) for n in modes} == modes
    one = tmp_path / "one.pt"
    torch.save({"w": torch.ones(2)}, one)
    os.chmod(one, 0o600)
    ckpt_archive.pack(one, tmp_path / "r1")
    ckpt_archive.restore(tmp_path / "r1", "latest", tmp_path / "one_back.pt")
    assert stat.S_IMODE((tmp_path / "one_back.pt").stat().st_mode) == 0o600
    # a manifest asking for 0777 gets at most what the umask allows
    def widen(m):
        for f in m["source"]["files"]:
            f["mode"] = 0o777
    edit_manifest(tmp_path / "r", widen)
    old = os.umask(0o027)
    try:
        ckpt_archive.restore(tmp_path / "r", "latest", tmp_path / "out2",
                             options=ckpt_archive.RestoreOptions(unverified=True))
    finally:
        os.umask(old)
    assert {stat.S_IMODE((tmp_path / "out2" / n).stat().st_mode) for n in modes} == {0o750}


def test_a_checkpoint_under_a_folder_name_that_is_not_utf8_packs_and_restores(tmp_path):
    """Fault guarded (final break test): a sound .pt or .safetensors file inside a folder named in Latin-1
    was refused ("torch.load failed: 'utf-8' codec can't encode character"): torch and safetensors take
    paths as UTF-8 text, so such a file is now opened and named through /proc/self/fd."""
    import os

    import numpy as np
    import safetensors.numpy

    folder = tmp_path / os.fsdecode(b"d\xe9")
    folder.mkdir()
    with open(folder / "p.pt", "wb") as fh:
        torch.save({"w": torch.ones(2), "step": 3}, fh)
    (folder / "m.safetensors").write_bytes(safetensors.numpy.save({"x": np.ones(3, dtype=np.float32)}))
    ckpt_archive.pack(folder, tmp_path / "r")
    ckpt_archive.pack(folder / "p.pt", tmp_path / "r2")
    ckpt_archive.restore(tmp_path / "r", "latest", tmp_path / "out")
    for name in ("p.pt", "m.safetensors"):
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes()
    assert ckpt_archive.load(tmp_path / "r2")["step"] == 3
