"""What `agentkv demo` shows: the per-turn table, the summary, the plot and the files.

The demo itself — a LangGraph agent run twice — is `agentkv_langgraph.demo.run_demo`
(LangGraph is an optional extra, and the core never imports it). This module holds
the framework-free half: one `DemoTurn` row per turn and run, the live rich table,
the summary figures computed from the rows, the PNG of device KV bytes per turn, and
`demo.json`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from agentkv.config import AgentKVConfig

__all__ = [
    "AGENTKV_RUN",
    "DEFAULT_BUDGET_TOKENS",
    "FULL_RUN",
    "DemoTurn",
    "RecallAnswer",
    "demo_config",
    "demo_table",
    "first_word",
    "budget_line",
    "plot_device_bytes",
    "quiet_budget_warnings",
    "summarize",
    "summary_text",
    "write_demo_json",
]

AGENTKV_RUN = "agentkv"
"""Row label of the run with the lifecycle (reuse, events, device budget)."""
FULL_RUN = "full"
"""Row label of the baseline: a full cache, the whole history re-encoded on every model call."""

DEFAULT_BUDGET_TOKENS = 512
"""The agentkv run's device budget when neither `--budget` nor the config names one: about a
fifth of the default model's history by the twelfth turn, so the budget visibly bites."""

_STATE_LABELS = {
    "active": "act",
    "committed": "com",
    "archived": "arc",
    "evictable": "rel",
    "evicted": "evd",
}
"""Short labels for the table: act(ive), com(mitted), arc(hived), rel(eased = evictable), evd (evicted)."""


@dataclass
class DemoTurn:
    """One row of the live table: one user turn of one run (all its model calls together)."""

    run: str
    """`AGENTKV_RUN` or `FULL_RUN`."""
    turn: int
    """1-based user turn."""
    model_calls: int
    """Model calls the agent made in this turn (2 when it called a tool, else 1)."""
    prefilled: int
    """Tokens the model encoded in this turn's calls (the baseline re-encodes the whole history each call)."""
    reused: int
    """History tokens served from the cache instead (always 0 for the baseline)."""
    ttft_ms: float
    """From the turn's graph invocation to the first decoded text of its first model call."""
    device_bytes: int
    """KV bytes on the device at the end of the turn (baseline: the cache of its last call)."""
    quantized_bytes: int
    host_bytes: int
    tokens_by_state: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    """Lifecycle events the callback handler sent during the turn, in order."""
    moves: dict[str, int] = field(default_factory=dict)
    """Spans that changed state during the turn, by the state they reached (events, budget, recall)."""
    answer: str = ""
    """The agent's final answer of the turn (kept in demo.json, not shown in the table)."""
    seconds: float = 0.0
    """Wall time of the whole turn (every model call and tool)."""

    @property
    def total_bytes(self) -> int:
        """KV bytes held on every tier: device (full precision and quantized) plus host."""
        return self.device_bytes + self.quantized_bytes + self.host_bytes


