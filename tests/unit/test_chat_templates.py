"""Chat templates read without relying on their internals: folding, reasoning, switches, fallback."""

from __future__ import annotations

import logging

import pytest
import torch
from chat_families import FAMILIES, family_tokenizer
from session_history import forcing

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.chat import normalize_messages
from agentkv.templates import ChatFormat, resolve_template
from tests.conftest import tiny_llama_config

FAMILY = {f.name: f for f in FAMILIES}


def backend_for(tokenizer, config: AgentKVConfig | None = None) -> TransformersBackend:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model_config = tiny_llama_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model_config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(model_config).eval().to(torch.float32)
    return TransformersBackend(model, tokenizer, config or AgentKVConfig(policy="full"))


def held_text(session) -> str:
    return "".join(span.text or "" for span in session.table.message_spans())


def test_gemma_folds_system_and_tool_results_into_user_turns_the_same_way_every_time():
    fmt = ChatFormat(family_tokenizer(FAMILY["gemma2"]))
    messages = normalize_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "w", "args": {}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {"role": "tool", "content": "warm", "tool_call_id": "c1"},
        ]
    )
    text = fmt.render(messages)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nWeather?<end_of_turn>")
    assert "<tool_response>\nsunny\n</tool_response>\n\n<tool_response>\nwarm\n</tool_response>" in text
    assert fmt.render(messages) == text


@pytest.mark.parametrize("name", ["llama3.1", "gemma2"])
def test_trimming_templates_answer_and_reuse(name):
    """`| trim` templates (the marker-based suffix crashed on them): an answer, then a follow-up reuses it."""
    backend = backend_for(family_tokenizer(FAMILY[name]))
    session = backend.session("t")
    history = [{"role": "user", "content": "  Hello there.  "}]
    session.extend(history)
    text = session.generate(5)
    follow = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
    result = session.extend(follow)
    assert result.cropped_tokens == 0  # the answer's tokens are kept even where `trim` changes its text
    assert held_text(session) == backend.chat_format.history_text(normalize_messages(follow))


QWEN_HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should look it up.",
        "tool_calls": [{"id": "c1", "name": "w", "args": {"city": "Paris"}}],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
]


def test_qwen3_keeps_reasoning_in_the_tool_loop_and_drops_it_after_a_new_question_exactly():
    backend = backend_for(family_tokenizer(FAMILY["qwen3"]))
    fmt = backend.chat_format
    session = backend.session("q")
    session.extend(QWEN_HISTORY)
    assert "<think>\nI should look it up.\n</think>" in held_text(session)  # after the last question: kept
    longer = [*QWEN_HISTORY, {"role": "assistant", "content": "Sunny."}]
    kept = session.extend(longer)
    assert kept.cropped_tokens == 0
    asked = [*longer, {"role": "user", "content": "And tomorrow?"}]
    dropped = session.extend(asked)
    # The template drops the call's reasoning once a new question follows: re-encoded from there, exactly.
    assert dropped.first_changed_message == 2 and dropped.cropped_tokens > 0
    history = fmt.history_text(normalize_messages(asked))
    assert "I should look it up." not in history
    assert held_text(session) == history
    rendered = [t for text in fmt.message_texts(normalize_messages(asked)) for t in fmt.encode(text)]
    assert session.token_ids() == rendered


def test_an_answers_reasoning_that_the_template_drops_is_re_encoded():
    backend = backend_for(family_tokenizer(FAMILY["qwen3"]))
    session = backend.session("r")
    history = [{"role": "user", "content": "Hi?"}]
    session.extend(history)
    thought = "<think>\nplan\n</think>\n\n"
    text = session.generate(3, prefix=thought)
    answer = {"role": "assistant", "content": text, "reasoning_content": "plan"}
    session.bind_message(answer)
    kept = session.extend([*history, answer, {"role": "tool", "content": "x", "tool_call_id": "z"}])
    assert kept.cropped_tokens == 0  # after the last question the template keeps the reasoning
    session.extend([*history, answer])  # a rewind: back to the answer
    dropped = session.extend([*history, answer, {"role": "user", "content": "Next."}])
    assert dropped.first_changed_message == 1 and dropped.cropped_tokens > 0
    assert "plan" not in held_text(session)


