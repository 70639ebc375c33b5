"""Human decisions about an answer that LangGraph makes again when it resumes a node.

A node that asks the model and then calls `interrupt()` runs twice: up to the
interrupt (the human reviews that answer), then from the top on resume, where its
model call answers again and that second answer is what the node returns into the
state. The first one is left out of the next call's history and cropped from the
cache, so a decision applied to it would be lost.

`NodeReplays` follows the answers of each graph task (by its checkpoint namespace,
which a resumed task keeps). A decision about an answer of a task that stopped at
the interrupt (or about "the latest answer", when such a task made one) is held
until the re-run makes its answer at the same position (its n-th model call), and
is then applied to that answer. A decision about anything else, such as a plan
written by an earlier node (the plan → review layout), is applied at once.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentkv import Event, UserConfirmed, UserRejected

__all__ = ["NodeReplays"]

Decision = UserConfirmed | UserRejected


@dataclass
class _Task:
    """One graph task's model answers (span owners), in call order."""

    answers: list[str] = field(default_factory=list)
    """This attempt's answers."""
    paused: list[str] = field(default_factory=list)
    """The answers of the attempt that stopped at an interrupt (what the human reviewed)."""
    paused_now: bool = False
    """Paused in the current run (else its pause was answered by an earlier resume)."""


@dataclass(frozen=True)
class _Held:
    """A decision waiting for the re-run task's answer at `position`."""

    position: int
    event: Decision


class NodeReplays:
    """Answers per task, and the decisions held for a resumed task's new answers (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[tuple[str, str], _Task] = {}
        self._held: dict[tuple[str, str], list[_Held]] = {}

    def answered(self, session_id: str, task: str, owner: str) -> list[Event]:
        """A model call of `task` answered with span owner `owner`; returns the decisions now due."""
        with self._lock:
            answers = self._tasks.setdefault((session_id, task), _Task()).answers
            answers.append(owner)
            position = len(answers) - 1
            held = self._held.get((session_id, task), [])
            due = [h for h in held if h.position == position]
            if due:
                held[:] = [h for h in held if h.position != position]
        return [dataclasses.replace(h.event, owner=owner) for h in due]

    def paused(self, session_id: str, task: str) -> None:
        """`task` stopped at an interrupt: its answers so far are the ones a human reviews."""
        with self._lock:
            state = self._tasks.get((session_id, task))
            if state is not None and state.answers:  # nested runs report the same pause: keep the first
                state.paused, state.answers, state.paused_now = state.answers, [], True

    def resumed(self, session_id: str, events: Sequence[Event]) -> list[Event]:
        """Decisions of a resume: those about a paused task's answers are held; returns the rest."""
        now: list[Event] = []
        with self._lock:
            paused = [(key, t) for key, t in self._tasks.items() if key[0] == session_id and t.paused]
            for event in events:
                target = self._target(event, paused)
                if target is None or not isinstance(event, (UserConfirmed, UserRejected)):
                    now.append(event)
                    continue
                key, position = target
                self._held.setdefault(key, []).append(_Held(position, event))
        return now

    def finish(self, session_id: str, *, interrupted: bool) -> list[Event]:
        """A top-level run ended: decisions whose answer never came back go to their first owner.

        The tasks that paused in a run that ended at an interrupt keep their answers for the resume;
        everything else about the session is forgotten.
        """
        with self._lock:
            left: list[Event] = []
            for key in [k for k in self._held if k[0] == session_id]:
                task = self._tasks.get(key)
                for held in self._held.pop(key):
                    first = task.paused[held.position] if task and held.position < len(task.paused) else None
                    left.append(dataclasses.replace(held.event, owner=first or held.event.owner))
            for key in [k for k in self._tasks if k[0] == session_id]:
                task = self._tasks[key]
                if interrupted and task.paused_now:
                    task.answers, task.paused_now = [], False
                else:
                    del self._tasks[key]
        return left

    @staticmethod
    def _target(
        event: Event, paused: Sequence[tuple[tuple[str, str], _Task]]
    ) -> tuple[tuple[str, str], int] | None:
        """The paused task and answer position a decision is about, if it is about one."""
        owner = getattr(event, "owner", None)
        for key, task in reversed(paused):
            if owner is None:
                return key, len(task.paused) - 1  # "the latest answer": the paused task's last one
            if owner in task.paused:
                return key, task.paused.index(owner)
        return None
