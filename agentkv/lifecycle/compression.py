"""Policy work on the attended cache's tokens: commit-time compression and token-mode eviction.

A span is compressed once, when it is committed; the generic baselines instead
keep the top tokens of the whole cache under pressure.

Both need the keys themselves, so they run only on the in-process store
(`KVStore`); on a store without attended tensors a span is simply frozen uncompressed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias

from agentkv.config import AgentKVConfig
from agentkv.lifecycle.pages import PageIndex
from agentkv.lifecycle.table import SpanTable
from agentkv.lifecycle.timing import SectionTimer
from agentkv.policies import Policy, SpanView
from agentkv.spans import Span, SpanKind
from agentkv.store.kvstore import KVStore
from agentkv.store.protocol import KVStoreProtocol

logger = logging.getLogger(__name__)

FaultReporter = Callable[[str, Span | None, Exception], None]
"""Records a survived failure: `(where, span or None, error)`."""


def scoring_view(
    store: KVStore, table: SpanTable, slots: torch.Tensor, *, keys: bool = True, queries: bool = True
) -> SpanView:
    """What a policy sees of the attended tokens at `slots` (keys, positions, spans, attention).

    `keys` / `queries`: whether to read the slots' keys and the recent ones (a policy's
    `needs_keys` / `needs_query`). Only those slots are read, never a whole layer: on
    the attended quantized tier a read dequantizes.
    """
    physical = store.physical
    recent = torch.arange(max(0, physical.length - 16), physical.length)
    slot_keys, query_keys = [], []
    for layer in range(physical.num_layers if keys or queries else 0):
        layer_keys = physical.layer_keys_at(layer, slots) if keys else None
        recent_keys = physical.layer_keys_at(layer, recent) if queries else None
        if (keys and layer_keys is None) or (queries and recent_keys is None):
            msg = "empty cache"
            raise RuntimeError(msg)
        if layer_keys is not None:
            slot_keys.append(layer_keys)
        if recent_keys is not None:
            query_keys.append(recent_keys)
    kinds = {s.span_id: s.kind for s in table.spans}
    return SpanView(
        keys=tuple(slot_keys),
        positions=physical.slot_position[slots],
        span_ids=physical.slot_span[slots],
        span_kinds=kinds,
        sequence_length=table.logical_length,
        attention=physical.slot_window_attention[slots],
        accumulated_attention=physical.slot_heavy_attention[slots],
        decayed_attention=physical.slot_attention[slots],
        query_keys=tuple(query_keys) if queries else None,
    )


SNAP_KERNEL = 5
"""Pooling kernel of question-observed compression (SnapKV's reference code: 5, average)."""


def observation_window(table: SpanTable, span: Span) -> list[int]:
    """Token ids of the turn's own question for a tool result: its user message, then its tool call.

    The user message is the last one before the span; the tool call is the last
    tool-calling span before it (the call that asked for this result).
    """
    before = [s for s in table.spans if s.end <= span.start]
    user = next((s for s in reversed(before) if s.kind is SpanKind.USER), None)
    call = next((s for s in reversed(before) if s.kind is SpanKind.TOOL_CALL), None)
    if call is not None and user is not None and call.start < user.start:
        call = None  # a call from an earlier turn is not this result's question
    return [t for s in (user, call) if s is not None for t in s.token_ids]


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
        port: Any = None,
        pages: PageIndex | None = None,
    ) -> None:
        self.port = port
        """The session's services (`window_attention` for question-observed compression), or None."""
        self.pages = pages
        """Builds page digests at commit (page recall), or None."""
        self.table = table
        self.store = store
        self.policy = policy
        self.whole_spans = whole_spans
        """Span mode: spans are compressed once at commit (token mode leaves them to `evict_tokens`)."""
        self.config = config
        self.timer = timer
        self.fault = fault

    def compress_at_commit(self, span: Span) -> None:
        """Score the span once (and keep its top tokens if its kind has a keep ratio), then freeze it.

        With page recall on, the span's page digest is built first, while all its keys
        are attended (pages compressed away here can still be recalled later). With
        `commit.observe: question`, a tool result keeps the tokens its turn's question
        attends to (`question_scores`) instead of the policy's top tokens.
        """
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
                if self.pages is not None:
                    self.pages.index(span)
                view = scoring_view(
                    store, self.table, slots, keys=self.policy.needs_keys, queries=self.policy.needs_query
                )
                scores = self.policy.score(view).float()
                if not span.scored:  # scored once: a recomputed span keeps its commit score
                    span.score = float(scores.mean()) if scores.numel() else 0.0
                    if self.policy.scores_spans:
                        span.score = float(self.policy.span_score(view).get(span.span_id, span.score))
                    span.scored = True
                ratio = self.config.commit.keep_ratio.get(span.kind.value, 1.0)
                keep = max(self.config.commit.min_keep_tokens, round(ratio * slots.numel()))
                if keep >= slots.numel():
                    return
                observed = self.question_scores(span, slots)
                if observed is not None:
                    chosen = torch.topk(observed, keep).indices
                else:
                    chosen = self.policy.select(view, keep)
            offsets = physical.slot_offset[slots[chosen]].tolist()
            dropped = store.compress(span, offsets)
            self.table.counters.compressed_tokens += dropped
        except Exception as e:  # noqa: BLE001 - a failing policy keeps the whole span
            self.fault("policy", span, e)

    def question_scores(self, span: Span, slots: torch.Tensor) -> torch.Tensor | None:
        """SnapKV at commit with the turn's own question as the observation window, `[n]` per slot.

        For a tool result under `commit.observe: question`: the turn's user message and
        the tool call that asked for the result are read after the conversation's end
        (`SessionPort.window_attention`; the cache is left as it was), and each of the
        span's tokens is scored by the attention they pay it, pooled along the span with
        SnapKV's kernel (`SNAP_KERNEL`, average) so a number keeps its neighbours.
        None (the policy's scores are used) for other kinds, other settings, or when
        there is no question to observe with.
        """
        if self.config.commit.observe != "question" or span.kind is not SpanKind.TOOL_RESULT:
            return None
        window = observation_window(self.table, span)
        observe = getattr(self.port, "window_attention", None)
        if not window or not callable(observe):
            return None
        attention = observe(window)
        if attention is None:
            return None
        physical = self.store.physical if isinstance(self.store, KVStore) else None
        if physical is None or attention.numel() != physical.length:
            return None
        offsets = physical.slot_offset[slots]  # [n]
        order = torch.argsort(offsets)
        raw = attention[slots.cpu()].float()[order].view(1, 1, -1)  # [1, 1, n] in span order
        pad = SNAP_KERNEL // 2
        pooled = F.avg_pool1d(raw, SNAP_KERNEL, stride=1, padding=pad, count_include_pad=False).view(-1)
        scores = torch.empty_like(pooled)
        scores[order] = pooled
        self.table.counters.observed_commits += 1
        return scores

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
                view = scoring_view(
                    store, table, slots, keys=self.policy.needs_keys, queries=self.policy.needs_query
                )
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
