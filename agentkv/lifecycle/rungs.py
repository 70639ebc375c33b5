"""The rungs a span's KV can occupy, from the most faithful to the cheapest, and what each costs.

    full precision  ->  8-bit keys  ->  int4 / int2 attended  ->  archived  ->  dropped

A `RungOption` is one rung with its device bytes (the store's count,
`agentkv.lifecycle.options`) and its fidelity cost (the fraction of a span's value
lost there, calibrated on the loaded model: `agentkv.backend.calibration`). The
planner (`agentkv.lifecycle.placement`) chooses one rung per span.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class Rung(Enum):
    """Where a span's KV is, from the most faithful to the cheapest."""

    FULL = "full"
    """Attended at the model's dtype."""
    KEYS8 = "keys8"
    """Attended, keys at 8 bits (two 4-bit planes), values quantized."""
    ATTENDED_Q = "attended_q"
    """Attended at the tier's bits (int4 or int2), sinks and residual window exact."""
    ARCHIVED = "archived"
    """Not attended, held on the archive tier (host exact, or int8/int4 on the device)."""
    DROPPED = "dropped"
    """Not held: recomputed from its token ids when needed."""


ATTENDED_RUNGS: frozenset[Rung] = frozenset({Rung.FULL, Rung.KEYS8, Rung.ATTENDED_Q})
"""Rungs that keep a span attended (all a pinned or active span may occupy)."""

DEFAULT_FIDELITY: Mapping[Rung, float] = {
    Rung.FULL: 0.0,
    Rung.KEYS8: 0.05,
    Rung.ATTENDED_Q: 0.25,
    Rung.ARCHIVED: 0.9,
    Rung.DROPPED: 1.0,
}
"""Fraction of a span's value lost at each rung, before calibration on the loaded model.

An archived span is not attended but comes back exactly (or nearly) when recalled; a
dropped one must be recomputed, against whatever the cache holds then.
"""


@dataclass(frozen=True)
class RungOption:
    """One rung a span may occupy, with what it costs there."""

    rung: Rung
    device_bytes: int
    """Device bytes the span holds at this rung (what the device budget counts)."""
    fidelity: float
    """Fraction of the span's value lost at this rung (0 = none)."""
    host_bytes: int = 0
    """Host bytes the span holds at this rung (what the host budget counts): its host archive."""


@dataclass(frozen=True)
class SpanOptions:
    """One span's choice: where it is now and where it may go."""

    span_id: int
    value: float
    """What losing the span entirely costs (the strategy's value)."""
    options: tuple[RungOption, ...]
    """The rungs the span may occupy, the most faithful first: the current one (`current`), the
    higher ones a promotion may reach before it, the cheaper ones it may be moved to after it."""
    klass: int = 0
    """The lifecycle's class: a lower class gives up each kind of step before a higher one."""
    order: int = 0
    """Tie-break between equal steps: the lower goes first (the span's start: older first)."""
    released: bool = False
    """Released by a rule (the grace queue): its steps come before every other span's."""
    hard: bool = False
    """Leaves attention only while the total is over `plan_placement`'s `hard_target` (recalled spans)."""
    current: int = 0
    """Index in `options` of the rung the span is on now; the rungs before it are promotions
    (a return to attention, a recompute at full precision) the plan may keep."""
    last: bool = False
    """Its steps down rank with the steps that take a span out of attention, after those of lower
    classes: the current question's best match is given up after everything the question does not need."""


NEEDED_CLASS = 1
"""The class of the spans the current question needs (`agentkv.lifecycle.options.NEEDED`)."""
PROMOTION_CLASS = 4
"""The class of a promotion (`agentkv.lifecycle.options.PROMOTION`): above pinned spans, so an
upgrade is given up only after every span is held at its quantized rung."""


class PlacementStrategy(Protocol):
    """The value of a span: what the planner loses by holding it at a cheaper rung."""

    def value(self, span_id: int, score: float, tokens: int, weight: float) -> float:
        """A span's value from its commit score, its held tokens and the lifecycle's weight for it."""
        ...


@dataclass(frozen=True)
class GreedyDualValue:
    """GreedyDual-Size (Cao & Irani 1997): the commit score is the value of a hit, whatever the span's size.

    The planner divides by bytes, so a long log and a short user fact of equal score
    are not equally cheap to keep. `weight` is the lifecycle's prior (pinned, active,
    needed by the current question, recalled for it), multiplied in.
    """

    floor: float = 1e-3
    """Value of a span scored 0 (never committed with a score): still more than nothing."""

    def value(self, span_id: int, score: float, tokens: int, weight: float) -> float:
        """`(score + floor) * weight`."""
        return (max(0.0, score) + self.floor) * weight
