"""`AgentKVMiddleware`: the KV lifecycle inside `langchain.agents.create_agent`.

An alternative to registering `KVLifecycleCallbackHandler` as a callback, for
agents built with `create_agent(model, tools, middleware=[...])`:

- `wrap_tool_call`: each tool call's outcome becomes `ToolCallCompleted` (or
  `ToolCallFailed` for an error `ToolMessage` or a raised exception; nothing for a
  call paused by `interrupt()`), decided as the handler decides it
  (`agentkv_langchain.outcomes`); like the handler, it is sent once the result is
  encoded, at the next `after_model`;
- `after_model`: pending tool outcomes are sent, and `HumanInTheLoopMiddleware`
  decisions that are visible in the state become `UserConfirmed` / `UserRejected`
  for the message that made the calls (see `AgentKVMiddleware`);
- `after_agent`: `TurnEnded`.

Events go through a `KVLifecycleCallbackHandler` (its `send`), so `handler.events`
records them, the same session choice applies (`thread_id`, `agentkv_branch`) and
errors are logged and counted instead of raised unless `raise_error` is set. Using
both this middleware and the handler as a callback is harmless: events are idempotent.

Needs LangChain's agents: `pip install 'agentkv-lifecycle[agents]'`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

try:
    from langchain.agents.middleware import AgentMiddleware
    from langchain.agents.middleware.types import AgentState, ToolCallRequest
except ImportError as e:  # pragma: no cover - depends on the installed extras
    msg = (
        "AgentKVMiddleware needs LangChain's agents (langchain>=1.5); "
        f"install them with: pip install 'agentkv-lifecycle[agents]' ({e})"
    )
    raise ImportError(msg) from e
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langgraph.config import get_config
from langgraph.runtime import Runtime
from langgraph.types import Command

from agentkv import Backend, Event, TurnEnded, UserConfirmed, UserRejected
from agentkv_langchain.backends import ConfigLike, resolve_config, shared_backend
from agentkv_langchain.callbacks import KVLifecycleCallbackHandler
from agentkv_langchain.outcomes import tool_event
from agentkv_langchain.sessions import THREAD_KEY, SessionKey

__all__ = ["HITL_SOURCE", "AgentKVMiddleware"]

HITL_SOURCE = "hitl_interrupt_decision"
"""`additional_kwargs["lc_source"]` of the `ToolMessage` the HITL middleware writes on reject / respond."""
_HITL_EDITS = "hitl_edited_tool_calls"
"""State key where HumanInTheLoopMiddleware keeps the reviewer's edits, by tool call id."""


