"""8-bit keys in two 4-bit planes (`agentkv.store.key_planes`): read, dropped per span, demoted by the budget.

Tolerances, and why: an 8-bit key is within half a step of its group's range / 255;
with the fine plane dropped it reads the middle of its 16-code bucket, at most 8
steps (range / 31.9) away, about the error of a round-to-nearest 4-bit key
(range / 30). The float16 statistics add a few ulps, hence the 1% and 1e-4 margins.
"""

from __future__ import annotations

from typing import Any

import torch

from agentkv.lifecycle.options import promotion
from agentkv.lifecycle.rungs import PROMOTION_CLASS, Rung, RungOption
from agentkv.spans import SpanState
from agentkv.store.attended import QuantizedAttendedLayer
from agentkv.store.block import tensor_bytes
from agentkv.store.key_planes import coarse_stats, split_planes
from agentkv.store.kivi import unpack_codes
from tests.unit.attended_sessions import GROUP, attended_session
from tests.unit.store_moves import quantize


def _group_range(k: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Per channel, each token's key-group range (groups of `GROUP` tokens from `first`): `[B, H, n, D]`."""
    part = k[:, :, first:last]
    b, h, n, d = part.shape
    grouped = part.reshape(b, h, n // GROUP, GROUP, d)
    spread = grouped.amax(dim=3, keepdim=True) - grouped.amin(dim=3, keepdim=True)
    return spread.expand(-1, -1, -1, GROUP, -1).reshape(b, h, n, d)


def _planes_layer(k: torch.Tensor, v: torch.Tensor) -> QuantizedAttendedLayer:
    layer = QuantizedAttendedLayer(4, GROUP, 0, key_bits=8)
    layer.update(k, v)
    return layer


def _read(layer: QuantizedAttendedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    full = layer.full()
    assert full is not None
    return full


def test_split_planes_recombine_to_the_8_bit_codes() -> None:
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    coarse, fine = split_planes(codes)
    assert coarse.shape == fine.shape == (4, 32)
    assert torch.equal(unpack_codes(coarse, 4).int() * 16 + unpack_codes(fine, 4).int(), codes.int())


def test_coarse_grid_reads_the_middle_of_each_bucket() -> None:
    scales, zeros = torch.tensor([0.5], dtype=torch.float16), torch.tensor([-3.0], dtype=torch.float16)
    s, z = coarse_stats(scales, zeros, torch.float32)
    # Fine codes 16 * hi .. 16 * hi + 15 read as 16 * hi + 7.5 on the 8-bit grid.
    assert float(s) == 8.0 and float(z + 2 * s) == -3.0 + (32 + 7.5) * 0.5


def test_8_bit_keys_within_half_a_step_and_4_bit_once_the_fine_plane_is_dropped() -> None:
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    layer = _planes_layer(k, v)
    assert layer.quantize(torch.arange(20, 84)) == 64
    assert layer.fine_length == 64
    got_k, got_v = _read(layer)
    step = _group_range(k, 20, 84) / 255
    assert bool(((got_k[:, :, 20:84] - k[:, :, 20:84]).abs() <= step / 2 * 1.01 + 1e-4).all())
    assert torch.equal(got_k[:, :, :20], k[:, :, :20]) and torch.equal(got_k[:, :, 84:], k[:, :, 84:])
    codes, scales = layer.key_codes, layer.key_scales
    assert layer.drop_fine(torch.arange(20, 52)) == 32 and layer.fine_length == 32
    assert layer.key_codes is codes and layer.key_scales is scales  # nothing re-quantized
    coarse_k, coarse_v = _read(layer)
    assert torch.equal(coarse_v, got_v)  # values untouched
    assert torch.equal(coarse_k[:, :, 52:], got_k[:, :, 52:])  # the slots that keep their fine plane
    err = (coarse_k[:, :, 20:52] - k[:, :, 20:52]).abs()
    assert bool((err <= step[:, :, :32] * 8 * 1.01 + 1e-4).all())
    assert float(err.max()) > float(step.max()) / 2  # really coarser than 8 bits
    assert layer.drop_fine(torch.arange(20, 52)) == 0  # already coarse


def test_dropping_the_fine_plane_frees_half_a_byte_per_key_element() -> None:
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    layer = _planes_layer(k, v)
    layer.quantize(torch.arange(0, 80))
    held = sum(tensor_bytes(t) for t in layer.own_tensors())
    layer.drop_fine(torch.arange(0, 40))
    assert held - sum(tensor_bytes(t) for t in layer.own_tensors()) == 40 * 2 * 16 // 2  # n * H * D / 2


def test_keys_at_selection_and_fork_keep_the_fine_plane_with_its_slots() -> None:
    torch.manual_seed(2)
    k, v = torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    layer = _planes_layer(k, v)
    layer.quantize(torch.arange(0, 40))
    layer.quantize(torch.arange(50, 80))
    layer.drop_fine(torch.arange(16, 32))
    before, _ = _read(layer)
    assert torch.equal(layer.keys_at(torch.tensor([70, 3, 20, 90])), before[:, :, [70, 3, 20, 90]])
    fork = QuantizedAttendedLayer(4, GROUP, 0, key_bits=8)
    fork.copy_from(layer)
    assert torch.equal(_read(fork)[0], before)
    keep = torch.cat([torch.arange(8, 24), torch.arange(60, 96)]).flip(0)
    layer.select(keep)
    assert torch.equal(_read(layer)[0], before[:, :, keep])
    assert layer.fine_length == 8 + 20  # slots 8-15 and 60-79 had their fine plane
    layer.update(k[:, :, :1], v[:, :, :1])  # a decode append after the selection
    assert torch.equal(_read(layer)[0][:, :, :-1], before[:, :, keep])


def _history() -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(5):
        history.append({"role": "user", "content": f"lorem ipsum dolor {turn} sit amet " * 8})
    return history


def _walk(history: list[dict[str, Any]], session: Any) -> None:
    for i in range(2, len(history) + 1):
        session.extend(history[:i])
        session.check()


def test_budget_drops_fine_planes_before_archiving_and_keeps_them_when_there_is_room(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    history = _history()
    sizing = attended_session(tiny_model, tiny_tokenizer, 8)
    sizing.extend(history)
    logical = sizing.stats().logical_tokens
    # Roomy: everything fits at 8-bit keys once quantized (K8V4 is ~22% of fp32 here plus the window).
    roomy = attended_session(tiny_model, tiny_tokenizer, 8, int(logical * 0.6))
    _walk(history, roomy)
    store = roomy.store
    assert roomy.stats().budget_satisfied and store.attended_quantized_tokens() > 0
    assert store.fine_key_tokens() == store.attended_quantized_tokens()  # no key went to 4 bits
    # Tight: every key at 8 bits does not fit under the limit, every key at 4 bits does.
    tight = attended_session(tiny_model, tiny_tokenizer, 8, int(logical * 0.28))
    _walk(history, tight)
    stats, store = tight.stats(), tight.store
    assert stats.budget_satisfied and stats.attended_tokens == stats.logical_tokens  # nothing archived
    assert all(s.tier.attended for s in tight.spans)
    assert 0 <= store.fine_key_tokens() < store.attended_quantized_tokens()
    assert stats.device_bytes == sum(tensor_bytes(t) for t in store.physical.tensors())
    # Tighter still: in one demotion, spans leave attention only once no key is left at 8 bits.
    # (Across turns a newer span may hold 8-bit keys while an older one that left stays out:
    # the budget drops fine planes only down to its limit, and recall brings spans back.)
    tighter = attended_session(tiny_model, tiny_tokenizer, 8, 40)
    tighter.extend(history)
    tighter.check()
    archived = [s for s in tighter.spans if s.state in (SpanState.ARCHIVED, SpanState.EVICTED)]
    assert archived and tighter.store.fine_key_tokens() == 0
    assert tighter.generate(max_new_tokens=3) is not None


def test_8_bit_keys_give_logits_closer_to_full_precision_than_4_bit_keys(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    history = _history()
    plain = attended_session(tiny_model, tiny_tokenizer, 4)
    plain.extend(history)
    prompt = plain.format.generation_prompt_ids(plain.messages)
    full = plain.continuation_logits(prompt)[-1]
    errors = {}
    for key_bits in (4, 8):
        session = attended_session(tiny_model, tiny_tokenizer, key_bits)
        session.extend(history)
        assert torch.equal(session.continuation_logits(prompt)[-1], full)  # nothing quantized: exact
        for span in session.spans:
            quantize(session.store, [span])
        session.check()
        errors[key_bits] = float((session.continuation_logits(prompt)[-1] - full).abs().max())
    assert 0 < errors[8] < errors[4]


def test_coarsening_spans_together_ends_as_dropping_their_planes_one_span_at_a_time(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    history = _history()
    together, alone = (attended_session(tiny_model, tiny_tokenizer, 8) for _ in range(2))
    for session in (together, alone):
        session.extend(history)
        for span in session.spans:
            quantize(session.store, [span])
    spans = [s for s in alone.spans if alone.store.fine_key_tokens(s)]
    assert len(spans) >= 3
    # Ask for one byte more than the first span's fine planes: exactly the first two spans go.
    store = alone.store
    first = store.physical.nbytes()
    layers = [x for x in store.physical.cache.managed_layers if isinstance(x, QuantizedAttendedLayer)]
    for layer in layers:
        layer.drop_fine(store.physical.slots_of(spans[0].span_id))
    wanted = first - store.physical.nbytes() + 1
    for layer in layers:
        layer.drop_fine(store.physical.slots_of(spans[1].span_id))
    freed = together.store.coarsen_attended_until(list(together.spans), wanted)
    assert freed == first - store.physical.nbytes() >= wanted
    assert together.store.fine_key_tokens() == store.fine_key_tokens() > 0
    merged = [
        x for x in together.store.physical.cache.managed_layers if isinstance(x, QuantizedAttendedLayer)
    ]
    for a, b in zip(merged, layers, strict=True):
        assert torch.equal(a.fine_index, b.fine_index) and a.key_fine is not None and b.key_fine is not None
        assert torch.equal(a.key_fine, b.key_fine)
    assert (
        together.store.coarsen_attended_until(list(together.spans), 0) == 0
    )  # nothing asked: nothing dropped


def best_match_upgrade(extra_bytes: int) -> Any:
    """Exact recall's upgrade of the best match (given up after every other step), `extra_bytes` more."""
    return promotion(
        -2,
        1.0,
        RungOption(Rung.FULL, extra_bytes, 0.0),
        RungOption(Rung.ATTENDED_Q, 0, 0.25),
        klass=PROMOTION_CLASS,
        order=0,
        last=True,
    )


def test_exact_recall_does_not_take_the_fine_planes_for_room(tiny_model: Any, tiny_tokenizer: Any) -> None:
    # A key at 8 bits reads about as well as an exact one, for a thirteenth of the bytes an exact
    # token adds: exact recall's plan (`spare=True`) keeps the fine planes, not as room to reclaim.
    history = _history()
    session = attended_session(tiny_model, tiny_tokenizer, 8, 10_000)
    session.extend(history)
    for span in session.spans:
        quantize(session.store, [span])
    fine = session.store.fine_key_bytes()
    assert fine > 0
    placer = session.manager.placer
    unit = best_match_upgrade(fine)
    target = placer.usage_bytes()
    spared = placer.plan_promotions([unit], target, spare=True)
    assert -2 not in spared.raised
    assert not any(rung in (Rung.ATTENDED_Q, Rung.ARCHIVED, Rung.DROPPED) for rung in spared.rungs.values())
    # Without the bound the fine planes (or whole spans) are room, and the upgrade fits.
    assert -2 in placer.plan_promotions([unit], target).raised


def test_a_released_span_is_quantized_before_it_is_dropped_and_an_upgrade_never_drops_it(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    """The grace queue steps down its attended rungs first; an upgrade (`spare`) only quantizes for room."""
    from agentkv.lifecycle.rungs import ATTENDED_RUNGS

    session = attended_session(tiny_model, tiny_tokenizer, 8, 10_000)
    session.extend(_history())
    released = [s for s in session.spans if s.kind.value == "user"][-1]
    for span in session.spans:
        if span is not released:
            quantize(session.store, [span])
    session.manager.mover.move(released, SpanState.EVICTABLE, reason="test: released")
    placer = session.manager.placer
    (choice,) = [c for c in placer._span_options() if c.span_id == released.span_id]
    assert [o.rung for o in choice.options] == [Rung.FULL, Rung.KEYS8, Rung.ATTENDED_Q, Rung.DROPPED]
    exact, keys8 = choice.options[0].device_bytes, choice.options[1].device_bytes
    usage = placer.usage_bytes()
    # Quantizing the released span closes a gap it can: it stays attended (the budget's plan).
    plan = placer.plan_promotions([], usage - (exact - keys8))
    assert plan.rungs[released.span_id] in ATTENDED_RUNGS and plan.met
    # An upgrade as large as the released span: it is not dropped for it; without `spare` it is.
    unit = best_match_upgrade(exact)
    spared = placer.plan_promotions([unit], usage, spare=True)
    assert spared.rungs.get(released.span_id, Rung.FULL) in ATTENDED_RUNGS
    assert placer.plan_promotions([unit], usage).rungs[released.span_id] is Rung.DROPPED
