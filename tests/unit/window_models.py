"""The window tests' models: the family matrix (`tests/families.py`) plus its windowed variants.

Also the conversation they replay and the moves that reorder the physical cache
(archive + restore, evict + rehydrate, recall), shared with `scripts/device_check.py`.

The matrix's windowed families (Mistral, Gemma 2/3, Starcoder2, Cohere2, OLMo3) slide
by `WINDOW` tokens; the variants here give a window to families whose configs allow
one and the matrix builds without: Phi-3 with `sliding_window` on every layer, Qwen2
and Qwen3 with windowed `layer_types` (three windowed layers, one full).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, Custom, SpanState, Tier, TransformersBackend
from agentkv.spans import SpanKind
from tests.families import FAMILIES, WINDOW, build, family_by_name, unavailable

_HYBRID = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-window": ("phi3", {"sliding_window": WINDOW}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": _HYBRID}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": _HYBRID}),
}
"""Windowed variants: name -> (matrix family, config overrides)."""

WINDOWED_CASES = [f.name for f in FAMILIES if f.windowed] + list(VARIANTS)
"""Every case with sliding-window layers."""
FULL_CASES = [f.name for f in FAMILIES if not f.windowed]
"""Full-attention families: nothing windowed may change them."""

__all__ = [
    "FULL_CASES",
    "HISTORY",
    "MOVES",
    "RULES",
    "VARIANTS",
    "WINDOW",
    "WINDOWED_CASES",
    "archive_restore",
    "build_case",
    "case_params",
    "logit_delta",
    "open_session",
    "plain_logits",
]


@functools.cache
def build_case(name: str) -> torch.nn.Module:
    """The tiny fp32 model of case `name` with its family's default kernel (cached: do not mutate it)."""
    family_name, overrides = VARIANTS.get(name, (name, {}))
    return build(family_by_name(family_name), **overrides)


def case_params(names: list[str]) -> list[Any]:
    """`pytest.param`s for cases, a family transformers cannot build skipped with its reason."""
    out = []
    for name in names:
        reason = unavailable(family_by_name(VARIANTS.get(name, (name, {}))[0]))
        out.append(pytest.param(name, id=name, marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return out


PROBE = [5, 6, 7, 9, 11]
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "weather", "args": {"city": "Paris"}}],
    },
    {
        "role": "tool",
        "content": "search results: sunny skies lorem ipsum dolor " * 8,
        "tool_call_id": "call_1",
    },
    # Messages after the tool result: a restored result sits after them physically.
    {"role": "user", "content": "thanks; and the secret code is 4417, remember the tracking number ZX-99"},
]
RULES = {
    "custom:archive": {"owner": "archive"},
    "custom:drop": {"owner": "evict"},
    "custom:bring": {"owner": "commit"},
}


def plain_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits `[n, V]` of a plain forward over `ids` (transformers' own masks)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=device)).logits[0].float()


def logit_delta(session: Any, model: torch.nn.Module) -> float:
    """Max |logit| difference of the next `PROBE` tokens over the session's cache against a plain forward."""
    reference = plain_logits(model, session.token_ids() + PROBE)[-len(PROBE) :]
    return (session.continuation_logits(PROBE) - reference).abs().max().item()


def open_session(model: torch.nn.Module, tokenizer: Any, **config: Any) -> Any:
    """A session over `model` that encoded `HISTORY`, with the moves' rules."""
    backend = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"rules": RULES, **config}))
    session = backend.session("t")
    session.extend(HISTORY)
    return session


def tool_span(session: Any) -> Any:
    """The conversation's tool result (several windows long)."""
    (tool,) = [s for s in session.spans if s.kind is SpanKind.TOOL_RESULT]
    assert tool.length >= 4 * WINDOW, "the moved span must be several windows long"
    return tool


def archive_restore(session: Any) -> None:
    """Archive the tool result to the host, then restore it (appended after later messages)."""
    tool = tool_span(session)
    assert session.apply(Custom(event="archive", owner="call_1")).applied
    assert tool.state is SpanState.ARCHIVED and tool.tier is Tier.HOST
    assert session.apply(Custom(event="bring", owner="call_1")).applied
    assert tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE


def evict_rehydrate(session: Any) -> None:
    """Drop the tool result's KV, then recompute it at its logical place (the mover's eager recompute)."""
    tool = tool_span(session)
    assert session.apply(Custom(event="drop", owner="call_1")).applied
    assert tool.state is SpanState.EVICTED and tool.tier is Tier.DROPPED
    assert session.manager.move(tool, SpanState.COMMITTED, reason="test") is not None  # eager recompute
    assert tool.tier is Tier.DEVICE and session.stats().rehydrated_tokens == tool.length


def recall(session: Any) -> None:
    """Archive the tool result as budget pressure would; a user turn about it recalls it."""
    tool = tool_span(session)
    assert session.apply(Custom(event="archive", owner="call_1")).applied
    session.manager.recallable.add(tool.span_id)  # as a budget archive marks it
    session.extend(
        [*HISTORY, {"role": "user", "content": "what did the search results say about sunny skies?"}]
    )
    assert tool.state is SpanState.COMMITTED and tool.tier is Tier.DEVICE, "recall brought the result back"


MOVES: dict[str, Callable[[Any], None]] = {
    "archive+restore": archive_restore,
    "evict+rehydrate": evict_rehydrate,
    "recall": recall,
}
