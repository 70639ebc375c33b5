"""The placement planner: one rung per span, chosen in one pass, so the limits hold at the least loss.

Every place a span's KV can be is a **rung** with a device cost (bytes, from the
store) and a fidelity cost (the fraction of the span's value lost there):

    full precision  ->  8-bit keys  ->  int4 / int2 attended  ->  archived  ->  dropped

A span's **value** comes from a strategy (`PlacementStrategy.value`, the way sglang's
radix cache takes an eviction strategy): its commit score, raised by its relevance to
the current question. The loss of holding span `s` at rung `r` is `value(s) * fidelity(r)`.

`plan_placement` is a multiple-choice knapsack solved greedily in one pass: each span
steps down its rungs, and the steps of all spans are taken in the lifecycle's order
until the device total is at the target. That order is lexicographic and named
(`PLACEMENT_ORDERS`). `needed_last`: every step of the spans the current
question does not need first, and among them every step that keeps a span attended
(int4 in attention) before any step that takes one out of attention, by class (the
rest, then the current turn, then pinned spans); only then the spans the current
question needs, int4 before archive, so a span the answer reads stays at full precision
while anything it does not need can still be archived (at 25% of the cache, int4 on the
needed span cost answers that 12.5%, which archives and recalls it exactly, kept:
issue 27, docs/benchmarks.md). `attended_first`, the default: every int4 step of every
class before any archive (`needed_last` can archive a committed span while released
scaffolding still waits in the grace queue on the device). In either order, every span
is quantized (to 8-bit keys) before any drops its fine key planes. Within a class, the least
value lost per byte saved (GreedyDual-Size). A span's allowed rungs bound how far
it may go: pinned and active spans are never archived or dropped, only held at a
cheaper attended rung, so a pinned prompt larger than the budget is held at int4
instead of leaving the budget unmet at full precision.

The plan runs in both directions. A span may also hold rungs *above* the one it is on
(`SpanOptions.current`): a recalled span's return to attention, a page recomputed at
full precision. Such a promotion starts granted, and its steps back down compete with
every other step in the same order (its class places it: recall's candidates with the
spans the question needs, an upgrade above pinned spans, the best match last). Once
the total is at the target, the promotions refused on the way are granted again,
the last in the order first, wherever the room left over holds them
(`_give_back`), so no refused promotion would have fit on its own.

Pure: no store, no model. `agentkv.lifecycle.options` builds the options from the store;
`agentkv.lifecycle.placer` applies the plan through the mover.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from agentkv.lifecycle.rungs import ATTENDED_RUNGS, NEEDED_CLASS, Rung, RungOption, SpanOptions


@dataclass(frozen=True)
class Placement:
    """What `plan_placement` chose."""

    rungs: dict[int, Rung]
    """The chosen rung of every span that moves, up or down (span id -> rung); spans absent stay."""
    device_bytes: int
    """The estimated device total once the moves are made."""
    loss: float
    """The estimated value lost by the moves."""
    met: bool
    """Whether the estimated total is at or under the target."""
    raised: frozenset[int] = frozenset()
    """The spans the plan keeps above their current rung (the promotions it grants)."""


NEEDED_LAST = "needed_last"
"""The spans the current question needs give up their steps after every other span."""
ATTENDED_FIRST = "attended_first"
"""Every step that keeps a span attended, of every class, before any step that takes one out of attention."""
PLACEMENT_ORDERS: tuple[str, ...] = (NEEDED_LAST, ATTENDED_FIRST)
"""The orders `plan_placement` knows, by name."""


@dataclass(order=True)
class _Step:
    phase: int
    """0, or 1 for the steps that wait for every other span's (`needed_last`: the needed spans)."""
    leaves: bool
    """The step takes the span out of attention (archived or dropped): after every step that does not."""
    coarsens: bool
    """The step drops a span's fine key planes (8-bit keys to the tier's bits): after every step
    that quantizes a span, so every span holds 8-bit keys before any holds 4-bit ones."""
    klass: int
    slope: float
    order: int
    span_id: int = field(compare=False)
    index: int = field(compare=False)
    """Index in the span's chain of the rung this step reaches."""


