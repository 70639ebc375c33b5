"""The `ForgetController`: one per session; runs the side thread, holds decisions, applies them.

See `agentkv.forget` for the whole story (when it runs, the fork, the guard rails).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentkv.chat import ChatMessage
from agentkv.config import AgentKVConfig, ForgetConfig
from agentkv.config_sections import FORGET_PROMPT_FIELD
from agentkv.events import Event, TurnEnded
from agentkv.forget.protocol import (
    SIDE_THREAD_BRANCH,
    ForgetRequested,
    ToolOutputForgotten,
    check_handles,
    cites,
    handle_of,
    parse_forget_answer,
    side_thread_opening,
    went_astray,
)
from agentkv.lifecycle.results import ApplyResult
from agentkv.metrics import SessionStats
from agentkv.spans import Span, SpanKind, SpanState

logger = logging.getLogger("agentkv.forget")

# ---------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Candidate:
    """A tool result the side thread may name."""

    handle: str
    owner: str
    """The result's `tool_call_id` (what the release event names)."""
    span_id: int
    tool: str
    turn: int
    tokens: int
    preview: str

    def line(self) -> str:
        """The listing line: handle, tool, turn, size and the start of the result."""
        preview = f": {self.preview}" if self.preview else ""
        return f"{self.handle} ({self.tool}, turn {self.turn}, {self.tokens} tokens){preview}"


@dataclass(frozen=True)
class ForgetDecision:
    """What one side-thread run (or one agent request) decided."""

    source: str
    turn: int
    """The session's turn when the decision was made."""
    trigger: str
    """`every_turns`, `watermark` or `agent`."""
    offered: tuple[str, ...]
    chosen: tuple[str, ...]
    """Handles the answer named that passed the guard rails (applied at the next boundary)."""
    refused: tuple[tuple[str, str], ...] = ()
    """(handle, why) for named handles the guard rails kept."""
    malformed: str | None = None
    """Why the answer was rejected as a whole (then `chosen` is empty)."""
    answer: str = ""
    """The side thread's raw answer after the prefilled opening."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


@dataclass
class ForgetStats:
    """Running totals of a session's forgetting (what `agentkv bench forget` reports)."""

    runs: int = 0
    """Side-thread runs."""
    requests: int = 0
    """Agent requests (`ForgetRequested`)."""
    malformed: int = 0
    prefill_tokens: int = 0
    """Tokens the side thread encoded (its prompt, the generation prompt and the prefilled opening)."""
    decode_tokens: int = 0
    seconds: float = 0.0
    """Wall time of the side-thread runs (fork, prefill, decode, close)."""
    released_spans: int = 0
    released_tokens: int = 0
    refused: int = 0
    """Handles the guard rails kept (at decision or at application)."""
    decisions: list[ForgetDecision] = field(default_factory=list)


# ---------------------------------------------------------------------------- the controller


class SideThread(Protocol):
    """What the controller uses of the side thread's fork of its session."""

    session_id: str

    def extend(self, messages: Sequence[Any]) -> Any:
        """Bring the fork in line with `messages`."""
        ...

    def stream(self, max_new_tokens: int, *, prefix: str) -> Iterator[str]:
        """Answer after the prefilled `prefix`, piece by piece."""
        ...

    def stats(self) -> SessionStats:
        """What the fork encoded and generated."""
        ...


class ForgetSession(Protocol):
    """What the controller uses of its session (`Session` provides it).

    Declared here, below the backend: the session owns a controller, so the controller
    imports neither the session's module nor the backend's session protocol.
    """

    session_id: str
    config: AgentKVConfig
    backend: Any
    """The backend that opened the session (the side thread's fork is closed through it)."""

    format: Any
    """The session's `ChatFormat` (the side thread's call opens in its tool-call format)."""

    @property
    def turn(self) -> int:
        """The current user turn."""
        ...

    @property
    def spans(self) -> list[Span]:
        """The logical sequence's spans."""
        ...

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation's messages."""
        ...

    @property
    def manager(self) -> Any:
        """The session's `LifecycleManager` (its budget, its recallable set)."""
        ...

    def apply(self, event: Event) -> ApplyResult:
        """Apply a lifecycle event."""
        ...

    def fork(self, branch: str, *, config: AgentKVConfig | None = None) -> SideThread:
        """A branch of the session, with its own settings."""
        ...


