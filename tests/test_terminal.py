"""A terminal that tells the truth (issue 13): phases on long work, one unit system, --json that is only
JSON, --quiet for cron, help that lists each command's own exit codes, Ctrl-C that says what was left."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

import ckpt_archive as ca
from ckpt_archive.cli.app import app
from ckpt_archive.repo.repository import Repository


def cli(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def _state(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g)}, "step": seed}


class Recorder:
    """A progress callback that records each phase and the bytes reported during it."""

    def __init__(self):
        self.phases: list[list] = [["(start)", None, 0]]

    def __call__(self, n: int) -> None:
        self.phases[-1][2] += n

    def phase(self, name: str, total=None) -> None:
        self.phases.append([name, total, 0])


def test_pack_reports_write_verify_and_trial_reload_phases_so_the_bar_never_sits_at_100_percent(tmp_path):
    rec = Recorder()
    res = ca.pack(_state(), tmp_path / "repo", on_bytes=rec)
    names = [p[0] for p in rec.phases]
    assert names == ["(start)", "write", "verify", "trial reload"]
    raw = res.manifest["summary"]["raw_bytes"]
    assert rec.phases[1][1] == 64 * 32 * 4 and rec.phases[1][2] > 0  # the write phase: its total and its bytes
    assert rec.phases[3][1] == raw and rec.phases[3][2] == raw     # the trial reload has a total and reaches it


def test_pack_of_a_file_names_the_read_and_hash_phase_with_its_bytes_from_the_first_second(tmp_path):
    """[issue 26] The bar sat at 'write 0 B / 464 MiB' for 9 of 20 s while the source was read and hashed."""
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    rec = Recorder()
    ca.pack(src, tmp_path / "repo", on_bytes=rec)
    names = [p[0] for p in rec.phases]
    assert names == ["(start)", "read and hash c.pt", "write", "verify", "trial reload"]
    assert rec.phases[0][2] == 0                                   # nothing is counted before a phase is named
    read = rec.phases[1]
    assert read[1] == src.stat().st_size and 0 <= read[2] <= read[1]


def test_export_reports_copy_reread_and_trial_reload_phases_with_totals(tmp_path):
    src = tmp_path / "src"
    ca.pack(_state(), src)
    rec = Recorder()
    ca.export(src, tmp_path / "dst", on_bytes=rec)
    names = [p[0].split(" of ")[0] for p in rec.phases[1:]]
    assert names == ["copy", "re-read", "verify", "trial reload"]
    stored = Repository.open(src).generation(1).manifest["summary"]["stored_bytes"]
    copy, reread = rec.phases[1], rec.phases[2]
    assert copy[1] == stored and copy[2] == stored and reread[1] == stored and reread[2] == stored


def test_verify_deep_reports_its_total(tmp_path):
    ca.pack(_state(), tmp_path / "repo")
    rec = Recorder()
    ca.verify(tmp_path / "repo", options=ca.VerifyOptions(deep=True), on_bytes=rec)
    (name, total, done), = rec.phases[1:]
    raw = Repository.open(tmp_path / "repo").generation(1).manifest["summary"]["raw_bytes"]
    assert name.startswith("trial reload") and total == raw and done == raw


def _task(description: str, total, done_steps, clock):
    """A rich Task advanced ``done_steps`` = [(seconds, bytes)] on a fake clock (rates and ETAs are real)."""
    from rich.progress import Progress

    now = [0.0]
    p = Progress(get_time=lambda: now[0])
    t = p.add_task(description, total=total)
    for at, n in done_steps:
        now[0] = at
        p.advance(t, n)
    now[0] = clock
    return p.tasks[0]


def test_progress_bar_uses_iec_units():
    from ckpt_archive.cli.common import bar_line, size_text

    assert size_text(1536 * 1024 ** 2, 3 * 1024 ** 3) == "1.5/3.0 GiB"
    assert size_text(512, 1536) == "512 B/1.5 KiB"
    task = _task("pack: write", 3 * 1024 ** 3, [(1.0, 0), (3.0, 1536 * 1024 ** 2)], 3.0)
    text = bar_line(task, 120).plain
    assert "1.5/3.0 GiB" in text and "MiB/s" in text and not re.search(r"\b(MB|GB|kB)\b", text)


#: a digit next to an ellipsis: a number cut to fit
CUT_NUMBER = re.compile(r"[0-9.]…|…[0-9]")


@pytest.mark.parametrize("width", [60, 80, 120])
def test_progress_bar_is_one_row_with_its_numbers_and_eta_at_any_width(width):
    """[issue 26] Bars wrapped to 3-4 rows at 80 columns and cut the ETA."""
    from ckpt_archive.cli.common import bar_line

    desc = "restore: decode, check and write generation 12 of /a/very/long/repository/path"
    task = _task(desc, 464 * 1024 ** 2, [(1.0, 0), (5.0, 200 * 1024 ** 2)], 5.0)
    text = bar_line(task, width).plain
    assert "\n" not in text and len(text) <= width - 1, text
    assert "200.0/464.0 MiB" in text and re.search(r"ETA \d+:\d\d", text), text
    assert not CUT_NUMBER.search(text), text


def test_progress_bar_keeps_the_speed_at_80_columns_cutting_a_long_phase_name_instead():
    """[issue 26] At 80 columns restore's row "restore: decode, check and write generation 1  ━━━  108.0/300.0 MiB
    ETA 0:03" had dropped its MiB/s (the README promises totals, speed and ETA on one row)."""
    from ckpt_archive.cli.common import bar_line

    task = _task("restore: decode, check and write generation 1", 300 * 1024 ** 2,
                 [(1.0, 0), (3.0, 108 * 1024 ** 2)], 3.0)
    text = bar_line(task, 80).plain
    assert len(text) <= 79 and "108.0/300.0 MiB" in text and "MiB/s" in text and "ETA" in text, text
    assert text.startswith("restore: decode"), text


