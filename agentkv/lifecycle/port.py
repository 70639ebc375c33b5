"""What the lifecycle needs from its session, as a protocol.

The lifecycle never imports the session or the backend: it works on a span table
(`agentkv.lifecycle.table`), a store (`agentkv.store.protocol`) and these few
services. `agentkv.backend.session.Session` provides them over a Transformers model; the
simulated tests provide them with no model at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from agentkv.config import AgentKVConfig
    from agentkv.lifecycle.placement import Rung
    from agentkv.lifecycle.table import SpanTable
    from agentkv.spans import Span
    from agentkv.store.protocol import KVStoreProtocol


class SessionPort(Protocol):
    """The services a session offers its lifecycle manager.

    Three optional services are looked up by name, so stores without a model (the
    simulated tests, a served engine) need not offer them: `question_queries()`
    (per layer, the RoPE'd queries `[H_q, m, D]` of the pending user message over
    the attended cache; page recall), `window_attention(token_ids)` (`[S]`
    attention the attended slots get from tokens read after the conversation's end;
    question-observed compression), both leaving the cache as it was, and
    `recompute_offsets(span, offsets)` (some of an attended span's tokens recomputed
    in full precision in place of their quantized KV; exact page recall).
    """

    @property
    def session_id(self) -> str:
        """The session's id."""
        ...

    @property
    def config(self) -> AgentKVConfig:
        """The session's configuration."""
        ...

    @property
    def table(self) -> SpanTable:
        """The session's span table."""
        ...

    @property
    def store(self) -> KVStoreProtocol:
        """Where the session's KV lives."""
        ...

    @property
    def bytes_per_token(self) -> int:
        """Device bytes of one attended token's KV (all layers, keys and values)."""
        ...

    def recompute(self, span: Span) -> None:
        """Compute a dropped span's KV from its token ids at its logical positions (raises on failure)."""
        ...

    def rung_fidelity(self) -> Mapping[Rung, float]:
        """Fraction of a span's value lost at each rung (`agentkv.lifecycle.placement`) on this model."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` (recall ranks spans against the new message's ids)."""
        ...

    def token_text(self, token: int) -> str:
        """One token's text (recall counts word overlap on it)."""
        ...

    def background_logprobs(self) -> Any:
        """The model's next-token log-probs `[V]` after a newline alone, or None (recall's word weights)."""
        ...

    def token_embeddings(self) -> Any:
        """The model's input embedding module, or None (recall's embedding signal)."""
        ...

    def global_device_bytes(self) -> int:
        """Device KV bytes held by every session of the backend (the global budget)."""
        ...

    def child_branches(self) -> Sequence[tuple[str, str | None]]:
        """`(session_id, branch)` of the live branch sessions forked from this one."""
        ...

    def close_child(self, session_id: str) -> None:
        """Close a branch session forked from this one."""
        ...
