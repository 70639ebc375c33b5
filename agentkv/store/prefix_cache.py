"""The cross-session prefix cache: KV of committed prefixes, shared by every session that starts with them.

Agent threads start alike (the system prompt with the tool descriptions, often
1–2k tokens); without sharing each thread encodes that prefix again and holds its
own copy. This cache keeps, per backend, the KV of such prefixes as *entries*: one
read-only key and value tensor per layer, `[B, H_kv, L, D]`, covering tokens
`0..L-1` of the entry's token ids. Entries are found through a hash chain over
token blocks (as vLLM's automatic prefix caching keys its blocks): the hash of
block k covers blocks 0..k, so the deepest block hit is the longest cached
prefix, which is then checked token by token and extended inside the entry past
the last full block.

A session that starts from an entry attends *views* of its tensors as the shared
prefix of its cache layers (`SharedPrefixLayer.attach_prefix`): nothing is copied.
Every change a session makes to that part (compaction, quantization, archiving)
materialises its own copy first (copy-on-write in `SharedPrefixLayer.select` and
`PhysicalCache.ensure_quantizable`), so no session can change what another one
attends. An entry's reference count is the number of holders (physical caches)
that still attend its storage, read from the holders themselves: a holder that
materialised its own copy, or closed, stops counting without having to say so, and
a lost receipt can only keep memory, never free what someone attends.

Unreferenced entries stay while there is room and go first under pressure, in the
order of a pluggable `EvictionStrategy` (`get_priority`, lowest goes first, as in
SGLang's radix cache). Simultaneous first calls of threads with the same prefix
encode it once: the first claims the prefix (`claim`), the others wait for it.

The cache needs no model: tests drive it with plain tensors.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from agentkv.store.block import kv_bytes

__all__ = [
    "EVICTION_STRATEGIES",
    "EvictionStrategy",
    "LFUStrategy",
    "LRUStrategy",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixEntry",
    "PrefixHolder",
    "PrefixMatch",
]


class PrefixHolder(Protocol):
    """What attends an entry: a physical cache (`PhysicalCache.attends`)."""

    def attends(self, tensor: torch.Tensor) -> bool:
        """Whether any attended tensor shares `tensor`'s storage."""
        ...


@dataclass(eq=False)
class PrefixEntry:
    """One cached prefix: its token ids and its KV, read-only."""

    entry_id: int
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]
    """Per layer, `[B, H_kv, L, D]`, L = `len(token_ids)`; never written after insertion."""
    values: list[torch.Tensor]
    """Per layer, `[B, H_kv, L, D]`."""
    last_used: int = 0
    """The cache's clock at the last lookup that matched it (LRU order)."""
    hits: int = 0
    """Lookups that matched it."""
    holders: weakref.WeakSet[PrefixHolder] = field(default_factory=weakref.WeakSet)

    @property
    def length(self) -> int:
        """Tokens covered."""
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of its keys and values (all layers)."""
        return kv_bytes(self.keys, self.values)

    def references(self) -> int:
        """Holders that attend it now (its reference count)."""
        anchor = self.keys[0] if self.keys else None
        if anchor is None:
            return 0
        return sum(1 for holder in list(self.holders) if holder.attends(anchor))

    def tensors(self) -> Iterator[torch.Tensor]:
        """Its keys and values, every layer."""
        yield from self.keys
        yield from self.values


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of some token ids: `length` tokens of `entry`."""

    entry: PrefixEntry
    length: int

    def layer_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, views of the entry's first `length` keys and values (no copy)."""
        n = self.length
        return [
            (k[..., :n, :], v[..., :n, :]) for k, v in zip(self.entry.keys, self.entry.values, strict=True)
        ]


class EvictionStrategy(Protocol):
    """Orders unreferenced entries for eviction: the lowest priority goes first."""

    def get_priority(self, entry: PrefixEntry) -> float:
        """The entry's priority to stay."""
        ...


@dataclass(frozen=True)
class LRUStrategy:
    """Least recently used first."""

    def get_priority(self, entry: PrefixEntry) -> float:
        """The entry's last use on the cache's clock."""
        return float(entry.last_used)