def test_progress_shows_no_eta_until_a_rate_is_known():
    """[issue 26] Restore's first tick showed an ETA of 4 h: a rate from the first bytes of a phase."""
    from ckpt_archive.cli.common import bar_line, eta_seconds

    first_tick = _task("restore: decode", 464 * 1024 ** 2, [(0.0, 0), (0.3, 4096)], 0.3)
    assert eta_seconds(first_tick) is None and "ETA" not in bar_line(first_tick, 80).plain
    later = _task("restore: decode", 464 * 1024 ** 2, [(0.0, 0), (1.0, 100 << 20), (3.0, 200 << 20)], 3.0)
    assert eta_seconds(later) == pytest.approx((464 - 300) / 100, rel=0.01)  # 300 MiB in 3 s


@pytest.mark.parametrize("args", [["list", "{repo}"], ["verify", "{repo}", "--deep"], ["inspect", "{repo}"],
                                  ["restore", "{repo}", "--output", "{tmp}/o.pt"], ["adopt", "{repo}"],
                                  ["status", "{repo}", "--state", "{tmp}/st.json"],
                                  ["export", "{repo}", "--to", "{tmp}/dst"],
                                  ["prune", "{repo}", "--keep-last", "1", "--dry-run"], ["gc", "{repo}"],
                                  ["forget", "{repo}@1", "--force"]])
def test_json_mode_prints_only_the_json_object_and_nothing_on_stderr(tmp_path, args):
    repo = tmp_path / "repo"
    ca.pack(_state(), repo)
    ca.pack(_state(), repo)  # forget refuses to remove the only generation that restores: give it a second
    argv = [a.format(repo=repo, tmp=tmp_path) for a in args]
    res = cli(*argv, "--json")
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
    doc = json.loads(res.stdout)
    assert isinstance(doc, dict) and doc["ok"] is True             # [issue 26] success says so, as errors do


def test_json_mode_errors_are_json_too(tmp_path):
    res = cli("verify", tmp_path / "nothing-here", "--json")
    assert res.exit_code == 2 and res.stderr == ""
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["error"] == "NotFound" and doc["exit_code"] == 2


