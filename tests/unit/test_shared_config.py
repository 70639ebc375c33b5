"""`ChatAgentKV(config=...)` on the process-wide backend gets its settings, whoever loaded the model first.

The shared backend is keyed by model, device and dtype; a `ChatAgentKV()` made
earlier in the process fixes the backend's default settings. A later
`ChatAgentKV(config=...)` must still run its sessions with its own budget and policy
(per-session settings, as `configurable.agentkv` applies them), and a session that
already exists with other settings is reported, not silently reused.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

import agentkv_langchain.backends as backends
from agentkv import AgentKVConfig
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph import with_kv_lifecycle

ASKED = {"budget": {"device_tokens": 48}, "policy": "window", "archive_tier": "drop"}


@pytest.fixture()
def fresh_shared(monkeypatch, tiny_model, tiny_tokenizer) -> None:
    """An empty process-wide backend table whose loads give the tiny model."""
    monkeypatch.setattr(backends, "_backends", {})
    monkeypatch.setattr(backends, "load_model", lambda *a, **k: (tiny_model, tiny_tokenizer))


def graph_of(llm: ChatAgentKV) -> Any:
    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [llm.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    return with_kv_lifecycle(builder.compile(checkpointer=InMemorySaver()), backend=llm.backend)


def test_later_config_gets_its_own_settings_on_the_shared_backend(fresh_shared) -> None:
    first = ChatAgentKV(max_new_tokens=2)
    asked = ChatAgentKV(config=ASKED, max_new_tokens=2)
    assert asked.backend is first.backend  # one loaded model
    assert first.backend.config == AgentKVConfig()  # the first caller's defaults

    graph_of(first).invoke({"messages": [HumanMessage("hi")]}, {"configurable": {"thread_id": "plain"}})
    out = graph_of(asked).invoke({"messages": [HumanMessage("hi")]}, {"configurable": {"thread_id": "mine"}})
    assert isinstance(out["messages"][-1], AIMessage)

    mine = asked.backend.get("mine")
    assert mine.config.budget.device_tokens == 48
    assert mine.config.policy.name == "window"
    assert mine.config.archive_tier == "drop"
    assert mine.limits.device_bytes is not None  # the lifecycle enforces what was asked
    assert first.backend.get("plain").config == AgentKVConfig()


def test_same_settings_as_the_backend_create_plain_sessions(fresh_shared) -> None:
    ChatAgentKV()
    same = ChatAgentKV(config=AgentKVConfig(), max_new_tokens=2)
    same.invoke([HumanMessage("hi")], {"metadata": {"thread_id": "same"}})
    assert same.backend.get("same").config is same.backend.config


def test_existing_session_with_other_settings_is_reported(fresh_shared, caplog) -> None:
    plain = ChatAgentKV(max_new_tokens=2)
    plain.invoke([HumanMessage("hi")], {"metadata": {"thread_id": "t"}})
    asked = ChatAgentKV(config=ASKED, max_new_tokens=2)
    with caplog.at_level(logging.WARNING, logger="agentkv.langchain"):
        asked.invoke([HumanMessage("hi")], {"metadata": {"thread_id": "t"}})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("session 't' already exists with other agentkv settings" in w for w in warnings)
    assert any("backend.close('t')" in w for w in warnings)
