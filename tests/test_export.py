"""Export to another destination, proven recoverable there (issue 4).

Destinations: moto's S3 server on 127.0.0.1 (tests/s3server.py; real HTTP, multipart, conditional
writes) and a local folder. The kill tests run the real CLI in a subprocess and SIGKILL it at a fault
point, then resume; everything else runs the CLI in-process (Typer's runner) for speed.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from ckpt_archive.errors import NoUsableGeneration
from ckpt_archive.ops.export import ExportOptions, export
from ckpt_archive.repo.repository import Repository
from s3server import s3_env, s3_server, s3_url  # noqa: F401  (pytest fixtures)

MEMBERS = ["tensors-00000.safetensors.ckz", "tree.json.ckz", "data-ids.json.ckz"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(96, 80, generator=g), "b": torch.randn(80, generator=g).to(torch.bfloat16),
                  "emb": torch.randint(0, 1000, (50, 7), generator=g)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(96, 80, generator=g), "step": torch.tensor(12.0)}},
                      "param_groups": [{"lr": 3e-4, "params": [0]}]},
        "step": 100 + seed, "rng": (3, (1, 2, 3), None),
    }


@pytest.fixture
def source(tmp_path):
    """A local repository with two usable generations of three members each (several chunks each)."""
    repo = tmp_path / "src"
    states = {}
    for seed in (1, 2):
        st = _state(seed)
        r = ca.pack(st, repo, ca.PackOptions(chunk_bytes=8192),
                    ca.Annotations(progress={"step": st["step"], "epoch": seed}, data_ids=list(range(40 * seed))))
        states[r.generation] = st
    return repo, states


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result


def run_cli_subprocess(*args: str, inject: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("CKPT_ARCHIVE_INJECT", None)
    if inject:
        env["CKPT_ARCHIVE_INJECT"] = inject
    return subprocess.run([sys.executable, "-m", "ckpt_archive", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def _split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix


def _keys(s3_server, url: str) -> list[str]:
    bucket, prefix = _split(url)
    out = s3_server.client().list_objects_v2(Bucket=bucket)  # (no Prefix: see s3server.py)
    return sorted(o["Key"][len(prefix) + 1:] for o in out.get("Contents", []) if o["Key"].startswith(prefix + "/"))


def _assert_bit_equal(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_bit_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bit_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


# --- a full export ---------------------------------------------------------------------------------
def test_export_to_s3_is_usable_there_and_restores_bit_equal(source, s3_server, s3_url, tmp_path, monkeypatch):
    repo, states = source
    report = tmp_path / "proof.md"
    res = cli("export", str(repo), "--to", s3_url, "--report", str(report))
    assert res.exit_code == 0, res.output
    dst = Repository.open(s3_url)
    gens = dst.generations()
    assert [(g.number, g.status) for g in gens] == [(2, "usable")]
    assert gens[0].marker["location"] == s3_url
    assert gens[0].marker["trial_reload"]["where"] == s3_url
    assert gens[0].marker["exported_from"]["location"] == str(repo)
    # the writer lock's released top ticket stays in the bucket (store/lease_lock.py: numbers only grow)
    assert _keys(s3_server, s3_url) == sorted(
        [f"generations/00000002/{m}" for m in ["CLAIM", "USABLE.json", "manifest.json", *MEMBERS]]
        + ["locks/000000000001.json", "repository.json"])
    text = report.read_text()
    # the proof's own restore command, run as printed, on a "new machine" (a fresh folder) whose environment
    # does not name the endpoint: the proof must carry it (it came from AWS_ENDPOINT_URL here)
    (line,) = [ln for ln in text.splitlines() if "ckpt-archive restore " in ln]
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words[:words.index("ckpt-archive")])
    assert env["AWS_ENDPOINT_URL"] == s3_server.endpoint and env["AWS_REGION"] == "us-east-1"
    args = words[words.index("ckpt-archive") + 1:]
    fresh = tmp_path / "new-machine"
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    res = cli(*args)
    assert res.exit_code == 0, res.output
    _assert_bit_equal(states[2], torch.load(fresh / "checkpoint.pt", weights_only=True))
    _assert_bit_equal(states[2], ca.load(s3_url))
    manifest = gens[0].manifest
    for rec in manifest["members"]:  # the proof lists each object's sha256 as read at the destination
        local = repo / "generations" / "00000002" / rec["stored_path"]
        assert rec["stored_path"] in text and __import__("hashlib").sha256(local.read_bytes()).hexdigest() in text
    assert f"ckpt-archive restore {s3_url}@2 --output checkpoint.pt" in text
    assert "trial reload from destination" in text and "FAILED" not in text
    assert "step" in text and "| 2 | 102 |" in text


def test_export_json_proof_lists_objects_checks_and_restore_command(source, s3_server, s3_url, tmp_path):
    repo, _ = source
    res = cli("export", f"{repo}@1", "--to", s3_url, "--json", "--report", str(tmp_path / "proof.json"))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc == json.loads((tmp_path / "proof.json").read_text())
    assert doc["ok"] is True and doc["destination"] == s3_url
    (g,) = doc["generations"]
    assert g["generation"] == 1 and g["step"] == 101 and g["status"] == "exported"
    copied = {o["key"].rsplit("/", 1)[1]: o for o in g["objects"]}
    assert set(MEMBERS) <= set(copied) and all(copied[m]["action"] == "copied" for m in MEMBERS)
    assert all(len(copied[m]["sha256"]) == 64 for m in MEMBERS)
    names = [c["check"] for c in g["checks"]]
    assert sum(n.startswith("size and sha256 re-read from destination") for n in names) == len(MEMBERS)
    assert any(n.startswith("trial reload from destination") for n in names)
    assert all(c["result"] == "ok" for c in g["checks"])
    assert doc["restore_command"] == (f"AWS_ENDPOINT_URL={s3_server.endpoint} AWS_REGION=us-east-1 "
                                      f"ckpt-archive restore {s3_url}@1 --output checkpoint.pt")
    assert doc["endpoint_url"] == s3_server.endpoint and doc["region"] == "us-east-1"
    assert g["fingerprints"]["manifest_sha256"] == g["marker"]["manifest_sha256"]
    assert g["trial_reload"]["where"] == s3_url and g["trial_reload"]["result"] == "ok"
    assert doc["install_commands"][-1] == 'python -m pip install -c constraints.txt -e ".[s3]"'


def test_export_all_usable_then_rerun_copies_nothing(source, s3_url):
    repo, _ = source
    first = export(repo, s3_url, ExportOptions(generations="all"))
    assert [g.generation for g in first.generations] == [1, 2] and first.bytes_copied > 0
    again = export(repo, s3_url, ExportOptions(generations="all"))
    assert [g.status for g in again.generations] == ["already-usable", "already-usable"]
    assert again.bytes_copied == 0
    assert [g.number for g in Repository.open(s3_url).usable()] == [1, 2]


def test_latest_n_selects_the_newest_usable(source, tmp_path):
    repo, _ = source
    res = cli("export", str(repo), "--latest", "1", "--to", str(tmp_path / "dst"), "--json")
    assert res.exit_code == 0, res.output
    assert [g["generation"] for g in json.loads(res.stdout)["generations"]] == [2]


def test_export_to_a_local_path_restores_bit_equal(source, tmp_path):
    repo, states = source
    dest = tmp_path / "usb" / "archive"
    res = cli("export", str(repo), "--all-usable", "--to", str(dest))
    assert res.exit_code == 0, res.output
    dst = Repository.open(dest)
    assert [(g.number, g.status, g.marker["location"]) for g in dst.generations()] == \
        [(1, "usable", str(dest)), (2, "usable", str(dest))]
    _assert_bit_equal(states[1], ca.load(dest, 1))
    assert not list(dest.rglob("*.tmp-*"))


def test_export_from_an_s3_repository_to_a_local_path(source, s3_url, tmp_path):
    """The way back: a new machine pulls the archive down and proves it usable on its own disk."""
    repo, states = source
    export(repo, s3_url, ExportOptions(generations="all"))
    back = tmp_path / "pulled"
    res = cli("export", s3_url, "--latest", "2", "--to", str(back), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["source"] == s3_url and [g["status"] for g in doc["generations"]] == ["exported", "exported"]
    dst = Repository.open(back)
    assert [(g.number, g.status) for g in dst.generations()] == [(1, "usable"), (2, "usable")]
    assert dst.generation(2).marker["exported_from"]["location"] == s3_url
    _assert_bit_equal(states[2], ca.load(back))


# --- interrupted and resumed ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "local"])
@pytest.mark.parametrize("inject", ["export-member-write=kill@2", "export-after-member=kill@2",
                                    "export-after-trial-reload=kill"])
def test_killed_export_resumes_without_duplicate_or_missing_member(source, kind, inject, request, tmp_path):
    repo, states = source
    dest = request.getfixturevalue("s3_url") if kind == "s3" else str(tmp_path / "dst")
    killed = run_cli_subprocess("export", f"{repo}@2", "--to", dest, inject=inject)
    assert killed.returncode == -9, killed.stderr
    dst = Repository.open(dest)
    (g,) = dst.generations()
    assert g.status == "partial" and g.marker is None          # no marker until the very end
    assert not dst.store.exists("generations/00000002/USABLE.json")
    with pytest.raises(NoUsableGeneration):
        ca.load(dest)

    resumed = cli("export", f"{repo}@2", "--to", dest, "--json")
    assert resumed.exit_code == 0, resumed.output
    (eg,) = json.loads(resumed.stdout)["generations"]
    assert eg["status"] == "resumed"
    actions = {o["key"].split("/", 2)[2]: o["action"] for o in eg["objects"]}  # path inside the generation
    assert actions["manifest.json"] == "present"
    assert any(actions[m] == "present" for m in MEMBERS)       # what survived the kill is kept
    assert eg["bytes_copied"] < sum(o["bytes"] for o in eg["objects"] if o["key"].endswith(".ckz"))
    names = sorted(dst.store.listdir("generations/00000002"))
    assert names == sorted(["CLAIM", "USABLE.json", "manifest.json", *MEMBERS])  # nothing missing, nothing extra
    assert dst.generation(2).status == "usable"
    _assert_bit_equal(states[2], ca.load(dest))


def test_dest_holding_another_archive_at_that_number_is_refused(source, s3_url, tmp_path):
    repo, _ = source
    assert cli("export", f"{repo}@1", "--to", s3_url).exit_code == 0
    other = tmp_path / "other"
    ca.pack(_state(9), other)                                    # a different archive, also generation 1
    before = Repository.open(s3_url).generation(1)
    res = cli("export", str(other), "--to", s3_url)
    assert res.exit_code == 2, res.output
    assert "generation 1 there holds another archive" in res.output and "nothing was changed" in res.output
    after = Repository.open(s3_url).generation(1)
    assert after.status == "usable" and after.manifest_sha256 == before.manifest_sha256


def test_corrupt_source_member_is_not_exported(source, s3_url):
    repo, _ = source
    victim = repo / "generations" / "00000002" / "tree.json.ckz"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    res = cli("export", str(repo), "--to", s3_url)
    assert res.exit_code == 1, res.output
    assert "tree.json" in res.output
    assert not Repository.open(s3_url).store.exists("generations/00000002/USABLE.json")


# --- damage at the destination after export -----------------------------------------------------------
def test_object_corrupted_at_destination_after_export_fails_verify_naming_it(source, s3_server, s3_url):
    repo, _ = source
    assert cli("export", str(repo), "--to", s3_url).exit_code == 0
    bucket, prefix = _split(s3_url)
    client = s3_server.client()
    key = f"{prefix}/generations/00000002/tensors-00000.safetensors.ckz"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 3] ^= 0x40
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    res = cli("verify", f"{s3_url}@2", "--json")
    assert res.exit_code == 1, res.output
    assert "tensors-00000.safetensors" in res.stdout
    report = ca.verify(s3_url, 2)
    assert not report.ok and report.problems[0].member == "tensors-00000.safetensors"


def test_object_missing_at_destination_fails_verify_and_restore_naming_it(source, s3_server, s3_url, tmp_path):
    repo, _ = source
    assert cli("export", str(repo), "--to", s3_url).exit_code == 0
    bucket, prefix = _split(s3_url)
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/generations/00000002/tensors-00000.safetensors.ckz")
    res = cli("verify", f"{s3_url}@2")
    assert res.exit_code == 1, res.output
    assert "tensors-00000.safetensors" in res.output and "missing" in res.output
    res = cli("restore", f"{s3_url}@2", "--output", str(tmp_path / "x.pt"))
    assert res.exit_code == 1, res.output
    assert not (tmp_path / "x.pt").exists()


def test_rerun_over_a_damaged_usable_copy_fails_naming_the_member(source, s3_server, s3_url):
    """A re-run must not call a damaged usable copy fine: sizes are re-checked."""
    repo, _ = source
    export(repo, s3_url)
    bucket, prefix = _split(s3_url)
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/generations/00000002/tree.json.ckz", Body=b"x")
    res = cli("export", str(repo), "--to", s3_url)
    assert res.exit_code == 1, res.output
    assert "tree.json" in res.output


# --- credentials -----------------------------------------------------------------------------------------
def test_wrong_credentials_exit_2_clear_message_nothing_marked_usable(source, s3_server, s3_url, monkeypatch):
    repo, _ = source
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with s3_server.enforce_auth():
        res = cli("export", str(repo), "--to", s3_url, "--json")
        human = cli("export", str(repo), "--to", s3_url)         # without --json: one line on stderr
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.stderr == ""                                      # --json: the error is the JSON object
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["error"] == "StoreError" and doc["exit_code"] == 2
    assert doc["where"] == s3_url and doc["reason"].startswith("access denied (") and "AWS_ACCESS_KEY_ID" in doc["hint"]
    assert human.exit_code == 2
    assert f"{s3_url}: access denied (" in human.stderr and "AWS_ACCESS_KEY_ID" in human.stderr
    (line,) = [ln for ln in human.stderr.splitlines() if ln.startswith("error:")]
    assert "access denied" in line
    assert not any(k.endswith("USABLE.json") for k in _keys(s3_server, s3_url))


def test_server_side_encryption_option_reaches_every_object(source, s3_server, s3_url):
    repo, _ = source
    res = cli("export", str(repo), "--to", s3_url, "--sse", "AES256")
    assert res.exit_code == 0, res.output
    bucket, prefix = _split(s3_url)
    client = s3_server.client()
    for key in _keys(s3_server, s3_url):
        if key.startswith("generations/"):
            head = client.head_object(Bucket=bucket, Key=f"{prefix}/{key}")
            assert head.get("ServerSideEncryption") == "AES256", key


def test_endpoint_url_option_beats_a_wrong_environment(source, s3_server, s3_url, monkeypatch):
    repo, _ = source
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    res = cli("export", str(repo), "--to", s3_url, "--endpoint-url", s3_server.endpoint, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["restore_command"].startswith(f"AWS_ENDPOINT_URL={s3_server.endpoint} AWS_REGION=us-east-1 "
                                             f"ckpt-archive restore")


# --- the other commands on an s3 repository -------------------------------------------------------------------
def test_list_inspect_verify_restore_work_on_an_s3_repository(source, s3_url, tmp_path):
    repo, states = source
    export(repo, s3_url, ExportOptions(generations="all"))
    res = cli("list", s3_url, "--json")
    assert res.exit_code == 0, res.output
    assert "102" in res.stdout
    res = cli("inspect", f"{s3_url}@1", "--json")
    assert res.exit_code == 0, res.output
    assert "101" in res.stdout
    res = cli("verify", f"{s3_url}@latest", "--deep")
    assert res.exit_code == 0, res.output
    out = tmp_path / "x.pt"
    res = cli("restore", f"{s3_url}@1", "--output", str(out))
    assert res.exit_code == 0, res.output
    _assert_bit_equal(states[1], torch.load(out, weights_only=True))


# --- copies made by other tools, and the end-of-rental script ------------------------------------------------
def test_generation_copied_by_another_tool_is_copied_until_verify_deep_there(source, s3_server, s3_url):
    """Any tool may copy a generation (aws s3 sync); it is listed `copied` until proven at its new place."""
    repo, states = source
    bucket, prefix = _split(s3_url)
    client = s3_server.client()
    for path in sorted(p for p in repo.rglob("*") if p.is_file() and not p.name.startswith(".")):
        rel = path.relative_to(repo).as_posix()
        client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=path.read_bytes())
    dst = Repository.open(s3_url)
    assert [g.status for g in dst.generations()] == ["copied", "copied"]
    res = cli("verify", f"{s3_url}@2", "--deep")
    assert res.exit_code == 0, res.output
    assert [g.status for g in Repository.open(s3_url).generations()] == ["copied", "usable"]
    # export recognises the copied generation 1 as the same archive: nothing to copy, proven and marked here
    result = export(repo, s3_url, ExportOptions(generations="all"))
    assert [g.status for g in result.generations] == ["resumed", "already-usable"]
    assert result.bytes_copied == 0
    assert [g.status for g in Repository.open(s3_url).generations()] == ["usable", "usable"]
    _assert_bit_equal(states[1], ca.load(s3_url, 1))


SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "end-of-rental.sh")


def _rental_output(tmp_path):
    """A training output folder: two checkpoints, and a log written after the newest of them."""
    out = tmp_path / "output"
    (out / "checkpoints").mkdir(parents=True)
    torch.save(_state(1), out / "checkpoints" / "step100.pt")
    torch.save(_state(2), out / "checkpoints" / "step200.pt")
    os.utime(out / "checkpoints" / "step100.pt", (1, 1))
    (out / "train.log").write_text("step 200 loss 0.1\n")          # the newest entry, not a checkpoint
    return out


def _run_script(*args, inject: str | None = None, report=None):
    env = dict(os.environ, CKPT_ARCHIVE=f"{sys.executable} -m ckpt_archive", SETTLE="0")
    env.pop("CKPT_ARCHIVE_INJECT", None)
    if inject:
        env["CKPT_ARCHIVE_INJECT"] = inject
    if report is not None:
        env["REPORT"] = str(report)
    return subprocess.run(["bash", SCRIPT, *map(str, args)], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "local"])
def test_end_of_rental_script_packs_the_newest_checkpoint_not_the_newest_file_and_prints_the_proof(kind, request,
                                                                                                  tmp_path):
    dest = request.getfixturevalue("s3_url") if kind == "s3" else str(tmp_path / "dest")
    out = _rental_output(tmp_path)
    proc = _run_script("--newest-in", out, tmp_path / "repo", dest, report=tmp_path / "proof.md")
    assert proc.returncode == 0, proc.stderr
    assert "OK, recoverable from the destination" in proc.stdout
    assert f"ckpt-archive restore {dest}@1 --output step200.pt" in proc.stdout
    assert "python -m pip install -c constraints.txt -e" in proc.stdout
    assert "pip install 'ckpt-archive[s3]'" not in proc.stdout
    assert "recoverable from" in proc.stderr
    _assert_bit_equal(_state(2), ca.load(dest))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "local"])
def test_end_of_rental_rerun_packs_nothing_twice_and_copies_nothing_twice(kind, request, tmp_path):
    dest = request.getfixturevalue("s3_url") if kind == "s3" else str(tmp_path / "dest")
    out = _rental_output(tmp_path)
    first = _run_script(out, tmp_path / "repo", dest, report=tmp_path / "first.md")
    assert first.returncode == 0, first.stderr
    again = _run_script(out, tmp_path / "repo", dest, "--json", report=tmp_path / "again.json")
    assert again.returncode == 0, again.stderr
    assert [g.number for g in Repository.open(tmp_path / "repo").generations()] == [1]   # not packed twice
    proof = json.loads((tmp_path / "again.json").read_text())
    assert [(g["generation"], g["status"], g["bytes_copied"]) for g in proof["generations"]] == \
        [(1, "already-usable", 0)]
    assert [g.number for g in Repository.open(dest).generations()] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "local"])
def test_end_of_rental_killed_between_objects_resumes_on_rerun(kind, request, tmp_path):
    dest = request.getfixturevalue("s3_url") if kind == "s3" else str(tmp_path / "dest")
    out = _rental_output(tmp_path)
    killed = _run_script(out, tmp_path / "repo", dest, inject="export-after-member=kill@1")
    assert killed.returncode != 0 and "NOT SAFE to return the machine" in killed.stderr
    (g,) = Repository.open(dest).generations()
    assert g.status == "partial"
    members = [m["stored_path"] for m in g.manifest["members"]]
    assert len(members) >= 2
    rerun = _run_script(out, tmp_path / "repo", dest, "--json", report=tmp_path / "proof.json")
    assert rerun.returncode == 0, rerun.stderr
    assert [g.number for g in Repository.open(tmp_path / "repo").generations()] == [1]   # packed once
    (eg,) = json.loads((tmp_path / "proof.json").read_text())["generations"]
    assert eg["status"] == "resumed"
    actions = {o["key"].split("/", 2)[2]: o["action"] for o in eg["objects"]}  # path inside the generation
    assert [actions[m] for m in members] == ["present"] + ["copied"] * (len(members) - 1)
    names = sorted(Repository.open(dest).store.listdir("generations/00000001"))
    # members may sit in a subfolder (exact/NAME: a source file's skeleton): compare top-level names
    assert names == sorted({"CLAIM", "USABLE.json", "manifest.json", *(m.split("/")[0] for m in members)})
    _assert_bit_equal(_state(2), ca.load(dest))


@pytest.mark.slow
def test_end_of_rental_script_fails_loudly_when_the_export_fails(source, s3_server, s3_url, tmp_path, monkeypatch):
    torch.save(_state(3), tmp_path / "last.pt")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    with s3_server.enforce_auth():
        proc = _run_script(tmp_path / "last.pt", tmp_path / "repo", s3_url, report=tmp_path / "proof.md")
    assert proc.returncode == 2, proc.stderr
    assert "access denied" in proc.stderr and "NOT SAFE to return the machine" in proc.stderr
    assert not (tmp_path / "proof.md").exists()


@pytest.mark.parametrize("where", ["", "inside", "parent"])
def test_export_refuses_an_empty_destination_or_one_overlapping_the_source(tmp_path, where):
    from ckpt_archive.errors import UsageError

    src = tmp_path / "box" / "src"
    ca.pack({"w": torch.ones(3)}, src)
    dest = {"": "", "inside": str(src / "generations" / "x"), "parent": str(tmp_path / "box")}[where]
    with pytest.raises(UsageError):
        export(src, dest)
    assert not (src / "generations" / "x").exists()


# --- an end of rental you can re-run: what a killed export leaves at DEST, and a missing bucket ---------------
@pytest.mark.slow
def test_rerun_aborts_the_multipart_upload_a_killed_export_left_at_dest(s3_server, s3_url, tmp_path, monkeypatch):
    """A process killed mid-upload cannot abort its multipart upload: the parts stay, invisible and billed.
    The re-run, holding DEST's lock, aborts the unfinished uploads below its own generation."""
    repo = tmp_path / "big"
    g = torch.Generator().manual_seed(5)
    # an ~11 MiB member: multipart (kept in the member, not a shared object: tests/test_shared_export.py has
    # the same kill for an object's upload)
    ca.pack({"w": torch.randn(3_000_000, generator=g), "step": 1}, repo, ca.PackOptions(share_min_bytes=0))
    monkeypatch.setenv("FSSPEC_S3", json.dumps({"default_block_size": 5 << 20}))
    killed = run_cli_subprocess("export", str(repo), "--to", s3_url, inject="export-member-write=kill")
    assert killed.returncode == -9, killed.stderr
    bucket, prefix = _split(s3_url)
    client = s3_server.client()
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == [f"{prefix}/generations/00000001/tensors-00000.safetensors.ckz"]

    res = cli("export", str(repo), "--to", s3_url, "--json")
    assert res.exit_code == 0, res.output
    (eg,) = json.loads(res.stdout)["generations"]
    assert eg["status"] == "resumed"
    assert eg["cleaned"]["aborted_uploads"] == ["generations/00000001/tensors-00000.safetensors.ckz"]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert Repository.open(s3_url).generation(1).status == "usable"


