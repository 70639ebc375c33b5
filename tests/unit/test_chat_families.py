"""Every fixture family's published chat template, end to end on a tiny random model.

For each family (tests/fixtures/chat_templates, tokenizers with the family's special
tokens from `chat_families`): a six-turn LangGraph tool agent through `ChatAgentKV`
(system prompt, two user turns, forced and "any" calls, tool results, a structured
output call, text answers). Every follow-up call reads the whole earlier history from
the cache; forced and "any" calls parse and validate in the family's own format; text
answers hold no call.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from chat_families import FAMILIES, Family, family_tokenizer
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from pydantic import BaseModel, Field

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.chat import normalize_messages
from agentkv.templates import ChatFormat
from agentkv_langchain import ChatAgentKV
from tests.conftest import tiny_llama_config


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@tool
def get_time(zone: str, hour24: bool = True) -> str:
    """The time in a time zone."""
    return f"12:00 in {zone}"


class Trip(BaseModel):
    """A trip plan."""

    city: str = Field(description="Where to go")
    days: int = Field(ge=1, le=30, description="How many days")


TOOLS = {"get_weather": get_weather, "get_time": get_time}


def family_backend(family: Family) -> TransformersBackend:
    from transformers import LlamaForCausalLM

    tokenizer = family_tokenizer(family)
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=8192,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval().to(torch.float32)
    model.requires_grad_(False)
    return TransformersBackend(model, tokenizer, AgentKVConfig(policy="full"))


def agent_graph(llm: ChatAgentKV) -> Any:
    """Model calls in a fixed order (turn by turn), tools run by a tool node."""
    plan = [
        llm.bind_tools([get_weather, get_time], tool_choice="get_weather"),  # forced, named
        llm.bind_tools([get_weather, get_time], tool_choice="any"),  # forced, model's pick
        llm.bind_tools([get_weather, get_time], tool_choice="none"),  # text
        llm.bind_tools([get_weather, get_time], tool_choice="any"),  # second user turn
        llm.with_structured_output(Trip, include_raw=True),  # structured output
        llm.bind_tools([get_weather, get_time], tool_choice="none"),  # text
    ]
    step = {"n": 0}

    def agent(state: MessagesState) -> dict[str, Any]:
        runnable = plan[step["n"]]
        step["n"] += 1
        out = runnable.invoke(state["messages"])
        if isinstance(out, dict):  # structured output: the raw call, answered, then the parsed object
            raw: AIMessage = out["raw"]
            assert out["parsing_error"] is None and isinstance(out["parsed"], Trip)
            call = raw.tool_calls[0]
            return {"messages": [raw, ToolMessage(json.dumps(call["args"]), tool_call_id=call["id"])]}
        return {"messages": [out]}

    def tools(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        results = [
            ToolMessage(str(TOOLS[c["name"]].invoke(c["args"])), tool_call_id=c["id"], name=c["name"])
            for c in last.tool_calls
        ]
        return {"messages": results}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        if isinstance(last, ToolMessage):  # the structured output's call, answered: go on
            return "agent"
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", "agent", END])
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_a_tool_agent_runs_on_the_family_template_and_reuses_the_cache(family: Family) -> None:
    backend = family_backend(family)
    fmt = backend.chat_format
    assert fmt.tool_format.name == family.tool_format
    assert (fmt.reasoning is not None) == family.reasoning
    llm = ChatAgentKV(backend=backend, max_new_tokens=96)
    calls: list[AIMessage] = []
    original = ChatAgentKV._generate

    def recording(self: ChatAgentKV, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        calls.append(result.generations[0].message)
        return result

    ChatAgentKV._generate = recording  # type: ignore[method-assign]
    try:
        graph = agent_graph(llm)
        config = {"configurable": {"thread_id": f"t-{family.name}"}, "recursion_limit": 30}
        first = [SystemMessage("You are a travel helper."), HumanMessage("Weather and time in Paris?")]
        graph.invoke({"messages": first}, config)
        graph.invoke({"messages": [HumanMessage("Plan a trip to Rome.")]}, config)
    finally:
        ChatAgentKV._generate = original  # type: ignore[method-assign]

    assert len(calls) == 6
    forced = [calls[0], calls[1], calls[3], calls[4]]
    for message in forced:  # parsed in the family's format, arguments valid for the schema
        assert message.tool_calls and not message.invalid_tool_calls, message
        for call in message.tool_calls:
            schema = {"get_weather": get_weather, "get_time": get_time}.get(call["name"])
            if schema is not None:
                schema.args_schema.model_validate(call["args"])  # type: ignore[union-attr]
            else:
                Trip.model_validate(call["args"])
    assert calls[0].tool_calls[0]["name"] == "get_weather"
    for message in (calls[2], calls[5]):  # text answers hold no call
        assert not message.tool_calls and not message.invalid_tool_calls
        assert not fmt.tool_format.parse(str(message.content)).calls
    for before, after in zip(calls, calls[1:], strict=False):
        # The whole earlier history (the previous prompt and its answer) was read from the cache.
        assert after.response_metadata["cropped_tokens"] == 0, family.name
        read = after.usage_metadata["input_token_details"]["cache_read"]  # type: ignore[index]
        # (the answer's last token is encoded with its end of turn, in the next call)
        assert read >= before.usage_metadata["input_tokens"] + before.usage_metadata["output_tokens"] - 1  # type: ignore[index]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_the_template_splits_a_conversation_into_its_messages(family: Family) -> None:
    fmt = ChatFormat(family_tokenizer(family))
    history = normalize_messages(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "a1b2c3d4e", "name": "w", "args": {"c": 1}}],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "a1b2c3d4e"},
            {"role": "assistant", "content": "  It is sunny.  "},
            {"role": "user", "content": "Thanks!"},
        ]
    )
    texts = fmt.message_texts(history)
    assert len(texts) == len(history)
    assert "".join(texts) == fmt.history_text(history)
    prompt = fmt.render(history, add_generation_prompt=True)
    assert prompt == fmt.history_text(history) + fmt.generation_prompt(history)
    # The end of an assistant turn is found whatever the template does to content (`trim`).
    assert fmt.assistant_suffix() and fmt.assistant_suffix() in fmt.history_text(history[:5])


def test_a_tight_budget_closes_a_mistral_call() -> None:
    backend = family_backend(next(f for f in FAMILIES if f.name == "mistral-nemo"))
    llm = ChatAgentKV(backend=backend, max_new_tokens=48).bind_tools([get_weather], tool_choice="get_weather")
    answer = llm.invoke([HumanMessage("Weather in Paris?")])
    # A 48-token budget holds the call (prefilled opening, arguments, a nine-character id): it closes in it.
    assert [call["name"] for call in answer.tool_calls] == ["get_weather"]
    assert isinstance(answer.tool_calls[0]["args"]["city"], str)
    assert answer.tool_calls[0]["id"].isalnum() and len(answer.tool_calls[0]["id"]) == 9


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_a_user_turn_right_after_a_tool_result_renders_on_every_template(family: Family) -> None:
    """No answer between the result and the next question (an interjection, a human review)."""
    fmt = ChatFormat(family_tokenizer(family))
    history = normalize_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "a1b2c3d4e", "name": "w", "args": {"c": 1}}],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "a1b2c3d4e"},
            {"role": "user", "content": "And tomorrow in Lyon?"},
        ]
    )
    texts = fmt.message_texts(history)
    assert len(texts) == len(history)
    assert "".join(texts) == fmt.history_text(history)
    assert "sunny" in fmt.history_text(history) and "And tomorrow in Lyon?" in texts[3]
