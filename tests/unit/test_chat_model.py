"""`ChatAgentKV` on the tiny random Llama: reuse across calls, tool calling, streaming, sessions.

The tiny model writes noise, so tests check mechanics (what is encoded, what is
reused, what the message carries), never answer quality. Decoding is greedy, so the
same conversation gives the same text on every path (invoke, stream, async).
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

import agentkv_langchain.calls as calls_module
from agentkv import AgentKVConfig, Session, TransformersBackend
from agentkv.spans import SpanKind
from agentkv_langchain import ChatAgentKV, parse_tool_calls, render_tool_prompt
from agentkv_langchain.chat_models import to_chat_dicts
from agentkv_langchain.sessions import SessionKey, session_for
from agentkv_langchain.tools import (
    ANY_TOOL,
    TOOL_CALL_OPEN,
    CallEnd,
    ToolCallStreamFilter,
    forced_call_prefix,
    resolve_tool_choice,
)

NEW_TOKENS = 16
"""Enough for the shortest forced call of these tools on the tiny tokenizer (a shorter budget is refused)."""
HISTORY = [
    SystemMessage("You are a helpful assistant.", id="sys"),
    HumanMessage("The secret code is 4417. What is the weather in Paris?", id="h1"),
]


def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


def get_code(name: str) -> str:
    """Look up a secret code by name."""
    return "4417"


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))


@pytest.fixture()
def llm(backend) -> ChatAgentKV:
    return ChatAgentKV(backend=backend, max_new_tokens=NEW_TOKENS)


def on_thread(thread: str) -> dict:
    return {"metadata": {"thread_id": thread}}


def pending(session: Session) -> int:
    """Tokens the session holds but has not encoded yet (the end of the last answer)."""
    return sum(span.length - span.n_computed for span in session.spans)


# ---------------------------------------------------------------------------- reuse and usage


def test_second_call_prefills_only_the_new_message(llm, backend):
    first = llm.invoke(HISTORY)
    session = backend.get("default")
    history_after_first = session.logical_length
    tail = pending(session)

    second = llm.invoke([*HISTORY, first, HumanMessage("And the code?", id="h2")])

    usage = second.usage_metadata
    meta = second.response_metadata
    assert usage is not None
    # Everything the first call encoded is read back, nothing re-encoded; the first answer's
    # pending end (its last token and end of turn) is encoded now, so it is not a cache read.
    read = history_after_first - tail
    assert usage["input_token_details"]["cache_read"] == read == meta["reused_tokens"]
    assert meta["cropped_tokens"] == 0
    # Encoded now: the first answer's pending end + the new message + the generation prompt.
    assert meta["prefill_tokens"] == usage["input_tokens"] - read
    new_user = next(s for s in session.spans if s.owner == "h2")
    assert new_user.kind is SpanKind.USER
    # Time to first token: within the call, measured where the token is decoded.
    assert isinstance(meta["time_to_first_token_s"], float) and meta["time_to_first_token_s"] > 0
    session.check()


def test_usage_metadata_counts_history_and_answer(llm, backend):
    result = llm.invoke(HISTORY)
    session = backend.get("default")
    stats = session.stats()
    usage = result.usage_metadata
    assert usage is not None
    assert usage["output_tokens"] == stats.generated_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # A fresh session encodes its whole input: all of it is prefill, none cache.
    assert usage["input_tokens"] == stats.prefill_tokens == result.response_metadata["prefill_tokens"]
    assert usage["input_token_details"] == {"cache_read": 0}
    answer = session.spans[-1]
    suffix = len(backend.chat_format.assistant_suffix_ids())
    assert usage["input_tokens"] == answer.end - usage["output_tokens"] - suffix
    assert result.response_metadata["model_name"] == llm.model_name
    assert result.response_metadata["session_id"] == "default"
    assert result.response_metadata["finish_reason"] in {"stop", "length"}
    assert result.id is not None and answer.owner == result.id


def test_get_num_tokens_counts_what_the_session_encodes(llm, backend):
    session = backend.session("count")
    session.extend(to_chat_dicts(HISTORY))
    assert llm.get_num_tokens_from_messages(list(HISTORY)) == session.logical_length
    with_tools = llm.get_num_tokens_from_messages(list(HISTORY), tools=[get_weather])
    assert with_tools > session.logical_length


# ---------------------------------------------------------------------------- streaming and async


def test_stream_concatenates_to_invoke(llm):
    invoked = llm.invoke(HISTORY, config=on_thread("invoke"))
    chunks = list(llm.stream(HISTORY, config=on_thread("stream")))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == invoked.text
    assert chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.usage_metadata == invoked.usage_metadata
    assert full.id == chunks[0].id


def test_async_invoke_and_stream(llm):
    invoked = llm.invoke(HISTORY, config=on_thread("sync"))

    async def run() -> tuple[AIMessage, list[AIMessageChunk]]:
        answer = await llm.ainvoke(HISTORY, config=on_thread("ainvoke"))
        chunks = [chunk async for chunk in llm.astream(HISTORY, config=on_thread("astream"))]
        return answer, chunks

    answer, chunks = asyncio.run(run())
    assert answer.text == invoked.text
    assert "".join(c.text for c in chunks) == invoked.text
    assert chunks[-1].chunk_position == "last"


def test_async_stream_abandoned_midway_frees_the_session(llm, backend):
    async def first_chunk_only() -> None:
        async for _ in llm.astream(HISTORY, config=on_thread("t")):
            break

    asyncio.run(first_chunk_only())
    # The lock was released by the thread that took it: another call on the session works.
    assert llm.invoke(HISTORY, config=on_thread("t")).response_metadata["session_id"] == "t"
    backend.get("t").check()


# ---------------------------------------------------------------------------- tool calling


def test_tool_prompt_is_added_to_the_system_message_deterministically(llm, backend):
    tooled = llm.bind_tools([get_weather, get_code])
    tooled.invoke(HISTORY)
    session = backend.get("default")
    system = session.messages[0]
    schemas = [tooled.kwargs["tools"][0], tooled.kwargs["tools"][1]]  # type: ignore[attr-defined]
    assert system.content == "You are a helpful assistant.\n\n" + render_tool_prompt(schemas)
    again = tooled.invoke(HISTORY)
    # Same tools, same system prompt: the whole history is a cache hit.
    assert again.response_metadata["cropped_tokens"] > 0  # only the previous answer is replaced
    assert again.usage_metadata is not None
    assert again.usage_metadata["input_token_details"]["cache_read"] == sum(
        s.length for s in session.spans[:2]
    )


def test_tool_prompt_becomes_a_system_message_when_there_is_none(llm, backend):
    llm.bind_tools([get_weather]).invoke([HumanMessage("weather?")])
    messages = backend.get("default").messages
    assert messages[0].role == "system" and messages[0].content.startswith("You can call tools")
    assert messages[1].role == "user"


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("get_code", "get_code"),
        ({"type": "function", "function": {"name": "get_code"}}, "get_code"),
    ],
)
def test_forced_tool_choice_names_the_tool(llm, tool_choice, expected):
    result = llm.bind_tools([get_weather, get_code], tool_choice=tool_choice).invoke(HISTORY)
    # The tiny model's arguments are noise: the call is valid or invalid, but it is there, named.
    calls = [*result.tool_calls, *result.invalid_tool_calls]
    assert len(calls) == 1
    assert calls[0]["name"] == expected
    assert calls[0]["id"] and calls[0]["id"].startswith("call_")
    assert result.text == ""


def test_tool_choice_none_never_calls(llm):
    result = llm.bind_tools([get_weather], tool_choice="none").invoke(HISTORY)
    assert not result.tool_calls and not result.invalid_tool_calls
    assert TOOL_CALL_OPEN not in result.text


def test_bind_tools_rejects_unknown_choice_listing_allowed(llm):
    with pytest.raises(ValueError, match="get_weather") as info:
        llm.bind_tools([get_weather], tool_choice="nope")
    assert "auto" in str(info.value) and "nope" in str(info.value)


def test_streamed_tool_call_matches_invoke(llm):
    tooled = llm.bind_tools([get_weather], tool_choice="any")
    invoked = tooled.invoke(HISTORY, config=on_thread("a"))
    chunks = list(tooled.stream(HISTORY, config=on_thread("b")))
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.text == invoked.text == ""
    assert [c["name"] for c in full.tool_calls + full.invalid_tool_calls] == ["get_weather"]
    assert [c["args"] for c in full.tool_calls] == [c["args"] for c in invoked.tool_calls]


@pytest.fixture()
def valid_calls(monkeypatch):
    """A model that always writes well-formed calls: invalid calls from the tiny model become valid.

    The tiny model's arguments are noise; what is tested here (binding the answer,
    matching it on the next call) does not depend on them.
    """
    real = calls_module.parse_tool_calls

    def parse(text: str, *fmt: object):
        content, calls, invalid = real(text, *fmt)
        repaired = [
            {"name": c["name"], "args": {"city": "Paris"}, "id": c["id"], "type": "tool_call"}
            for c in invalid
        ]
        return content, [*calls, *repaired], []

    monkeypatch.setattr(calls_module, "parse_tool_calls", parse)


def test_answer_with_tool_calls_is_matched_on_the_next_call(llm, backend, valid_calls):
    tooled = llm.bind_tools([get_weather], tool_choice="get_weather")
    call = tooled.invoke(HISTORY)
    assert [c["name"] for c in call.tool_calls] == ["get_weather"]
    session = backend.get("default")
    answer = session.spans[-1]
    assert answer.kind is SpanKind.TOOL_CALL and answer.owner == call.id
    history_after_call = session.logical_length
    tail = pending(session)

    result = ToolMessage("sunny", tool_call_id=call.tool_calls[0]["id"])
    follow_up = tooled.invoke([*HISTORY, call, result])

    usage = follow_up.usage_metadata
    assert usage is not None
    assert usage["input_token_details"]["cache_read"] == history_after_call - tail
    assert follow_up.response_metadata["cropped_tokens"] == 0
    # Only the tool result, the call's pending end and the new prompt were encoded.
    assert follow_up.response_metadata["prefill_tokens"] == usage["input_tokens"] - history_after_call + tail
    result_span = next(s for s in session.spans if s.kind is SpanKind.TOOL_RESULT)
    assert result_span.owner == call.tool_calls[0]["id"]
    session.check()


def test_tool_message_span_is_owned_by_its_tool_call_id(llm, backend):
    conversation = [
        *HISTORY,
        AIMessage(
            "", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_abc"}], id="ai1"
        ),
        ToolMessage("sunny", tool_call_id="call_abc", id="tool1"),
    ]
    llm.bind_tools([get_weather]).invoke(conversation)
    spans = backend.get("default").spans
    call = next(s for s in spans if s.owner == "ai1")
    result = next(s for s in spans if s.kind is SpanKind.TOOL_RESULT)
    assert call.kind is SpanKind.TOOL_CALL
    assert result.owner == "call_abc"


def test_history_with_tool_use_blocks_and_v1_content(llm):
    # Anthropic-style content with a tool_use block, as the standard suite sends it.
    conversation = [
        HumanMessage("What is 1 + 2"),
        AIMessage(
            [
                {"type": "text", "text": "some text"},
                {"type": "tool_use", "id": "abc", "name": "add", "input": {}},
            ],
            tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "abc", "type": "tool_call"}],
        ),
        ToolMessage(json.dumps({"result": 3}), tool_call_id="abc"),
    ]
    assert isinstance(llm.invoke(conversation), AIMessage)
    assert to_chat_dicts(conversation)[1]["content"] == "some text"


def test_media_content_is_refused_with_allowed_blocks(llm):
    image = HumanMessage([{"type": "text", "text": "look"}, {"type": "image", "url": "https://x/y.png"}])
    with pytest.raises(ValueError, match="'image' block") as info:
        llm.invoke([image])
    assert "text" in str(info.value)


def test_unknown_call_argument_and_other_model_are_refused(llm):
    with pytest.raises(ValueError, match="unknown call argument") as info:
        llm.invoke(HISTORY, frequency_penalty=1.0)
    assert "temperature" in str(info.value)
    with pytest.raises(ValueError, match="in-process model"):
        llm.invoke(HISTORY, model="gpt-4o")


def test_template_with_tool_support_gets_the_tools(tiny_model, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    backend = TransformersBackend(tiny_model, tokenizer, AgentKVConfig(policy="full"))
    assert backend.chat_format.tools_in_template
    llm = ChatAgentKV(backend=backend, max_new_tokens=NEW_TOKENS)
    tooled = llm.bind_tools([get_weather])
    first = tooled.invoke(HISTORY)
    session = backend.get("default")
    prompt = tokenizer.decode(session.token_ids())
    assert '"name": "get_weather"' in prompt and "You can call tools" not in prompt
    second = tooled.invoke([*HISTORY, first, HumanMessage("thanks")])
    assert second.response_metadata["cropped_tokens"] == 0
    # New tools change the first message: re-encoded from its first changed token.
    third = llm.bind_tools([get_code]).invoke(HISTORY)
    assert third.response_metadata["cropped_tokens"] > 0
    assert "get_code" in tokenizer.decode(session.token_ids())


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen-like template: tools in a system block, tool calls rendered from `tool_calls`."""


