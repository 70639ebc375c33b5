"""The placement service: the one owner of what the device holds, and of the room left on it.

Budget enforcement, recall and exact recall do not predict each other:
each asks this service. It measures usage against the limits (the watermark
arithmetic lives in `agentkv.lifecycle.limits.BudgetLimits`), says how much room a
question may fill (`recall_room`; exact recall's `floor_usage`), and makes a plan
(`agentkv.lifecycle.rungs` gives every span its rungs,
`agentkv.lifecycle.placement.plan_placement` picks one per span) that the mover applies
(`demote_to`).

Room is counted at the *floor* of the demotion order (`AttendedFloor`): with an
attended quantized tier, the budget holds every attended span quantized before it
archives any, so a span brought back needs room at its quantized size, and so do the
pinned and active spans that stay; the sinks and the residual window stay exact.
"""

from __future__ import annotations

from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.placement import ATTENDED_FIRST, ATTENDED_RUNGS, Rung, plan_placement
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.rungs import lifecycle_class, span_options
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor, AttendedQuantizer

REPLANS = 5
"""Plans made at most per `demote_to` (the store's byte figures are estimates before a move)."""


class Placer:
    """Room, order and plans for one session; every move it plans goes through the mover."""

    def __init__(self, port: SessionPort, limits: BudgetLimits, mover: Mover, marks: RecallMarks) -> None:
        self.port = port
        self.table = port.table
        self.limits = limits
        self.mover = mover
        self.marks = marks
        self.placement_order = ATTENDED_FIRST
        """The planner's step order, by name (`agentkv.lifecycle.placement.PLACEMENT_ORDERS`)."""

    # -- usage and room ---------------------------------------------------------------------

    def usage_bytes(self) -> int:
        """What the device budget counts: attended KV and quantized archives (both on the device)."""
        tiers = self.port.store.bytes_by_tier()
        return tiers.device + tiers.quantized

    def effective_limit(self) -> int | None:
        """This session's device limit now: its own, lowered by its share of a global excess."""
        if self.limits.global_device_bytes is None:
            return self.limits.device_bytes
        return self.limits.device_share(self.usage_bytes(), self.port.global_device_bytes())

    def floor(self) -> AttendedFloor | None:
        """What attended KV costs at the least the budget holds it in; None: full precision."""
        store = self.port.store
        return store.attended_floor() if isinstance(store, AttendedQuantizer) else None

    def recall_room(self, floor: AttendedFloor | None) -> int | None:
        """Device bytes recall may fill: the high watermark minus pinned and active spans (None = no limit).

        Up to the high watermark, not the low one: the low watermark is where demotion
        stops, the high one is the limit the prefill that follows must respect.
        """
        limit = self.effective_limit()
        if limit is None:
            return None
        fixed = [
            s.held_tokens + (s.length - s.n_computed)
            for s in self.table.spans
            if s.tier.attended and (s.pinned or s.state is SpanState.ACTIVE)
        ]
        if floor is None:
            held = sum(fixed) * self.port.bytes_per_token
        else:
            held = sum(floor.span_cost(tokens) for tokens in fixed) + floor.exact_surplus
        return max(0, self.limits.high_bytes(limit) - held)

    def quantized_now(self) -> dict[int, int]:
        """Each attended span's slots held quantized in attention now, by span id (empty without the tier)."""
        store = self.port.store
        if not isinstance(store, AttendedQuantizer):
            return {}
        attended = [s for s in self.table.spans if s.tier.attended]
        counts = store.attended_token_counts(attended)
        return {s.span_id: counts[s.span_id][0] if s.tier is Tier.ATTENDED_QUANTIZED else 0 for s in attended}

    def floor_usage(self, quantized: dict[int, int], floor: AttendedFloor) -> int:
        """Device bytes after this turn's prefill with every token the budget may quantize quantized.

        What the device counts now (attended KV, quantized archives), less the
        evictable spans (the budget drops them first), less what quantizing the exact
        tokens would free (the sinks and the residual window stay exact), plus the new
        message's pending tokens at their quantized size. `quantized`: each device span's
        slots held quantized now. The fine planes of 8-bit keys count as held: a key read
        at 8 bits is about as good as exact, for a thirteenth of the bytes that holding
        its token exact adds, so exact recall does not take them for room.
        """
        store = self.port.store
        usage = self.usage_bytes()
        exact_held = 0
        pending = 0
        for span in self.table.spans:
            if not span.tier.attended:
                continue
            if span.state is SpanState.EVICTABLE:
                usage -= store.span_bytes(span)
                continue
            exact_held += span.held_tokens - quantized[span.span_id]
            pending += span.length - span.n_computed
        quantizable = max(0, exact_held - floor.exact_tokens)
        saved = quantizable * max(0, floor.exact_token_bytes - floor.token_bytes)
        return usage - saved + floor.span_cost(pending)

    # -- order and plans --------------------------------------------------------------------

    def demote_to(
        self, target: int, limit: int | None, *, order: str | None = None, coarsen_to: int | None = None
    ) -> None:
        """Bring device usage to at most `target` bytes with one placement plan (re-planned if short).

        Spans recalled for this turn move only while usage is over `limit` itself (its
        high watermark, not `target`): recall chose them for the question being
        answered, but the budget is a limit and the turn's own new content must fit. The
        store's byte figures are estimates before a move (int4 keys; a tier with 8-bit
        keys holds more): when usage is still over `target` after the moves, the plan is
        made again from what the store now holds (`REPLANS` at most). With 8-bit keys,
        once nothing is left to quantize, keys drop to 4 bits (in the planner's order)
        before any span leaves attention. `order` overrides the session's step order
        (`placement_order`) for this call.

        `coarsen_to` (the budget's limit): fine key planes are dropped only down to it,
        and once usage is within it nothing else moves. A key at 8 bits reads about as
        well as an exact one, and dropping a fine plane needs no recompute and no copy of
        the span, so a hysteresis gap below the limit saves nothing there; each turn that
        goes over drops the planes it needs, until none are left and spans move by the plan.
        """
        coarse_target = target if coarsen_to is None else max(target, coarsen_to)
        hard = max(target, self.limits.high_bytes(limit)) if limit is not None else target
        step_order = order or self.placement_order
        for _ in range(REPLANS):
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
            plan = plan_placement(choices, usage, target, hard_target=hard, order=step_order)
            by_id = {s.span_id: s for s in self.table.spans}
            moving = [by_id[c.span_id] for c in choices if c.span_id in plan.rungs]
            leaving = [
                s
                for s in moving
                if plan.rungs[s.span_id] not in ATTENDED_RUNGS and s.state is not SpanState.EVICTABLE
            ]
            if leaving and self.mover.can_coarsen():
                # 8-bit keys drop to 4 bits before any span leaves attention: the rest of the plan first.
                staying = [s for s in moving if s not in leaving]
                self._apply(staying, plan.rungs)
                if staying:
                    continue
                if self.usage_bytes() <= coarse_target:
                    return  # within the limit with the fine planes held
                if self.mover.coarsen(self._attended_in_order(), self.usage_bytes() - coarse_target):
                    continue
            if not plan.rungs:
                if self.mover.coarsen(self._attended_in_order(), usage - coarse_target):
                    continue
                return
            self._apply(moving, plan.rungs)
            if leaving and self.mover.can_coarsen():
                # The plan quantized spans while others left attention: their keys go to 4 bits too.
                self.mover.coarsen(self._attended_in_order(), self.usage_bytes())
                coarse_target = target
            if self.usage_bytes() >= usage:
                return  # nothing moved (every move failed): the plan would repeat itself

    def _attended_in_order(self) -> list[Span]:
        """Attended spans, the lifecycle's lowest class first (the order keys drop to 4 bits in)."""
        attended = [s for s in self.table.spans if s.tier.attended]
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


class PlacementPeer:
    """What budget enforcement, recall and exact recall share: the service they ask.

    The peers never call each other; each reads room and order from the placer and
    moves spans through its mover. The port, table and marks are the placer's.
    """

    def __init__(self, placer: Placer, timer: SectionTimer) -> None:
        self.placer = placer
        self.port = placer.port
        self.table = placer.table
        self.mover = placer.mover
        self.marks = placer.marks
        self.timer = timer