def test_quiet_prints_nothing_on_success_but_still_errors(tmp_path):
    src = tmp_path / "last.pt"
    torch.save(_state(), src)
    res = cli("backup", src, "--repo", tmp_path / "repo", "--settle", 0, "--quiet")
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == ""
    res = cli("restore", f"{tmp_path / 'repo'}@7", "--output", tmp_path / "x.pt", "-q")
    assert res.exit_code == 2 and "no generation 7" in res.stderr


def test_help_lists_each_commands_own_exit_codes_once_and_no_bool_metavar():
    top = cli("--help", env={"COLUMNS": "200"})
    assert top.exit_code == 0
    assert "Exit codes:" not in top.output                        # not repeated under every command
    for command, special in [("backup", "75"), ("status", "unhealthy"), ("adopt", "stays copied"),
                             ("list", None)]:
        res = cli(command, "--help", env={"COLUMNS": "200"})
        text = " ".join(res.output.split())
        assert text.count("Exit codes:") == 1, command
        assert "<bool>" not in res.output, command
        if special:
            assert special in text, command
    text = " ".join(cli("list", "--help", env={"COLUMNS": "200"}).output.split())
    assert " 1 " not in text.split("Exit codes:")[1]              # list never returns 1: not listed
    restore = " ".join(cli("restore", "--help", env={"COLUMNS": "200"}).output.split())
    assert re.search(r"--jobs\s+-j\s+<int>\s+Decoder threads", restore)


def _cli_subprocess(*args, inject=None):
    env = dict(os.environ)
    env.pop("CKPT_ARCHIVE_INJECT", None)
    if inject:
        env["CKPT_ARCHIVE_INJECT"] = inject
    # a shell's background job starts with SIGINT ignored and a child inherits that: Python then installs no
    # KeyboardInterrupt handler and the injected Ctrl-C does nothing (every test below passed as a no-op run)
    return subprocess.run([sys.executable, "-m", "ckpt_archive", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_ctrl_c_during_pack_says_what_was_left_and_how_to_clean_it_exit_130(tmp_path):
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    repo = tmp_path / "repo"
    ca.pack(_state(2), repo)
    proc = _cli_subprocess("pack", src, "--repo", repo, inject="after-seal=sigint")
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    real = os.path.realpath(repo)
    assert f"generation 2 of {real} left partial at step 'seal'" in proc.stderr
    assert f"ckpt-archive gc {real}" in proc.stderr
    assert [(g.number, g.status) for g in Repository.open(repo).generations()] == [(1, "usable"), (2, "partial")]
    res = cli("gc", repo)                                          # the command it named cleans it
    assert res.exit_code == 0
    assert [g.number for g in Repository.open(repo).generations()] == [1]


def test_ctrl_c_during_export_says_a_rerun_resumes(tmp_path):
    src = tmp_path / "src"
    ca.pack(_state(), src)
    proc = _cli_subprocess("export", src, "--to", tmp_path / "dst", "--json", inject="export-after-member=sigint")
    assert proc.returncode == 130
    doc = json.loads(proc.stdout)
    assert doc["error"] == "Interrupted" and "generation 1" in doc["left"]
    assert "run the same export again to resume" in doc["cleanup"]
    assert proc.stderr == ""
    res = cli("export", src, "--to", tmp_path / "dst", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["generations"][0]["status"] == "resumed"


def test_restore_in_one_pass_reports_its_one_phase_with_the_manifest_size_as_total(tmp_path):
    """A state packed from Python is written once, in place (ops/restore_torch.py): one phase."""
    ca.pack(_state(), tmp_path / "repo")
    raw = Repository.open(tmp_path / "repo").generation(1).manifest["summary"]["raw_bytes"]
    rec = Recorder()
    ca.restore(tmp_path / "repo", output=tmp_path / "o.pt", on_bytes=rec)
    (name, total, done), = rec.phases[1:]
    assert name == "decode, check and write generation 1" and total == raw and 0 < done <= raw
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True)["model"]["w"], _state()["model"]["w"])


def test_restore_through_torch_save_reports_decode_and_write_phases_with_the_manifest_size_as_total(tmp_path):
    """A state the one-pass writer declines (an nn.Parameter in it) is decoded, then written by torch.save."""
    state = {**_state(), "p": torch.nn.Parameter(torch.ones(3))}
    ca.pack(state, tmp_path / "repo")
    raw = Repository.open(tmp_path / "repo").generation(1).manifest["summary"]["raw_bytes"]
    rec = Recorder()
    res = ca.restore(tmp_path / "repo", output=tmp_path / "o.pt", on_bytes=rec)
    (decode, d_total, d_done), (write, w_total, w_done) = rec.phases[1:]
    assert decode == "decode and check generation 1" and write == "write o.pt"
    assert d_total == raw and 0 < d_done <= raw                    # every tensor byte decoded and checked
    assert w_total == raw and w_done == res.bytes_written          # the bytes written, counted as they go
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=False)["model"]["w"], _state()["model"]["w"])