def step_chain(options: Sequence[RungOption], current: int = 0) -> list[RungOption]:
    """The rungs a span steps through: its highest first, then the cheaper rungs on the lower convex hull.

    Among rungs of equal bytes the least loss is kept; a rung that saves bytes but loses
    less than the one before it (an inconsistent input) is taken at the earlier loss. An
    attended rung that loses more per byte saved than a cheaper rung beyond it is
    skipped (the multiple-choice knapsack's LP-dominated item): 8-bit keys that lose
    more per byte than 4-bit keys, and 4-bit keys that lose more per byte than leaving
    attention from 8-bit keys (on a model where the quantized tier costs nearly as much
    as not attending a span, the span goes straight to its archive).
    The archive is never skipped: it is the tier the configuration names (an int8
    archive on the device is where a span leaving attention goes, even where dropping
    it would save more per unit of loss). Nor is the rung the span is on now
    (`options[current]`, below a promotion): the plan may always leave it where it is.
    """
    top, now = options[0], options[current]
    cheaper = sorted(
        (o for o in options[1:] if o.device_bytes < top.device_bytes),
        key=lambda o: (-o.device_bytes, o.fidelity, o is not now),
    )
    monotone = [top]
    for option in cheaper:
        if option.device_bytes == monotone[-1].device_bytes:
            continue
        if option.fidelity < monotone[-1].fidelity:
            option = RungOption(option.rung, option.device_bytes, monotone[-1].fidelity)
        monotone.append(option)
    chain: list[RungOption] = []
    for option in monotone:
        while (
            len(chain) >= 2
            and chain[-1].rung in ATTENDED_RUNGS
            and chain[-1].device_bytes != now.device_bytes
            and _slope(1.0, chain[-2], chain[-1]) > _slope(1.0, chain[-2], option)
        ):
            chain.pop()
        chain.append(option)
    return chain


def _current_index(chain: Sequence[RungOption], now: RungOption) -> int:
    """Where the span is now in its chain: the rung at its current bytes (the top without a promotion)."""
    return next((i for i, o in enumerate(chain) if o.device_bytes == now.device_bytes), 0)


def _attended_is_cheaper(options: Sequence[RungOption]) -> bool:
    """Whether the span's cheapest attended rung loses less than its cheapest rung out of attention.

    Only then does leaving attention wait for every attended step: on a model where the
    quantized tier costs as much as not attending a span (calibrated), archiving
    it (exact, recallable) competes on value per byte instead.
    """
    attended = [o.fidelity for o in options if o.rung in ATTENDED_RUNGS and o is not options[0]]
    leaving = [o.fidelity for o in options if o.rung not in ATTENDED_RUNGS]
    return not attended or not leaving or max(attended) < min(leaving)


def _slope(value: float, a: RungOption, b: RungOption) -> float:
    saved = a.device_bytes - b.device_bytes
    return value * (b.fidelity - a.fidelity) / saved if saved > 0 else float("inf")


def _give_back(
    chains: dict[int, list[RungOption]],
    current: dict[int, int],
    at: dict[int, int],
    total: int,
    target: int,
    *,
    rank_of: Callable[[int, int], tuple[int, bool, bool, int, float]],
) -> int:
    """Give promotions back the steps the room left over allows: the last in the order first; the total.

    A promotion stepped down while the total was over the target; once the later steps
    closed the gap, one that fits again is granted again, so no promotion the plan
    refuses would have fit on its own.
    """
    while True:
        undo = [
            (rank_of(span_id, index), span_id)
            for span_id, index in at.items()
            if index > 0
            and current[span_id] > 0
            and total + chains[span_id][index - 1].device_bytes - chains[span_id][index].device_bytes
            <= target
        ]
        if not undo:
            return total
        _, span_id = max(undo)
        index = at[span_id]
        total += chains[span_id][index - 1].device_bytes - chains[span_id][index].device_bytes
        at[span_id] = index - 1


