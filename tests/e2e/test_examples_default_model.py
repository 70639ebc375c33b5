"""Each example once on the default model (SmolLM2-135M-Instruct): real answers, real tool calls."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agentkv import AgentKVConfig, TransformersBackend

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default_model() -> Iterator[tuple[Any, Any]]:
    from agentkv import load_model

    yield load_model()


@pytest.fixture()
def backend(default_model) -> TransformersBackend:
    model, tokenizer = default_model
    return TransformersBackend(model, tokenizer, AgentKVConfig())


def test_tool_assistant_on_the_default_model(example, backend):
    result = example("tool_assistant").main(backend, turns=10, max_new_tokens=24)
    # Forced tool choice: the 135M model writes parseable calls, but one in the ten turns. Since
    # tool_choice="none" lets it write its text answer after a tool result (it used to be cut at a
    # started <tool_call>, leaving content=''), later forced calls read a different history, and in
    # one of them it fills the arguments unparseably; the demo repairs that call with the defaults.
    assert result["repaired"] <= 1
    assert result["handler_errors"] == 0
    by_owner = {s["owner"]: s for s in result["spans"]}
    completed = [t for _, name, t in result["events"] if name == "ToolCallCompleted"]
    failed = [t for _, name, t in result["events"] if name == "ToolCallFailed"]
    assert len(completed) == 5 and len(failed) == 1
    assert all(by_owner[c]["state"] == "committed" for c in completed)
    # The failed lookup's error text is kept like a result (an observation); its call is released.
    assert by_owner[failed[0]]["kind"] == "tool_result" and by_owner[failed[0]]["state"] == "committed"
    assert all(s["state"] in ("evictable", "evicted") for s in result["spans"] if s["kind"] == "tool_call")
    # Each call encodes only what is new: far less than re-encoding each call's whole history.
    encoded = sum(c["prefill_tokens"] for c in result["calls"])
    histories = sum(c["prefill_tokens"] + c["reused_tokens"] for c in result["calls"])
    assert encoded * 3 < histories


def test_plan_confirm_on_the_default_model(example, backend):
    result = example("plan_confirm").main(backend, max_new_tokens=24)
    rejected, approved = result["plans"]
    assert result["states"][rejected]["state"] in ("evictable", "evicted")
    assert result["states"][approved] == {"state": "committed", "tier": "device", "pinned": True}
    assert result["answer"]
    assert result["handler_errors"] == 0


def test_tree_of_thought_on_the_default_model(example, backend):
    """Plain `Send` on SmolLM2: prefix shared, losers freed, adoption saves the winner's prefill."""
    module = example("tree_of_thought")
    adopted = module.main(backend, k=3, max_new_tokens=16, thread_id="tot-adopt")
    plain = module.main(backend, k=3, max_new_tokens=16, thread_id="tot-plain", adopt=False)
    memory = adopted["memory"]
    own = sum(memory["branch_own_bytes"].values())
    assert memory["alive_bytes"] == memory["prefix_bytes"] + own + memory["cached_prefix_bytes"]
    assert memory["alive_bytes"] < memory["copied_prefix_bytes"]
    for result in (adopted, plain):
        assert result["memory"]["branch_bytes_after_run"] == {b: 0 for b in result["branches"]}
        assert result["handler_errors"] == 0
    assert len(adopted["adopted"]) == 1 and not plain["adopted"]
    assert adopted["answer"] == plain["answer"]  # adopted KV answers as re-encoded KV does
    assert adopted["answer_prefill"] < plain["answer_prefill"]
    assert (adopted["answer"] or "").strip()


def test_plain_langchain_on_the_default_model(example, backend):
    result = example("plain_langchain").main(backend, max_new_tokens=12)
    by_owner = {s["owner"]: s for s in result["spans"]}
    for call_id in result["tool_calls"]:
        # A failed call's error text is kept like a result; the calls themselves are released.
        assert by_owner[call_id]["kind"] == "tool_result" and by_owner[call_id]["state"] == "committed"
    assert any(a.strip() for a in result["answers"])  # "none" stops an answer that starts a call
    assert result["handler_errors"] == 0