def test_restore_of_a_byte_exact_file_reports_its_one_phase_with_a_total(tmp_path):
    src = tmp_path / "c.pt"
    torch.save(_state(3), src)
    ca.pack(src, tmp_path / "repo")
    raw = Repository.open(tmp_path / "repo").generation(1).manifest["summary"]["raw_bytes"]
    rec = Recorder()
    ca.restore(tmp_path / "repo", output=tmp_path / "o.pt", on_bytes=rec)
    (name, total, done), = rec.phases[1:]
    assert name == "decode, check and write generation 1" and total == raw and 0 < done <= raw
    assert (tmp_path / "o.pt").read_bytes() == src.read_bytes()


def test_restore_cli_shows_phases_and_iec_totals_on_a_terminal_and_nothing_with_json_or_quiet(tmp_path):
    repo = tmp_path / "repo"
    ca.pack(_state(), repo)
    tty = {"TTY_COMPATIBLE": "1", "COLUMNS": "160"}                # rich treats stderr as a terminal
    res = cli("restore", repo, "--output", tmp_path / "a.pt", env=tty)
    assert res.exit_code == 0, res.output
    assert "restore: decode, check and write generation 1" in res.stderr  # one pass (ops/restore_torch.py)
    assert re.search(r"[0-9.]+( B| KiB)?/8\.2 KiB", res.stderr)    # the manifest's raw size, in IEC units
    assert not re.search(r"[0-9] (kB|KB|MB|GB)\b", res.stderr)
    for quiet in (["--json"], ["--quiet"]):
        res = cli("restore", repo, "--output", tmp_path / f"b{quiet[0]}.pt", *quiet, env=tty)
        assert res.exit_code == 0 and res.stderr == "", quiet


#: Each command's exit-code wording that only it can say: the generic paragraph is gone everywhere.
OWN_EXIT_WORDS = {
    "gc": ("0 leftovers removed", "or nothing to remove", "2 could not be carried out (not a repository, lock held"),
    "prune": ("1 refused: no generation verifies, kept or to be removed",),
    "forget": ("1 nothing removed: it is the only generation that verifies", "2 nothing removed: no such generation"),
    "inspect": ("1 the generation's manifest or marker is not valid",),
    "demo": ("0 the resume matches exactly and every negative control diverged",),
    "check-resume": ("0 the resume is exact and every negative control diverged",
                     "1 a divergence: the resume differs from the continuous run, or a control had no effect",
                     "2 could not check"),
}


