"""The placement service: the one owner of what the device holds, and of the room left on it.

Budget enforcement, recall and exact recall do not predict each other's room: each
asks this service for a plan. It measures usage against the limits (the watermark
arithmetic lives in `agentkv.lifecycle.limits.BudgetLimits`) and plans
(`agentkv.lifecycle.options` gives every span its rungs,
`agentkv.lifecycle.placement.plan_placement` picks one per span) in both directions:
down, for the budgets (`place`: the device, and the host as the plan's second
resource), and up, for recall and exact recall (`plan_promotions`: a recalled span's
return to attention, a page recomputed at full precision, each a promotion the plan
grants when its room can be made by the steps of everything below it in the
lifecycle's order). The mover applies the moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.mover import Mover
from agentkv.lifecycle.options import host_options, pending_options, span_options
from agentkv.lifecycle.placement import ATTENDED_FIRST, Placement, plan_placement
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.rungs import ATTENDED_RUNGS, Rung, SpanOptions
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState
from agentkv.store.protocol import AttendedFloor, AttendedQuantizer


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

    def relieve_global(self) -> int:
        """The plan's first step over the global high watermark: free what no session attends; bytes freed.

        Unreferenced prefix cache entries go before any session demotes a span of its own.
        """
        free = self.limits.global_relief(self.port.global_device_bytes())
        return self.port.relieve_global(free) if free else 0

    def floor(self) -> AttendedFloor | None:
        """What attended KV costs at the least the budget holds it in; None: full precision."""
        store = self.port.store
        return store.attended_floor() if isinstance(store, AttendedQuantizer) else None

    def pending_tokens(self) -> int:
        """Tokens of attended spans not computed yet (the next prefill's)."""
        return sum(s.length - s.n_computed for s in self.table.spans if s.tier.attended)

    def plan_promotions(
        self,
        promotions: Sequence[SpanOptions],
        target: int,
        *,
        relevance: Mapping[int, float] | None = None,
        klass_of: Mapping[int, int] | None = None,
        keep_attended: frozenset[int] = frozenset(),
        spare: bool = False,
    ) -> Placement:
        """One plan over every span, the next prefill's tokens and the promotions asked for.

        The promotions start granted; the plan steps down from there, every span by its
        rungs and class and value, until the device total (the new message's tokens at the
        rung the budget will hold them in included) is at `target`. A promotion it keeps
        fits: the steps of everything below it in the order make its room. A promotion
        of span `s` stands for `s`'s own options (`s` is left out of the rest).

        Args:
            promotions: what recall asks for (`options.promotion`), best first.
            target: the device total to reach.
            relevance: each span's relevance to the current question (raises its value).
            klass_of: classes that override the lifecycle's.
            keep_attended: spans that may not leave attention in this plan.
            spare: no span leaves attention or drops its fine key planes (where 8-bit keys
                are in play), released ones included: only quantizing makes room.
        """
        asked = {p.span_id for p in promotions}
        options = self._span_options(relevance=relevance, klass_of=klass_of, attended=keep_attended)
        choices = [c for c in options if c.span_id not in asked]
        pending = pending_options(
            self.pending_tokens(), self.floor(), self.port.bytes_per_token, self.port.rung_fidelity()
        )
        usage = self.usage_bytes()
        if pending is not None:
            choices.append(pending)
            usage += pending.options[0].device_bytes
        choices += promotions
        spare_above = None
        if spare:
            raised = sum(p.options[0].device_bytes - p.options[p.current].device_bytes for p in promotions)
            spare_above = usage + raised
        return plan_placement(
            choices, usage, target, spare_above=spare_above, spare_released=spare, order=self.placement_order
        )

    def _span_options(
        self,
        *,
        relevance: Mapping[int, float] | None = None,
        klass_of: Mapping[int, int] | None = None,
        attended: frozenset[int] = frozenset(),
    ) -> list[SpanOptions]:
        """Every span's rungs at the store's costs (`options.span_options`), with this session's settings."""
        return span_options(
            self.table.spans,
            self.port.store,
            self.marks,
            archive_tier=self.mover.archive_tier,
            fidelity=self.port.rung_fidelity(),
            relevance=relevance,
            klass_of=klass_of,
            attended=attended,
        )

    def apply_exits(self, plan: Placement) -> None:
        """Make the moves of `plan` that take a span out of attention (the rest wait for the budget)."""
        by_id = {s.span_id: s for s in self.table.spans}
        exits = {i: r for i, r in plan.rungs.items() if i in by_id and r not in ATTENDED_RUNGS}
        self._apply([by_id[i] for i in exits], exits)

    # -- order and plans --------------------------------------------------------------------

    def place(
        self,
        target: int | None,
        limit: int | None,
        *,
        host_limit: int | None = None,
        order: str | None = None,
        spare_above: int | None = None,
    ) -> None:
        """Bring the device to at most `target` bytes and the host under `host_limit`: one plan, its moves.

        The device is planned first, on the store's own counts (`attended_costs`), so the
        plan lands where it says. Spans recalled for this turn leave attention only while
        usage is over `limit` itself (its high watermark, not `target`): recall chose them
        for the question being answered, but the budget is a limit and the turn's own new
        content must fit. With 8-bit keys, holding a span's keys at 4 bits is one of its
        steps (`Rung.KEYS8` -> `Rung.ATTENDED_Q`), taken in the planner's order with the
        others: every span is quantized (to 8-bit keys) before any coarsens, and every
        attended step comes before any span leaves attention.

        The host is the plan's second resource: what the host holds once the device's
        archives arrive (each at its host bytes, `RungOption.host_bytes`) is planned
        against `host_limit` by the same planner (`options.host_options`), down to its low
        watermark; a span the device sends to the host that the host cannot keep is dropped
        instead of copied there first (its token ids stay: recall recomputes it).

        Args:
            target: the device total to reach (its low watermark); None: the device is not over.
            limit: the device limit (`target`'s high watermark is its bound for recalled spans).
            host_limit: the host budget's limit; None: no host budget.
            order: overrides the session's step order (`placement_order`) for this call.
            spare_above: no span leaves attention or drops its fine key planes while usage
                is at or under it (`plan_placement`); the budget passes its high watermark.
        """
        choices: list[SpanOptions] = []
        rungs: dict[int, Rung] = {}
        usage = self.usage_bytes()
        if target is not None and usage > target:
            hard = max(target, self.limits.high_bytes(limit)) if limit is not None else target
            choices = self._span_options()
            plan = plan_placement(
                choices,
                usage,
                target,
                hard_target=hard,
                spare_above=spare_above,
                order=order or self.placement_order,
            )
            rungs = dict(plan.rungs)
        dropped: dict[int, Rung] = {}
        if host_limit is not None:
            arriving = {
                c.span_id: option.host_bytes
                for c in choices
                for option in c.options
                if rungs.get(c.span_id) is option.rung and option.host_bytes
            }
            dropped = self._host_plan(host_limit, arriving)
        for span_id in dropped.keys() & rungs.keys():
            rungs[span_id] = dropped.pop(span_id)  # the device's archive the host cannot keep
        by_id = {s.span_id: s for s in self.table.spans}
        self._apply([by_id[i] for i in rungs if i in by_id], rungs)
        self._apply([by_id[i] for i in dropped if i in by_id], dropped, reason="host budget")

    def _host_plan(self, host_limit: int, arriving: Mapping[int, int]) -> dict[int, Rung]:
        """The host's moves (span id -> `Rung.DROPPED`) once `arriving` lands there; none under the limit."""
        store = self.port.store
        usage = store.host_bytes() + sum(arriving.values())
        if not self.limits.over(usage, host_limit):
            return {}
        fidelity = self.port.rung_fidelity()
        choices = host_options(self.table.spans, store, self.marks, arriving=arriving, fidelity=fidelity)
        return plan_placement(choices, usage, self.limits.low_bytes(host_limit)).rungs

    def _apply(self, spans: list[Span], rungs: Mapping[int, Rung], reason: str = "budget") -> None:
        """Make the planned moves through the mover: drops and archives, quantization, then 4-bit keys."""
        marks = self.marks
        quantize: list[Span] = []
        coarse: list[Span] = []
        for span in spans:
            rung = rungs[span.span_id]
            if rung in ATTENDED_RUNGS:
                quantize.append(span)
                if rung is Rung.ATTENDED_Q:
                    coarse.append(span)
                continue
            state = SpanState.EVICTED if rung is Rung.DROPPED else SpanState.ARCHIVED
            was_recallable = span.span_id in marks.recallable
            committed = span.state is SpanState.COMMITTED
            if self.mover.move(span, state, reason=reason) is None:
                continue
            # Archived or dropped by the budget, or an archive the budget evicted: still recallable
            # (restored, or recomputed from its token ids). Released spans are not.
            if state is SpanState.ARCHIVED or was_recallable or committed:
                marks.recallable.add(span.span_id)
        if quantize:
            self.mover.hold_quantized(quantize)
        if coarse:
            self.mover.hold_coarse(coarse)


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
