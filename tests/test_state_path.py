"""One place-in-the-state type, one progress-key table, one config loader (issue 10).

Each of these replaced two or three copies that disagreed: a path parsed back with ``split(".")`` split a
state_dict key such as ``fc1.weight`` in two; the manifest's progress and the policy audit read
different step/epoch keys; the session config and ``pack --config`` read YAML by different rules.
"""
from __future__ import annotations

import pytest

from ckpt_archive.errors import SourceError, UsageError
from ckpt_archive.format.config_file import load_config, load_value_file
from ckpt_archive.format.progress import EPOCH_KEYS, STEP_KEYS, find_progress
from ckpt_archive.format.state_path import Index, StatePath, walk
from ckpt_archive.training.audit import audit
from ckpt_archive.training.parts import find_parts


def test_a_dotted_key_stays_one_key_in_the_display_form():
    p = StatePath(("model", "fc1.weight"))
    assert str(p) == 'model["fc1.weight"]'
    assert StatePath.parse(str(p)) == ("model", "fc1.weight")
    assert StatePath.parse("model.fc1.weight") == ("model", "fc1", "weight")  # three keys, as written


def test_a_list_position_is_told_from_an_int_dict_key():
    state = {"optimizer": {"state": {0: {"exp_avg": 1.0}}, "param_groups": [{"lr": 0.1}]}}
    paths = {str(p): p for p, _ in walk(state)}
    assert "optimizer.state.0.exp_avg" in paths and "optimizer.param_groups[0].lr" in paths
    assert isinstance(paths["optimizer.param_groups[0].lr"][2], Index)
    assert not isinstance(paths["optimizer.state.0.exp_avg"][2], Index)
    assert paths["optimizer.state.0.exp_avg"].get(state) == 1.0
    assert StatePath.parse("optimizer.param_groups[0].lr").get(state) == 0.1


def test_display_form_round_trips_keys_with_brackets_quotes_and_spaces():
    for key in ("a[0]", 'say "hi"', "x y", "", "optimizer.pt"):
        p = StatePath(("top", key)).at(3)
        assert StatePath.parse(str(p)) == ("top", key, 3), str(p)


@pytest.mark.parametrize("text", [".a", "a..b", "a[x]", "a[0]b", 'a["unterminated]'])
def test_malformed_display_form_is_refused_not_guessed(text):
    with pytest.raises(ValueError, match="not a state path"):
        StatePath.parse(text)


def test_slash_form_of_only_round_trips_and_refuses_a_key_it_cannot_write():
    assert StatePath.parse_slash("optimizer/state/0") == ("optimizer", "state", "0")
    assert StatePath.parse_slash("/model//") == ("model",)
    assert StatePath(("optimizer", "param_groups")).at(0).slash() == "optimizer/param_groups/0"
    with pytest.raises(ValueError, match="cannot be written"):
        StatePath(("sub/optimizer.pt",)).slash()


def test_setting_through_a_tuple_rebuilds_it_and_keeps_its_type():
    state = {"rng": {"python": (3, (1, 2), None)}}
    new = StatePath(("rng", "python")).at(1).set(state, (7, 8))
    assert new["rng"]["python"] == (3, (7, 8), None) and type(new["rng"]["python"]) is tuple


def test_keys_override_names_a_part_whose_key_holds_a_dot():
    opt = {"state": {}, "param_groups": [{"lr": 0.5, "params": [0]}]}
    state = {"ckpt": {"opt.v2": opt}}
    (path, found), = find_parts(state, {"optimizer": 'ckpt["opt.v2"]'})["optimizer"]
    assert found is opt and str(path) == 'ckpt["opt.v2"]'
    with pytest.raises(UsageError, match="no 'ckpt.opt.v2'"):
        find_parts(state, {"optimizer": "ckpt.opt.v2"})  # two keys, 'opt' and 'v2': not there
    with pytest.raises(UsageError, match="not a state path"):
        find_parts(state, {"optimizer": "ckpt..opt"})


