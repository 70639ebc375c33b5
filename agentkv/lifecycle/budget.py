"""Budgets: a session held under its device and host limits after each operation.

The budget in bytes and its watermarks are `agentkv.lifecycle.limits.BudgetLimits`
(`device_tokens` counts full-precision token equivalents); usage, room and plans are
the placement service's (`agentkv.lifecycle.placer.Placer`). This module decides
*when* to relieve pressure and reports whether the limit holds.

Two ways to relieve pressure, chosen by what the policy declares (`whole_spans`):
- *span mode* (agentkv's `lifecycle` policy, and `full`): pressure moves whole spans
  down their rungs (full precision -> attended quantized -> archived -> dropped), one
  rung per span chosen by the placement planner (`Placer.place`) so that the
  limit holds at the least value lost: evictable spans first, pinned and active spans
  last and never out of attention, the spans the current question needs after the
  rest. Spans were compressed once, at commit.
- *token mode* (generic baselines: window, StreamingLLM, H2O, SnapKV, …): pressure
  re-scores every attended token and keeps the top ones, as those methods do.
"""

from __future__ import annotations

import logging
from typing import Any

from agentkv.lifecycle.compression import Compressor
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.placer import PlacementPeer, Placer
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import SpanState

logger = logging.getLogger(__name__)


class BudgetKeeper(PlacementPeer):
    """Holds one session under its device and host budgets after each operation."""

    def __init__(
        self,
        placer: Placer,
        timer: SectionTimer,
        compressor: Compressor,
        *,
        whole_spans: bool,
        enforced: bool,
    ) -> None:
        super().__init__(placer, timer)
        self.compressor = compressor
        self.whole_spans = whole_spans
        """Span mode (True) or token mode (False); see the module docstring."""
        self.enforced = enforced
        """False for policy `full`: the device budget is reported, never enforced."""
        self.satisfied = True
        """Whether the last check met the device budget."""
        self.last_limit: int | None = None
        """The device limit the last `enforce` applied (`check` holds usage to it)."""

    @property
    def limits(self) -> BudgetLimits:
        """The session's limits (the placement service's)."""
        return self.placer.limits

    def usage_bytes(self) -> int:
        """What the device budget counts (`Placer.usage_bytes`)."""
        return self.placer.usage_bytes()

    def enforce(self) -> None:
        """Demote until under the low watermark when over the high one, the host budget in the same plan."""
        table = self.table
        limits = self.limits
        if self.enforced:
            self.placer.relieve_global()
        limit = self.placer.effective_limit() if self.enforced else None
        self.last_limit = limit
        host_limit = limits.host_bytes
        host_planned = False
        if limit is not None:
            usage = self.usage_bytes()
            if limits.over(usage, limit):
                target = limits.low_bytes(limit)
                if self.whole_spans:
                    # One compaction for all moves; the store counts its removals as gone before it.
                    with self.port.store.deferred_removal():
                        self.placer.place(
                            target, limit, host_limit=host_limit, spare_above=limits.high_bytes(limit)
                        )
                    host_planned = True
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
            # Policy `full` keeps every token: the budget is reported, met only when usage is under it.
            reported = limits.device_bytes
            self.satisfied = reported is None or not limits.over(self.usage_bytes(), reported)
            if not self.satisfied:
                table.counters.budget_unmet += 1
        if host_limit is not None and not host_planned:
            self.placer.place(None, None, host_limit=host_limit)
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
