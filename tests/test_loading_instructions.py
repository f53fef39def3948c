"""Loading instructions that load (issue 26): the snippet a manifest carries, and the one `restore` prints, are
generated from what the restored file needs, and each is run here for every kind of state the suite packs.

The fault: a state holding `np.random.get_state()` (docs/checkpointer.md's own example) restored to a .pt whose
instructions said "loads with torch.load(path, weights_only=True)"; that load raises UnpicklingError.
"""
from __future__ import annotations

import argparse
import collections
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from tests.fixture_state import fixture_state
from tests.helpers import assert_same


def _checkpointer_doc_state():
    """docs/checkpointer.md's save: model, optimizer, scheduler, scaler, every RNG stream, data cursor."""
    torch.manual_seed(0)
    np.random.seed(3)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                       "_growth_tracker": 0},
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "data": {"cursor": 7}}


#: name -> (state, does the whole restored .pt need more than weights_only's defaults?)
STATES = {
    "tensors-only": (lambda: {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4}, False),
    "checkpointer-doc-numpy-rng": (_checkpointer_doc_state, True),
    "numpy-pcg64-dict": (lambda: {"rng": np.random.default_rng(5).bit_generator.state, "w": torch.ones(2)}, False),
    "numpy-scalars-and-arrays": (lambda: {"metric": np.float64(0.5), "flag": np.bool_(True),
                                          "ids": np.arange(4, dtype=np.int16), "w": torch.ones(2)}, True),
    "frozen-fixture-state": (fixture_state, True),
    "argparse-namespace": (lambda: {"args": argparse.Namespace(lr=0.1, name="run"), "w": torch.ones(2)}, True),
    "parameters": (lambda: {"p": torch.nn.Parameter(torch.ones(3)), "step": 1}, False),
    "containers-and-torch-values": (lambda: {"od": collections.OrderedDict(a=1), "t": (1, 2.5, None),
                                             "big": 2 ** 70, "nan": float("nan"), "size": torch.Size([2, 3]),
                                             "dtype": torch.bfloat16, "w": torch.zeros(2, dtype=torch.int8)}, False),
    "empty-bytes": (lambda: {"blob": b"", "w": torch.ones(1)}, True),
}


def _run(snippet: str, repo, restored) -> dict:
    """Run a generated snippet as written, with REPO and ckpt.pt naming this test's repository and file."""
    code = snippet.replace("'REPO'", repr(str(repo))).replace("'ckpt.pt'", repr(str(restored)))
    namespace: dict = {}
    exec(compile(code, "<loading instructions>", "exec"), namespace)  # noqa: S102 - the snippet under test
    return namespace


@pytest.mark.parametrize("name", sorted(STATES))
def test_the_manifests_snippet_and_restores_snippet_load_the_restored_file(tmp_path, name):
    make, needs_more = STATES[name]
    state = make()
    repo = tmp_path / "repo"
    allow = ["argparse.Namespace"] if name == "argparse-namespace" else []
    res = ca.pack(state, repo, options=ca.PackOptions(allow=tuple(allow)))
    instr = res.manifest["instructions"]
    out = tmp_path / "ckpt.pt"
    restored = ca.restore(repo, output=out)

    ns = _run(instr["snippet"], repo, out)                    # the manifest's promise, run as written
    assert_same(state, ns["state"])
    loading = restored.extra["loading"]                       # what restore printed, from the file itself
    ns = {}
    exec(compile(loading["snippet"], "<restore's snippet>", "exec"), ns)  # noqa: S102
    assert_same(state, ns["state"])

    plain = "loads with torch.load(path, weights_only=True)"
    if needs_more:
        assert loading["allow"] and plain not in instr["text"] and "refuses it unless" in instr["text"]
        with pytest.raises(Exception, match="(?i)weights.only|unpickl|global"):
            torch.load(out, weights_only=True)                # the allowlist in the snippet is needed...
        for part in instr.get("plain_parts") or []:           # ...and the parts it offers need none
            one = tmp_path / f"{part}.pt"
            ca.restore(repo, output=one, options=ca.RestoreOptions(only=part))
            assert_same(state[part], torch.load(one, weights_only=True))
    else:
        assert loading["allow"] == [] and plain in instr["text"]
        assert_same(state, torch.load(out, weights_only=True))


def test_a_torch_save_file_with_numpy_restores_byte_exact_and_its_snippet_loads_it(tmp_path):
    state = _checkpointer_doc_state()
    src = tmp_path / "src.pt"
    torch.save(state, src)
    repo = tmp_path / "repo"
    res = ca.pack(src, repo, options=ca.PackOptions(allow_numpy=True))
    out = tmp_path / "ckpt.pt"
    restored = ca.restore(repo, output=out)
    assert out.read_bytes() == src.read_bytes()
    assert_same(state, _run(res.manifest["instructions"]["snippet"], repo, out)["state"])
    ns: dict = {}
    exec(compile(restored.extra["loading"]["snippet"], "<restore's snippet>", "exec"), ns)  # noqa: S102
    assert_same(state, ns["state"])


