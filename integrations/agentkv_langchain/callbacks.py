"""`KVLifecycleCallbackHandler`: LangChain / LangGraph runs become agentkv lifecycle events.

The agent framework already knows the moments that matter to a KV cache — a tool
returned, a turn ended, the user approved a plan, a branch lost — and reports them
as callbacks. This handler translates each into an `agentkv.events` event and
applies it with `backend.apply(session_id, event)`; it never touches the cache
itself (the rules table decides what an event does).

| callback | event |
|---|---|
| `on_tool_end` (its `ToolMessage`, or the call id seen at start) | `ToolCallCompleted` |
| `on_tool_end` with a `ToolMessage(status="error")`, `on_tool_error` | `ToolCallFailed` |
| `on_chain_end` of a top-level run that was not interrupted | `TurnEnded` |
| LangGraph `Command(resume=...)`, then `on_resume` | `UserConfirmed` / `UserRejected` |
| custom events `agentkv.*` (see `agentkv_langchain.helpers`) | the matching event |
| the first call inside a branch | `BranchOpened` on the parent session |

How a resume value reads as confirm or reject: `resume_decision`.

A tool's outcome is sent when its result is in the cache, not when the tool
returns: `ChatAgentKV` encodes a `ToolMessage` only at the next model call, and an
event that names a span the session does not hold yet would miss it (a failed
call's error output would then be committed with the turn). So `ToolCallCompleted`
/ `ToolCallFailed` wait for the end of the session's next model call (which also
means the result is compressed with the attention of the answer that read it), or
for the end of the top-level run, whichever comes first; `flush()` sends them now.

Which session an event goes to is decided exactly as `ChatAgentKV` decides it, with
`agentkv_langchain.sessions.SessionKey.from_metadata`: start events carry the run
metadata (`thread_id`, `agentkv_branch`, LangGraph's `langgraph_*` keys), end and
error events do not, so a `run_id → context` map is filled at start and children
inherit their parent's context. Parallel branches call the handler from worker
threads: one lock guards the map.

Hints never break a run: by default every exception inside the handler is logged
(logger `agentkv.callbacks`), counted in `errors` and swallowed; with
`raise_error=True` (or `callbacks.raise_error: true` in the config) it propagates.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, ToolMessage

from agentkv import (
    AgentKVConfig,
    Backend,
    BranchPruned,
    BranchSelected,
    Custom,
    Event,
    Lease,
    ToolCallCompleted,
    ToolCallFailed,
    TurnEnded,
    UserConfirmed,
    UserRejected,
)
from agentkv.session_ids import is_branch_of
from agentkv_langchain.decisions import (
    CONFIRM_EVENT,
    CUSTOM_EVENTS,
    GENERIC_EVENT,
    OWNER_KEY,
    PIN_EVENT,
    PRUNE_BRANCH_EVENT,
    REJECT_EVENT,
    SELECT_BRANCH_EVENT,
    ToolCallRecord,
    answered_interrupts,
    custom_event_from,
    decision_events,
    resume_decision,
)
from agentkv_langchain.fanout import BranchSelector
from agentkv_langchain.replays import NodeReplays
from agentkv_langchain.runs import (
    RunContext,
    RunTracking,
    graph_step,
    is_bubble_up,
    is_resume_command,
)
from agentkv_langchain.sessions import THREAD_KEY, SessionKey

if TYPE_CHECKING:
    # LangGraph delivers `on_interrupt` / `on_resume` only to `GraphCallbackHandler`s;
    # without LangGraph installed there are no interrupts, and the plain base suffices.
    _HandlerBase = BaseCallbackHandler
else:
    try:
        from langgraph.callbacks import GraphCallbackHandler as _HandlerBase
    except ImportError:  # pragma: no cover - langgraph is an optional extra
        _HandlerBase = BaseCallbackHandler

__all__ = [
    "CONFIRM_EVENT",
    "CUSTOM_EVENTS",
    "GENERIC_EVENT",
    "OWNER_KEY",
    "PIN_EVENT",
    "PRUNE_BRANCH_EVENT",
    "REJECT_EVENT",
    "SELECT_BRANCH_EVENT",
    "KVLifecycleCallbackHandler",
    "resume_decision",
]

logger = logging.getLogger("agentkv.callbacks")

_REPORTED = "_agentkv_reported"
"""Marks an exception already counted, so an outer guard does not count it again."""

P = ParamSpec("P")
R = TypeVar("R")
H = TypeVar("H", bound="KVLifecycleCallbackHandler")


def _guarded(method: Callable[Concatenate[H, P], R]) -> Callable[Concatenate[H, P], R | None]:
    """Catch, log and count errors in a callback; re-raise only when the handler says so."""

    @functools.wraps(method)
    def wrapper(self: H, *args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            if getattr(e, _REPORTED, False):  # counted where it happened; raise_error lets it through
                raise
            self.report_failure(method.__name__, e)
            return None

    return wrapper


class KVLifecycleCallbackHandler(RunTracking, _HandlerBase):
    """Turns agent runs into lifecycle events on a `TransformersBackend`'s sessions.

    Register it like any LangChain callback (`config={"callbacks": [handler]}`), or
    let `agentkv_langgraph.with_kv_lifecycle` attach it to a compiled graph.

    Args:
        backend: The backend whose sessions `ChatAgentKV` uses.
        config: Where `callbacks.raise_error` is read; None = the backend's config.
        raise_error: Overrides `config.callbacks.raise_error`: True lets handler errors
            stop the run (tests, debugging); False logs and counts them.
        session_id: A fixed session, for a `ChatAgentKV(session_id=...)`; None = from
            the run metadata, as the chat model does.
        end_turn_on_root: Send `TurnEnded` when a top-level chain ends (a graph
            invocation, or the runnable wrapping one agent turn). Turn it off when a
            top-level chain is smaller than a turn and call `end_turn` yourself.
        adopt_branches: When the thread's next model call after a fan-out continues
            with a branch's own messages, adopt that branch's session as the thread's
            (its KV is not re-encoded); False = prune every branch at that call.
        branch_selector: `(thread, open branch ids) -> id | None`, asked when a run
            ends with branches nobody selected: the branch it names is kept for the
            next run to adopt, the others are pruned. None = prune them all.

    Fan-outs settle by themselves (see `agentkv_langchain.fanout`): at the thread's
    first model call after the fan-out step, the branch it continues is adopted and
    the others get `BranchPruned`; when the run ends, branches still open are pruned
    unless selected (`select_branch`, or `branch_selector`).
    """

    run_inline = True
    """Called on the event loop's thread in async runs, so start/end order is kept."""

    def __init__(
        self,
        backend: Backend,
        *,
        config: AgentKVConfig | None = None,
        raise_error: bool | None = None,
        session_id: str | None = None,
        end_turn_on_root: bool = True,
        adopt_branches: bool = True,
        branch_selector: BranchSelector | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.config = config or backend.config
        self.raise_error = self.config.callbacks.raise_error if raise_error is None else raise_error
        self.session_id = session_id
        self.end_turn_on_root = end_turn_on_root
        self.adopt_branches = adopt_branches
        self.branch_selector = branch_selector
        self.adopted: list[tuple[str, str]] = []
        """`(thread, branch)` of every branch adopted as its thread's continuation, in order."""
        self.events: list[tuple[str, Event]] = []
        """Every event sent, in order, as `(session_id, event)`, duplicates included (sessions skip them)."""
        self.leases: dict[tuple[str, str], Lease] = {}
        """Pins made by `agentkv.pin` events, by `(session_id, owner)`; give them back with `release`."""
        self.errors = 0
        """Exceptions caught inside callbacks (each one logged)."""
        self._lock = threading.RLock()
        self._runs: dict[UUID, RunContext] = {}
        self._interrupts: dict[str, dict[str, Any]] = {}
        """Per thread: pending interrupt id → its value (what a resume answers)."""
        self._tool_calls: dict[str, list[ToolCallRecord]] = {}
        """Per session: the calls of the latest assistant message that made any (HITL matches them)."""
        self._branches: dict[tuple[str, str], int | None] = {}
        """Open branches `(thread, branch)` → the graph step that opened them (settled ones leave)."""
        self._selected: set[tuple[str, str]] = set()
        """Open branches a `select_branch` (or the selector) kept: adopted or pruned at the next call."""
        self._pending: dict[str, list[Event]] = {}
        """Per session: tool outcomes waiting for the result to be encoded."""
        self._failed_inputs: set[tuple[str, str]] = set()
        """`(session, tool_call_id)` of error results already reported (from a tool run or an input)."""
        self.replays = NodeReplays()
        """Answers per graph task; decisions held for a node that asks the model again on resume."""

    # -- public helpers --------------------------------------------------------------------------

    def send(self, session_id: str, event: Event) -> Any:
        """Record and apply one event (what every callback ends in); returns the `ApplyResult` or None."""
        with self._lock:
            self.events.append((session_id, event))
        logger.debug("session %s <- %r", session_id, event)
        return self.backend.apply(session_id, event)

    def flush(self, session_id: str | None = None, *, thread: str | None = None) -> None:
        """Send the tool outcomes still waiting for their results to be encoded (see the module doc).

        Args:
            session_id: Only this session's; None = every session's (or `thread`'s).
            thread: Only the sessions of this thread (its own and its branches').
        """
        with self._lock:
            if session_id is not None:
                wanted = [session_id] if session_id in self._pending else []
            elif thread is not None:
                wanted = [s for s in self._pending if s == thread or is_branch_of(s, thread)]
            else:
                wanted = list(self._pending)
            batches = [(sid, self._pending.pop(sid)) for sid in wanted]
        for sid, events in batches:
            for event in events:
                self._emit(sid, event)

    def end_turn(self, thread_id: str | None = None) -> Any:
        """Send `TurnEnded` to a thread's session yourself (see `end_turn_on_root`)."""
        return self.send(self._thread(thread_id), TurnEnded())

    def release(self, session_id: str, owner: str) -> bool:
        """Give back a pin made by an `agentkv.pin` event; False when there was none."""
        with self._lock:
            lease = self.leases.pop((session_id, owner), None)
        if lease is None or session_id not in self.backend:
            return False
        return self.backend.get(session_id).release(lease)

    def events_for(self, session_id: str) -> list[Event]:
        """The events sent to one session, in order."""
        with self._lock:
            return [event for sid, event in self.events if sid == session_id]

    # -- runs: starts fill the context map, ends use it -------------------------------------------

    @_guarded
    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Remember the run; a top-level `Command(resume=...)` is held until LangGraph confirms the resume."""
        context = self._enter(run_id, parent_run_id, metadata)
        if parent_run_id is None and is_resume_command(inputs):
            with self._lock:
                context.resume[:] = [inputs.resume]

    @_guarded
    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: list[list[Any]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Remember the model call; an error `ToolMessage` in its input becomes `ToolCallFailed`.

        A tool that ran outside this handler's view (a result written by hand, another
        agent's tool node) reports its failure only as `ToolMessage(status="error")` in
        the history; the event waits for the end of this call, when the result is encoded.
        """
        context = self._enter(run_id, parent_run_id, metadata, model=True)
        if context.branch is None and messages:
            self._settle(context.thread, step=graph_step(metadata), messages=messages[0])
        for batch in messages or []:
            for message in batch or []:
                if not (isinstance(message, ToolMessage) and message.status == "error"):
                    continue
                key = (context.session_id, message.tool_call_id)
                with self._lock:
                    if key in self._failed_inputs:
                        continue
                    self._failed_inputs.add(key)
                self.defer(
                    context.session_id,
                    ToolCallFailed(tool_call_id=message.tool_call_id, error=_text(message.content)),
                )

    @_guarded
    def on_llm_start(
        self,
        serialized: dict[str, Any] | None,
        prompts: list[str],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Remember a completion-model call (same as a chat model's)."""
        self._enter(run_id, parent_run_id, metadata, model=True)

    @_guarded
    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """Record which message holds which tool call (human review names calls, events name messages)."""
        context = self._exit(run_id)
        if context is None:
            return
        due: list[Event] = []
        for generations in getattr(response, "generations", None) or []:
            for generation in generations:
                message = getattr(generation, "message", None)
                if isinstance(message, AIMessage) and message.id and context.checkpoint_ns:
                    due += self.replays.answered(context.session_id, context.checkpoint_ns, message.id)
                if isinstance(message, AIMessage) and message.tool_calls:
                    records = [
                        ToolCallRecord(
                            str(call.get("id") or ""), call["name"], call.get("args") or {}, message.id
                        )
                        for call in message.tool_calls
                    ]
                    with self._lock:
                        self._tool_calls[context.session_id] = records
        self.flush(context.session_id)
        for event in due:  # a decision about this answer's first version, made before the node re-ran
            self._emit(context.session_id, event)

    @_guarded
    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """Forget the model call."""
        self._exit(run_id)

    @_guarded
    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Remember the tool run and its `tool_call_id` (the end may report a bare string)."""
        context = self._enter(run_id, parent_run_id, metadata)
        call_id = kwargs.get("tool_call_id")
        if not call_id and isinstance(inputs, Mapping):
            call_id = inputs.get("tool_call_id")
        context.tool_call_id = str(call_id) if call_id else None

    @_guarded
    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """A tool returned: commit its result, release the call (or release both when it reports an error)."""
        context = self._exit(run_id)
        message = _tool_message(output, context.tool_call_id if context else None)
        call_id = message.tool_call_id if message is not None else context.tool_call_id if context else None
        if not call_id or context is None:
            logger.debug("tool run %s has no tool_call_id: no span names its result", run_id)
            return
        session_id = self._session_of_call(call_id) or context.session_id
        if message is not None and message.status == "error":
            with self._lock:
                self._failed_inputs.add((session_id, call_id))
            self.defer(session_id, ToolCallFailed(tool_call_id=call_id, error=_text(message.content)))
        else:
            self.defer(session_id, ToolCallCompleted(tool_call_id=call_id))

    @_guarded
    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """A tool raised: release the call and its output; an interrupt raised inside a tool is a pause."""
        context = self._exit(run_id)
        if context is None:
            return
        if is_bubble_up(error):
            self._mark_interrupted(context.root)
            return
        if context.tool_call_id:
            error_event = ToolCallFailed(tool_call_id=context.tool_call_id, error=repr(error))
            session_id = self._session_of_call(context.tool_call_id) or context.session_id
            with self._lock:  # the error ToolMessage made of it is the same failure
                self._failed_inputs.add((session_id, context.tool_call_id))
            self.defer(session_id, error_event)

    @_guarded
    def on_chain_end(
        self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        """The end of a top-level run ends the turn, unless the run stopped at an interrupt."""
        context = self._exit(run_id)
        if parent_run_id is not None or context is None:
            return
        self._forget_root(run_id)
        self.flush(thread=context.thread)
        interrupted = context.interrupted or (isinstance(outputs, Mapping) and "__interrupt__" in outputs)
        for event in self.replays.finish(context.session_id, interrupted=interrupted):
            self._emit(context.session_id, event)
        if interrupted:
            logger.debug("run %s paused at an interrupt: the turn goes on", run_id)
            return
        if context.branch is None:  # a run that is itself a branch settles nothing
            self._settle(context.thread, at_end=True)
        if self.end_turn_on_root:
            self._emit(context.session_id, TurnEnded())

    @_guarded
    def on_chain_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        """A failed run changes nothing (the next user turn ends it); an interrupt marks the turn paused."""
        context = self._exit(run_id)
        if context is not None and is_bubble_up(error):
            self._mark_interrupted(context.root)
            if context.checkpoint_ns:
                self.replays.paused(context.session_id, context.checkpoint_ns)
        if parent_run_id is None:
            self._forget_root(run_id)
            if context is not None:
                self.flush(thread=context.thread)
                paused = context.interrupted or is_bubble_up(error)
                for event in self.replays.finish(context.session_id, interrupted=paused):
                    self._emit(context.session_id, event)
                if context.branch is None and not (context.interrupted or is_bubble_up(error)):
                    self._settle(context.thread, at_end=True)

    # -- LangGraph: interrupt and resume -------------------------------------------------------

    @_guarded
    def on_interrupt(self, event: Any) -> None:
        """LangGraph paused: remember the interrupts (their values say what a resume answers)."""
        context = self._context(getattr(event, "run_id", None))
        if context is None:
            return
        self._mark_interrupted(context.root)
        with self._lock:
            pending = self._interrupts.setdefault(context.thread, {})
            for item in getattr(event, "interrupts", ()) or ():
                pending[str(getattr(item, "id", len(pending)))] = getattr(item, "value", None)

    @_guarded
    def on_resume(self, event: Any) -> None:
        """LangGraph resumed from a checkpoint: the held `Command(resume=...)` becomes confirm/reject."""
        context = self._context(getattr(event, "run_id", None))
        if context is None:
            return
        with self._lock:
            root = self._runs.get(context.root, context)
            if not root.resume:
                return
            resume = root.resume.pop()
            pending = self._interrupts.get(context.thread, {})
            answered = answered_interrupts(resume, pending)
            for interrupt_id, _, _ in answered:
                pending.pop(interrupt_id, None)
            session_id = root.session_id
            records = list(self._tool_calls.get(session_id, ()))
        # A decision about an answer the resumed node makes again waits for that new answer.
        for event_ in self.replays.resumed(session_id, decision_events(answered, records)):
            self._emit(session_id, event_)

    # -- custom events ---------------------------------------------------------------------------

    @_guarded
    def on_custom_event(
        self,
        name: str,
        data: Any,
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """`agentkv.*` events dispatched by `agentkv_langchain.helpers` (or by hand)."""
        if name not in CUSTOM_EVENTS:
            return
        context = self._context(run_id) or self._context_from(run_id, None, metadata)
        data = data if data is not None else {}
        if name == GENERIC_EVENT:
            self._emit(context.session_id, custom_event_from(data))
            return
        if not isinstance(data, Mapping):
            msg = f"{name}: data must be a mapping, got {type(data).__name__}"
            raise TypeError(msg)
        owner = data.get("owner")
        owner = str(owner) if owner is not None else None
        if name == CONFIRM_EVENT:
            self._emit(context.session_id, UserConfirmed(owner=owner))
        elif name == REJECT_EVENT:
            self._emit(context.session_id, UserRejected(owner=owner))
        elif name == PIN_EVENT:
            self._pin(context.session_id, owner)
        else:
            branch = data.get("branch")
            if not isinstance(branch, str) or not branch:
                msg = f"{name}: data['branch'] must be a non-empty string, got {branch!r}"
                raise ValueError(msg)
            event = (
                BranchPruned(branch=branch) if name == PRUNE_BRANCH_EVENT else BranchSelected(branch=branch)
            )
            # A branch is settled by its parent, whichever run (a judge node, the branch itself) says so.
            self._emit(context.thread, event)
            pruned = name == PRUNE_BRANCH_EVENT
            with self._lock:  # settled branches need no more BranchOpened bookkeeping
                for t, b in list(self._branches):
                    if t == context.thread and (b == branch if pruned else b != branch):
                        del self._branches[(t, b)]
                        self._selected.discard((t, b))
                if not pruned:
                    self._selected.add((context.thread, branch))

    # -- internals ---------------------------------------------------------------------------------

    def _emit(self, session_id: str, event: Event) -> None:
        """`send` from inside a callback: one failing event is logged and counted, the others still go."""
        try:
            self.send(session_id, event)
        except Exception as e:
            self.report_failure(f"{event.name} for session {session_id!r}", e)

    def defer(self, session_id: str, event: Event) -> None:
        """Queue an event for the session, sent when the session's model run ends (not mid-forward)."""
        with self._lock:
            self._pending.setdefault(session_id, []).append(event)

    def report_failure(self, where: str, error: Exception) -> None:
        """Count a failure in agentkv code: raise it when `raise_error`, else log it (the run goes on)."""
        with self._lock:
            self.errors += 1
        if self.raise_error:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(error, _REPORTED, True)
            raise error
        logger.warning("agentkv callback %s failed (the run goes on): %r", where, error, exc_info=error)

    def _thread(self, thread_id: str | None) -> str:
        return SessionKey.from_metadata({THREAD_KEY: thread_id} if thread_id else {}, self.session_id).thread

    def _pin(self, session_id: str, owner: str | None) -> None:
        if owner is None:
            msg = f"{PIN_EVENT}: data['owner'] is required (the span owner to pin)"
            raise ValueError(msg)
        with self._lock:
            if (session_id, owner) in self.leases or session_id not in self.backend:
                return  # already pinned (a re-run node pins again), or no such session: a no-op hint
            self.events.append((session_id, Custom(event="pin", owner=owner)))
            self.leases[(session_id, owner)] = self.backend.get(session_id).pin(owner, reason=PIN_EVENT)


# ---------------------------------------------------------------------------- helpers


def _tool_message(output: Any, call_id: str | None) -> ToolMessage | None:
    """The `ToolMessage` a tool run produced: itself, or inside a `Command(update={"messages": [...]})`."""
    if isinstance(output, ToolMessage):
        return output
    update = getattr(output, "update", None)
    messages = update.get("messages") if isinstance(update, Mapping) else None
    for message in messages or []:
        if isinstance(message, ToolMessage) and (call_id is None or message.tool_call_id == call_id):
            return message
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return str(content)