def test_every_commands_help_lists_only_its_own_exit_codes_and_the_top_level_one_line_each():
    from ckpt_archive.errors import EXIT_MEANINGS

    names = [c.name for c in app.registered_commands]
    assert set(OWN_EXIT_WORDS) <= set(names)
    for name in names:
        res = cli(name, "--help", env={"COLUMNS": "200"})
        assert res.exit_code == 0, name
        assert "<bool>" not in res.output, name
        text = " ".join(res.output.split())
        assert text.count("Exit codes:") == 1, name
        codes = text.split("Exit codes:")[1]
        for code in (1, 2):                                       # never the generic words of the old paragraph
            assert f"{code} {EXIT_MEANINGS[code]}" not in codes, name
        for words in OWN_EXIT_WORDS.get(name, ()):
            assert words in codes, (name, words)
    for name in ("gc",):                                          # it never exits 1: not listed
        codes = " ".join(cli(name, "--help", env={"COLUMNS": "200"}).output.split()).split("Exit codes:")[1]
        assert not re.search(r"(^|; )1 ", codes.strip()), name
    top = cli("--help", env={"COLUMNS": "100"}).output
    panel = top.split("Commands")[1]
    rows = [line for line in panel.splitlines() if line.startswith("│")]
    groups = [g.name for g in app.registered_groups]  # `key` (issue 28): a group of commands, one line too
    assert len(rows) == len(names) + len(groups), rows            # one line per command, none wrapped