def test_a_safetensors_source_gets_safetensors_instructions_that_load_it(tmp_path):
    from safetensors.torch import save_file

    tensors = {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16)}
    src = tmp_path / "model.safetensors"
    save_file(tensors, str(src))
    repo = tmp_path / "repo"
    res = ca.pack(src, repo)
    out = tmp_path / "model.safetensors.out"
    restored = ca.restore(repo, output=out)
    assert restored.extra["loading"]["format"] == "safetensors"
    code = res.manifest["instructions"]["snippet"].replace("'REPO'", repr(str(repo))) \
        .replace("'model.safetensors'", repr(str(out)))
    ns: dict = {}
    exec(compile(code, "<snippet>", "exec"), ns)  # noqa: S102
    assert_same(tensors, ns["state"])


def test_a_folder_sources_snippet_loads_its_files(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "model.pt")
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    repo = tmp_path / "repo"
    res = ca.pack(folder, repo)
    ns = _run(res.manifest["instructions"]["snippet"], repo, tmp_path / "unused.pt")
    assert_same({"w": torch.ones(2)}, ns["files"]["model.pt"])


def test_the_snippet_runs_in_a_fresh_interpreter_without_ckpt_archive_state(tmp_path):
    """The restored file's snippet is plain torch + NumPy: it runs in a new process as printed."""
    state = _checkpointer_doc_state()
    repo = tmp_path / "repo"
    ca.pack(state, repo)
    out = tmp_path / "ckpt.pt"
    snippet = ca.restore(repo, output=out).extra["loading"]["snippet"]
    assert "ckpt_archive" not in snippet
    code = snippet + "print(sorted(state), state['rng']['numpy'][0])\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "MT19937" in proc.stdout


def test_restore_cli_prints_the_snippet_the_file_needs_and_plain_load_for_a_part(tmp_path):
    repo = tmp_path / "repo"
    ca.pack(_checkpointer_doc_state(), repo)
    res = CliRunner().invoke(app, ["restore", str(repo), "-o", str(tmp_path / "a.pt")])
    assert res.exit_code == 0, res.output
    assert "torch.serialization.safe_globals(allowed)" in res.stdout and "numpy.ndarray" in res.stdout
    assert "--only model" in res.stdout                       # a part that needs no allowlist is offered
    res = CliRunner().invoke(app, ["restore", str(repo), "-o", str(tmp_path / "m.pt"), "--only", "model"])
    assert res.exit_code == 0, res.output
    assert "loads with torch.load(path, weights_only=True)" in res.stdout and "safe_globals" not in res.stdout


def test_inspect_prints_the_snippet_its_text_refers_to_and_it_runs_as_printed(tmp_path, monkeypatch):
    """[issue 26] `inspect` said "(the snippet does it with torch.serialization.safe_globals)" but printed no
    snippet; the one it prints names this repository and the generation inspected, and runs as printed."""
    repo = tmp_path / "repo"
    first = _checkpointer_doc_state()
    ca.pack(first, repo)
    ca.pack({**_checkpointer_doc_state(), "data": {"cursor": 99}}, repo)        # a newer generation 2
    res = CliRunner().invoke(app, ["inspect", f"{repo}@1"])
    assert res.exit_code == 0, res.output
    printed = res.stdout.split("loading instructions:\n", 1)[1].split("LR policy", 1)[0]
    code = "\n".join(line[2:] for line in printed.splitlines() if line.startswith("  "))
    assert "safe_globals(allowed)" in code and repr(str(repo)) in code and "generation=1" in code, printed
    monkeypatch.chdir(tmp_path)                  # `ckpt-archive restore REPO@1 --output ckpt.pt`, as it says
    assert CliRunner().invoke(app, ["restore", f"{repo}@1", "--output", "ckpt.pt"]).exit_code == 0
    namespace: dict = {}
    exec(compile(code, "<inspect's snippet>", "exec"), namespace)  # noqa: S102 - the snippet under test
    assert namespace["state"]["data"] == {"cursor": 7}              # generation 1's file, loaded
    assert ca.load(repo, generation=1)["data"] == {"cursor": 7}


class SnippetConfig:  # a user's plain-data class, admitted at pack with --allow
    def __init__(self, lr):
        self.lr = lr


def test_the_snippet_older_archives_stored_still_loads(tmp_path):
    """Archives written before the options objects carry `ckpt_archive.load('REPO', generation='latest',
    allow=[...])` in their loading instructions (ops/meta.py wrote that form until commit 4757154). The fault: a
    person restoring such an archive on a new machine ran its own instructions and got "load() got an unexpected
    keyword argument 'allow'". That form still loads, with a DeprecationWarning naming today's form; any other
    loose keyword is still refused, and the message names the LoadOptions field it belongs to."""
    name = f"{SnippetConfig.__module__}.SnippetConfig"
    repo = tmp_path / "r"
    ca.pack({"cfg": SnippetConfig(0.25), "w": torch.ones(2)}, repo, options=ca.PackOptions(allow=(name,)))
    old_snippet = ("import ckpt_archive\n"
                   f"state = ckpt_archive.load('REPO', generation='latest', allow={[name]!r})"
                   "  # the exact state; nothing unpickled\n")
    with pytest.warns(DeprecationWarning, match=r"options=ckpt_archive.LoadOptions\(allow="):
        state = _run(old_snippet, repo, tmp_path / "unused.pt")["state"]
    assert type(state["cfg"]) is SnippetConfig and state["cfg"].lr == 0.25 and state["w"].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match=r"pass options=LoadOptions\(only=\.\.\.\)"):
        ca.load(repo, only="w")
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        ca.load(repo, colour="red")
    with pytest.raises(TypeError, match="beside options"):
        ca.load(repo, options=ca.LoadOptions(), allow=[name])
