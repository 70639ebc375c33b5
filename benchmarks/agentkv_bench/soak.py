"""`agentkv bench soak`: hundreds of agent turns in one session under a fixed device budget.

A soak answers the question a short benchmark cannot: after 300 turns of tool
calls, confirmations and recalls, is the session still inside its budget, is the
host tier still inside its limit, and is a turn still as fast as it was at the
start (no leak, no creeping re-encoding, no book-keeping that grows with history)?

The conversation. Each turn is a user message (a fact to remember, or a question
about an earlier one), every few turns a tool round trip (a call and a noisy
result, then `ToolCallCompleted`, sometimes `ToolCallFailed`), the model's short
answer (`max_new_tokens`, greedy), and `TurnEnded`; every few turns the user
confirms an answer (`UserConfirmed`, a pin) and an older confirmation is
released again. Text comes from a seeded generator, so every run is the same.

Positions. A model has a fixed number of positions (the tiny test model 2048,
SmolLM2 8192), so no single history can grow for 300 turns. Like LangChain's
summarisation middleware, the agent compacts its history when the next turn
would pass `context_tokens`: the system prompt stays, a summary message (the
latest facts) replaces the old turns, the last turn is kept. The session sees a
rewrite, crops from the first changed message and re-encodes only the new suffix.

Budget. A full-cache run holds at most `context_tokens` tokens of KV (the most
history the agent ever keeps). The session gets `budget_fraction` of that as its
device budget (`budget.device_tokens`), and half of it as its host budget
(`budget.host_tokens`), with the default watermarks (high 1.0, low 0.8) and the
host archive tier.

Nothing is asserted: `run_soak` records per turn the device bytes (attended plus
quantized, what the budget counts) against the high watermark, the host bytes
against the host limit and the wall time of the turn, writes `soak.json` and
`soak.png`, and returns a summary (`agentkv bench soak` prints it; a test checks it).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import torch

from agentkv.backend.session import Session
from agentkv.backend.transformers import TransformersBackend
from agentkv.chat import normalize_messages
from agentkv.config import AgentKVConfig
from agentkv.events import Event, ToolCallCompleted, ToolCallFailed, TurnEnded, UserConfirmed
from agentkv.lifecycle import Lease
from agentkv.progress import ProgressCallback, report
from agentkv_bench.conversation import SYSTEM_PROMPT, noisy_document

_CITIES = ("Paris", "Lisbon", "Osaka", "Quito", "Tallinn", "Nairobi", "Hobart", "Bergen", "Cusco", "Tbilisi")
_ITEMS = ("booking", "parcel", "locker", "invoice", "ticket", "visa")

TOOL_EVERY = 3
"""Every third turn makes a tool call."""
FAILED_EVERY = 5
"""Every fifth tool call fails (its error output is committed like a result, its call released)."""
CONFIRM_EVERY = 7
"""Every seventh turn the user confirms the answer (a pin)."""
PIN_TURNS = 14
"""A confirmation is released again this many turns later, so pins do not pile up forever."""
QUESTION_EVERY = 4
"""Every fourth user message asks about an earlier fact (recall traffic)."""
WINDOW_TURN_TOKENS = 220
"""Room kept free for one more turn before compacting; grows to twice the largest turn seen."""


@dataclass(frozen=True)
class SoakTurn:
    """What one turn cost and left behind."""

    turn: int
    seconds: float
    """Wall time of the turn: extend, answer and events."""
    device_bytes: int
    """Attended KV on the device after the turn."""
    usage_bytes: int
    """What the device budget counts: attended plus quantized archives."""
    host_bytes: int
    logical_tokens: int
    attended_tokens: int
    quantized_tokens: int
    """Attended tokens held at int4/int2 (the attended quantized tier)."""
    prefill_tokens: int
    """Tokens encoded this turn."""
    budget_satisfied: bool
    compacted: bool
    """True when the agent summarised its history before this turn."""
    faults: int


def _fact(rng: random.Random, turn: int) -> tuple[str, str]:
    """A fact to remember: (the sentence, the value a later question asks for)."""
    city = _CITIES[turn % len(_CITIES)]
    item = _ITEMS[turn % len(_ITEMS)]
    value = f"{rng.randint(1000, 9999)}"
    return f"Note {turn}: my {item} for {city} has reference {value}.", f"{item} for {city}"


def _summary(facts: list[str]) -> str:
    return "Summary of our conversation so far: " + " ".join(facts[-6:])


def _compact(history: list[dict[str, Any]], facts: list[str]) -> list[dict[str, Any]]:
    """System prompt, a summary of the facts, and the last turn (from its user message on)."""
    last_user = max(i for i, m in enumerate(history) if m["role"] == "user")
    summary = {"role": "user", "content": _summary(facts)}
    return [history[0], summary, {"role": "assistant", "content": "Noted."}, *history[last_user:]]


def run_soak(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    turns: int = 300,
    budget_fraction: float = 0.25,
    out_dir: str | Path = "runs/soak",
    context_tokens: int | None = None,
    max_new_tokens: int = 3,
    tool_words: int = 30,
    seed: int = 0,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run `turns` agent turns in one session under a device budget; write `soak.json` and `soak.png`.

    Args:
        model: A causal LM (the tiny test model, the default SmolLM2, any HF model).
        tokenizer: Its tokenizer.
        turns: Agent turns to run (one user message each).
        budget_fraction: Device budget as a fraction of `context_tokens` (see the module docstring).
        out_dir: Where `soak.json` and `soak.png` go (created).
        context_tokens: The most history the agent keeps before compacting; default
            `min(model positions, 2048)`.
        max_new_tokens: Length of each model answer (short: a soak measures the cache, not decoding).
        tool_words: Words in each tool result.
        seed: Seeds the conversation text.
        progress: Called with a `ProgressStep` after each turn (the CLI shows a bar).

    Returns:
        The summary dict (also the `summary` entry of `soak.json`).

    Raises:
        ValueError: `turns < 1` or `budget_fraction` outside (0, 1].
    """
    if turns < 1:
        msg = f"turns must be >= 1, got {turns}"
        raise ValueError(msg)
    if not 0 < budget_fraction <= 1:
        msg = f"budget_fraction must be in (0, 1], got {budget_fraction}"
        raise ValueError(msg)
    positions = getattr(model.config, "max_position_embeddings", None) or 2048
    window = int(context_tokens or min(int(positions), 2048))
    device_tokens = max(16, int(budget_fraction * window))
    config = AgentKVConfig.from_dict(
        {
            "budget": {"device_tokens": device_tokens, "host_tokens": max(16, window // 2)},
            "archive_tier": "host",
        }
    )
    backend = TransformersBackend(model, tokenizer, config)
    session = backend.session("soak")
    bpt = backend.runner.bytes_per_token
    limit = session.budget_limits().device_bytes or 0
    high_bytes = session.budget_limits().high_bytes(limit)
    host_limit = session.budget_limits().host_bytes or 0

    rng = random.Random(seed)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    facts: list[str] = []
    asked: list[str] = []
    produced: dict[str, list[int]] = {}
    pins: list[tuple[int, Lease]] = []
    rows: list[SoakTurn] = []
    compactions = 0
    reserve = WINDOW_TURN_TOKENS
    started = time.perf_counter()
    for turn in range(1, turns + 1):
        before_turn = session.logical_length
        compacted = before_turn + reserve > window
        if compacted:
            history = _compact(history, facts)
            compactions += 1
        t0 = time.perf_counter()
        prefill_before = session.counters.prefill_tokens
        if turn % QUESTION_EVERY == 0 and asked:
            history.append({"role": "user", "content": f"What was the reference of my {rng.choice(asked)}?"})
        else:
            sentence, key = _fact(rng, turn)
            facts.append(sentence)
            asked.append(key)
            history.append({"role": "user", "content": sentence})
        events: list[Event] = []
        if turn % TOOL_EVERY == 0:
            call_id = f"call_{turn}"
            city = _CITIES[turn % len(_CITIES)]
            history.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": call_id, "name": "search", "args": {"query": f"weather {city}"}}],
                }
            )
            failed = (turn // TOOL_EVERY) % FAILED_EVERY == 0
            result = "error: upstream timeout" if failed else noisy_document(rng, "weather", city, tool_words)
            history.append({"role": "tool", "content": result, "tool_call_id": call_id})
            events.append(ToolCallFailed(call_id, error="timeout") if failed else ToolCallCompleted(call_id))
        session.extend(history)
        for event in events:
            session.apply(event)
        answer_id = f"answer_{turn}"
        answer = session.generate(max_new_tokens=max_new_tokens, message_id=answer_id)
        produced[answer_id] = list(session.spans[-1].token_ids)
        history.append({"role": "assistant", "content": answer, "id": answer_id})
        session.apply(TurnEnded())
        if turn % CONFIRM_EVERY == 0:
            pins.extend((turn, lease) for lease in session.apply(UserConfirmed(answer_id)).leases)
        while pins and pins[0][0] <= turn - PIN_TURNS:
            session.release(pins.pop(0)[1])
        seconds = time.perf_counter() - t0
        stats = session.stats()
        if not compacted:
            # Tokens per turn depend on the tokenizer: keep room for twice the largest turn seen.
            reserve = max(reserve, 2 * (stats.logical_tokens - before_turn))
        rows.append(
            SoakTurn(
                turn=turn,
                seconds=seconds,
                device_bytes=stats.device_bytes,
                usage_bytes=stats.device_bytes + stats.quantized_bytes,
                host_bytes=stats.host_bytes,
                logical_tokens=stats.logical_tokens,
                attended_tokens=stats.attended_tokens,
                quantized_tokens=stats.attended_quantized_tokens,
                prefill_tokens=stats.prefill_tokens - prefill_before,
                budget_satisfied=stats.budget_satisfied,
                compacted=compacted,
                faults=stats.faults,
            )
        )
        report(progress, "soak", turn, turns)

    wall = time.perf_counter() - started
    stats = session.stats()
    try:
        session.check()
        check_error = None
    except RuntimeError as e:
        check_error = str(e)
    head, tail = rows[:20], rows[-20:]
    summary: dict[str, Any] = {
        "turns": turns,
        "context_tokens": window,
        "budget_fraction": budget_fraction,
        "device_tokens_budget": device_tokens,
        "bytes_per_token": bpt,
        "high_watermark_bytes": high_bytes,
        "max_device_bytes": max(r.usage_bytes for r in rows),
        "max_attended_bytes": max(r.device_bytes for r in rows),
        "final_device_bytes": rows[-1].usage_bytes,
        "peak_device_bytes": stats.peak_device_bytes,
        "host_limit_bytes": host_limit,
        "max_host_bytes": max(r.host_bytes for r in rows),
        "budget_unmet_turns": sum(not r.budget_satisfied for r in rows),
        "mean_turn_s_first20": mean(r.seconds for r in head),
        "mean_turn_s_last20": mean(r.seconds for r in tail),
        "last20_over_first20": mean(r.seconds for r in tail) / max(mean(r.seconds for r in head), 1e-9),
        "wall_s": wall,
        "compactions": compactions,
        "prefill_tokens": stats.prefill_tokens,
        "reused_tokens": stats.reused_tokens,
        "restored_tokens": stats.restored_tokens,
        "rehydrated_tokens": stats.rehydrated_tokens,
        "transitions": stats.transitions,
        "events_applied": stats.events_applied,
        "faults": stats.faults,
        "final_logical_tokens": stats.logical_tokens,
        "final_attended_tokens": stats.attended_tokens,
        "quantized_tokens_max": max(r.quantized_tokens for r in rows),
        "logical_tokens_kept": _history_intact(session, history, produced),
        "check_error": check_error,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(
        json.dumps({"summary": summary, "turns": [asdict(r) for r in rows]}, indent=2)
    )
    plot_soak(rows, high_bytes, host_limit, out / "soak.png")
    return summary


def _history_intact(session: Session, history: list[dict[str, Any]], produced: dict[str, list[int]]) -> bool:
    """Whether the session's tokens are exactly what the history implies (nothing the agent said lost).

    Messages the session encoded must have the ids the chat template gives them;
    answers the model generated keep the ids it produced.
    """
    expected = session.format.message_ids(normalize_messages(history), 0)
    spans = [s for s in session.spans if s.message_index >= 0]
    if len(spans) != len(expected):
        return False
    for span, ids in zip(spans, expected, strict=True):
        want = produced.get(span.owner or "", ids) if span.generated else ids
        if span.token_ids != want:
            return False
    return True


def plot_soak(rows: list[SoakTurn], high_bytes: int, host_limit: int, path: Path) -> None:
    """Device bytes vs the high watermark, host bytes vs the host limit, and time per turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r.turn for r in rows]
    mib = 1024 * 1024
    fig, (dev, host, speed) = plt.subplots(1, 3, figsize=(15, 4))
    dev.plot(turns, [r.usage_bytes / mib for r in rows], label="device KV (attended + quantized)")
    dev.axhline(high_bytes / mib, color="red", linestyle="--", label="high watermark")
    for r in rows:
        if r.compacted:
            dev.axvline(r.turn, color="grey", alpha=0.15)
    dev.set_xlabel("turn")
    dev.set_ylabel("MiB")
    dev.legend()
    host.plot(turns, [r.host_bytes / mib for r in rows], label="host tier")
    if host_limit:
        host.axhline(host_limit / mib, color="red", linestyle="--", label="host limit")
    host.set_xlabel("turn")
    host.set_ylabel("MiB")
    host.legend()
    speed.plot(turns, [r.seconds * 1000 for r in rows], ".", markersize=3, label="turn wall time")
    speed.set_xlabel("turn")
    speed.set_ylabel("ms")
    speed.legend()
    fig.suptitle("Soak: one session, many turns, fixed budget (grey: history compacted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
