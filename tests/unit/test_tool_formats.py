"""The tool-call format registry: each format renders, constrains and parses calls with one shape."""

from __future__ import annotations

import pytest
from chat_families import FAMILIES, family_tokenizer

from agentkv.grammar import compile_grammar
from agentkv.grammar.grammars import grammar_error
from agentkv.templates import ChatFormat
from agentkv.toolformats import (
    FORMATS,
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PHI4,
    PYTHONIC,
    QWEN,
    detect_tool_format,
    split_reasoning,
    tool_format,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
    },
]
CALLS = [("get_weather", {"city": "Paris", "days": 2}, "a1b2c3d4e"), ("now", {}, "f5g6h7i8j")]


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_rendered_call_parses_back_to_the_same_call(fmt):
    calls = CALLS[:1] if getattr(fmt, "single", False) else CALLS
    parsed = fmt.parse(fmt.render_calls(calls))
    assert parsed.content == "" and parsed.invalid == ()
    assert [(c.name, c.args) for c in parsed.calls] == [(name, args) for name, args, _ in calls]


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("mode", ["forced", "auto"])
@pytest.mark.parametrize("parallel", [False, True])
def test_every_grammar_builds(fmt, mode, parallel):
    assert grammar_error(fmt.grammar(TOOLS, mode, parallel=parallel)) is None


def test_text_before_and_between_calls_is_content():
    text = 'Let me look. <tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"}'
    parsed = HERMES.parse(text)
    assert parsed.content == "Let me look.\nthen"
    assert [c.name for c in parsed.calls] == ["a", "b"]


def test_llama3_reads_a_bare_object_and_the_python_tag():
    assert LLAMA3_JSON.parse('  {"name": "f", "parameters": {"x": 1}}').calls[0].args == {"x": 1}
    assert LLAMA3_JSON.parse('<|python_tag|>{"name": "f", "parameters": {}}').calls[0].name == "f"
    assert LLAMA3_JSON.parse('I think {"name" is a key}').calls == ()  # not at the start: text


def test_mistral_keeps_the_models_call_id_and_templates_get_nine_characters():
    from agentkv.templates import template_id

    parsed = MISTRAL.parse('[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "Ab3dE6gH9"}]')
    assert parsed.calls[0].id == "Ab3dE6gH9"
    assert template_id("Ab3dE6gH9") == "Ab3dE6gH9"
    assert len(template_id("call_0123abcd")) == 9 and template_id("call_0123abcd") == template_id(
        "call_0123abcd"
    )


def test_pythonic_calls_read_json_and_python_literals():
    parsed = PYTHONIC.parse('[f(a=1, b="x", c=true, d=None), g()] and then')
    assert [(c.name, c.args) for c in parsed.calls] == [
        ("f", {"a": 1, "b": "x", "c": True, "d": None}),
        ("g", {}),
    ]
    assert parsed.content == "and then"
    assert PYTHONIC.parse("[1, 2] is a list").calls == ()
    assert PYTHONIC.parse("[f(1)]").invalid[0].error.startswith("positional")


def test_unknown_format_names_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed: hermes, qwen, llama3_json"):
        tool_format("openai")


@pytest.mark.parametrize(
    ("marks", "expected"),
    [
        ("{{ '[TOOL_CALLS][' }}", MISTRAL),
        ("<|tool_call|> ... <|/tool_call|>", PHI4),
        ("respond only with <|tool_call|>", GRANITE),
        ('\'<tool_call>\\n{"name": "\'', QWEN),
        ("<tool_call>", HERMES),
        ('<|start_header_id|> "parameters": ', LLAMA3_JSON),
        ("{{ message.content }}", HERMES),
        (None, HERMES),
    ],
)
def test_detection_reads_what_the_template_writes(marks, expected):
    assert detect_tool_format(marks) is expected


@pytest.mark.parametrize(
    ("text", "reasoning", "rest"),
    [
        ("<think>\nplan\n</think>\n\nHello", "plan", "Hello"),
        ("  <think>plan</think>Hi", "plan", "Hi"),
        ("plan</think>\nHi", "plan", "Hi"),  # the generation prompt opened the block
        ("<think>cut short", "cut short", ""),  # the budget ended it: all reasoning
        ("No reasoning here.", None, "No reasoning here."),
    ],
)
def test_split_reasoning(text, reasoning, rest):
    assert split_reasoning(text) == (reasoning, rest)


FAMILY = {f.name: f for f in FAMILIES}


@pytest.mark.parametrize("name", ["mistral-nemo", "granite3.3", "phi4-mini", "qwen3", "llama3.1"])
def test_a_call_the_grammar_allows_is_the_call_the_template_renders(name):
    """The grammar (with the family's special tokens by id) accepts the format's rendering of a call."""
    tokenizer = family_tokenizer(FAMILY[name])
    fmt = ChatFormat(tokenizer)
    lark = fmt.tool_format.grammar(TOOLS[:1], "forced", specials=fmt.grammar_specials)
    compiled = compile_grammar(tokenizer, fmt.stop_token_ids(), lark)
    matcher = compiled.matcher()
    text = fmt.tool_format.render_calls([("get_weather", {"city": "Paris", "days": 2}, "a1b2c3d4e")])
    assert matcher.consume_tokens(fmt.encode(text)), text
    assert matcher.is_accepting()


def test_a_text_answer_cannot_start_a_call_in_the_family_format():
    import torch

    from agentkv_langchain.tools import ToolCallBan, banned_opening

    tokenizer = family_tokenizer(FAMILY["mistral-nemo"])
    banned = banned_opening(MISTRAL)
    assert banned == "[TOOL_CALLS]"
    ban = ToolCallBan(tokenizer, banned)
    logits = ban([], torch.zeros(len(tokenizer)))
    assert logits[tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")] == float("-inf")
    assert torch.isfinite(logits).sum() == len(tokenizer) - int(ban.contains.sum())
    assert banned_opening(HERMES) == "<tool"
