"""The store protocol: where a session's KV lives, as the lifecycle sees it.

The lifecycle decides *what* happens to a span (commit, release, archive, evict,
recall, pin); a store carries it out on whatever holds the KV. The lifecycle's
mover (`agentkv.lifecycle.mover`) is the only caller of the verbs below, and the
only place where a span's lifecycle state and its storage tier change together.

Two implementations:

- `agentkv.store.kvstore.KVStore`: the in-process physical cache of a local
  Transformers model (device tensors, an int8/int4 tier, a host tier).
- a served-engine store (vLLM + LMCache over HTTP): `note_state(COMMITTED)` pins
  the span's prefix in the engine, `note_state(EVICTABLE)` leaves the span out of
  the next prompt, `archive` deletes it from L1 and keeps L2, `restore` prefetches,
  `fork` shares the prefix with a branch, `forget` deletes a branch's tail.

The verbs take `Span`s (token ids, logical positions, kept offsets: everything an
engine needs to address the KV by token sequence) and return plain Python values;
tensors stay inside the implementations. A store sets `span.kept` (and
`span.n_computed`) when it moves KV; it never writes `span.tier` or `span.state`:
each verb that moves KV returns the tier the span is on afterwards (a `Tier`, or a
`MoveResult` for several spans) and the mover writes it, so a span's state and tier
change in one place. A caller that uses a store without a mover (a test) writes the
returned tier itself.

Errors: a verb that cannot do its work raises; the mover records a fault and
keeps the span where it was (a failed offload must never lose a span).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from agentkv.spans import Span, SpanState, Tier

ARCHIVE_TIERS: tuple[str, ...] = ("host", "int8", "int4", "drop")
"""Where `archive` may put a span (`agentkv.archive_tier` in YAML)."""


@dataclass(frozen=True)
class TierBytes:
    """Bytes held per tier, now."""

    device: int
    quantized: int
    host: int
    shared: int = 0
    """Part of `device` that is a prefix shared with a parent session (not owned)."""


@dataclass(frozen=True)
class MoveResult:
    """What a store verb did to several spans (or to what one span holds): the mover writes the tiers."""

    tiers: dict[int, Tier] = field(default_factory=dict)
    """Span id -> the tier it is on now, for every span the verb changed."""
    freed: int = 0
    """Device bytes freed."""
    dropped: dict[int, int] = field(default_factory=dict)
    """Span id -> tokens whose KV the verb removed (compression)."""


@dataclass(frozen=True)
class AttendedFloor:
    """What attended KV costs at the least the budget can hold it in (the attended quantized tier).

    Bytes over all layers. Recall plans with it: under pressure every span is held quantized in attention
    before any is archived, so a span brought back needs room at this size.
    """

    token_bytes: int
    """A token held quantized: codes, value statistics, key statistics amortized over full groups."""
    exact_token_bytes: int
    """A token at full precision."""
    span_bytes: int
    """At most what a span adds beyond its tokens: the statistics of its last, partial key group."""
    exact_tokens: int
    """Tokens never quantized: the attention sinks and the residual window."""
    fine_token_bytes: int = 0
    """What a quantized token's 8-bit keys add to `token_bytes` (their fine plane); 0 without them."""

    def span_cost(self, tokens: int) -> int:
        """Bytes a span of `tokens` takes at most, held quantized."""
        return tokens * self.token_bytes + self.span_bytes if tokens else 0

    @property
    def exact_surplus(self) -> int:
        """What the never-quantized tokens cost beyond their quantized size."""
        return self.exact_tokens * max(0, self.exact_token_bytes - self.token_bytes)


@dataclass(frozen=True)
class SpanCosts:
    """One attended span's device bytes now and at each attended rung, counted from the store's codes.

    Slots never quantized (the attention sinks, the residual window) stay exact at every rung.
    """

    held: int
    """Slots the span holds in attention."""
    quantized: int
    """Of them, held quantized now."""
    fine: int
    """Of the quantized, keys held at 8 bits (their fine plane is held)."""
    quantizable: int
    """Exact slots the attended tier would quantize now."""
    now: int
    """Bytes held now."""
    keys8: int | None
    """Bytes with every quantizable slot quantized at 8-bit keys (None: the tier has no 8-bit keys)."""
    coarse: int
    """Bytes with every quantizable slot quantized and every key at the tier's floor bits."""
    int8: int = 0
    """Device bytes of the span archived on the int8 tier (codes, statistics, residual)."""
    int4: int = 0
    """Device bytes of the span archived on the int4 tier."""
    host: int = 0
    """Host bytes of the span archived on the host tier (at `host_bits` where that is smaller)."""