@pytest.mark.parametrize("args", [
    ("restore", "r@latest", "--json"),                       # no --output
    ("list", "--json"),                                      # no REPO
    ("restore", "r@latest", "-o", "x.pt", "--bogus", "--json"),
])
def test_json_mode_usage_errors_are_one_json_object_on_stdout_not_a_usage_box(tmp_path, args):
    proc = subprocess.run([sys.executable, "-m", "ckpt_archive", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["error"] == "UsageError" and doc["exit_code"] == 2 and doc["reason"]


def test_ctrl_c_after_the_generation_was_published_exits_0_and_says_it_was_published(tmp_path):
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    repo = tmp_path / "repo"
    ca.pack(_state(2), repo)
    proc = _cli_subprocess("pack", src, "--repo", repo, inject="after-publish=sigint")
    assert proc.returncode == 0, proc.stderr
    assert f"generation 2 of {os.path.realpath(repo)} was published" in proc.stderr
    assert "left partial" not in proc.stderr
    assert [(g.number, g.status) for g in Repository.open(repo).generations()] == [(1, "usable"), (2, "usable")]
    proc = _cli_subprocess("pack", src, "--repo", repo, "--json", inject="after-publish=sigint")
    assert proc.returncode == 0 and proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["interrupted"] is True and doc["published"] == [3]


def test_ctrl_c_landing_after_the_command_finished_keeps_its_exit_code(monkeypatch, tmp_path):
    from ckpt_archive.cli import app as app_module
    from ckpt_archive.cli.common import FINISHED

    repo = tmp_path / "repo"
    ca.pack(_state(), repo)

    def interrupted_after_finishing(*a, **kw):          # what typer does when Ctrl-C lands after the body
        FINISHED.append(0)
        raise SystemExit(130)

    monkeypatch.setattr(app_module, "app", interrupted_after_finishing)
    monkeypatch.setattr(sys, "argv", ["ckpt-archive", "list", str(repo)])
    with pytest.raises(SystemExit) as info:
        app_module.main()
    assert info.value.code == 0


def test_pack_shows_torchs_own_warnings_once_as_the_tools_warnings_and_none_with_quiet(tmp_path, monkeypatch):
    import warnings

    real = ca.pack

    def noisy_pack(*a, **kw):                    # torch warns like this while a source is read
        for _ in range(3):
            warnings.warn("TypedStorage is deprecated", UserWarning)
        return real(*a, **kw)

    monkeypatch.setattr(ca, "pack", noisy_pack)
    src = tmp_path / "c.pt"
    torch.save(_state(), src)
    res = CliRunner().invoke(app, ["pack", str(src), "--repo", str(tmp_path / "repo")])
    assert res.exit_code == 0, res.output
    assert res.stderr.count("warning: UserWarning: TypedStorage is deprecated") == 1
    assert "UserWarning: TypedStorage" not in res.stderr.replace("warning: UserWarning: TypedStorage", "")
    res = CliRunner().invoke(app, ["pack", str(src), "--repo", str(tmp_path / "repo"), "-q"])
    assert res.exit_code == 0 and "TypedStorage" not in res.stderr


def test_inspect_of_a_state_without_optimizer_prints_no_empty_lr_policy_table(tmp_path):
    repo = tmp_path / "repo"
    ca.pack({"model": {"w": torch.ones(3)}, "step": 1}, repo)
    res = cli("inspect", repo)
    assert res.exit_code == 0, res.output
    assert "LR policy (scheduler" not in res.output and "after_sched_step" not in res.output
    assert "no optimizer param groups" in res.output


def test_generation_repr_is_short_not_the_whole_manifest(tmp_path):
    repo = tmp_path / "repo"
    ca.pack({"model": {"w": torch.ones(300)}, "step": 7}, repo)
    text = repr(Repository.open(repo).generation(1))
    assert len(text) < 200 and "Generation(1, 'usable', step=7" in text and "members" not in text


# ------------------------------------------------------------------ issue 26: stdout for results, 80 columns, --help
def _repo_with_wide_numbers(tmp_path):
    """Three generations with big steps, MiB sizes, long tags; and a partial one (a reason for --all)."""
    repo = tmp_path / "repo"
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        ca.pack({"model": {"w": torch.randn(600, 600, generator=g)}, "step": 123_456_789 + i}, repo,
                annotations=ca.Annotations(tags=("nightly", "keep-forever-and-ever")))
    (repo / "generations" / "00000009").mkdir()
    return repo


@pytest.mark.parametrize("command", [["list", "{repo}"], ["inspect", "{repo}"], ["verify", "{repo}"],
                                     ["status", "{repo}", "--state", "{tmp}/st.json"]])
def test_results_go_to_stdout_and_nothing_else_to_stderr(tmp_path, command):
    """[issue 26] list, inspect, verify and status printed their result on stderr: `list R | grep usable`
    got nothing."""
    repo = tmp_path / "repo"
    ca.pack(_state(), repo)
    res = cli(*[a.format(repo=repo, tmp=tmp_path) for a in command])
    assert res.exit_code == 0, res.output
    assert all(line.startswith("warning: ") for line in res.stderr.splitlines()), res.stderr  # diagnostics only
    assert {"list": "usable", "inspect": "generation 1", "verify": "generation 1: ok",
            "status": "ok: newest usable generation 1"}[command[0]] in res.stdout


def test_a_failing_verdict_goes_to_stdout_even_with_quiet_and_errors_to_stderr(tmp_path):
    repo = tmp_path / "repo"
    ca.pack(_state(), repo)
    member = next((repo / "generations" / "00000001").glob("tensors-*.ckz"))
    data = bytearray(member.read_bytes())
    data[-1] ^= 0xFF
    member.write_bytes(bytes(data))
    res = cli("verify", repo, "-q")
    assert res.exit_code == 1 and "problem(s)" in res.stdout and member.name.removesuffix(".ckz") in res.stdout
    res = cli("verify", f"{repo}@7", "-q")
    assert res.exit_code == 2 and res.stdout == "" and "no generation 7" in res.stderr


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("width", [60, 80, 120])
def test_list_fits_the_terminal_without_cutting_or_wrapping_a_number(tmp_path, width):
    """[issue 26] At 80 columns `list` wrapped dates and sizes across lines; numbers are never cut: columns
    are abbreviated or dropped instead, and a row is one line."""
    repo = _repo_with_wide_numbers(tmp_path)
    res = cli("list", repo, "--all", env={"COLUMNS": str(width)})
    assert res.exit_code == 0, res.output
    lines = _table_lines(res.stdout)[1:]                            # the title (the repository's path) aside
    assert all(len(line.rstrip()) <= width for line in lines), lines
    assert not CUT_NUMBER.search(res.stdout), res.stdout
    for n in (1, 2, 3):                                           # each generation: one line, numbers whole
        row = next(line for line in lines if re.match(rf"\s*{n}\s+usable", line))
        assert f"{123_456_789 + n - 1}" in row and re.search(r"\d\d-\d\d \d\d:\d\d", row)
        assert re.search(r"\d+\.\d (KiB|MiB)", row), row
    assert "no manifest" in res.stdout                            # the reason is shown, in a column or below


@pytest.mark.parametrize("width", [60, 80, 120])
def test_inspect_and_prune_tables_fit_without_cutting_numbers(tmp_path, width):
    repo = _repo_with_wide_numbers(tmp_path)
    for args, start in ((["inspect", repo], "members"), (["prune", repo, "--keep-last", "1", "--dry-run"], "keep")):
        res = cli(*args, env={"COLUMNS": str(width)})
        assert res.exit_code == 0, res.output
        table = res.stdout[res.stdout.index(start):].split("loading instructions")[0].split("LR policy")[0]
        prose = ("  ", "check before removing", "would remove", "shared objects:")  # sentences, not rows
        lines = [line for line in _table_lines(table) if not line.startswith(prose)][1:]  # rows; title aside
        assert lines and all(len(line.rstrip()) <= width for line in lines), (args[0], lines)
        assert not CUT_NUMBER.search(table), table
    res = cli("prune", repo, "--keep-last", "1", "--dry-run", env={"COLUMNS": str(width)})
    for n in (1, 2):                                              # a decision row: one line, numbers whole
        assert re.search(rf"^\s*{n}\s+\S.*{123_456_789 + n - 1}.*REMOVE", res.stdout, re.M), res.stdout


def test_help_shows_readable_metavars_and_a_plain_usage_line():
    """[issue 26] <list[str]> metavars, pack's usage with {source}, check-resume without {total_steps}."""
    for name in [c.name for c in app.registered_commands]:
        text = cli(name, "--help", env={"COLUMNS": "100"}).output
        assert "<list[" not in text and "{" not in text.split("Usage:")[1].splitlines()[0], name
    pack = cli("pack", "--help", env={"COLUMNS": "100"}).output
    assert re.search(r"pack \[OPTIONS\] SOURCE", pack) and re.search(r"--tag\s+TAG", pack)
    check = " ".join(cli("check-resume", "--help", env={"COLUMNS": "100"}).output.split())
    assert "{total_steps}" in check and "'{resume:--resume-from {}}'" in check
    assert re.search(r"--interrupt-at\s+N\[,N\.\.\.\]", check)


@pytest.mark.parametrize("width", [80, 100, 120])
def test_no_commands_help_cuts_a_word_with_an_ellipsis_at_80_to_120_columns(width):
    """[issue 26] check-resume's `--script-control=--omit-rng…` example and its `--output` default
    `./ckpt-archive-check-resume…` were cut at 80 columns: a help text token wider than its column."""
    for name in [None] + [c.name for c in app.registered_commands]:
        text = cli(*([name] if name else []), "--help", env={"COLUMNS": str(width)}).output
        assert "…" not in text, (name, [line for line in text.splitlines() if "…" in line])


@pytest.mark.parametrize("width", [80, 100])
def test_restore_only_example_is_not_cut_at_80_to_100_columns(width):
    text = cli("restore", "--help", env={"COLUMNS": str(width)}).output
    assert "global_step10/mp_rank_00_model_states.pt/module" in text
    assert "…" not in text


def test_the_docs_give_one_check_resume_template_form():
    """[issue 26] The README had `--out {output} {resume}` and `--output {output} '{resume:--resume-from {}}'`."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            if "python train.py --steps {steps}" in line:  # a command template (the API's list form aside)
                assert "--output {output}" in line and "'{resume:--resume-from {}}'" in line, (doc.name, line)


def test_a_folder_named_like_a_selector_gets_told_how_to_name_it(tmp_path):
    """[issue 26] `run@2` (a folder) gave '.../run: not a repository'."""
    repo = tmp_path / "run@2"
    ca.pack(_state(), repo)
    res = cli("inspect", repo)
    assert res.exit_code == 2 and f"{repo}@latest" in res.stderr and "not a repository" not in res.stderr
    assert cli("inspect", f"{repo}@latest").exit_code == 0


@pytest.mark.parametrize("command", [["list"], ["status"], ["gc"], ["prune", "--keep-last", "1"], ["adopt"]])
def test_a_generation_given_where_a_repository_is_taken_names_the_repository(tmp_path, command):
    """[issue 26, the run@2 kind] `ckpt-archive list r1@latest` said only "r1@latest: not a ckpt-archive repository"
    (as `list run@2@latest` did, following inspect's advice for a folder named run@2): say which repository."""
    for name in ("r1", "run@2"):
        repo = tmp_path / name
        ca.pack(_state(), repo)
        res = cli(command[0], f"{repo}@latest", *command[1:])
        assert res.exit_code == 2, res.output
        assert f"give {repo}" in res.stderr and "not a ckpt-archive repository" not in res.stderr, res.stderr
    res = cli(command[0], tmp_path / "nothere@latest", *command[1:])         # no repository under the head either
    assert res.exit_code == 2 and "this command takes a repository" not in res.stderr, res.stderr


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
def test_ctrl_c_after_restore_put_its_output_in_place_exits_0_and_says_it_is_complete(tmp_path, json_mode):
    """Fault: a Ctrl-C landing after restore renamed its output into place exited 130 ("interrupted;
    nothing is known to be left half-written") although the file was complete, so a script re-ran or
    deleted a good restore. The output is complete: exit 0, and the warning says so."""
    repo = tmp_path / "repo"
    ca.pack(_state(), repo)
    out = tmp_path / "out.pt"
    args = ["restore", f"{repo}@latest", "-o", out] + (["--json"] if json_mode else [])
    proc = _cli_subprocess(*args, inject="restore-placed=sigint")
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert torch.load(out, weights_only=True)["step"] == _state()["step"]
    if json_mode:
        doc = json.loads(proc.stdout)
        assert doc["ok"] is True and doc["interrupted"] is True and str(out) in doc["complete"]
    else:
        assert f"{out} is restored and complete" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_ctrl_c_before_restore_put_its_output_in_place_still_exits_130(tmp_path, monkeypatch):
    """The other side of the line: an interrupt before the rename leaves no output and is a failure (130)."""
    from ckpt_archive.ops import restore as restore_mod

    repo = tmp_path / "repo"
    ca.pack(_state(), repo)
    out = tmp_path / "out.pt"

    def interrupted(self, gen):
        raise KeyboardInterrupt

    monkeypatch.setattr(restore_mod._Job, "commit", interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        ca.restore(repo, output=out)
    assert not getattr(info.value, "ckpt_complete", None) and not out.exists()
    # what the CLI says: that nothing was written -- not pack's "list --all shows any partial generation, gc
    # removes it", which a restore never leaves (break test)
    from ckpt_archive.cli.common import interrupted_text

    text, left, cleanup = interrupted_text(info.value)
    assert "nothing was written to" in text and "gc" not in text and "partial" not in text, text
    # and a Ctrl-C before the restore began (no note attached yet): what a command that only reads can leave
    for command in ("restore", "verify", "list", "status", "inspect"):
        text, _, _ = interrupted_text(KeyboardInterrupt(), command)
        assert "only read" in text and "gc" not in text and "partial" not in text, (command, text)
    assert "gc" in interrupted_text(KeyboardInterrupt(), "pack")[0]


def test_help_at_60_columns_is_wrapped_not_cut():
    """Fault: below about 76 columns Typer's boxed option tables cut option names and words with an
    ellipsis ("--instructio…", "(JSON/YAML/TO…"): `COLUMNS=60 ckpt-archive pack --help` could not be read.
    Narrow help is Click's plain layout, wrapped to the width: every line fits, nothing is cut, and every
    option of every command is named in full."""
    from ckpt_archive.cli.app import app

    group = typer.main.get_command(app)
    for name in ["", *group.commands]:
        res = cli(*([name] if name else []), "--help", env={"COLUMNS": "60"})
        assert res.exit_code == 0, res.output
        assert "…" not in res.output, (name, res.output)
        assert max(map(len, res.output.splitlines())) <= 60, (name, res.output)
        if name:
            for param in group.commands[name].params:
                for opt in param.opts:
                    if opt.startswith("--"):
                        assert opt in res.output, (name, opt)
