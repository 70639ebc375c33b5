"""Displaced spans come back: after recall, the budget's own order decides what the device holds.

Recall makes room for what a question needs: a long tool result recalled for one
question displaces committed spans the budget would otherwise have kept (short user
facts, a confirmed option), since the spans recalled for a turn are demoted last.
Once that turn is over the recalled span competes on value per byte again, but the
spans it displaced are no longer on the device to compete with it: they would come
back only if a later question happened to name them. The device then holds what
an old question needed rather than what the demotion order values, and a fact the
agent confirmed is lost to a log that was read once.

So at each new user turn, after recall has served the question, the demoted spans
are offered back in the budget's own order (GreedyDual-Size,
`agentkv.lifecycle.placer.demotion_order`): a demoted span whose value per token is higher than
that of the attended spans the budget would demote first comes back when the room
under the low watermark, plus what those lower-valued spans hold, pays for it. The
budget check after the prefill then demotes the lower-valued spans as it always
does. Nothing is displaced for an equal or higher value, so the held set only
moves toward the order the budget keeps, and spans the question needs (recalled
or relevant) are never offered up.

A dropped span comes back lazily: its tokens join the prefill that follows (the new
user message's), at their logical positions, with no forward of their own; an
archived one is copied back. Both keep the score they were given at commit.

Opt-in (`recall.restore_displaced`). Measured over 225 questions at 12.5% it gains 8
answers and loses 6, most of them int4 near misses. The room it refills is the room exact
recall would have used at the next turn. It also adds 40-55% prefill tokens
(`scripts/recall_bench.py`, docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.placer import PlacementPeer, Placer, demotion_order, value_per_token
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedFloor


def held_when_back(span: Span) -> int:
    """Tokens a demoted span holds once attended again (a dropped span is recomputed in full)."""
    return span.n_computed if span.tier is Tier.DROPPED else span.held_tokens


def value_when_back(span: Span) -> float:
    """A demoted span's value per token once attended again (the demotion order's measure)."""
    return span.score / max(1, held_when_back(span))


def plan_restoration(
    demoted: Sequence[Span],
    attended: Sequence[Span],
    free: int,
    cost: Callable[[int], int],
    marks: RecallMarks,
) -> list[Span]:
    """The demoted spans to bring back, best first.

    Args:
        demoted: recallable demoted spans recall did not bring back this turn.
        attended: committed attended spans that are neither pinned nor needed by this turn.
        free: device bytes under the low watermark once the prefill has run (may be negative).
        cost: bytes a span of that many tokens holds on the device at the floor of the order.
        marks: this turn's recall marks (the demotion order puts what the turn needs last).

    Each candidate, highest value per token first, takes the free room and then the
    room of the attended spans the budget would demote first, as long as each of those
    is worth less per token than the candidate; if that is not enough, nothing is
    displaced for it and the next candidate is tried.
    """
    queue = [s for s in demotion_order(attended, marks) if s.span_id not in marks.needed]
    restored: list[Span] = []
    for span in sorted(demoted, key=lambda s: (value_when_back(s), s.start), reverse=True):
        need = cost(held_when_back(span))
        value = value_when_back(span)
        gained, taken = 0, 0
        while free + gained < need and taken < len(queue) and value_per_token(queue[taken]) < value:
            gained += cost(queue[taken].held_tokens)
            taken += 1
        if free + gained < need:
            continue
        restored.append(span)
        del queue[:taken]
        free += gained - need
    return restored


def attended_competitors(spans: Sequence[Span], marks: RecallMarks) -> list[Span]:
    """Committed attended spans a restoration may displace: not pinned, not protected by this turn."""
    return [
        s
        for s in spans
        if s.state is SpanState.COMMITTED
        and s.tier is Tier.DEVICE
        and not s.pinned
        and s.span_id not in marks.recalled
        and s.span_id not in marks.needed
    ]


class Restorer(PlacementPeer):
    """Brings back, at a new user turn, the demoted spans the demotion order values above attended ones."""

    def __init__(self, placer: Placer, timer: SectionTimer, *, enabled: bool) -> None:
        super().__init__(placer, timer)
        self.enabled = enabled

    def restore(self, demoted: list[Span], floor: AttendedFloor | None) -> list[int]:
        """Bring back the `demoted` spans `plan_restoration` picks; their ids.

        Called after recall and exact recall took the room the question needs. The room
        left is the low watermark minus the device bytes after the prefill, at the floor
        of the demotion order (`Placer.room_at_floor`; `floor` None: full precision).
        """
        if not self.enabled or not demoted or self.placer.effective_limit() is None:
            return []
        if floor is None:
            per_token = self.placer.port.bytes_per_token

            def cost(tokens: int) -> int:
                return tokens * per_token
        else:
            cost = floor.span_cost
        with self.timer.timed("policy_seconds"):
            free = self.placer.room_at_floor(floor) or 0
            plan = plan_restoration(
                demoted, attended_competitors(self.table.spans, self.marks), free, cost, self.marks
            )
        self.mover.restore_together([s for s in plan if s.tier is not Tier.DROPPED])
        restored = [
            span.span_id
            for span in plan
            if self.mover.move(span, SpanState.COMMITTED, reason="restore", lazily=True) is not None
        ]
        self.table.counters.restored_spans += len(restored)
        return restored
