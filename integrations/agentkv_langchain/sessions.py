"""Which agentkv session a LangChain model call belongs to.

A session is one conversation's KV cache, so the choice decides what can be reused.
LangGraph copies the run's `configurable.thread_id` into the callback metadata of
every call made inside a graph; outside a graph, pass it yourself with
`config={"metadata": {"thread_id": ...}}`. A parallel branch (a `Send` task, a
tree-of-thought candidate) must not share its parent's session, or the branches
would overwrite each other's history: a model call made inside a LangGraph `Send`
task (its metadata carries `langgraph_triggers` with `__pregel_push` and
`langgraph_checkpoint_ns == "<node>:<task_id>"`) runs on a fork of the thread's
session named by the task id, which shares the thread's KV prefix without copying
it. `metadata["agentkv_branch"]` (`agentkv_langgraph.branch_config`) names the
branch explicitly instead.

Every entry point resolves the thread the same way (`call_metadata`): the call's
own config (`config["metadata"]`, then `config["configurable"]["thread_id"]`), or,
for a call made without one inside a run (a LangGraph node calling `llm.invoke(...)`
or `llm.stream(...)`), LangChain's context-local runnable config
(`ensure_config()`), then the callback metadata of the model run. langchain-core
does not hand `_stream` a run manager, so the callback metadata alone is not
enough: `ChatAgentKV` captures the config at `invoke` / `ainvoke` / `stream` /
`astream` and keeps it in `CALL_METADATA` while the call picks its session.

To route calls differently, extend `SessionKey.from_metadata` (what identifies a
session) or `open_session` (how a key becomes a session); `session_for` composes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from threading import Lock
from typing import Any

from langchain_core.runnables import RunnableConfig, ensure_config

from agentkv import AgentKVConfig, AnySession, Backend
from agentkv.session_ids import branch_session_id

logger = logging.getLogger("agentkv.langchain")

__all__ = [
    "BRANCH_KEY",
    "CALL_METADATA",
    "DEFAULT_THREAD",
    "PUSH_TRIGGER",
    "THREAD_KEY",
    "SessionKey",
    "call_metadata",
    "calling",
    "current_metadata",
    "is_send_task",
    "open_session",
    "send_task_id",
    "session_for",
]

THREAD_KEY = "thread_id"
"""Metadata key of the conversation id (LangGraph sets it from `configurable.thread_id`)."""
BRANCH_KEY = "agentkv_branch"
"""Metadata key of a branch id; set by the LangGraph helper for calls inside a branch."""
DEFAULT_THREAD = "default"
"""The session used when a call names no thread."""
PUSH_TRIGGER = "__pregel_push"
"""The trigger LangGraph gives a `Send` task (`langgraph.pregel._algo.PUSH_TRIGGER`)."""
_NS_SEP = "|"
"""Separator of nested checkpoint namespaces (a subgraph's tasks: `outer:<id>|inner:<id>`)."""


def is_send_task(metadata: Mapping[str, Any] | None) -> bool:
    """Whether run metadata belongs to a LangGraph `Send` task."""
    triggers = (metadata or {}).get("langgraph_triggers") or ()
    return not isinstance(triggers, str) and PUSH_TRIGGER in tuple(triggers)


def send_task_id(metadata: Mapping[str, Any] | None) -> str | None:
    """The task id of a `Send` task's run (from its checkpoint namespace), else None."""
    if not is_send_task(metadata):
        return None
    namespace = str((metadata or {}).get("langgraph_checkpoint_ns") or "")
    _, _, task_id = namespace.rsplit(_NS_SEP, 1)[-1].partition(":")
    return task_id or None


CALL_METADATA: ContextVar[Mapping[str, Any] | None] = ContextVar("agentkv_call_metadata", default=None)
"""The metadata of the model call being started (set by `ChatAgentKV`'s entry points, see `calling`)."""


def call_metadata(config: RunnableConfig | None = None) -> dict[str, Any]:
    """The metadata that picks a call's session, read from its config.

    Args:
        config: The config the call was given; None = the context-local runnable
            config of the run the call is made in (a LangGraph node's), if any.

    Returns:
        `config["metadata"]`, with `thread_id` taken from `config["configurable"]`
        when the metadata has none.
    """
    resolved = ensure_config(config)
    metadata = dict(resolved.get("metadata") or {})
    thread = (resolved.get("configurable") or {}).get(THREAD_KEY)
    if not metadata.get(THREAD_KEY) and thread:
        metadata[THREAD_KEY] = thread
    return metadata


def current_metadata(own: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A model run's metadata completed with the call's (or the current run's) config.

    Args:
        own: The run's callback metadata (`run_manager.metadata`, a start callback's
            `metadata`); its keys win.
    """
    base = CALL_METADATA.get()
    merged = dict(base if base is not None else call_metadata(None))
    merged.update(own or {})
    if not merged.get(THREAD_KEY) and base is not None and base.get(THREAD_KEY):
        merged[THREAD_KEY] = base[THREAD_KEY]
    return merged


@contextmanager
def calling(config: RunnableConfig | None) -> Iterator[None]:
    """Mark a model call in progress with its config's metadata (see `CALL_METADATA`)."""
    token = CALL_METADATA.set(call_metadata(config))
    try:
        yield
    finally:
        CALL_METADATA.reset(token)


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
    def from_metadata(
        cls, metadata: Mapping[str, Any] | None, fixed: str | None = None, *, send_forks: bool = True
    ) -> SessionKey:
        """Read the key from a run's metadata.

        Args:
            metadata: the callback metadata of the model call (`run_manager.metadata`).
            fixed: a session id that overrides the thread from the metadata
                (`ChatAgentKV(session_id=...)`); branches still fork from it.
            send_forks: a model call inside a `Send` task gets the task's branch. False
                for runs that encode nothing themselves (a tool run in a `Send` task,
                as `create_agent` runs tools): their results are read by the thread.
        """
        metadata = metadata or {}
        thread = fixed or metadata.get(THREAD_KEY) or DEFAULT_THREAD
        branch = metadata.get(BRANCH_KEY) or (send_task_id(metadata) if send_forks else None)
        return cls(thread=str(thread), branch=str(branch) if branch else None)


def open_session(backend: Backend, key: SessionKey, config: AgentKVConfig | None = None) -> AnySession:
    """The session for `key`: the thread's own, or a fork of it for a branch (both created on first use).

    `config` is the settings a thread session gets when it is created here (None = the
    backend's); a branch keeps its thread's.
    """
    session = backend.session(key.thread, config=config)
    if config is not None and session.config != config:
        _warn_kept_settings(session.session_id)
    if key.branch is None:
        return session
    return backend.fork(key.thread, key.branch)


_warned: set[str] = set()
_warned_lock = Lock()


def _warn_kept_settings(session_id: str) -> None:
    """Say once per session that it keeps the settings it was created with (never silently)."""
    with _warned_lock:
        if session_id in _warned:
            return
        _warned.add(session_id)
    logger.warning(
        "session %r already exists with other agentkv settings than this ChatAgentKV(config=...); it "
        "keeps them: settings apply when a session is created. Use a new thread_id, or close it first "
        "(backend.close(%r))",
        session_id,
        session_id,
    )


def session_for(
    backend: Backend,
    metadata: Mapping[str, Any] | None,
    fixed: str | None = None,
    config: AgentKVConfig | None = None,
) -> AnySession:
    """The session a model call with this run metadata uses (see the module docstring)."""
    return open_session(backend, SessionKey.from_metadata(metadata, fixed), config)
