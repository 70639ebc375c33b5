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
    from agentkv.lifecycle.rungs import Rung
    from agentkv.lifecycle.table import SpanTable
    from agentkv.spans import Span, Tier
    from agentkv.store.protocol import KVStoreProtocol


class SessionPort(Protocol):
    """The services a session offers its lifecycle manager.

    Three services need a local model; a session without one (a served engine, the
    simulated tests) answers "not supported" as documented on each (see
    `agentkv.backend.port_base.SessionServicesBase`).
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

    @property
    def recomputes_offsets(self) -> bool:
        """Whether `recompute_offsets` is supported (exact page recall needs it)."""
        ...

    def recompute_offsets(self, parts: Sequence[tuple[Span, Sequence[int]]]) -> dict[int, Tier]:
        """Recompute some tokens of attended spans in full precision, in one forward; each span's tier now.

        A span stays on the attended quantized tier while any of its tokens stays quantized.
        Raises on failure (every span stays as it was), and `NotImplementedError` where
        `recomputes_offsets` is False.
        """
        ...

    def window_attention(self, token_ids: Sequence[int]) -> Any:
        """`[S]` attention the attended slots get from `token_ids` read after the conversation's end.

        None: not supported (or nothing to observe). The cache is left as it was
        (question-observed compression).
        """
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

    def relieve_global(self, free_bytes: int) -> int:
        """Free up to `free_bytes` of device KV no session attends (unreferenced prefix cache entries)."""
        ...

    def child_branches(self) -> Sequence[tuple[str, str | None]]:
        """`(session_id, branch)` of the live branch sessions forked from this one."""
        ...

    def close_child(self, session_id: str) -> None:
        """Close a branch session forked from this one."""
        ...
