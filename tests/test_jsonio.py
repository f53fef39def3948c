"""Strict JSON in and out (``ckpt_archive.format.jsonio``): what a hostile document may not slip past."""
from __future__ import annotations

import json
import math

import pytest

from ckpt_archive.errors import InvalidJSON, ManifestInvalid
from ckpt_archive.format import jsonio


def test_a_duplicate_key_is_refused_rather_than_the_last_value_silently_winning():
    with pytest.raises(InvalidJSON, match=r"m\.json: not valid JSON \(duplicate key 'sha256'\)"):
        jsonio.loads(b'{"sha256": "aa", "sha256": "bb"}', where="m.json")
    with pytest.raises(InvalidJSON, match="duplicate key 'a'"):
        jsonio.loads(b'{"x": [{"a": 1, "a": 1}]}', where="m.json")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_constants_are_refused(token):
    with pytest.raises(InvalidJSON, match=f"non-standard JSON constant {token}"):
        jsonio.loads(f'{{"v": {token}}}'.encode(), where="m.json")


def test_a_document_nested_deeper_than_the_limit_is_refused_with_a_clean_error_not_a_recursion_crash():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(InvalidJSON, match="nested more than"):
        jsonio.loads(deep, where="m.json")
    with pytest.raises(InvalidJSON, match="nested more than 3 levels"):
        jsonio.loads(b'{"a": {"b": {"c": {}}}}', where="m.json", max_depth=3)
    assert jsonio.loads(b'{"a": {"b": {"c": 1}}}', where="m.json", max_depth=3) == {"a": {"b": {"c": 1}}}


def test_a_document_larger_than_the_limit_is_refused_before_parsing():
    with pytest.raises(InvalidJSON, match="more than the 10"):
        jsonio.loads(b'{"a": "0123456789"}', where="m.json", max_bytes=10)


def test_refusals_are_check_failures_and_value_errors():
    with pytest.raises(InvalidJSON) as err:
        jsonio.loads(b"\xff\xfe", where="m.json")
    assert isinstance(err.value, ManifestInvalid) and isinstance(err.value, ValueError)
    assert err.value.exit_code == 1 and err.value.where == "m.json"


def test_valid_documents_parse_exactly_as_json_loads_parses_them():
    doc = {"a": [1, 2.5, -0.0, 1e308, "é", None, True], "b": {"c": {}}, "big": 2**70}
    raw = json.dumps(doc).encode()
    assert jsonio.loads(raw, where="m.json") == json.loads(raw)


def test_dumps_writes_non_finite_floats_as_the_format_tags_them_never_as_nan_tokens():
    out = jsonio.dumps({"loss": float("nan"), "hist": [float("inf"), -math.inf, 1.5]}, indent=None)
    assert b"NaN" not in out and b"Infinity" not in out and out.endswith(b"\n")
    assert json.loads(out) == {"loss": {"$t": "float", "v": "nan"},
                               "hist": [{"$t": "float", "v": "inf"}, {"$t": "float", "v": "-inf"}, 1.5]}


def test_dumps_of_finite_values_is_byte_identical_to_json_dumps():
    doc = {"b": 1, "a": [1.5, "é", None]}
    assert jsonio.dumps(doc, indent=1) == (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode()
    assert jsonio.dumps(doc, indent=2, ensure_ascii=True, sort_keys=True) == \
        (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


_SHAPES = {  # the densest JSON there is, one shape each (issue 24: a 60 MiB tree parsed into 1.5 GB)
    "empty lists": lambda n: "[" + ",".join(["[]"] * (n // 3)) + "]",
    "empty objects": lambda n: "[" + ",".join(["{}"] * (n // 3)) + "]",
    "short strings": lambda n: "[" + ",".join(['"ab"'] * (n // 5)) + "]",
    "floats": lambda n: "[" + ",".join(["1.5"] * (n // 4)) + "]",
    "unique keys": lambda n: "{" + ",".join(f'"{i}":0' for i in range(n // 12)) + "}",
    "one-key objects": lambda n: "[" + ",".join(['{"a":0}'] * (n // 8)) + "]",
    "wide characters": lambda n: "[" + ",".join(['"\U0001f600a"'] * (n // 9)) + "]",
}


@pytest.mark.parametrize("shape", sorted(_SHAPES))
def test_parse_cost_is_an_upper_bound_of_what_a_parse_really_allocates(shape):
    """The parse-cost bound (issue 24) is only a bound if the estimate is never below what a parse really
    takes: measured with tracemalloc on 1 MiB of each of the densest shapes."""
    import tracemalloc

    doc = _SHAPES[shape](1 << 20).encode()
    tracemalloc.start()
    try:
        jsonio.loads(doc, where="m.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= jsonio.parse_cost(doc), (shape, peak, jsonio.parse_cost(doc))


def test_a_document_costlier_than_max_cost_is_refused_before_parsing():
    doc = _SHAPES["empty lists"](1 << 20).encode()
    with pytest.raises(InvalidJSON, match="would take about .* bytes of memory to parse"):
        jsonio.loads(doc, where="m.json", max_cost=8 << 20)
    assert jsonio.loads(b'{"a": [1, 2]}', where="m.json", max_cost=8 << 20) == {"a": [1, 2]}
