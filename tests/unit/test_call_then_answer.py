"""`tool_use="call_then_answer"` forces a call where the thread needs one, and a long thread's way out.

The first request of a thread gets a forced call, a tool result gets a text answer,
and a later user turn is the model's to decide: a follow-up question is not a reason
to book the same room again. A thread that outgrows the model's positions fails
before encoding with `ContextLengthError`, which names LangChain's way out.
"""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, trim_messages
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from agentkv import AgentKVConfig, ContextLengthError, TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.planning import call_then_answer_choice
from agentkv_langchain.tools import ANY_TOOL


@tool
def book_room(room: str) -> str:
    """Book a hotel room by its number."""
    return f"room {room} booked"


TOOLS = [{"type": "function", "function": {"name": "book_room", "parameters": {"type": "object"}}}]


def test_a_call_is_forced_on_the_threads_first_request_only() -> None:
    first = [{"role": "user", "content": "Book room 12."}]
    assert call_then_answer_choice(first, TOOLS) == "book_room"  # "any" of one tool
    two = [*TOOLS, {"type": "function", "function": {"name": "cancel", "parameters": {"type": "object"}}}]
    assert call_then_answer_choice(first, two) == ANY_TOOL
    called = [
        *first,
        {"role": "assistant", "content": "", "tool_calls": [{"name": "book_room", "arguments": {}}]},
        {"role": "tool", "content": "room 12 booked", "tool_call_id": "c1"},
    ]
    assert call_then_answer_choice(called, TOOLS) == "none"  # answer from the result
    answered = [*called, {"role": "assistant", "content": "Booked."}]
    follow_up = [*answered, {"role": "user", "content": "When is check-out?"}]
    assert call_then_answer_choice(follow_up, TOOLS) is None  # the model decides


def test_create_agent_books_once_over_three_turns(tiny_model, tiny_tokenizer) -> None:
    from langchain.agents import create_agent

    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    llm = ChatAgentKV(backend=backend, max_new_tokens=24, tool_use="call_then_answer")
    agent = create_agent(llm, [book_room], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "hotel"}, "recursion_limit": 8}
    forced_turns = []
    for text in ("Book room 12.", "Is breakfast included?", "When is check-out?"):
        out = agent.invoke({"messages": [HumanMessage(text)]}, config)
        last_user = max(i for i, m in enumerate(out["messages"]) if isinstance(m, HumanMessage))
        turn = out["messages"][last_user:]
        forced_turns.append(isinstance(turn[1], AIMessage) and bool(turn[1].tool_calls))
        assert isinstance(out["messages"][-1], AIMessage) and not out["messages"][-1].tool_calls
    assert forced_turns[0]  # the first request: a call, then an answer from its result
    results = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    # The tiny random model, left to decide, answers in text: one booking, not three.
    assert len(results) == 1 and forced_turns[1:] == [False, False]


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
