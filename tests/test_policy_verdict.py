"""Issue 25: the library gives the CLI's verdict.

Fault: ``ckpt-archive verify --strict`` exited 1 on a state without optimizer state while
``ckpt_archive.verify(repo, strict=True).ok`` was True: ``strict=True`` was swallowed by ``**store_options``
and the audit and the strict verdict lived in the CLI. Now ops computes them, and unknown keyword arguments
are refused.
"""
from __future__ import annotations

import json

import pytest
import torch

import ckpt_archive


def _cli(*args):
    from typer.testing import CliRunner

    from ckpt_archive.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def no_optimizer_repo(tmp_path_factory):
    """A state with model, RNG and a data cursor but no optimizer state: --strict fails it."""
    repo = tmp_path_factory.mktemp("v") / "repo"
    ckpt_archive.pack({"model": {"w": torch.ones(2)}, "rng": {"python": 1, "numpy": 2, "torch": torch.get_rng_state()},
                       "data": {"cursor": 3}, "step": 3}, repo)
    return repo


def test_library_verify_strict_gives_the_clis_verdict(no_optimizer_repo):
    lib = ckpt_archive.verify(no_optimizer_repo, options=ckpt_archive.VerifyOptions(strict=True))
    cli = _cli("verify", no_optimizer_repo, "--strict", "--json")
    assert cli.exit_code == 1, cli.output
    assert lib.ok is False
    doc = json.loads(cli.stdout)
    assert [p.to_json() for p in lib.problems] == doc["problems"]
    assert any(p.field == "optimizer" and "no optimizer state" in p.reason for p in lib.problems)
    assert lib.policy.strict and lib.to_json()["policy"] == doc["policy"]
    # without strict: a warning, as the CLI says
    plain = ckpt_archive.verify(no_optimizer_repo)
    assert plain.ok and any(w.startswith("completeness: optimizer:") for w in plain.warnings)
    assert _cli("verify", no_optimizer_repo).exit_code == 0


def test_verify_refuses_unknown_keyword_arguments(no_optimizer_repo):
    with pytest.raises(TypeError):
        ckpt_archive.verify(no_optimizer_repo, strcit=True)
    with pytest.raises(TypeError, match="strict"):  # an option is a field of VerifyOptions, never a keyword
        ckpt_archive.verify(no_optimizer_repo, strict=True)
    with pytest.raises(TypeError):
        ckpt_archive.inspect(no_optimizer_repo, endpoint_url="http://x")
    # store options go in one explicit mapping
    assert ckpt_archive.verify(no_optimizer_repo, store_options={}).generation == 1


def test_library_inspect_carries_the_audit_the_cli_prints(no_optimizer_repo):
    info = ckpt_archive.inspect(no_optimizer_repo)
    cli = _cli("inspect", no_optimizer_repo, "--json")
    assert cli.exit_code == 0, cli.output
    assert info.policy.to_json() == json.loads(cli.stdout)["policy"]
    assert any(f.field == "optimizer" for f in info.policy.completeness)
    assert ckpt_archive.inspect(no_optimizer_repo, policy=False).policy is None


def test_verify_without_policy_checks_bytes_only(no_optimizer_repo):
    rep = ckpt_archive.verify(no_optimizer_repo, options=ckpt_archive.VerifyOptions(strict=True, policy=False))
    assert rep.ok and rep.policy is None and "policy" not in rep.to_json()


def test_policy_analysis_imports_nothing_above_format(tmp_path):
    """ops/ runs the audit (training's pure analysis); that analysis must never import ops/repo/store/cli, not even
    inside a function, or ops -> training -> ops is a cycle."""
    import ast
    from pathlib import Path

    pure = ("parts", "values", "schedulers", "simulate", "nextstep", "plan", "impose", "changes", "session_config",
            "audit", "completeness", "session", "lr_bases", "sched_settings")
    root = Path(ckpt_archive.__file__).parent / "training"
    for name in pure:
        path = root / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [mod or ""]
            for n in names:
                assert not n.startswith(("ckpt_archive.ops", "ckpt_archive.repo", "ckpt_archive.store",
                                         "ckpt_archive.cli")), f"training/{name}.py imports {n}"


def test_policy_table_cuts_every_lr_to_an_ellipsis_at_80_columns(tmp_path):
    """Issue 26: `COLUMNS=80 inspect` showed every LR of the policy table as `0.007…`, the next-step LR included.
    Numbers are never cut: columns give way instead, and the caption says which."""
    import io

    from rich.console import Console

    from ckpt_archive.cli.policy_views import audit_table
    from ckpt_archive.training.audit import audit

    m = torch.nn.Linear(2, 2)
    o = torch.optim.AdamW([{"params": [m.weight]}, {"params": [m.bias], "lr": 3.5e-3}], lr=7.123456e-3)
    s = torch.optim.lr_scheduler.CosineAnnealingLR(o, 100)
    for _ in range(7):
        o.step()
        s.step()
    a = audit({"optimizer": o.state_dict(), "scheduler": s.state_dict(), "progress": {"step": 7},
               "a_long_group_name_for_good_measure": {}})
    con = Console(file=io.StringIO(), width=80)
    con.print(audit_table(a, 80))
    text = con.file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for g in a.groups:
        assert f"{g.next_lr:.7g}" in text and f"{g.after_step_lr:.7g}" in text
    assert "not shown at 80 columns" in text and "lr (= next_lr)" in text
    wide = Console(file=io.StringIO(), width=200)
    wide.print(audit_table(a, 200))
    assert "derived_lr" in wide.file.getvalue() and "not shown" not in wide.file.getvalue()
