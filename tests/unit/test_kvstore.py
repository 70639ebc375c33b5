"""KVStore on a live session: slot order, batched restores, one compaction per budget check, bytes.

These are tests of the store itself (`agentkv.store.kvstore`, `agentkv.store.cache`), so they
read its physical cache directly; tests of the session and the lifecycle go through the public API.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.spans import SpanState, Tier
from tests.unit.session_history import HISTORY, TOL
from tests.unit.store_moves import archive, restore


@pytest.fixture()
def backend(tiny_model, tiny_tokenizer) -> TransformersBackend:
    return TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"policy": "full"}))


def assert_matches_full(session, model, probe: list[int]) -> None:
    """Continuation logits over the managed cache equal a plain forward of all tokens."""
    managed = session.continuation_logits(probe)
    with torch.inference_mode():
        reference = model(input_ids=torch.tensor([session.token_ids() + probe])).logits[0, -len(probe) :]
    assert (managed - reference.float()).abs().max().item() <= TOL


def test_random_permutation_of_physical_cache_keeps_logits(backend, tiny_model):
    session = backend.session("t")
    session.extend(HISTORY)
    physical = session.store.physical
    physical.permute(torch.randperm(physical.length, generator=torch.Generator().manual_seed(1)))
    assert_matches_full(session, tiny_model, [11, 12, 13])
    session.check()


def test_restoring_several_spans_at_once_is_exact_and_one_append(backend, tiny_model, monkeypatch):
    session = backend.session("t")
    session.extend(HISTORY)
    spans = [session.spans[i] for i in (1, 3, 5)]
    for span in spans:
        archive(session.store, span, "host")
    appends: list[int] = []
    physical = session.store.physical
    original = physical.append_blocks

    def counted(items, windows=None):
        appends.append(len(items))
        original(items, windows)

    monkeypatch.setattr(physical, "append_blocks", counted)
    restore(session.store, spans)
    assert appends == [3]
    assert all(s.tier is Tier.DEVICE for s in spans)
    assert session.stats().host_bytes == 0
    assert_matches_full(session, tiny_model, [21, 22])
    session.check()


def test_byte_accounting_equals_tensors(backend):
    session = backend.session("t")
    session.extend(HISTORY)
    archive(session.store, session.spans[1], "host")
    archive(session.store, session.spans[3], "int4")
    tiers = session.store.bytes_by_tier()
    layers = session.store.physical.cache.managed_layers
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in layers)
    assert tiers.device == held
    assert tiers.host == session.store.blocks[session.spans[1].span_id].nbytes
    assert tiers.quantized == session.store.blocks[session.spans[3].span_id].nbytes


def test_one_budget_check_compacts_the_cache_once(tiny_model, tiny_tokenizer, monkeypatch):
    # Demoting k spans in one budget check must copy the attended cache once, not k times.
    config = AgentKVConfig.from_dict({"budget": {"device_tokens": 200, "low_watermark": 0.3}})
    backend = TransformersBackend(tiny_model, tiny_tokenizer, config)
    session = backend.session("t")
    physical = session.store.physical
    compactions: list[int] = []
    original = physical._select

    def counted(keep):
        compactions.append(int(keep.numel()))
        original(keep)

    monkeypatch.setattr(physical, "_select", counted)
    history = [{"role": "system", "content": "You are a helpful assistant."}]
    most_demoted = 0
    for i in range(8):
        history.append({"role": "user", "content": f"note {i}: the secret code is 44{i}7 lorem ipsum"})
        history.append({"role": "assistant", "content": f"noted {i}"})
        before = {s.span_id for s in session.spans if s.state is SpanState.ARCHIVED}
        compactions.clear()
        session.extend(history)
        demoted = {s.span_id for s in session.spans if s.state is SpanState.ARCHIVED} - before
        most_demoted = max(most_demoted, len(demoted))
        assert len(compactions) <= 1
        session.check()
    assert most_demoted >= 2


# -- sliding layers ----------------------------------------------------------------------------


def test_sliding_layers_hold_the_window_in_any_slot_order_and_the_probe_scatters_onto_slots(tiny_tokenizer):
    """A windowed model's cache: sliding layers hold the last window - 1 slots, whatever the order;
    the attention probe's weights of a sliding layer land on the slots its keys are."""
    from agentkv.backend.runner import Feed
    from agentkv.policies import AttentionProbe
    from tests.unit.window_models import WINDOW, build_case, open_session

    model = build_case("gemma3")
    session = open_session(model, tiny_tokenizer)
    physical = session.store.physical
    assert physical.windowed and int(physical.slot_window.sum()) == WINDOW - 1
    newest = int(physical.slot_position.max())
    assert physical.slot_position[physical.slot_window].tolist() == list(
        range(newest - WINDOW + 2, newest + 1)
    )
    physical.permute(torch.randperm(physical.length, generator=torch.Generator().manual_seed(1)))
    assert sorted(physical.slot_position[physical.slot_window].tolist()) == list(
        range(newest - WINDOW + 2, newest + 1)
    )
    assert_matches_full(session, model, [5, 6, 7])
    session.check()
    # The probe over the cache against eager attention of a plain forward (positions = columns).
    ids = session.token_ids()
    probe_ids = [5, 6, 7, 9]
    start = len(ids)
    feed = Feed(probe_ids, list(range(start, start + 4)), [-1] * 4, list(range(4)))
    before = physical.length
    order = physical.slot_position.clone()  # slot -> position (the probe's tokens last)
    with physical.whole_window(), AttentionProbe(model, window=2) as probe:
        session.runner.forward(physical, feed, logits="none", probe=probe)
    layers = probe.layer_attention
    physical.truncate(before)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        out = eager(input_ids=torch.tensor([ids + probe_ids]), output_attentions=True)
    for layer, weights in layers.items():
        reference = out.attentions[layer][0, :, -2:].float().mean(dim=(0, 1))  # [positions]
        on_slots = reference[torch.cat([order, torch.arange(start, start + 4)])]
        assert (weights - on_slots).abs().max().item() <= TOL, f"layer {layer}"


def test_the_attended_quantized_tier_holds_the_full_layers_and_sliding_ones_stay_exact(tiny_tokenizer):
    from agentkv.spans import SpanKind
    from agentkv.store.attended import QuantizedAttendedLayer
    from tests.unit.store_moves import quantize
    from tests.unit.window_models import HISTORY as WINDOW_HISTORY
    from tests.unit.window_models import WINDOW, build_case, open_session

    session = open_session(build_case("gemma3"), tiny_tokenizer)
    (tool,) = [s for s in session.spans if s.kind is SpanKind.TOOL_RESULT]
    quantize(session.store, [tool])
    physical = session.store.physical
    layers = physical.cache.managed_layers
    assert session.store.attended_quantized_tokens(tool) > 0
    assert all(isinstance(layers[i], QuantizedAttendedLayer) for i in physical.full_layers)
    assert not any(isinstance(layers[i], QuantizedAttendedLayer) for i in physical.sliding_layers)
    session.extend([*WINDOW_HISTORY, {"role": "user", "content": "and the secret code once more?"}])
    assert int(physical.slot_window.sum()) == WINDOW - 1  # still trimmed after each forward
    session.check()
