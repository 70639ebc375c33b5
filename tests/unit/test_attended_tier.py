"""The attended quantized tier (KIVI int4/int2 in attention, demoted to by the budget before archiving).

Tolerances, and why: int4 round-to-nearest puts every key/value within half a step
of its group's range (range / 15 / 2 per group; for the tiny random model's KV that
is a few hundredths), and a softmax over perturbed keys moves the logits by about
that much times the value norm. The session test bounds the logit error relative to
the logits' own spread (max |Δ| <= 5% of max |logit| at int4, 20% at int2) and
requires the same greedy token. With nothing quantized the layer returns its exact
tensors, so the logits are those of the full-precision cache exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.spans import SpanState, Tier
from agentkv.store.attended import QuantizedAttendedLayer, check_attended_spec, quantize_layers
from agentkv.store.block import tensor_bytes
from agentkv.store.cache import SharedPrefixLayer
from agentkv.store.kivi import MAX_KEY_BLOCKS, key_blocks, value_group
from tests.unit.store_moves import quantize

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code is 4417. Remember the package tracking number ZX-99. " * 6},
    {"role": "assistant", "content": "the tool returned sunny skies in Paris " * 4},
    {"role": "user", "content": "What is the secret code?"},
]


def _layer(bits: int, group: int = 16, key_bits: int | None = None) -> QuantizedAttendedLayer:
    return QuantizedAttendedLayer(bits, group, 0, key_bits)


def _within_half_a_step(got: torch.Tensor, want: torch.Tensor, bits: int, dim: int, group: int) -> bool:
    """Every element within half a step of its group's range (groups of `group` along `dim`)."""
    moved_got, moved_want = got.movedim(dim, -1), want.movedim(dim, -1)
    n = moved_want.shape[-1]
    lead = moved_want.shape[:-1]
    grouped = moved_want.reshape(*lead, n // group, group)
    step = (grouped.amax(dim=-1) - grouped.amin(dim=-1)) / ((1 << bits) - 1)  # [..., n / G]
    err = (moved_got - moved_want).abs().reshape(*lead, n // group, group).amax(dim=-1)
    return bool((err <= step / 2 * 1.01 + 1e-3).all())


@pytest.mark.parametrize(("bits", "key_bits"), [(4, 4), (2, 2), (2, 4)])
def test_quantized_slots_within_half_a_step_and_the_rest_exact(bits: int, key_bits: int) -> None:
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    layer = _layer(bits, key_bits=key_bits)
    out = layer.update(k, v)
    assert out[0] is layer.keys and torch.equal(out[0], k)  # nothing quantized: the exact tensors
    assert layer.quantize(torch.arange(20, 84)) == 64  # four key groups of 16
    assert layer.quantized_length == 64 and layer.exact_length == 36
    full = layer.full()
    assert full is not None
    got_k, got_v = full
    for part in (slice(0, 20), slice(84, 100)):
        assert torch.equal(got_k[:, :, part], k[:, :, part]) and torch.equal(got_v[:, :, part], v[:, :, part])
    assert _within_half_a_step(got_k[:, :, 20:84], k[:, :, 20:84], key_bits, dim=2, group=16)
    assert _within_half_a_step(got_v[:, :, 20:84], v[:, :, 20:84], bits, dim=3, group=value_group(16, 16))
    assert layer.quantize(torch.arange(20, 84)) == 0  # already quantized: never re-quantized


def test_removal_keeps_whole_groups_bit_for_bit_and_frees_their_bytes() -> None:
    torch.manual_seed(2)
    k, v = torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    layer = _layer(4)
    layer.update(k, v)
    layer.quantize(torch.arange(0, 40))  # key groups: 0-15, 16-31, 32-39 (a partial one)
    layer.quantize(torch.arange(60, 80))  # 60-75, 76-79
    assert layer.key_scales is not None and layer.key_scales.shape[2] == 5
    full = layer.full()
    assert full is not None
    # Drop tokens 16-31 (a whole group), half of group 0, and some exact slots; permute the rest.
    keep = torch.cat([torch.arange(8, 16), torch.arange(32, 60), torch.arange(70, 96)]).flip(0)
    layer.select(keep)
    after = layer.full()
    assert after is not None
    assert torch.equal(after[0], full[0].index_select(2, keep))
    assert torch.equal(after[1], full[1].index_select(2, keep))
    assert layer.key_scales is not None and layer.key_scales.shape[2] == 4  # the emptied group is gone
    # Bytes: codes of the quantized slots kept, their value statistics, four key groups' statistics.
    q, e, d = layer.quantized_length, layer.exact_length, 16
    assert q == 8 + 8 + 10 and e == int(keep.numel()) - q
    per_slot_codes = 2 * d // 2  # keys and values, int4, one head's channels
    stats = 2 * 2  # scale and zero, float16
    expected = 2 * (q * per_slot_codes + q * (d // value_group(d, 16)) * stats)
    expected += 2 * 4 * d * stats + 2 * 2 * e * d * 4
    assert sum(tensor_bytes(t) for t in layer.own_tensors()) == expected
    # Appending and cutting back restore the same state.
    layer.update(k[:, :, :5], v[:, :, :5])
    layer.cut_to(int(keep.numel()))
    again = layer.full()
    assert again is not None and torch.equal(again[0], after[0]) and torch.equal(again[1], after[1])


def _mixed_layer(seed: int) -> tuple[QuantizedAttendedLayer, torch.Tensor]:
    """A layer with exact and quantized runs, compacted once; and the slots it holds, `[N]`."""
    torch.manual_seed(seed)
    layer = _layer(4)
    layer.update(torch.randn(1, 2, 120, 16), torch.randn(1, 2, 120, 16))
    layer.quantize(torch.arange(10, 70))
    layer.quantize(torch.arange(90, 105))
    layer.select(torch.cat([torch.arange(0, 30), torch.arange(40, 120)]))
    return layer, torch.arange(110)


def test_keys_at_reads_only_the_asked_slots_and_matches_the_full_read() -> None:
    layer, _ = _mixed_layer(3)
    slots = torch.tensor([105, 3, 12, 80, 29, 64, 0, 95])  # exact and quantized, any order
    full = layer.full()
    assert full is not None
    got = layer.keys_at(slots)
    assert got is not None and torch.equal(got, full[0].index_select(2, slots))
    # A layer with a shared prefix reads across the prefix / own boundary the same way.
    k, v = torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    shared = SharedPrefixLayer()
    shared.update(k[:, :, :30], v[:, :, :30])
    shared.freeze_as_prefix()
    shared.update(k[:, :, 30:], v[:, :, 30:])
    picked = torch.tensor([45, 2, 29, 30, 7])
    got_shared = shared.keys_at(picked)
    assert got_shared is not None and torch.equal(got_shared, k.index_select(2, picked))


def test_layers_quantized_in_one_batch_equal_each_quantized_alone() -> None:
    torch.manual_seed(4)
    batched = [_layer(4, key_bits=4) for _ in range(11)]  # more than one batch of LAYER_BATCH
    alone = [_layer(4, key_bits=4) for _ in range(11)]
    for a, b in zip(batched, alone, strict=True):
        k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
        a.update(k, v)
        b.update(k.clone(), v.clone())
    slots = torch.arange(5, 50)
    assert quantize_layers(batched, slots) == 45
    for a, b in zip(batched, alone, strict=True):
        assert b.quantize(slots) == 45
        fa, fb = a.full(), b.full()
        assert fa is not None and fb is not None
        assert torch.equal(fa[0], fb[0]) and torch.equal(fa[1], fb[1])
        assert a.key_codes is not None and b.key_codes is not None and torch.equal(a.key_codes, b.key_codes)


def test_a_repeated_read_is_remembered_and_any_change_reads_afresh() -> None:
    layer, _ = _mixed_layer(5)
    first, second = layer.full(), layer.full()
    assert first is not None and second is not None
    assert second[0] is first[0] and second[1] is first[1]  # the probe's second read costs nothing
    expected = (first[0].clone(), first[1].clone())
    other, _ = _mixed_layer(6)
    other_read = other.full()
    assert other_read is not None and other_read[0] is not first[0]  # never another layer's read
    layer.update(torch.ones(1, 2, 1, 16), torch.ones(1, 2, 1, 16))
    grown = layer.full()
    assert grown is not None and grown[0].shape[2] == 111 and torch.equal(grown[0][:, :, :110], expected[0])
    layer.select(torch.arange(1, 111))
    cut = layer.full()
    assert cut is not None and torch.equal(cut[1], grown[1][:, :, 1:])
    layer.quantize(torch.arange(90, 110))
    again = layer.full()
    assert again is not None and not torch.equal(again[0][:, :, 90:110], cut[0][:, :, 90:110])


def test_bytes_far_below_full_precision_when_everything_is_quantized() -> None:
    k, v = torch.randn(1, 2, 512, 64), torch.randn(1, 2, 512, 64)
    for bits, key_bits, most in ((4, 4, 0.17), (2, 4, 0.13), (2, 2, 0.10)):
        layer = _layer(bits, group=32, key_bits=key_bits)
        layer.update(k, v)
        layer.quantize(torch.arange(512))
        held = sum(tensor_bytes(t) for t in layer.own_tensors())
        assert held < most * (tensor_bytes(k) + tensor_bytes(v)), (bits, key_bits, held)


def _backend(tiny_model: Any, tiny_tokenizer: Any, data: dict[str, Any]) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict(data))


def _last_logits(session: Any) -> torch.Tensor:
    prompt = session.format.generation_prompt_ids(session.messages)
    return session.continuation_logits(prompt)[-1]


def test_nothing_quantized_is_exactly_the_full_cache(tiny_model: Any, tiny_tokenizer: Any) -> None:
    plain = _backend(tiny_model, tiny_tokenizer, {"policy": "lifecycle"}).session("p")
    plain.extend(MESSAGES)
    tiered = _backend(
        tiny_model, tiny_tokenizer, {"policy": "lifecycle", "quantization": {"attended_bits": 4}}
    ).session("q")
    tiered.extend(MESSAGES)
    tiered.check()
    assert tiered.store.attended_quantized_tokens() == 0  # no budget: no pressure, nothing quantized
    assert torch.equal(_last_logits(tiered), _last_logits(plain))


@pytest.mark.parametrize(
    ("quantization", "tolerance"), [({"attended_bits": 4}, 0.05), ({"attended_bits": 2}, 0.20)]
)
def test_quantized_in_attention_logits_close_to_full_precision(
    tiny_model: Any, tiny_tokenizer: Any, quantization: dict[str, Any], tolerance: float
) -> None:
    plain = _backend(tiny_model, tiny_tokenizer, {"policy": "full"}).session("p")
    plain.extend(MESSAGES)
    full = _last_logits(plain)
    settings = {**quantization, "group_size": 16, "attended_residual_tokens": 16}
    session = _backend(tiny_model, tiny_tokenizer, {"policy": "full", "quantization": settings}).session("q")
    session.extend(MESSAGES)
    for span in session.spans:
        quantize(session.store, [span])
    session.check()
    assert any(s.tier is Tier.ATTENDED_QUANTIZED for s in session.spans)  # `check` compared them to slots
    held = session.store.physical.length
    # All but the 4 sink positions and the 16-token residual window are quantized.
    assert session.store.attended_quantized_tokens() == held - 4 - 16
    quant = _last_logits(session)
    err = float((quant - full).abs().max())
    scale = float(full.abs().max())
    assert 0 < err <= tolerance * scale, f"{quantization}: max |Δlogit| {err:.4f} vs max |logit| {scale:.4f}"
    assert int(quant.argmax()) == int(full.argmax())


@pytest.mark.parametrize(
    ("content", "tier"),
    [
        (MESSAGES[1]["content"] + "Also the gate code is 12.", Tier.ATTENDED_QUANTIZED),
        ("A different question.", Tier.DEVICE),  # only its exact leading tokens stay
    ],
)
def test_a_rewritten_message_keeps_its_start_on_the_tier_its_slots_are_on(
    tiny_model: Any, tiny_tokenizer: Any, content: str, tier: Tier
) -> None:
    settings = {
        "attended_bits": 4,
        "group_size": 16,
        "attended_residual_tokens": 16,
        "attended_sink_tokens": 64,
    }
    session = _backend(tiny_model, tiny_tokenizer, {"policy": "full", "quantization": settings}).session("r")
    session.extend(MESSAGES)
    quantize(session.store, list(session.spans))
    span = session.spans[1]
    assert span.tier is Tier.ATTENDED_QUANTIZED and span.start + 1 < 64 < span.end
    session.extend([MESSAGES[0], {"role": "user", "content": content}])
    session.check()  # the tier agrees with the slots the rewrite kept
    assert session.spans[1] is span and session.stats().reused_tokens > 0  # the message kept its start
    assert span.state is SpanState.ACTIVE and span.tier is tier


def test_a_rewritten_question_keeps_its_start_and_is_active_again(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    """The new message's turn first ends the one before (committing it); the rewritten question is new."""
    session = _backend(tiny_model, tiny_tokenizer, {"policy": "lifecycle"}).session("q")
    session.extend(MESSAGES)
    question = session.spans[-1]
    assert question.state is SpanState.ACTIVE
    session.extend([*MESSAGES[:-1], {"role": "user", "content": "What is the secret code again?"}])
    assert session.spans[-1] is question and question.state is SpanState.ACTIVE and not question.frozen
    session.check()


def _budget_session(
    tiny_model: Any, tiny_tokenizer: Any, device_tokens: int, order: str = "needed_last"
) -> tuple[Any, Any]:
    backend = _backend(
        tiny_model,
        tiny_tokenizer,
        {
            "policy": "lifecycle",
            "archive_tier": "drop",
            "budget": {"device_tokens": device_tokens, "placement_order": order},
            "quantization": {"attended_bits": 4, "group_size": 16, "attended_residual_tokens": 16},
        },
    )
    return backend, backend.session("b")


def test_budget_quantizes_in_attention_before_archiving(tiny_model: Any, tiny_tokenizer: Any) -> None:
    # History of ~300 tokens; 45% of it in fp32 bytes holds all of it at int4 plus the window and sinks.
    backend, session = _budget_session(tiny_model, tiny_tokenizer, 10_000)
    history = list(MESSAGES[:2])
    for turn in range(4):
        history = [*history, {"role": "user", "content": f"lorem ipsum dolor {turn} " * 8}]
    session.extend(history)
    logical = session.stats().logical_tokens
    # The old order by name: every span at int4 before any archive (the default keeps needed spans full).
    backend, session = _budget_session(tiny_model, tiny_tokenizer, int(logical * 0.45), "attended_first")
    session.extend(history)
    session.check()
    stats = session.stats()
    assert stats.budget_satisfied and stats.attended_tokens == stats.logical_tokens  # nothing left attention
    assert all(s.tier.attended for s in session.spans)
    assert stats.tokens_by_tier["attended_quantized"] > 0
    assert sum(stats.tokens_by_tier.values()) == stats.logical_tokens
    assert any(s.tier is Tier.ATTENDED_QUANTIZED for s in session.spans)
    assert session.store.attended_quantized_tokens() > 0
    walked = sum(tensor_bytes(t) for t in session.store.physical.tensors())
    assert stats.device_bytes == walked < stats.attended_tokens * backend.runner.bytes_per_token


def test_budget_archives_only_once_everything_demotable_is_quantized(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    backend, session = _budget_session(tiny_model, tiny_tokenizer, 40)
    history = list(MESSAGES[:2])
    session.extend(history)
    for turn in range(4):
        history = [*history, {"role": "user", "content": f"lorem ipsum dolor {turn} " * 8}]
        session.extend(history)
        session.check()
        child = session.fork(f"branch-{turn}")
        child.extend([*history, {"role": "assistant", "content": "consectetur adipiscing elit"}])
        child.check()
        backend.close(child.session_id)
    store = session.store
    archived = [s for s in session.spans if s.state in (SpanState.ARCHIVED, SpanState.EVICTED)]
    assert archived, "a 40-token budget must archive something"
    # Every committed span still attended is quantized as far as the sinks and window allow.
    for span in session.spans:
        if span.tier.attended and span.state is SpanState.COMMITTED and not span.pinned:
            assert quantize(store, [span]) == 0, span
    stats = session.stats()
    walked = sum(tensor_bytes(t) for t in store.physical.tensors())
    assert stats.device_bytes == walked
    assert session.generate(max_new_tokens=3) is not None


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"attended_bits": 3}, "attended_bits"),
        ({"attended_bits": 8}, "attended_bits"),
        ({"attended_residual_tokens": -1}, "attended_residual_tokens"),
        ({"attended_key_bits": 3}, "attended_key_bits"),
        ({"attended_sink_tokens": -1}, "attended_sink_tokens"),
    ],
)
def test_bad_attended_config_is_a_clear_error(quantization: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentKVConfig.from_dict({"quantization": quantization})


def test_bad_attended_spec_names_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"expected one of \[4, 2\], got 3"):
        check_attended_spec(3, 32, 8)
    with pytest.raises(ValueError, match="group_size: expected an int >= 1, got 0"):
        check_attended_spec(4, 0, 8)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4 for 2-bit codes, got 6"):
        check_attended_spec(2, 32, 8, head_dim=6)
    with pytest.raises(ValueError, match=r"key_bits: expected one of \[8, 4, 2\], got 3"):
        check_attended_spec(4, 32, 8, key_bits=3)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 2 for 4-bit codes, got 5"):
        check_attended_spec(4, 32, 8, head_dim=5, key_bits=8)  # 8-bit keys are two 4-bit planes


def test_scoring_reads_only_what_the_policy_needs(tiny_model: Any, tiny_tokenizer: Any) -> None:
    from agentkv.lifecycle.compression import span_view
    from agentkv.policies import make_policy
    from agentkv.store.tokens import read_tokens

    backend, session = _budget_session(tiny_model, tiny_tokenizer, 10_000)
    session.extend(list(MESSAGES))
    store = session.store
    physical = store.physical
    physical.quantize_slots(torch.arange(4, physical.length - 16))
    slots = physical.slots_of(session.spans[1].span_id)
    table = session.table
    # The lifecycle policy reads attention, kinds and recency, not keys: a commit dequantizes nothing.
    assert not make_policy("lifecycle").needs_keys and make_policy("key_norm").needs_keys
    lean = span_view(read_tokens(physical, slots, keys=False, queries=False), table)
    assert lean.keys == () and lean.query_keys is None and lean.num_tokens == int(slots.numel())
    full_view = span_view(read_tokens(physical, slots), table)
    assert len(full_view.keys) == physical.num_layers
    for layer, keys in enumerate(full_view.keys):
        held = physical.cache.managed_layers[layer].full()
        assert held is not None and torch.equal(keys, held[0].index_select(2, slots))


def test_quantizing_an_earlier_span_later_gives_the_same_layer() -> None:
    torch.manual_seed(7)
    k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    in_order, reversed_order = _layer(4), _layer(4)
    in_order.update(k, v)
    reversed_order.update(k.clone(), v.clone())
    in_order.quantize(torch.arange(5, 40))
    in_order.quantize(torch.arange(60, 90))
    reversed_order.quantize(torch.arange(60, 90))  # later span first: the earlier goes before it
    reversed_order.quantize(torch.arange(5, 40))
    a, b = in_order.full(), reversed_order.full()
    assert a is not None and b is not None
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(in_order.quant_index, reversed_order.quant_index)
    kept = torch.cat([torch.arange(0, 20), torch.arange(70, 100)])
    in_order.select(kept)
    reversed_order.select(kept)
    a, b = in_order.full(), reversed_order.full()
    assert a is not None and b is not None and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_spans_quantized_in_one_pass_equal_the_one_by_one_demotion(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": "noted: code 4417 and ZX-99 " * 5}]
    one_pass = _budget_session(tiny_model, tiny_tokenizer, 10_000)[1]
    one_by_one = _budget_session(tiny_model, tiny_tokenizer, 10_000)[1]
    one_pass.extend(history)
    one_by_one.extend(history)
    spans_a = [s for s in one_pass.spans if s.length > 8]
    spans_b = [s for s in one_by_one.spans if s.length > 8]
    need = 40_000  # more than the first span frees, less than all of them
    freed_b = 0
    for span in spans_b:
        if freed_b >= need:
            break
        freed_b += quantize(one_by_one.store, [span])
    freed_a = quantize(one_pass.store, spans_a, need)
    assert [s.tier for s in spans_a] == [s.tier for s in spans_b]
    assert freed_a == freed_b > need  # the savings were planned exactly
    assert 0 < one_pass.store.attended_quantized_tokens() < one_pass.store.physical.length
    for a, b in zip(
        one_pass.store.physical.cache.managed_layers,
        one_by_one.store.physical.cache.managed_layers,
        strict=True,
    ):
        fa, fb = a.full(), b.full()
        assert fa is not None and fb is not None
        assert torch.equal(fa[0], fb[0]) and torch.equal(fa[1], fb[1])
        assert isinstance(a, QuantizedAttendedLayer) and isinstance(b, QuantizedAttendedLayer)
        assert torch.equal(a.key_group, b.key_group) and torch.equal(a.quant_index, b.quant_index)


# -- the read path: one output, each slot written once, equal to the straightforward formula --


def _codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar codes by the definition: byte j holds channels j, j + D/p, ... at `bits` each, lowest first."""
    per, mask = 8 // bits, (1 << bits) - 1
    return torch.cat([(packed.long() >> (bits * i)) & mask for i in range(per)], dim=-1)  # [B, H, Q, D]


def _reference_read(layer: QuantizedAttendedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """code * scale + zero, statistics gathered per row, slots placed by index.

    Computed in float32 and rounded once to the output dtype: what `addcmul` does for
    float16 / bfloat16 (it computes in float32), as the read did before it wrote in place.
    """
    assert layer.key_codes is not None and layer.key_scales is not None and layer.key_zeros is not None
    assert layer.value_codes is not None and layer.value_scales is not None and layer.value_zeros is not None
    assert layer.keys is not None and layer.values is not None and layer.out_dtype is not None
    dtype = layer.out_dtype
    key_codes = _codes(layer.key_codes, layer.key_bits).float()
    key_scales = layer.key_scales.float()[:, :, layer.key_group]  # [B, H, Q, D]
    key_zeros = layer.key_zeros.float()[:, :, layer.key_group]
    keys = (key_codes * key_scales + key_zeros).to(dtype)
    value_codes = _codes(layer.value_codes, layer.bits).float()
    b, h, q, d = value_codes.shape
    per_group = d // int(layer.value_scales.shape[-1])
    value_scales = layer.value_scales.float().repeat_interleave(per_group, dim=-1)  # [B, H, Q, D]
    value_zeros = layer.value_zeros.float().repeat_interleave(per_group, dim=-1)
    values = (value_codes * value_scales + value_zeros).to(dtype)
    out_k = torch.full((b, h, layer.own_length, d), float("nan"), dtype=dtype)
    out_v = out_k.clone()
    out_k[:, :, layer.quant_index], out_v[:, :, layer.quant_index] = keys, values
    out_k[:, :, layer.exact_index], out_v[:, :, layer.exact_index] = layer.keys, layer.values
    return out_k, out_v


def _read_equals_reference(layer: QuantizedAttendedLayer) -> bool:
    full = layer.full()
    assert full is not None
    want = _reference_read(layer)
    return torch.equal(full[0], want[0]) and torch.equal(full[1], want[1])


def _shaped(layout: str, bits: int, key_bits: int, dtype: torch.dtype) -> QuantizedAttendedLayer:
    """A layer (groups of 8, D = 32) quantized into one of the layouts the read path tells apart."""
    torch.manual_seed(11)
    layer = _layer(bits, group=8, key_bits=key_bits)
    layer.update(torch.randn(2, 2, 200, 32, dtype=dtype), torch.randn(2, 2, 200, 32, dtype=dtype))
    if layout in ("regular", "thinned", "thinned-heavily"):
        layer.quantize(torch.arange(4, 164))  # 20 full key groups
    if layout == "partial":
        layer.quantize(torch.arange(4, 167))  # 20 full groups and one of 3
    if layout == "interleaved":  # exact sinks, two spans (the later one quantized first), exact between
        layer.quantize(torch.arange(100, 150))
        layer.quantize(torch.arange(4, 60))
    if layout == "many-runs":  # more quantized runs than MAX_DIRECT_RUNS: read at once, placed by index
        for start in range(0, 200, 25):
            layer.quantize(torch.arange(start, start + 10))
    if layout == "thinned":  # a few tokens of two groups dropped: those groups become blocks of their own
        layer.select(torch.cat([torch.arange(0, 20), torch.arange(23, 60), torch.arange(61, 200)]))
    if layout == "thinned-heavily":  # neighbouring groups thinned to different lengths: per-row gather
        drop = torch.tensor([4 + 8 * g + i for g in range(20) for i in range(g % 5 + 1)])
        keep = torch.ones(200, dtype=torch.bool)
        keep[drop] = False
        layer.select(keep.nonzero().flatten().flip(0))  # permuted too
    return layer


LAYOUTS = ["regular", "partial", "interleaved", "many-runs", "thinned", "thinned-heavily"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("bits", "key_bits"), [(4, 4), (2, 2), (2, 4)])
def test_the_read_equals_the_reference_dequantization_bit_for_bit(
    layout: str, bits: int, key_bits: int
) -> None:
    layer = _shaped(layout, bits, key_bits, torch.float32)
    assert layer.quantized_length and layer.exact_length
    assert _read_equals_reference(layer)
    plan = layer._plan
    assert plan is not None
    assert plan.direct == (layout != "many-runs")
    assert (plan.blocks[0] is None) == (layout == "thinned-heavily")  # the per-row gather is what it reads
    if layout == "thinned":
        assert plan.blocks[0] is not None and len(plan.blocks[0]) > 1


@pytest.mark.parametrize("layout", ["partial", "interleaved", "thinned-heavily"])
def test_the_read_in_half_precision_equals_the_reference(layout: str) -> None:
    layer = _shaped(layout, 4, 4, torch.float16)
    full = layer.full()
    assert full is not None and full[0].dtype == torch.float16
    assert _read_equals_reference(layer)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_decode_append_after_quantizing_reads_correctly(layout: str) -> None:
    layer = _shaped(layout, 4, 4, torch.float32)
    assert _read_equals_reference(layer)
    plan = layer._plan
    for step in range(3):  # appends keep the plan (quantized runs unchanged) and read the new slots
        token = torch.full((2, 2, 1, 32), float(step))
        k, _ = layer.update(token, token + 1)
        assert layer._plan is plan and torch.equal(k[:, :, -1:], token)
        assert _read_equals_reference(layer)
    assert layer.quantize(layer.exact_index[-12:-2]) == 10  # a change of layout: a new plan
    assert _read_equals_reference(layer) and layer._plan is not plan
    layer.update(torch.ones(2, 2, 1, 32), torch.ones(2, 2, 1, 32))
    assert _read_equals_reference(layer)
    layer.cut_to(layer.own_length - 5)
    assert _read_equals_reference(layer)


def test_key_blocks_merge_successive_full_groups_and_keep_the_others_apart() -> None:
    groups = torch.tensor([0] * 4 + [1] * 4 + [2] * 4 + [3] * 2 + [5] * 4 + [6] * 4)
    assert key_blocks(groups) == [(0, 3, 4, 0), (12, 1, 2, 3), (14, 2, 4, 5)]
    assert key_blocks(torch.empty(0, dtype=torch.long)) == []
    ragged = torch.cat([torch.full((g + 1,), g) for g in range(MAX_KEY_BLOCKS + 1)])
    assert key_blocks(ragged) is None


def test_token_counts_in_one_pass_equal_the_span_by_span_figures(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    # Some spans quantized, some exact, the sinks and the residual window exact; then a removal
    # left uncompacted inside `deferred_removal`: the planner's one-pass counts must agree throughout.
    history = list(MESSAGES[:2])
    for turn in range(4):
        history = [*history, {"role": "user", "content": f"lorem ipsum dolor {turn} " * 8}]
    probe = _budget_session(tiny_model, tiny_tokenizer, 10_000)[1]
    probe.extend(history)
    budget = int(probe.stats().logical_tokens * 0.6)
    session = _budget_session(tiny_model, tiny_tokenizer, budget, "attended_first")[1]
    session.extend(history)
    store = session.store

    def agree() -> None:
        spans = list(session.spans)
        counts = store.attended_token_counts(spans)
        assert counts == {
            s.span_id: (store.attended_quantized_tokens(s), store.quantizable_tokens(s)) for s in spans
        }

    agree()
    quantized = [s for s in session.spans if store.attended_quantized_tokens(s)]
    assert quantized and any(store.quantizable_tokens(s) for s in session.spans)
    with store.deferred_removal():
        store.drop(quantized[0])
        agree()
    agree()
