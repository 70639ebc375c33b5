"""`EngineStore`: the store protocol carried out by a served engine (vLLM + LMCache).

The lifecycle (rules, mover, budget, recall) is the same as for a local model; only
"where KV lives" differs. On an engine:

| store verb (lifecycle move) | what the engine does |
|---|---|
| `note_state(→ COMMITTED)` (commit) | pin the prompt prefix through the span |
| `archive(span, tier)` (archive) | span leaves the prompt; old tail: L1 deleted, L2 kept under a pin |
| `drop` / `forget` (release, evict, prune) | span leaves the prompt; old tail from it deleted |
| `restore_many` (recall) | span back in the prompt; prefetch L2 → L1 first |
| fork | nothing to copy: a branch uses the parent's `cache_salt` |
| `close` (session closed) | unpin what the session pinned, delete every sequence it wrote |

A release and an archive in one step (the usual case under a budget) split the old
tail: the chunks before the first *dropped* span keep their L2 copy (the archived
spans live there), the chunks from it on are deleted on every tier. `host_bytes`
counts only the archived tokens L2 keeps that way.

Engines reuse KV **by prefix only**: leaving a span out of the prompt changes every
chunk after it, so the chunks of the previous sequence past the first change are
*stale* (nothing will ever ask for them again). Verbs only record what changed;
`sync(prompt)`, called right before the next engine request, reconciles once:
deletes the stale chunks by key (not the kept prefix), moves the commit pin, and
prefetches recalled spans. Every call there is a *hint*: an engine that is down,
slow or answers 4xx makes it a logged no-op (`hint_failures`), never an error for
the agent, because the prompt itself carries the whole truth. What a failed hint
leaves behind is repaired at the next sync that reaches the coordinator: skipped
deletes are sent again, and a pin or unpin that timed out (it may still be applied
when the coordinator resumes) is checked against the salt's pin table when the
session is the salt's only holder (`agentkv.engines.pins`). Where hints go and how a
failure becomes a no-op: `agentkv.engines.hints`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from agentkv.engines.hints import EngineTarget, HintSender, HintStats
from agentkv.engines.lmcache import TierName
from agentkv.engines.pins import SessionPins
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.protocol import MoveResult, TierBytes, WholeSpanStore

__all__ = ["PINNING_STATES", "EngineStore", "EngineTarget", "HintStats", "common_prefix"]

T = TypeVar("T")

PINNING_STATES = frozenset({SpanState.COMMITTED})
"""A span in one of these states is part of the pinned prefix."""


class EngineStore(WholeSpanStore):
    """The store protocol (`archive`, `restore_many`, `drop`, `note_state`, …) over vLLM + LMCache.

    Whole spans only: no token access or lazy recompute (`WholeSpanStore`).

    Args:
        target: the engine this session uses; None = vLLM alone (no LMCache): verbs
            still decide the prompt, no hints are sent.
        cache_salt: the conversation's salt; branch sessions pass their parent's.
        spans: the session's span table in logical order (read, never written: the mover writes tiers).
        bytes_per_token: KV bytes of one token on the engine (all layers, K and V).
        shared_prefix: for a branch, the sequence it inherits from its parent: never deleted by it.
        owner: who asks the fleet's pin planner (the session id; default: the salt).
        owns_salt: whether this store is the only holder of pins on its salt now (a root
            conversation whose branches are closed); only then are maybe-applied pins
            reconciled against the coordinator's pin table. Default: never.
        on_failure: told of every failed hint (`what`, the error), e.g. to count it as a fault.
    """

    def __init__(
        self,
        target: EngineTarget | None,
        cache_salt: str,
        spans: Callable[[], Sequence[Span]],
        bytes_per_token: int,
        *,
        shared_prefix: Sequence[int] = (),
        owner: str | None = None,
        owns_salt: Callable[[], bool] | None = None,
        on_failure: Callable[[str, Exception], None] | None = None,
    ) -> None:
        if bytes_per_token <= 0:
            msg = f"bytes_per_token: expected > 0, got {bytes_per_token}"
            raise ValueError(msg)
        self.target = target
        self.cache_salt = cache_salt
        self.owner = cache_salt if owner is None else owner
        self.spans = spans
        self.bytes_per_token = bytes_per_token
        self.stats = HintStats()
        self.hints = HintSender(cache_salt, self.stats, on_failure)
        self.sent: list[int] = list(shared_prefix)
        """The sequence the engine last held KV for (prompt + generated ids)."""
        self.shared_prefix: list[int] = list(shared_prefix)
        self.pins: SessionPins | None = (
            None
            if target is None
            else SessionPins(
                target, cache_salt, self.owner, bytes_per_token, self.hints, owns_salt or (lambda: False)
            )
        )
        """The session's pin references (None without a coordinator)."""
        self._stale_tier: TierName | None = None
        self._archived_since_sync: list[int] = []
        self._dropped_since_sync: list[int] = []
        self._recalled_since_sync = False
        self._layout: dict[int, int] = {}
        """Span id -> offset in the prompt of the last sync (where each span's tokens were sent)."""
        self._sent_layout: dict[int, int] = {}
        """The same for `sent`: the sequence the engine holds KV for."""
        self._on_l2: dict[int, int] = {}
        """Archived span id -> its tokens L2 keeps (whole chunks before the first dropped span)."""
        self._kept: list[list[int]] = []
        """Old sequences kept on L2 for archived spans: deleted at close."""
        self._pending_deletes: list[tuple[list[int], int, int | None, TierName]] = []
        """Deletes a failed hint skipped: (sequence, first token, end token or None, tier)."""
        self._parked = False
        self._moved = False

    # -- the store protocol -----------------------------------------------------------------

    def archive(self, span: Span, tier: str) -> Tier:
        """Leave the span out of the prompt; L2 keeps the sequence that held it (recallable: HOST)."""
        if tier == "drop":
            return self.drop(span)
        self._archived_since_sync.append(span.span_id)
        self._mark_stale("l1")
        return Tier.HOST

    def restore_many(self, spans: Sequence[Span]) -> MoveResult:
        """Put archived spans back in the prompt (DEVICE); the next `sync` prefetches that prefix."""
        for span in spans:
            self._on_l2.pop(span.span_id, None)
        self._recalled_since_sync = True
        return MoveResult(tiers={s.span_id: Tier.DEVICE for s in spans})

    def archive_exact(self, span: Span) -> bool:
        """An engine's archive is its own prefix cache: the prompt's tokens, recomputed exactly if evicted."""
        return True

    def drop(self, span: Span) -> Tier:
        """Leave the span out of the prompt (DROPPED); its stale tail is deleted on every tier at `sync`."""
        if span.tier.attended:
            self._mark_stale("all")
            self._dropped_since_sync.append(span.span_id)
        self._on_l2.pop(span.span_id, None)
        return Tier.DROPPED

    def forget(self, span: Span) -> None:
        """A history rewrite or a pruned branch: the span's tail is stale everywhere (it leaves the table)."""
        self._mark_stale("all")
        self._dropped_since_sync.append(span.span_id)
        self._on_l2.pop(span.span_id, None)

    def compress(self, span: Span, keep_offsets: list[int]) -> MoveResult:
        """Engines keep whole spans: commit-time token compression does not apply (nothing dropped)."""
        del span, keep_offsets
        return MoveResult()

    def adopt_recomputed(self, span: Span) -> Tier:
        """The span is attended again (DEVICE); the engine recomputes (or reloads) it on the next call."""
        del span
        return Tier.DEVICE

    def note_state(self, span: Span, before: SpanState, after: SpanState) -> None:
        """Commit pins are placed at `sync` (on the prompt the engine will see); nothing to send now."""
        del span, before, after

    def bytes_by_tier(self) -> TierBytes:
        """KV the engine holds for this session: the prompt (device), what L2 keeps of the archive (host)."""
        spans = list(self.spans())
        device = sum(s.n_computed for s in spans if s.tier.attended) * self.bytes_per_token
        host = sum(self.held_on_l2(s) for s in spans if s.tier is Tier.HOST) * self.bytes_per_token
        shared = min(len(self.shared_prefix), device // self.bytes_per_token) * self.bytes_per_token
        return TierBytes(device=device, quantized=0, host=host, shared=shared)

    def host_bytes(self) -> int:
        """Bytes of the archived spans LMCache's storage tier keeps."""
        return self.bytes_by_tier().host

    def span_bytes(self, span: Span) -> int:
        """Bytes held for one span (0 when dropped; an archived span: what L2 keeps of it)."""
        if span.tier is Tier.DROPPED:
            return 0
        if span.tier is Tier.HOST:
            return self.held_on_l2(span) * self.bytes_per_token
        return span.n_computed * self.bytes_per_token

    def held_on_l2(self, span: Span) -> int:
        """Tokens of an archived span that LMCache's L2 keeps for a recall (0 = recomputed if recalled).

        Decided at the sync after the archive: the whole chunks of the old sequence before
        its first dropped span, within the pin budget. Until then, what the engine holds of
        the span in the sequence it last computed. Without a coordinator, nothing.
        """
        if self.target is None:
            return 0
        if span.span_id in self._on_l2:
            return self._on_l2[span.span_id]
        offset = self._sent_layout.get(span.span_id)
        if offset is None:
            return 0
        return max(0, min(offset + span.length, len(self.sent)) - offset)

    @contextlib.contextmanager
    def deferred_removal(self) -> Iterator[None]:
        """Removals are already deferred to `sync`: nothing to batch."""
        yield

    def check(self, spans: Sequence[Span]) -> list[str]:
        """Engine tiers are the spans' own fields; only a quantized tier would be inconsistent."""
        quantized = (Tier.QUANTIZED, Tier.ATTENDED_QUANTIZED)
        return [f"span {s.span_id} is on the {s.tier} tier" for s in spans if s.tier in quantized]

    # -- what the engine sees -----------------------------------------------------------------

    def prompt(self) -> list[int]:
        """The token ids the engine sees: the spans whose KV is attended, in logical order."""
        return [t for s in self.spans() if s.tier.attended for t in s.token_ids]

    def committed_length(self) -> int:
        """Prompt tokens up to the end of the last committed (or pinned) span."""
        length = end = 0
        for span in self.spans():
            if not span.tier.attended:
                continue
            length += len(span.token_ids)
            if span.state in PINNING_STATES or span.pinned:
                end = length
        return end

    def sync(self, prompt: list[int]) -> None:
        """Reconcile the engine with the prompt about to be sent (stale tails, pins, prefetch).

        First what failed hints left behind (skipped deletes, maybe-applied pins), then
        this step's changes.
        """
        self._layout = self._prompt_layout()
        if self.target is None:
            self._stale_tier = None
            self._archived_since_sync = []
            self._dropped_since_sync = []
            self._recalled_since_sync = False
            return
        self._retry_deletes(prompt)
        self._pins.reconcile()
        stale_tier = self._stale_tier
        diverged = common_prefix(self.sent, prompt)
        if stale_tier is not None or diverged < len(self.sent):
            self._drop_stale(diverged, stale_tier or "all")
        self._pins.move_commit(prompt[: self.committed_length()])
        if self._recalled_since_sync or self._parked or self._moved:
            self._prefetch(prompt)
        self._stale_tier = None
        self._archived_since_sync = []
        self._dropped_since_sync = []
        self._recalled_since_sync = False
        self._parked = False
        self._moved = False

    def moved(self) -> None:
        """The conversation's calls go to another engine of the fleet from now on.

        The new engine's own prefix cache is cold, but LMCache is the fleet's: the next
        `sync` prefetches the prompt L2 -> L1 of the shared server so the engine loads the
        history instead of recomputing it, and (as every sync) re-sends the deletes failed
        hints skipped and checks maybe-applied pins. Pins live on the coordinator, not on
        an engine: the ones held stay valid.
        """
        self._moved = True
        self.stats.moves += 1

    def completed(self, sequence: list[int]) -> None:
        """The engine now holds KV for `sequence` (the prompt plus the ids it generated)."""
        self.sent = list(sequence)
        self._sent_layout = self._layout

    def _prompt_layout(self) -> dict[int, int]:
        layout: dict[int, int] = {}
        offset = 0
        for span in self.spans():
            if span.tier.attended:
                layout[span.span_id] = offset
                offset += len(span.token_ids)
        return layout

    def park(self) -> None:
        """The turn is over and the conversation waits: its pinned prefix gives up its L1 copy.

        While a conversation waits for its user, the chunks its pin keeps on L2 need not
        take L1 room that others' unpinned chunks (which live nowhere else) could use;
        the next `sync` prefetches them back (L2 -> L1) before the conversation's call.

        Every pinned chunk the coordinator places on L2 is named, whatever it says about
        L1: its L1 placements arrive through the server's event reports (flushed about
        once a second), so a copy a prefetch or a retrieve just put in L1 is not listed
        yet; filtering on it left such copies behind. An L1 delete of a key L1 does not
        hold is a no-op on the server; a chunk not (yet) on L2 keeps its only copy.
        """
        if self.target is None or not self._pins.commit:
            return
        coordinator = self.target.coordinator
        pinned = self._pins.commit
        lookup = self.hints.send("lookup", lambda: coordinator.lookup(pinned, self.cache_salt))
        if lookup is None:
            return
        keys = [key for p in lookup.placements if "l2" in p.tiers for key in p.keys]
        if not keys:
            return
        url = self.target.instance_url
        result = self.hints.send("demote", lambda: coordinator.delete_chunks(url, keys, tier="l1"))
        if result is not None:
            self.stats.demoted_chunks += result.affected
            self._parked = True

    def refit_pins(self) -> None:
        """Fit the commit pin to what is committed now and to this session's share, not at its next call.

        At a turn end the turn's committed history is pinned before `park` gives up the
        pinned chunks' L1 copies (the user may think for a while). A conversation that gave
        up its residency (`AdmissionGate.turn_ended`) is ranked behind the residents by the
        fleet planner: its pin shrinks at once and the room goes to them.
        """
        if self.target is None:
            return
        self._pins.move_commit(self.prompt()[: self.committed_length()])

    def stand_alone(self, owner: str) -> None:
        """This branch is its conversation now (adopted): the prefix it shared is its own to delete."""
        self.shared_prefix = []
        self.owner = owner

    def select(self) -> None:
        """This branch won: pin its prompt (within the pin budget) so the parent keeps it."""
        if self.target is None:
            return
        self._pins.select(self.prompt())

    def close(self, *, spare: Sequence[Sequence[int]] = ()) -> None:
        """Unpin everything this session pinned and delete every sequence it wrote (never the shared prefix).

        `spare`: sequences other sessions of the conversation go on with (a sibling branch's,
        an adopted branch's): the chunks they share with what this one wrote stay.

        Every pin reference is given back once (a sequence pinned for several archived
        spans once), then the salt's pin table is checked for references a timed-out
        hint left (when this store owns the salt; a branch hands them to its parent via
        `uncertain_pins`). The sequences deleted: the last one sent, the old ones kept on
        L2 for archived spans, and the deletes a failed hint skipped.
        """
        if self.target is None:
            return
        self._pins.release_all()
        pending, self._pending_deletes = self._pending_deletes, []

        def kept(sequence: list[int]) -> int:
            return max(common_prefix(sequence, other) for other in [self.shared_prefix, *spare])

        for sequence, keep, end, tier in pending:
            self._delete_tail(sequence, max(keep, kept(sequence)), tier, end)
        for sequence in [*self._kept, self.sent]:
            keep = kept(sequence)
            if len(sequence) > keep:
                self._delete_tail(sequence, keep, "all")
        self._kept = []
        self._on_l2 = {}
        self.sent = list(self.shared_prefix)

    @property
    def uncertain_pins(self) -> list[list[int]]:
        """Sequences whose pin or unpin failed: the coordinator may hold a reference nobody wants."""
        return [] if self.pins is None else self.pins.uncertain

    @uncertain_pins.setter
    def uncertain_pins(self, sequences: list[list[int]]) -> None:
        if self.pins is not None:
            self.pins.uncertain = sequences

    def adopt_uncertain(self, sequences: Sequence[list[int]]) -> None:
        """Take over a closed branch's maybe-applied pins (same salt): checked once this store owns it."""
        if self.pins is not None:
            self.pins.uncertain.extend(list(s) for s in sequences if s)

    def reconcile_pins(self) -> None:
        """Give back references failed pins left on the coordinator (`SessionPins.reconcile`)."""
        if self.pins is not None:
            self.pins.reconcile()

    def pin_budget(self) -> int | None:
        """Most tokens this conversation pins (`SessionPins.budget`)."""
        return self._pins.budget()

    # -- internals -------------------------------------------------------------------------

    @property
    def _target(self) -> EngineTarget:
        return _configured(self.target)

    @property
    def _pins(self) -> SessionPins:
        return _configured(self.pins)

    def _mark_stale(self, tier: TierName) -> None:
        # "all" wins over "l1": one released span makes the whole old tail garbage.
        self._stale_tier = "all" if self._stale_tier == "all" or tier == "all" else tier

    def _drop_stale(self, diverged: int, tier: TierName) -> None:
        """Split the old sequence's stale tail: L2 keeps it up to the first dropped span, the rest goes.

        Archive only: the chunks after the change lose their L1 copy, L2 keeps them under
        a pin (within the pin budget) so that a recall finds them. A release (or a history
        rewrite) makes every chunk from the dropped span on garbage on every tier. Both in
        one step: the first rule up to the first dropped span, the second from it.
        """
        old = self.sent
        size = self._target.chunk_size
        own = common_prefix(old, self.shared_prefix)  # a branch never touches its parent's prefix
        dropped = [self._sent_layout[i] for i in self._dropped_since_sync if i in self._sent_layout]
        if tier == "all" and len(dropped) < len(self._dropped_since_sync):
            first_drop = diverged  # a dropped span of unknown place: everything after the change goes
        else:
            first_drop = max(diverged, min(dropped, default=len(old)))
        archived = [i for i in self._archived_since_sync if i in self._sent_layout]
        end = first_drop // size * size  # whole chunks before the chunk holding the first dropped token
        kept: list[int] = []
        garbage_from = diverged  # nothing archived there: every chunk after the change is garbage
        if archived and end > diverged // size * size:
            kept = self._pins.keep_archived(archived, old[:end])  # safe from L2 eviction; L1 copy goes
            if not any(old[:end] == k for k in self._kept):
                self._kept.append(old[:end])
            self._delete_tail(old, max(diverged, own), "l1", end)
            garbage_from = first_drop
        spans = {s.span_id: s for s in self.spans()}
        for span_id in self._archived_since_sync:
            span = spans.get(span_id)
            offset = self._sent_layout.get(span_id)
            on_l2 = 0 if span is None or offset is None else min(offset + span.length, len(kept)) - offset
            self._on_l2[span_id] = max(0, on_l2)
        if garbage_from < len(old):
            self._delete_tail(old, max(garbage_from, own), "all")
        self.sent = old[:diverged]

    def _delete_tail(self, sequence: list[int], keep: int, tier: TierName, end: int | None = None) -> None:
        """Delete `sequence`'s chunks from the one holding position `keep` up to the one holding `end`.

        A delete the engine did not take (coordinator down, slow, an error) is remembered
        and sent again at the next sync (`_retry_deletes`) or at close.
        """
        size = self._target.chunk_size
        first = keep // size  # the chunk holding the first changed token is stale too
        last = len(sequence) // size if end is None else min(len(sequence) // size, end // size)
        if last <= first:
            return
        coordinator = self._target.coordinator
        lookup = self.hints.send("lookup", lambda: coordinator.lookup(sequence, self.cache_salt))
        if lookup is None:
            self._pending_deletes.append((list(sequence), keep, end, tier))
            return
        stale = lookup.placements[first:last]
        if tier == "l1":  # archive: give up only L1 copies that L2 already holds (never the only copy)
            keys = [key for placement in stale if "l2" in placement.tiers for key in placement.keys]
        else:  # every stale key, placed or not yet reported (a lagging report must not keep it)
            keys = [key for placement in stale for key in placement.keys]
        if not keys:
            return
        result = self.hints.send(
            "delete", lambda: coordinator.delete_chunks(self._target.instance_url, keys, tier=tier)
        )
        if result is None:
            self._pending_deletes.append((list(sequence), keep, end, tier))
            return
        self.stats.deleted_chunks += result.affected

    def _retry_deletes(self, prompt: list[int]) -> None:
        """Send again the deletes a failed hint skipped (sparing the chunks the next prompt begins with)."""
        pending, self._pending_deletes = self._pending_deletes, []
        for sequence, keep, end, tier in pending:
            self.stats.retried_deletes += 1
            self._delete_tail(sequence, max(keep, common_prefix(sequence, prompt)), tier, end)

    def _prefetch(self, prompt: list[int]) -> None:
        coordinator = self._target.coordinator
        instance = self._target.instance_id
        started = self.hints.send("prefetch", lambda: coordinator.prefetch(instance, prompt, self.cache_salt))
        if started is None or not started.request_id:
            return
        self.stats.prefetches += 1
        deadline = time.monotonic() + self._target.prefetch_wait
        while time.monotonic() < deadline:
            status = self.hints.send(
                "prefetch_status", lambda: coordinator.prefetch_status(instance, started.request_id)
            )
            if status is None:
                return
            if status == "completed":
                self.stats.prefetch_completed += 1
                break
            time.sleep(0.05)
        self._pins.release_recalled(prompt)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _configured(value: T | None) -> T:
    """`value`, which exists only with a coordinator (the public entry points return early without one)."""
    if value is None:
        msg = "no LMCache coordinator configured"
        raise RuntimeError(msg)
    return value