def test_rerun_removes_stray_objects_of_its_own_partial_generation(source, s3_server, s3_url):
    repo, states = source
    bucket, prefix = _split(s3_url)
    first = run_cli_subprocess("export", f"{repo}@2", "--to", s3_url, inject="export-after-manifest=kill")
    assert first.returncode == -9, first.stderr
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/generations/00000002/stray.tmp", Body=b"x")
    res = cli("export", f"{repo}@2", "--to", s3_url, "--json")
    assert res.exit_code == 0, res.output
    (eg,) = json.loads(res.stdout)["generations"]
    assert eg["cleaned"]["removed"] == ["generations/00000002/stray.tmp"]
    assert "stray.tmp" not in Repository.open(s3_url).store.listdir("generations/00000002")
    _assert_bit_equal(states[2], ca.load(s3_url))


def test_a_missing_bucket_is_one_clear_line_with_exit_2(source, s3_server, s3_env, tmp_path):
    repo, _ = source
    url = "s3://no-such-bucket-for-ckpt-archive/run-1"
    res = cli("export", str(repo), "--to", url)
    assert res.exit_code == 2, res.output
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert "bucket does not exist" in line and url in line
    assert "repository.json: missing" not in res.output
    res = cli("export", str(repo), "--to", url, "--json")
    assert res.exit_code == 2 and res.stderr == ""
    assert "bucket does not exist" in json.loads(res.stdout)["reason"]


