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
