"""Policy work on the attended cache's tokens: commit-time compression and token-mode eviction.

A span is compressed once, when it is committed; the generic baselines instead
keep the top tokens of the whole cache under pressure.

Both read the tokens through the store protocol (`KVStoreProtocol.attended_tokens`);
a store that cannot answer (a served engine) holds spans whole: a span is frozen
uncompressed there, and token mode drops nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias

from agentkv.config import AgentKVConfig
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.table import SpanTable
from agentkv.lifecycle.timing import SectionTimer
from agentkv.policies import Policy, SpanView
from agentkv.spans import Span, SpanKind
from agentkv.store.protocol import AttendedTokens, KVStoreProtocol

logger = logging.getLogger(__name__)

WindowAttention = Callable[[list[int]], torch.Tensor | None]
"""`SessionPort.window_attention`: `[S]` attention from token ids read after the conversation's end."""


def span_view(tokens: AttendedTokens, table: SpanTable) -> SpanView:
    """What a policy sees of attended tokens (keys, positions, spans, attention)."""
    return SpanView(
        keys=tokens.keys,
        positions=tokens.positions,
        span_ids=tokens.span_ids,
        span_kinds={s.span_id: s.kind for s in table.spans},
        sequence_length=table.logical_length,
        attention=tokens.attention,
        accumulated_attention=tokens.accumulated_attention,
        decayed_attention=tokens.decayed_attention,
        query_keys=tokens.query_keys,
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
        mover: Mover,
        *,
        whole_spans: bool,
        window_attention: WindowAttention | None = None,
    ) -> None:
        self.window_attention = window_attention
        """The session's observation of a question (question-observed compression), or None."""
        self.table = table
        self.store = store
        self.policy = policy
        self.whole_spans = whole_spans
        """Span mode: spans are compressed once at commit (token mode leaves them to `evict_tokens`)."""
        self.config = config
        self.timer = timer
        self.mover = mover
        """Applies what compression keeps (`Mover.compress`, `Mover.keep_attended`) and records faults."""
        self.fault = mover.fault

    def compress_at_commit(self, span: Span) -> None:
        """Score the span once (and keep its top tokens if its kind has a keep ratio), then freeze it.

        With `commit.observe: question`, a tool result keeps the tokens its turn's question
        attends to (`question_scores`) instead of the policy's top tokens.
        """
        span.frozen = True
        store = self.store
        if self.policy is None or not self.whole_spans or store.attended_size() is None:
            return
        try:
            with self.timer.timed("policy_seconds"):
                tokens = store.attended_tokens(
                    span, keys=self.policy.needs_keys, queries=self.policy.needs_query
                )
                if tokens is None or tokens.slots.numel() == 0:
                    return
                view = span_view(tokens, self.table)
                scores = self.policy.score(view).float()
                if not span.scored:  # scored once: a recomputed span keeps its commit score
                    span.score = float(scores.mean()) if scores.numel() else 0.0
                    if self.policy.scores_spans:
                        span.score = float(self.policy.span_score(view).get(span.span_id, span.score))
                    span.scored = True
                count = int(tokens.slots.numel())
                ratio = self.config.commit.keep_ratio.get(span.kind.value, 1.0)
                keep = max(self.config.commit.min_keep_tokens, round(ratio * count))
                if keep >= count:
                    return
                observed = self.question_scores(span, tokens)
                if observed is not None:
                    chosen = torch.topk(observed, keep).indices
                else:
                    chosen = self.policy.select(view, keep)
            offsets = tokens.offsets[chosen].tolist()
            dropped = self.mover.compress(span, offsets)
            self.table.counters.compressed_tokens += dropped
        except Exception as e:  # noqa: BLE001 - a failing policy keeps the whole span
            self.fault("policy", span, e)

    def question_scores(self, span: Span, tokens: AttendedTokens) -> torch.Tensor | None:
        """SnapKV at commit with the turn's own question as the observation window, `[n]` per token.

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
        if not window or self.window_attention is None:
            return None
        attention = self.window_attention(window)
        if attention is None or attention.numel() != tokens.attended:
            return None
        order = torch.argsort(tokens.offsets)
        raw = attention[tokens.slots.cpu()].float()[order].view(1, 1, -1)  # [1, 1, n] in span order
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
        size = store.attended_size()
        if self.policy is None or size is None or size[0] == 0:
            return []
        length, per_token = size[0], max(1, size[1])
        keep = max(0, (target - store.bytes_by_tier().quantized) // per_token)
        if keep >= length:
            return []
        try:
            with self.timer.timed("policy_seconds"):
                tokens = store.attended_tokens(
                    None, keys=self.policy.needs_keys, queries=self.policy.needs_query
                )
                if tokens is None:
                    return []
                # Pins are receipts in every mode: a pinned span's tokens are never dropped.
                pinned_ids = [s.span_id for s in table.spans if s.pinned]
                protected = torch.isin(tokens.span_ids, torch.tensor(pinned_ids, dtype=torch.long))
                view = span_view(tokens, table)
                chosen = self.policy.select(view, max(int(keep), int(protected.sum())), protected=protected)
        except Exception as e:  # noqa: BLE001 - a failing policy drops nothing this time
            self.fault("policy", None, e)
            return []
        with self.timer.timed("store_seconds"):
            dropped = self.mover.keep_attended(tokens.slots[chosen])
        emptied: list[Span] = []
        for span in table.spans:
            if span.span_id in dropped:
                table.counters.compressed_tokens += dropped[span.span_id]
                if not span.kept:
                    emptied.append(span)
        return emptied
