"""`agentkv bench calls`: traces parse strictly, replays ask every call, and agreement is counted right."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from agentkv import TransformersBackend
from agentkv_bench.call_bench import (
    CallRow,
    calls_summary,
    canonical,
    flat_args,
    load_call_traces,
    parse_call_trace,
    replay_calls,
    run_calls_bench,
    trace_names,
)
from agentkv_bench.methods import METHODS

TOOLS = [
    {
        "name": "search_orders",
        "description": "Search orders by customer name.",
        "parameters": {
            "type": "object",
            "properties": {"customer": {"type": "string"}},
            "required": ["customer"],
        },
    },
    {
        "name": "refund",
        "description": "Refund an order.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
            "required": ["order_id", "amount"],
        },
    },
]
LISTING = " ".join(f"ORD-{7000 + i}-Q costs {10 + i}.50;" for i in range(12))
TRACE: dict[str, Any] = {
    "name": "shop",
    "system": "You are a shop assistant. Use the tools.",
    "tools": TOOLS,
    "messages": [
        {"user": "Find the orders of Dana Whitfield."},
        {"call": {"name": "search_orders", "args": {"customer": "Dana Whitfield"}}, "result": LISTING},
        {"assistant": "She has twelve orders."},
        {"user": "Refund the rug."},
        {"call": {"name": "refund", "args": {"order_id": "ORD-7013-Q", "amount": 23.5}}, "result": "ok"},
        {"call": {"name": "search_orders", "args": {"customer": "Dana W."}}, "result": LISTING},
        {"assistant": "Done."},
    ],
}


def row(step: int, method: str, name: str | None, args: dict[str, Any] | None, **kw: Any) -> CallRow:
    base = CallRow(
        trace="t",
        step=step,
        method=method,
        budget=0.25 if method != "full" else 1.0,
        name=name,
        args=args,
        forced_args=args,
        script_name="a",
        script_args={"x": 1},
        attended_tokens=10,
        device_bytes=100,
        host_bytes=0,
        budget_met=True,
    )
    return replace(base, **kw)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda d: d.pop("tools"), "missing"),
        (lambda d: d["messages"].insert(0, {"assistant": "hi"}), "starts with a user message"),
        (lambda d: d["messages"][1]["call"].update(name="nope"), "unknown tool 'nope'"),
        (lambda d: d["messages"].append({"user": "x", "assistant": "y"}), "is not"),
        (lambda d: d.update(messages=[{"user": "hi"}]), "no call"),
        (lambda d: d["messages"][1].update(call="search_orders"), "is not {name, args}"),
    ],
)
def test_a_malformed_trace_is_refused_with_where_it_breaks(change, error):
    data = json.loads(json.dumps(TRACE))
    change(data)
    with pytest.raises(ValueError, match=error):
        parse_call_trace(data, where="shop")


def test_the_shipped_traces_parse_and_their_calls_fit_their_tools():
    names = trace_names()
    assert len(names) >= 6
    for trace in load_call_traces():
        tools = {t["name"]: t["parameters"] for t in trace.tools}
        for message in trace.messages:
            if "call" in message:
                schema = tools[message["call"]["name"]]
                assert (
                    set(schema.get("required", []))
                    <= set(message["call"]["args"])
                    <= set(schema["properties"])
                )


def test_canonical_calls_ignore_key_order_and_integral_floats():
    assert canonical("f", {"a": 1, "b": [2.0, {"c": 3.0}]}) == canonical("f", {"b": [2, {"c": 3}], "a": 1.0})
    assert canonical("f", {"a": 1.5}) != canonical("f", {"a": 1})
    assert canonical("f", {"a": 1}) != canonical("g", {"a": 1})


def test_arguments_are_compared_leaf_by_leaf_at_their_paths():
    assert flat_args({"a": {"b": [1, 2.0]}, "c": "x"}) == {"a.b[0]": 1, "a.b[1]": 2, "c": "x"}
    script = {"id": "RSV-1", "driver": {"name": "Ana", "licence": "PT-7"}, "days": 3}
    forced = {"id": "RSV-1", "driver": {"name": "Ana", "licence": "PT-9"}, "days": 3.0, "extra": 1}
    assert row(0, "m", "a", {}, script_args=script, forced_args=forced).script_values == 0.75
    assert row(0, "m", "a", {}, script_args=script, forced_args=None).script_values == 0.0


def test_summary_counts_agreement_with_the_full_cache_step_by_step():
    rows = [
        row(0, "full", "a", {"x": 1}),
        row(1, "full", "b", {"y": "Q"}),
        row(2, "full", "a", {"x": 2}),
        row(0, "m", "a", {"x": 1.0}),  # the same call
        row(1, "m", "b", {"y": "R"}),  # same tool, other arguments
        row(2, "m", None, None, budget_met=False),  # nothing parsed
    ]
    (full, method) = calls_summary(rows)
    assert method["same_tool_as_full"] == pytest.approx(2 / 3)
    assert method["same_call_as_full"] == pytest.approx(1 / 3)
    assert method["script_tool"] == pytest.approx(1 / 3) and method["script_call"] == pytest.approx(1 / 3)
    assert full["same_call_as_full"] == 1.0 and full["budget_met"] and not method["budget_met"]
    # Forced to the script's tool, the arguments are compared with the full cache's forced ones.
    assert method["forced_same_as_full"] == pytest.approx(1 / 3)
    assert method["script_values"] == pytest.approx(1 / 3)  # only step 0 writes x = 1


@pytest.fixture
def trace():
    return parse_call_trace(TRACE, where="shop")


def test_replay_asks_every_call_over_the_scripted_history(tiny_model, tiny_tokenizer, trace):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, METHODS["full"].config(None))
    rows = replay_calls(backend, trace, method="full", budget=1.0, events=False)
    assert [r.script_name for r in rows] == ["search_orders", "refund", "search_orders"]
    # The grammar makes every call parse.
    assert all(r.name in {"search_orders", "refund"} and r.args is not None for r in rows)
    # Each call attends everything before it: the listing makes the later prompts longer.
    assert rows[0].attended_tokens < rows[1].attended_tokens < rows[2].attended_tokens
    assert "calls:shop:full:1.0" not in backend  # the session is closed after the replay


def test_with_nothing_evicted_the_lifecycle_writes_the_full_caches_calls(tiny_model, tiny_tokenizer, trace):
    full = replay_calls(
        TransformersBackend(tiny_model, tiny_tokenizer, METHODS["full"].config(None)),
        trace,
        method="full",
        budget=1.0,
        events=False,
    )
    roomy = METHODS["agentkv-nohost"].config(100 * max(r.attended_tokens for r in full))
    managed = replay_calls(
        TransformersBackend(tiny_model, tiny_tokenizer, roomy),
        trace,
        method="agentkv-nohost",
        budget=100.0,
        events=True,
    )
    assert [r.call for r in managed] == [r.call for r in full]
    assert [r.forced_args for r in managed] == [r.forced_args for r in full]
    assert [r.attended_tokens for r in managed] == [r.attended_tokens for r in full]


def test_the_bench_holds_the_budget_and_writes_its_rows(tiny_model, tiny_tokenizer, tmp_path):
    path = tmp_path / "shop.json"
    path.write_text(json.dumps(TRACE), encoding="utf-8")
    result = run_calls_bench(
        tiny_model, tiny_tokenizer, traces=[str(path)], budgets=(0.25,), out_dir=tmp_path / "out"
    )
    written = json.loads((tmp_path / "out" / "calls.json").read_text(encoding="utf-8"))
    assert written["summary"] == result["summary"]
    (full, budgeted) = result["summary"]
    assert (full["method"], budgeted["method"], budgeted["budget"]) == ("full", "agentkv-nohost", 0.25)
    assert budgeted["calls"] == full["calls"] == 3
    assert budgeted["budget_met"]
    assert budgeted["device_mib"] < full["device_mib"]  # a quarter of the tokens, some of them at int4


def test_an_unbudgeted_method_is_refused_before_any_run(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="unknown or unbudgeted methods"):
        run_calls_bench(tiny_model, tiny_tokenizer, methods=("full",), traces=["nope"])
