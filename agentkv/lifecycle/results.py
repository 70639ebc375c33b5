"""What lifecycle operations return: small frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.spans import Lease, SpanState, Tier


@dataclass(frozen=True)
class Transition:
    """One span's move."""

    span_id: int
    before: SpanState
    after: SpanState
    tier: Tier
    reason: str


@dataclass(frozen=True)
class ApplyResult:
    """What `Session.apply(event)` did."""

    event: str
    applied: bool
    """False for a no-op (duplicate, unknown target, span already evicted)."""
    transitions: tuple[Transition, ...] = ()
    leases: tuple[Lease, ...] = ()
    reason: str = ""