def test_template_switches_reach_the_template():
    tokenizer = family_tokenizer(FAMILY["qwen3"])
    off = ChatFormat(tokenizer, template_kwargs={"enable_thinking": False})
    messages = normalize_messages([{"role": "user", "content": "Hi"}])
    assert off.generation_prompt(messages).endswith("<think>\n\n</think>\n\n")
    assert ChatFormat(tokenizer).generation_prompt(messages) == "<|im_start|>assistant\n"
    backend = backend_for(tokenizer, AgentKVConfig(chat={"template_kwargs": {"enable_thinking": False}}))
    assert backend.chat_format.generation_prompt(messages).endswith("</think>\n\n")


def test_the_fallback_template_starts_with_bos_and_stops_on_eos():
    """A vocabulary with no known family's turn tokens (Phi-3's) gets ChatML, stopped by text."""
    tokenizer = family_tokenizer(FAMILY["phi3.5"])
    tokenizer.chat_template = None
    fmt = ChatFormat(tokenizer)
    assert fmt.uses_fallback
    text = fmt.render(normalize_messages([{"role": "user", "content": "Hi"}]), add_generation_prompt=True)
    assert text == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id in fmt.stop_token_ids()
    # Its vocabulary has no `<|im_end|>` token: the answer stops where the model spells it out.
    assert "<|im_end|>" not in tokenizer.get_vocab()
    assert fmt.stop_strings() == ("<|im_end|>",)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "name": "weather", "args": {"city": "Oslo"}}],
    },
    {"role": "tool", "content": "rain, 4 C", "tool_call_id": "c1"},
    {"role": "assistant", "content": "Rainy and cold."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize(
    ("family", "named", "prompt", "end"),
    [
        ("gemma2", "gemma", "<start_of_turn>model\n", "<end_of_turn>"),
        ("llama3.2", "llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
        ("qwen3", "chatml", "<|im_start|>assistant\n", "<|im_end|>"),
    ],
)
def test_a_base_tokenizer_gets_the_template_its_turn_tokens_name(family, named, prompt, end):
    """No chat template: the built-in one in the vocabulary's own turn tokens; one token ends a turn."""
    tokenizer = family_tokenizer(FAMILY[family])
    tokenizer.chat_template = None
    guessed = ChatFormat(tokenizer)
    assert guessed.uses_fallback
    assert guessed.template == resolve_template(named, tokenizer)
    messages = normalize_messages(CONVERSATION)
    text = guessed.render(messages, add_generation_prompt=True)
    assert text.endswith(prompt) and "rain, 4 C" in text and "Be brief." in text
    assert text.startswith(tokenizer.bos_token or "")
    assert tokenizer.convert_tokens_to_ids(end) in guessed.stop_token_ids()
    assert guessed.stop_strings() == ()
    # Message by message, the texts join into the whole rendering (the session holds one span each).
    assert "".join(guessed.message_texts(messages)) + guessed.generation_prompt(messages) == text
    assert not ChatFormat(tokenizer, template=named).uses_fallback


def test_a_named_template_replaces_the_tokenizers_and_a_bad_name_is_refused(tmp_path):
    tokenizer = family_tokenizer(FAMILY["gemma2"])
    messages = normalize_messages(CONVERSATION[:2])
    named = ChatFormat(tokenizer, template="gemma")
    assert named.render(messages) == "<bos><start_of_turn>user\nBe brief.\n\nWeather in Oslo?<end_of_turn>\n"
    own = tmp_path / "plain.jinja"
    own.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", encoding="utf-8"
    )
    assert (
        ChatFormat(tokenizer, template=str(own)).render(messages)
        == "system: Be brief.\nuser: Weather in Oslo?\n"
    )
    with pytest.raises(ValueError, match="neither a built-in template"):
        ChatFormat(tokenizer, template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="unknown template 'vicuna'; allowed: chatml, gemma, llama3"):
        AgentKVConfig(chat={"template": "vicuna"})
    backend = backend_for(tokenizer, AgentKVConfig(policy="full", chat={"template": "gemma"}))
    assert backend.chat_format.template == named.template


def test_a_broken_jinja_file_is_an_error_naming_the_setting_the_file_and_the_line(tmp_path):
    broken = tmp_path / "bad.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }{% endfor %}", encoding="utf-8")
    expected = f"chat.template '{broken}': not a valid Jinja template: line 2: unexpected '}}'"
    with pytest.raises(ValueError) as info:
        backend_for(family_tokenizer(FAMILY["gemma2"]), AgentKVConfig(chat={"template": str(broken)}))
    assert str(info.value) == expected
    tokenizer = family_tokenizer(FAMILY["gemma2"])
    tokenizer.chat_template = "{{ messages[0].content }"
    with pytest.raises(ValueError, match="^the tokenizer's chat template: not a valid Jinja template: line"):
        ChatFormat(tokenizer)


