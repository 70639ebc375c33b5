"""An "auto" answer and `max_new_tokens`: a call that fits is let in, one that does not is reported.

In "auto" the answer is text or a call, and the whole budget may lie inside the window
where each picked token is checked against the budget left (`GrammarProcessor.accept`).
Opening a call must then be allowed whenever the shortest complete call still fits;
when it does not fit, the answer ends as text with `finish_reason="length"` and a
warning that names the budget it needed. With the grammar off, a call cut by the
budget is an invalid call whose error says so.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.grammar import GrammarProcessor, compile_grammar, text_or_call_grammar
from agentkv.grammar.finishing import CLOSING_WINDOW
from agentkv.toolformats.hermes import HERMES
from agentkv_langchain import ChatAgentKV

PING = {
    "type": "function",
    "function": {"name": "ping", "description": "Ping.", "parameters": {"type": "object", "properties": {}}},
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a city up.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
HISTORY = [{"role": "user", "content": "Ping it."}]


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))


def auto_grammars() -> list[str]:
    return [text_or_call_grammar([PING]), HERMES.grammar([PING], "auto")]


def written(processor: GrammarProcessor, ids: list[int], vocab: int) -> list[int]:
    """The ids of `ids` the processor lets through (unmasked and accepted), up to the first it stops."""
    produced: list[int] = []
    for token in ids:
        if not processor(produced, torch.zeros(vocab))[token].isfinite() or not processor.accept(
            produced, token
        ):
            break
        produced.append(token)
    return produced


@pytest.mark.parametrize("lark", auto_grammars())
def test_an_auto_call_that_fits_the_budget_is_let_in(tiny_tokenizer, lark):
    """The whole budget inside the checking window, and the call fits: every token of it goes through."""
    ids = tiny_tokenizer.encode(CALL, add_special_tokens=False)
    budget = len(ids) + 1  # the call and the end of turn: exactly what it takes
    assert budget <= CLOSING_WINDOW
    compiled = compile_grammar(tiny_tokenizer, [2], lark)
    processor = GrammarProcessor(compiled, budget=budget, tokenizer=tiny_tokenizer, stop_ids=[2])
    assert written(processor, ids, len(tiny_tokenizer)) == ids
    processor(ids, torch.zeros(len(tiny_tokenizer)))
    assert processor.complete and processor.cut is None


@pytest.mark.parametrize("lark", auto_grammars())
def test_an_auto_call_too_long_for_the_budget_is_refused_with_what_it_needs(tiny_tokenizer, lark):
    ids = tiny_tokenizer.encode(CALL, add_special_tokens=False)
    compiled = compile_grammar(tiny_tokenizer, [2], lark)
    processor = GrammarProcessor(compiled, budget=8, tokenizer=tiny_tokenizer, stop_ids=[2])
    kept = written(processor, ids, len(tiny_tokenizer))
    assert len(kept) < len(ids)
    cut = processor.cut
    assert cut is not None and cut.position == len(kept) and cut.token == ids[len(kept)]
    assert cut.needed is not None and 8 < cut.needed <= len(ids) + 1
    # The budget it names is enough: the same call goes through with it.
    roomy = GrammarProcessor(compiled, budget=cut.needed, tokenizer=tiny_tokenizer, stop_ids=[2])
    assert written(roomy, ids, len(tiny_tokenizer)) == ids


@pytest.mark.parametrize("text", ["<toolbox> <tool_call>", "<tool <tool_call>", "a<tool_x"])
def test_text_before_a_call_holds_no_other_call_opening(tiny_tokenizer, text):
    """After `<tool`, the only way on is the rest of `<tool_call>` (as in a text answer, no `<tool`)."""
    for lark in auto_grammars():
        matcher = compile_grammar(tiny_tokenizer, [2], lark).matcher()
        assert not matcher.consume_tokens(tiny_tokenizer.encode(text, add_special_tokens=False))
        ok = compile_grammar(tiny_tokenizer, [2], lark).matcher()
        assert ok.consume_tokens(tiny_tokenizer.encode("See < and tools: " + CALL, add_special_tokens=False))


def pushing(monkeypatch: pytest.MonkeyPatch, tokenizer: Any, text: str) -> None:
    """Make the model prefer `text` first; the grammar processor still has the last word."""
    target = tokenizer.encode(text, add_special_tokens=False)
    real = GrammarProcessor.__call__

    def call(self: GrammarProcessor, produced: Any, logits: torch.Tensor) -> torch.Tensor:
        if len(produced) < len(target):
            logits = logits.clone()
            logits[target[len(produced)]] = logits.max() + 50.0
        return real(self, produced, logits)

    monkeypatch.setattr(GrammarProcessor, "__call__", call)


def test_a_model_that_calls_within_a_tight_budget_gets_its_call(backend, monkeypatch, caplog):
    pushing(monkeypatch, backend.tokenizer, CALL)
    budget = len(backend.tokenizer.encode(CALL, add_special_tokens=False)) + 1
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        result = ChatAgentKV(backend=backend, max_new_tokens=budget).bind_tools([PING]).invoke(HISTORY)
    assert [c["name"] for c in result.tool_calls] == ["ping"] and not result.invalid_tool_calls
    assert result.response_metadata["finish_reason"] == "tool_calls"
    assert "ended this answer early" not in caplog.text


def test_a_call_the_budget_cannot_hold_ends_with_length_and_a_warning(backend, monkeypatch, caplog):
    pushing(monkeypatch, backend.tokenizer, CALL)
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        result = ChatAgentKV(backend=backend, max_new_tokens=8).bind_tools([PING]).invoke(HISTORY)
    assert not result.tool_calls and not result.invalid_tool_calls
    assert result.response_metadata["finish_reason"] == "length"
    assert CALL.startswith(result.content)  # it ends where the call was turned away, no pseudo-call after
    (record,) = [r for r in caplog.records if "ended this answer early" in r.getMessage()]
    assert "max_new_tokens=8" in record.getMessage() and "raise max_new_tokens" in record.getMessage()


def test_a_call_cut_by_max_new_tokens_without_the_grammar_says_so(backend, caplog):
    llm = ChatAgentKV(backend=backend, max_new_tokens=3, grammar=False)
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        result = llm.bind_tools([LOOKUP], tool_choice="lookup").invoke(HISTORY)
    assert result.response_metadata["finish_reason"] == "length" and not result.tool_calls
    (bad,) = result.invalid_tool_calls
    assert bad["name"] == "lookup" and "cut at max_new_tokens=3" in str(bad["error"])
    warnings = [r for r in caplog.records if "max_new_tokens=3 cut the tool call" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("city", ["Paris", "Rome 12", "a b c"])
def test_a_value_is_not_ended_early_when_the_call_fits(backend, monkeypatch, caplog, city):
    """Finishing starts when the way out fills the budget left, not a token before: the value is kept."""
    call = f'<tool_call>{{"name": "lookup", "arguments": {{"city": "{city}"}}}}</tool_call>'
    pushing(monkeypatch, backend.tokenizer, call)
    written_as = len(backend.tokenizer.encode(call, add_special_tokens=False)) + 1
    # One token less also fits: the grammar closes the call with `"}}` in one token.
    for budget in (written_as - 1, written_as):
        with caplog.at_level(logging.WARNING, logger="agentkv"):
            result = ChatAgentKV(backend=backend, max_new_tokens=budget).bind_tools([LOOKUP]).invoke(HISTORY)
        assert [c["args"] for c in result.tool_calls] == [{"city": city}], budget
    assert "ended this answer early" not in caplog.text
