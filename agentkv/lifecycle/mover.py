"""The mover: the one place where a span's lifecycle state and its storage tier change together.

Every move goes `check_transition` → the store verb the move needs → the new
state, and a failed store verb is a recorded fault that leaves the span where it
was (a failed offload never loses a span; a failed restore falls back on
recomputing the span from its token ids). Only the mover writes `span.state` and
`span.tier`: a store verb returns the tier a span is on afterwards and the mover writes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from agentkv.lifecycle.marks import RecallMarks
from agentkv.lifecycle.rehydration import Recompute, RecomputeOffsets, rehydrate, rehydrate_lazily
from agentkv.lifecycle.results import Transition
from agentkv.lifecycle.rules import DEMOTED_STATES, check_transition
from agentkv.lifecycle.table import SpanTable
from agentkv.lifecycle.timing import SectionTimer
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import AttendedQuantizer, KVStoreProtocol

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

COARSEN_ALL = 1 << 62
"""`coarsen_attended_until`'s byte goal that every span given reaches (their fine planes all dropped)."""

CommitCompression = Callable[[Span], None]
"""Scores and compresses a span once, at its first commit (`Compressor.compress_at_commit`)."""


class Mover:
    """Moves spans between states, doing the store work each move needs."""

    def __init__(
        self,
        table: SpanTable,
        store: KVStoreProtocol,
        recompute: Recompute,
        archive_tier: str,
        marks: RecallMarks,
        timer: SectionTimer,
        recompute_offsets: RecomputeOffsets,
    ) -> None:
        self.table = table
        self.store = store
        self.recompute = recompute
        """The session's recompute of a dropped span (`SessionPort.recompute`)."""
        self.recompute_tokens = recompute_offsets
        """The session's recompute of some tokens of an attended span (`SessionPort.recompute_offsets`)."""
        self.archive_tier = archive_tier
        self.marks = marks
        self.timer = timer
        self.compress_at_commit: CommitCompression | None = None
        """Compresses a span at its first commit (set by the manager, which owns the policy)."""

    def move(self, span: Span, target: SpanState, *, reason: str, lazily: bool = False) -> Transition | None:
        """Move one span to `target`, doing the store work the move needs. None when nothing changed.

        `lazily`: a dropped span brought back to COMMITTED is left with its tokens
        pending for the next prefill (`rehydrate_lazily`) where the store allows it,
        instead of being recomputed now with a forward of its own.
        """
        if span.state is target:
            return None
        if span.pinned and target in DEMOTED_STATES:
            logger.debug("span %s is pinned: %s does not demote it", span.span_id, reason)
            return None
        check_transition(span.state, target, reason)
        before = span.state
        store = self.store
        with self.timer.timed("store_seconds"):
            if target is SpanState.COMMITTED:
                if lazily and (tier := rehydrate_lazily(span, store)) is not None:
                    span.tier = tier
                    self.table.counters.rehydrated_tokens += span.length
                if not span.tier.attended and not self._bring_back(span):
                    self._settle_failed_bring_back(span)
                    return None
                if self.compress_at_commit is None:
                    span.frozen = True
                elif not span.frozen and span.n_computed > 0:
                    self.compress_at_commit(span)  # a pending tail joins `kept` later
                # A span committed before any of its KV is computed (a history sent in one call, a
                # lazily recomputed span) is scored once the prefill computed it (`commit_computed`).
            elif target is SpanState.ARCHIVED:
                if span.tier.attended and not self._archive(span):
                    return None
                if span.tier is Tier.DROPPED:
                    target = SpanState.EVICTED
            elif target is SpanState.EVICTED:
                span.tier = store.drop(span)
                self.marks.recallable.discard(span.span_id)
        span.state = target
        store.note_state(span, before, target)
        self.table.counters.transitions += 1
        logger.debug(
            "session %s span %s (%s): %s -> %s [%s] on %s",
            self.table.session_id,
            span.span_id,
            span.kind.value,
            before.value,
            target.value,
            span.tier.value,
            reason,
        )
        return Transition(span.span_id, before, target, span.tier, reason)

    def commit_computed(self) -> int:
        """Score and compress, once, the committed spans whose KV a prefill has just computed.

        Commit-time scoring reads the span's own keys and attention, so a span committed
        while its tokens were still pending is scored here, after the forward that
        computed them, instead of being frozen with no score. Returns how many.
        """
        compress = self.compress_at_commit
        if compress is None:
            return 0
        late = [
            s
            for s in self.table.spans
            if s.state is SpanState.COMMITTED
            and not s.frozen
            and s.tier.attended
            and s.n_computed == s.length
        ]
        with self.timer.timed("store_seconds"):
            for span in late:
                compress(span)
        return len(late)

    def move_holding(self, span: Span, offsets: list[int], *, reason: str) -> bool:
        """Bring a span back (restored or recomputed at its logical positions) holding only `offsets`.

        The span is attended again like any span compressed at commit: `kept` lists the offsets it
        holds (exact recall's chosen pages, or what it held before an exact recompute); its token ids
        stay, so the rest can come back later. Commit-time compression (which re-runs on a recomputed
        span) must not thin the offsets out: they are this commit's choice.
        """
        compress, self.compress_at_commit = self.compress_at_commit, None
        try:
            moved = self.move(span, SpanState.COMMITTED, reason=reason)
        finally:
            self.compress_at_commit = compress
        if moved is None:
            return False
        keep = sorted(set(offsets) & set(span.kept_offsets))
        if keep and len(keep) < span.held_tokens:
            with self.timer.timed("store_seconds"):
                self.compress(span, keep)
        return True

    def compress(self, span: Span, keep_offsets: list[int]) -> int:
        """Keep only `keep_offsets` of an attended span; tokens dropped (raises what the store raised)."""
        result = self.store.compress(span, keep_offsets)
        self._write_tiers(result.tiers)
        return result.dropped.get(span.span_id, 0)

    def cut(self, span: Span, keep_tokens: int) -> None:
        """A rewritten message keeps its span's first `keep_tokens`; the store cuts the rest (`reopen`)."""
        span.tier = self.store.cut(span, keep_tokens)

    def reopen(self, span: Span) -> None:
        """A cut span's kept start is new content: ACTIVE and unfrozen (a rewrite, not a transition)."""
        span.state, span.frozen = SpanState.ACTIVE, False

    def keep_attended(self, keep: torch.Tensor) -> dict[int, int]:
        """Keep only the attended slots `keep` across the cache (token mode); tokens dropped by span id."""
        result = self.store.keep_attended(self.table.spans, keep)
        self._write_tiers(result.tiers)
        return result.dropped

    def ready_to_pin(self, span: Span, *, confirmed: bool, reason: str) -> bool:
        """Bring a span to where a pin may hold it; False when it cannot be pinned.

        A pinned span is never demoted, so one that already was (released, archived)
        comes back first, recomputed lazily where the store allows (its tokens join the
        next prefill). A `confirmed` span (a user's confirmation, the strongest hint
        there is) also comes back from EVICTED and is committed, and one held quantized
        in attention or archived as codes is recomputed at full precision from its token
        ids. A span that cannot come back (a restore and its recompute failed) is not pinned.
        """
        if span.state is SpanState.EVICTED and not confirmed:
            return False
        if confirmed and span.tier.archived and not self.store.archive_exact(span):
            self.move(span, SpanState.EVICTED, reason=reason)  # the codes go; the token ids stay
        if (confirmed and span.state is not SpanState.COMMITTED) or span.state in DEMOTED_STATES:
            self.move(span, SpanState.COMMITTED, reason=reason, lazily=True)
        if span.state in DEMOTED_STATES:
            return False
        if confirmed:
            self.promote(span, reason=reason)
        return True

    def hold_quantized(self, spans: Sequence[Span]) -> int:
        """Hold attended spans quantized in attention, in one pass; bytes freed (a failure is a fault)."""
        store = self.store
        if not isinstance(store, AttendedQuantizer):
            return 0
        with self.timer.timed("store_seconds"):
            try:
                result = store.quantize_attended_until(spans, None)
            except Exception as e:  # noqa: BLE001 - every slot is still attended
                self.fault("quantization in attention", None, e)
                return 0
        self._write_tiers(result.tiers)
        return result.freed

    def hold_coarse(self, spans: Sequence[Span]) -> int:
        """Hold the 8-bit keys of `spans` at 4 bits (fine planes dropped); bytes freed (failures: faults)."""
        store = self.store
        if not isinstance(store, AttendedQuantizer):
            return 0
        with self.timer.timed("store_seconds"):
            try:
                return store.coarsen_attended_until(spans, COARSEN_ALL)
            except Exception as e:  # noqa: BLE001 - the keys stay at 8 bits, still attended
                self.fault("key coarsening", None, e)
                return 0

    def promote(self, span: Span, *, reason: str) -> bool:
        """Hold an attended span held quantized at full precision again, recomputed from its token ids.

        An uncompressed span is recomputed lazily (its tokens join the next prefill, at
        their logical positions); a span compressed at commit is dropped and recomputed
        at once, holding the offsets it held. Returns whether anything changed; a failure
        is a recorded fault and leaves the span attended, quantized.
        """
        if span.tier is not Tier.ATTENDED_QUANTIZED:
            return False
        if span.kept is None:
            return self.recompute_pending(span, reason=reason)
        offsets = span.kept_offsets
        if self.move(span, SpanState.EVICTED, reason=reason) is None:
            return False
        if not self.move_holding(span, offsets, reason=reason):
            self.marks.recallable.add(span.span_id)  # its token ids remain: a later recall recomputes it
            return False
        return True

    def recompute_pending(self, span: Span, *, reason: str) -> bool:
        """Recompute an uncompressed attended span lazily (at the next prefill); False: a recorded fault."""
        store = self.store
        if not isinstance(store, AttendedQuantizer):
            return False
        with self.timer.timed("store_seconds"):
            try:
                span.tier = store.recompute_pending(span)
            except Exception as e:  # noqa: BLE001 - the span is still attended, quantized
                self.fault(reason, span, e)
                return False
        self.table.counters.rehydrated_tokens += span.length
        return True

    def recompute_offsets(self, parts: Sequence[tuple[Span, Sequence[int]]], *, reason: str) -> bool:
        """Recompute tokens of attended spans at full precision, in one forward; False: a recorded fault."""
        with self.timer.timed("store_seconds"):
            try:
                tiers = self.recompute_tokens(parts)
            except Exception as e:  # noqa: BLE001 - every span is still attended, quantized, as it was
                self.fault(reason, parts[0][0] if parts else None, e)
                return False
        self._write_tiers(tiers)
        return True

    def restore_together(self, spans: Sequence[Span]) -> None:
        """Restore archived spans in one append before their moves (on failure each move restores its own)."""
        archived = [s for s in spans if s.tier.archived]
        if len(archived) < 2:
            return
        with self.timer.timed("store_seconds"):
            try:
                restored = self.store.restore_many(archived)
            except Exception as e:  # noqa: BLE001 - each span falls back on its own move
                self.fault("restore", None, e)
                return
            self._write_tiers(restored.tiers)
            self.table.counters.restored_tokens += sum(s.held_tokens for s in archived)

    def fault(self, where: str, span: Span | None, error: Exception) -> None:
        """Record a survived failure (counted, logged, in the event log)."""
        self.table.counters.faults += 1
        span_id = None if span is None else span.span_id
        logger.warning(
            "session %s: %s of span %s failed (%s); kept safe", self.table.session_id, where, span_id, error
        )
        self.table.record("fault", where=where, span=span_id, error=repr(error))

    def _settle_failed_bring_back(self, span: Span) -> None:
        """After a restore *and* its recompute failed, say what is true: the KV is gone.

        The failed restore dropped the archived block, so the span becomes EVICTED: its
        token ids remain, so a later recall (or `move(span, COMMITTED)`) recomputes it.
        """
        if span.tier is Tier.DROPPED and span.state is not SpanState.EVICTED:
            before = span.state
            span.state = SpanState.EVICTED
            self.store.note_state(span, before, SpanState.EVICTED)
            self.table.counters.transitions += 1
            self.table.record(
                "transition",
                span=span.span_id,
                before=before.value,
                after="evicted",
                reason="restore and recompute failed",
            )

    def _archive(self, span: Span) -> bool:
        """Archive to the configured tier; on failure keep the span on the device (a recorded fault)."""
        try:
            span.tier = self.store.archive(span, self.archive_tier)
        except Exception as e:  # noqa: BLE001 - a failed offload must never lose the span
            self.fault("archive", span, e)
            return False
        return True

    def _bring_back(self, span: Span) -> bool:
        """Restore an archived span, or recompute a dropped one."""
        store = self.store
        if span.tier.archived:
            try:
                self._write_tiers(store.restore_many([span]).tiers)
                self.table.counters.restored_tokens += span.held_tokens
                return True
            except Exception as e:  # noqa: BLE001 - fall back to recomputing from the token ids
                self.fault("restore", span, e)
                span.tier = store.drop(span)
        return self.rehydrate(span)

    def rehydrate(self, span: Span) -> bool:
        """Recompute a dropped span from its token ids; False (a recorded fault) when that fails."""
        try:
            tier = rehydrate(span, self.store, self.recompute)
        except Exception as e:  # noqa: BLE001
            self.fault("rehydrate", span, e)
            return False
        if tier is not None:
            span.tier = tier
            self.table.counters.rehydrated_tokens += span.n_computed
        return True

    def _write_tiers(self, tiers: Mapping[int, Tier]) -> None:
        """Write the tiers a store verb returned (`MoveResult.tiers`) on the spans they name."""
        for span_id, tier in tiers.items():
            self.table.span(span_id).tier = tier