def plan_placement(
    choices: Iterable[SpanOptions],
    usage: int,
    target: int,
    *,
    hard_target: int | None = None,
    spare_above: int | None = None,
    spare_released: bool = False,
    order: str = ATTENDED_FIRST,
) -> Placement:
    """Choose a rung for every span so that the device total is at most `target`, losing the least.

    Steps are taken in the lifecycle's order: released spans (the grace queue) first,
    oldest first; then every step that keeps a span attended
    (int4 in attention) before any that takes one out of attention; within each, the
    lower class first (`SpanOptions.klass`: the rest, then what the current question
    needs, then active, then pinned); within a class, the least value lost per byte
    saved first. With `order="needed_last"` the steps of the spans the
    current question needs (class `NEEDED_CLASS`) come after all of that, int4 before
    archive; with `"attended_first"` (the default) they take their class's place among the others.
    The last step, the one that closes the gap, is the closing step that
    loses least in that order (not the one with the best rate, which may save far more
    than needed).

    Args:
        choices: every span that may move, with its value and its rungs (current first).
        usage: the device total now (bytes).
        target: the total to reach (the low watermark).
        hard_target: the total above which `hard` spans may leave attention too (the high
            watermark); None = they move like any other.
        spare_above: the total above which any span may leave attention or drop its fine
            key planes (8-bit keys to the tier's bits); None = no such bound. Released
            spans are not bound by it, and it holds only where 8-bit keys are in play
            (some span's rungs include them). At the high watermark: once every span is
            held quantized, a history under the limit keeps its 8-bit keys and every
            span attended (a key at 8 bits reads about as well as an exact one, and the
            hysteresis gap below the limit saves no re-plan there).
        spare_released: released spans are held by `spare_above` too (a promotion's plan:
            an upgrade makes its room by quantizing, the grace queue's spans included, and
            takes no span out of attention); False: the budget's, released spans go first.
        order: one of `PLACEMENT_ORDERS`.

    Promotions (`SpanOptions.current` > 0) start granted and count in the total from the
    start; those refused are given back the room left over at the end (`_give_back`).

    Returns:
        The moves (span id -> rung, up or down), the estimated total and loss, whether
        `target` is met, and the promotions granted (`raised`).
    """
    if order not in PLACEMENT_ORDERS:
        raise ValueError(f"unknown placement order {order!r}; expected one of {PLACEMENT_ORDERS}")
    chains: dict[int, list[RungOption]] = {}
    heap: list[_Step] = []
    spans: dict[int, SpanOptions] = {}

    def step_to(choice: SpanOptions, index: int) -> _Step:
        chain = chains[choice.span_id]
        before, after = chain[index - 1], chain[index]
        leaves = after.rung not in ATTENDED_RUNGS and not choice.released
        leaves = (leaves and _attended_is_cheaper(choice.options)) or choice.last
        klass = -1 if choice.released else choice.klass
        slope = _slope(choice.value, before, after)
        phase = int(order == NEEDED_LAST and klass == NEEDED_CLASS)
        coarsens = before.rung is Rung.KEYS8 and after.rung is Rung.ATTENDED_Q and not choice.released
        return _Step(phase, leaves, coarsens, klass, slope, choice.order, choice.span_id, index)

    current: dict[int, int] = {}
    total = usage
    for choice in choices:
        chain = step_chain(choice.options, choice.current)
        now = _current_index(chain, choice.options[choice.current])
        total += chain[0].device_bytes - chain[now].device_bytes  # a promotion starts granted
        if len(chain) < 2:
            continue
        chains[choice.span_id] = chain
        spans[choice.span_id] = choice
        current[choice.span_id] = now
        heap.append(step_to(choice, 1))
    heapq.heapify(heap)
    if not any(option.rung is Rung.KEYS8 for chain in chains.values() for option in chain):
        spare_above = None

    def spares(step: _Step) -> bool:
        """The step drops a span's fine key planes, or takes a kept span out of attention."""
        exits = chains[step.span_id][step.index].rung not in ATTENDED_RUNGS
        return step.coarsens or (exits and (spare_released or not spans[step.span_id].released))

    def rank(step: _Step) -> tuple[int, bool, bool, int, float]:
        """The step order's keys, loss in place of the slope (for the closing step)."""
        return (step.phase, step.leaves, step.coarsens, step.klass, lost(step))

    def blocked(step: _Step) -> bool:
        if spare_above is not None and total <= spare_above and spares(step):
            return True
        return spans[step.span_id].hard and step.leaves and hard_target is not None and total <= hard_target

    def saved(step: _Step) -> int:
        chain = chains[step.span_id]
        return chain[step.index - 1].device_bytes - chain[step.index].device_bytes

    def lost(step: _Step) -> float:
        chain = chains[step.span_id]
        return spans[step.span_id].value * (chain[step.index].fidelity - chain[step.index - 1].fidelity)

    at: dict[int, int] = {}
    while heap and total > target:
        step = heapq.heappop(heap)
        if blocked(step):
            continue
        if saved(step) >= total - target:
            # The last step: any step that alone closes the gap will do; take the least loss.
            closing = [s for s in heap if saved(s) >= total - target and not blocked(s)]
            best = min(closing, key=lambda s: (*rank(s), s.order), default=step)
            if rank(best) < rank(step):
                heap.remove(best)
                heap.append(step)
                heapq.heapify(heap)
                step = best
        total -= saved(step)
        at[step.span_id] = step.index
        if step.index + 1 < len(chains[step.span_id]):
            heapq.heappush(heap, step_to(spans[step.span_id], step.index + 1))
    total = _give_back(
        chains,
        current,
        at,
        total,
        target,
        rank_of=lambda span_id, index: rank(step_to(spans[span_id], index)),
    )
    final = {span_id: at.get(span_id, 0) for span_id in chains}
    loss = sum(spans[i].value * (chains[i][f].fidelity - chains[i][0].fidelity) for i, f in final.items())
    rungs = {span_id: chains[span_id][i].rung for span_id, i in final.items() if i != current[span_id]}
    raised = frozenset(span_id for span_id, i in final.items() if i < current[span_id])
    return Placement(rungs=rungs, device_bytes=total, loss=loss, met=total <= target, raised=raised)
