"""`agentkv demo`: the tool-using LangGraph agent, with the KV lifecycle and without, side by side.

The agent (`agentkv_langgraph.demo_agent`: model ⇄ `ToolNode`, twelve scripted user
turns, forced tool calls) runs twice in one process on the same model:

1. **agentkv**: `ChatAgentKV` on one session per thread, the graph wrapped by
   `with_kv_lifecycle` (tool ends, turn ends → events), and a device KV budget.
2. **full**: the same graph with `ReencodingChatAgentKV`, a stateless model that keeps
   no cache between calls — a fresh full-cache session per model call, the whole
   history prefilled every time. That is what `ChatHuggingFace` does today.

Each user turn adds a row to a live rich table (`agentkv.demo.demo_table`): model
calls, tokens prefilled and reused, time to first token, KV bytes per tier, tokens per
span state, the events the handler sent and the span moves they (and the budget, and
recall) caused. Then both runs answer recall questions about early facts, completion
style, and the summary says whether agentkv answered as the full cache did.

**Time to first token** of a turn: from the turn's `graph.invoke` until the first
decoded text of the turn's first model call. The first call is usually a forced tool
call whose text is not streamed, so the time is measured where the tokens are made:
`on_chat_model_start` of that call (a callback) plus the call's own
`response_metadata["time_to_first_token_s"]` (`ChatAgentKV`: from the call's start to
its first decoded text). It includes everything the turn does before the model can
answer: graph overhead, matching the history, prefill, recall, budget demotions.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from uuid import UUID

import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.runnables import RunnableConfig
from pydantic import PrivateAttr
from rich.console import Console
from rich.live import Live
from rich.panel import Panel

from agentkv import AgentKVConfig, AnySession, Session, TransformersBackend, TurnEnded
from agentkv.demo import (
    AGENTKV_RUN,
    FULL_RUN,
    DemoTurn,
    RecallAnswer,
    demo_config,
    demo_table,
    plot_device_bytes,
    summarize,
    summary_text,
    write_demo_json,
)
from agentkv.inspection import plot_span_strip
from agentkv_langchain import ChatAgentKV
from agentkv_langgraph.demo_agent import RECALL_QUESTIONS, SCRIPT, RecallQuestion, build_graph, turn_input
from agentkv_langgraph.graph import with_kv_lifecycle

__all__ = ["DEMO_THREAD", "ReencodingChatAgentKV", "run_demo"]

DEMO_THREAD = "demo"
"""The LangGraph thread (and agentkv session) of the agentkv run."""

RECALL_MAX_NEW_TOKENS = 8
"""Tokens generated after a recall question's prefix: the fact and a word or two."""


class ReencodingChatAgentKV(ChatAgentKV):
    """The baseline chat model: the same in-process model with no KV cache kept between calls.

    Every call opens a fresh session on `backend` (build it with `policy: full` and no
    budget) and prefills the whole history, as a stateless chat model does. The
    previous call's session is closed when the next call starts, so the last one can
    still be inspected (`last_session`). Calls must not overlap (the demo is sequential).
    """

    _calls: int = PrivateAttr(default=0)
    _last: Session | None = PrivateAttr(default=None)

    def _session(self, metadata: Mapping[str, Any]) -> AnySession:
        if self._last is not None:
            self.backend.close(self._last.session_id)
        self._calls += 1
        session = self.backend.session(f"reencode-call-{self._calls}")
        if not isinstance(session, Session):
            msg = f"the re-encode baseline needs a TransformersBackend, got {type(self.backend).__name__}"
            raise TypeError(msg)
        self._last = session
        return session

    @property
    def last_session(self) -> Session | None:
        """The session of the latest call (its KV is that call's full cache), None before any."""
        return self._last


