"""Which spans recall may bring back, and which it brought back for the current turn."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecallMarks:
    """Recall bookkeeping shared by the mover, the budget and recall."""

    recallable: set[int] = field(default_factory=set)
    """Spans demoted by budget pressure (not released by a rule): recall may bring them back."""
    recalled: set[int] = field(default_factory=set)
    """Spans recall made attended (or protected) for this turn: demoted last."""
    relevance: dict[int, float] = field(default_factory=dict)
    """Recall score of each span recalled this turn (the least relevant goes first under pressure)."""
    needed: set[int] = field(default_factory=set)
    """Attended spans recall counts as relevant to this turn's user message: demoted after the rest."""

    def new_turn(self) -> None:
        """A new user turn: last turn's recall protections lapse."""
        self.recalled = set()
        self.relevance = {}
        self.needed = set()

    def mark_recalled(self, span_id: int, score: float) -> None:
        """Protect a span for this turn, with the relevance recall gave it."""
        self.recalled.add(span_id)
        self.relevance[span_id] = score

    def inherit(self, parent: RecallMarks) -> None:
        """A fork may recall what its parent could."""
        self.recallable = set(parent.recallable)
