"""A store's invariants: slots, archived blocks and byte accounting against the spans' tiers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from agentkv.spans import Span, Tier
from agentkv.store.block import tensor_bytes
from agentkv.store.cache import PhysicalCache
from agentkv.store.protocol import TierBytes

__all__ = ["CheckedStore", "store_problems"]


class CheckedStore(Protocol):
    """What the checks read of a store (`agentkv.store.kvstore.KVStore`)."""

    @property
    def physical(self) -> PhysicalCache:
        """The attended cache."""
        ...

    @property
    def blocks(self) -> Mapping[int, Any]:
        """Archived spans' blocks (the full layers'), by span id."""
        ...

    @property
    def window_blocks(self) -> Mapping[int, Any]:
        """Archived spans' sliding-layer blocks, by span id."""
        ...

    def attended_tier(self, span: Span) -> Tier:
        """The tier an attended span's slots say it is on."""
        ...

    def bytes_by_tier(self) -> TierBytes:
        """Bytes per tier."""
        ...


def store_problems(store: CheckedStore, spans: Sequence[Span]) -> list[str]:
    """Slots, blocks and byte accounting against the spans' tiers; one line per problem."""
    physical = store.physical
    problems: list[str] = []
    by_id = {s.span_id: s for s in spans}
    # Slots: each belongs to a live span, sits at that span's logical position, and appears once.
    offsets: dict[int, list[int]] = {}
    for slot_span, offset, position in zip(
        physical.slot_span.tolist(),
        physical.slot_offset.tolist(),
        physical.slot_position.tolist(),
        strict=True,
    ):
        owner = by_id.get(slot_span)
        if owner is None:
            problems.append(f"physical slot holds unknown span {slot_span}")
            continue
        offsets.setdefault(slot_span, []).append(offset)
        if position != owner.start + offset:
            problems.append(
                f"span {slot_span} offset {offset} at position {position}, expected {owner.start + offset}"
            )
    for span in spans:
        held = sorted(offsets.get(span.span_id, []))
        block = store.blocks.get(span.span_id)
        if span.tier.attended:
            if held != span.kept_offsets:
                problems.append(
                    f"span {span.span_id} holds {len(held)} slots, expected {span.held_tokens} "
                    "(its kept offsets)"
                )
            if block is not None:
                problems.append(f"device span {span.span_id} also has an archived block")
            slots_say = store.attended_tier(span)
            if slots_say is not span.tier:
                problems.append(f"span {span.span_id} is on tier {span.tier}, its slots say {slots_say}")
        else:
            if held:
                problems.append(f"span {span.span_id} on tier {span.tier.value} still has {len(held)} slots")
            if span.tier is Tier.DROPPED and block is not None:
                problems.append(f"dropped span {span.span_id} still has a block")
            if span.tier.archived and (block is None or sorted(block.offsets) != span.kept_offsets):
                problems.append(f"archived span {span.span_id} block does not match its kept tokens")
    for block_span in store.window_blocks:
        if block_span not in store.blocks:
            problems.append(f"sliding-layer block of span {block_span} without its full layers' block")
    for block_span in store.blocks:
        if block_span not in by_id:
            problems.append(f"archived block of unknown span {block_span}")
    # Accounting: what the tiers report is what their tensors hold.
    tiers = store.bytes_by_tier()
    walked = sum(tensor_bytes(t) for t in physical.tensors())
    if walked != physical.nbytes():
        problems.append(f"the cache's tensors hold {walked} B, its accounting says {physical.nbytes()} B")
    if tiers.device != physical.nbytes():
        problems.append(f"device tier reports {tiers.device} B, the cache holds {physical.nbytes()} B")
    return problems
