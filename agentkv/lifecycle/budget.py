"""Budgets: the one place a token budget becomes bytes, and where pressure is relieved.

The budget in bytes and its watermarks are `agentkv.lifecycle.limits.BudgetLimits`
(`device_tokens` counts full-precision token equivalents); this module holds a
session under them.

Two ways to relieve pressure, chosen by what the policy declares (`whole_spans`):
- *span mode* (agentkv's `lifecycle` policy, and `full`): pressure demotes whole
  spans — evictable first; then, with an attended quantized tier, spans are held
  quantized and still attended (lowest priority first: committed spans in the
  demotion order of `agentkv.lifecycle.demotion`, then recalled, then the current
  turn, then pinned); then committed spans are archived in that order, then
  quantized archives are evicted. Demotion order: full
  precision -> attended quantized (keys at 8 bits, then at 4, when the tier holds
  8-bit keys) -> archived -> evicted. Spans were compressed
  once, at commit.
- *token mode* (generic baselines: window, StreamingLLM, H2O, SnapKV, …): pressure
  re-scores every attended token and keeps the top ones, as those methods do.
"""

from __future__ import annotations

import logging
from typing import Any

from agentkv.lifecycle.compression import Compressor
from agentkv.lifecycle.demotion import demotion_key, demotion_order
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.port import SessionPort
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedQuantizer

logger = logging.getLogger(__name__)