# ---------------------------------------------------------------------------- sessions


def test_model_name_defaults_to_the_model(llm, tiny_model):
    assert llm.model_name == "LlamaForCausalLM"  # built from a config: no name_or_path
    assert llm._get_ls_params()["ls_model_name"] == "LlamaForCausalLM"
    assert llm._identifying_params["model_name"] == "LlamaForCausalLM"


def test_thread_id_from_metadata_picks_the_session(llm, backend):
    result = llm.invoke(HISTORY, config=on_thread("x"))
    assert result.response_metadata["session_id"] == "x"
    assert "x" in backend and "default" not in backend


def test_fixed_session_id_overrides_metadata(backend):
    llm = ChatAgentKV(backend=backend, session_id="fixed", max_new_tokens=4)
    assert llm.invoke(HISTORY, config=on_thread("x")).response_metadata["session_id"] == "fixed"
    assert "x" not in backend


def test_branch_metadata_forks_the_thread(llm, backend):
    llm.invoke(HISTORY, config=on_thread("x"))
    result = llm.invoke(HISTORY, config={"metadata": {"thread_id": "x", "agentkv_branch": "b1"}})
    assert result.response_metadata["session_id"] == "x/b1"
    assert backend.get("x/b1").branch == "b1"


def test_session_key_from_metadata():
    assert SessionKey.from_metadata(None) == SessionKey("default")
    assert SessionKey.from_metadata({"thread_id": 7}) == SessionKey("7")
    assert SessionKey.from_metadata({"thread_id": "t"}, fixed="f") == SessionKey("f")
    assert SessionKey.from_metadata({"thread_id": "t", "agentkv_branch": "b"}) == SessionKey("t", "b")


