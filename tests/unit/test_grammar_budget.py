"""A forced call is never cut by `max_new_tokens`: it parses and validates, or fails before decoding.

Array-of-objects schemas are where a budget bites: with a few tokens left, opening one
more item moves the shortest way out from a handful of tokens to a whole item. The
processor checks each picked token against the budget left (`GrammarProcessor.accept`),
and refuses a budget the schema's shortest answer cannot fit (`AnswerTooLong`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.grammar import AnswerTooLong, GrammarProcessor, compile_grammar, json_grammar
from agentkv_langchain import ChatAgentKV

BOOKING = {
    "type": "object",
    "properties": {
        "guests": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "diet": {"enum": ["none", "vegetarian", "gluten free"]},
                    "age": {"type": "integer"},
                },
                "required": ["name", "diet"],
            },
        },
        "room": {"enum": ["single", "double suite"]},
    },
    "required": ["guests", "room"],
}
ROUTE = {
    "type": "object",
    "properties": {
        "stops": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "legs": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "properties": {
                                "mode": {"enum": ["train", "bus", "night ferry"]},
                                "hours": {"type": "integer"},
                            },
                            "required": ["mode", "hours"],
                        },
                    },
                },
                "required": ["city", "legs"],
            },
        }
    },
    "required": ["stops"],
}
HISTORY = [{"role": "user", "content": "Plan it."}]


def valid(value: Any, schema: dict[str, Any]) -> bool:
    """The subset of JSON schema the schemas above use (no extra keys, as the grammar is strict)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) >= schema.get("minItems", 0)
            and all(valid(v, schema["items"]) for v in value)
        )
    props = schema["properties"]
    return (
        isinstance(value, dict)
        and set(value) <= set(props)
        and set(schema["required"]) <= set(value)
        and all(valid(v, props[k]) for k, v in value.items())
    )


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))


@pytest.mark.parametrize("name,schema", [("book", BOOKING), ("route", ROUTE)])
@pytest.mark.parametrize("budget", [24, 32, 48, 64, 96])
def test_a_forced_call_parses_and_validates_or_fails_before_decoding(backend, name, schema, budget):
    llm = ChatAgentKV(backend=backend, max_new_tokens=budget, temperature=1.0)
    bound = llm.bind_tools([tool(name, schema)], tool_choice=name)
    for seed in range(4):
        thread = f"{name}-{budget}-{seed}"
        try:
            result = bound.invoke(HISTORY, {"metadata": {"thread_id": thread}}, seed=seed)
        except AnswerTooLong as error:
            assert f"max_new_tokens={budget}" in str(error)
            assert not any(span.generated for span in backend.get(thread).spans)  # nothing decoded
            continue
        assert not result.invalid_tool_calls, (result.content, result.invalid_tool_calls)
        (call,) = result.tool_calls
        assert valid(call["args"], schema), call["args"]


@pytest.mark.parametrize("budget", [8, 16, 32])
def test_json_answers_end_inside_the_budget(backend, budget):
    """The processor on its own (structured output), greedy and sampled."""
    session = backend.session("json")
    session.extend(HISTORY)
    stops = session.format.stop_token_ids()
    compiled = compile_grammar(backend.tokenizer, stops, json_grammar(BOOKING))
    for seed in (None, 1, 2):
        try:
            processor = GrammarProcessor(compiled, budget=budget, tokenizer=backend.tokenizer, stop_ids=stops)
        except AnswerTooLong as error:
            assert error.needed > budget
            return
        text = session.generate(
            max_new_tokens=budget,
            temperature=0.0 if seed is None else 1.0,
            seed=seed,
            logits_processor=processor,
        )
        assert processor.complete, text
        session.extend([{"role": "user", "content": "Again."}])


def test_a_budget_under_the_shortest_answer_is_refused_with_the_numbers(tiny_tokenizer):
    compiled = compile_grammar(tiny_tokenizer, [2], json_grammar(ROUTE))
    with pytest.raises(AnswerTooLong, match=r"max_new_tokens=4.*at least (\d+)") as caught:
        GrammarProcessor(compiled, budget=4, tokenizer=tiny_tokenizer, stop_ids=[2])
    assert isinstance(caught.value, ValueError) and caught.value.needed > 4
    GrammarProcessor(compiled, budget=caught.value.needed, tokenizer=tiny_tokenizer, stop_ids=[2])


def test_a_token_that_opens_an_item_too_late_is_refused(tiny_tokenizer):
    """`accept`: with an item closed and a few tokens to spare, `]` fits; `,` (one more item) does not."""
    compiled = compile_grammar(tiny_tokenizer, [2], json_grammar(BOOKING))
    opened = tiny_tokenizer.encode('{"guests": [{"name": "a", "diet": "none"}', add_special_tokens=False)
    probe = GrammarProcessor(compiled, opened, budget=512, tokenizer=tiny_tokenizer, stop_ids=[2])
    assert probe.way is not None
    way_out = len(probe.way)  # `], "room": "single"}` and the end of turn
    processor = GrammarProcessor(compiled, opened, budget=way_out + 2, tokenizer=tiny_tokenizer, stop_ids=[2])
    vocab = len(tiny_tokenizer)
    close = tiny_tokenizer.encode("]", add_special_tokens=False)[0]
    comma = tiny_tokenizer.encode(",", add_special_tokens=False)[0]
    logits = processor([], torch.zeros(vocab))
    assert logits[comma].isfinite() and logits[close].isfinite()  # both follow the grammar
    assert processor.accept([], close)
    assert not processor.accept([], comma)
    assert not processor([], torch.zeros(vocab))[comma].isfinite()  # refused: masked when asked again


def test_closing_never_picks_a_token_the_grammar_forbids() -> None:
    """Inside a string-like lexeme (most tokens allowed), a forbidden quote stays out of the pick."""
    from agentkv.grammar.finishing import closing_choice, closing_rank

    class Vocab:
        texts = ['"', '"}', "0", "a", "b", "c", "d", "e"]

        def __len__(self) -> int:
            return len(self.texts)

        def decode(self, ids: list[int]) -> str:
            return "".join(self.texts[i] for i in ids)

    rank = closing_rank(Vocab(), set())
    allowed = torch.tensor([False, False, True, True, True, True, True, True])  # an id lexeme: no quotes
    choice = closing_choice(allowed, rank)
    assert choice.sum() == 1 and bool(allowed[choice].all())
    assert Vocab.texts[int(choice.nonzero())] == "0"
