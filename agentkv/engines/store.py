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
when the coordinator resumes) is checked against the salt's pin table
(`agentkv.engines.reconcile`) when the session is the salt's only holder.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.engines.http import EngineError
from agentkv.engines.lmcache import CoordinatorClient, TierName
from agentkv.engines.planner import EnginePinPlanner
from agentkv.engines.reconcile import surplus_sequences
from agentkv.spans import Span, SpanState, Tier
from agentkv.store.kvstore import TierBytes

logger = logging.getLogger("agentkv.engines")

PINNING_STATES = frozenset({SpanState.COMMITTED})
"""A span in one of these states is part of the pinned prefix."""


@dataclass(frozen=True)
class EngineTarget:
    """One served engine as a session sees it: the coordinator, the LMCache server it lands on, units.

    Attributes:
        coordinator: the LMCache coordinator client (pins, lookup, prefetch, deletes).
        instance_id: the LMCache server this session's requests are routed to (sticky).
        instance_url: that server's own HTTP API (key-addressed deletes).
        chunk_size: LMCache's chunk size in tokens (pins and deletes act on whole chunks).
        prefetch_wait: seconds to wait for a prefetch to complete before the next call.
        pin_budget_tokens: most tokens one conversation pins (None = its L2 quota, if any).
        planner: the fleet's pin planner, shared by the backend's sessions (None = each
            conversation pins within its own budget only).
    """

    coordinator: CoordinatorClient
    instance_id: str
    instance_url: str
    chunk_size: int = 256
    prefetch_wait: float = 5.0
    pin_budget_tokens: int | None = None
    planner: EnginePinPlanner | None = None


