"""The half of the lifecycle port (`agentkv.lifecycle.port.SessionPort`) every session offers alike.

`SessionServices` (local model) and `EngineServices` (served engine) extend it with
what differs: how a span's KV is recomputed, what attention or embeddings recall may
read. The ids, config, table, text encoding and branch sessions are the same code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from agentkv.config import AgentKVConfig
from agentkv.lifecycle.rungs import DEFAULT_FIDELITY, Rung
from agentkv.lifecycle.table import SpanTable
from agentkv.session_ids import is_branch_of
from agentkv.spans import Span, Tier
from agentkv.templates import ChatFormat

if TYPE_CHECKING:
    from agentkv.store.protocol import KVStoreProtocol

__all__ = ["PortSession", "SessionServicesBase"]


class PortSession(Protocol):
    """What the common port reads of a session (`Session`, `EngineSession`)."""

    session_id: str
    config: AgentKVConfig
    table: SpanTable
    format: ChatFormat
    backend: Any
    """Its backend: `tokenizer`, `bytes_per_token`, `sessions()`, `close(id)`."""

    @property
    def store(self) -> KVStoreProtocol:
        """Its store (`KVStore`, `EngineStore`)."""
        ...


SessionT = TypeVar("SessionT", bound=PortSession)
"""The kind of session a port serves (`Session`, `EngineSession`)."""


class SessionServicesBase(Generic[SessionT]):
    """`SessionPort` services that do not depend on what runs the session."""

    def __init__(self, session: SessionT) -> None:
        self.session = session

    @property
    def store(self) -> KVStoreProtocol:
        """The session's store."""
        return self.session.store

    @property
    def session_id(self) -> str:
        """The session's id."""
        return self.session.session_id

    @property
    def config(self) -> AgentKVConfig:
        """The session's configuration."""
        return self.session.config

    @property
    def table(self) -> SpanTable:
        """The session's span table."""
        return self.session.table

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one attended token (the backend's model or engine)."""
        return int(self.session.backend.bytes_per_token)

    def rung_fidelity(self) -> Mapping[Rung, float]:
        """Fraction of a span's value lost at each rung: the built-in priors (no model to measure on)."""
        return DEFAULT_FIDELITY

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` (no chat template)."""
        return self.session.format.encode(text)

    def token_text(self, token: int) -> str:
        """One token's text."""
        return str(self.session.backend.tokenizer.decode([token]))

    @property
    def recomputes_offsets(self) -> bool:
        """Whether some tokens of a span can be recomputed alone: not without a local model."""
        return False

    def recompute_offsets(self, parts: Sequence[tuple[Span, Sequence[int]]]) -> dict[int, Tier]:
        """Not supported without a local model."""
        del parts
        msg = f"{type(self).__name__} cannot recompute single tokens (no local model)"
        raise NotImplementedError(msg)

    def window_attention(self, token_ids: Sequence[int]) -> Any:
        """Not supported without a local model: None (commit compression uses the policy's scores)."""
        del token_ids
        return None

    def child_branches(self) -> list[tuple[str, str | None]]:
        """`(session_id, branch)` of the live branch sessions forked from this one."""
        session = self.session
        return [
            (child.session_id, child.branch)
            for child in session.backend.sessions()
            if is_branch_of(child.session_id, session.session_id) and child.parent is session
        ]

    def close_child(self, session_id: str) -> None:
        """Close a branch session forked from this one."""
        self.session.backend.close(session_id)
