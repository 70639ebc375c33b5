"""`agentkv demo`: what the lifecycle does for an agent, in one command.

The same tool-using conversation runs twice in one process: once on an agentkv
session (reuse + lifecycle events + a device budget), once the way
`ChatHuggingFace` works today (the whole history re-encoded every turn on a
plain full cache). A live table shows each turn; at the end, a summary and a
PNG of device KV bytes per turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from agentkv.backend.transformers import TransformersBackend
from agentkv.bench.conversation import build_conversation, iter_histories
from agentkv.config import AgentKVConfig
from agentkv.events import ToolCallCompleted, TurnEnded
from agentkv.inspect import plot_span_strip

RECALL_QUESTION = "What is the reference number of my booking 0?"
RECALL_PREFIX = "The reference number of booking 0 is"


@dataclass
class DemoTurn:
    """One row of the live table."""

    run: str
    turn: int
    prefilled: int
    reused: int
    ttft_ms: float
    device_bytes: int
    quantized_bytes: int
    host_bytes: int
    tokens_by_state: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f}"


def _table(rows: list[DemoTurn], budget_bytes: int | None) -> Table:
    title = "agentkv demo: lifecycle session vs full cache re-encoded each turn"
    if budget_bytes:
        title += f" (device budget {budget_bytes / 1024:,.0f} KiB)"
    table = Table(title=title)
    for name in (
        "run",
        "turn",
        "prefilled",
        "reused",
        "TTFT ms",
        "device KiB",
        "int KiB",
        "host KiB",
        "states",
        "events",
    ):
        table.add_column(name, justify="left" if name in ("run", "states", "events") else "right")
    for row in rows[-24:]:
        states = " ".join(f"{k[:3]}={v}" for k, v in row.tokens_by_state.items() if v)
        table.add_row(
            row.run,
            str(row.turn),
            str(row.prefilled),
            str(row.reused),
            f"{row.ttft_ms:,.0f}",
            _kib(row.device_bytes),
            _kib(row.quantized_bytes),
            _kib(row.host_bytes),
            states,
            ", ".join(row.events),
        )
    return table


def run_demo(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    config: AgentKVConfig | None = None,
    turns: int = 12,
    budget_tokens: int | None = 512,
    max_new_tokens: int = 16,
    out_dir: str | Path = "agentkv-out",
    console: Console | None = None,
    on_turn: Callable[[DemoTurn], None] | None = None,
) -> dict[str, Any]:
    """Run the demo; returns the summary and writes `demo.json`, `device_bytes.png`, `spans.png`."""
    console = console or Console()
    base = config or AgentKVConfig()
    if budget_tokens is not None and not base.budget.limited:
        base = base.with_overrides({"budget": {"device_tokens": budget_tokens}})
    lifecycle_backend = TransformersBackend(model, tokenizer, base)
    full_backend = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"policy": "full"}))
    conversation = build_conversation(turns, tool_words=80)
    rows: list[DemoTurn] = []
    answers: list[str] = []
    budget_bytes = base.budget.device_bytes or (
        base.budget.device_tokens * lifecycle_backend.runner.bytes_per_token
        if base.budget.device_tokens
        else None
    )
    session = lifecycle_backend.session("demo")

    def record(row: DemoTurn, live: Live) -> None:
        rows.append(row)
        live.update(_table(rows, budget_bytes))
        if on_turn is not None:
            on_turn(row)

    with Live(_table(rows, budget_bytes), console=console, refresh_per_second=4, transient=False) as live:
        for index, history in enumerate(iter_histories(conversation, answers)):
            started = time.perf_counter()
            result = session.extend(history)
            stream = session.stream(max_new_tokens=max_new_tokens)
            first = next(stream, "")
            ttft = time.perf_counter() - started
            answer = first + "".join(stream)
            answers.append(answer)
            events = []
            if conversation[index].tool_name is not None:
                session.apply(ToolCallCompleted(f"call_{index}"))
                events.append("tool_call_completed")
            session.apply(TurnEnded())
            events.append("turn_ended")
            stats = session.stats()
            record(
                DemoTurn(
                    "agentkv",
                    index + 1,
                    result.prefilled_tokens,
                    result.reused_tokens,
                    ttft * 1000,
                    stats.device_bytes,
                    stats.quantized_bytes,
                    stats.host_bytes,
                    dict(stats.tokens_by_state),
                    events,
                ),
                live,
            )
        for index, history in enumerate(iter_histories(conversation, answers)):
            fresh = full_backend.session(f"full-{index}")
            started = time.perf_counter()
            result = fresh.extend(history)
            stream = fresh.stream(max_new_tokens=max_new_tokens)
            next(stream, "")
            ttft = time.perf_counter() - started
            for _ in stream:
                pass
            stats = fresh.stats()
            record(
                DemoTurn(
                    "full",
                    index + 1,
                    result.prefilled_tokens,
                    result.reused_tokens,
                    ttft * 1000,
                    stats.device_bytes,
                    0,
                    0,
                    dict(stats.tokens_by_state),
                    [],
                ),
                live,
            )
            if index < len(conversation) - 1:
                full_backend.close(fresh.session_id)

    final_history = [
        *history,
        {"role": "assistant", "content": answers[-1]},
        {"role": "user", "content": RECALL_QUESTION},
    ]
    session.extend(final_history)
    ours = session.generate(max_new_tokens=12, prefix=RECALL_PREFIX)
    reference = full_backend.session(f"full-{len(conversation) - 1}")
    reference.extend(final_history)
    theirs = reference.generate(max_new_tokens=12, prefix=RECALL_PREFIX)

    agentkv_rows = [r for r in rows if r.run == "agentkv"]
    full_rows = [r for r in rows if r.run == "full"]
    summary = {
        "turns": turns,
        "budget_bytes": budget_bytes,
        "final_device_bytes": {"agentkv": agentkv_rows[-1].device_bytes, "full": full_rows[-1].device_bytes},
        "peak_device_bytes": {
            "agentkv": session.stats().peak_device_bytes,
            "full": max(r.device_bytes for r in full_rows),
        },
        "memory_saved": 1 - agentkv_rows[-1].device_bytes / max(full_rows[-1].device_bytes, 1),
        "last_turn_ttft_ms": {"agentkv": agentkv_rows[-1].ttft_ms, "full": full_rows[-1].ttft_ms},
        "ttft_speedup_last_turn": full_rows[-1].ttft_ms / max(agentkv_rows[-1].ttft_ms, 1e-9),
        "total_prefilled": {
            "agentkv": sum(r.prefilled for r in agentkv_rows),
            "full": sum(r.prefilled for r in full_rows),
        },
        "recall_question": RECALL_QUESTION,
        "recall_answer": {"agentkv": RECALL_PREFIX + ours, "full": RECALL_PREFIX + theirs},
        "recall_matches_full_cache": ours.strip() == theirs.strip(),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(
        json.dumps({"summary": summary, "turns": [asdict(r) for r in rows]}, indent=2)
    )
    _plot_bytes(agentkv_rows, full_rows, budget_bytes, out / "device_bytes.png")
    plot_span_strip(session, out / "spans.png")
    session.save_snapshot(str(out / "session.json"))
    console.print(Panel.fit(_summary_text(summary, out), title="summary"))
    return summary


def _summary_text(summary: dict[str, Any], out: Path) -> str:
    final = summary["final_device_bytes"]
    ttft = summary["last_turn_ttft_ms"]
    prefilled = summary["total_prefilled"]
    lines = [
        f"device KV at the end: agentkv {final['agentkv'] / 1024:,.0f} KiB "
        f"vs full {final['full'] / 1024:,.0f} KiB "
        f"({summary['memory_saved']:.0%} saved)",
        f"time to first token, last turn: {ttft['agentkv']:,.0f} ms vs {ttft['full']:,.0f} ms "
        f"({summary['ttft_speedup_last_turn']:.1f}x faster)",
        f"tokens prefilled in total: {prefilled['agentkv']:,} vs {prefilled['full']:,}",
        f"recall: {summary['recall_question']!r}",
        f"  agentkv: {summary['recall_answer']['agentkv']!r}",
        f"  full:    {summary['recall_answer']['full']!r}",
        f"  same answer as the full cache: {summary['recall_matches_full_cache']}",
        f"wrote {out / 'demo.json'}, {out / 'device_bytes.png'}, {out / 'spans.png'}, {out / 'session.json'}",
    ]
    return "\n".join(lines)


def _plot_bytes(ours: list[DemoTurn], full: list[DemoTurn], budget: int | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(
        [r.turn for r in full], [r.device_bytes / 1024 for r in full], "o-", label="full cache (re-encoded)"
    )
    ax.plot([r.turn for r in ours], [r.device_bytes / 1024 for r in ours], "o-", label="agentkv lifecycle")
    ax.plot([r.turn for r in ours], [r.host_bytes / 1024 for r in ours], "--", label="agentkv host tier")
    if budget:
        ax.axhline(budget / 1024, color="grey", linestyle=":", label="device budget")
    ax.set_xlabel("turn")
    ax.set_ylabel("KV bytes (KiB)")
    ax.legend()
    ax.set_title("Device KV bytes per turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
