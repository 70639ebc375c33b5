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
error events do not, so each run's start leaves a `RunRecord` (children inherit their
parent's) in the handler's `RunBook` (`agentkv_langchain.runs`: one typed record per
run, session and thread, under one lock: parallel branches call the handler from
worker threads). How a run or a tool call ended is `agentkv_langchain.outcomes.decide`,
the same decision `AgentKVMiddleware` makes.

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
    BranchOpened,
    BranchPruned,
    BranchSelected,
    Custom,
    EngineBackend,
    Event,
    Lease,
    ToolCallFailed,
    TransformersBackend,
    TurnEnded,
)
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
    custom_event,
    decision_events,
    resume_decision,
)
from agentkv_langchain.fanout import BranchSelector, settlement
from agentkv_langchain.outcomes import Outcome, decide, is_bubble_up, tool_event, tool_message
from agentkv_langchain.replays import GraphTasks
from agentkv_langchain.runs import RunBook, RunRecord, graph_step, is_resume_command
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


class KVLifecycleCallbackHandler(_HandlerBase):
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
        """The events sent, in order, as `(session_id, event)`, duplicates included (sessions skip them):
        the last `callbacks.event_log` of them (a long-lived handler does not grow without bound)."""
        self.event_log = self.config.callbacks.event_log
        self.leases: dict[tuple[str, str], Lease] = {}
        """Pins made by `agentkv.pin` events, by `(session_id, owner)`; give them back with `release`."""
        self.errors = 0
        """Exceptions caught inside callbacks (each one logged)."""
        self._lock = threading.RLock()
        """Guards the records above (`events`, `leases`, `adopted`, `errors`)."""
        self.book = RunBook(session_id)
        """What the handler holds between callbacks: one record per run, session and thread."""
        self.tasks = GraphTasks()
        """One record per graph task: decisions held for a node that asks the model again on resume."""

    # -- public helpers --------------------------------------------------------------------------

    def send(self, session_id: str, event: Event) -> Any:
        """Record and apply one event (what every callback ends in); returns the `ApplyResult` or None."""
        with self._lock:
            self.events.append((session_id, event))
            if len(self.events) > self.event_log:
                del self.events[: len(self.events) - self.event_log]
        logger.debug("session %s <- %r", session_id, event)
        return self.backend.apply(session_id, event)

    def defer(self, session_id: str, event: Event) -> None:
        """Queue an event for the session, sent when the session's model run ends (not mid-forward)."""
        self.book.defer(session_id, event)

    def flush(self, session_id: str | None = None, *, thread: str | None = None) -> None:
        """Send the tool outcomes still waiting for their results to be encoded (see the module doc).

        Args:
            session_id: Only this session's; None = every session's (or `thread`'s).
            thread: Only the sessions of this thread (its own and its branches').
        """
        for sid, events in self.book.take_pending(session_id, thread=thread):
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

    def report_failure(self, where: str, error: Exception) -> None:
        """Count a failure in agentkv code: raise it when `raise_error`, else log it (the run goes on)."""
        with self._lock:
            self.errors += 1
        if self.raise_error:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(error, _REPORTED, True)
            raise error
        logger.warning("agentkv callback %s failed (the run goes on): %r", where, error, exc_info=error)

    # -- runs: starts fill the run book, ends read it -------------------------------------------

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
        run = self._enter(run_id, parent_run_id, metadata)
        if parent_run_id is None and is_resume_command(inputs):
            with self.book.lock:
                run.resume = inputs.resume

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
        run = self._enter(run_id, parent_run_id, metadata, model=True)
        if run.branch is None and messages:
            self._settle(run.thread, step=graph_step(metadata), messages=messages[0])
        for batch in messages or []:
            for message in batch or []:
                if not isinstance(message, ToolMessage):
                    continue
                event = tool_event(message.tool_call_id, message)
                if isinstance(event, ToolCallFailed) and self.book.first_failure(
                    run.session_id, event.tool_call_id
                ):
                    self.defer(run.session_id, event)

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
        run = self.book.exit(run_id)
        if run is None:
            return
        due: list[Event] = []
        for generations in getattr(response, "generations", None) or []:
            for generation in generations:
                message = getattr(generation, "message", None)
                if isinstance(message, AIMessage) and message.id and run.task:
                    due += self.tasks.answered(run.session_id, run.task, message.id)
                if isinstance(message, AIMessage) and message.tool_calls:
                    self.book.made_calls(
                        run.session_id,
                        (
                            ToolCallRecord(
                                str(call.get("id") or ""), call["name"], call.get("args") or {}, message.id
                            )
                            for call in message.tool_calls
                        ),
                    )
        self.flush(run.session_id)
        for event in due:  # a decision about this answer's first version, made before the node re-ran
            self._emit(run.session_id, event)

    @_guarded
    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """Forget the model call."""
        self.book.exit(run_id)

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
        run = self._enter(run_id, parent_run_id, metadata)
        call_id = kwargs.get("tool_call_id")
        if not call_id and isinstance(inputs, Mapping):
            call_id = inputs.get("tool_call_id")
        run.tool_call_id = str(call_id) if call_id else None

    @_guarded
    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """A tool returned: commit its result, release the call (or release both when it reports an error)."""
        run = self.book.exit(run_id)
        message = tool_message(output, run.tool_call_id if run else None)
        call_id = message.tool_call_id if message is not None else run.tool_call_id if run else None
        if not call_id or run is None:
            logger.debug("tool run %s has no tool_call_id: no span names its result", run_id)
            return
        self._tool_ended(run, call_id, output, None)

    @_guarded
    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """A tool raised: release the call and its output; an interrupt raised inside a tool is a pause."""
        run = self.book.exit(run_id)
        if run is None:
            return
        if decide(error=error) is Outcome.INTERRUPTED:
            self.book.mark_interrupted(run.root)
        elif run.tool_call_id:
            self._tool_ended(run, run.tool_call_id, None, error)

    @_guarded
    def on_chain_end(
        self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        """The end of a top-level run ends the turn, unless the run stopped at an interrupt."""
        run = self.book.exit(run_id)
        if parent_run_id is None and run is not None:
            self._root_ended(run, decide(outputs, interrupted=run.outcome is Outcome.INTERRUPTED))

    @_guarded
    def on_chain_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        """A failed run changes nothing (the next user turn ends it); an interrupt marks the turn paused."""
        run = self.book.exit(run_id)
        if run is None:
            if parent_run_id is None:
                self.book.forget_root(run_id)
            return
        outcome = decide(error=error, interrupted=run.outcome is Outcome.INTERRUPTED)
        if is_bubble_up(error):
            self.book.mark_interrupted(run.root)
            if run.task:
                self.tasks.paused(run.session_id, run.task)
        if parent_run_id is None:
            self._root_ended(run, outcome)

    # -- LangGraph: interrupt and resume -------------------------------------------------------

    @_guarded
    def on_interrupt(self, event: Any) -> None:
        """LangGraph paused: remember the interrupts (their values say what a resume answers)."""
        run = self.book.get(getattr(event, "run_id", None))
        if run is None:
            return
        self.book.mark_interrupted(run.root)
        self.book.interrupted(run.thread, getattr(event, "interrupts", ()) or ())

    @_guarded
    def on_resume(self, event: Any) -> None:
        """LangGraph resumed from a checkpoint: the held `Command(resume=...)` becomes confirm/reject."""
        run = self.book.get(getattr(event, "run_id", None))
        resumed = self.book.resume(run) if run is not None else None
        if resumed is None:
            return
        session_id, answered = resumed
        decisions = decision_events(answered, self.book.tool_calls(session_id))
        # A decision about an answer the resumed node makes again waits for that new answer.
        for event_ in self.tasks.resumed(session_id, decisions):
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
        run = self.book.get(run_id) or self.book.record_for(run_id, None, metadata)
        event = custom_event(name, data)
        if name == PIN_EVENT and isinstance(event, Custom) and event.owner is not None:
            self._pin(run.session_id, event.owner)  # pinned here, the lease kept (`release`)
        elif isinstance(event, (BranchPruned, BranchSelected)):
            # A branch is settled by its parent, whichever run (a judge node, the branch itself) says so.
            self._emit(run.thread, event)
            self.book.decided(run.thread, event.branch, selected=isinstance(event, BranchSelected))
        else:
            self._emit(run.session_id, event)

    # -- views of the run book (what the tests check is left empty) -------------------------------

    @property
    def _runs(self) -> dict[UUID, RunRecord]:
        """The live runs (empty once every run ended)."""
        return self.book.runs

    @property
    def _pending(self) -> dict[str, list[Event]]:
        """Tool outcomes waiting for their results to be encoded, by session."""
        return self.book.pending()

    @property
    def _interrupts(self) -> dict[str, dict[str, Any]]:
        """Interrupts waiting for a resume, by thread."""
        return self.book.interrupts()

    # -- internals ---------------------------------------------------------------------------------

    def _enter(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        metadata: Mapping[str, Any] | None,
        *,
        model: bool = False,
    ) -> RunRecord:
        """Track a run; the first run inside a branch opens it on the parent session."""
        run, opened = self.book.enter(run_id, parent_run_id, metadata, model=model)
        if opened and run.branch is not None:
            self._emit(run.thread, BranchOpened(branch=run.branch, parent=run.thread))
        return run

    def _tool_ended(self, run: RunRecord, call_id: str, output: Any, error: BaseException | None) -> None:
        """Hold a tool's outcome for the session whose model made the call (sent once the result is in it)."""
        event = tool_event(call_id, output, error)
        if event is None:
            return
        session_id = self.book.session_of_call(call_id) or run.session_id
        if isinstance(event, ToolCallFailed):  # the error ToolMessage made of it is the same failure
            self.book.first_failure(session_id, call_id)
        self.defer(session_id, event)

    def _root_ended(self, run: RunRecord, outcome: Outcome) -> None:
        """A top-level run ended: outcomes go out; a completed or failed one settles its fan-out.

        Completed, it also ends the turn (`end_turn_on_root`); interrupted, the turn goes on.
        """
        self.book.forget_root(run.root)
        self.flush(thread=run.thread)
        for event in self.tasks.finish(run.session_id, outcome):
            self._emit(run.session_id, event)
        self.book.forget_closed(lambda session_id: session_id in self.backend)
        if outcome is Outcome.INTERRUPTED:
            logger.debug("run %s paused at an interrupt: the turn goes on", run.root)
            return
        if run.branch is None:  # a run that is itself a branch settles nothing
            self._settle(run.thread, at_end=True)
        if outcome is Outcome.COMPLETED and self.end_turn_on_root:
            self._emit(run.session_id, TurnEnded())

    def _settle(
        self, thread: str, *, step: int | None = None, messages: Any = None, at_end: bool = False
    ) -> None:
        """Settle the thread's open branches (see `agentkv_langchain.fanout.settlement`).

        Branches opened at graph step `step` or later are still running and stay open;
        `messages` is the input of the thread-level call settling them.
        """
        settling, selected = self.book.settling(thread, step)
        if not settling:
            return
        plan = settlement(
            self.backend,
            thread,
            settling,
            selected,
            messages=messages,
            at_end=at_end,
            adopt=self.adopt_branches,
            selector=self.branch_selector,
        )
        for branch in plan.pruned:
            self._emit(thread, BranchPruned(branch=branch))
        self.book.settled(thread, settling, set(plan.kept))
        if plan.adopted is not None and isinstance(self.backend, TransformersBackend | EngineBackend):
            self._adopt(self.backend, thread, plan.adopted)

    def _adopt(self, backend: TransformersBackend | EngineBackend, thread: str, branch: str) -> None:
        """The thread goes on with `branch`: its session becomes the thread's (nothing is re-encoded)."""
        with self._lock:
            self.events.append((thread, BranchSelected(branch=branch)))
        try:
            backend.adopt(thread, branch)
        except Exception as e:
            self.report_failure(f"adopting branch {branch!r} of {thread!r}", e)
        else:
            with self._lock:
                self.adopted.append((thread, branch))
            logger.debug("thread %s goes on with branch %s: adopted", thread, branch)

    def _emit(self, session_id: str, event: Event) -> None:
        """`send` from inside a callback: one failing event is logged and counted, the others still go."""
        try:
            self.send(session_id, event)
        except Exception as e:
            self.report_failure(f"{event.name} for session {session_id!r}", e)

    def _thread(self, thread_id: str | None) -> str:
        return SessionKey.from_metadata({THREAD_KEY: thread_id} if thread_id else {}, self.session_id).thread

    def _pin(self, session_id: str, owner: str) -> None:
        with self._lock:
            if (session_id, owner) in self.leases or session_id not in self.backend:
                return  # already pinned (a re-run node pins again), or no such session: a no-op hint
            self.events.append((session_id, Custom(event="pin", owner=owner)))
            self.leases[(session_id, owner)] = self.backend.get(session_id).pin(owner, reason=PIN_EVENT)
