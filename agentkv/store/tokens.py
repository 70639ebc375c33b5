"""The attended cache read and thinned token by token: what policies score.

The lifecycle sees these only through the store protocol (`KVStoreProtocol.attended_tokens`,
`keep_attended`); the tensors stay here, over a `PhysicalCache`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentkv.spans import Span
from agentkv.store.cache import PhysicalCache
from agentkv.store.protocol import AttendedTokens

RECENT_TOKENS = 16
"""The most recent attended tokens whose keys stand in for queries (`AttendedTokens.query_keys`)."""


def read_tokens(
    physical: PhysicalCache, slots: torch.Tensor, *, keys: bool = True, queries: bool = True
) -> AttendedTokens:
    """The attended tokens at `slots` (`long [n]`): keys, the recent keys, positions and attention.

    Keys and recent keys are read from the layers that hold every slot (`scored_layers`).

    Raises:
        RuntimeError: the cache holds no keys to read ("empty cache").
    """
    recent = torch.arange(max(0, physical.length - RECENT_TOKENS), physical.length)
    slot_keys, query_keys = [], []
    for layer in scored_layers(physical) if keys or queries else ():
        layer_keys = physical.layer_keys_at(layer, slots) if keys else None
        recent_keys = physical.layer_keys_at(layer, recent) if queries else None
        if (keys and layer_keys is None) or (queries and recent_keys is None):
            msg = "empty cache"
            raise RuntimeError(msg)
        if layer_keys is not None:
            slot_keys.append(layer_keys)
        if recent_keys is not None:
            query_keys.append(recent_keys)
    return AttendedTokens(
        keys=tuple(slot_keys),
        query_keys=tuple(query_keys) if queries else None,
        positions=physical.slot_position[slots],
        span_ids=physical.slot_span[slots],
        offsets=physical.slot_offset[slots],
        slots=slots,
        attention=physical.slot_window_attention[slots],
        accumulated_attention=physical.slot_heavy_attention[slots],
        decayed_attention=physical.slot_attention[slots],
        attended=physical.length,
    )


def scored_layers(physical: PhysicalCache) -> list[int]:
    """The layers whose keys a policy scores: every layer, or only the full-attention ones.

    A sliding-window layer no longer holds the keys of tokens behind its window (their
    slots read as zeros there), so on a model with full-attention layers too (Gemma 2 / 3,
    windowed Qwen variants) only those are read. A model whose every layer is windowed
    (Mistral 7B v0.1) has nothing better: all its layers are read.
    """
    full = [i for i in range(physical.num_layers) if i not in physical.sliding_layers]
    return full or list(range(physical.num_layers))


def keep_slots(physical: PhysicalCache, spans: Sequence[Span], keep: torch.Tensor) -> dict[int, int]:
    """Drop every attended slot but `keep`; each span's `kept` follows. Tokens dropped, by span id."""
    drop_mask = torch.ones(physical.length, dtype=torch.bool)
    drop_mask[keep] = False
    dropped_by_span: dict[int, set[int]] = {}
    for slot in drop_mask.nonzero().flatten().tolist():
        dropped_by_span.setdefault(int(physical.slot_span[slot]), set()).add(int(physical.slot_offset[slot]))
    physical.remove(drop_mask.nonzero().flatten())
    out: dict[int, int] = {}
    for span in spans:
        dropped = dropped_by_span.get(span.span_id)
        if dropped:
            span.kept = [o for o in span.kept_offsets if o not in dropped]
            out[span.span_id] = len(dropped)
    return out
