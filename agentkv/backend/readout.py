"""What a session tells without changing anything: its table's fields, stats, snapshots, the log.

`Session` and `EngineSession` inherit these from `SessionReadout` (through
`agentkv.backend.session_core`), so the encoding and decoding of each stay on one
screen. Every method reads; none writes the cache or the span table (`stats` only
raises the peak-bytes counter). What differs by store (how many tokens the model
attends) is `_attended_tokens`.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from typing import Any, Protocol

from agentkv.chat import ChatMessage
from agentkv.lifecycle.manager import LifecycleManager
from agentkv.lifecycle.table import SpanTable
from agentkv.metrics import Counters, LogRecord, SessionStats
from agentkv.spans import Lease, Span, SpanState, Tier
from agentkv.store.protocol import TierBytes

__all__ = ["ReadableStore", "SessionReadout"]


class ReadableStore(Protocol):
    """What the readout reads of a session's store (`KVStore`, `EngineStore`)."""

    def bytes_by_tier(self) -> TierBytes:
        """Bytes held per tier, now."""
        ...

    def span_bytes(self, span: Span) -> int:
        """Bytes held for one span."""
        ...

    def close(self) -> None:
        """Free everything the store holds."""
        ...


class SessionReadout:
    """The reading half of `Session`: properties over its `SpanTable`, stats and snapshots."""

    backend: Any
    session_id: str
    lock: threading.RLock
    store: ReadableStore
    table: SpanTable
    manager: LifecycleManager

    # -- the span table's fields, for reading ----------------------------------------------------

    @property
    def spans(self) -> list[Span]:
        """The logical sequence's spans (the table's list)."""
        return self.table.spans

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation's messages (the table's list)."""
        return self.table.messages

    @property
    def leases(self) -> dict[int, Lease]:
        """Live pin receipts by id."""
        return self.table.leases

    @property
    def turn(self) -> int:
        """The current user turn."""
        return self.table.turn

    @property
    def counters(self) -> Counters:
        """Running totals."""
        return self.table.counters

    @property
    def log(self) -> deque[LogRecord]:
        """The event log."""
        return self.table.log

    @property
    def logical_length(self) -> int:
        """Tokens in the logical sequence (held or not)."""
        return self.table.logical_length

    @property
    def recallable(self) -> frozenset[int]:
        """Ids of the demoted spans recall may bring back (a copy: reading it changes nothing)."""
        with self.lock:
            return frozenset(self.manager.recallable)

    def _attended_tokens(self) -> tuple[int, int]:
        """`(attended, attended quantized)` tokens the model reads now (the subclass knows its store)."""
        raise NotImplementedError

    # -- reporting -------------------------------------------------------------------------------

    def stats(self) -> SessionStats:
        """Counters and per-tier bytes, now."""
        with self.lock:
            tiers = self.store.bytes_by_tier()
            by_state = {state.value: 0 for state in SpanState}
            by_tier = {tier.value: 0 for tier in Tier}
            for span in self.spans:
                by_state[span.state.value] += span.length
                by_tier[span.tier.value] += span.length
            c = self.counters
            c.peak_device_bytes = max(c.peak_device_bytes, tiers.device)
            attended, attended_quantized = self._attended_tokens()
            return SessionStats.from_counters(
                c,
                session_id=self.session_id,
                device_bytes=tiers.device,
                quantized_bytes=tiers.quantized,
                host_bytes=tiers.host,
                shared_device_bytes=tiers.shared,
                tokens_by_state=by_state,
                tokens_by_tier=by_tier,
                attended_tokens=attended,
                attended_quantized_tokens=attended_quantized,
                logical_tokens=self.logical_length,
                spans=len(self.spans),
                turn=self.turn,
                **self.manager.budget.figures(),
            )

    def snapshot(self) -> dict[str, Any]:
        """The span map and stats as a JSON-friendly dict (what `agentkv inspect` renders)."""
        with self.lock:
            tokenizer = self.backend.tokenizer
            spans = []
            for span in self.spans:
                entry = span.describe()
                entry["bytes"] = self.store.span_bytes(span)
                entry["preview"] = tokenizer.decode(span.token_ids[:48], skip_special_tokens=False)
                spans.append(entry)
            return {"session_id": self.session_id, "stats": self.stats().to_dict(), "spans": spans}

    def export_log(self) -> str:
        """The event log as JSON lines."""
        with self.lock:
            return "\n".join(record.to_json() for record in self.log)

    def save_snapshot(self, path: str) -> None:
        """Write `snapshot()` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.snapshot(), f, indent=2)

    def check(self) -> None:
        """Verify the invariants; raise `AssertionError`-free `RuntimeError` naming the first broken one."""
        with self.lock:
            self.manager.check()