@dataclass
class HintStats:
    """What the store asked of the engine, and what failed (failures are logged no-ops)."""

    pins: int = 0
    unpins: int = 0
    deleted_chunks: int = 0
    prefetches: int = 0
    prefetch_completed: int = 0
    demoted_chunks: int = 0
    """L1 copies given up at turn end because L2 holds the chunk under this session's pin."""
    hint_failures: int = 0
    last_failure: str = ""
    retried_deletes: int = 0
    """Deletes skipped by a failed hint and sent again at a later sync."""
    reconciled_unpins: int = 0
    """References a timed-out pin (or unpin) left on the coordinator, found and given back."""
    log: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class EngineStore:
    """The store protocol (`archive`, `restore_many`, `drop`, `note_state`, …) over vLLM + LMCache.

    Args:
        target: the engine this session uses; None = vLLM alone (no LMCache): verbs
            still decide the prompt, no hints are sent.
        cache_salt: the conversation's salt; branch sessions pass their parent's.
        spans: the session's span table in logical order (read, never written, except `span.tier`).
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
        self.sent: list[int] = list(shared_prefix)
        """The sequence the engine last held KV for (prompt + generated ids)."""
        self.shared_prefix: list[int] = list(shared_prefix)
        self._commit_pin: list[int] = []
        self._archive_pins: dict[int, list[int]] = {}
        self._selected_pins: list[list[int]] = []
        self.owns_salt: Callable[[], bool] = owns_salt or (lambda: False)
        self.on_failure = on_failure
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
        self.uncertain_pins: list[list[int]] = []
        """Sequences whose pin or unpin failed: the coordinator may hold a reference we do not want."""
        self._parked = False
        self._pin_cap: int | None = None
        self._pin_cap_known = False

    # -- the store protocol -----------------------------------------------------------------

    def archive(self, span: Span, tier: str) -> None:
        """Leave the span out of the prompt; L2 keeps the sequence that held it (recallable)."""
        if tier == "drop":
            self.drop(span)
            return
        span.tier = Tier.HOST
        self._archived_since_sync.append(span.span_id)
        self._mark_stale("l1")

    def restore_many(self, spans: Sequence[Span]) -> None:
        """Put archived spans back in the prompt; the next `sync` prefetches that prefix."""
        for span in spans:
            span.tier = Tier.DEVICE
            self._on_l2.pop(span.span_id, None)
        self._recalled_since_sync = True

    def drop(self, span: Span) -> None:
        """Leave the span out of the prompt; its stale tail is deleted on every tier at `sync`."""
        if span.tier is Tier.DEVICE:
            self._mark_stale("all")
            self._dropped_since_sync.append(span.span_id)
        self._on_l2.pop(span.span_id, None)
        span.tier = Tier.DROPPED

    def forget(self, span: Span) -> None:
        """A history rewrite or a pruned branch: the span's tail is stale everywhere."""
        self._mark_stale("all")
        self._dropped_since_sync.append(span.span_id)
        self._on_l2.pop(span.span_id, None)
        span.tier = Tier.DROPPED

    def compress(self, span: Span, keep_offsets: list[int]) -> int:
        """Engines keep whole spans: commit-time token compression does not apply (0 dropped)."""
        del span, keep_offsets
        return 0

    def adopt_recomputed(self, span: Span) -> None:
        """The span is attended again; the engine recomputes (or reloads) it on the next call."""
        span.tier = Tier.DEVICE

    def note_state(self, span: Span, before: SpanState, after: SpanState) -> None:
        """Commit pins are placed at `sync` (on the prompt the engine will see); nothing to send now."""
        del span, before, after

    def bytes_by_tier(self) -> TierBytes:
        """KV the engine holds for this session: the prompt (device), what L2 keeps of the archive (host)."""
        spans = list(self.spans())
        device = sum(s.n_computed for s in spans if s.tier is Tier.DEVICE) * self.bytes_per_token
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
        return [f"span {s.span_id} is on the quantized tier" for s in spans if s.tier is Tier.QUANTIZED]

    # -- what the engine sees -----------------------------------------------------------------

    def prompt(self) -> list[int]:
        """The token ids the engine sees: the spans whose KV is attended, in logical order."""
        return [t for s in self.spans() if s.tier is Tier.DEVICE for t in s.token_ids]

    def committed_length(self) -> int:
        """Prompt tokens up to the end of the last committed (or pinned) span."""
        length = end = 0
        for span in self.spans():
            if span.tier is not Tier.DEVICE:
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
        self.reconcile_pins()
        stale_tier = self._stale_tier
        diverged = common_prefix(self.sent, prompt)
        if stale_tier is not None or diverged < len(self.sent):
            self._drop_stale(diverged, stale_tier or "all")
        self._move_commit_pin(prompt[: self.committed_length()])
        if self._recalled_since_sync or self._parked:
            self._prefetch(prompt)
        self._stale_tier = None
        self._archived_since_sync = []
        self._dropped_since_sync = []
        self._recalled_since_sync = False
        self._parked = False

    def completed(self, sequence: list[int]) -> None:
        """The engine now holds KV for `sequence` (the prompt plus the ids it generated)."""
        self.sent = list(sequence)
        self._sent_layout = self._layout

    def _prompt_layout(self) -> dict[int, int]:
        layout: dict[int, int] = {}
        offset = 0
        for span in self.spans():
            if span.tier is Tier.DEVICE:
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
        if self.target is None or not self._commit_pin:
            return
        coordinator = self.target.coordinator
        pinned = self._commit_pin
        lookup = self._hint("lookup", lambda: coordinator.lookup(pinned, self.cache_salt))
        if lookup is None:
            return
        keys = [key for p in lookup.placements if "l2" in p.tiers for key in p.keys]
        if not keys:
            return
        url = self.target.instance_url
        result = self._hint("demote", lambda: coordinator.delete_chunks(url, keys, tier="l1"))
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
        self._move_commit_pin(self.prompt()[: self.committed_length()])

    def select(self) -> None:
        """This branch won: pin its prompt (within the pin budget) so the parent keeps it."""
        if self.target is None:
            return
        prompt = self._fit(self.prompt(), exclude=None)
        if prompt and self._pin(prompt):
            self._selected_pins.append(prompt)

    def close(self) -> None:
        """Unpin everything this session pinned and delete every sequence it wrote (never the shared prefix).

        Every pin reference is given back once (a sequence pinned for several archived
        spans once), then the salt's pin table is checked for references a timed-out
        hint left (when this store owns the salt; a branch hands them to its parent via
        `uncertain_pins`). The sequences deleted: the last one sent, the old ones kept on
        L2 for archived spans, and the deletes a failed hint skipped.
        """
        if self.target is None:
            return
        for sequence in self._held_pins():
            self._unpin(sequence)
        self._commit_pin = []
        self._archive_pins = {}
        self._selected_pins = []
        if self.target.planner is not None:
            self.target.planner.release(self.owner)
        self.reconcile_pins()
        pending, self._pending_deletes = self._pending_deletes, []
        for sequence, keep, end, tier in pending:
            self._delete_tail(sequence, max(keep, common_prefix(sequence, self.shared_prefix)), tier, end)
        for sequence in [*self._kept, self.sent]:
            keep = common_prefix(sequence, self.shared_prefix)
            if len(sequence) > keep:
                self._delete_tail(sequence, keep, "all")
        self._kept = []
        self._on_l2 = {}
        self.sent = list(self.shared_prefix)

    def adopt_uncertain(self, sequences: Sequence[list[int]]) -> None:
        """Take over a closed branch's maybe-applied pins (same salt): checked once this store owns it."""
        self.uncertain_pins.extend(list(s) for s in sequences if s)

    def reconcile_pins(self) -> None:
        """Give back the references a timed-out pin or unpin left on the coordinator (sole holder only).

        The salt's pin table (`GET /cache/pins`) is compared with this store's books: a
        maybe-applied sequence whose every chunk holds a reference beyond them is unpinned
        once (`agentkv.engines.reconcile.surplus_sequences`); one that shows none was not
        applied and is forgotten. Another holder's reference is never taken: only the
        salt's sole holder reconciles, and only surplus counts are given back.
        """
        if self.target is None or not self.uncertain_pins or not self.owns_salt():
            return
        coordinator = self.target.coordinator
        table = self._hint("pin table", lambda: coordinator.pin_counts(self.cache_salt))
        if table is None:
            return
        observed: list[list[int]] = []
        for sequence in self.uncertain_pins:
            lookup = self._hint("lookup", functools.partial(coordinator.lookup, sequence, self.cache_salt))
            if lookup is None:
                return
            observed.append([_references(table, p.keys) for p in lookup.placements])
        uncertain, self.uncertain_pins = self.uncertain_pins, []
        for index in surplus_sequences(uncertain, self._held_pins(), observed, self.target.chunk_size):
            if self._unpin(uncertain[index]):
                self.stats.reconciled_unpins += 1

    def _held_pins(self) -> list[list[int]]:
        """The sequences this store holds one pin reference on (an archive pin may serve several spans)."""
        held: list[list[int]] = []
        for sequence in [self._commit_pin, *self._archive_pins.values(), *self._selected_pins]:
            if sequence and not any(sequence is other for other in held):
                held.append(sequence)
        return held

    # -- internals -------------------------------------------------------------------------

    @property
    def _target(self) -> EngineTarget:
        if self.target is None:  # the public entry points return early without a coordinator
            msg = "no LMCache coordinator configured"
            raise RuntimeError(msg)
        return self.target

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
            kept = self._fit(old[:end], exclude=None)
            # A pin protects them from L2 eviction; only their L1 copy goes.
            if kept and self._pin(kept):
                for span_id in archived:
                    self._archive_pins.setdefault(span_id, kept)
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
        lookup = self._hint("lookup", lambda: coordinator.lookup(sequence, self.cache_salt))
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
        result = self._hint(
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

    def pin_budget(self) -> int | None:
        """Most tokens this conversation pins: the configured budget, capped by its L2 quota.

        Pins are exempt from L2 eviction, so pinning more than the salt's L2 quota would
        hold more than the cache it was given. None = no cap (no quota, no budget). The
        quota is asked once; a coordinator that does not answer is asked again next time.
        """
        target = self._target
        if not self._pin_cap_known:
            try:
                quota = target.coordinator.l2_limit_bytes(self.cache_salt)
            except (EngineError, ValueError) as e:
                self._failed("quota", e)
                return target.pin_budget_tokens
            caps = [
                c for c in (target.pin_budget_tokens, _tokens(quota, self.bytes_per_token)) if c is not None
            ]
            self._pin_cap = min(caps) if caps else None
            self._pin_cap_known = True
        return self._pin_cap

    def _fit(self, sequence: list[int], exclude: list[int] | None) -> list[int]:
        """The longest whole-chunk prefix of `sequence` that keeps this session's pins within budget.

        Chunks are prefix-chained, so chunk `j` of two sequences is one key when they agree
        up to its end: the budget counts distinct chunks over every pin the session holds
        (but `exclude`, the pin about to be replaced). With a fleet planner, the session's
        share of the fleet budget caps it too (it asks with what it would pin uncapped).
        """
        size = self._target.chunk_size
        whole = sequence[: len(sequence) // size * size]  # pins cover whole chunks only
        cap = self.pin_budget()
        planner = self._target.planner
        if cap is None and planner is None:
            return whole
        others = [self._commit_pin, *self._archive_pins.values(), *self._selected_pins]
        held = {_chunk_id(p, j, size) for p in others if p is not exclude for j in range(len(p) // size)}
        if planner is not None:
            new = sum(_chunk_id(whole, j, size) not in held for j in range(len(whole) // size))
            share = planner.grant(self.owner, (len(held) + new) * size)
            cap = share if cap is None else min(cap, share)
        room = (cap or 0) // size - len(held)
        n = 0
        while n < len(whole) // size:
            if _chunk_id(whole, n, size) not in held:
                if room <= 0:
                    break
                room -= 1
            n += 1
        return whole[: n * size]

    def _move_commit_pin(self, prefix: list[int]) -> None:
        whole = self._fit(prefix, exclude=self._commit_pin)
        if whole == self._commit_pin:
            return
        if not whole:  # the committed prefix shrank below one chunk (a history rewrite)
            self._unpin(self._commit_pin)
            self._commit_pin = []
            return
        # Pin the new prefix first, then give back the old one: shared chunks never drop to 0.
        if self._pin(whole):
            if self._commit_pin:
                self._unpin(self._commit_pin)
            self._commit_pin = whole

    def _pin(self, sequence: list[int]) -> bool:
        """One reference on the sequence's chunks; a failed request may still land (then reconciled)."""
        if self._hint("pin", lambda: self._target.coordinator.pin(sequence, self.cache_salt)):
            self.stats.pins += 1
            return True
        self.uncertain_pins.append(list(sequence))
        return False

    def _unpin(self, sequence: list[int]) -> bool:
        """Give one reference back; a failed request may not have landed (then reconciled)."""
        if self._hint("unpin", lambda: self._target.coordinator.unpin(sequence, self.cache_salt)):
            self.stats.unpins += 1
            return True
        self.uncertain_pins.append(list(sequence))
        return False

    def _prefetch(self, prompt: list[int]) -> None:
        coordinator = self._target.coordinator
        instance = self._target.instance_id
        started = self._hint("prefetch", lambda: coordinator.prefetch(instance, prompt, self.cache_salt))
        if started is None or not started.request_id:
            return
        self.stats.prefetches += 1
        deadline = time.monotonic() + self._target.prefetch_wait
        while time.monotonic() < deadline:
            status = self._hint(
                "prefetch_status", lambda: coordinator.prefetch_status(instance, started.request_id)
            )
            if status is None:
                return
            if status == "completed":
                self.stats.prefetch_completed += 1
                break
            time.sleep(0.05)
        recalled = [sid for sid, seq in self._archive_pins.items() if common_prefix(seq, prompt) == len(seq)]
        for span_id in recalled:
            self._unpin(self._archive_pins.pop(span_id))

    def _hint(self, what: str, send: Callable[[], Any]) -> Any:
        """Send one hint; an engine error is a logged no-op (None), never the agent's problem."""
        try:
            answer = send()
        except (EngineError, ValueError) as e:
            self._failed(what, e)
            return None
        self.stats.log.append((what, {"answer": answer}))
        return answer if answer is not None else True

    def _failed(self, what: str, error: Exception) -> None:
        self.stats.hint_failures += 1
        self.stats.last_failure = f"{what}: {error}"
        logger.warning("engine hint %s for salt %r skipped: %s", what, self.cache_salt, error)
        if self.on_failure is not None:
            self.on_failure(what, error)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _references(table: dict[tuple[str, int], int], keys: Sequence[dict[str, Any]]) -> int:
    """A chunk's pin count in the coordinator's table (the least over its ranks' keys; 0 = unlisted)."""
    counts = [table.get((str(k.get("chunk_hash_hex", "")), int(k.get("kv_rank", 0) or 0)), 0) for k in keys]
    return min(counts, default=0)


def _chunk_id(sequence: Sequence[int], index: int, size: int) -> int:
    """An identity for chunk `index` of `sequence`: prefix-chained, like LMCache's keys."""
    return hash(tuple(sequence[: (index + 1) * size]))


def _tokens(limit_bytes: int | None, bytes_per_token: int) -> int | None:
    return None if limit_bytes is None else limit_bytes // bytes_per_token
