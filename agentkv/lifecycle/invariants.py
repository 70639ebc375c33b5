"""The invariants of a session's span table, its store and its budget, checked in one call.

Written next to the code that could break them (the mover, the budget), and run
by the property tests after every operation.
"""

from __future__ import annotations

from collections.abc import Iterable

from agentkv.lifecycle.rules import DEMOTED_STATES
from agentkv.lifecycle.table import SpanTable
from agentkv.spans import SpanState, Tier


def table_problems(table: SpanTable, tool_call_spans: Iterable[tuple[str, int]] = ()) -> list[str]:
    """Positions, message numbering, states against tiers, and leases; one line per problem."""
    problems: list[str] = []
    spans = table.spans
    by_id = {s.span_id: s for s in spans}
    if len(by_id) != len(spans):
        problems.append("two spans share an id")
    expected_start = 0
    message_index = 0
    for span in spans:
        if span.start != expected_start:
            problems.append(f"span {span.span_id} starts at {span.start}, expected {expected_start}")
        expected_start = span.end
        if span.message_index >= 0:
            if span.message_index != message_index:
                problems.append(
                    f"span {span.span_id} is message {span.message_index}, expected {message_index}"
                )
            message_index += 1
        if not 0 <= span.n_computed <= span.length:
            problems.append(f"span {span.span_id} computed {span.n_computed} of {span.length} tokens")
        if span.kept is not None and (
            span.kept != sorted(set(span.kept)) or any(not 0 <= o < span.n_computed for o in span.kept)
        ):
            problems.append(f"span {span.span_id} keeps offsets outside its computed tokens")
    if message_index != len(table.messages):
        problems.append(f"{message_index} message spans for {len(table.messages)} messages")
    for span in spans:
        if span.state is SpanState.ARCHIVED and not span.tier.archived:
            problems.append(f"archived span {span.span_id} is on tier {span.tier.value}")
        if span.state is SpanState.EVICTED and span.tier is not Tier.DROPPED:
            problems.append(f"evicted span {span.span_id} is on tier {span.tier.value}")
        if span.state in (SpanState.ACTIVE, SpanState.COMMITTED) and not span.tier.attended:
            problems.append(f"{span.state.value} span {span.span_id} is on tier {span.tier.value}")
        if span.pinned and span.state in DEMOTED_STATES:
            problems.append(f"pinned span {span.span_id} is {span.state.value}")
        for lease_id in span.leases:
            lease = table.lease(lease_id)
            if lease is None or span.span_id not in lease.span_ids:
                problems.append(f"span {span.span_id} is pinned by lease {lease_id}, which does not list it")
    for lease in table.leases.values():
        for span_id in lease.span_ids:
            live = by_id.get(span_id)
            if live is not None and lease.lease_id not in live.leases:
                problems.append(f"lease {lease.lease_id} lists span {span_id}, which lost the pin")
    for call_id, span_id in tool_call_spans:
        if span_id not in by_id:
            problems.append(f"tool call {call_id!r} registered to unknown span {span_id}")
    return problems


def raise_problems(session_id: str, problems: list[str]) -> None:
    """Raise `RuntimeError` naming every broken invariant (the first ten), if any.

    Raises:
        RuntimeError: so a failing property test says what went wrong, not just that something did.
    """
    if problems:
        msg = f"session {session_id}: " + "; ".join(problems[:10])
        raise RuntimeError(msg)