def test_session_for_creates_the_parent_before_forking(backend):
    session = session_for(backend, {"thread_id": "new", "agentkv_branch": "b"})
    assert session.session_id == "new/b" and "new" in backend


def test_langgraph_thread_gets_its_own_session_and_reuses_it(llm, backend):
    def agent(state: MessagesState) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    graph = builder.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "g1"}}

    graph.invoke({"messages": list(HISTORY)}, config)
    session = backend.get("g1")
    encoded = session.logical_length - pending(session)
    state = graph.invoke({"messages": [HumanMessage("And the code?")]}, config)

    last = state["messages"][-1]
    assert last.response_metadata["session_id"] == "g1"
    assert last.usage_metadata["input_token_details"]["cache_read"] == encoded
    assert "default" not in backend


# ---------------------------------------------------------------------------- the protocol


def test_parse_plain_text_is_content():
    assert parse_tool_calls("Hello there  ") == ("Hello there  ", [], [])


def test_parse_one_call_with_text_around_it():
    content, calls, invalid = parse_tool_calls(
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> ok'
    )
    assert content == "Let me check.\nok"
    assert [(c["name"], c["args"], c["type"]) for c in calls] == [
        ("get_weather", {"city": "Paris"}, "tool_call")
    ]
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == len("call_") + 8
    assert invalid == []


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n  {"name": "f", "arguments": {"x": 1}}\n</tool_call>',  # whitespace
        '<tool_call>{"name": "f", "arguments": {"x": 1}}',  # no closing tag at the end
        '<tool_call>{"name": "f", "args": {"x": 1}}</tool_call>',  # "args"
        '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>',  # "parameters"
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as a string
        '<tool_call>{"name": "f", "arguments": {"x": 1}}}</tool_call>',  # trailing junk
        '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # a missing closing brace
        '<tool_call>```json\n{"name": "f", "arguments": {"x": 1}}\n```</tool_call>',  # a code fence
    ],
)
def test_parse_is_tolerant(text):
    content, calls, invalid = parse_tool_calls(text)
    assert content == ""
    assert [(c["name"], c["args"]) for c in calls] == [("f", {"x": 1})]
    assert invalid == []