@dataclass(frozen=True)
class RecallAnswer:
    """One recall question, answered by both runs after the conversation.

    The questions ask for one-word facts (a year, a city) after a completion prefix,
    so an answer is compared by its first word: what the model says after the fact
    ("1889 for the World's Fair" vs "1889.") is the weak model rambling, not recall.
    """

    question: str
    prefix: str
    gold: str
    agentkv: str
    full: str

    @property
    def same(self) -> bool:
        """Both runs answered the same first word (the fidelity check: the full cache is the reference)."""
        return first_word(self.agentkv) == first_word(self.full)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, with the verdicts: `same`, and per run whether the answer is the fact."""
        gold = first_word(self.gold)
        return {
            **asdict(self),
            "same": self.same,
            "agentkv_correct": first_word(self.agentkv) == gold,
            "full_correct": first_word(self.full) == gold,
        }


def first_word(text: str) -> str:
    """The first run of letters and digits, casefolded ("  Lyon, France." -> "lyon")."""
    match = re.search(r"\w+", text)
    return match.group(0).casefold() if match else ""


def demo_config(config: AgentKVConfig | None, budget_tokens: int | None) -> AgentKVConfig:
    """The agentkv run's settings: `config` with the demo's device budget applied.

    Args:
        config: Settings from `--config` (None = the defaults).
        budget_tokens: None = the config's own device budget (`device_tokens` /
            `device_bytes`), or `DEFAULT_BUDGET_TOKENS` when it has none; 0 = no
            device budget at all; n > 0 = n tokens (replacing the config's).

    Raises:
        ValueError: `budget_tokens` is negative.
    """
    config = config or AgentKVConfig()
    if budget_tokens is not None and budget_tokens < 0:
        msg = f"budget: expected 0 (unlimited) or a number of tokens > 0, got {budget_tokens}"
        raise ValueError(msg)
    if budget_tokens is None:
        if config.budget.device_tokens is not None or config.budget.device_bytes is not None:
            return config
        budget_tokens = DEFAULT_BUDGET_TOKENS
    budget: dict[str, int | None]
    if budget_tokens == 0:
        budget = {"device_tokens": None, "device_bytes": None, "global_device_bytes": None}
    else:
        budget = {"device_tokens": budget_tokens, "device_bytes": None}
    return config.with_overrides({"budget": budget}, prefix="budget")


def _unit(rows: Sequence[DemoTurn]) -> tuple[str, int]:
    """KiB for small caches (the tiny test model), MiB from 10 MiB up (the default model's)."""
    largest = max((max(r.device_bytes, r.host_bytes, r.quantized_bytes) for r in rows), default=0)
    return ("MiB", 2**20) if largest >= 10 * 2**20 else ("KiB", 2**10)


def _size(n: int, divisor: int) -> str:
    return f"{n / divisor:,.1f}" if divisor > 1024 else f"{n / divisor:,.0f}"


def demo_table(rows: Sequence[DemoTurn], *, budget_tokens: int | None, budget_bytes: int | None) -> Table:
    """The live table: one row per turn and run (the latest 30 rows)."""
    title = "agentkv demo: the tool agent with the KV lifecycle vs a full cache re-encoded every model call"
    if budget_tokens or budget_bytes:
        limit = f"{budget_tokens} tokens" if budget_tokens else f"{(budget_bytes or 0) / 1024:,.0f} KiB"
        title += f"\n(agentkv device budget {limit})"
    table = Table(title=title)
    unit, divisor = _unit(rows)
    columns = (
        ("run", "left"),
        ("turn", "right"),
        ("calls", "right"),
        ("prefilled", "right"),
        ("reused", "right"),
        ("TTFT ms", "right"),
        (f"device {unit}", "right"),
        (f"int {unit}", "right"),
        (f"host {unit}", "right"),
        (f"total {unit}", "right"),
        ("tokens by state", "left"),
        ("events", "left"),
        ("span moves", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows[-30:]:
        states = " ".join(f"{_STATE_LABELS.get(k, k)}={v}" for k, v in row.tokens_by_state.items() if v)
        moves = " ".join(f"→{_STATE_LABELS.get(k, k)} {v}" for k, v in row.moves.items() if v)
        table.add_row(
            row.run,
            str(row.turn),
            str(row.model_calls),
            str(row.prefilled),
            str(row.reused),
            f"{row.ttft_ms:,.0f}",
            _size(row.device_bytes, divisor),
            _size(row.quantized_bytes, divisor),
            _size(row.host_bytes, divisor),
            _size(row.total_bytes, divisor),
            states,
            ", ".join(row.events),
            moves,
        )
    return table


def summarize(
    rows: Sequence[DemoTurn],
    recall: Sequence[RecallAnswer],
    *,
    budget_tokens: int | None,
    budget_bytes: int | None,
    peak_device_bytes: dict[str, int],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary figures, from the rows of both runs and the recall answers.

    Args:
        rows: Every `DemoTurn` of both runs.
        recall: The recall questions with both runs' answers.
        budget_tokens: The agentkv run's device budget in tokens (None = none in tokens).
        budget_bytes: The same budget in bytes (None = unlimited).
        peak_device_bytes: Per run, the most device KV bytes held at any moment.
        extra: More entries for the summary (model, wall times, ...).

    Returns:
        A JSON-friendly dict; the ratios compare the baseline to agentkv (above 1: agentkv is better).
    """
    ours = [r for r in rows if r.run == AGENTKV_RUN]
    full = [r for r in rows if r.run == FULL_RUN]
    if not ours or not full or len(ours) != len(full):
        msg = f"summarize: both runs need the same turns, got {len(ours)} agentkv and {len(full)} full rows"
        raise ValueError(msg)
    ttft_total = {AGENTKV_RUN: sum(r.ttft_ms for r in ours), FULL_RUN: sum(r.ttft_ms for r in full)}
    summary: dict[str, Any] = {
        "turns": len(ours),
        "budget_tokens": budget_tokens,
        "budget_bytes": budget_bytes,
        "final_device_bytes": {AGENTKV_RUN: ours[-1].device_bytes, FULL_RUN: full[-1].device_bytes},
        "final_host_bytes": {AGENTKV_RUN: ours[-1].host_bytes, FULL_RUN: full[-1].host_bytes},
        "final_quantized_bytes": {AGENTKV_RUN: ours[-1].quantized_bytes, FULL_RUN: full[-1].quantized_bytes},
        "peak_device_bytes": dict(peak_device_bytes),
        "final_total_bytes": {AGENTKV_RUN: ours[-1].total_bytes, FULL_RUN: full[-1].total_bytes},
        # Device = full precision + quantized (both on the accelerator); total adds the host tier.
        "device_saved": 1
        - (ours[-1].device_bytes + ours[-1].quantized_bytes)
        / max(full[-1].device_bytes + full[-1].quantized_bytes, 1),
        "total_saved": 1 - ours[-1].total_bytes / max(full[-1].total_bytes, 1),
        "ttft_ms_last_turn": {AGENTKV_RUN: ours[-1].ttft_ms, FULL_RUN: full[-1].ttft_ms},
        "ttft_speedup_last_turn": full[-1].ttft_ms / max(ours[-1].ttft_ms, 1e-9),
        "ttft_ms_total": ttft_total,
        "ttft_speedup_overall": ttft_total[FULL_RUN] / max(ttft_total[AGENTKV_RUN], 1e-9),
        "total_prefilled": {
            AGENTKV_RUN: sum(r.prefilled for r in ours),
            FULL_RUN: sum(r.prefilled for r in full),
        },
        "total_reused": {AGENTKV_RUN: sum(r.reused for r in ours), FULL_RUN: sum(r.reused for r in full)},
        "events": sum(len(r.events) for r in ours),
        "recall": [a.to_dict() for a in recall],
        "recall_matches_full_cache": all(a.same for a in recall),
    }
    summary.update(extra or {})
    return summary


def summary_text(summary: dict[str, Any], files: Sequence[Path]) -> str:
    """The summary panel's text."""
    final = summary["final_device_bytes"]
    unit, divisor = ("MiB", 2**20) if final[FULL_RUN] >= 10 * 2**20 else ("KiB", 2**10)
    last = summary["ttft_ms_last_turn"]
    total = summary["ttft_ms_total"]
    prefilled = summary["total_prefilled"]
    budget = summary.get("budget_tokens")
    ours_device = final[AGENTKV_RUN] + summary["final_quantized_bytes"][AGENTKV_RUN]
    full_device = final[FULL_RUN] + summary["final_quantized_bytes"][FULL_RUN]
    totals = summary["final_total_bytes"]
    lines = [
        f"KV at the end: device {_size(ours_device, divisor)} vs {_size(full_device, divisor)} {unit} "
        f"({summary['device_saved']:.0%} less"
        + (f", {budget}-token budget" if budget else "")
        + f"); host {_size(summary['final_host_bytes'][AGENTKV_RUN], divisor)} {unit}; "
        f"total {_size(totals[AGENTKV_RUN], divisor)} vs {_size(totals[FULL_RUN], divisor)} {unit} "
        f"({summary['total_saved']:.0%} less) (agentkv vs full; device includes "
        f"{_size(summary['final_quantized_bytes'][AGENTKV_RUN], divisor)} {unit} quantized)",
        f"time to first token, last turn: {last[AGENTKV_RUN]:,.0f} ms vs {last[FULL_RUN]:,.0f} ms "
        f"({summary['ttft_speedup_last_turn']:.1f}x); all turns: {total[AGENTKV_RUN]:,.0f} ms vs "
        f"{total[FULL_RUN]:,.0f} ms ({summary['ttft_speedup_overall']:.1f}x)",
        f"tokens prefilled in total: {prefilled[AGENTKV_RUN]:,} vs {prefilled[FULL_RUN]:,} "
        f"({summary['total_reused'][AGENTKV_RUN]:,} served from the cache); "
        f"{summary['events']} lifecycle events",
    ]
    if "budget_checks_unmet" in summary:
        lines.append(budget_line(summary))
    repaired = summary.get("repaired_tool_calls")
    if repaired:
        lines.append(
            "forced tool calls whose arguments did not parse (called with defaults): "
            f"agentkv {repaired[AGENTKV_RUN]}, full {repaired[FULL_RUN]}"
        )
    yes = {True: "yes", False: "no"}
    for answer in summary["recall"]:
        lines += [
            f"recall: {answer['question']!r} -> {answer['prefix']!r} ... (the fact: {answer['gold']})",
            f"  agentkv: {answer['agentkv'].strip()!r} ({yes[answer['agentkv_correct']]}); "
            f"full: {answer['full'].strip()!r} ({yes[answer['full_correct']]}); "
            f"same answer as the full cache: {yes[answer['same']]}",
        ]
    if "wall_seconds" in summary:
        wall = summary["wall_seconds"]
        lines.append(
            f"wall time of the turns: agentkv {wall[AGENTKV_RUN]:.1f} s, full {wall[FULL_RUN]:.1f} s"
        )
    lines.append("wrote " + ", ".join(str(f) for f in files))
    return "\n".join(lines)


class _BudgetWarningFilter(logging.Filter):
    """Drops the lifecycle's "device budget … cannot be met" warnings and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and "cannot be met" in str(record.msg):
            self.dropped += 1
            return False
        return True


@contextmanager
def quiet_budget_warnings() -> Iterator[_BudgetWarningFilter]:
    """Inside the block, budget warnings from agentkv's loggers are not printed (the demo sums them up).

    A demo turn whose pinned and active spans exceed the budget would otherwise print
    a WARNING over the live table on every turn; the summary's `budget_line` says it
    once, with the count from `SessionStats.budget_unmet`. Other warnings still show.
    """
    quiet = _BudgetWarningFilter()
    names = ["agentkv", *(n for n in logging.Logger.manager.loggerDict if n.startswith("agentkv."))]
    loggers = [logging.getLogger(n) for n in names]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield quiet
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def budget_line(summary: dict[str, Any]) -> str:
    """One line on the device budget for the whole run (instead of a warning per turn)."""
    unmet = int(summary.get("budget_checks_unmet", 0))
    budget = summary.get("budget_tokens")
    name = f"the {budget}-token device budget" if budget else "the device budget"
    if not summary.get("budget_bytes"):
        return "device budget: none (unlimited)"
    if unmet == 0:
        return f"{name} was met after every operation"
    peak = summary["peak_device_bytes"][AGENTKV_RUN]
    return (
        f"{name} was exceeded after {unmet} operation(s) (pinned and active spans alone were larger; "
        f"they are never demoted); peak device {peak / 2**20:,.1f} MiB vs budget "
        f"{summary['budget_bytes'] / 2**20:,.1f} MiB"
    )


def write_demo_json(path: Path, summary: dict[str, Any], rows: Sequence[DemoTurn]) -> Path:
    """`demo.json`: the summary and every row."""
    path.write_text(json.dumps({"summary": summary, "turns": [asdict(r) for r in rows]}, indent=2))
    return path


def plot_device_bytes(rows: Sequence[DemoTurn], budget_bytes: int | None, path: Path) -> Path:
    """Device KV bytes per turn for both runs (and agentkv's host tier), with the budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r.run == AGENTKV_RUN]
    full = [r for r in rows if r.run == FULL_RUN]
    unit, divisor = _unit(rows)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(
        [r.turn for r in full],
        [r.device_bytes / divisor for r in full],
        "o-",
        label="full cache, re-encoded each call",
    )
    ax.plot([r.turn for r in ours], [r.device_bytes / divisor for r in ours], "o-", label="agentkv lifecycle")
    if any(r.host_bytes for r in ours):
        ax.plot(
            [r.turn for r in ours], [r.host_bytes / divisor for r in ours], "--", label="agentkv host tier"
        )
        ax.plot(
            [r.turn for r in ours],
            [r.total_bytes / divisor for r in ours],
            "-.",
            label="agentkv total (device + host)",
        )
    if any(r.quantized_bytes for r in ours):
        ax.plot(
            [r.turn for r in ours],
            [r.quantized_bytes / divisor for r in ours],
            ":",
            label="agentkv quantized",
        )
    if budget_bytes:
        ax.axhline(budget_bytes / divisor, color="grey", linestyle=":", label="device budget")
    ax.set_xlabel("user turn")
    ax.set_ylabel(f"KV bytes ({unit})")
    ax.legend()
    ax.set_title("KV bytes at the end of each turn (device, host and total)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
