"""The order in which budget pressure demotes committed spans: value per byte, after what the turn needs.

Two things decide which committed span the budget quantizes or archives first:

1. **What this turn's user message needs goes last.** Recall ranks every attended span
   against the new message; the spans it counts as relevant (at least
   `recall.relative_floor` times as relevant as the best, the rule recall itself
   uses to pick candidates) are demoted only after every other committed span.
   A weak match does not count: a question shares "what", "the" and "?" with
   half the history, and letting those scores order the demotion pushed a short
   user fact out in favour of a long log that merely shared a word.
2. **Among the rest, the least value per byte goes first** (GreedyDual-Size, Cao &
   Irani 1997, with the commit score as the value of a hit). Every demotion
   frees bytes in proportion to the span's held tokens, while what is lost is one
   span's chance of being needed, which the commit score estimates. A 30-token
   user message that names a policy number and a 500-token tool log of equal
   score are not equally cheap to keep: holding the message costs a sixteenth of
   the log. The log is also the span recall can bring back later, because a
   question about it shares its rare words (codes, field names); a user fact asked
   in other words cannot be found again once it is gone.

Ties go to the older span first.
"""

from __future__ import annotations

from collections.abc import Iterable

from agentkv.lifecycle.marks import RecallMarks
from agentkv.spans import Span


def value_per_token(span: Span) -> float:
    """The span's commit score per held token (GreedyDual-Size's H with unit miss cost = score)."""
    return span.score / max(1, span.held_tokens)


def demotion_key(span: Span, marks: RecallMarks) -> tuple[bool, float, int]:
    """Sort key, lowest first: not needed by this turn, then the least value per token, then the oldest."""
    return (span.span_id in marks.needed, value_per_token(span), span.start)


def demotion_order(spans: Iterable[Span], marks: RecallMarks) -> list[Span]:
    """`spans` in the order budget pressure demotes them (first = demoted first)."""
    return sorted(spans, key=lambda span: demotion_key(span, marks))
