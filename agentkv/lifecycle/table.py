"""The span table: a session's lifecycle state with a public face.

A session owns one table: its spans (the logical sequence), the messages they
stand for, the pin leases, the turn number, the running counters and the event
log. The session's encoder appends and crops spans; the lifecycle
(`agentkv.lifecycle.manager`) moves them between states and tiers. Both go
through this table's methods and fields, so neither reaches into the other's
private state, and the lifecycle can run on a table with no model behind it
(`tests/unit/test_lifecycle_simulated.py`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from agentkv.metrics import Counters, LogRecord
from agentkv.spans import Lease, Span, SpanKind, SpanState, Tier

if TYPE_CHECKING:
    from agentkv.chat import ChatMessage

LOG_LIMIT = 10_000
"""Records the event log keeps (the oldest go first)."""


class SpanTable:
    """Spans, messages, leases, turn, counters and the event log of one session."""

    def __init__(self, session_id: str, *, first_span_id: int = 0) -> None:
        self.session_id = session_id
        self.spans: list[Span] = []
        """The logical sequence, in order; span i ends where span i + 1 starts."""
        self.messages: list[ChatMessage] = []
        """The conversation's messages; `Span.message_index` points into this list."""
        self.leases: dict[int, Lease] = {}
        """Live pin receipts by id (see `agentkv.spans.Lease`)."""
        self.turn = 0
        """The current user turn (a new user message starts the next one)."""
        self.counters = Counters()
        self.log: deque[LogRecord] = deque(maxlen=LOG_LIMIT)
        """The public event log (`Session.export_log()` writes it as JSON lines)."""
        self._next_span_id = itertools.count(first_span_id)

    # -- the log -----------------------------------------------------------------------------

    def record(self, kind: str, **detail: Any) -> None:
        """Append one record to the event log (`kind`: event, transition, extend, recall, fault, ...)."""
        self.log.append(LogRecord(kind, detail))

    # -- spans -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    def span(self, span_id: int) -> Span:
        """The span with this id (KeyError naming the session when absent)."""
        found = self.find(span_id)
        if found is None:
            msg = f"session {self.session_id!r} has no span {span_id}"
            raise KeyError(msg)
        return found

    def find(self, span_id: int | None) -> Span | None:
        """The span with this id, or None."""
        for span in self.spans:
            if span.span_id == span_id:
                return span
        return None

    def owned_by(self, owner: str) -> list[Span]:
        """Spans whose owner (message id, tool_call_id) or branch is `owner`."""
        return [s for s in self.spans if s.owner == owner or s.branch == owner]

    def in_turn(self, turn: int) -> list[Span]:
        """Spans created during `turn`."""
        return [s for s in self.spans if s.turn == turn]

    def in_state(self, state: SpanState, tier: Tier | None = None) -> list[Span]:
        """Spans in `state` (and on `tier` when given), in logical order."""
        return [s for s in self.spans if s.state is state and (tier is None or s.tier is tier)]

    def message_spans(self) -> list[Span]:
        """Spans that stand for a message, in message order."""
        return [s for s in self.spans if s.message_index >= 0]

    @property
    def logical_length(self) -> int:
        """Tokens in the logical sequence (held or not)."""
        return self.spans[-1].end if self.spans else 0

    def token_ids(self) -> list[int]:
        """The whole logical sequence's token ids (nothing is ever lost)."""
        return [t for span in self.spans for t in span.token_ids]

    def new_span(self, kind: SpanKind, token_ids: list[int], *, branch: str | None, **fields: Any) -> Span:
        """Append a new ACTIVE device span at the end of the logical sequence."""
        span = Span(
            span_id=next(self._next_span_id),
            kind=kind,
            token_ids=list(token_ids),
            start=self.logical_length,
            turn=self.turn,
            branch=branch,
            **fields,
        )
        self.spans.append(span)
        return span

    def remove(self, span: Span) -> None:
        """Take a span out of the table (a prompt span whose prefill failed, a cropped message)."""
        self.spans.remove(span)

    def truncate(self, count: int) -> None:
        """Keep only the first `count` spans."""
        del self.spans[count:]

    def truncate_messages(self, count: int) -> None:
        """Keep only the first `count` messages."""
        del self.messages[count:]

    # -- leases ------------------------------------------------------------------------------

    def lease(self, lease_id: int) -> Lease | None:
        """The live lease with this id, or None."""
        return self.leases.get(lease_id)

    def add_lease(self, lease: Lease) -> None:
        """Record a granted lease."""
        self.leases[lease.lease_id] = lease

    def remove_lease(self, lease_id: int) -> None:
        """Forget a lease record (`give_back` also removes its spans' pins)."""
        self.leases.pop(lease_id, None)

    def grant(self, spans: Sequence[Span], reason: str = "") -> Lease:
        """Pin `spans` under one new lease (an empty lease pins nothing)."""
        lease = Lease.new(self.session_id, tuple(s.span_id for s in spans), reason)
        for span in spans:
            span.leases.add(lease.lease_id)
        self.add_lease(lease)
        return lease

    def move_pins(self, old: Span, new: Span) -> None:
        """`new` takes every pin of `old` (the same message, encoded again); the leases list it instead."""
        for lease_id in old.leases:
            lease = self.lease(lease_id)
            if lease is None:
                continue
            span_ids = tuple(new.span_id if i == old.span_id else i for i in lease.span_ids)
            self.leases[lease_id] = replace(lease, span_ids=span_ids)
            new.leases.add(lease_id)

    def give_back(self, lease: Lease) -> bool:
        """Remove this lease's pins; False (nothing changes) for an unknown or foreign lease.

        A receipt is its lease id in its session: the spans it pins may have been encoded
        again since it was granted (`move_pins`).
        """
        held = self.lease(lease.lease_id)
        if held is None or held.session_id != lease.session_id:
            return False
        self.remove_lease(lease.lease_id)
        for span in self.spans:
            span.leases.discard(lease.lease_id)
        return True

    def unpin_all(self, span: Span) -> None:
        """Give back every lease that pins `span` (a rule's `unpin` action)."""
        for lease_id in list(span.leases):
            lease = self.lease(lease_id)
            if lease is not None:
                self.give_back(lease)

    # -- branches ----------------------------------------------------------------------------

    def fork(self, session_id: str) -> SpanTable:
        """A branch's table: copies of the spans (their KV is shared by the store), messages and pins.

        Span ids continue the parent's numbering: ids of spans a rewrite removed are
        never reused, so nothing that still names them (an old lease, a recall mark)
        lands on a new span.
        """
        child = SpanTable(session_id, first_span_id=next(self._next_span_id))
        for span in self.spans:
            clone = Span(
                **{
                    **span.__dict__,
                    "leases": set(span.leases),
                    "kept": None if span.kept is None else list(span.kept),
                }
            )
            child.spans.append(clone)
        # The parent's pins hold in the branch too (the system prompt, confirmed facts).
        child.leases = dict(self.leases)
        child.messages = list(self.messages)
        child.turn = self.turn
        return child

    def clear(self) -> None:
        """Forget every span and message (a closed session)."""
        self.spans.clear()
        self.messages.clear()
