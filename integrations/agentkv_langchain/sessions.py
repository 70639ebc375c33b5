"""Which agentkv session a LangChain model call belongs to.

A session is one conversation's KV cache, so the choice decides what can be reused.
LangGraph copies the run's `configurable.thread_id` into the callback metadata of
every call made inside a graph; outside a graph, pass it yourself with
`config={"metadata": {"thread_id": ...}}`. A parallel branch (a `Send` task, a
tree-of-thought candidate) must not share its parent's session, or the branches
would overwrite each other's history; the LangGraph helper marks such calls with
`metadata["agentkv_branch"]`, and they get a fork of the thread's session that
shares its KV prefix without copying it.

To route calls differently, extend `SessionKey.from_metadata` (what identifies a
session) or `open_session` (how a key becomes a session); `session_for` composes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv import Session, TransformersBackend
from agentkv.session_ids import branch_session_id

__all__ = ["BRANCH_KEY", "DEFAULT_THREAD", "THREAD_KEY", "SessionKey", "open_session", "session_for"]

THREAD_KEY = "thread_id"
"""Metadata key of the conversation id (LangGraph sets it from `configurable.thread_id`)."""
BRANCH_KEY = "agentkv_branch"
"""Metadata key of a branch id; set by the LangGraph helper for calls inside a branch."""
DEFAULT_THREAD = "default"
"""The session used when a call names no thread."""


@dataclass(frozen=True)
class SessionKey:
    """What identifies a session: the conversation, and the branch inside it (if any)."""

    thread: str
    branch: str | None = None

    @property
    def session_id(self) -> str:
        """The backend session id: `<thread>/<branch>`, or the thread's own."""
        return branch_session_id(self.thread, self.branch)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any] | None, fixed: str | None = None) -> SessionKey:
        """Read the key from a run's metadata.

        Args:
            metadata: the callback metadata of the model call (`run_manager.metadata`).
            fixed: a session id that overrides the thread from the metadata
                (`ChatAgentKV(session_id=...)`); branches still fork from it.
        """
        metadata = metadata or {}
        thread = fixed or metadata.get(THREAD_KEY) or DEFAULT_THREAD
        branch = metadata.get(BRANCH_KEY)
        return cls(thread=str(thread), branch=str(branch) if branch else None)


def open_session(backend: TransformersBackend, key: SessionKey) -> Session:
    """The session for `key`: the thread's own, or a fork of it for a branch (both created on first use)."""
    session = backend.session(key.thread)
    if key.branch is None:
        return session
    return backend.fork(key.thread, key.branch)


def session_for(
    backend: TransformersBackend, metadata: Mapping[str, Any] | None, fixed: str | None = None
) -> Session:
    """The session a model call with this run metadata uses (see the module docstring)."""
    return open_session(backend, SessionKey.from_metadata(metadata, fixed))
