"""The one session type and the one backend type the integrations program against.

`Session` (a local Transformers model) and `EngineSession` (a served engine) are two
runners behind the same session core; `TransformersBackend` and `EngineBackend` share
one session table (`SessionRegistry`). `AgentSession` and `AgentBackend` name what
both offer, so code over either takes one type instead of a union; what only one
runner has (scoring with the local model, adopting a branch) is asked for with
`isinstance` at the place that needs it. Both are runtime-checkable: a pydantic field
typed `AgentBackend` accepts either backend and refuses anything else.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, Self, Unpack, runtime_checkable

from agentkv.backend.contracts import ExtendResult
from agentkv.backend.sampling import AnswerOptions
from agentkv.chat import ChatMessage
from agentkv.config import AgentKVConfig
from agentkv.events import Event
from agentkv.lifecycle.results import ApplyResult
from agentkv.lifecycle.table import SpanTable
from agentkv.metrics import Counters, SessionStats
from agentkv.spans import Lease, Span
from agentkv.templates import ChatFormat

__all__ = ["AgentBackend", "AgentSession"]


@runtime_checkable
class AgentSession(Protocol):
    """One conversation, whatever runs it (`Session`, `EngineSession`)."""

    session_id: str
    config: AgentKVConfig
    table: SpanTable
    format: ChatFormat
    lock: threading.RLock
    closed: bool
    branch: str | None

    @property
    def parent(self) -> AgentSession | None:
        """The session this branch was forked from (None for a root conversation)."""
        ...

    @property
    def manager(self) -> Any:
        """The session's `LifecycleManager`."""
        ...

    @property
    def spans(self) -> list[Span]:
        """The logical sequence's spans."""
        ...

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation's messages."""
        ...

    @property
    def counters(self) -> Counters:
        """Running totals."""
        ...

    @property
    def turn(self) -> int:
        """The current user turn."""
        ...

    def extend(
        self, messages: Sequence[Any], *, prefill: bool = True, events: Sequence[Event] = ()
    ) -> ExtendResult:
        """Bring the session in line with `messages`."""
        ...

    def generate(self, max_new_tokens: int = 256, **options: Unpack[AnswerOptions]) -> str:
        """Answer as the assistant."""
        ...

    def stream(self, max_new_tokens: int = 256, **options: Unpack[AnswerOptions]) -> Iterator[str]:
        """Answer as the assistant, in pieces."""
        ...

    def bind_message(self, message: Any, span_id: int | None = None) -> None:
        """Say which message stands for a generated span."""
        ...

    def apply(self, event: Event) -> ApplyResult:
        """Apply a lifecycle event."""
        ...

    def pin(
        self, owner: str | None = None, *, span_ids: Sequence[int] | None = None, reason: str = ""
    ) -> Lease:
        """Pin spans; returns the lease."""
        ...

    def release(self, lease: Lease) -> bool:
        """Give a pin back."""
        ...

    def fork(self, branch: str, *, config: AgentKVConfig | None = None) -> Self:
        """A branch session over this one's prefix."""
        ...

    def stats(self) -> SessionStats:
        """Counters and per-tier bytes, now."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """The span map and stats as a JSON-friendly dict."""
        ...

    def save_snapshot(self, path: str) -> None:
        """Write `snapshot()` as JSON."""
        ...

    def check(self) -> None:
        """Verify the lifecycle invariants."""
        ...

    def close(self) -> None:
        """Free the session's KV."""
        ...


@runtime_checkable
class AgentBackend(Protocol):
    """Sessions over one model, whatever serves it (`TransformersBackend`, `EngineBackend`)."""

    config: AgentKVConfig
    tokenizer: Any
    chat_format: ChatFormat
    noop_events: int

    @property
    def max_positions(self) -> int | None:
        """Positions the model supports (None = not declared)."""
        ...

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token."""
        ...

    def session(
        self, session_id: str, *, create: bool = True, config: AgentKVConfig | None = None
    ) -> AgentSession:
        """The session with this id, created on first use."""
        ...

    def get(self, session_id: str) -> AgentSession:
        """An existing session."""
        ...

    def fork(self, session_id: str, branch: str, *, config: AgentKVConfig | None = None) -> AgentSession:
        """Create (or get) a branch session."""
        ...

    def close(self, session_id: str) -> None:
        """Free a session's KV and forget it (one that already ended: a logged no-op)."""
        ...

    def apply(self, session_id: str, event: Event) -> Any:
        """Apply an event to a session (unknown: a logged no-op)."""
        ...

    def sessions(self) -> Iterator[AgentSession]:
        """A snapshot of the live sessions."""
        ...

    def __contains__(self, session_id: object) -> bool:
        """Whether a session with this id is live."""
        ...

    def device_bytes(self) -> int:
        """KV bytes the backend's sessions hold on the device (engine: in prompts)."""
        ...