@pytest.mark.parametrize("key", STEP_KEYS)
def test_pack_and_the_audit_read_the_same_step_keys(key):
    # the manifest's progress (find_progress) and the audit's counters used to read different keys
    state = {key: 7, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    assert find_progress(state)["step"] == 7
    assert audit(state).counters["progress_step"] == 7


@pytest.mark.parametrize("key", EPOCH_KEYS)
def test_pack_and_the_audit_read_the_same_epoch_keys(key):
    state = {key: 3, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    assert find_progress(state)["epoch"] == 3
    assert audit(state).counters["progress_epoch"] == 3


def test_progress_table_keeps_every_key_either_copy_had():
    for key in ("step", "global_step", "iteration", "iter", "steps", "optimizer_step", "num_updates", "update"):
        assert key in STEP_KEYS
    for key in ("epoch", "epochs", "current_epoch"):
        assert key in EPOCH_KEYS
    # a specific name wins over a plural that some trainers use for the total
    assert find_progress({"steps": 1000, "global_step": 40, "epochs": 10, "current_epoch": 2}) == {
        "step": 40, "epoch": 2}


def test_session_config_and_pack_config_read_yaml_by_the_same_1_2_rules(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optimizer:\n  lr: 1e-4\nfp16: yes\nwarmup: 4\nnothing: null\n")
    want = {"optimizer": {"lr": 1e-4}, "fp16": "yes", "warmup": 4, "nothing": None}
    assert load_config(cfg) == want == load_value_file(cfg, what="config")
    assert isinstance(load_config(cfg)["optimizer"]["lr"], float)


def test_a_config_that_is_no_mapping_or_missing_is_refused_naming_the_file(tmp_path):
    lst = tmp_path / "c.json"
    lst.write_text("[1, 2]")
    with pytest.raises(SourceError, match="config is not a mapping") as e:
        load_config(lst)
    assert str(lst) in str(e.value)
    with pytest.raises(SourceError, match="config not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = = 1")
    with pytest.raises(SourceError, match="cannot parse config"):
        load_config(bad)


def test_only_refuses_empty_components_and_reaches_keys_holding_a_slash(tmp_path):
    """Faults: ``--only ""``, ``/``, ``//`` silently selected the whole state and ``model//weight`` was read
    as ``model/weight``; a key containing "/" (a folder source's relpath, ``global_step10/x.pt``) could not
    be reached, and ``{"a/b": X, "a": {"b": Y}}`` with only="a/b" silently returned Y. Empty components
    are usage errors (exit 2), slash keys are resolved, and two resolutions are refused as ambiguous."""
    import torch
    from typer.testing import CliRunner

    import ckpt_archive
    from ckpt_archive.cli.app import app
    from ckpt_archive.errors import UsageError

    repo = tmp_path / "repo"
    ckpt_archive.pack({"model": {"weight": torch.ones(2)}, "g/x.pt": {"module": torch.zeros(3)},
                       "a/b": torch.full((1,), 1.0), "a": {"b": torch.full((1,), 2.0)}}, str(repo))
    for bad in ("", "/", "//", "model//weight", "model/"):
        with pytest.raises(UsageError, match="empty path component"):
            ckpt_archive.load(str(repo), options=ckpt_archive.LoadOptions(only=bad))
        res = CliRunner().invoke(app, ["restore", f"{repo}@latest", "--output", str(tmp_path / "o.pt"), "--only", bad])
        assert res.exit_code == 2 and not (tmp_path / "o.pt").exists(), res.output
    assert torch.equal(ckpt_archive.load(str(repo), "latest", ckpt_archive.LoadOptions(only="g/x.pt/module")),
                       torch.zeros(3))
    assert torch.equal(ckpt_archive.load(str(repo), "latest", ckpt_archive.LoadOptions(only="model/weight")),
                       torch.ones(2))
    with pytest.raises(UsageError, match="ambiguous"):
        ckpt_archive.load(str(repo), options=ckpt_archive.LoadOptions(only="a/b"))
    res = CliRunner().invoke(app, ["restore", f"{repo}@latest", "--output", str(tmp_path / "o.pt"), "--only", "a/b"])
    assert res.exit_code == 2 and "ambiguous" in res.output


def test_only_matches_keys_by_their_text_refusing_two_that_read_alike_and_loose_positions(tmp_path):
    """Faults (final break test): with ``{1: A, "1": B}`` and ``{True: ..., "True": ...}`` the step ``1`` /
    ``True`` silently took the first key; ``e/None`` returned the value of a lone-surrogate str key
    (tagged keys were matched as ``str(k.get("v"))``, "None" for them), which itself could not be
    selected; Counter keys were unreachable; a list position was read by ``int()``, so ``-1``, ``1_0``,
    ``+2``, ``01`` and an Arabic-Indic ``3`` all selected elements the slash form never writes."""
    import collections
    import os

    import ckpt_archive
    from ckpt_archive.errors import NotFound

    bad = os.fsdecode(b"caf\xe9")
    ckpt_archive.pack({"d": {1: "int-one", "1": "str-one"}, "f": {True: "t", "True": "T"},
                       "e": {bad: "surrogate", None: "none-key"}, "u": {1: "only-int"},
                       "c": collections.Counter({"x": 3, 5: 2}), "l": list(range(20))}, str(tmp_path / "r"))

    def only(sel):
        return ckpt_archive.load(str(tmp_path / "r"), options=ckpt_archive.LoadOptions(only=sel))

    for sel in ("d/1", "f/True"):
        with pytest.raises(UsageError, match="ambiguous"):
            only(sel)
    assert only("e/None") == "none-key" and only(f"e/{bad}") == "surrogate" and only("u/1") == "only-int"
    assert only("c/x") == 3 and only("c/5") == 2 and only("l/0") == 0 and only("l/12") == 12
    for sel in ("l/-1", "l/1_0", "l/+2", "l/01", "l/\u0663", "l/ 1", "l/20"):
        with pytest.raises(NotFound):
            only(sel)
