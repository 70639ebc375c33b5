"""What a session and its backend promise each other, and what session calls return."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from agentkv.backend.runner import ModelRunner
from agentkv.config import AgentKVConfig
from agentkv.lifecycle.results import ApplyResult
from agentkv.store.prefix_cache import PrefixCache
from agentkv.templates import ChatFormat


class ContextLengthError(ValueError):
    """A conversation that no longer fits the model's positions; the message names the way out.

    The session is unchanged: shortening the history it is sent (a summary in place of
    old turns, or old turns dropped) lets the thread go on; the session crops what
    changed and encodes the new suffix.
    """

    def __init__(self, session_id: str, total: int, limit: int, way_out: str | None = None) -> None:
        self.session_id = session_id
        self.total = total
        """Positions the call would need (history, prompt and `max_new_tokens`)."""
        self.limit = limit
        """The model's positions (`max_position_embeddings`)."""
        way_out = way_out or "send a shorter history: summarise old turns or drop them"
        msg = (
            f"session {session_id!r}: the conversation would be {total} tokens long, more than the "
            f"model's {limit} positions; {way_out}"
        )
        super().__init__(msg)


class BackendHost(Protocol):
    """What any session needs from the backend that owns it (both backends provide it)."""

    config: AgentKVConfig
    chat_format: ChatFormat
    tokenizer: Any

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token (the local model's, or the served engine's)."""
        ...

    def sessions(self) -> Iterator[Any]:
        """A snapshot of the live sessions."""
        ...

    def fork(self, session_id: str, branch: str, *, config: AgentKVConfig | None = None) -> Any:
        """Create (or get) the branch session `<session_id>/<branch>` (`config`: its own settings)."""
        ...

    def close(self, session_id: str) -> None:
        """Free a session's KV and forget it."""
        ...

    def device_bytes(self) -> int:
        """Device KV bytes across all sessions (the engine: their prompts)."""
        ...


class SessionHost(BackendHost, Protocol):
    """What a local session needs from its backend (`TransformersBackend` provides it)."""

    runner: ModelRunner
    model_lock: Any
    """A lock serialising model forwards (attention hooks live on the shared model)."""
    prefix_cache: PrefixCache | None
    """Leading system messages' KV shared across sessions (None: each session encodes its own)."""

    def __contains__(self, session_id: object) -> bool:
        """Whether a session with this id is live."""
        ...

    def relieve_device(self, free_bytes: int) -> int:
        """Free device bytes no session attends; bytes freed."""
        ...


class SessionClosedError(RuntimeError):
    """The session was closed; create a new one with `backend.session(id)`."""


@dataclass(frozen=True)
class ExtendResult:
    """What `Session.extend` did."""

    prefilled_tokens: int
    """Tokens encoded by the model in this call."""
    reused_tokens: int
    """Tokens of the incoming history served from the cache."""
    cropped_tokens: int
    """Cached tokens dropped because the history was rewritten upstream."""
    new_spans: tuple[int, ...]
    first_changed_message: int | None
    """Index of the first message that differed from the cache (None = pure append)."""
    seconds: float
    pending_tokens: int = 0
    """New tokens left for the next answer to encode (`extend(..., prefill=False)`)."""
    applied: tuple[ApplyResult, ...] = ()
    """What each event given with the messages did (`extend(..., events=...)`), in order."""
