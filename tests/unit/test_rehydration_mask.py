"""Rehydration recomputes a span at its logical place, whatever the model's attention implementation.

The logical 4D mask reaches the attention function untouched, and the functions
read it differently: SDPA takes bool (True = attend), eager *adds* the mask to the
scores. A bool mask under eager hides nothing, so a span recomputed in the middle
of the conversation would attend to the messages that came after it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agentkv import AgentKVConfig, Custom, SpanState, Tier, TransformersBackend
from agentkv.backend.runner import ModelRunner
from agentkv.spans import SpanKind

TOL = 1e-4
PROBE = [5, 6, 7]
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "weather", "args": {"city": "Paris"}}],
    },
    {"role": "tool", "content": "search results: sunny skies " * 6, "tool_call_id": "call_1"},
    # Messages after the tool result: a rehydrated result must not attend to them.
    {"role": "user", "content": "thanks; and the secret code is 4417"},
]


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def model(request, tiny_model) -> torch.nn.Module:
    """The tiny Llama (same weights) with the attention implementation under test."""
    twin = copy.deepcopy(tiny_model)
    twin.set_attn_implementation(request.param)
    assert twin.config._attn_implementation == request.param
    return twin


def full_forward(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()  # [n, V]


def test_rehydrated_span_equals_a_full_forward(model, tiny_tokenizer):
    config = AgentKVConfig.from_dict({"rules": {"custom:drop": {"owner": "evict"}}})
    session = TransformersBackend(model, tiny_tokenizer, config).session("t")
    session.extend(HISTORY)
    (tool,) = [s for s in session.spans if s.kind is SpanKind.TOOL_RESULT]
    assert session.apply(Custom(event="drop", owner="call_1")).applied
    assert tool.state is SpanState.EVICTED and tool.tier is Tier.DROPPED

    assert session.manager.move(tool, SpanState.COMMITTED, reason="test") is not None
    assert tool.tier is Tier.DEVICE
    assert session.stats().rehydrated_tokens == tool.length
    # The recomputed span sits at the end of the physical cache, after "thanks; ...".
    assert int(session.store.physical.slot_position[-1]) == tool.start + tool.length - 1

    ids = session.token_ids()
    reference = full_forward(model, ids + PROBE)[-len(PROBE) :]  # [3, V]
    delta = (session.continuation_logits(PROBE) - reference).abs().max().item()
    assert delta <= TOL, f"{model.config._attn_implementation}: rehydrated logits off by {delta}"
    session.check()


def test_logical_mask_takes_the_form_the_implementation_reads(tiny_model, tiny_tokenizer):
    twin = copy.deepcopy(tiny_model)
    runner = ModelRunner(twin)
    session = TransformersBackend(twin, tiny_tokenizer).session("t")
    session.extend(HISTORY[:2])
    physical = session.store.physical
    positions = [3, 4]  # two tokens logically inside what the cache holds
    allowed = (
        torch.cat([physical.slot_position, torch.tensor(positions)])[None, :]
        <= torch.tensor(positions)[:, None]
    )  # [2, S + 2]

    twin.set_attn_implementation("sdpa")
    sdpa = runner.logical_mask(physical, positions)
    assert sdpa.dtype == torch.bool and torch.equal(sdpa[0, 0], allowed)

    twin.set_attn_implementation("eager")  # read per call: the switch is honoured
    eager = runner.logical_mask(physical, positions)
    assert eager.dtype == runner.dtype and eager.shape == (1, 1, 2, physical.length + 2)
    assert torch.equal(eager[0, 0] == 0, allowed)
    assert torch.all(eager[0, 0][~allowed] == torch.finfo(runner.dtype).min)

    twin.config._attn_implementation = "flash_attention_2"  # no kernel needed: only the name is read
    with pytest.raises(ValueError, match="flash_attention_2.*cannot take a logical 4D mask"):
        runner.logical_mask(physical, positions)