class _TurnCalls(BaseCallbackHandler):
    """Records one turn's model calls: when each started and what it reported at its end.

    The chat model's own figures (prefill, reuse, time to first token) are read from
    the `LLMResult` at `on_llm_end`, not from the graph state: the agent may replace a
    message (a repaired tool call), and the replacement carries no metadata.
    """

    raise_error = True
    """A bug here should stop the demo, not silently skew its figures."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[UUID, float] = {}
        self.metadata: dict[UUID, dict[str, Any]] = {}

    def on_chat_model_start(
        self, serialized: dict[str, Any] | None, messages: Any, *, run_id: UUID, **kwargs: Any
    ) -> None:
        """Remember when the call started."""
        self.started[run_id] = time.perf_counter()

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        """Keep the call's `response_metadata`."""
        generation = response.generations[0][0] if response.generations and response.generations[0] else None
        if isinstance(generation, ChatGeneration):
            self.metadata[run_id] = dict(generation.message.response_metadata)
        else:
            self.metadata[run_id] = {}

    def calls(self) -> list[dict[str, Any]]:
        """The finished calls in start order."""
        return [self.metadata[r] for r in sorted(self.metadata, key=lambda r: self.started.get(r, 0.0))]

    def first_token_at(self) -> float | None:
        """`perf_counter()` time of the first decoded text of the turn's first call."""
        if not self.started:
            return None
        first = min(self.started, key=self.started.__getitem__)
        seconds = self.metadata.get(first, {}).get("time_to_first_token_s")
        return self.started[first] + seconds if seconds is not None else None


def _states(session: Session | None) -> dict[int, str]:
    return {} if session is None else {s.span_id: s.state.value for s in session.spans}


def _moves(before: dict[int, str], session: Session | None) -> dict[str, int]:
    """Spans whose state changed during the turn (new spans count where they ended up, if not active)."""
    after = _states(session)
    moved = Counter(state for span, state in after.items() if before.get(span, "active") != state)
    return dict(moved)


def _play_turn(
    graph: Any,
    run: str,
    index: int,
    *,
    session: Callable[[], Session | None],
    events: Callable[[], list[str]],
) -> DemoTurn:
    """Run scripted turn `index` on one graph and measure it (see the module docstring for TTFT)."""
    calls = _TurnCalls()
    config: RunnableConfig = {"configurable": {"thread_id": DEMO_THREAD}, "callbacks": [calls]}
    events_before = len(events())
    states_before = _states(session())
    started = time.perf_counter()
    out = graph.invoke(turn_input(index), config)
    ended = time.perf_counter()
    first_token_at = calls.first_token_at()
    done = calls.calls()
    current = session()
    stats = current.stats() if current is not None else None
    return DemoTurn(
        run=run,
        turn=index + 1,
        model_calls=len(done),
        prefilled=sum(int(c.get("prefill_tokens", 0)) for c in done),
        reused=sum(int(c.get("reused_tokens", 0)) for c in done),
        ttft_ms=1000 * ((first_token_at or ended) - started),
        device_bytes=stats.device_bytes if stats else 0,
        quantized_bytes=stats.quantized_bytes if stats else 0,
        host_bytes=stats.host_bytes if stats else 0,
        tokens_by_state=dict(stats.tokens_by_state) if stats else {},
        events=events()[events_before:],
        moves=_moves(states_before, current) if run == AGENTKV_RUN else {},
        answer=str(out["messages"][-1].content),
        seconds=ended - started,
    )


def _ask(session: Session, question: RecallQuestion) -> str:
    """One recall question, completion style, as a new user turn of `session`."""
    session.extend([*session.messages, {"role": "user", "content": question.question}])
    answer = session.generate(max_new_tokens=RECALL_MAX_NEW_TOKENS, prefix=question.prefix)
    session.apply(TurnEnded())
    return answer


