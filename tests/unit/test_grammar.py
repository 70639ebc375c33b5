"""Grammar-constrained decoding (`agentkv.grammar`) on the tiny random Llama.

A random model writes noise; under a grammar its calls and JSON still parse and
validate, which is what these tests check (the default model's rates are measured
by `agentkv bench tools`).
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

import llguidance
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel

import agentkv_langchain.chat_models as chat_models_module
from agentkv import AgentKVConfig, TransformersBackend
from agentkv.grammar import (
    GrammarError,
    GrammarProcessor,
    compile_grammar,
    json_grammar,
    strict_schema,
    text_grammar,
    text_or_call_grammar,
    tool_call_grammar,
)
from agentkv_langchain import ChatAgentKV

HISTORY = [
    SystemMessage("You are a helpful assistant.", id="sys"),
    HumanMessage("Weather in Paris?", id="h1"),
]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
}


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": f"The {name} tool.", "parameters": parameters or WEATHER},
    }


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))


def accepts(tokenizer: Any, lark: str, text: str) -> bool:
    compiled = compile_grammar(tokenizer, [2], lark)
    matcher: llguidance.LLMatcher = compiled.matcher()
    return bool(matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)))


def complete(tokenizer: Any, lark: str, text: str) -> bool:
    compiled = compile_grammar(tokenizer, [2], lark)
    matcher = compiled.matcher()
    return bool(matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))) and bool(
        matcher.is_accepting()
    )


# ---------------------------------------------------------------------------- grammars


def test_strict_schema_closes_listed_objects_and_keeps_explicit_choices():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}},
        "$defs": {"D": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    closed = strict_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # a copy


def test_call_grammar_takes_schema_calls_only(tiny_tokenizer):
    lark = tool_call_grammar([tool("weather"), tool("add", {"type": "object", "properties": {}})])
    good = '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    assert complete(tiny_tokenizer, lark, good)
    assert complete(tiny_tokenizer, lark, '<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    extra = '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "type": "string"'
    assert not accepts(tiny_tokenizer, lark, extra)
    assert not accepts(tiny_tokenizer, lark, '<tool_call>{"name": "weather", "arguments": {"unit": "kelvin"')
    assert not accepts(tiny_tokenizer, lark, '<tool_call>{"name": "other"')
    # One call unless parallel calls are allowed.
    assert not accepts(tiny_tokenizer, lark, good + "\n<tool_call>")
    assert accepts(tiny_tokenizer, tool_call_grammar([tool("weather")], parallel=True), good + "\n" + good)


@pytest.mark.parametrize("pseudo", ["<tool_call>", "<function>", '{"name": "x"}', 'a { "name"'])
def test_text_grammar_cannot_start_a_call(tiny_tokenizer, pseudo):
    assert complete(tiny_tokenizer, text_grammar(), "It is sunny in Paris.")
    assert not accepts(tiny_tokenizer, text_grammar(), f"Sure: {pseudo}")


def test_auto_grammar_is_text_or_text_then_a_constrained_call(tiny_tokenizer):
    lark = text_or_call_grammar([tool("weather")])
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    assert complete(tiny_tokenizer, lark, "Just text.")
    assert complete(tiny_tokenizer, lark, "Let me check. " + call)
    assert not accepts(tiny_tokenizer, lark, 'Let me check. <tool_call>{"name": "weather", "arguments": {"x"')
    assert not accepts(tiny_tokenizer, lark, "Let me check. <function>")


def test_json_grammar_follows_the_schema_or_any_object(tiny_tokenizer):
    assert complete(
        tiny_tokenizer, json_grammar(WEATHER), '{"city": "Rome", "unit": "fahrenheit", "days": 3}'
    )
    assert not accepts(tiny_tokenizer, json_grammar(WEATHER), '{"city": "Rome", "days"')  # order, required
    assert complete(tiny_tokenizer, json_grammar(), '{"anything": [1, 2]}')


def test_bad_schema_fails_at_bind_time_naming_the_path(backend):
    bad = {"type": "object", "properties": {"tags": {"type": "array", "items": {"pattern": "(?<=a)b"}}}}
    llm = ChatAgentKV(backend=backend)
    with pytest.raises(GrammarError, match=r"tools\[1\] \('bad'\)\.parameters\.properties\.tags\.items"):
        llm.bind_tools([tool("weather"), tool("bad", bad)])
    with pytest.raises(ValueError, match="with_structured_output: schema"):
        llm.with_structured_output(bad | {"title": "Bad"}, method="json_schema")
    ChatAgentKV(backend=backend, grammar=False).bind_tools([tool("bad", bad)])  # off: no check


# ---------------------------------------------------------------------------- decoding


def check_weather(args: dict[str, Any]) -> None:
    assert set(args) <= {"city", "unit", "days"} and {"city", "unit"} <= set(args)
    assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args.get("days", 0), int)


@pytest.mark.parametrize("choice", ["weather", "any", "required", True])
def test_forced_calls_of_a_random_model_parse_and_validate(backend, choice):
    llm = ChatAgentKV(backend=backend, max_new_tokens=40, temperature=1.0, seed=3)
    bound = llm.bind_tools(
        [tool("weather"), tool("lookup", {"type": "object", "properties": {}})], tool_choice=choice
    )
    for i in range(3):
        result = bound.invoke(HISTORY, {"metadata": {"thread_id": f"forced-{choice}-{i}"}})
        assert not result.invalid_tool_calls, result.invalid_tool_calls
        (call,) = result.tool_calls
        if call["name"] == "weather":
            check_weather(call["args"])
        else:
            assert call["name"] == "lookup" and call["args"] == {}


def test_a_tight_budget_still_closes_the_call(backend):
    # A few tokens more than the longest shortest call: a random model left alone writes on.
    shortest = backend.tokenizer.encode('{"city": "x", "unit": "fahrenheit"}}</tool_call>')
    llm = ChatAgentKV(backend=backend, max_new_tokens=len(shortest) + 4, temperature=1.0, seed=0)
    for i in range(4):
        result = llm.bind_tools([tool("weather")], tool_choice="weather").invoke(
            HISTORY, {"metadata": {"thread_id": f"tight-{i}"}}
        )
        assert not result.invalid_tool_calls and result.tool_calls, result
        check_weather(result.tool_calls[0]["args"])


def test_a_long_number_is_ended_for_the_next_required_key(backend):
    """A random model writes digits until the budget; finishing ends the number with a comma."""
    add = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    llm = ChatAgentKV(backend=backend, max_new_tokens=40, temperature=1.0, seed=4)
    result = llm.bind_tools([tool("add", add)], tool_choice="add").invoke(HISTORY)
    assert not result.invalid_tool_calls and result.tool_calls
    assert set(result.tool_calls[0]["args"]) == {"a", "b"}


def boost(tokenizer: Any, text: str) -> Any:
    """A processor that pushes the model to write `text` first, whatever it would write."""
    target = tokenizer(text, add_special_tokens=False)["input_ids"]

    def push(produced: Any, logits: torch.Tensor) -> torch.Tensor:
        if len(produced) < len(target):
            logits = logits.clone()
            logits[target[len(produced)]] = logits.max() + 50.0
        return logits

    return push


def under_grammar_with(monkeypatch: pytest.MonkeyPatch, push: Any) -> None:
    """Make the model prefer `push`'s text, then apply the grammar's mask (the grammar has the last word)."""
    real = chat_models_module.grammar_processor

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        processor = real(*args, **kwargs)
        return lambda produced, logits: processor(produced, push(produced, logits))

    monkeypatch.setattr(chat_models_module, "grammar_processor", wrapped)


def test_any_lets_the_model_pick_the_tool_under_the_grammar(backend, monkeypatch):
    tools = [tool("search"), tool("weather"), tool("lookup")]
    under_grammar_with(monkeypatch, boost(backend.tokenizer, "lookup"))
    result = (
        ChatAgentKV(backend=backend, max_new_tokens=64).bind_tools(tools, tool_choice="any").invoke(HISTORY)
    )
    assert [c["name"] for c in result.tool_calls] == ["lookup"]  # not the first listed: the model's pick


def test_none_answers_in_text_when_the_model_starts_a_call(backend, monkeypatch):
    under_grammar_with(monkeypatch, boost(backend.tokenizer, "<tool_call>"))
    result = (
        ChatAgentKV(backend=backend, max_new_tokens=8)
        .bind_tools([tool("search")], tool_choice="none")
        .invoke(HISTORY)
    )
    assert result.text.strip() and "<tool" not in result.text
    assert not result.tool_calls and not result.invalid_tool_calls


def test_auto_call_is_constrained_once_started(backend, monkeypatch):
    under_grammar_with(
        monkeypatch, boost(backend.tokenizer, '<tool_call>{"name": "weather", "arguments": {"x')
    )
    result = (
        ChatAgentKV(backend=backend, max_new_tokens=96, temperature=1.0, seed=1)
        .bind_tools([tool("weather")])
        .invoke(HISTORY)
    )
    assert not result.invalid_tool_calls and len(result.tool_calls) == 1
    check_weather(result.tool_calls[0]["args"])


def test_constrained_answer_kv_is_reused_next_turn(backend):
    llm = ChatAgentKV(backend=backend, session_id="reuse", max_new_tokens=64)
    call = llm.bind_tools([tool("weather")], tool_choice="weather").invoke(HISTORY)
    assert call.tool_calls
    session = backend.get("reuse")
    call_span = next(s for s in session.spans if s.generated)
    # The constrained call's KV as the first call left it (its last sampled token is not yet encoded).
    computed = call_span.start + call_span.n_computed
    assert computed > call_span.start
    messages = [*HISTORY, call, ToolMessage("sunny", tool_call_id=call.tool_calls[0]["id"])]
    answer = llm.bind_tools([tool("weather")], tool_choice="none").invoke(messages)
    usage = answer.usage_metadata
    assert usage is not None and answer.response_metadata["cropped_tokens"] == 0
    # Everything encoded before the tool result came from the cache, the constrained call included.
    assert usage["input_token_details"]["cache_read"] >= computed
    session.check()


class Person(BaseModel):
    name: str
    age: int


class PersonDict(TypedDict):
    name: str
    age: int


PERSON_SCHEMA = {
    "title": "Person",
    "description": "A person.",
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("schema", [Person, PersonDict, PERSON_SCHEMA], ids=["pydantic", "typeddict", "json"])
def test_structured_output_of_a_random_model_validates(backend, schema, method):
    llm = ChatAgentKV(backend=backend, max_new_tokens=30, temperature=1.0, seed=5)
    out = llm.with_structured_output(schema, method=method, include_raw=True).invoke(
        "Alice is 30.", {"metadata": {"thread_id": f"so-{method}-{id(schema)}"}}
    )
    assert out["parsing_error"] is None and isinstance(out["raw"], AIMessage)
    parsed = out["parsed"]
    person = parsed if isinstance(parsed, Person) else Person(**parsed)
    assert isinstance(person.age, int)


def test_json_mode_is_any_object_and_strict_needs_the_grammar(backend):
    out = (
        ChatAgentKV(backend=backend, max_new_tokens=20, temperature=1.0, seed=2)
        .with_structured_output(None, method="json_mode")
        .invoke("Give JSON.")
    )
    assert isinstance(out, dict)
    with pytest.raises(ValueError, match="strict=True"):
        ChatAgentKV(backend=backend, grammar=False).with_structured_output(Person, strict=True)


# ---------------------------------------------------------------------------- property


def schemas(depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    leaves = st.one_of(
        st.just({"type": "string"}),
        st.just({"type": "integer"}),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["red", "green", "blue", "x y"]), min_size=1, max_size=3, unique=True).map(
            lambda values: {"enum": values}
        ),
        st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 9}, st.integers(-5, 5)),
    )
    if depth == 0:
        return leaves
    inner = schemas(depth - 1)
    arrays = st.builds(
        lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3)
    )
    objects = st.dictionaries(st.sampled_from(["a", "b", "c_d", "e"]), inner, max_size=3).flatmap(
        lambda props: st.builds(
            lambda required: {"type": "object", "properties": props, "required": sorted(required)},
            st.sets(st.sampled_from(sorted(props)) if props else st.nothing(), max_size=len(props)),
        )
    )
    return st.one_of(leaves, arrays, objects)


def valid(value: Any, schema: dict[str, Any]) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema["maxItems"]
            and all(valid(v, schema["items"]) for v in value)
        )
    props = schema["properties"]
    return (
        isinstance(value, dict)
        and set(value) <= set(props)
        and set(schema["required"]) <= set(value)
        and all(valid(v, props[k]) for k, v in value.items())
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    schema=schemas().map(
        lambda s: (
            s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]}
        )
    ),
    seed=st.integers(0, 2**16),
)
def test_random_schemas_give_valid_json(backend, schema, seed):
    session = backend.session("property")
    session.extend([{"role": "user", "content": "Answer in JSON."}])
    stops = session.format.stop_token_ids()
    compiled = compile_grammar(backend.tokenizer, stops, json_grammar(schema))
    processor = GrammarProcessor(compiled, budget=48, tokenizer=backend.tokenizer, stop_ids=stops)
    text = session.generate(max_new_tokens=48, temperature=1.0, seed=seed, logits_processor=processor)
    assert valid(json.loads(text), schema), text
    backend.close("property")


def test_end_of_turn_is_allowed_only_where_the_grammar_may_end(tiny_tokenizer):
    """Even a stop id the grammar reads as text (a tokenizer that does not mark it special)."""
    text_stop = tiny_tokenizer.encode("x", add_special_tokens=False)[0]  # a plain-text token as the stop id
    compiled = compile_grammar(tiny_tokenizer, [2], json_grammar({"type": "object"}))
    processor = GrammarProcessor(compiled, stop_ids=[2, text_stop])
    vocab = len(tiny_tokenizer)
    opened = tiny_tokenizer.encode('{"a": "', add_special_tokens=False)
    assert not processor(opened, torch.zeros(vocab))[text_stop].isfinite()  # inside a string: no stop
    closed = tiny_tokenizer.encode('{"a": "b"}', add_special_tokens=False)
    processor = GrammarProcessor(compiled, stop_ids=[2, text_stop])
    assert processor(closed, torch.zeros(vocab))[2].isfinite()  # complete: the end of turn is allowed
