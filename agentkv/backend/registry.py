"""The session table both backends share: create, look up, fork, close and route events by id.

`TransformersBackend` and `EngineBackend` differ in what a session runs on (a local
model and `KVStore`, or a served engine and `EngineStore`); the table of sessions
over it is one piece of code. A backend subclasses `SessionRegistry` and says how
to make one of its sessions (`_new_session`). The table also ends sessions the
`agentkv.sessions` bounds say to end (idle, or beyond `max_live`), for both backends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from agentkv.backend.retention import SessionUse, sessions_to_end
from agentkv.config import AgentKVConfig
from agentkv.events import Event, validate_event
from agentkv.session_ids import branch_session_id

logger = logging.getLogger("agentkv.backend")

__all__ = ["ENDED_IDS_KEPT", "RegisteredSession", "SessionRegistry", "UnknownSessionError"]

ENDED_IDS_KEPT = 50_000
"""Ended session ids remembered so that closing one again is a no-op (a few MB at most)."""


class UnknownSessionError(KeyError):
    """No session with that id; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown session"


class RegisteredSession(Protocol):
    """What the table needs of a session (both `Session` and `EngineSession` have it)."""

    closed: bool
    lock: threading.RLock

    @property
    def parent(self) -> Any:
        """The session it was forked from (None for a thread)."""
        ...

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

    def detach(self, session_id: str) -> None:
        """Become the thread `session_id` (a branch taking its thread's place)."""
        ...


S = TypeVar("S", bound=RegisteredSession)


class SessionRegistry(Generic[S]):
    """Sessions by id, thread-safe; the subclass builds its own kind (`_new_session`).

    Args:
        clock: the clock of the idle bound (`agentkv.sessions.idle_seconds`), in seconds.
    """

    config: AgentKVConfig

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: dict[str, S] = {}
        self._table_lock = threading.Lock()
        self.noop_events = 0
        """Events for unknown or closed sessions, ignored (logged)."""
        self.clock = clock
        self._last_used: dict[str, float] = {}
        self.ended_sessions = 0
        """Sessions closed by the `agentkv.sessions` bounds so far."""
        self._ended_ids: OrderedDict[str, str] = OrderedDict()
        """Recently ended ids → how they ended (`close` on one is a no-op), the last `ENDED_IDS_KEPT`."""

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
                session = existing
            elif not create:
                raise UnknownSessionError(self._unknown(session_id))
            else:
                session = self._new_session(session_id, parent=None, branch=None, config=config)
                self._sessions[session_id] = session
                self._ended_ids.pop(session_id, None)
            self._last_used[session_id] = self.clock()
        self.end_idle_sessions(keep=session_id)
        return session

    def _adopt_branch(self, session_id: str, branch: str, close_parent: Callable[[S, S], None]) -> S:
        """The branch `branch` of thread `session_id` takes the thread's id; the thread session closes.

        The branch's spans are committed and its siblings closed (`BranchSelected` on
        both), then under both locks the table swaps them and `close_parent(parent, child)`
        ends the old thread session.

        Raises:
            UnknownSessionError: no such thread or branch session.
            ValueError: the branch session is not a branch of `session_id`.
        """
        from agentkv.events import BranchSelected

        branch_id = branch_session_id(session_id, branch)
        parent = self.get(session_id)
        child = self.get(branch_id)
        if child.parent is not parent:
            msg = f"session {branch_id!r} is not a branch of {session_id!r}"
            raise ValueError(msg)
        parent.apply(BranchSelected(branch=branch))  # closes the siblings
        child.apply(BranchSelected(branch=branch))  # commits the branch's own spans
        with parent.lock, child.lock:
            with self._table_lock:
                self._sessions.pop(branch_id, None)
                self._sessions[session_id] = child
            child.detach(session_id)
            close_parent(parent, child)
        return child

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
        """Free a session's KV and forget it.

        Closing a session that already ended (closed before, or ended by the
        `agentkv.sessions` bounds while the app still holds its thread id) is a logged
        no-op, so a logout hook can always close its thread.

        Raises:
            UnknownSessionError: no session with this id was ever open (or it ended long
                ago, beyond the last `ENDED_IDS_KEPT` ended ids); the message lists the live ones.
        """
        with self._table_lock:
            session = self._sessions.pop(session_id, None)
            self._last_used.pop(session_id, None)
            ended = self._ended_ids.get(session_id)
            if session is not None:
                self._remember_ended(session_id, "closed")
        if session is None and ended is not None:
            logger.info("close(%r) ignored: the session already ended (%s)", session_id, ended)
            return
        if session is None:
            raise UnknownSessionError(self._unknown(session_id))
        session.close()

    def _remember_ended(self, session_id: str, how: str) -> None:
        """Note an ended id (under the table lock), keeping the last `ENDED_IDS_KEPT`."""
        self._ended_ids[session_id] = how
        self._ended_ids.move_to_end(session_id)
        while len(self._ended_ids) > ENDED_IDS_KEPT:
            self._ended_ids.popitem(last=False)

    def end_idle_sessions(self, keep: str | None = None) -> list[str]:
        """Close the sessions the `agentkv.sessions` bounds end now (idle, or beyond `max_live`).

        Their threads' next calls open new sessions and re-encode the history they send.
        A session busy in a call (its lock held), one with open branches, and `keep`
        are never ended. Runs whenever a session is opened or looked up.

        Returns:
            The ids closed, least recently used first.
        """
        bounds = self.config.sessions
        if not bounds.bounded:
            return []
        with self._table_lock:
            table = dict(self._sessions)
            last_used = dict(self._last_used)
        parents = {s.parent.session_id for s in table.values() if s.parent is not None and not s.closed}
        uses = [  # threads only: a branch lives and ends with its fan-out
            SessionUse(sid, last_used.get(sid, self.clock()), sid != keep and sid not in parents)
            for sid, s in table.items()
            if not s.closed and s.parent is None
        ]
        ended: list[str] = []
        for session_id in sessions_to_end(uses, bounds, self.clock()):
            session = table[session_id]
            if not session.lock.acquire(blocking=False):
                continue  # in a call right now: ended on a later check
            try:
                with self._table_lock:
                    if self._sessions.get(session_id) is not session:
                        continue
                    self._sessions.pop(session_id)
                    self._last_used.pop(session_id, None)
                    self._remember_ended(session_id, "ended by the agentkv.sessions bounds")
                session.close()
            finally:
                session.lock.release()
            ended.append(session_id)
            logger.info("session %r ended by agentkv.sessions bounds; its KV is freed", session_id)
        self.ended_sessions += len(ended)
        return ended

    def apply(self, session_id: str, event: Event) -> Any:
        """Apply an event to a session; an unknown session is a logged no-op (returns None).

        A malformed event raises `TypeError` either way (the session's `apply` checks it).
        """
        with self._table_lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed:
            validate_event(event)
            self.noop_events += 1
            logger.info("event %s for unknown session %r ignored", event.name, session_id)
            return None
        return session.apply(event)
