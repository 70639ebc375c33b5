"""Policy work on the attended cache's tokens: commit-time compression and token-mode eviction.

A span is compressed once, when it is committed; the generic baselines instead
keep the top tokens of the whole cache under pressure.

Both need the keys themselves, so they run only on the in-process store
(`KVStore`); on a store without attended tensors a span is simply frozen uncompressed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from agentkv.config import AgentKVConfig
from agentkv.lifecycle.table import SpanTable
from agentkv.lifecycle.timing import SectionTimer
from agentkv.policies import Policy, SpanView
from agentkv.spans import Span
from agentkv.store.kvstore import KVStore
from agentkv.store.protocol import KVStoreProtocol

logger = logging.getLogger(__name__)

FaultReporter = Callable[[str, Span | None, Exception], None]
"""Records a survived failure: `(where, span or None, error)`."""


def scoring_view(store: KVStore, table: SpanTable, slots: torch.Tensor) -> SpanView:
    """What a policy sees of the attended tokens at `slots` (keys, positions, spans, attention)."""
    physical = store.physical
    keys = []
    for layer in range(physical.num_layers):
        layer_keys = physical.layer_keys(layer)
        if layer_keys is None:
            msg = "empty cache"
            raise RuntimeError(msg)
        keys.append(layer_keys.index_select(-2, slots.to(layer_keys.device)))
    kinds = {s.span_id: s.kind for s in table.spans}
    recent = torch.arange(max(0, physical.length - 16), physical.length)
    query_keys = tuple(
        k.index_select(-2, recent.to(k.device))
        for k in (physical.layer_keys(i) for i in range(physical.num_layers))
        if k is not None
    )
    return SpanView(
        keys=tuple(keys),
        positions=physical.slot_position[slots],
        span_ids=physical.slot_span[slots],
        span_kinds=kinds,
        sequence_length=table.logical_length,
        attention=physical.slot_attention[slots],
        accumulated_attention=physical.slot_attention[slots],
        query_keys=query_keys,
    )


class Compressor:
    """Runs the policy over attended tokens: once per span at commit, or across the cache (token mode)."""

    def __init__(
        self,
        table: SpanTable,
        store: KVStoreProtocol,
        policy: Policy | None,
        config: AgentKVConfig,
        timer: SectionTimer,
        fault: FaultReporter,
        *,
        whole_spans: bool,
    ) -> None:
        self.table = table
        self.store = store
        self.policy = policy
        self.whole_spans = whole_spans
        """Span mode: spans are compressed once at commit (token mode leaves them to `evict_tokens`)."""
        self.config = config
        self.timer = timer
        self.fault = fault

    def compress_at_commit(self, span: Span) -> None:
        """Score the span once (and keep its top tokens if its kind has a keep ratio), then freeze it."""
        span.frozen = True
        store = self.store
        if self.policy is None or not self.whole_spans or not isinstance(store, KVStore):
            return
        physical = store.physical
        slots = physical.slots_of(span.span_id)
        if slots.numel() == 0:
            return
        try:
            with self.timer.timed("policy_seconds"):
                view = scoring_view(store, self.table, slots)
                scores = self.policy.score(view).float()
                span.score = float(scores.mean()) if scores.numel() else 0.0
                if self.policy.scores_spans:
                    span.score = float(self.policy.span_score(view).get(span.span_id, span.score))
                ratio = self.config.commit.keep_ratio.get(span.kind.value, 1.0)
                keep = max(self.config.commit.min_keep_tokens, round(ratio * slots.numel()))
                if keep >= slots.numel():
                    return
                chosen = self.policy.select(view, keep)
            offsets = physical.slot_offset[slots[chosen]].tolist()
            dropped = store.compress(span, offsets)
            self.table.counters.compressed_tokens += dropped
        except Exception as e:  # noqa: BLE001 - a failing policy keeps the whole span
            self.fault("policy", span, e)

    def evict_tokens(self, target: int) -> list[Span]:
        """Token mode: keep the policy's top tokens across the whole attended cache.

        Returns:
            The spans that lost every token (the caller's mover evicts them).
        """
        store = self.store
        table = self.table
        if self.policy is None or not isinstance(store, KVStore) or store.physical.length == 0:
            return []
        physical = store.physical
        per_token = max(1, physical.bytes_per_token())
        keep = max(0, (target - store.bytes_by_tier().quantized) // per_token)
        if keep >= physical.length:
            return []
        slots = torch.arange(physical.length)
        # Pins are receipts in every mode: a pinned span's tokens are never dropped.
        pinned_ids = [s.span_id for s in table.spans if s.pinned]
        protected = torch.isin(physical.slot_span, torch.tensor(pinned_ids, dtype=torch.long))
        try:
            with self.timer.timed("policy_seconds"):
                view = scoring_view(store, table, slots)
                chosen = self.policy.select(view, max(int(keep), int(protected.sum())), protected=protected)
        except Exception as e:  # noqa: BLE001 - a failing policy drops nothing this time
            self.fault("policy", None, e)
            return []
        drop_mask = torch.ones(physical.length, dtype=torch.bool)
        drop_mask[chosen] = False
        emptied: list[Span] = []
        with self.timer.timed("store_seconds"):
            dropped_by_span: dict[int, set[int]] = {}
            for slot in drop_mask.nonzero().flatten().tolist():
                dropped_by_span.setdefault(int(physical.slot_span[slot]), set()).add(
                    int(physical.slot_offset[slot])
                )
            physical.remove(drop_mask.nonzero().flatten())
            for span in table.spans:
                dropped = dropped_by_span.get(span.span_id)
                if not dropped:
                    continue
                span.kept = [o for o in span.kept_offsets if o not in dropped]
                table.counters.compressed_tokens += len(dropped)
                if not span.kept:
                    emptied.append(span)
        return emptied