def test_a_session_on_a_guessed_template_answers_and_extends_exactly():
    """A base Gemma-like tokenizer: a generated answer ends at `<end_of_turn>` and the next turn reuses it."""
    tokenizer = family_tokenizer(FAMILY["gemma2"])
    tokenizer.chat_template = None
    backend = backend_for(tokenizer)
    session = backend.session("base")
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    session.extend(history)
    text = session.generate(8)
    answer = {"role": "assistant", "content": text}
    session.bind_message(answer)
    result = session.extend([*history, answer, {"role": "user", "content": "And tomorrow?"}])
    assert result.cropped_tokens == 0
    rendered = backend.chat_format.render(
        normalize_messages([*history, answer, {"role": "user", "content": "And tomorrow?"}])
    )
    assert held_text(session) == rendered


def test_a_vocabulary_without_turn_tokens_is_warned_truly_and_answers_stop_at_the_text(caplog):
    """No template and no built-in's turn tokens (Phi-3's vocabulary): ChatML spelled in plain tokens."""
    tokenizer = family_tokenizer(FAMILY["phi3.5"])
    tokenizer.chat_template = None
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        backend = backend_for(tokenizer)
    [warning] = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
    assert "no built-in template's turn tokens are tokens of its vocabulary" in warning
    assert "<|im_start|>, <|im_end|>" in warning and "plain text" in warning
    assert "chat.template (chatml, gemma, llama3 or a .jinja file)" in warning
    assert "are in the vocabulary" not in warning
    session = backend.session("t")
    session.extend([{"role": "user", "content": "Hi"}])
    said = tokenizer.encode("Sure<|im_end|>\n<|im_start|>user\nmore", add_special_tokens=False)
    text = session.generate(max_new_tokens=len(said), logits_processor=forcing(said))
    assert text == "Sure"


def test_a_template_whose_turn_ends_with_a_special_token_needs_no_stop_string():
    tokenizer = family_tokenizer(FAMILY["qwen3"])
    assert ChatFormat(tokenizer).stop_strings() == ()


def test_a_named_tool_format_and_unknown_names():
    from agentkv_langchain import ChatAgentKV

    backend = backend_for(family_tokenizer(FAMILY["llama3.1"]))
    assert backend.chat_format.tool_format.name == "llama3_json"
    ChatAgentKV(backend=backend, tool_format="pythonic")
    assert backend.chat_format.tool_format.name == "pythonic"
    with pytest.raises(ValueError, match="allowed: hermes"):
        AgentKVConfig(chat={"tool_format": "openai"})


def test_reasoning_is_split_off_never_content_and_never_read_for_calls():
    from agentkv_langchain.calls import answer_filter, read_answer

    fmt = ChatFormat(family_tokenizer(FAMILY["qwen3"]))
    tools = [
        {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}
    ]
    text = (
        '<think>\nMaybe <tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>?\n</think>\n\nIt is sunny.'
    )
    shown = answer_filter(fmt, tools)
    assert shown is not None
    streamed = "".join(shown.feed(text[i : i + 7]) for i in range(0, len(text), 7))
    read = read_answer(text, tools, shown, fmt)
    assert read.content == "It is sunny." and read.tool_calls == [] and read.invalid_tool_calls == []
    assert read.reasoning is not None and read.reasoning.startswith("Maybe <tool_call>")
    assert streamed + read.rest == "It is sunny."
    assert read.as_message("m1")["reasoning_content"] == read.reasoning
    # After the reasoning, a call is a call.
    called = read_answer(
        '<think>x</think>\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>', tools, None, fmt
    )
    assert [c["name"] for c in called.tool_calls] == ["w"] and called.reasoning == "x"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "gemma2",
            {"system": False, "tool": False, "tool_calls": False, "tools": False, "alternation": True},
        ),
        (
            "mistral-nemo",
            {"system": False, "tool": True, "tool_calls": True, "tools": False, "alternation": True},
        ),
        ("llama3.1", {"system": True, "notes": True, "tool": True, "tool_calls": True, "tools": True}),
        ("phi3.5", {"system": True, "tool": False, "tool_calls": False, "tools": False}),
        ("deepseek-r1", {"system": True, "notes": False, "tool_calls": False}),
        ("granite3.3", {"tools": True, "tool_calls": False}),
    ],
)
def test_probes_find_what_each_template_renders_itself(name, expected):
    rules = ChatFormat(family_tokenizer(FAMILY[name])).rules
    assert {key: getattr(rules, key) for key in expected} == expected
