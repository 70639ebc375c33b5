"""Budgets: the one place a token budget becomes bytes, and where pressure is relieved.

The budget in bytes and its watermarks are `agentkv.lifecycle.limits.BudgetLimits`
(`device_tokens` counts full-precision token equivalents); this module holds a
session under them.

Two ways to relieve pressure, chosen by what the policy declares (`whole_spans`):
- *span mode* (agentkv's `lifecycle` policy, and `full`): pressure moves whole spans
  down their rungs (full precision -> attended quantized -> archived -> dropped), one
  rung per span chosen by the placement planner (`agentkv.lifecycle.placement`) so
  that the limit holds at the least value lost: evictable spans first, pinned and
  active spans last and never out of attention, the spans the current question needs
  after the rest. Spans were compressed once, at commit.
- *token mode* (generic baselines: window, StreamingLLM, H2O, SnapKV, …): pressure
  re-scores every attended token and keeps the top ones, as those methods do.
"""

from __future__ import annotations

import logging
from typing import Any

from agentkv.lifecycle.compression import Compressor
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.placement import ATTENDED_FIRST, ATTENDED_RUNGS, Rung, plan_placement
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.rungs import lifecycle_class, span_options
from agentkv.spans import Span, SpanState, Tier

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
        self.placement_order = ATTENDED_FIRST
        """The planner's step order, by name (`agentkv.lifecycle.placement.PLACEMENT_ORDERS`)."""

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
        """Bring device usage to at most `target` bytes with one placement plan (re-planned if short).

        `agentkv.lifecycle.rungs` gives every span its rungs and value,
        `agentkv.lifecycle.placement` picks one rung per span (the least value lost per
        byte saved first), and the mover applies the moves. Spans recalled for this turn
        move only while usage is over the limit itself (the high watermark, not
        `target`): recall chose them for the question being answered, but the budget is
        a limit and the turn's own new content must fit. The store's byte figures are
        estimates before a move (int4 keys; a tier with 8-bit keys holds more): when usage
        is still over `target` after the moves, the plan is made again from what the store
        now holds (a few times at most). With 8-bit keys, once nothing is left to quantize,
        keys drop to 4 bits (in the planner's order) before any span leaves attention.
        """
        limit = self.last_limit
        hard = max(target, self.limits.high_bytes(limit)) if limit is not None else target
        for _ in range(5):
            usage = self.usage_bytes()
            if usage <= target:
                return
            choices = span_options(
                self.table.spans,
                self.port.store,
                self.marks,
                archive_tier=self.mover.archive_tier,
                token_bytes=self.port.bytes_per_token,
                fidelity=self.port.rung_fidelity(),
            )
            plan = plan_placement(choices, usage, target, hard_target=hard, order=self.placement_order)
            by_id = {s.span_id: s for s in self.table.spans}
            order = [by_id[c.span_id] for c in choices if c.span_id in plan.rungs]
            leaving = [
                s
                for s in order
                if plan.rungs[s.span_id] not in ATTENDED_RUNGS and s.state is not SpanState.EVICTABLE
            ]
            if leaving and self.mover.can_coarsen():
                # 8-bit keys drop to 4 bits before any span leaves attention: the rest of the plan first.
                staying = [s for s in order if s not in leaving]
                self._apply(staying, plan.rungs)
                if staying or self.mover.coarsen(self._attended_in_order(), self.usage_bytes() - target):
                    continue
            if not plan.rungs:
                if self.mover.coarsen(self._attended_in_order(), usage - target):
                    continue
                return
            self._apply(order, plan.rungs)
            if self.usage_bytes() >= usage:
                return  # nothing moved (every move failed): the plan would repeat itself

    def _attended_in_order(self) -> list[Span]:
        """Attended spans, the lifecycle's lowest class first (the order keys drop to 4 bits in)."""
        attended = [s for s in self.table.spans if s.tier is Tier.DEVICE]
        return sorted(attended, key=lambda s: (lifecycle_class(s, self.marks), s.start))

    def _apply(self, spans: list[Span], rungs: dict[int, Rung]) -> None:
        """Make the planned moves through the mover: drops and archives, then one quantization pass."""
        marks = self.marks
        quantize: list[Span] = []
        for span in spans:
            rung = rungs[span.span_id]
            if rung is Rung.ATTENDED_Q:
                quantize.append(span)
                continue
            state = SpanState.EVICTED if rung is Rung.DROPPED else SpanState.ARCHIVED
            was_recallable = span.span_id in marks.recallable
            committed = span.state is SpanState.COMMITTED
            if self.mover.move(span, state, reason="budget") is None:
                continue
            # Archived or dropped by the budget, or an archive the budget evicted: still recallable
            # (restored, or recomputed from its token ids). Released spans are not.
            if state is SpanState.ARCHIVED or was_recallable or committed:
                marks.recallable.add(span.span_id)
        if quantize:
            self.mover.hold_quantized(quantize)

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
