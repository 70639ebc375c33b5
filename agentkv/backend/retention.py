"""Which sessions a backend ends: a most-sessions limit and an idle time (`agentkv.sessions`).

Sessions are never ended by the conversation itself (a LangGraph thread has no
end), so without a bound every thread ever seen keeps its KV. Ending a session
frees its KV only: the thread's next call opens a new session and re-encodes the
history it sends. The choice is a pure function of the table's use times, so it is
tested without a model; the backend applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentkv.config import SessionsConfig


@dataclass(frozen=True)
class SessionUse:
    """One live session as the bound sees it."""

    session_id: str
    last_used: float
    """Clock reading of its last use (`TransformersBackend` uses `time.monotonic`)."""
    endable: bool
    """False for the session being opened and a thread with open branches: never ended now."""


def sessions_to_end(uses: Sequence[SessionUse], bounds: SessionsConfig, now: float) -> list[str]:
    """The ids to close now: the idle ones, then the least recently used beyond `max_live`.

    Args:
        uses: The live sessions.
        bounds: The `agentkv.sessions` settings.
        now: The current clock reading (same clock as `last_used`).

    Returns:
        Session ids, least recently used first; only endable sessions.
    """
    ending: list[str] = []
    if bounds.idle_seconds is not None:
        ending += [u.session_id for u in uses if u.endable and now - u.last_used >= bounds.idle_seconds]
    if bounds.max_live is not None:
        live = [u for u in uses if u.session_id not in ending]
        excess = len(live) - bounds.max_live
        oldest = sorted((u for u in live if u.endable), key=lambda u: u.last_used)
        ending += [u.session_id for u in oldest[: max(excess, 0)]]
    return ending