def test_a_re_export_to_a_destination_whose_usable_copy_rotted_is_exit_1_naming_the_member(tmp_path):
    """Fault: re-running ``export`` to a DEST that already holds the generation marked usable answered
    ``already-usable`` (exit 0) after checking sizes only, though a byte of a DEST member had flipped and
    restore there exited 1. The stored chunks' sha256 are re-read from DEST before answering."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    ca.pack({"w": torch.randn(1000, generator=torch.Generator().manual_seed(3))}, src)
    runner = CliRunner()
    assert runner.invoke(app, ["export", str(src), "--to", str(dest), "-q"]).exit_code == 0
    res = runner.invoke(app, ["export", str(src), "--to", str(dest), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["generations"][0]["status"] == "already-usable"
    (member,) = (dest / "generations" / "00000001").glob("tensors-*.ckz")
    data = bytearray(member.read_bytes())
    data[len(data) // 2] ^= 1
    member.write_bytes(bytes(data))
    res = runner.invoke(app, ["export", str(src), "--to", str(dest), "--json"])
    assert res.exit_code == 1, res.stdout
    doc = json.loads(res.stdout)
    assert doc["error"] == "IntegrityError" and "tensors-00000.safetensors" in (doc["where"] or "") \
        and "sha256" in doc["reason"]