@dataclass(frozen=True)
class LFUStrategy:
    """Least often used first (ties: least recently used)."""

    def get_priority(self, entry: PrefixEntry) -> float:
        """Hits, then last use as a fraction."""
        return entry.hits + entry.last_used / (entry.last_used + 1.0)


EVICTION_STRATEGIES: dict[str, type[LRUStrategy] | type[LFUStrategy]] = {
    "lru": LRUStrategy,
    "lfu": LFUStrategy,
}
"""Strategies by the name `prefix_cache.eviction` takes."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """What the cache holds now and what it served."""

    entries: int
    referenced_entries: int
    tokens: int
    bytes: int
    """Bytes of every entry (referenced or not), each counted once."""
    unreferenced_bytes: int
    """Bytes no session attends: what eviction can free."""
    hits: int
    misses: int
    shared_tokens: int
    """Tokens sessions took from the cache instead of encoding them."""
    evicted_entries: int


class PrefixCache:
    """Committed prefixes' KV shared across the sessions of one backend (thread-safe).

    Args:
        max_bytes: entries may hold at most this many bytes; None = no limit of its own
            (the global device budget still evicts unreferenced entries under pressure).
        block_tokens: tokens per hashed block; a prefix is found by its full blocks.
        strategy: which unreferenced entry goes first.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        block_tokens: int = 16,
        strategy: EvictionStrategy | None = None,
    ) -> None:
        if block_tokens < 1:
            msg = f"block_tokens: must be >= 1, got {block_tokens}"
            raise ValueError(msg)
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.strategy: EvictionStrategy = strategy or LRUStrategy()
        self._entries: dict[int, PrefixEntry] = {}
        self._chain: dict[int, set[int]] = {}
        """Hash of blocks 0..k -> ids of the entries holding at least those blocks."""
        self._in_flight: dict[tuple[int, ...], threading.Event] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._clock = 0
        self.hits = 0
        self.misses = 0
        self.shared_tokens = 0
        self.evicted_entries = 0

    # -- lookup -----------------------------------------------------------------------------

    def _block_hashes(self, token_ids: Sequence[int]) -> Iterator[tuple[int, int]]:
        """`(end, hash of tokens[:end])` for every full block of `token_ids`."""
        b = self.block_tokens
        running = 0
        for end in range(b, len(token_ids) + 1, b):
            running = hash((running, tuple(token_ids[end - b : end])))
            yield end, running

    def lookup(self, token_ids: Sequence[int], *, limit: int | None = None) -> PrefixMatch | None:
        """The longest cached prefix of `token_ids`, at most `limit` tokens (None when under one block).

        Only looks: `adopt` counts the use (LRU, hits), `note_miss` a first encoding without one.
        """
        limit = len(token_ids) if limit is None else min(limit, len(token_ids))
        with self._lock:
            best: PrefixMatch | None = None
            candidates: set[int] = set()
            for _, key in self._block_hashes(token_ids[:limit]):
                ids = self._chain.get(key)
                if not ids:
                    break
                candidates = ids
            for entry_id in candidates:
                entry = self._entries[entry_id]
                n = _common_prefix(entry.token_ids, token_ids, limit)
                if n >= self.block_tokens and (best is None or n > best.length):
                    best = PrefixMatch(entry, n)
            return best

    def adopt(self, match: PrefixMatch, holder: PrefixHolder) -> None:
        """Record that `holder` now attends `match` (a reference while it does; a use for LRU)."""
        with self._lock:
            self._clock += 1
            match.entry.last_used = self._clock
            match.entry.hits += 1
            match.entry.holders.add(holder)
            self.hits += 1
            self.shared_tokens += match.length

    def note_miss(self) -> None:
        """Count a session that started with nothing from the cache."""
        with self._lock:
            self.misses += 1

    # -- encoding once ----------------------------------------------------------------------

    @contextmanager
    def claim(self, token_ids: Sequence[int]) -> Iterator[bool]:
        """Encode a prefix once across threads: yields True to the one that must encode it.

        A second thread claiming the same prefix waits until the first one leaves
        its block (published or failed), then gets False and looks it up again.
        """
        key = tuple(token_ids)
        with self._lock:
            running = self._in_flight.get(key)
            if running is None:
                mine = threading.Event()
                self._in_flight[key] = mine
        if running is not None:
            running.wait()
            yield False
            return
        try:
            yield True
        finally:
            with self._lock:
                del self._in_flight[key]
            mine.set()

    # -- insertion and eviction -----------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        holder: PrefixHolder | None = None,
    ) -> PrefixEntry | None:
        """Cache the KV of `token_ids` (per layer `[B, H_kv, L, D]`, not copied, never written after).

        Returns the entry, the one already holding these tokens, or None when the
        prefix is shorter than a block or does not fit under `max_bytes` even after
        evicting every unreferenced entry.
        """
        ids = tuple(token_ids)
        if len(ids) < self.block_tokens:
            return None
        for k in keys:
            if k.shape[-2] != len(ids):
                msg = f"prefix KV holds {k.shape[-2]} tokens per layer, expected {len(ids)} (its token ids)"
                raise ValueError(msg)
        with self._lock:
            existing = self.lookup_exact(ids)
            if existing is not None:
                return existing
            entry = PrefixEntry(next(self._ids), ids, list(keys), list(values))
            if self.max_bytes is not None:
                room = self.max_bytes - self.held_bytes()
                if entry.nbytes > room and self.evict(entry.nbytes - room) < entry.nbytes - room:
                    return None
            self._clock += 1
            entry.last_used = self._clock
            if holder is not None:
                entry.holders.add(holder)
            self._entries[entry.entry_id] = entry
            for _, key in self._block_hashes(ids):
                self._chain.setdefault(key, set()).add(entry.entry_id)
            return entry

    def lookup_exact(self, token_ids: Sequence[int]) -> PrefixEntry | None:
        """The entry holding exactly these tokens, if any (no hit counted)."""
        ids = tuple(token_ids)
        with self._lock:
            return next((e for e in self._entries.values() if e.token_ids == ids), None)

    def evict(self, free_bytes: int) -> int:
        """Drop unreferenced entries, lowest priority first, until `free_bytes` are freed; bytes freed."""
        freed = 0
        with self._lock:
            idle = [e for e in self._entries.values() if e.references() == 0]
            idle.sort(key=self.strategy.get_priority)
            for entry in idle:
                if freed >= free_bytes:
                    break
                freed += entry.nbytes
                self._remove(entry)
        return freed

    def _remove(self, entry: PrefixEntry) -> None:
        del self._entries[entry.entry_id]
        for _, key in self._block_hashes(entry.token_ids):
            ids = self._chain.get(key)
            if ids is not None:
                ids.discard(entry.entry_id)
                if not ids:
                    del self._chain[key]
        self.evicted_entries += 1

    def clear(self) -> None:
        """Forget every entry (sessions keep attending the tensors they hold)."""
        with self._lock:
            for entry in list(self._entries.values()):
                self._remove(entry)

    # -- accounting -------------------------------------------------------------------------

    def entries(self) -> list[PrefixEntry]:
        """A snapshot of the entries."""
        with self._lock:
            return list(self._entries.values())

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the cache holds (for the backend's de-duplicated device accounting)."""
        for entry in self.entries():
            yield from entry.tensors()

    def held_bytes(self) -> int:
        """Bytes of every entry."""
        return sum(e.nbytes for e in self.entries())

    def stats(self) -> PrefixCacheStats:
        """Entries, bytes and counters now."""
        entries = self.entries()
        refs = [e.references() for e in entries]
        return PrefixCacheStats(
            entries=len(entries),
            referenced_entries=sum(1 for r in refs if r),
            tokens=sum(e.length for e in entries),
            bytes=sum(e.nbytes for e in entries),
            unreferenced_bytes=sum(e.nbytes for e, r in zip(entries, refs, strict=True) if not r),
            hits=self.hits,
            misses=self.misses,
            shared_tokens=self.shared_tokens,
            evicted_entries=self.evicted_entries,
        )


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n