class BudgetKeeper:
    """Holds one session under its device and host budgets after each operation."""

    def __init__(
        self,
        port: SessionPort,
        limits: BudgetLimits,
        mover: Mover,
        compressor: Compressor,
        marks: RecallMarks,
        *,
        whole_spans: bool,
        enforced: bool,
    ) -> None:
        self.port = port
        self.table = port.table
        self.limits = limits
        self.mover = mover
        self.compressor = compressor
        self.marks = marks
        self.whole_spans = whole_spans
        """Span mode (True) or token mode (False); see the module docstring."""
        self.enforced = enforced
        """False for policy `full`: the device budget is reported, never enforced."""
        self.satisfied = True
        """Whether the last check met the device budget."""
        self.last_limit: int | None = None
        """The device limit the last `enforce` applied (`check` holds usage to it)."""

    def usage_bytes(self) -> int:
        """What the device budget counts: attended KV, quantized archives, page digests (on the device)."""
        tiers = self.port.store.bytes_by_tier()
        return tiers.device + tiers.quantized + tiers.digest

    def effective_limit(self) -> int | None:
        """This session's device limit now: its own, lowered by its share of a global excess."""
        if self.limits.global_device_bytes is None:
            return self.limits.device_bytes
        return self.limits.device_share(self.usage_bytes(), self.port.global_device_bytes())

    def enforce(self) -> None:
        """Demote until under the low watermark when over the high one; then the host budget."""
        table = self.table
        limits = self.limits
        limit = self.effective_limit() if self.enforced else None
        self.last_limit = limit
        if limit is not None:
            usage = self.usage_bytes()
            if limits.over(usage, limit):
                target = limits.low_bytes(limit)
                if self.whole_spans:
                    with self.port.store.deferred_removal():  # one compaction for all moves
                        self._demote_spans(target)
                else:
                    # Token mode drops tokens, not spans; a span left with none is evicted, whatever
                    # its state (the generic baselines drop active tokens too, by design). Generic
                    # compressors hold a fixed-size cache (the papers' budget): they keep up to the
                    # high watermark, the same room recall fills for agentkv at answer time.
                    for span in self.compressor.evict_tokens(limits.high_bytes(limit)):
                        self.mover.move(span, SpanState.EVICTED, reason="no tokens left")
                usage = self.usage_bytes()
            satisfied = not limits.over(usage, limit)
            if not satisfied and self.satisfied:
                logger.warning(
                    "session %s: device budget %s cannot be met (%s held) without demoting pinned "
                    "or active spans",
                    table.session_id,
                    limits.describe(limit),
                    limits.describe(usage),
                )
            if not satisfied:
                table.counters.budget_unmet += 1
            self.satisfied = satisfied
        else:
            self.satisfied = True
        self._enforce_host_budget()
        tiers = self.port.store.bytes_by_tier()
        table.counters.peak_device_bytes = max(table.counters.peak_device_bytes, tiers.device)

    def figures(self) -> dict[str, Any]:
        """The `SessionStats` budget fields: the limit and the usage, in bytes and full-precision tokens."""
        limits = self.limits
        usage = self.usage_bytes()
        limit = self.last_limit if self.enforced else limits.device_bytes
        return {
            "budget_satisfied": self.satisfied,
            "budget_device_bytes": limit,
            "budget_device_tokens": None if limit is None else limits.in_tokens(limit),
            "budget_used_bytes": usage,
            "budget_used_tokens": limits.in_tokens(usage),
        }

    def check(self) -> list[str]:
        """The budget invariant: reported as met means usage is under the high watermark."""
        if self.satisfied and self.last_limit is not None:
            usage = self.usage_bytes()
            if self.limits.over(usage, self.last_limit):
                return [
                    f"budget reported as met but device usage {usage} B is over the high watermark "
                    f"({self.limits.high} of {self.last_limit} B)"
                ]
        return []

    def demotable(self, span: Span) -> bool:
        """Neither pinned nor protected by this turn's recall."""
        return not span.pinned and span.span_id not in self.marks.recalled

    def _demote_spans(self, target: int) -> None:
        """Demote whole spans until device usage is at most `target` bytes.

        Order: the grace queue (evictable spans, oldest first), then committed spans on
        the device in the demotion order (`agentkv.lifecycle.demotion`: what this turn's
        user message needs last, the least value per byte first), then quantized archives.
        Spans recalled for this turn go last, least relevant first, and only as far as
        the limit itself (the high watermark, not `target`): recall chose them for the
        question being answered, but the budget is a limit and the turn's own new content
        (a long tool result arriving after the recall) must fit. Pinned and active spans
        are never demoted. Usage is re-read only after a move (`usage_bytes` sums every
        block).
        """
        spans = self.table.spans
        marks = self.marks
        usage = self.usage_bytes()
        limit = self.last_limit
        hard = max(target, self.limits.high_bytes(limit)) if limit is not None else target

        def demote(candidates: list[Span], state: SpanState, *, recalled: bool = False) -> bool:
            nonlocal usage
            goal = hard if recalled else target
            for span in candidates:
                if usage <= goal:
                    return True
                if span.pinned or (span.span_id in marks.recalled) is not recalled:
                    continue
                was_recallable = span.span_id in marks.recallable
                if self.mover.move(span, state, reason="budget") is None:
                    continue
                # Archived by the budget, or an archive the budget evicted: still recallable
                # (restored, or recomputed from its token ids). Released spans are not.
                if state is SpanState.ARCHIVED or was_recallable:
                    marks.recallable.add(span.span_id)
                usage = self.usage_bytes()
            return usage <= goal

        def in_order(state: SpanState, tier: Tier) -> list[Span]:
            # What this turn's user message does not need first, least value per byte first.
            return demotion_order((s for s in spans if s.state is state and s.tier is tier), marks)

        # 1. The grace queue: evictable spans go first, oldest first.
        evictable = sorted((s for s in spans if s.state is SpanState.EVICTABLE), key=lambda s: s.start)
        if demote(evictable, SpanState.EVICTED):
            return
        # 2. With an attended quantized tier: hold spans quantized, still attended, before archiving any.
        if self._quantize_attended(target):
            return
        usage = self.usage_bytes()
        # 3. Committed spans on the device, least value per byte first (whole spans: never re-scored).
        if demote(in_order(SpanState.COMMITTED, Tier.DEVICE), SpanState.ARCHIVED):
            return
        # 4. Quantized archives still count on the device: the least value per byte goes.
        if demote(in_order(SpanState.ARCHIVED, Tier.QUANTIZED), SpanState.EVICTED):
            return
        # 5. Last resort: what recall brought in for this turn, least relevant first.
        relevance = marks.relevance
        recalled = sorted(
            (s for s in spans if s.state is SpanState.COMMITTED and s.tier is Tier.DEVICE),
            key=lambda s: (relevance.get(s.span_id, 0.0), s.start),
        )
        demote(recalled, SpanState.ARCHIVED, recalled=True)

    def _quantize_attended(self, target: int) -> bool:
        """Quantize device spans in attention, lowest priority first, until usage <= `target`.

        Priority, lowest first (the lifecycle's own order): committed spans in the demotion
        order (`agentkv.lifecycle.demotion`); spans recalled for this turn by relevance;
        the current turn's active spans oldest first; pinned spans last. The store keeps
        the attention sinks and the residual window in full precision. With 8-bit keys,
        every candidate is quantized before any span's keys drop to 4 bits (in the same
        order): a span's keys go to 4 bits only when quantizing all of them did not
        suffice. Returns whether usage is at `target`.
        """
        store = self.port.store
        if not isinstance(store, AttendedQuantizer):
            return False
        marks = self.marks
        device = [s for s in self.table.spans if s.tier is Tier.DEVICE and s.state is not SpanState.EVICTABLE]

        def rank(span: Span) -> tuple[int, bool, float, int]:
            if span.pinned:
                return (3, False, 0.0, span.start)
            if span.state is SpanState.ACTIVE:
                return (2, False, 0.0, span.start)
            if span.span_id in marks.recalled:
                return (1, False, marks.relevance.get(span.span_id, 0.0), span.start)
            return (0, *demotion_key(span, marks))

        usage = self.usage_bytes()
        if usage <= target:
            return True
        ranked = sorted(device, key=rank)
        with self.mover.timer.timed("store_seconds"):
            try:
                # One pass over the layers for every span the one-by-one loop below would take;
                # the loop then only runs if the store's estimate fell short.
                store.quantize_attended_until(ranked, usage - target)
                usage = self.usage_bytes()
                for span in ranked:
                    if usage <= target:
                        return True
                    if store.quantize_attended(span):
                        usage = self.usage_bytes()
                if usage > target:  # 8-bit keys: hold them at 4 bits, same order, before archiving
                    store.coarsen_attended_until(ranked, usage - target)
                    usage = self.usage_bytes()
            except Exception as e:  # noqa: BLE001 - every slot is still attended: archive instead
                self.mover.fault("quantization in attention", None, e)
                return self.usage_bytes() <= target
        return usage <= target

    def _enforce_host_budget(self) -> None:
        limit = self.limits.host_bytes
        if limit is None:
            return
        store = self.port.store
        host = [s for s in self.table.spans if s.tier is Tier.HOST]
        for span in sorted(host, key=lambda s: (s.score, s.start)):
            if store.host_bytes() <= self.limits.low_bytes(limit):
                return
            if self.demotable(span) and span.state is not SpanState.EVICTED:
                self.mover.move(span, SpanState.EVICTED, reason="host budget")
