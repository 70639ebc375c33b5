"""`agentkv bench reuse`: session reuse vs re-encoding the whole history every turn.

Re-encoding is what `langchain-huggingface`'s `ChatHuggingFace` does today: each
call renders the full conversation and prefills it from scratch. Both runs share
one process, one model and the same conversation; the re-encode run appends the
answers the reuse run produced, so both see exactly the same histories.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.runner import Feed, ModelRunner
from agentkv.backend.session import Session
from agentkv.backend.transformers import TransformersBackend
from agentkv.bench.conversation import build_conversation, iter_histories
from agentkv.config import AgentKVConfig
from agentkv.progress import ProgressCallback, report
from agentkv.store.cache import PhysicalCache

logger = logging.getLogger("agentkv.bench")


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


def timed_answer(session: Session, history: list[dict[str, Any]], max_new_tokens: int) -> TurnRow:
    """Extend with the history and stream an answer, timing the first token and the decode rate."""
    started = time.perf_counter()
    result = session.extend(history)
    pieces: list[str] = []
    first_at: float | None = None
    generated_before = session.counters.generated_tokens
    for piece in session.stream(max_new_tokens=max_new_tokens):
        if first_at is None:
            first_at = time.perf_counter()
        pieces.append(piece)
    ended = time.perf_counter()
    first_at = first_at or ended
    produced = session.counters.generated_tokens - generated_before
    decode_time = ended - first_at
    return TurnRow(
        turn=0,
        history_tokens=session.logical_length,
        prefill_tokens=result.prefilled_tokens,
        reused_tokens=result.reused_tokens,
        ttft_s=first_at - started,
        decode_tokens=produced,
        decode_tok_s=(produced - 1) / decode_time if produced > 1 and decode_time > 0 else 0.0,
        answer="".join(pieces),
    )


def decode_rate_ratio(model: Any, ids: list[int], new_tokens: int = 48) -> dict[str, float]:
    """Decode tokens/s of agentkv's loop vs `model.generate` from the same prefilled full cache."""
    from transformers import DynamicCache

    runner = ModelRunner(model)
    physical = PhysicalCache(runner.num_layers)
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
    ours = new_tokens / (time.perf_counter() - started)

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids[:-1]], device=runner.device), cache=cache, use_cache=True)
        started = time.perf_counter()
        model.generate(
            torch.tensor([ids], device=runner.device),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        theirs = new_tokens / (time.perf_counter() - started)
    return {"agentkv_tok_s": ours, "generate_tok_s": theirs, "ratio": ours / theirs}


def run_reuse_bench(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    turns: int = 22,
    max_new_tokens: int = 24,
    tool_words: int = 90,
    out_dir: str | Path = "runs/reuse",
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run both modes and write `reuse.json` and `reuse.png` under `out_dir`.

    `progress` is called after each turn of each mode (task "reuse: session" or
    "reuse: re-encode") and once the decode-rate comparison is done.
    """
    conversation = build_conversation(turns, tool_words=tool_words)
    backend = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"policy": "full"}))
    session = backend.session("reuse")
    answers: list[str] = []
    reuse_rows: list[TurnRow] = []
    for index, history in enumerate(iter_histories(conversation, answers)):
        row = timed_answer(session, history, max_new_tokens)
        reuse_rows.append(TurnRow(**{**asdict(row), "turn": index + 1}))
        answers.append(row.answer)
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
    template_tokens = session.stats().prefill_tokens - len(final_ids)
    summary = {
        "turns": turns,
        "final_history_tokens": len(final_ids),
        "reuse_prefill_tokens": sum(r.prefill_tokens for r in reuse_rows),
        "reencode_prefill_tokens": sum(r.prefill_tokens for r in reencode_rows),
        "prefill_minus_history": template_tokens,
        "last_turn_ttft_reuse_s": reuse_rows[-1].ttft_s,
        "last_turn_ttft_reencode_s": reencode_rows[-1].ttft_s,
        "last_turn_ttft_speedup": reencode_rows[-1].ttft_s / max(reuse_rows[-1].ttft_s, 1e-9),
        "total_wall_reuse_s": reuse_total,
        "total_wall_reencode_s": reencode_total,
        "total_wall_speedup": reencode_total / max(reuse_total, 1e-9),
        "answers_identical": matches,
        "decode": decode,
    }
    result = {
        "summary": summary,
        "reuse": [asdict(r) for r in reuse_rows],
        "reencode": [asdict(r) for r in reencode_rows],
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reuse.json").write_text(json.dumps(result, indent=2))
    plot_reuse(reuse_rows, reencode_rows, out / "reuse.png")
    return result


def plot_reuse(reuse: list[TurnRow], reencode: list[TurnRow], path: Path) -> None:
    """Prefill tokens and time to first token per turn, both modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r.turn for r in reuse]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(turns, [r.prefill_tokens for r in reencode], "o-", label="re-encode (ChatHuggingFace-style)")
    left.plot(turns, [r.prefill_tokens for r in reuse], "o-", label="agentkv session reuse")
    left.set_xlabel("turn")
    left.set_ylabel("tokens prefilled")
    left.legend()
    right.plot(turns, [r.ttft_s * 1000 for r in reencode], "o-", label="re-encode")
    right.plot(turns, [r.ttft_s * 1000 for r in reuse], "o-", label="agentkv")
    right.set_xlabel("turn")
    right.set_ylabel("time to first token (ms)")
    right.legend()
    fig.suptitle("Session reuse vs re-encoding the history each turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
