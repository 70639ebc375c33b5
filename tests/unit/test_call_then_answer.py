"""`tool_use="call_then_answer"` forces a call where the thread needs one, and a long thread's way out.

A user turn gets a forced call and a tool result a text answer; a forced call that
repeats one whose result the thread already holds is answered from that result
instead: a follow-up question is not a reason to fetch the same log again. A thread
that outgrows the model's positions fails before encoding with `ContextLengthError`,
which names LangChain's way out.
"""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, trim_messages
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from agentkv import AgentKVConfig, ContextLengthError, TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.planning import call_then_answer_choice, repeated_calls
from agentkv_langchain.tools import ANY_TOOL


@tool
def fetch_log() -> str:
    """Fetch the deployment log."""
    return "deploy 41 failed: disk full on node 3"


TOOLS = [{"type": "function", "function": {"name": "fetch_log", "parameters": {"type": "object"}}}]


def test_a_user_turn_gets_a_call_and_a_tool_result_an_answer() -> None:
    first = [{"role": "user", "content": "Why did the deploy fail?"}]
    assert call_then_answer_choice(first, TOOLS) == "fetch_log"  # "any" of one tool
    two = [*TOOLS, {"type": "function", "function": {"name": "book", "parameters": {"type": "object"}}}]
    assert call_then_answer_choice(first, two) == ANY_TOOL
    called = [*first, {"role": "tool", "content": "deploy 41 failed", "tool_call_id": "c1"}]
    assert call_then_answer_choice(called, TOOLS) == "none"


def test_a_call_is_repeated_only_when_its_result_is_not_in_the_thread() -> None:
    booked = [
        HumanMessage("Book room 12."),
        AIMessage("", tool_calls=[{"id": "c1", "name": "book_room", "args": {"room": "12", "nights": 2}}]),
        ToolMessage("room 12 booked", tool_call_id="c1"),
        AIMessage("Booked."),
        HumanMessage("Is breakfast included?"),
    ]
    same = [{"name": "book_room", "args": {"nights": 2, "room": "12"}}]  # key order does not matter
    assert repeated_calls(booked, same)
    assert not repeated_calls(booked, [{"name": "book_room", "args": {"room": "14", "nights": 2}}])
    assert not repeated_calls(booked, [*same, {"name": "fetch_log", "args": {}}])
    unanswered = booked[:2]  # a call with no result yet is not one to answer from
    assert not repeated_calls(unanswered, same) and not repeated_calls(booked, [])


def test_create_agent_fetches_the_log_once_for_its_follow_ups(tiny_model, tiny_tokenizer) -> None:
    from langchain.agents import create_agent

    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    llm = ChatAgentKV(backend=backend, max_new_tokens=24, tool_use="call_then_answer")
    agent = create_agent(llm, [fetch_log], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "ops"}, "recursion_limit": 8}
    for text in ("Why did the deploy fail?", "Which node was it?", "What should I free up?"):
        out = agent.invoke({"messages": [HumanMessage(text)]}, config)
        final = out["messages"][-1]
        assert isinstance(final, AIMessage) and not final.tool_calls  # text (the random model's noise)
    messages = out["messages"]
    assert sum(isinstance(m, ToolMessage) for m in messages) == 1  # one fetch, three answers
    assert sum(isinstance(m, AIMessage) and bool(m.tool_calls) for m in messages) == 1
    backend.get("ops").check()  # the discarded repeat left the session consistent


def test_a_thread_past_the_models_positions_names_the_way_out(tiny_tokenizer) -> None:
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    backend = TransformersBackend(model, tiny_tokenizer, AgentKVConfig(policy="full"))
    llm = ChatAgentKV(backend=backend, max_new_tokens=8)
    run = {"metadata": {"thread_id": "long"}}
    history: list = []
    with pytest.raises(ContextLengthError) as caught:
        for i in range(40):
            history.append(HumanMessage(f"note {i}: the user asked about the weather in Paris"))
            history.append(llm.invoke(history, run))
    error = caught.value
    assert isinstance(error, ValueError) and error.limit == 256 and error.total > 256
    assert "SummarizationMiddleware" in str(error) and "trim_messages" in str(error)
    # The way out works on the same thread: trimmed, the history fits and the call answers.
    trimmed = trim_messages(history, max_tokens=128, token_counter=llm, start_on="human")
    assert isinstance(llm.invoke(trimmed, run), AIMessage)