@dataclass(frozen=True, eq=False)
class AttendedTokens:
    """Attended tokens as a policy scores them: what `KVStoreProtocol.attended_tokens` reads.

    `n` tokens, in the store's slot order; `keys` and `query_keys` are empty/None when not asked for.
    """

    keys: tuple[torch.Tensor, ...]
    """Per layer, the tokens' keys `[B, H, n, D]` (dequantized on the attended quantized tier)."""
    query_keys: tuple[torch.Tensor, ...] | None
    """Per layer, the keys of the most recent attended tokens `[B, H, w, D]` (a stand-in for queries)."""
    positions: torch.Tensor
    """`[n]` logical positions."""
    span_ids: torch.Tensor
    """`[n]` the span each token belongs to."""
    offsets: torch.Tensor
    """`[n]` each token's offset in its span."""
    slots: torch.Tensor
    """`[n]` where each token sits among the attended slots (an index into `SessionPort.window_attention`)."""
    attention: torch.Tensor
    """`[n]` attention from the last observation window (SnapKV)."""
    accumulated_attention: torch.Tensor
    """`[n]` attention accumulated over every forward (H2O)."""
    decayed_attention: torch.Tensor
    """`[n]` attention with exponential decay (SideQuest-style EMA)."""
    attended: int
    """Attended slots in the whole cache (the length of `window_attention`'s answer)."""


@runtime_checkable
class KVStoreProtocol(Protocol):
    """What the lifecycle asks of "where KV lives" (one store per session)."""

    def archive(self, span: Span, tier: str) -> Tier:
        """Move an attended span out of attention into `tier` (one of `ARCHIVE_TIERS`); the span's tier now.

        `drop` releases the KV (DROPPED); the others keep it recallable (HOST or
        QUANTIZED). Raises when the span is not attended or the tier is full; the span
        then stays where it was.
        """
        ...

    def restore_many(self, spans: Sequence[Span]) -> MoveResult:
        """Bring archived spans back into attention, all or nothing; the tiers of those restored."""
        ...

    def drop(self, span: Span) -> Tier:
        """Release a span's KV wherever it is (DROPPED); its token ids stay, so it can be recomputed."""
        ...

    def archive_exact(self, span: Span) -> bool:
        """Whether an archived span's restore gives back its KV exactly (a full-precision host copy).

        False for codes (the int8 / int4 tiers, a host copy at `host_bits`): a restore
        then holds their dequantized values.
        """
        ...

    def forget(self, span: Span) -> None:
        """Remove a span entirely (a history rewrite or a pruned branch's tail)."""
        ...

    def compress(self, span: Span, keep_offsets: list[int]) -> MoveResult:
        """Keep only `keep_offsets` of an attended span (commit-time compression); dropped tokens, tier."""
        ...

    def cut(self, span: Span, keep_tokens: int) -> Tier:
        """Keep only an attended span's first `keep_tokens` (a rewritten message's start); its tier."""
        ...

    def adopt_recomputed(self, span: Span) -> Tier:
        """The span's KV was recomputed from its token ids and is attended again; its tier (DEVICE)."""
        ...

    def note_state(self, span: Span, before: SpanState, after: SpanState) -> None:
        """The lifecycle moved `span` from `before` to `after` (an engine pins or unpins its prefix)."""
        ...

    def bytes_by_tier(self) -> TierBytes:
        """Exact bytes held per tier, now."""
        ...

    def host_bytes(self) -> int:
        """Bytes on the host tier (what the host budget counts)."""
        ...

    def span_bytes(self, span: Span) -> int:
        """Bytes held for one span in its tier."""
        ...

    def deferred_removal(self) -> AbstractContextManager[None]:
        """Batch the removals of several moves (one compaction for all of them)."""
        ...

    def check(self, spans: Sequence[Span]) -> list[str]:
        """Inconsistencies between the spans' tiers and what the store holds (empty = none)."""
        ...

    # -- token access: a store without readable KV answers "not supported" (`WholeSpanStore`) --

    def attended_size(self) -> tuple[int, int] | None:
        """Attended slots and device bytes of one slot; None: the store has no tokens a policy can read."""
        ...

    def attended_tokens(self, span: Span | None, *, keys: bool, queries: bool) -> AttendedTokens | None:
        """The attended tokens of `span` (or of the whole cache) for a policy; None: not supported.

        Only those tokens are read, never a whole layer (on the attended quantized tier a read
        dequantizes). Raises when the cache holds slots but no keys.
        """
        ...

    def keep_attended(self, spans: Sequence[Span], keep: torch.Tensor) -> MoveResult:
        """Keep only the attended slots `keep` (`AttendedTokens.slots` values); dropped tokens and tiers.

        Token-mode eviction (the generic baselines). Each span's `kept` lists what it
        holds afterwards. Raises `NotImplementedError` where `attended_size` is None.
        """
        ...

    def recompute_lazily(self, span: Span) -> Tier | None:
        """Make a dropped span attended with every token pending, so the next prefill recomputes it.

        Sets `span.n_computed` to 0 and returns the span's tier (DEVICE). None (nothing
        changed): the store cannot (its prefill does not compute pending spans).
        """
        ...


