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
from agentkv.models import MANIFEST_NAME
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


def test_a_later_chat_template_is_refused_not_silently_ignored(fresh_shared) -> None:
    first = ChatAgentKV(max_new_tokens=2)
    with pytest.raises(ValueError, match="agentkv.chat is backend-wide"):
        ChatAgentKV(config={"chat": {"template": "llama3"}}, max_new_tokens=2)
    with pytest.raises(ValueError, match="agentkv.chat is backend-wide"):
        with_kv_lifecycle(graph_of(first), backend=first.backend, config={"chat": {"template": "llama3"}})
    same = ChatAgentKV(config={"chat": {}}, max_new_tokens=2)  # asks for the backend's own format
    assert same.backend is first.backend


def test_chat_cannot_change_per_run(fresh_shared, caplog) -> None:
    llm = ChatAgentKV(max_new_tokens=2)
    graph = graph_of(llm)
    run = {"configurable": {"thread_id": "t", "agentkv": {"chat": {"template": "llama3"}}}}
    with caplog.at_level(logging.WARNING, logger="agentkv.langgraph"):
        graph.invoke({"messages": [HumanMessage("hi")]}, run)
    assert any("chat cannot change per run" in r.getMessage() for r in caplog.records)
    assert llm.backend.get("t").config.chat == llm.backend.config.chat


def test_a_session_config_with_backend_wide_settings_is_warned_once(
    tiny_model: Any, tiny_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from agentkv import TransformersBackend

    backend = TransformersBackend(tiny_model, tiny_tokenizer)
    own = AgentKVConfig.from_dict(
        {"budget": {"device_tokens": 48}, "sessions": {"max_live": 1}, "chat": {"template": "llama3"}}
    )
    with caplog.at_level(logging.WARNING, logger="agentkv.backend"):
        session = backend.session("a", config=own)
        backend.session("b", config=own)
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1
    assert "agentkv.sessions" in warnings[0] and "agentkv.chat.template" in warnings[0]
    assert "budget" not in warnings[0]  # a session's own setting, honoured
    assert session.limits.device_bytes is not None
    quiet = AgentKVConfig.from_dict({"budget": {"device_tokens": 48}, "prefix_cache": {"enabled": False}})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentkv.backend"):
        backend.session("c", config=quiet)
    assert not caplog.records


def test_loading_settings_that_do_not_match_the_model_passed_are_warned(
    tiny_model: Any, tiny_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from agentkv import TransformersBackend

    kernel = tiny_model.config._attn_implementation  # as the fixture's model was built (eager or sdpa)
    asked = "eager" if kernel != "eager" else "sdpa"
    other = AgentKVConfig.from_dict(
        {"model": "/tmp/other_model", "dtype": "float16", "device": "cuda:3", "attn_implementation": asked}
    )
    with caplog.at_level(logging.WARNING, logger="agentkv.backend"):
        TransformersBackend(tiny_model, tiny_tokenizer, other)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "agentkv.model='/tmp/other_model' ignored" in warning
    assert "agentkv.dtype='float16' ignored, the model passed runs torch.float32" in warning
    assert "agentkv.device='cuda:3' ignored, the model passed is on cpu" in warning
    assert f"agentkv.attn_implementation='{asked}' ignored, the model passed uses {kernel!r}" in warning

    caplog.clear()
    same = AgentKVConfig.from_dict({"dtype": "float32", "device": "cpu", "attn_implementation": kernel})
    with caplog.at_level(logging.WARNING, logger="agentkv.backend"):
        TransformersBackend(tiny_model, tiny_tokenizer, same)
        TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"dtype": "auto"}))
    assert not caplog.records


def test_a_loaded_model_matches_the_name_it_was_loaded_by(
    tiny_model: Any, tiny_tokenizer: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import copy

    from agentkv import TransformersBackend

    named = copy.copy(tiny_model)
    named.config = copy.deepcopy(tiny_model.config)
    named.config.name_or_path = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="agentkv.backend"):
        TransformersBackend(named, tiny_tokenizer, AgentKVConfig(model=str(tmp_path)))
        TransformersBackend(named, tiny_tokenizer, AgentKVConfig(model=f"{tmp_path}/../{tmp_path.name}"))
        (tmp_path / MANIFEST_NAME).write_text('{"source": "/models/tiny.gguf"}', encoding="utf-8")
        TransformersBackend(
            named, tiny_tokenizer, AgentKVConfig(model="/models/tiny.gguf")
        )  # a converted GGUF
    assert not caplog.records
