"""`agentkv bench reuse`: session reuse vs re-encoding, and the per-call overhead vs a bare forward.

Re-encoding is what `langchain-huggingface`'s `ChatHuggingFace` does today: each
call renders the full conversation and prefills it from scratch. Both runs share
one process, one model and the same conversation; the re-encode run appends the
answers the reuse run produced, so both see exactly the same histories.

The per-call overhead is read against the floor a session can reach: a *bare*
transformers forward of the same new tokens over a `DynamicCache` holding the
same history (no message matching, no spans, no budget, no recall). Each turn is
measured `repeats` more times, session and bare forward alternating so a load
drift slows both alike (the session is cropped back to the previous turn and the
turn replayed up to its first token), and the medians are compared.
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.runner import Feed, ModelRunner
from agentkv.backend.session import Session
from agentkv.backend.transformers import TransformersBackend
from agentkv.config import AgentKVConfig
from agentkv.progress import ProgressCallback, report
from agentkv.store.cache import PhysicalCache
from agentkv_bench.conversation import build_conversation, iter_histories

logger = logging.getLogger("agentkv_bench")


@dataclass(frozen=True)
class TurnRow:
    """Figures for one turn of one run."""

    turn: int
    history_tokens: int
    prefill_tokens: int
    reused_tokens: int
    ttft_s: float
    decode_tokens: int
    decode_tok_s: float
    answer: str
    new_tokens: int = 0
    """Tokens encoded before the first answer token: the new messages plus the generation prompt."""
    cached_tokens: int = 0
    """Tokens already in the cache when the turn started (what the new tokens attend to)."""


@dataclass(frozen=True)
class OverheadRow:
    """One turn's time to first token: the session's call path vs a bare forward, medians of repeats."""

    turn: int
    new_tokens: int
    cached_tokens: int
    session_ttft_s: float
    """Median over repeats: `extend(history)` (matching, spans, budget, recall, forward) + first token."""
    bare_ttft_s: float
    """Median over repeats: `model(new_ids, cache=DynamicCache(history))` + argmax, nothing else."""
    ratio_to_bare: float
    """session_ttft_s / bare_ttft_s (1.0 = no overhead at all)."""
    repeats: int


def timed_answer(session: Session, history: list[dict[str, Any]], max_new_tokens: int) -> TurnRow:
    """Extend with the history and stream an answer, timing the first token and the decode rate."""
    started = time.perf_counter()
    result = session.extend(history, prefill=False)  # as ChatAgentKV calls it: one forward per call
    pieces: list[str] = []
    first_at: float | None = None
    generated_before = session.counters.generated_tokens
    prompt = 0
    for piece in session.stream(max_new_tokens=max_new_tokens):
        if first_at is None:
            first_at = time.perf_counter()
            prompt = len(session.format.generation_prompt_ids(session.messages))
        pieces.append(piece)
    ended = time.perf_counter()
    first_at = first_at or ended
    produced = session.counters.generated_tokens - generated_before
    decode_time = ended - first_at
    return TurnRow(
        turn=0,
        history_tokens=session.logical_length,
        prefill_tokens=result.prefilled_tokens + result.pending_tokens + prompt,  # encoded for this call
        reused_tokens=result.reused_tokens,
        ttft_s=first_at - started,
        decode_tokens=produced,
        decode_tok_s=(produced - 1) / decode_time if produced > 1 and decode_time > 0 else 0.0,
        answer="".join(pieces),
        new_tokens=result.prefilled_tokens + result.pending_tokens + prompt,
        cached_tokens=result.reused_tokens,
    )


def first_token_seconds(
    session: Session, before: list[dict[str, Any]], history: list[dict[str, Any]]
) -> float:
    """Replay one turn up to its first answer token: crop back to `before`, then extend + first piece.

    The crop runs outside the timing; the timed part is exactly what an agent's model
    call does (match messages, encode the new ones, budget checks, recall, first token).
    """
    session.extend(before)
    started = time.perf_counter()
    session.extend(history, prefill=False)
    stream = session.stream(max_new_tokens=1)
    try:
        next(iter(stream), None)
    finally:
        stream.close()  # type: ignore[attr-defined]
    return time.perf_counter() - started


class BareForward:
    """A `DynamicCache` over a conversation's prefix, to time the bare forward of a turn's new tokens.

    The cache grows with the conversation (each turn's ids extend the previous
    turn's); after a timed forward it is cropped back, so every repeat runs over the
    same cache. A model with sliding-window layers cannot crop them once the window
    is full: its cache is copied before the timed forward instead (outside the
    timing). When the ids do not extend what it holds, it is rebuilt.
    """

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.ids: list[int] = []
        self.windowed = ModelRunner(model).layout.windowed

    @torch.inference_mode()
    def _advance(self, prefix: list[int]) -> None:
        if self.ids != prefix[: len(self.ids)]:
            from transformers import DynamicCache

            self.cache, self.ids = DynamicCache(config=self.model.config), []
        missing = prefix[len(self.ids) :]
        for begin in range(0, len(missing), 1024):  # chunked like the session's prefill
            chunk = missing[begin : begin + 1024]
            start = len(self.ids)
            self.model(
                input_ids=torch.tensor([chunk], device=self.device),
                position_ids=torch.arange(start, start + len(chunk), device=self.device)[None],
                cache=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            self.ids += chunk

    @torch.inference_mode()
    def first_token_seconds(self, ids: list[int], new_tokens: int) -> float:
        """Seconds for the forward of `ids[-new_tokens:]` over a cache of the rest, and its argmax."""
        prefix, new = ids[:-new_tokens], ids[-new_tokens:]
        self._advance(prefix)
        start = len(prefix)
        kept = copy.deepcopy(self.cache) if self.windowed else None
        started = time.perf_counter()
        out = self.model(
            input_ids=torch.tensor([new], device=self.device),
            position_ids=torch.arange(start, start + len(new), device=self.device)[None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        int(torch.argmax(out.logits[0, -1]))
        elapsed = time.perf_counter() - started
        if kept is not None:
            self.cache = kept
        else:
            self.cache.crop(-len(new))  # transformers 5: a negative count of tokens to remove
        return elapsed


def decode_rate_ratio(model: Any, ids: list[int], new_tokens: int = 48, repeats: int = 5) -> dict[str, float]:
    """Decode tokens/s of agentkv's loop vs `model.generate` from the same prefilled cache.

    The two loops run in turn `repeats` times (a noisy machine slows both alike); the
    rates are each side's median and `ratio` is their quotient (above 1: agentkv faster).
    """
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(repeats):
        ours.append(_agentkv_decode_rate(model, ids, new_tokens))
        theirs.append(_generate_decode_rate(model, ids, new_tokens))
    ours_median, theirs_median = statistics.median(ours), statistics.median(theirs)
    return {
        "agentkv_tok_s": ours_median,
        "generate_tok_s": theirs_median,
        "ratio": ours_median / theirs_median,
        "repeats": float(repeats),
    }


def _agentkv_decode_rate(model: Any, ids: list[int], new_tokens: int) -> float:
    """Greedy tokens/s of agentkv's runner over its own cache, the prompt prefilled first."""
    runner = ModelRunner(model)
    physical = PhysicalCache(runner.num_layers, window=runner.window)  # as a session holds it
    feed = Feed(ids, list(range(len(ids))), [0] * len(ids), list(range(len(ids))))
    logits = runner.forward(physical, feed)
    assert logits is not None
    started = time.perf_counter()
    position = len(ids)
    for step in range(new_tokens):
        token = int(torch.argmax(logits))
        logits = runner.forward(physical, Feed([token], [position], [0], [len(ids) + step]))
        assert logits is not None
        position += 1
    return new_tokens / (time.perf_counter() - started)


def _generate_decode_rate(model: Any, ids: list[int], new_tokens: int) -> float:
    """Greedy tokens/s of `model.generate` over a `DynamicCache` prefilled with all but the last id."""
    from transformers import DynamicCache

    runner_device = next(model.parameters()).device
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:-1]], device=runner_device), cache=cache, use_cache=True)
        started = time.perf_counter()
        model.generate(
            torch.tensor([ids], device=runner_device),
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return new_tokens / (time.perf_counter() - started)


def run_reuse_bench(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    turns: int = 30,
    max_new_tokens: int = 24,
    tool_words: int = 90,
    repeats: int = 5,
    out_dir: str | Path = "runs/reuse",
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run both modes and the overhead comparison; write `reuse.json` and `reuse.png` under `out_dir`.

    Args:
        model: The causal LM.
        tokenizer: Its tokenizer.
        turns: Conversation turns (30 reach ~4.5k tokens with the default model).
        max_new_tokens: Answer length per turn.
        tool_words: Length of each tool result.
        repeats: Extra first-token measurements per turn for the session and the bare
            forward (medians are compared); 0 skips the overhead comparison. A model with
            sliding-window layers is not rewound for the session's repeats (its dropped
            sliding KV would be recomputed, which no agent call pays): its turn's one
            measurement is compared with the bare forward's median.
        out_dir: Where the files go.
        progress: Called after each turn of each mode (task "reuse: session" or
            "reuse: re-encode") and once the decode-rate comparison is done.
    """
    if turns < 1 or repeats < 0:
        msg = f"turns must be >= 1 and repeats >= 0, got turns={turns}, repeats={repeats}"
        raise ValueError(msg)
    conversation = build_conversation(turns, tool_words=tool_words)
    backend = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"policy": "full"}))
    session = backend.session("reuse")
    bare = BareForward(model)
    answers: list[str] = []
    reuse_rows: list[TurnRow] = []
    overhead_rows: list[OverheadRow] = []
    before: list[dict[str, Any]] = []
    for index, history in enumerate(iter_histories(conversation, answers)):
        row = timed_answer(session, history, max_new_tokens)
        reuse_rows.append(TurnRow(**{**asdict(row), "turn": index + 1}))
        answers.append(row.answer)
        if repeats and before:
            ids = session.token_ids()[: row.cached_tokens + row.new_tokens]
            ours: list[float] = []
            theirs: list[float] = []
            for _ in range(repeats):  # alternate, so a drifting load slows both alike
                ours.append(row.ttft_s if bare.windowed else first_token_seconds(session, before, history))
                theirs.append(bare.first_token_seconds(ids, row.new_tokens))
            session.extend([*history, {"role": "assistant", "content": row.answer}])
            overhead_rows.append(
                OverheadRow(
                    turn=index + 1,
                    new_tokens=row.new_tokens,
                    cached_tokens=row.cached_tokens,
                    session_ttft_s=statistics.median(ours),
                    bare_ttft_s=statistics.median(theirs),
                    ratio_to_bare=statistics.median(ours) / max(statistics.median(theirs), 1e-9),
                    repeats=repeats,
                )
            )
        before = [*history, {"role": "assistant", "content": row.answer}]
        report(progress, "reuse: session", index + 1, turns)

    reencode_rows: list[TurnRow] = []
    matches = 0
    for index, history in enumerate(iter_histories(conversation, answers)):
        fresh = backend.session(f"reencode-{index}")
        row = timed_answer(fresh, history, max_new_tokens)
        backend.close(fresh.session_id)
        matches += row.answer == answers[index]
        reencode_rows.append(TurnRow(**{**asdict(row), "turn": index + 1}))
        report(progress, "reuse: re-encode", index + 1, turns)

    final_ids = session.token_ids()
    report(progress, "reuse: decode loop vs generate", 0, 1)
    decode = decode_rate_ratio(model, final_ids)
    report(progress, "reuse: decode loop vs generate", 1, 1)
    reuse_total = sum(r.ttft_s + r.decode_tokens / max(r.decode_tok_s, 1e-9) for r in reuse_rows)
    reencode_total = sum(r.ttft_s + r.decode_tokens / max(r.decode_tok_s, 1e-9) for r in reencode_rows)
    # From the turns' own rows: the session's counters also hold the overhead repeats' prefills.
    template_tokens = sum(r.prefill_tokens + r.decode_tokens for r in reuse_rows) - len(final_ids)
    last_bare = overhead_rows[-1].bare_ttft_s if overhead_rows else float("nan")
    summary = {
        "turns": turns,
        "final_history_tokens": len(final_ids),
        "reuse_prefill_tokens": sum(r.prefill_tokens for r in reuse_rows),
        "reencode_prefill_tokens": sum(r.prefill_tokens for r in reencode_rows),
        "prefill_minus_history": template_tokens,
        "last_turn_ttft_reuse_s": reuse_rows[-1].ttft_s,
        "last_turn_ttft_reencode_s": reencode_rows[-1].ttft_s,
        "last_turn_ttft_speedup": reencode_rows[-1].ttft_s / max(reuse_rows[-1].ttft_s, 1e-9),
        "last_turn_ttft_bare_s": last_bare,
        "last_turn_reencode_over_bare": reencode_rows[-1].ttft_s / last_bare
        if overhead_rows
        else float("nan"),
        "total_wall_reuse_s": reuse_total,
        "total_wall_reencode_s": reencode_total,
        "total_wall_speedup": reencode_total / max(reuse_total, 1e-9),
        "answers_identical": matches,
        "overhead": overhead_summary(overhead_rows),
        "decode": decode,
    }
    result = {
        "summary": summary,
        "reuse": [asdict(r) for r in reuse_rows],
        "reencode": [asdict(r) for r in reencode_rows],
        "overhead": [asdict(r) for r in overhead_rows],
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reuse.json").write_text(json.dumps(result, indent=2))
    plot_reuse(reuse_rows, reencode_rows, overhead_rows, out / "reuse.png")
    return result


OVERHEAD_TARGET = 1.15
"""Session TTFT may be at most this many times the bare forward's (issue 12)."""

SHORT_TURN_TOKENS = 64
"""Turns with fewer new tokens are "short" (a user note); the others carry a tool result."""


def overhead_summary(rows: list[OverheadRow], cache_at_least: int = 3000) -> dict[str, Any]:
    """Per turn kind (short / long), the first turn over a cache of `cache_at_least` tokens and the worst one.

    The issue's reference points are a 28-token and a 218-token turn over a ~3k-token
    cache; `worst_ratio` covers every turn from there on.
    """
    out: dict[str, Any] = {"target": OVERHEAD_TARGET, "cache_at_least": cache_at_least}
    for kind in ("short", "long"):
        mine = [
            r
            for r in rows
            if r.cached_tokens >= cache_at_least and (r.new_tokens < SHORT_TURN_TOKENS) == (kind == "short")
        ]
        if not mine:
            continue
        first = mine[0]
        out[kind] = {
            "turn": first.turn,
            "new_tokens": first.new_tokens,
            "cached_tokens": first.cached_tokens,
            "session_ttft_ms": 1000 * first.session_ttft_s,
            "bare_ttft_ms": 1000 * first.bare_ttft_s,
            "ratio_to_bare": first.ratio_to_bare,
            "median_ratio": statistics.median(r.ratio_to_bare for r in mine),
            "worst_ratio": max(r.ratio_to_bare for r in mine),
            "turns": len(mine),
            "within_target": statistics.median(r.ratio_to_bare for r in mine) <= OVERHEAD_TARGET,
        }
    return out


def plot_reuse(
    reuse: list[TurnRow], reencode: list[TurnRow], overhead: list[OverheadRow], path: Path
) -> None:
    """Prefill tokens, time to first token per turn (both modes and the bare forward), overhead ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r.turn for r in reuse]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    left.plot(turns, [r.prefill_tokens for r in reencode], "o-", label="re-encode (ChatHuggingFace-style)")
    left.plot(turns, [r.prefill_tokens for r in reuse], "o-", label="agentkv session reuse")
    left.set_xlabel("turn")
    left.set_ylabel("tokens prefilled")
    left.legend()
    middle.plot(turns, [r.ttft_s * 1000 for r in reencode], "o-", label="re-encode")
    middle.plot(turns, [r.ttft_s * 1000 for r in reuse], "o-", label="agentkv")
    if overhead:
        middle.plot(
            [r.turn for r in overhead], [r.bare_ttft_s * 1000 for r in overhead], "x:", label="bare forward"
        )
    middle.set_xlabel("turn")
    middle.set_ylabel("time to first token (ms)")
    middle.set_yscale("log")
    middle.legend()
    if overhead:
        for kind, marker in (("short", "o"), ("long", "s")):
            mine = [r for r in overhead if (r.new_tokens < SHORT_TURN_TOKENS) == (kind == "short")]
            right.plot(
                [r.cached_tokens for r in mine],
                [r.ratio_to_bare for r in mine],
                marker,
                label=f"{kind} turns",
            )
        right.axhline(OVERHEAD_TARGET, color="grey", linestyle=":", label=f"target {OVERHEAD_TARGET}x")
        right.axhline(1.0, color="black", linewidth=0.5)
        right.set_xlabel("cached tokens")
        right.set_ylabel("session TTFT / bare forward TTFT")
        right.legend()
    fig.suptitle("Session reuse vs re-encoding, and the session's overhead over a bare forward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
