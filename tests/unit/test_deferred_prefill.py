"""`extend(..., prefill=False)`: one forward per model call (new messages + prompt), the same answer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend

HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code is 4417. Remember the package tracking number ZX-99."},
    {"role": "assistant", "content": "Noted: code 4417 and tracking number ZX-99."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
MORE = [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And the code?"}]


def _backend(model: Any, tokenizer: Any, policy: str = "full", **budget: int) -> TransformersBackend:
    data: dict[str, Any] = {"policy": policy}
    if budget:
        data["budget"] = budget
    return TransformersBackend(model, tokenizer, AgentKVConfig.from_dict(data))


def _count_forwards(monkeypatch: pytest.MonkeyPatch, backend: TransformersBackend) -> list[int]:
    calls: list[int] = []
    original = backend.runner.forward

    def counted(cache: Any, feed: Any, **kwargs: Any) -> Any:
        calls.append(len(feed))
        return original(cache, feed, **kwargs)

    monkeypatch.setattr(backend.runner, "forward", counted)
    return calls


def test_deferred_extend_answers_in_one_forward_with_the_same_text(
    tiny_model: Any, tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = _backend(tiny_model, tiny_tokenizer).session("eager")
    lazy_backend = _backend(tiny_model, tiny_tokenizer)
    lazy = lazy_backend.session("lazy")
    for session in (eager, lazy):
        session.extend(HISTORY)
        session.generate(max_new_tokens=4)
    history = [*HISTORY, {"role": "assistant", "content": eager.messages[-1].content}, *MORE[1:]]
    eager.extend(history)
    expected = eager.generate(max_new_tokens=6)

    calls = _count_forwards(monkeypatch, lazy_backend)
    result = lazy.extend(history, prefill=False)
    assert result.prefilled_tokens == 0 and result.pending_tokens > 0 and calls == []
    assert lazy.last_logits is None and lazy.prefill_deferred
    assert lazy.generate(max_new_tokens=6) == expected
    # The first forward holds the pending messages and the generation prompt; then one per token.
    assert calls[0] > result.pending_tokens and all(n == 1 for n in calls[1:])
    assert lazy.stats().prefill_tokens == eager.stats().prefill_tokens  # same tokens, fewer forwards
    assert lazy.token_ids() == eager.token_ids()
    assert not lazy.prefill_deferred
    lazy.check()


def test_pending_tokens_are_encoded_by_any_later_call(tiny_model: Any, tiny_tokenizer: Any) -> None:
    session = _backend(tiny_model, tiny_tokenizer).session("t")
    session.extend(HISTORY, prefill=False)
    logits = session.continuation_logits([5, 6])
    with torch.inference_mode():
        full = tiny_model(input_ids=torch.tensor([session.token_ids() + [5, 6]])).logits[0, -2:].float()
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
    other = _backend(tiny_model, tiny_tokenizer).session("u")
    other.extend(HISTORY[:2], prefill=False)
    assert other.extend(HISTORY).prefilled_tokens == len(other.token_ids())  # the earlier pending ones too
    other.check()


def test_deferred_extend_under_a_budget_still_checks_it(tiny_model: Any, tiny_tokenizer: Any) -> None:
    session = _backend(tiny_model, tiny_tokenizer, "lifecycle", device_tokens=48).session("b")
    session.extend(HISTORY, prefill=False)
    session.generate(max_new_tokens=3)
    session.extend([*HISTORY, {"role": "assistant", "content": session.messages[-1].content}, *MORE[1:]])
    session.generate(max_new_tokens=3)
    session.check()
    stats = session.stats()
    assert stats.prefill_tokens > 0 and stats.tokens_by_state
