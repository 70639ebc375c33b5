"""Pins as receipts: `pin()` hands out a `Lease`, `release(lease)` gives that pin back.

As in SGLang's radix cache (`inc_lock_ref` / `dec_lock_ref`), what must not be
evicted is held by a receipt, so a lost lease can only keep memory, never free
someone else's. A lease lists its spans; each span lists the leases that pin it
(`Span.leases`); the span table grants and takes back leases
(`SpanTable.grant` / `give_back`) and `agentkv.lifecycle.invariants` checks the
two sides agree.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

_lease_ids = itertools.count(1)


@dataclass(frozen=True)
class Lease:
    """A receipt for a pin. Only `Session.release(lease)` with this receipt removes that pin."""

    lease_id: int
    session_id: str
    span_ids: tuple[int, ...]
    reason: str = ""

    @staticmethod
    def new(session_id: str, span_ids: tuple[int, ...], reason: str = "") -> Lease:
        """A fresh lease with a process-unique id."""
        return Lease(next(_lease_ids), session_id, span_ids, reason)