class ForgetController:
    """One per session: runs the side thread, holds decisions until the next turn boundary, applies them.

    The session calls `on_turn_ended()` after an explicit `TurnEnded`,
    `at_turn_boundary()` when an `extend` brings a new user message (before encoding
    it), and `request(event)` for a `ForgetRequested` event. Everything else goes
    through the session's public API (`fork`, `extend`, `generate`, `apply`).
    """

    def __init__(self, session: ForgetSession) -> None:
        self.session = session
        self.config: ForgetConfig = session.config.forget
        self.enabled = self.config.enabled
        """Whether the side thread runs at turn ends (`forget.enabled`; set it to pause or resume)."""
        self.stats = ForgetStats()
        self.pending: list[ForgetDecision] = []
        """Decisions waiting for the next turn boundary."""
        self.applied: set[ForgetRequested] = set()
        self.last_run_turn = 0
        self.ended_turn: int | None = None
        """The last turn whose end was handled (the side thread runs at most once per turn)."""
        self.demoted_seen = 0
        """Tokens demoted by the budget at the last watermark check."""
        self.forgotten: set[int] = set()
        """Span ids released by a forget decision (not counted as budget pressure)."""

    # -- what can be forgotten -------------------------------------------------------------------

    def tool_results(self) -> list[tuple[str, Span]]:
        """Every tool-result message of the conversation with its handle, in order."""
        spans = [s for s in self.session.spans if s.kind is SpanKind.TOOL_RESULT and s.message_index >= 0]
        return [(handle_of(i), span) for i, span in enumerate(spans)]

    def guard(self, span: Span, *, current_turn: int) -> str | None:
        """Why `span` must not be forgotten now (None = it may)."""
        if span.owner is None:
            return "has no tool_call_id (events cannot name it)"
        if span.pinned:
            return "pinned"
        if span.turn >= current_turn:
            return "belongs to the current turn"
        if span.state not in (SpanState.COMMITTED, SpanState.ARCHIVED):
            return f"is {span.state.value}, not committed"
        answer = self.last_answer()
        if answer and cites(answer, self._text(span)):
            return "cited by the last answer"
        return None

    def candidates(self, *, current_turn: int | None = None) -> list[Candidate]:
        """Committed tool results the guard rails allow, oldest first, at most `max_candidates`."""
        turn = self.session.turn + 1 if current_turn is None else current_turn
        names = self._tool_names()
        out: list[Candidate] = []
        for handle, span in self.tool_results():
            if self.guard(span, current_turn=turn) is not None:
                continue
            text = " ".join(self._text(span).split())
            preview = text[: self.config.preview_chars]
            if len(text) > len(preview):
                preview += "..."
            out.append(
                Candidate(
                    handle=handle,
                    owner=span.owner or "",
                    span_id=span.span_id,
                    tool=names.get(span.owner or "", "tool"),
                    turn=span.turn,
                    tokens=span.length,
                    preview=preview,
                )
            )
            if len(out) >= self.config.max_candidates:
                break
        return out

    def last_answer(self) -> str:
        """The content of the conversation's last assistant message without tool calls."""
        for message in reversed(self.session.messages):
            if message.role == "assistant" and not message.tool_calls and message.content.strip():
                return message.content
        return ""

    def _text(self, span: Span) -> str:
        if 0 <= span.message_index < len(self.session.messages):
            return self.session.messages[span.message_index].content
        return ""

    def _tool_names(self) -> dict[str, str]:
        return {call.id: call.name for m in self.session.messages for call in m.tool_calls}

    # -- hooks from the session --------------------------------------------------------------------

    def on_turn_ended(self) -> ForgetDecision | None:
        """A turn ended: run the side thread if it is due; its decision waits for the next boundary."""
        session = self.session
        if self.ended_turn == session.turn:
            return None
        self.ended_turn = session.turn
        trigger = self._trigger()
        if trigger is None:
            return None
        if any(s.state is SpanState.ACTIVE and s.turn == session.turn for s in session.spans):
            # Called at a boundary with no explicit turn end: commit the turn first (what the next
            # user message would do a moment later), so its results are what the side thread sees.
            session.apply(TurnEnded())
        decision = self.run_side_thread(trigger)
        if decision is not None:
            self.pending.append(decision)
        return decision

    def at_turn_boundary(self) -> list[ApplyResult]:
        """A new user message is about to be encoded: end the previous turn's decisions and apply them."""
        if self.enabled:
            self.on_turn_ended()
        return self.apply_pending()

    def request(self, event: ForgetRequested) -> ApplyResult:
        """The main agent's `forget_tool_outputs` call: checked now, applied at the next boundary."""
        session = self.session
        if event in self.applied:
            return self._noop(event, "duplicate request")
        offered = tuple(handle for handle, _ in self.tool_results())
        handles, error = check_handles(event.handles, offered)
        if error is not None:
            self.stats.malformed += 1
            return self._noop(event, f"malformed request, nothing released: {error}")
        chosen, refused = self._screen(handles, current_turn=session.turn)
        decision = ForgetDecision(
            source=event.source,
            turn=session.turn,
            trigger="agent",
            offered=offered,
            chosen=chosen,
            refused=refused,
        )
        self.applied.add(event)
        self.stats.requests += 1
        self.stats.refused += len(refused)
        self.stats.decisions.append(decision)
        self.pending.append(decision)
        kept = "; ".join(f"{h} {why}" for h, why in refused)
        reason = f"queued for the next turn boundary: {', '.join(chosen) or 'nothing'}"
        return ApplyResult(event.name, applied=True, reason=reason + (f"; kept {kept}" if kept else ""))

    def _noop(self, event: Event, reason: str) -> ApplyResult:
        logger.info("session %s: %s ignored: %s", self.session.session_id, event.name, reason)
        return ApplyResult(event.name, applied=False, reason=reason)

    # -- the side thread -------------------------------------------------------------------------

    def _trigger(self) -> str | None:
        config = self.config
        if not self.enabled:
            return None
        if config.every_turns is not None and self.session.turn - self.last_run_turn >= config.every_turns:
            return "every_turns"
        if config.on_high_watermark and self._at_watermark():
            return "watermark"
        return None

    def _at_watermark(self) -> bool:
        """Whether the device budget reached its high watermark since the last check.

        The manager demotes as soon as usage passes the high watermark and stops under
        the low one, so at a turn end usage is never above the high watermark: pressure
        shows as spans the budget demoted since the last check, or as usage already in
        the band between the two watermarks.
        """
        budget = self.session.manager.budget
        limit = budget.last_limit
        if limit is None:
            return False
        demoted = sum(
            s.length
            for s in self.session.spans
            if s.state in (SpanState.ARCHIVED, SpanState.EVICTED) and s.span_id not in self.forgotten
        )
        grew = demoted > self.demoted_seen
        self.demoted_seen = demoted
        return grew or budget.usage_bytes() >= budget.limits.low_bytes(limit)

    def run_side_thread(self, trigger: str = "manual") -> ForgetDecision | None:
        """Fork, ask, parse, close the fork. None when there is nothing to offer (no model call)."""
        session = self.session
        current = session.turn + 1  # decided at a turn end: the turn that just ended is over
        candidates = self.candidates(current_turn=current)
        self.last_run_turn = session.turn
        if not candidates:
            return None
        listing = "\n".join(c.line() for c in candidates)
        prompt = self.config.prompt.replace(FORGET_PROMPT_FIELD, listing)
        offered = tuple(c.handle for c in candidates)
        started = time.perf_counter()
        # The fork answers one question and is closed: it needs no budget, no recall, no side thread.
        fork_config = session.config.with_overrides(
            {
                "budget": {"device_tokens": None, "device_bytes": None, "global_device_bytes": None},
                "recall": {"enabled": False},
                "forget": {"enabled": False},
            },
            prefix="agentkv.forget (side thread)",
        )
        fork = session.fork(f"{SIDE_THREAD_BRANCH}-{self.stats.runs}", config=fork_config)
        try:
            fork.extend([*session.messages, {"role": "user", "content": prompt}])
            opening = side_thread_opening(session.format.tool_format)
            text = _until_list_end(fork, 4 + 5 * len(candidates), offered, opening)
            fork_stats = fork.stats()
        finally:
            session.backend.close(fork.session_id)
        seconds = time.perf_counter() - started
        handles, error = parse_forget_answer(text, offered)
        chosen, refused = self._screen(handles, current_turn=current)
        decision = ForgetDecision(
            source="side_thread",
            turn=session.turn,
            trigger=trigger,
            offered=offered,
            chosen=chosen,
            refused=refused,
            malformed=error,
            answer=text,
            prefill_tokens=fork_stats.prefill_tokens,
            decode_tokens=fork_stats.generated_tokens,
            seconds=seconds,
        )
        stats = self.stats
        stats.runs += 1
        stats.prefill_tokens += decision.prefill_tokens
        stats.decode_tokens += decision.decode_tokens
        stats.seconds += seconds
        stats.refused += len(refused)
        stats.decisions.append(decision)
        if error is not None:
            stats.malformed += 1
            logger.info("session %s: forget side thread answer rejected: %s", session.session_id, error)
        else:
            logger.info(
                "session %s: forget side thread offered %s, chose %s",
                session.session_id,
                ", ".join(offered),
                ", ".join(chosen) or "nothing",
            )
        return decision

    def _screen(
        self, handles: Sequence[str], *, current_turn: int
    ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        by_handle = dict(self.tool_results())
        chosen: list[str] = []
        refused: list[tuple[str, str]] = []
        for handle in handles:
            span = by_handle.get(handle)
            why = "unknown handle" if span is None else self.guard(span, current_turn=current_turn)
            if why is None:
                chosen.append(handle)
            else:
                refused.append((handle, why))
        return tuple(chosen), tuple(refused)

    # -- the boundary --------------------------------------------------------------------------------

    def apply_pending(self) -> list[ApplyResult]:
        """Release what the pending decisions chose, re-checking the guard rails now."""
        if not self.pending:
            return []
        session = self.session
        decisions, self.pending = self.pending, []
        by_handle = dict(self.tool_results())
        results: list[ApplyResult] = []
        # At a boundary the turn in progress is over; during a turn (a manual call) it is still current.
        current = session.turn + 1
        for decision in decisions:
            for handle in decision.chosen:
                span = by_handle.get(handle)
                why = "gone (history rewritten)" if span is None else self.guard(span, current_turn=current)
                if span is None or why is not None:
                    self.stats.refused += 1
                    logger.info("session %s: %s kept at the boundary: %s", session.session_id, handle, why)
                    continue
                result = session.apply(ToolOutputForgotten(owner=span.owner, at_turn=session.turn))
                results.append(result)
                if result.applied:
                    self.forgotten.add(span.span_id)
                    # Released, not lost: recall may recompute it from its token ids when it is needed.
                    session.manager.recallable.add(span.span_id)
                    self.stats.released_spans += 1
                    self.stats.released_tokens += span.length
        return results


def _until_list_end(fork: SideThread, max_new_tokens: int, offered: Sequence[str], opening: str) -> str:
    """Greedy answer after the prefilled `opening`, stopped when the list closes or cannot be valid."""
    pieces: list[str] = []
    stream = fork.stream(max_new_tokens, prefix=opening)
    try:
        for piece in stream:
            pieces.append(piece)
            if "]" in piece or went_astray("".join(pieces), offered):
                break
    finally:
        stream.close()  # type: ignore[attr-defined]
    return "".join(pieces)