class AgentKVMiddleware(AgentMiddleware):
    """Lifecycle events from a `create_agent` agent's hooks.

    List it **before** `HumanInTheLoopMiddleware` (`middleware=[kv, hitl]`): `after_model`
    hooks run in reverse order, so it then sees the state after the human's decisions.
    A reviewed call's decision reads from the state: "reject" and "respond" leave a
    `ToolMessage` marked by the HITL middleware, "edit" a record of the edit; an
    "approve" leaves no trace, so it is inferred for the calls `hitl` gates (pass the
    HITL middleware). The message that made the calls is confirmed when any of its
    reviewed calls was approved, edited or answered, rejected when all were rejected.
    For exact decisions, also attach the handler as a callback: it reads the resume
    value itself.

    Args:
        backend: The backend the agent's `ChatAgentKV` uses; None = the process-wide
            `shared_backend(config)`, the one `ChatAgentKV()` without a backend uses.
        handler: Where events go (and are recorded); None = a new one for `backend`.
        config: Settings (`callbacks.raise_error`), in any form `shared_backend` reads (an
            `AgentKVConfig`, a YAML-shaped mapping, a graph YAML path); None = the backend's.
        hitl: The agent's `HumanInTheLoopMiddleware`, to recognise approvals.
        session_id: A fixed session, as in `ChatAgentKV(session_id=...)`.
    """

    def __init__(
        self,
        backend: Backend | None = None,
        *,
        handler: KVLifecycleCallbackHandler | None = None,
        config: ConfigLike = None,
        hitl: Any = None,
        session_id: str | None = None,
    ) -> None:
        super().__init__()
        if handler is None:
            settings = resolve_config(config)
            if backend is None:
                backend = shared_backend(settings)
            handler = KVLifecycleCallbackHandler(backend, config=settings, session_id=session_id)
        self.handler = handler
        self.session_id = session_id
        self.hitl = hitl

    # -- hooks -----------------------------------------------------------------------------------

    def wrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        """Run the tool; remember its outcome for the session (sent after the next model call)."""
        session_id = self._session_id(getattr(request.runtime, "config", None))
        try:
            result = handler(request)
        except Exception as e:
            self._outcome(session_id, request.tool_call, None, e)
            raise
        self._outcome(session_id, request.tool_call, result, None)
        return result

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        """Async `wrap_tool_call`."""
        session_id = self._session_id(getattr(request.runtime, "config", None))
        try:
            result = await handler(request)
        except Exception as e:
            self._outcome(session_id, request.tool_call, None, e)
            raise
        self._outcome(session_id, request.tool_call, result, None)
        return result

    def after_model(self, state: AgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Send the tool outcomes whose results the model just read, and the human's decisions."""
        self._guard(self._after_model, state)
        return None

    async def aafter_model(self, state: AgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Async `after_model`."""
        return self.after_model(state, runtime)

    def after_agent(self, state: AgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """The agent answered: end the turn."""
        self._guard(self._after_agent)
        return None

    async def aafter_agent(self, state: AgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Async `after_agent`."""
        return self.after_agent(state, runtime)

    # -- internals ---------------------------------------------------------------------------------

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Hints never break the agent: errors are the handler's to log, count or raise."""
        try:
            fn(*args)
        except Exception as e:
            self.handler.report_failure(getattr(fn, "__name__", "middleware"), e)

    def _session_id(self, config: Mapping[str, Any] | None = None) -> str:
        if config is None:
            try:
                config = get_config()
            except RuntimeError:
                config = {}
        metadata = dict(config.get("metadata") or {})
        thread = (config.get("configurable") or {}).get(THREAD_KEY)
        if THREAD_KEY not in metadata and thread is not None:
            metadata[THREAD_KEY] = thread
        # These hooks run in nodes and tool tasks, not in model calls: a tool's `Send` task is
        # not a branch (its result is read by the thread's next model call).
        key = SessionKey.from_metadata(metadata, self.session_id, send_forks=False)
        return key.session_id

    def _outcome(
        self, session_id: str, call: Mapping[str, Any], result: Any, error: BaseException | None
    ) -> None:
        """Hold a tool call's outcome (`outcomes.tool_event`; none for a call paused by an interrupt)."""

        def record() -> None:
            call_id = str(call.get("id") or "")
            event = tool_event(call_id, result, error) if call_id else None
            if event is not None:
                self.handler.defer(session_id, event)

        self._guard(record)

    def _after_model(self, state: Mapping[str, Any]) -> None:
        session_id = self._session_id()
        self.handler.flush(session_id)
        for event in self._decisions(state):
            self.handler.send(session_id, event)

    def _after_agent(self) -> None:
        session_id = self._session_id()
        self.handler.flush(session_id)
        self.handler.send(session_id, TurnEnded())

    def _decisions(self, state: Mapping[str, Any]) -> list[Event]:
        """The human's decisions on the latest message's calls, as far as the state shows them."""
        messages: Sequence[AnyMessage] = state.get("messages") or []
        answers = [(i, m) for i, m in enumerate(messages) if isinstance(m, AIMessage)]
        if not answers or not answers[-1][1].tool_calls:
            return []
        index, ai = answers[-1]
        marked: dict[str, str] = {}
        for message in messages[index + 1 :]:
            kwargs = getattr(message, "additional_kwargs", {}) or {}
            if isinstance(message, ToolMessage) and kwargs.get("lc_source") == HITL_SOURCE:
                marked[message.tool_call_id] = str((kwargs.get("lc_data") or {}).get("decision", ""))
        edited = set((state.get(_HITL_EDITS) or {}).keys())
        gated = set(getattr(self.hitl, "interrupt_on", {}) or {})
        decisions: list[str] = []
        for call in ai.tool_calls:
            call_id = str(call.get("id") or "")
            if call_id in marked:
                decisions.append(marked[call_id])
            elif call_id in edited:
                decisions.append("edit")
            elif call["name"] in gated:
                decisions.append("approve")
        if not decisions:
            return []
        if all(d == "reject" for d in decisions):
            return [UserRejected(owner=ai.id)]
        return [UserConfirmed(owner=ai.id)]