def test_parse_two_calls_get_distinct_ids():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
    _, calls, _ = parse_tool_calls(text)
    assert [c["name"] for c in calls] == ["a", "b"]
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_missing_close_ends_at_the_next_call():
    text = '<tool_call>{"name": "a", "arguments": {}}<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c["name"] for c in parse_tool_calls(text)[1]] == ["a", "b"]


def test_parse_a_closing_tag_inside_a_json_string_does_not_cut_the_call():
    """Constrained decoding guarantees a complete object; its strings may hold any text, tags too."""
    text = '<tool_call>{"name": "add_todo", "arguments": {"task": "}}</tool_call> then more"}}</tool_call>'
    content, calls, invalid = parse_tool_calls(text)
    assert invalid == [] and content == ""
    assert [(c["name"], c["args"]) for c in calls] == [("add_todo", {"task": "}}</tool_call> then more"})]


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ('<tool_call>{"name": "f", "arguments": {"x": lorem ipsum', "f"),  # malformed arguments
        ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "f"),  # arguments not an object
        ('<tool_call>{"arguments": {}}</tool_call>', None),  # no name
        ("<tool_call>not json at all</tool_call>", None),
    ],
)
def test_parse_malformed_call_is_invalid(text, name):
    content, calls, invalid = parse_tool_calls(text)
    assert calls == []
    assert len(invalid) == 1
    assert invalid[0]["name"] == name
    assert invalid[0]["error"]
    assert invalid[0]["id"].startswith("call_")
    assert invalid[0]["type"] == "invalid_tool_call"


