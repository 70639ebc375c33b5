r"""Where each question's fact is when the model answers it: exact, int4 in attention, or not attended.

Runs one workload under one budget with the bench's own loop (`agentkv_bench.memory.run_one`)
and, at each question's answer step, finds the spans whose text holds the gold answer and
whether the gold's tokens are held at full precision (`exact`), quantized in attention with
their 8-bit key planes (`k8`) or at 4-bit keys (`int4`), or not attended (`out`), next to how
many tokens the model attends then. It tells a miss under quantization noise from a miss where
the fact was exact and the model read elsewhere. The budget is a fraction of the full cache's
tokens at the last question, sized as `scripts/recall_bench.py` sizes it (or `--full-tokens`).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/gold_at_answer.py printrush --budget 0.25
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from recall_bench import full_tokens

import agentkv_bench.memory as memory
from agentkv.backend.transformers import TransformersBackend
from agentkv.models import load_model
from agentkv_bench.methods import METHODS
from agentkv_bench.workloads import load_workloads


def gold_offsets(tokenizer: Any, token_ids: list[int], gold: str) -> list[int]:
    """Offsets of the tokens that spell the first occurrence of `gold` in the span's text."""
    text = tokenizer.decode(token_ids)
    start = text.find(gold)
    if start < 0:
        return []
    offsets, end = [], 0
    for i, token in enumerate(token_ids):
        begin, end = end, end + len(tokenizer.decode([token]))
        if end > start and begin < start + len(gold):
            offsets.append(i)
    return offsets


def _precision(store: Any, span: Any, quantized: list[int]) -> str:
    """`exact`, `k8` (every quantized gold token keeps its 8-bit key plane) or `int4`."""
    if not quantized:
        return "exact"
    layers = store.physical.cache.managed_layers
    is_fine = getattr(layers[0], "is_fine", None) if layers else None
    if is_fine is None:
        return "int4"
    physical = store.physical
    slots = physical.slots_of(span.span_id)
    slots = slots[torch.isin(physical.slot_offset[slots], torch.tensor(quantized))]
    return "k8" if bool(is_fine(slots).all()) else "int4"


def main() -> None:
    """Run the workload and print, per question, where its fact is at the answer step."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workload")
    parser.add_argument(
        "--full-tokens",
        type=int,
        default=None,
        help="the full cache's tokens (default: sized as recall_bench)",
    )
    parser.add_argument("--budget", type=float, required=True, help="fraction of the full cache, e.g. 0.25")
    parser.add_argument("--method", default="agentkv-nohost", choices=sorted(METHODS))
    args = parser.parse_args()

    model, tokenizer = load_model()
    workload = load_workloads([args.workload])[0]
    gold_of = {q.id: q.gold for q in workload.questions}
    where: dict[str, str] = {}
    sample = memory.sample_step

    def located(session: Any, step: str) -> Any:
        out = sample(session, step)
        question = step.removeprefix("q:")
        if step.startswith("q:") and question in gold_of:
            held = []
            for span in session.table.spans:
                offsets = gold_offsets(tokenizer, span.token_ids, gold_of[question])
                if not offsets:
                    continue
                if not span.tier.attended:
                    held.append(f"{span.kind}:out")
                    continue
                quantized = set(session.store.quantized_offsets(span)).intersection(offsets)
                held.append(f"{span.kind}:{_precision(session.store, span, sorted(quantized))}")
            where[question] = f"{','.join(held) or 'nowhere'} attended={out.attended_tokens}"
        return out

    memory.sample_step = located  # the bench loop samples every step through this module attribute
    method = METHODS[args.method]
    full = args.full_tokens or full_tokens(
        TransformersBackend(model, tokenizer, METHODS["full"].config(None)), workload
    )
    tokens = max(1, round(args.budget * full))
    backend = TransformersBackend(model, tokenizer, method.config(tokens))
    _, rows, _, _ = memory.run_one(
        backend,
        workload,
        method,
        budget=args.budget,
        budget_tokens=tokens,
        full_tokens=full,
        reference=None,
    )
    for row in rows:
        mark = "ok  " if row.exact_match else "miss"
        held = where.get(row.question, "?")
        print(f"{mark} {row.question:24s} {held:48s} {row.answer!r} (gold {row.gold!r})")


if __name__ == "__main__":
    main()
