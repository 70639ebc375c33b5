"""The session table both backends share: create, look up, fork, close and route events by id.

`TransformersBackend` and `EngineBackend` differ in what a session runs on (a local
model and `KVStore`, or a served engine and `EngineStore`); the table of sessions
over it is one piece of code. A backend subclasses `SessionRegistry` and says how
to make one of its sessions (`_new_session`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

from agentkv.config import AgentKVConfig
from agentkv.events import Event, validate_event
from agentkv.session_ids import branch_session_id

logger = logging.getLogger("agentkv.backend")

__all__ = ["RegisteredSession", "SessionRegistry", "UnknownSessionError"]


class UnknownSessionError(KeyError):
    """No session with that id; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown session"


class RegisteredSession(Protocol):
    """What the table needs of a session (both `Session` and `EngineSession` have it)."""

    closed: bool

    @property
    def manager(self) -> Any:
        """The session's lifecycle manager."""
        ...

    def apply(self, event: Event) -> Any:
        """Apply a lifecycle event."""
        ...

    def close(self) -> None:
        """Free the session's KV."""
        ...


S = TypeVar("S", bound=RegisteredSession)


class SessionRegistry(Generic[S]):
    """Sessions by id, thread-safe; the subclass builds its own kind (`_new_session`)."""

    config: AgentKVConfig

    def __init__(self) -> None:
        self._sessions: dict[str, S] = {}
        self._table_lock = threading.Lock()
        self.noop_events = 0
        """Events for unknown or closed sessions, ignored (logged)."""

    def _new_session(
        self, session_id: str, *, parent: S | None, branch: str | None, config: AgentKVConfig | None
    ) -> S:
        """A new session of this backend's kind (`parent`/`branch` for a fork)."""
        raise NotImplementedError

    def session(self, session_id: str, *, create: bool = True, config: AgentKVConfig | None = None) -> S:
        """The session with this id, created on first use (`create=False` raises when absent).

        `config` applies only when the session is created here (per-run overrides such as
        LangGraph's `configurable.agentkv`); None = the backend's config. An existing
        session keeps the config it was created with.

        Raises:
            ValueError: `session_id` is not a non-empty string.
            UnknownSessionError: `create=False` and no such live session.
        """
        if not isinstance(session_id, str) or not session_id:
            msg = f"session id: expected a non-empty string, got {session_id!r}"
            raise ValueError(msg)
        with self._table_lock:
            existing = self._sessions.get(session_id)
            if existing is not None and not existing.closed:
                return existing
            if not create:
                raise UnknownSessionError(self._unknown(session_id))
            session = self._new_session(session_id, parent=None, branch=None, config=config)
            self._sessions[session_id] = session
            return session

    def get(self, session_id: str) -> S:
        """An existing session (raises `UnknownSessionError` naming the known ids)."""
        return self.session(session_id, create=False)

    def _unknown(self, session_id: str) -> str:
        known = ", ".join(sorted(self._sessions)[:20]) or "none"
        return f"unknown session {session_id!r}; known sessions: {known}"

    def __contains__(self, session_id: object) -> bool:
        with self._table_lock:
            return session_id in self._sessions

    def sessions(self) -> Iterator[S]:
        """A snapshot of the live sessions."""
        with self._table_lock:
            return iter(list(self._sessions.values()))

    def fork(self, session_id: str, branch: str, *, config: AgentKVConfig | None = None) -> S:
        """Create (or get) the branch session `<session_id>/<branch>` over the parent's prefix.

        `config` applies only when the branch is created here; None = the parent's.
        """
        parent = self.get(session_id)
        child_id = branch_session_id(session_id, branch)
        with self._table_lock:
            existing = self._sessions.get(child_id)
            if existing is not None and not existing.closed:
                return existing
        child = self._new_session(child_id, parent=parent, branch=branch, config=config)
        parent.manager.note_branch(branch)
        with self._table_lock:
            self._sessions[child_id] = child
        return child

    def close(self, session_id: str) -> None:
        """Free a session's KV and forget it (raises `UnknownSessionError` when absent)."""
        with self._table_lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise UnknownSessionError(self._unknown(session_id))
        session.close()

    def apply(self, session_id: str, event: Event) -> Any:
        """Apply an event to a session; an unknown session is a logged no-op (returns None)."""
        validate_event(event)
        with self._table_lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed:
            self.noop_events += 1
            logger.info("event %s for unknown session %r ignored", event.name, session_id)
            return None
        return session.apply(event)