def run_demo(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    config: AgentKVConfig | None = None,
    turns: int = len(SCRIPT),
    budget_tokens: int | None = None,
    max_new_tokens: int = 24,
    out_dir: str | Path = "agentkv-out",
    console: Console | None = None,
    on_turn: Callable[[DemoTurn], None] | None = None,
) -> dict[str, Any]:
    """Run the agent with and without agentkv; show the table and summary; write the files.

    Args:
        model: The causal LM (both runs share it).
        tokenizer: Its tokenizer.
        config: The agentkv run's settings (an `agentkv:` YAML section); None = defaults.
        turns: Scripted user turns per run (the script repeats past its twelve).
        budget_tokens: The agentkv run's device budget: None = the config's, or
            `agentkv.demo.DEFAULT_BUDGET_TOKENS` (512) when it has none; 0 = unlimited.
        max_new_tokens: Length limit of each model call's answer.
        out_dir: Where `demo.json`, `device_bytes.png`, `spans.png` (the agentkv
            session's span map) and `session.json` (its snapshot) go.
        console: Where the live table and the summary are drawn (default: stdout; 200
            columns wide when it is not a terminal).
        on_turn: Called with each row as it is added.

    Returns:
        The summary (also in `demo.json`): final and peak device bytes, memory saved,
        TTFT on the last turn and over all turns, prefill totals, the recall answers.

    Raises:
        ValueError: `turns < 1`, `max_new_tokens < 1` or a bad budget.
    """
    if turns < 1 or max_new_tokens < 1:
        msg = f"turns and max_new_tokens must be >= 1, got turns={turns}, max_new_tokens={max_new_tokens}"
        raise ValueError(msg)
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or file would get 80 columns and a squeezed table
            console = Console(width=200)
    settings = demo_config(config, budget_tokens)
    ours = TransformersBackend(model, tokenizer, settings)
    full = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"policy": "full"}))
    limit_bytes = ours.session(DEMO_THREAD).budget_limits().device_bytes
    budget = {"budget_tokens": settings.budget.device_tokens, "budget_bytes": limit_bytes}
    rows: list[DemoTurn] = []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    lifecycle_graph = with_kv_lifecycle(
        build_graph(ChatAgentKV(backend=ours, max_tokens=max_new_tokens)), backend=ours, config=settings
    )
    handler = lifecycle_graph.agentkv.handler
    baseline = ReencodingChatAgentKV(backend=full, max_tokens=max_new_tokens)
    baseline_graph = build_graph(baseline)

    with Live(demo_table(rows, **budget), console=console, refresh_per_second=4) as live:

        def record(row: DemoTurn) -> None:
            rows.append(row)
            live.update(demo_table(rows, **budget))
            if on_turn is not None:
                on_turn(row)

        # Turn by turn, alternating runs: a machine whose load drifts slows both alike.
        for index in range(turns):
            record(
                _play_turn(
                    lifecycle_graph,
                    AGENTKV_RUN,
                    index,
                    session=lambda: ours.get(DEMO_THREAD),
                    events=lambda: [event.name for sid, event in handler.events if sid == DEMO_THREAD],
                )
            )
            record(
                _play_turn(
                    baseline_graph, FULL_RUN, index, session=lambda: baseline.last_session, events=list
                )
            )
    console.line()  # a file or pipe gets the final table without a trailing newline

    session = ours.get(DEMO_THREAD)
    peak = {AGENTKV_RUN: session.stats().peak_device_bytes}
    reference = baseline.last_session
    if reference is None:  # pragma: no cover - every turn makes at least one model call
        msg = "the baseline made no model call"
        raise RuntimeError(msg)
    peak[FULL_RUN] = max(r.device_bytes for r in rows if r.run == FULL_RUN)
    recall = [
        RecallAnswer(q.question, q.prefix, q.gold, agentkv=_ask(session, q), full=_ask(reference, q))
        for q in RECALL_QUESTIONS
    ]
    thread: RunnableConfig = {"configurable": {"thread_id": DEMO_THREAD}}
    summary = summarize(
        rows,
        recall,
        **budget,
        peak_device_bytes=peak,
        extra={
            "model": baseline.model_name,
            "max_new_tokens": max_new_tokens,
            "policy": settings.policy.name,
            "archive_tier": settings.archive_tier,
            "wall_seconds": {
                run: sum(r.seconds for r in rows if r.run == run) for run in (AGENTKV_RUN, FULL_RUN)
            },
            "handler_errors": handler.errors,
            "repaired_tool_calls": {
                AGENTKV_RUN: lifecycle_graph.get_state(thread).values.get("repaired", 0),
                FULL_RUN: baseline_graph.get_state(thread).values.get("repaired", 0),
            },
        },
    )
    files = [
        write_demo_json(out / "demo.json", summary, rows),
        plot_device_bytes(rows, limit_bytes, out / "device_bytes.png"),
        plot_span_strip(session, out / "spans.png"),
        out / "session.json",
    ]
    session.save_snapshot(str(out / "session.json"))
    console.print(Panel.fit(summary_text(summary, files), title="agentkv demo: summary"))
    return summary
