"""Human decisions about an answer that LangGraph makes again when it resumes a node.

A node that asks the model and then calls `interrupt()` runs twice: up to the
interrupt (the human reviews that answer), then from the top on resume, where its
model call answers again and that second answer is what the node returns into the
state. The first one is left out of the next call's history and cropped from the
cache, so a decision applied to it would be lost.

`GraphTasks` keeps one `TaskRecord` per graph task (by its checkpoint namespace,
which a resumed task keeps): its answers, the answers of the attempt that stopped
at the interrupt, the decisions held for its re-run, and its outcome
(`INTERRUPTED` while paused in the current run, `REPLAYED` once that run ended and
the task waits to run again). A decision about an answer of an interrupted task (or
about "the latest answer", when such a task made one) is held until the re-run makes
its answer at the same position (its n-th model call), and is then applied to that
answer. A decision about anything else, such as a plan written by an earlier node
(the plan → review layout), is applied at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentkv import Event, UserConfirmed, UserRejected
from agentkv_langchain.outcomes import Outcome, after_run

__all__ = ["GraphTasks", "TaskRecord"]

Decision = UserConfirmed | UserRejected
TaskKey = tuple[str, str]
"""`(session id, checkpoint namespace)` of a graph task."""


@dataclass(frozen=True)
class _Held:
    """A decision waiting for the re-run task's answer at `position`."""

    position: int
    event: Decision
    order: int
    """When it was held (decisions left over at the end go out in this order)."""


@dataclass
class TaskRecord:
    """One graph task's model answers (span owners) and what waits for its re-run."""

    answers: list[str] = field(default_factory=list)
    """This attempt's answers, in call order."""
    paused: list[str] = field(default_factory=list)
    """The answers of the attempt that stopped at an interrupt (what the human reviewed)."""
    held: list[_Held] = field(default_factory=list)
    """Decisions about `paused` answers, each waiting for the re-run's answer at its position."""
    outcome: Outcome | None = None
    """`INTERRUPTED`: paused in the current run; `REPLAYED`: paused in an earlier one, runs again."""

    def first_owner(self, position: int) -> str | None:
        """The interrupted attempt's answer at `position`, if it made one."""
        return self.paused[position] if position < len(self.paused) else None


class GraphTasks:
    """The graph tasks of the handler's sessions, one `TaskRecord` each (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[TaskKey, TaskRecord] = {}
        self._order = itertools.count()

    def answered(self, session_id: str, task: str, owner: str) -> list[Event]:
        """A model call of `task` answered with span owner `owner`; returns the decisions now due."""
        with self._lock:
            record = self._tasks.setdefault((session_id, task), TaskRecord())
            record.answers.append(owner)
            position = len(record.answers) - 1
            due = [h for h in record.held if h.position == position]
            record.held = [h for h in record.held if h.position != position]
        return [dataclasses.replace(h.event, owner=owner) for h in due]

    def paused(self, session_id: str, task: str) -> None:
        """`task` stopped at an interrupt: its answers so far are the ones a human reviews."""
        with self._lock:
            record = self._tasks.get((session_id, task))
            if record is not None and record.answers:  # nested runs report the same pause: keep the first
                record.paused, record.answers = record.answers, []
                record.outcome = Outcome.INTERRUPTED

    def resumed(self, session_id: str, events: Sequence[Event]) -> list[Event]:
        """Decisions of a resume: those about an interrupted task's answers are held; returns the rest."""
        now: list[Event] = []
        with self._lock:
            paused = [r for (sid, _), r in self._tasks.items() if sid == session_id and r.paused]
            for event in events:
                target = _target(event, paused)
                if target is None or not isinstance(event, (UserConfirmed, UserRejected)):
                    now.append(event)
                    continue
                record, position = target
                record.held.append(_Held(position, event, next(self._order)))
        return now

    def finish(self, session_id: str, outcome: Outcome) -> list[Event]:
        """A top-level run ended with `outcome`: held decisions whose answer never came go to the first one.

        When the run was interrupted, the tasks that paused in it wait for the resume
        (`REPLAYED`); everything else about the session is forgotten.
        """
        left: list[tuple[int, Event]] = []
        with self._lock:
            for key in [k for k in self._tasks if k[0] == session_id]:
                record = self._tasks[key]
                for held in record.held:
                    owner = record.first_owner(held.position) or held.event.owner
                    left.append((held.order, dataclasses.replace(held.event, owner=owner)))
                record.held = []
                record.outcome = after_run(record.outcome, outcome)
                if record.outcome is None:
                    del self._tasks[key]
                else:
                    record.answers = []
        return [event for _, event in sorted(left, key=lambda item: item[0])]

    def __len__(self) -> int:
        with self._lock:
            return len(self._tasks)


def _target(event: Event, paused: Sequence[TaskRecord]) -> tuple[TaskRecord, int] | None:
    """The interrupted task and answer position a decision is about, if it is about one."""
    owner = getattr(event, "owner", None)
    for record in reversed(paused):
        if owner is None:
            return record, len(record.paused) - 1  # "the latest answer": the paused task's last one
        if owner in record.paused:
            return record, record.paused.index(owner)
    return None
