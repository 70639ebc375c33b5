"""What `KVLifecycleCallbackHandler` remembers about runs, and settling fan-outs.

`RunContext` is what a run's start told the handler (thread, branch, node, root),
for the end/error callbacks that carry no metadata. `RunTracking`, which the
handler inherits, enters and exits runs, finds a run's session, and settles a
thread's open branches (see `agentkv_langchain.fanout`). Also how LangGraph's
control flow looks from a callback: bubble-up exceptions, resume commands.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

from agentkv import (
    Backend,
    BranchOpened,
    BranchPruned,
    BranchSelected,
    EngineBackend,
    Event,
    TransformersBackend,
)
from agentkv.session_ids import branch_session_id
from agentkv_langchain.decisions import ToolCallRecord
from agentkv_langchain.fanout import BranchSelector, continued_branch
from agentkv_langchain.sessions import BRANCH_KEY, THREAD_KEY, SessionKey, current_metadata

__all__ = ["BUBBLE_UPS", "RunContext", "RunTracking", "graph_step", "is_bubble_up", "is_resume_command"]

logger = logging.getLogger("agentkv.callbacks")

BUBBLE_UPS = frozenset({"GraphBubbleUp", "GraphInterrupt", "NodeInterrupt", "ParentCommand"})
"""LangGraph's control-flow exceptions: an interrupt is a pause, not a failure."""


@dataclass
class RunContext:
    """What a run's start told us, for the end/error callbacks that carry no metadata."""

    thread: str
    branch: str | None
    root: UUID
    node: str | None = None
    checkpoint_ns: str | None = None
    triggers: tuple[str, ...] = ()
    tool_call_id: str | None = None
    interrupted: bool = False
    resume: list[Any] = field(default_factory=list)
    """A top-level run's pending `Command(resume=...)` value (at most one), applied at `on_resume`."""

    @property
    def session_id(self) -> str:
        """The run's session: its thread, or the thread's branch."""
        return branch_session_id(self.thread, self.branch)


