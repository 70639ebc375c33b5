"""Session statistics and the event log, as plain dataclasses that export to JSON."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Counters:
    """Running totals a session keeps (mutable; `SessionStats` is the frozen view)."""

    prefill_tokens: int = 0
    reused_tokens: int = 0
    shared_prefix_tokens: int = 0
    generated_tokens: int = 0
    cropped_tokens: int = 0
    encoded_tokens: int = 0
    rehydrated_tokens: int = 0
    restored_tokens: int = 0
    compressed_tokens: int = 0
    exact_recalled_tokens: int = 0
    observed_commits: int = 0
    events_applied: int = 0
    events_noop: int = 0
    events_internal: int = 0
    transitions: int = 0
    faults: int = 0
    budget_unmet: int = 0
    engine_moves: int = 0
    peak_device_bytes: int = 0
    lifecycle_seconds: float = 0.0
    policy_seconds: float = 0.0
    store_seconds: float = 0.0
    forward_seconds: float = 0.0

    def add(self, other: Counters) -> None:
        """Add another session's totals to these (a branch adopted by its thread keeps both).

        Totals are summed; `peak_device_bytes` is the larger of the two peaks.
        """
        for name, value in asdict(other).items():
            mine = getattr(self, name)
            setattr(self, name, max(mine, value) if name == "peak_device_bytes" else mine + value)


@dataclass(frozen=True)
class PromptRead:
    """What an answer's first token read: its prompt as held in the cache.

    `attended_tokens` = tokens of the cache the first answer token attended (the whole
    prompt, generation prompt included, as held: evicted or archived spans are not in
    it). `encoded_total` = the session's `encoded_tokens` at that moment, so a caller
    that read the stats before its call knows how many tokens it encoded itself (the
    rest of the attended ones were read from the cache).
    """

    attended_tokens: int
    encoded_total: int

    def usage(self, encoded_before: int) -> tuple[int, int, int]:
        """`(input_tokens, cache_read, new_tokens)` of a call begun at `encoded_tokens == encoded_before`.

        `input_tokens = cache_read + new_tokens` exactly; tokens encoded by the call and
        demoted before the answer was read do not count (the answer never attended them).
        """
        new = min(max(0, self.encoded_total - encoded_before), self.attended_tokens)
        return self.attended_tokens, self.attended_tokens - new, new


@dataclass(frozen=True)
class SessionStats:
    """What `Session.stats()` reports (contract fields first)."""

    session_id: str
    prefill_tokens: int
    """Tokens encoded by the model in this session so far."""
    reused_tokens: int
    """Tokens served from the cache instead of being re-encoded."""
    device_bytes: int
    """Full-precision KV bytes attended on the model's device, now."""
    quantized_bytes: int
    host_bytes: int
    peak_device_bytes: int
    tokens_by_state: dict[str, int]
    generated_tokens: int = 0
    cropped_tokens: int = 0
    encoded_tokens: int = 0
    """Tokens run through the model into this session's cache: prefills, spans recomputed from
    their tokens, and each generated token fed back (scoring forwards that leave the cache as it
    was are not counted)."""
    rehydrated_tokens: int = 0
    restored_tokens: int = 0
    compressed_tokens: int = 0
    exact_recalled_tokens: int = 0
    """Tokens of relevant spans held quantized that recall recomputed at full precision."""
    observed_commits: int = 0
    """Tool results compressed at commit by their turn's question (`commit.observe: question`)."""
    shared_device_bytes: int = 0
    """Part of `device_bytes` shared with another session (a branch fork's parent, or the
    backend's prefix cache), not owned; the global budget counts it once across sessions."""
    shared_prefix_tokens: int = 0
    """Of `reused_tokens`, tokens taken from a prefix another session encoded (the backend's
    prefix cache; on a served engine, the engine's own prefix cache hits)."""
    attended_tokens: int = 0
    attended_quantized_tokens: int = 0
    """Of `attended_tokens`, those held at int4/int2 in attention (the attended quantized tier)."""
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """Tokens of the spans on each tier (`agentkv.spans.Tier` values, `attended_quantized` included)."""
    logical_tokens: int = 0
    spans: int = 0
    turn: int = 0
    events_applied: int = 0
    """Events sent to the session (by the agent's run, the handler or the user) that changed something."""
    events_noop: int = 0
    """Events that changed nothing: unknown owner or session, duplicate, or span already evicted."""
    events_internal: int = 0
    """Turn ends the session applied itself (a new user message closes the previous turn); not in
    `events_applied`, which counts only what the user's graph caused."""
    transitions: int = 0
    faults: int = 0
    """Failures inside offload / restore / quantization / policy that were survived."""
    budget_unmet: int = 0
    """Times the budget could not be met without demoting pinned or active spans."""
    engine_moves: int = 0
    """Times a served conversation moved to another engine of its fleet (its engine was down)."""
    engine: str | None = None
    """The served engine the last call went to (its URL); None on a local model."""
    route: str = ""
    """Why the last call went there (`agentkv.engines.fleet.Route`: reason and loads); "" on a local model."""
    budget_satisfied: bool = True
    budget_device_bytes: int | None = None
    """The device limit the last budget check applied, in bytes (None = no limit)."""
    budget_device_tokens: float | None = None
    """The same limit in full-precision token equivalents, the unit of `budget.device_tokens`
    (bytes / one full-precision token's bytes): tokens held at int4 take less, so more fit."""
    budget_used_bytes: int = 0
    """What the device budget counts now: attended KV and quantized archives."""
    budget_used_tokens: float = 0.0
    """`budget_used_bytes` in full-precision token equivalents."""
    lifecycle_seconds: float = 0.0
    policy_seconds: float = 0.0
    store_seconds: float = 0.0
    forward_seconds: float = 0.0

    @classmethod
    def from_counters(cls, counters: Counters, **now: Any) -> SessionStats:
        """The running totals as they are, plus the figures measured now (bytes, tokens by state, ...).

        Every `Counters` field is a `SessionStats` field of the same name: a new counter
        reaches the stats without being copied by hand.
        """
        return cls(**asdict(counters), **now)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


@dataclass(frozen=True)
class LogRecord:
    """One entry of a session's event log."""

    kind: str
    """"event", "transition", "extend", "generate", "budget", "recall", "fault"."""
    detail: dict[str, Any]
    at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        """One JSON object (a line of the JSONL export)."""
        return json.dumps({"kind": self.kind, "at": self.at, **self.detail}, default=str)