class WholeSpanStore:
    """The "not supported" answers of a store whose KV the lifecycle cannot read token by token.

    A served engine (and a simulated store) moves whole spans only: no policy scores its
    tokens, no lazy recompute. Such a store inherits these answers, so
    the lifecycle gets a clear behaviour (spans frozen uncompressed, recall by words) from
    it rather than an `AttributeError`.
    """

    def attended_size(self) -> tuple[int, int] | None:
        """Not supported: None."""
        return None

    def attended_tokens(self, span: Span | None, *, keys: bool, queries: bool) -> AttendedTokens | None:
        """Not supported: None."""
        del span, keys, queries
        return None

    def keep_attended(self, spans: Sequence[Span], keep: torch.Tensor) -> MoveResult:
        """Not supported (`attended_size` is None)."""
        del spans, keep
        msg = f"{type(self).__name__} keeps whole spans: token-mode eviction does not apply"
        raise NotImplementedError(msg)

    def cut(self, span: Span, keep_tokens: int) -> Tier:
        """Not supported: whole spans only (a rewritten message is re-sent whole)."""
        del span, keep_tokens
        msg = f"{type(self).__name__} keeps whole spans: a span cannot be cut"
        raise NotImplementedError(msg)

    def recompute_lazily(self, span: Span) -> Tier | None:
        """Not supported: None."""
        del span
        return None


@runtime_checkable
class CostReporter(Protocol):
    """A store that counts what each attended span costs at each attended rung (the planner's input)."""

    def attended_costs(self, spans: Sequence[Span]) -> dict[int, SpanCosts]:
        """By attended span id: its bytes now and at each attended rung, in one pass over the cache."""
        ...


@runtime_checkable
class AttendedQuantizer(Protocol):
    """A store with an attended quantized tier: a span can be held quantized and still be attended."""

    def quantize_attended_until(self, spans: Sequence[Span], free_bytes: int | None) -> MoveResult:
        """Hold `spans` quantized in attention, in order, until `free_bytes` are freed (None: all; one pass).

        Sinks and the residual window stay full precision. Bytes freed, and
        ATTENDED_QUANTIZED for every span any of whose tokens it quantized.
        """
        ...

    def coarsen_attended_until(self, spans: Sequence[Span], free_bytes: int) -> int:
        """Hold the spans' keys at 4 bits instead of 8 (8-bit key tiers), in order, until `free_bytes`.

        Bytes freed. Only spans already held quantized have 8-bit keys; they stay ATTENDED_QUANTIZED.
        """
        ...

    def fine_key_bytes(self) -> int:
        """Bytes of the 8-bit keys' fine planes held (freed by holding every quantized key at 4 bits)."""
        ...

    def attended_floor(self) -> AttendedFloor | None:
        """What attended KV costs held quantized (recall's plan); None without the tier or any KV."""
        ...

    def attended_quantized_tokens(self, span: Span | None = None) -> int:
        """Slots held quantized in attention (of one span, or all)."""
        ...

    def attended_token_counts(self, spans: Sequence[Span]) -> dict[int, tuple[int, int]]:
        """By span id: (slots held quantized in attention, slots quantizing the span would take now).

        One pass for every span: the placement planner's estimate on every plan.
        """
        ...

    def quantized_offsets(self, span: Span) -> list[int]:
        """Offsets of the span's tokens held quantized in attention, sorted."""
        ...

    def recompute_pending(self, span: Span) -> Tier:
        """Drop an attended, uncompressed span's KV, its tokens pending: the next forward recomputes them.

        The span's tier now (DEVICE: it is attended, and recomputed at full precision).
        """
        ...