class RunTracking:
    """The run-tracking half of `KVLifecycleCallbackHandler` (its state is the handler's)."""

    if TYPE_CHECKING:
        backend: Backend
        session_id: str | None
        adopt_branches: bool
        branch_selector: BranchSelector | None
        adopted: list[tuple[str, str]]
        events: list[tuple[str, Event]]
        _lock: threading.RLock
        _runs: dict[UUID, RunContext]
        _tool_calls: dict[str, list[ToolCallRecord]]
        _branches: dict[tuple[str, str], int | None]
        _selected: set[tuple[str, str]]

        def _emit(self, session_id: str, event: Event) -> None: ...

        def report_failure(self, where: str, error: Exception) -> None:
            """Count (and maybe raise) a failure: the handler's."""

    def _context(self, run_id: UUID | None) -> RunContext | None:
        if run_id is None:
            return None
        with self._lock:
            return self._runs.get(run_id)

    def _context_from(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        metadata: Mapping[str, Any] | None,
        *,
        model: bool = False,
    ) -> RunContext:
        """A run's context: its own metadata where it says something, its parent's otherwise.

        Only a model call inside a `Send` task runs on the task's fork (`model=True`); a
        node or tool run there belongs to the thread, unless `agentkv_branch` names a branch.
        """
        metadata = metadata or {}
        parent = self._runs.get(parent_run_id) if parent_run_id is not None else None
        if parent is None and not metadata.get(THREAD_KEY):
            # A top-level call (`llm.stream(..., {"configurable": {"thread_id": ...}})`): the thread is
            # in the call's config, not in the callback metadata; read it as `ChatAgentKV` does.
            metadata = current_metadata(metadata)
        key = SessionKey.from_metadata(metadata, self.session_id, send_forks=model)
        thread = (
            key.thread if (THREAD_KEY in metadata or self.session_id or parent is None) else parent.thread
        )
        branch = key.branch
        if branch is None and BRANCH_KEY not in metadata and parent is not None and parent.thread == thread:
            branch = parent.branch
        triggers = metadata.get("langgraph_triggers") or (parent.triggers if parent else ())
        return RunContext(
            thread=thread,
            branch=branch,
            root=parent.root if parent is not None else run_id,
            node=metadata.get("langgraph_node") or (parent.node if parent else None),
            checkpoint_ns=metadata.get("langgraph_checkpoint_ns")
            or (parent.checkpoint_ns if parent else None),
            triggers=tuple(triggers)
            if isinstance(triggers, Sequence) and not isinstance(triggers, str)
            else (),
        )

    def _enter(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        metadata: Mapping[str, Any] | None,
        *,
        model: bool = False,
    ) -> RunContext:
        with self._lock:
            context = self._context_from(run_id, parent_run_id, metadata, model=model)
            self._runs[run_id] = context
            opened = context.branch is not None and (context.thread, context.branch) not in self._branches
            if opened and context.branch is not None:
                self._branches[(context.thread, context.branch)] = graph_step(metadata)
        if opened and context.branch is not None:
            self._emit(context.thread, BranchOpened(branch=context.branch, parent=context.thread))
        return context

    def _settle(
        self, thread: str, *, step: int | None = None, messages: Any = None, at_end: bool = False
    ) -> None:
        """Settle the thread's open branches (see `agentkv_langchain.fanout`).

        Args:
            thread: The thread whose fan-out is settled.
            step: The graph step of the thread-level call settling it; branches opened at
                that step or later are still running and stay open.
            messages: That call's input: a branch it continues is adopted.
            at_end: The run ended: selected branches stay for the next run, others go.
        """
        with self._lock:
            settling = [
                b
                for (t, b), opened in self._branches.items()
                if t == thread and (step is None or opened is None or opened < step)
            ]
            selected = {b for b in settling if (thread, b) in self._selected}
        if not settling:
            return
        winner = None
        keep: set[str] = set()
        backend = self.backend
        # Adoption moves the winner's session into the thread's place (`adopt`, on either backend).
        adoptable = isinstance(backend, TransformersBackend | EngineBackend)
        if messages is not None and self.adopt_branches and adoptable:
            winner = continued_branch(backend, thread, settling, messages)
        if at_end:
            keep = set(selected)
            if not keep and self.branch_selector is not None:
                pick = self.branch_selector(thread, sorted(settling))
                keep = {pick} if pick in settling else set()
        for branch in settling:
            if branch != winner and branch not in keep:
                self._emit(thread, BranchPruned(branch=branch))
        with self._lock:
            for branch in settling:
                if branch not in keep:
                    self._branches.pop((thread, branch), None)
                    self._selected.discard((thread, branch))
                else:
                    self._selected.add((thread, branch))
        if winner is not None and isinstance(backend, TransformersBackend | EngineBackend):
            with self._lock:
                self.events.append((thread, BranchSelected(branch=winner)))
            try:
                backend.adopt(thread, winner)
            except Exception as e:
                self.report_failure(f"adopting branch {winner!r} of {thread!r}", e)
            else:
                with self._lock:
                    self.adopted.append((thread, winner))
                logger.debug("thread %s goes on with branch %s: adopted", thread, winner)

    def _session_of_call(self, call_id: str) -> str | None:
        """The session whose model made tool call `call_id` (its result is encoded there)."""
        with self._lock:
            return next(
                (
                    sid
                    for sid, records in self._tool_calls.items()
                    if any(r.tool_call_id == call_id for r in records)
                ),
                None,
            )

    def _exit(self, run_id: UUID) -> RunContext | None:
        with self._lock:
            return self._runs.pop(run_id, None)

    def _forget_root(self, root: UUID) -> None:
        """Drop what is left of a finished top-level run (children that never reported an end)."""
        with self._lock:
            for run_id in [r for r, c in self._runs.items() if c.root == root]:
                del self._runs[run_id]

    def _mark_interrupted(self, root: UUID) -> None:
        with self._lock:
            context = self._runs.get(root)
            if context is not None:
                context.interrupted = True


def graph_step(metadata: Mapping[str, Any] | None) -> int | None:
    """The LangGraph step a run belongs to (`langgraph_step`), if any."""
    step = (metadata or {}).get("langgraph_step")
    return step if isinstance(step, int) else None


def is_bubble_up(error: BaseException) -> bool:
    """Whether `error` is LangGraph control flow (an interrupt), not a failure."""
    return any(cls.__name__ in BUBBLE_UPS for cls in type(error).__mro__)


def is_resume_command(inputs: Any) -> bool:
    """A LangGraph `Command` carrying a resume value (checked by shape: LangGraph is optional)."""
    return type(inputs).__name__ == "Command" and getattr(inputs, "resume", None) is not None
