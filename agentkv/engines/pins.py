"""`SessionPins`: the pin references one session holds on its salt, and the ones it may hold unknowingly.

A session pins (`POST /cache/pins`, one reference on each whole chunk of a token
sequence from position 0) its committed prefix, the old sequences its archived spans
live in, and a selected branch's prompt, all within its pin budget (its salt's L2
quota, `engine.pin_budget_tokens`, its share of the fleet planner). Pins are exempt
from L2 eviction, so every reference must be given back: a request that failed may
still have landed (a coordinator that stalls applies its queue when it resumes), so
its sequence is kept as *uncertain* and reconciled against the salt's pin table when
this session is the salt's only holder (`agentkv.engines.reconcile`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentkv.engines.hints import EngineTarget, HintSender
from agentkv.engines.http import EngineError
from agentkv.engines.reconcile import surplus_sequences


class SessionPins:
    """Commit, archive and selection pins of one session, within its budget.

    Args:
        target: the engine (coordinator, chunk size, pin budget, fleet planner).
        cache_salt: the conversation's salt.
        owner: who asks the fleet's pin planner (the session id).
        bytes_per_token: engine KV bytes of one token (the L2 quota is in bytes).
        hints: how requests are sent (failures are logged no-ops).
        owns_salt: whether this session is the salt's only holder now.
    """

    def __init__(
        self,
        target: EngineTarget,
        cache_salt: str,
        owner: str,
        bytes_per_token: int,
        hints: HintSender,
        owns_salt: Callable[[], bool],
    ) -> None:
        self.target = target
        self.cache_salt = cache_salt
        self.owner = owner
        self.bytes_per_token = bytes_per_token
        self.hints = hints
        self.owns_salt = owns_salt
        self.commit: list[int] = []
        """The committed prefix pinned (whole chunks)."""
        self.archive: dict[int, list[int]] = {}
        """Archived span id -> the old sequence pinned for it (one reference may serve several spans)."""
        self.selected: list[list[int]] = []
        """Winning branches' prompts pinned for the parent."""
        self.uncertain: list[list[int]] = []
        """Sequences whose pin or unpin failed: the coordinator may hold a reference nobody wants."""
        self._cap: int | None = None
        self._cap_known = False

    # -- the books ---------------------------------------------------------------------------------

    def held(self) -> list[list[int]]:
        """The sequences this session holds one reference on each (an archive pin counted once)."""
        held: list[list[int]] = []
        for sequence in [self.commit, *self.archive.values(), *self.selected]:
            if sequence and not any(sequence is other for other in held):
                held.append(sequence)
        return held

    def budget(self) -> int | None:
        """Most tokens this conversation pins: the configured budget, capped by its L2 quota.

        Pins are exempt from L2 eviction, so pinning more than the salt's L2 quota would
        hold more than the cache it was given. None = no cap (no quota, no budget). The
        quota is asked once; a coordinator that does not answer is asked again next time.
        """
        target = self.target
        if not self._cap_known:
            try:
                quota = target.coordinator.l2_limit_bytes(self.cache_salt)
            except (EngineError, ValueError) as e:
                self.hints.failed("quota", e)
                return target.pin_budget_tokens
            tokens = None if quota is None else quota // self.bytes_per_token
            caps = [c for c in (target.pin_budget_tokens, tokens) if c is not None]
            self._cap = min(caps) if caps else None
            self._cap_known = True
        return self._cap

    def fit(self, sequence: list[int], exclude: list[int] | None) -> list[int]:
        """The longest whole-chunk prefix of `sequence` that keeps this session's pins within budget.

        Chunks are prefix-chained, so chunk `j` of two sequences is one key when they agree
        up to its end: the budget counts distinct chunks over every pin the session holds
        (but `exclude`, the pin about to be replaced). With a fleet planner, the session's
        share of the fleet budget caps it too (it asks with what it would pin uncapped).
        """
        size = self.target.chunk_size
        whole = sequence[: len(sequence) // size * size]  # pins cover whole chunks only
        cap = self.budget()
        planner = self.target.planner
        if cap is None and planner is None:
            return whole
        others = [self.commit, *self.archive.values(), *self.selected]
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

    # -- moves -------------------------------------------------------------------------------------

    def move_commit(self, prefix: list[int]) -> None:
        """Pin the committed `prefix` (within budget) in place of the old commit pin."""
        whole = self.fit(prefix, exclude=self.commit)
        if whole == self.commit:
            return
        if not whole:  # the committed prefix shrank below one chunk (a history rewrite)
            self.unpin(self.commit)
            self.commit = []
            return
        # Pin the new prefix first, then give back the old one: shared chunks never drop to 0.
        if self.pin(whole):
            if self.commit:
                self.unpin(self.commit)
            self.commit = whole

    def keep_archived(self, span_ids: Sequence[int], sequence: list[int]) -> list[int]:
        """Pin (within budget) the old sequence archived spans live in; returns the part pinned."""
        kept = self.fit(sequence, exclude=None)
        if kept and self.pin(kept):
            for span_id in span_ids:
                self.archive.setdefault(span_id, kept)
        return kept

    def release_recalled(self, prompt: list[int]) -> None:
        """Archived spans back in `prompt` no longer need their archive pin (a shared one goes last)."""
        recalled = [sid for sid, seq in self.archive.items() if _is_prefix(seq, prompt)]
        released = [self.archive.pop(span_id) for span_id in recalled]
        for index, sequence in enumerate(released):
            shared = any(sequence is other for other in [*released[index + 1 :], *self.archive.values()])
            if not shared:
                self.unpin(sequence)

    def select(self, prompt: list[int]) -> None:
        """Pin a winning branch's prompt (within budget) so the parent keeps it."""
        kept = self.fit(prompt, exclude=None)
        if kept and self.pin(kept):
            self.selected.append(kept)

    def release_all(self) -> None:
        """Give every reference back once, leave the fleet planner, then reconcile what failed."""
        for sequence in self.held():
            self.unpin(sequence)
        self.commit = []
        self.archive = {}
        self.selected = []
        if self.target.planner is not None:
            self.target.planner.release(self.owner)
        self.reconcile()

    def pin(self, sequence: list[int]) -> bool:
        """One reference on the sequence's chunks; a failed request may still land (then reconciled)."""
        landed = self._send("pin", self.target.coordinator.pin, sequence)
        if landed:
            self.hints.stats.pins += 1
        return landed

    def unpin(self, sequence: list[int]) -> bool:
        """Give one reference back; a failed request may not have landed (then reconciled)."""
        landed = self._send("unpin", self.target.coordinator.unpin, sequence)
        if landed:
            self.hints.stats.unpins += 1
        return landed

    def _send(self, verb: str, call: Callable[[list[int], str], object], sequence: list[int]) -> bool:
        """Send a pin or an unpin; one that failed may still land, so it waits in `uncertain`."""
        if self.hints.send(verb, lambda: call(sequence, self.cache_salt)):
            return True
        self.uncertain.append(list(sequence))
        return False

    # -- what failed -------------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Give back the references failed pins or unpins left on the coordinator (sole holder only).

        The salt's pin table (`GET /cache/pins`) is compared with the books: an uncertain
        sequence whose every chunk holds a reference beyond them is unpinned once
        (`surplus_sequences`); one that shows none was not applied and is forgotten.
        Another holder's reference is never taken: only the salt's sole holder reconciles.
        """
        if not self.uncertain or not self.owns_salt():
            return
        coordinator = self.target.coordinator
        table = self.hints.send("pin table", lambda: coordinator.pin_counts(self.cache_salt))
        if table is None:
            return
        observed: list[list[int]] = []
        for sequence in self.uncertain:
            lookup = self.hints.send("lookup", _bind(coordinator.lookup, sequence, self.cache_salt))
            if lookup is None:
                return
            observed.append([_references(table, p.keys) for p in lookup.placements])
        uncertain, self.uncertain = self.uncertain, []
        for index in surplus_sequences(uncertain, self.held(), observed, self.target.chunk_size):
            if self.unpin(uncertain[index]):
                self.hints.stats.reconciled_unpins += 1


def _bind(
    function: Callable[[list[int], str], object], sequence: list[int], salt: str
) -> Callable[[], object]:
    return lambda: function(sequence, salt)


def _is_prefix(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(short) <= len(long) and list(long[: len(short)]) == list(short)


def _references(table: dict[tuple[str, int], int], keys: Sequence[dict[str, object]]) -> int:
    """A chunk's pin count in the coordinator's table (the least over its ranks' keys; 0 = unlisted)."""
    counts = [
        table.get((str(k.get("chunk_hash_hex", "")), int(str(k.get("kv_rank", 0) or 0))), 0) for k in keys
    ]
    return min(counts, default=0)


def _chunk_id(sequence: Sequence[int], index: int, size: int) -> int:
    """An identity for chunk `index` of `sequence`: prefix-chained, like LMCache's keys."""
    return hash(tuple(sequence[: (index + 1) * size]))
