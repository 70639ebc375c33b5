"""PhysicalCache: batched removal compacts once and never lets a removed slot be attended."""

from __future__ import annotations

import pytest
import torch

from agentkv.store.block import KVBlock
from agentkv.store.cache import PhysicalCache

LAYERS, HEADS, DIM = 3, 2, 4


def _cache_with_spans(lengths: list[int]) -> tuple[PhysicalCache, torch.Tensor]:
    """A cache holding one span per length, appended in order; returns it and layer 0's keys."""
    physical = PhysicalCache(LAYERS)
    torch.manual_seed(0)
    position = 0
    for span_id, n in enumerate(lengths):
        for layer in physical.cache.managed_layers:
            layer.update(torch.randn(1, HEADS, n, DIM), torch.randn(1, HEADS, n, DIM))
        physical.record_append(
            torch.full((n,), span_id), torch.arange(n), torch.arange(position, position + n)
        )
        position += n
    keys = physical.layer_keys(0)
    assert keys is not None
    return physical, keys.clone()


def _count_compactions(physical: PhysicalCache, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = physical._select

    def counted(keep: torch.Tensor) -> None:
        calls.append(int(keep.numel()))
        original(keep)

    monkeypatch.setattr(physical, "_select", counted)
    return calls


def test_deferred_removal_compacts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    physical, keys = _cache_with_spans([3, 4, 5, 2])
    per_slot = physical.nbytes() // physical.length
    calls = _count_compactions(physical, monkeypatch)
    with physical.deferred_removal():
        physical.remove(physical.slots_of(1))
        physical.remove(physical.slots_of(3))
        # Inside the block the removals are visible to bookkeeping, not yet copied.
        assert calls == []
        assert physical.slots_of(1).numel() == 0
        assert physical.nbytes() == (14 - 6) * per_slot
    assert calls == [8]
    assert physical.length == 8
    assert physical.slot_span.tolist() == [0] * 3 + [2] * 5
    kept = torch.cat([torch.arange(0, 3), torch.arange(7, 12)])
    after = physical.layer_keys(0)
    assert after is not None
    assert torch.equal(after, keys.index_select(-2, kept))
    assert physical.nbytes() == 8 * per_slot


def test_reading_keys_inside_the_block_compacts_first(monkeypatch: pytest.MonkeyPatch) -> None:
    physical, keys = _cache_with_spans([2, 3])
    with physical.deferred_removal():
        physical.remove(physical.slots_of(0))
        inside = physical.layer_keys(0)  # what a policy view or a forward would attend
        assert inside is not None
        assert torch.equal(inside, keys[..., 2:, :])
        physical.remove(physical.slots_of(1))
    assert physical.length == 0


def test_append_inside_the_block_keeps_bookkeeping_in_sync() -> None:
    physical, _ = _cache_with_spans([2, 3])
    block = KVBlock(
        keys=[torch.ones(1, HEADS, 2, DIM)] * LAYERS,
        values=[torch.ones(1, HEADS, 2, DIM)] * LAYERS,
        offsets=[0, 1],
    )
    with physical.deferred_removal():
        physical.remove(physical.slots_of(0))
        physical.append_block(7, block, torch.tensor([10, 11]))
        physical.remove(physical.slots_of(7, [1]))
    assert physical.slot_span.tolist() == [1, 1, 1, 7]
    assert physical.slot_position.tolist() == [2, 3, 4, 10]
    physical._check_lengths()


def test_nested_blocks_compact_at_the_outermost_end(monkeypatch: pytest.MonkeyPatch) -> None:
    physical, _ = _cache_with_spans([2, 2, 2])
    calls = _count_compactions(physical, monkeypatch)
    with physical.deferred_removal():
        with physical.deferred_removal():
            physical.remove(physical.slots_of(0))
        assert calls == []
        physical.remove(physical.slots_of(2))
    assert calls == [2]
    assert physical.slot_span.tolist() == [1, 1]


def test_bytes_read_mid_compaction_count_the_removed_slots_as_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another session's global accounting reads this cache without its lock, mid-compaction too."""
    physical, _ = _cache_with_spans([3, 4, 5, 2])
    per_slot = physical.nbytes() // physical.length
    seen: list[int] = []
    original = physical._select

    def read_between(keep: torch.Tensor) -> None:
        original(keep)  # the slots are gone, the pending mask is not replaced yet
        seen.append(physical.nbytes())

    monkeypatch.setattr(physical, "_select", read_between)
    with physical.deferred_removal():
        physical.remove(physical.slots_of(1))
    assert seen == [(14 - 4) * per_slot]
    assert physical.nbytes() == (14 - 4) * per_slot
