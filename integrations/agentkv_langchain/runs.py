"""What `KVLifecycleCallbackHandler` holds between callbacks: one typed record per run, session and thread.

LangChain reports a run in pieces: its start carries the metadata (thread, branch,
graph node and task), its end and error do not. `RunBook` keeps, under one lock:

- a `RunRecord` per live run: its session, its root, its graph task, the tool call it
  runs, its outcome once known, a top-level run's pending resume value;
- a `SessionRecord` per session: tool outcomes waiting for their result to be encoded,
  failed calls already reported, the latest assistant message's tool calls;
- a `ThreadRecord` per thread: interrupts waiting for a resume, open fan-out branches.

A graph task's answers (what a resumed node makes again) are `replays.GraphTasks`';
how each unit ended is `outcomes.decide`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from agentkv import Event
from agentkv.session_ids import branch_session_id, is_branch_of
from agentkv_langchain.decisions import ToolCallRecord, answered_interrupts
from agentkv_langchain.outcomes import Outcome
from agentkv_langchain.sessions import BRANCH_KEY, THREAD_KEY, SessionKey, current_metadata

__all__ = [
    "RunBook",
    "RunRecord",
    "SessionRecord",
    "ThreadRecord",
    "graph_step",
    "is_resume_command",
]


@dataclass
class RunRecord:
    """One LangChain run (a graph, node, model call or tool), from its start callback to its end."""

    thread: str
    branch: str | None
    root: UUID
    """The top-level run it belongs to (itself for a top-level run)."""
    named: bool = True
    """The thread was named (run metadata, the call's config, a fixed session), not the default."""
    node: str | None = None
    """The LangGraph node it runs in (`langgraph_node`)."""
    task: str | None = None
    """The LangGraph task it runs in (its checkpoint namespace, which a resumed task keeps)."""
    triggers: tuple[str, ...] = ()
    tool_call_id: str | None = None
    """The call a tool run answers (its end may report a bare string)."""
    outcome: Outcome | None = None
    """None while it runs; `INTERRUPTED` as soon as an interrupt is seen inside it."""
    resume: Any = None
    """A top-level run's `Command(resume=...)` value, until LangGraph confirms the resume (`on_resume`)."""

    @property
    def session_id(self) -> str:
        """The run's session: its thread, or the thread's branch."""
        return branch_session_id(self.thread, self.branch)


@dataclass
class SessionRecord:
    """What the handler holds for one agentkv session."""

    pending: list[Event] = field(default_factory=list)
    """Tool outcomes waiting for their results to be encoded (the end of the session's next model call)."""
    failed_calls: set[str] = field(default_factory=set)
    """`tool_call_id`s whose failure was reported (by a tool run, or an error result in a model's input)."""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    """The calls of the latest assistant message that made any (human review names calls)."""


@dataclass
class ThreadRecord:
    """What the handler holds for one conversation (a thread and its branches)."""

    interrupts: dict[str, Any] = field(default_factory=dict)
    """Pending interrupt id → its value (what a resume answers)."""
    branches: dict[str, int | None] = field(default_factory=dict)
    """Open branches → the graph step of their first run (None outside a graph); settled ones leave."""
    selected: set[str] = field(default_factory=set)
    """Branches a `select_branch` (or the selector) kept: adopted or pruned at the thread's next call."""


class RunBook:
    """The handler's state: runs, sessions and threads, each a typed record, under one lock (thread-safe).

    Args:
        fixed_session: A fixed session id (`ChatAgentKV(session_id=...)`); None = from the run metadata.
    """

    def __init__(self, fixed_session: str | None = None) -> None:
        self.fixed_session = fixed_session
        self.lock = threading.RLock()
        self.runs: dict[UUID, RunRecord] = {}
        """Live runs, by run id (a finished top-level run leaves nothing behind)."""
        self.sessions: dict[str, SessionRecord] = {}
        self.threads: dict[str, ThreadRecord] = {}
        self._seen_open: set[str] = set()
        """Sessions with a record that the backend was seen holding (`forget_closed`)."""

    # -- runs --------------------------------------------------------------------------------------

    def get(self, run_id: UUID | None) -> RunRecord | None:
        """The live run `run_id`, if any."""
        if run_id is None:
            return None
        with self.lock:
            return self.runs.get(run_id)

    def record_for(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        metadata: Mapping[str, Any] | None,
        *,
        model: bool = False,
    ) -> RunRecord:
        """A run's record: its own metadata where it says something, its parent's otherwise (not entered).

        Only a model call inside a `Send` task runs on the task's fork (`model=True`); a
        node or tool run there belongs to the thread, unless `agentkv_branch` names a branch.
        """
        metadata = metadata or {}
        with self.lock:
            parent = self.runs.get(parent_run_id) if parent_run_id is not None else None
        if (parent is None or not parent.named) and not metadata.get(THREAD_KEY):
            # The thread is in the call's config, not in the callback metadata: a top-level call
            # (`llm.stream(..., {"configurable": {"thread_id": ...}})`), or a step of an LCEL chain
            # whose root callback ran before the chain's config was the current one. Read it as
            # `ChatAgentKV` does.
            metadata = current_metadata(metadata)
        key = SessionKey.from_metadata(metadata, self.fixed_session, send_forks=model)
        own_thread = THREAD_KEY in metadata or self.fixed_session or parent is None
        thread = key.thread if own_thread or parent is None else parent.thread
        inherited = parent is not None and parent.named
        named = bool(metadata.get(THREAD_KEY)) or self.fixed_session is not None or inherited
        branch = key.branch
        if branch is None and BRANCH_KEY not in metadata and parent is not None and parent.thread == thread:
            branch = parent.branch
        triggers = metadata.get("langgraph_triggers") or (parent.triggers if parent else ())
        return RunRecord(
            thread=thread,
            branch=branch,
            root=parent.root if parent is not None else run_id,
            named=named,
            node=metadata.get("langgraph_node") or (parent.node if parent else None),
            task=metadata.get("langgraph_checkpoint_ns") or (parent.task if parent else None),
            triggers=tuple(triggers)
            if isinstance(triggers, Sequence) and not isinstance(triggers, str)
            else (),
        )

    def enter(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        metadata: Mapping[str, Any] | None,
        *,
        model: bool = False,
    ) -> tuple[RunRecord, bool]:
        """Start tracking a run; returns its record and whether it opened a branch of its thread."""
        with self.lock:
            record = self.record_for(run_id, parent_run_id, metadata, model=model)
            self.runs[run_id] = record
            root = self.runs.get(record.root)
            if record.named and root is not None and not root.named:
                self._name_thread(record)
            branches = self._thread(record.thread).branches if record.branch is not None else {}
            opened = record.branch is not None and record.branch not in branches
            if opened and record.branch is not None:
                branches[record.branch] = graph_step(metadata)
        return record, opened

    def _name_thread(self, record: RunRecord) -> None:
        """A run named its thread where its root's start did not: the root and its runs take it.

        An LCEL chain's root callback runs before the chain's config is the current one, so
        a `configurable.thread_id` is first seen by a step; the root's turn end and the
        other steps then go to that thread, not to the default one.
        """
        for other in self.runs.values():
            if other.root == record.root and not other.named:
                other.thread, other.named = record.thread, True

    def exit(self, run_id: UUID) -> RunRecord | None:
        """Stop tracking a run; its record (None when it was never entered)."""
        with self.lock:
            return self.runs.pop(run_id, None)

    def forget_root(self, root: UUID) -> None:
        """Drop what is left of a finished top-level run (children that never reported an end)."""
        with self.lock:
            for run_id in [r for r, record in self.runs.items() if record.root == root]:
                del self.runs[run_id]

    def mark_interrupted(self, root: UUID) -> None:
        """An interrupt was seen inside top-level run `root`: it is paused, whatever it returns."""
        with self.lock:
            record = self.runs.get(root)
            if record is not None:
                record.outcome = Outcome.INTERRUPTED

    # -- sessions ----------------------------------------------------------------------------------

    def defer(self, session_id: str, event: Event) -> None:
        """Hold a tool outcome until the session's result is encoded (see `take_pending`)."""
        with self.lock:
            self._session(session_id).pending.append(event)

    def take_pending(
        self, session_id: str | None = None, *, thread: str | None = None
    ) -> list[tuple[str, list[Event]]]:
        """Remove and return the held tool outcomes: one session's, a thread's sessions', or all."""
        with self.lock:
            if session_id is not None:
                wanted = [session_id]
            elif thread is not None:
                wanted = [s for s in self.sessions if s == thread or is_branch_of(s, thread)]
            else:
                wanted = list(self.sessions)
            batches = []
            for sid in wanted:
                record = self.sessions.get(sid)
                if record is not None and record.pending:
                    batches.append((sid, record.pending))
                    record.pending = []
            return batches

    def pending(self) -> dict[str, list[Event]]:
        """A snapshot of the held tool outcomes, by session (sessions holding none are left out)."""
        with self.lock:
            return {sid: list(r.pending) for sid, r in self.sessions.items() if r.pending}

    def first_failure(self, session_id: str, call_id: str) -> bool:
        """Note that call `call_id` failed; False when its failure was already reported."""
        with self.lock:
            failed = self._session(session_id).failed_calls
            first = call_id not in failed
            failed.add(call_id)
            return first

    def made_calls(self, session_id: str, calls: Iterable[ToolCallRecord]) -> None:
        """The session's latest assistant message made these tool calls."""
        with self.lock:
            self._session(session_id).tool_calls = list(calls)

    def tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        """The calls of the session's latest assistant message that made any."""
        with self.lock:
            record = self.sessions.get(session_id)
            return list(record.tool_calls) if record is not None else []

    def session_of_call(self, call_id: str) -> str | None:
        """The session whose model made tool call `call_id` (its result is encoded there)."""
        with self.lock:
            return next(
                (
                    sid
                    for sid, record in self.sessions.items()
                    if any(r.tool_call_id == call_id for r in record.tool_calls)
                ),
                None,
            )

    # -- threads: interrupts -----------------------------------------------------------------------

    def interrupted(self, thread: str, interrupts: Iterable[Any]) -> None:
        """LangGraph paused the thread at these interrupts (objects with `id` and `value`)."""
        with self.lock:
            pending = self._thread(thread).interrupts
            for item in interrupts:
                pending[str(getattr(item, "id", len(pending)))] = getattr(item, "value", None)

    def resume(self, run: RunRecord) -> tuple[str, list[tuple[str, Any, Any]]] | None:
        """Take the held resume value of `run`'s top-level run.

        Returns:
            `(the top-level run's session, the interrupts the value answers)`, or None
            when no resume value was held.
        """
        with self.lock:
            root = self.runs.get(run.root, run)
            if root.resume is None:
                return None
            value, root.resume = root.resume, None
            thread = self.threads.get(run.thread)
            pending = thread.interrupts if thread is not None else {}
            answered = answered_interrupts(value, pending)
            for interrupt_id, _, _ in answered:
                pending.pop(interrupt_id, None)
            return root.session_id, answered

    def interrupts(self) -> dict[str, dict[str, Any]]:
        """A snapshot of the pending interrupts, by thread."""
        with self.lock:
            return {thread: dict(r.interrupts) for thread, r in self.threads.items()}

    # -- threads: fan-out branches -----------------------------------------------------------------

    def settling(self, thread: str, step: int | None) -> tuple[list[str], set[str]]:
        """The branches to settle (opened before graph step `step`; all when None), and the selected ones."""
        with self.lock:
            record = self.threads.get(thread)
            if record is None:
                return [], set()
            settling = [
                b for b, opened in record.branches.items() if step is None or opened is None or opened < step
            ]
            return settling, {b for b in settling if b in record.selected}

    def settled(self, thread: str, branches: Iterable[str], keep: set[str]) -> None:
        """`branches` were settled: the kept ones stay open and selected, the others leave."""
        with self.lock:
            record = self._thread(thread)
            for branch in branches:
                if branch in keep:
                    record.selected.add(branch)
                else:
                    record.branches.pop(branch, None)
                    record.selected.discard(branch)

    def decided(self, thread: str, branch: str, *, selected: bool) -> None:
        """A branch was pruned (it leaves) or selected (it is kept; its open siblings leave)."""
        with self.lock:
            record = self._thread(thread)
            for other in list(record.branches):
                if (other != branch) if selected else (other == branch):
                    del record.branches[other]
                    record.selected.discard(other)
            if selected:
                record.selected.add(branch)

    # -- closed sessions ----------------------------------------------------------------------------

    def forget_closed(self, is_open: Callable[[str], bool]) -> None:
        """Drop the records of sessions and threads the backend held and has closed since.

        `is_open(session_id)` says whether the backend holds a session now. A thread
        record stays while it has pending interrupts or open branches, and so do its
        sessions' records (a resume names the calls of the message that paused); a
        session record with held tool outcomes stays (they are sent when it comes back).
        Records of sessions the backend never held (events without a model session) stay.
        """
        with self.lock:
            for sid in [*self.sessions, *self.threads]:
                if is_open(sid):
                    self._seen_open.add(sid)
            closed = {sid for sid in self._seen_open if not is_open(sid)}
            waiting = {t for t, r in self.threads.items() if r.interrupts or r.branches or t not in closed}
            for thread in set(self.threads) - waiting:
                del self.threads[thread]
            for sid, record in list(self.sessions.items()):
                held = record.pending or any(sid == t or is_branch_of(sid, t) for t in waiting)
                if sid in closed and not held:
                    del self.sessions[sid]
            self._seen_open -= closed - set(self.sessions) - set(self.threads)

    def _session(self, session_id: str) -> SessionRecord:
        return self.sessions.setdefault(session_id, SessionRecord())

    def _thread(self, thread: str) -> ThreadRecord:
        return self.threads.setdefault(thread, ThreadRecord())


def graph_step(metadata: Mapping[str, Any] | None) -> int | None:
    """The LangGraph step a run belongs to (`langgraph_step`), if any."""
    step = (metadata or {}).get("langgraph_step")
    return step if isinstance(step, int) else None


def is_resume_command(inputs: Any) -> bool:
    """A LangGraph `Command` carrying a resume value (checked by shape: LangGraph is optional)."""
    return type(inputs).__name__ == "Command" and getattr(inputs, "resume", None) is not None