def test_forced_prefix_reaches_into_the_arguments():
    schema = {"properties": {"unit": {"type": "string"}, "city": {"type": "string"}}, "required": ["city"]}
    assert (
        forced_call_prefix("get_weather", schema)
        == '<tool_call>{"name": "get_weather", "arguments": {"city": "'
    )
    number = {"properties": {"input": {"type": "integer"}}}
    assert forced_call_prefix("f", number).endswith('"arguments": {"input": ')
    assert forced_call_prefix("f", {"properties": {}}).endswith('"arguments": {}')
    assert forced_call_prefix("f").endswith('"arguments": {')


def test_forced_prefix_parses_once_the_model_closes_the_call():
    schema = {"properties": {"city": {"type": "string"}}}
    _, calls, _ = parse_tool_calls(forced_call_prefix("get_weather", schema) + 'Paris"}}')
    assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Paris"})]
    _, calls, _ = parse_tool_calls(forced_call_prefix('we"ird') + "}}")
    assert calls[0]["name"] == 'we"ird'


def test_call_end_counts_brackets_outside_strings():
    end = CallEnd(forced_call_prefix("f", {"properties": {"q": {"type": "string"}}}))
    assert not end.feed('a } { \\" ] text')  # inside the string: ignored
    assert not end.feed('", "n": [1, {"x": 2}]')
    assert not end.feed("}")  # arguments closed, the call object still open
    assert end.feed("} trailing")
    assert end.feed("more")  # stays done


