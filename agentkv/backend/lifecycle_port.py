"""The session's side of the lifecycle: the services `agentkv.lifecycle.port.SessionPort` names.

The lifecycle manager never holds the session itself; it holds this adapter,
which offers exactly what the lifecycle may use (recompute a span, encode text,
global usage, branch sessions) through the session's public methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from agentkv.backend.port_base import SessionServicesBase
from agentkv.backend.runner import Feed, ModelRunner
from agentkv.config import AgentKVConfig
from agentkv.lifecycle.budget import BudgetLimits
from agentkv.lifecycle.rungs import DEFAULT_FIDELITY, Rung
from agentkv.lifecycle.table import SpanTable
from agentkv.policies import AttentionProbe
from agentkv.spans import Span, Tier
from agentkv.store.kvstore import KVStore
from agentkv.templates import ChatFormat


class ServedSession(Protocol):
    """The public face of a session this adapter reads (`agentkv.backend.session.Session`)."""

    session_id: str
    config: AgentKVConfig
    table: SpanTable
    store: KVStore
    runner: ModelRunner
    format: ChatFormat
    backend: Any
    parent: Any
    limits: BudgetLimits

    def forward(self, feed: Feed, **kwargs: Any) -> Any:
        """Run a feed through the model over the session's cache."""
        ...


class SessionServices(SessionServicesBase[ServedSession]):
    """`SessionPort` over a local session: recompute and attention probes run the model."""

    def rung_fidelity(self) -> Mapping[Rung, float]:
        """The rung costs measured on the backend's model (`budget.rung_costs: calibrated`), or the priors."""
        if self.config.budget.rung_costs == "fixed":
            return DEFAULT_FIDELITY
        return self.session.backend.rung_fidelity(self.config)

    def recompute(self, span: Span) -> None:
        """Compute a dropped span's KV from its token ids at its logical positions.

        The mask is by logical position: the span attends only to what precedes it
        in the conversation, wherever those tokens sit in the physical cache.
        """
        positions = list(range(span.start, span.start + span.n_computed))
        feed = Feed(
            span.token_ids[: span.n_computed],
            positions,
            [span.span_id] * len(positions),
            list(range(len(positions))),
        )
        self.session.store.physical.compact_pending()
        mask = self.session.runner.logical_mask(self.session.store.physical, positions)
        with self.session.backend.model_lock:
            self.session.forward(feed, logits="none", attention_mask=mask)

    @property
    def recomputes_offsets(self) -> bool:
        """A local model recomputes single tokens."""
        return True

    def recompute_offsets(self, parts: Sequence[tuple[Span, Sequence[int]]]) -> dict[int, Tier]:
        """Recompute some tokens of attended spans in full precision, in one forward, replacing their KV.

        The tokens are run at their logical positions over the cache as it is, their old
        (quantized) copies masked out; a recomputed token attends the recomputed tokens
        before it, not their old copies. The old copies are removed only once the forward
        succeeded, so a failure leaves every span as it was. Exact page recall uses it
        (`agentkv.lifecycle.exact_recall`). Returns each span's tier afterwards (the mover writes it).

        Raises:
            ValueError: some offset is not held in the attended cache.
        """
        physical = self.session.store.physical
        physical.compact_pending()
        tokens: list[tuple[int, int, Span, int]] = []  # (position, span id, span, offset)
        old: list[torch.Tensor] = []
        for span, offsets in parts:
            wanted = sorted(set(offsets))
            slots = physical.slots_of(span.span_id, wanted)
            if int(slots.numel()) != len(wanted):
                msg = (
                    f"span {span.span_id}: {len(wanted) - int(slots.numel())} of the offsets are not attended"
                )
                raise ValueError(msg)
            old.append(slots)
            tokens += [(span.start + o, span.span_id, span, o) for o in wanted]
        if not tokens:
            return {}
        tokens.sort(key=lambda t: (t[0], t[1]))
        positions = [p for p, _, _, _ in tokens]
        feed = Feed(
            [span.token_ids[o] for _, _, span, o in tokens],
            positions,
            [span_id for _, span_id, _, _ in tokens],
            [o for _, _, _, o in tokens],
        )
        hidden = torch.cat(old)
        mask = self.session.runner.logical_mask(physical, positions, hidden=hidden)
        with self.session.backend.model_lock:
            self.session.forward(feed, logits="none", attention_mask=mask)
        physical.remove(hidden)
        return {span.span_id: self.session.store.attended_tier(span) for span, _ in parts}

    def window_attention(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """`[S]` attention the attended slots get from `token_ids` read after the conversation's end."""
        ids = list(token_ids)
        if not ids or Feed.pending(self.session.table.spans).input_ids:
            return None  # pending tokens would sit between the cache and the window
        physical = self.session.store.physical
        start = self.session.table.logical_length
        feed = Feed(ids, list(range(start, start + len(ids))), [-1] * len(ids), list(range(len(ids))))
        before = physical.length
        probe = self._probe(feed, len(ids))
        return probe.attention()[:before]

    def _probe(self, feed: Feed, window: int) -> AttentionProbe:
        """Run `feed` after the attended cache under an attention probe, then cut the cache back."""
        session = self.session
        physical = session.store.physical
        physical.compact_pending()
        before = physical.length
        mask = None
        if before and min(feed.positions) < int(physical.slot_position.max()):
            mask = session.runner.logical_mask(physical, feed.positions)
        try:
            with (
                session.backend.model_lock,
                physical.whole_window(),  # the tokens are taken back: the sliding KV they would outdate stays
                AttentionProbe(session.runner.model, window=window) as probe,
            ):
                session.runner.forward(physical, feed, logits="none", attention_mask=mask, probe=probe)
        finally:
            physical.truncate(before)
        return probe

    def background_logprobs(self) -> Any:
        """The model's next-token log-probs `[V]` after a newline alone (recall's word weights)."""
        session = self.session
        with session.backend.model_lock:
            return session.runner.background_logprobs(session.format.encode("\n"))

    def token_embeddings(self) -> Any:
        """The model's input embedding module, or None."""
        get = getattr(self.session.runner.model, "get_input_embeddings", None)
        return get() if callable(get) else None

    def global_device_bytes(self) -> int:
        """Device KV bytes across the backend's sessions and its prefix cache."""
        return self.session.backend.device_bytes()

    def relieve_global(self, free_bytes: int) -> int:
        """Free device bytes no session attends (unreferenced prefix cache entries); bytes freed."""
        return self.session.backend.relieve_device(free_bytes)
