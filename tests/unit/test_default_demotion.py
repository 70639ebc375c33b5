"""The default demotion order: full precision -> attended int4 -> archived -> evicted.

With the default config a session under budget pressure holds spans at int4 *in attention*
before it archives any; with no pressure nothing is quantized, the cache is the plain cache
(exact logits) and its forks share its tensors instead of copying them.
"""

from __future__ import annotations

from typing import Any

import torch

from agentkv import AgentKVConfig, SpanState, Tier, TransformersBackend

TOL = 1e-4
"""fp32 tolerance: sdpa over the same KV in another layout differs by rounding only."""


def notes(n: int) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(n):
        history.append({"role": "user", "content": f"note {i}: the secret code is 44{i}7 lorem ipsum dolor"})
        history.append({"role": "assistant", "content": f"noted {i}"})
    return history


def reference_logits(model: Any, ids: list[int], probe: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids + probe])).logits[0, -len(probe) :].float()


def test_the_attended_int4_tier_is_the_default() -> None:
    config = AgentKVConfig()
    assert config.quantization.attended_bits == 4
    archive_only = AgentKVConfig.from_dict({"quantization": {"attended_bits": None}})
    assert archive_only.quantization.attended_bits is None


def test_no_pressure_means_the_plain_cache(tiny_model, tiny_tokenizer):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())
    session = backend.session("t")
    session.extend(notes(4))
    stats = session.stats()
    assert stats.attended_quantized_tokens == 0
    # Never quantized: every attended slot costs a full-precision token's bytes.
    assert stats.device_bytes == stats.attended_tokens * backend.bytes_per_token
    probe = [5, 6, 7]
    reference = reference_logits(tiny_model, session.token_ids(), probe)
    assert (session.continuation_logits(probe) - reference).abs().max().item() <= TOL


def test_pressure_quantizes_in_attention_before_archiving(tiny_model, tiny_tokenizer):
    history = notes(6)
    free = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig()).session("free")
    free.extend(history)
    full_bytes = free.stats().device_bytes
    # Room for about half of the history at full precision: int4 in attention fits all of it.
    # The old order by name: every span at int4 before any archive (the default keeps needed spans full).
    budget = {"device_bytes": full_bytes // 2, "low_watermark": 0.9, "placement_order": "attended_first"}
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"budget": budget}))
    session = backend.session("t")
    session.extend(history)
    session.check()
    stats = session.stats()
    assert stats.budget_satisfied and stats.device_bytes <= full_bytes // 2
    assert stats.attended_quantized_tokens > 0
    assert all(s.tier.attended for s in session.spans), "int4 in attention fits: nothing archived"
    assert any(s.tier is Tier.ATTENDED_QUANTIZED for s in session.spans)
    assert stats.attended_tokens == free.stats().attended_tokens
    # A slot counts as held quantized only where every layer holds it so.
    assert session.store.attended_quantized_tokens() == stats.attended_quantized_tokens
    # Still attended, and close to the full cache (lossy, not exact).
    probe = [5, 6, 7]
    managed = session.continuation_logits(probe)
    reference = reference_logits(tiny_model, session.token_ids(), probe)
    assert (managed - reference).abs().max().item() <= 0.1 * float(reference.max() - reference.min())
    # The same budget without the attended tier archives instead.
    archive_only = {"budget": budget, "quantization": {"attended_bits": None}}
    other_backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(archive_only))
    other = other_backend.session("a")
    other.extend(history)
    assert other.stats().attended_quantized_tokens == 0
    assert any(s.state is SpanState.ARCHIVED for s in other.spans)


def test_forks_share_an_unquantized_cache_and_copy_only_when_quantized(tiny_model, tiny_tokenizer):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())
    parent = backend.session("t")
    history = notes(3)
    parent.extend(history)
    probe = [5, 6, 7]
    before = parent.continuation_logits(probe)
    held = parent.stats().device_bytes
    # The branch has a budget its parent's history already fills: its next turn brings pressure.
    child = parent.fork("b", config=AgentKVConfig.from_dict({"budget": {"device_bytes": held}}))
    shared = child.stats()
    assert shared.shared_device_bytes == shared.device_bytes == held  # the parent's tensors, not a copy
    # Under pressure the branch's first quantization takes its own copy.
    child.extend([*history, {"role": "user", "content": "branch b: a longer note " * 6}])
    child.check()
    assert child.stats().attended_quantized_tokens > 0
    assert child.stats().shared_device_bytes == 0
    assert parent.stats().attended_quantized_tokens == 0
    assert torch.equal(parent.continuation_logits(probe), before)  # the parent's cache is untouched