def test_forced_call_stops_when_the_call_is_complete(llm, monkeypatch):
    """A model that closes the call and rambles on is cut at the call's last brace."""
    real_stream = Session.stream
    # One tool bound: "any" prefills its call up to the arguments; the model writes the rest.
    script = ['{"city": "Paris', '"}', "}", " and then", " more", " noise"]
    served: list[str] = []

    def close_then_ramble(self, *args, **kwargs):
        inner = real_stream(self, *args, **kwargs)
        try:
            next(inner, None)  # the real decode opens the answer's span
            for piece in script:
                served.append(piece)
                yield piece
        finally:
            inner.close()

    monkeypatch.setattr(Session, "stream", close_then_ramble)
    result = llm.bind_tools([get_weather], tool_choice="any").invoke(HISTORY)
    assert [(c["name"], c["args"]) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert served == script[:3]
    assert result.response_metadata["finish_reason"] == "tool_calls"


def test_stream_filter_shows_a_prefix_of_the_final_content():
    text = 'Sure, checking  <tool_call>{"name": "f", "arguments": {}}</tool_call>\n done'
    for cut in range(1, len(text)):
        shown = ToolCallStreamFilter()
        emitted = shown.feed(text[:cut]) + shown.feed(text[cut:])
        content, _, _ = parse_tool_calls(text)
        assert content.startswith(emitted)
        assert emitted + shown.rest(content) == content == "Sure, checking\ndone"


def test_stream_filter_holds_back_a_partial_tag():
    shown = ToolCallStreamFilter()
    assert shown.feed("Hi <tool") == "Hi"
    assert shown.feed("box") == " <toolbox"


def test_render_tool_prompt_is_deterministic_and_names_tools():
    schemas = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    prompt = render_tool_prompt(schemas)
    assert prompt == render_tool_prompt(copy.deepcopy(schemas))
    assert '"name": "f"' in prompt and "<tool_call>" in prompt and "</tool_call>" in prompt


def test_resolve_tool_choice():
    names = ["a", "b"]
    assert resolve_tool_choice(None, names) is None
    assert resolve_tool_choice("auto", names) is None
    assert resolve_tool_choice("none", names) == "none"
    assert resolve_tool_choice("any", names) == ANY_TOOL  # the model picks (tests/unit/test_tool_choice.py)
    assert resolve_tool_choice(True, names) == ANY_TOOL
    assert resolve_tool_choice("any", ["a"]) == "a"
    assert resolve_tool_choice("b", names) == "b"
    assert resolve_tool_choice({"name": "b"}, names) == "b"
    with pytest.raises(ValueError, match="at least one bound tool"):
        resolve_tool_choice("any", [])


def test_empty_messages_are_refused_in_chat_model_terms(llm, backend):
    def agent(state: MessagesState) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    graph = builder.compile(checkpointer=InMemorySaver())
    with pytest.raises(ValueError, match="ChatAgentKV: no messages to answer") as caught:
        graph.invoke({"messages": []}, {"configurable": {"thread_id": "empty"}})
    assert "extend(" not in str(caught.value)  # an API a ChatAgentKV user never calls
    with pytest.raises(ValueError, match="ChatAgentKV: no messages to answer"):
        llm.invoke([])


def test_assistant_dict_without_content_goes_to_a_session_not_through_langchain(llm, backend):
    call = {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "name": "get_weather", "args": {"city": "Paris"}}],
    }
    history = [{"role": "user", "content": "Weather in Paris?"}, call]
    result = {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    backend.session("direct").extend([*history, result])  # the session's rule: content may be omitted
    with pytest.raises(ValueError, match="must contain 'role' and 'content'"):
        llm.invoke([*history, result])  # LangChain converts the dicts first and refuses it
    answer = llm.invoke([history[0], {**call, "content": ""}, result])  # as the docs say to write it
    assert isinstance(answer, AIMessage)
