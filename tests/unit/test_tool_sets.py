"""Issue 10 item 7: binding or unbinding tools mid-thread keeps the cached prefix.

A tool-bound agent node followed by an unbound answer node (and the reverse order,
and a different tool set per node) on one thread: each call reads everything
before it from the cache (nothing cropped), the thread's system prompt keeps the
tools block it started with, and the change is said in a note placed after the
call's last message. Answers stay right for their call: an unbound answer has no
tool call and no tag, a bound forced call names its tool.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from agentkv import AgentKVConfig, TransformersBackend
from agentkv_langchain import ChatAgentKV
from agentkv_langchain.toolset import NO_TOOLS_NOTE, RESTORED_NOTE
from agentkv_langgraph import with_kv_lifecycle

SYSTEM = SystemMessage("You are a helpful assistant.", id="sys")


def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


def get_code(name: str) -> str:
    """Look up a secret code by name."""
    return "4417"


def build(llm: ChatAgentKV, order: list[str], *, system: bool = True, choice: str = "get_weather") -> Any:
    """Nodes in `order`: "bound" (get_weather with `choice`), "tools" (answers every call), "answer"
    (no tools), "other" (a different tool set: forced get_code). `system`: SYSTEM leads each call."""
    bound = llm.bind_tools([get_weather], tool_choice=choice)
    other = llm.bind_tools([get_code], tool_choice="get_code")
    lead = [SYSTEM] if system else []

    def call(model: Any) -> Any:
        def node(state: MessagesState) -> dict[str, list[AnyMessage]]:
            return {"messages": [model.invoke([*lead, *state["messages"]])]}

        return node

    def tools(state: MessagesState) -> dict[str, list[AnyMessage]]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        calls = [*last.tool_calls, *last.invalid_tool_calls]
        return {"messages": [ToolMessage("sunny", tool_call_id=str(c["id"])) for c in calls]}

    nodes = {"bound": call(bound), "answer": call(llm), "other": call(other), "tools": tools}
    builder = StateGraph(MessagesState)
    names = []
    for i, kind in enumerate(order):
        name = f"{i}-{kind}"
        builder.add_node(name, nodes[kind])
        names.append(name)
    for a, b in zip([START, *names], [*names, END], strict=True):
        builder.add_edge(a, b)
    return builder.compile(checkpointer=InMemorySaver())


def run(
    tiny_model: Any, tiny_tokenizer: Any, order: list[str], turns: int = 2, **shape: Any
) -> tuple[TransformersBackend, list[AIMessage]]:
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    llm = ChatAgentKV(backend=backend, max_new_tokens=16)
    graph = with_kv_lifecycle(build(llm, order, **shape), backend=backend)
    config = {"configurable": {"thread_id": "t"}}
    for turn in range(turns):
        graph.invoke({"messages": [HumanMessage(f"What is the weather in Paris? ({turn})")]}, config)
    messages = graph.get_state(config).values["messages"]
    return backend, [m for m in messages if isinstance(m, AIMessage)]


def check_no_crop(answers: list[AIMessage]) -> None:
    for previous, answer in zip(answers, answers[1:], strict=False):
        meta = answer.response_metadata
        assert meta["cropped_tokens"] == 0, f"{answer.id}: cropped {meta['cropped_tokens']}"
        # Everything the previous call saw is read from the cache.
        assert (
            answer.usage_metadata["input_token_details"]["cache_read"]
            >= previous.usage_metadata["input_tokens"]
        )


def test_bound_then_unbound_keeps_the_prefix(tiny_model, tiny_tokenizer):
    backend, answers = run(tiny_model, tiny_tokenizer, ["bound", "tools", "answer"])
    check_no_crop(answers)
    calls, texts = answers[0::2], answers[1::2]
    assert all([c["name"] for c in [*a.tool_calls, *a.invalid_tool_calls]] == ["get_weather"] for a in calls)
    assert all(not a.tool_calls and not a.invalid_tool_calls and "<tool" not in a.text for a in texts)
    messages = backend.get("t").messages
    assert (
        messages[0].content.startswith("You are a helpful assistant.")
        and "get_weather" in messages[0].content
    )
    notes = [m.content for m in messages[1:] if m.role == "system"]
    assert notes == [NO_TOOLS_NOTE, RESTORED_NOTE, NO_TOOLS_NOTE]  # answer, agent again, answer


@pytest.mark.parametrize("choice", ["get_weather", "any", "auto"])
def test_bound_then_unbound_without_a_system_message_keeps_the_prefix(tiny_model, tiny_tokenizer, choice):
    # Most small graphs start with a user message: the tools block then gets a system message of its
    # own in front of it, on every call, and the "no tools" note after the tool result stays a note.
    backend, answers = run(
        tiny_model, tiny_tokenizer, ["bound", "tools", "answer"], system=False, choice=choice
    )
    check_no_crop(answers)
    assert backend.get("t").stats().cropped_tokens == 0
    messages = backend.get("t").messages
    assert messages[0].role == "system" and "get_weather" in messages[0].content
    assert messages[1].role == "user"
    notes = [m.content for m in messages[1:] if m.role == "system"]
    assert notes == [NO_TOOLS_NOTE, RESTORED_NOTE, NO_TOOLS_NOTE]


def test_unbound_then_bound_keeps_the_prefix(tiny_model, tiny_tokenizer):
    backend, answers = run(tiny_model, tiny_tokenizer, ["answer", "bound", "tools"])
    check_no_crop(answers)
    assert all(not a.tool_calls and not a.invalid_tool_calls for a in answers[0::2])
    assert all(
        [c["name"] for c in [*a.tool_calls, *a.invalid_tool_calls]] == ["get_weather"] for a in answers[1::2]
    )
    messages = backend.get("t").messages
    assert messages[0].content == "You are a helpful assistant."  # started without tools: no block
    notes = [m.content for m in messages[1:] if m.role == "system"]
    assert len(notes) == 3 and "get_weather" in notes[0] and notes[1] == NO_TOOLS_NOTE


def test_a_different_tool_set_per_node(tiny_model, tiny_tokenizer):
    backend, answers = run(tiny_model, tiny_tokenizer, ["bound", "tools", "other", "tools"], turns=1)
    check_no_crop(answers)
    assert [c["name"] for c in [*answers[1].tool_calls, *answers[1].invalid_tool_calls]] == ["get_code"]
    notes = [m.content for m in backend.get("t").messages[1:] if m.role == "system"]
    assert len(notes) == 1 and "get_code" in notes[0] and "get_weather" not in notes[0]


def test_the_same_question_again_with_other_tools_starts_over(tiny_model, tiny_tokenizer):
    # The standard suites ask one question on the shared "default" session with one tool set, then
    # the same question with another: the second call does not continue the first (its answer is
    # missing), so it starts over with the new tools in the system prompt, not a note after it.
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    llm = ChatAgentKV(backend=backend, max_new_tokens=16)
    question = [HumanMessage("Tell me a joke about cats.")]
    llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question)
    second = llm.bind_tools([get_code], tool_choice="get_code").invoke(question)
    messages = backend.get("default").messages
    assert messages[0].role == "system" and "get_code" in messages[0].content
    assert "get_weather" not in messages[0].content
    assert [m.role for m in messages] == ["system", "user", "assistant"]
    assert [c["name"] for c in [*second.tool_calls, *second.invalid_tool_calls]] == ["get_code"]


# A template with tool support that writes its own default system prompt when message 0 is not one
# (the Qwen2.5 shape): the tools travel with message 0, whatever its role.
TOOLS_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{% set lead = messages[0].content %}"
    "{%- else %}{% set lead = 'You are a default assistant.' %}{% endif %}"
    "<|im_start|>system\n{{ lead }}{% if tools %}\n\nTools: {{ tools | tojson }}{% endif %}<|im_end|>\n"
    "{%- for message in messages %}{% if not (loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{%- endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_tools_and_default_system_prompt_keep_the_prefix(tiny_model, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    backend, answers = run(tiny_model, tokenizer, ["bound", "tools", "answer"], turns=1, system=False)
    assert backend.chat_format.tools_in_template
    check_no_crop(answers)
    messages = backend.get("t").messages
    assert messages[0].role == "user" and messages[0].tools_json and "get_weather" in messages[0].tools_json
    assert [m.content for m in messages if m.role == "system"] == [NO_TOOLS_NOTE]
