"""A session's first encoding starts from the backend's cross-session prefix cache.

When a session's cache is empty (a new thread, or a history rewritten from its
first message) and its pending tokens start at position 0, `start_from_shared_prefix`:

1. attends the longest cached prefix of those tokens (views of the entry's tensors,
   nothing copied, nothing encoded), and
2. when the session's leading system messages (the system prompt with the tool
   descriptions) reach past that, encodes them in a forward of their own, holds them
   as a read-only prefix and publishes them to the cache, under a claim, so threads
   whose first calls run at the same time encode the prefix once.

It returns what is left to encode. Exactness: the shared KV is the KV this
session's own forward would write for the same tokens at the same positions
(tested: logits equal within fp32 tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from agentkv.backend.contracts import SessionHost
from agentkv.backend.runner import Feed
from agentkv.config import AgentKVConfig
from agentkv.config_sections import PrefixCacheConfig
from agentkv.lifecycle.table import SpanTable
from agentkv.metrics import Counters
from agentkv.spans import Span, SpanKind, Tier
from agentkv.store.kvstore import KVStore
from agentkv.store.prefix_cache import EVICTION_STRATEGIES, PrefixCache, PrefixMatch

__all__ = ["PrefixUser", "build_prefix_cache", "shareable_length", "start_from_shared_prefix"]


class PrefixUser(Protocol):
    """What encoding from the prefix cache needs of a session (`Session` provides it)."""

    backend: SessionHost
    config: AgentKVConfig
    store: KVStore
    table: SpanTable

    @property
    def spans(self) -> list[Span]:
        """The logical sequence's spans."""
        ...

    @property
    def counters(self) -> Counters:
        """Running totals."""
        ...

    def span(self, span_id: int) -> Span:
        """The span with this id."""
        ...

    def forward(self, feed: Feed, **kwargs: Any) -> torch.Tensor | None:
        """Run `feed` over the session's cache (the caller holds `model_lock`)."""
        ...


def build_prefix_cache(config: PrefixCacheConfig, bytes_per_token: int) -> PrefixCache | None:
    """The backend's prefix cache as `prefix_cache` configures it (None when disabled)."""
    if not config.enabled:
        return None
    max_bytes = None if config.max_tokens is None else config.max_tokens * bytes_per_token
    strategy = EVICTION_STRATEGIES[config.eviction]()
    return PrefixCache(max_bytes=max_bytes, block_tokens=config.block_tokens, strategy=strategy)


def shareable_length(spans: Sequence[Span], limit: int) -> int:
    """Tokens of the leading system spans not encoded yet, at most `limit` (what a thread shares)."""
    n = 0
    for span in spans:
        if span.kind is not SpanKind.SYSTEM or span.tier is not Tier.DEVICE or span.n_computed:
            break
        if span.start != n or span.kept is not None:
            break
        n += span.length
    return min(n, limit)


def start_from_shared_prefix(session: PrefixUser, feed: Feed) -> Feed:
    """Take what the prefix cache holds of `feed`, publish the session's shareable prefix; the rest to encode.

    A no-op (returns `feed`) unless the backend has a prefix cache, the session's config
    enables it, the cache holds nothing yet and `feed` starts at position 0. At least
    one token is always left to encode (the answer needs its logits).
    """
    cache = session.backend.prefix_cache
    physical = session.store.physical
    if (
        cache is None
        or not session.config.prefix_cache.enabled
        or physical.length
        or len(feed) < 2
        or feed.positions != list(range(len(feed)))
    ):
        return feed
    limit = len(feed) - 1
    shareable = shareable_length(session.spans, limit)
    match = cache.lookup(feed.input_ids, limit=limit)
    held = 0 if match is None else match.length
    if shareable < cache.block_tokens or shareable <= held:
        return _attend(session, cache, feed, match)
    with cache.claim(feed.input_ids[:shareable]) as mine:
        # Another thread may have published it meanwhile (or failed to): look again.
        match = cache.lookup(feed.input_ids, limit=limit)
        held = 0 if match is None else match.length
        if not mine or shareable <= held:
            return _attend(session, cache, feed, match)
        rest = _attend(session, cache, feed, match)
        head = rest.chunk(0, shareable - held)
        with session.backend.model_lock, physical.whole_window():  # shared whole: any match length is exact
            session.forward(head, logits="none")
        session.counters.prefill_tokens += len(head)
        _mark_computed(session, head)
        layers = physical.freeze_as_prefix()
        if layers:
            cache.insert(
                feed.input_ids[:shareable], [k for k, _ in layers], [v for _, v in layers], holder=physical
            )
        return rest.chunk(len(head), len(rest))


def _attend(session: PrefixUser, cache: PrefixCache, feed: Feed, match: PrefixMatch | None) -> Feed:
    """Attend `match`'s tokens as the session's shared prefix; the rest of `feed`."""
    if match is None:
        cache.note_miss()
        return feed
    n = match.length
    head = feed.chunk(0, n)
    physical = session.store.physical
    physical.attach_prefix(
        match.layer_views(),
        torch.tensor(head.span_ids, dtype=torch.long),
        torch.tensor(head.offsets, dtype=torch.long),
        torch.tensor(head.positions, dtype=torch.long),
    )
    cache.adopt(match, physical)
    _mark_computed(session, head)
    session.counters.reused_tokens += n
    session.counters.shared_prefix_tokens += n
    session.table.record("shared_prefix", tokens=n, entry=match.entry.entry_id)
    return feed.chunk(n, len(feed))


def _mark_computed(session: PrefixUser, head: Feed) -> None:
    """The spans' tokens in `head` now hold KV (so a failed later forward does not encode them twice)."""
    ends: dict[int, int] = {}
    for span_id, offset in zip(head.span_ids, head.offsets, strict=True):
        ends[span_id] = max(ends.get(span_id, 0), offset + 1)
    for span_id, end in ends.items():
        span = session.span(span_id)
        span.n_computed = max(span.n_computed, end)
