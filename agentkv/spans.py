"""Spans: contiguous runs of tokens in a session's logical sequence.

A span is the unit the lifecycle talks about. It always keeps its token ids, so
whatever happens to its KV (compressed, quantized, offloaded, dropped) the KV can
be recomputed from the tokens: nothing the agent said is ever lost.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import StrEnum


class SpanKind(StrEnum):
    """What a span holds; rules and policies treat kinds differently."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    REASONING = "reasoning"
    PROMPT = "prompt"  # template scaffolding such as the generation prompt


class SpanState(StrEnum):
    """Lifecycle state; see `agentkv.lifecycle.TRANSITIONS` for the allowed moves."""

    ACTIVE = "active"
    COMMITTED = "committed"
    ARCHIVED = "archived"
    EVICTABLE = "evictable"
    EVICTED = "evicted"


class Tier(StrEnum):
    """Where a span's KV lives right now (the mover writes it, from what the store's verbs return)."""

    DEVICE = "device"  # attended, every held token at full precision
    ATTENDED_QUANTIZED = "attended_quantized"  # attended, some or all held tokens quantized in attention
    QUANTIZED = "quantized"  # int8/int4 archive on the model's device, not attended
    HOST = "host"  # full precision on the CPU (pinned when CUDA), not attended
    DROPPED = "dropped"  # no KV held; recomputable from the token ids

    @property
    def attended(self) -> bool:
        """Whether the model attends the span's KV (at full precision or quantized in attention)."""
        return self in ATTENDED_TIERS

    @property
    def archived(self) -> bool:
        """Whether the span's KV is held out of attention, recallable (host or the quantized archive)."""
        return self in ARCHIVED_TIERS


ATTENDED_TIERS = frozenset({Tier.DEVICE, Tier.ATTENDED_QUANTIZED})
"""Tiers the model attends: what "on the device, in attention" means."""
ARCHIVED_TIERS = frozenset({Tier.HOST, Tier.QUANTIZED})
"""Tiers an archived span is on: its KV is held, out of attention, and can be restored."""


ATTENDED_STATES = frozenset({SpanState.ACTIVE, SpanState.COMMITTED, SpanState.EVICTABLE})


@dataclass
class Span:
    """One message (or part of one) in the logical sequence.

    `start` is the logical position of the first token: RoPE positions of the
    span's keys, which never change even when the span moves in the physical cache.
    """

    span_id: int
    kind: SpanKind
    token_ids: list[int]
    start: int
    owner: str | None = None
    """Message id, `tool_call_id`, run id or branch id that events use to name this span."""
    fingerprints: frozenset[str] = frozenset()
    """Fingerprints of the messages this span stands for (matched message by message)."""
    message_index: int = -1
    """Index of the message in the conversation; -1 for spans that are not messages."""
    branch: str | None = None
    turn: int = 0
    generated: bool = False
    """True when the model produced these ids (never re-tokenised)."""
    state: SpanState = SpanState.ACTIVE
    tier: Tier = Tier.DEVICE
    kept: list[int] | None = None
    """Offsets (within the span) whose KV is held after compression at commit; None = all."""
    frozen: bool = False
    """True once compressed at commit: later pressure moves the whole span, never re-scores it."""
    score: float = 0.0
    """Span-level importance fixed at commit; the lowest go first under pressure."""
    scored: bool = False
    """True once `score` was set at commit. A span recomputed later keeps it: the attention it
    draws in a recompute (its own tokens over a partial cache) is not the attention the
    conversation paid it, and re-scoring there would demote every recalled span first."""
    leases: set[int] = field(default_factory=set)
    n_computed: int = 0
    """How many of `token_ids` have had their KV computed (the tail may still be pending)."""
    text: str | None = None
    """The chat template's text these tokens stand for (a message's rendering; for an answer, its
    generation prompt, text and end of turn). A later call keeps the span only while the template
    still renders its message so (`ChatFormat.split`); None: not a message."""
    produced_text: bool = False
    """`text` is what the model produced; the template has not rendered the message yet."""

    @property
    def length(self) -> int:
        """Number of tokens in the span."""
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Logical position one past the last token."""
        return self.start + len(self.token_ids)

    @property
    def pinned(self) -> bool:
        """A pinned span is never demoted; pins are leases (see `Session.pin`)."""
        return bool(self.leases)

    @property
    def kept_offsets(self) -> list[int]:
        """Offsets whose KV is held in whatever tier the span is in."""
        return list(range(self.n_computed)) if self.kept is None else list(self.kept)

    @property
    def held_tokens(self) -> int:
        """Tokens whose KV is held (0 when dropped)."""
        if self.tier is Tier.DROPPED:
            return 0
        return self.n_computed if self.kept is None else len(self.kept)

    def mark_computed(self) -> None:
        """Record that the pending tail now has KV on the device.

        A span compressed at commit lists the offsets it kept; tail tokens computed
        after the commit are held too, so they join that list (they were never scored:
        compression happens once, at commit).
        """
        if self.kept is not None:
            self.kept = sorted(set(self.kept) | set(range(self.n_computed, self.length)))
        self.n_computed = self.length

    def describe(self) -> dict[str, object]:
        """A JSON-friendly summary, used by `inspect` and snapshots."""
        return {
            "span_id": self.span_id,
            "kind": self.kind.value,
            "owner": self.owner,
            "branch": self.branch,
            "turn": self.turn,
            "start": self.start,
            "tokens": self.length,
            "held_tokens": self.held_tokens,
            "state": self.state.value,
            "tier": self.tier.value,
            "pinned": self.pinned,
            "frozen": self.frozen,
            "generated": self.generated,
            "score": self.score,
            "scored": self.scored,
        }


# -- pins as receipts ---------------------------------------------------------------------------
# As in SGLang's radix cache (`inc_lock_ref` / `dec_lock_ref`), what must not be evicted is
# held by a receipt, so a lost lease can only keep memory, never free someone else's. A
# lease lists its spans; each span lists the leases that pin it (`Span.leases`); the span
# table grants and takes back leases (`SpanTable.grant` / `give_back`) and
# `agentkv.lifecycle.invariants` checks the two sides agree.

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
