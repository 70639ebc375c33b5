"""Why is a chosen tree-of-thought option answered wrongly under a budget (issue 11, lever 4)?

Replays a workload under a method and budget, asks its `chosen` question, and
prints the span map at question time, then scores the gold answer on the same
attended tokens four ways with plain forwards of the model:

- `session`: the session's own cache (logical positions, gaps where spans left);
- `gapped`: a plain forward over the attended tokens at their logical positions
  (must equal `session`: checks the cache is what it claims to be);
- `renumbered`: the same tokens at contiguous positions 0..n-1 (no gaps);
- `full`: every token of the conversation (no budget).

    .venv/bin/python scripts/chosen_option_probe.py --workload buildfix --method agentkv-nohost --budget 0.25
"""

from __future__ import annotations

import argparse

import torch

from agentkv.backend.transformers import TransformersBackend
from agentkv.models import load_model
from agentkv_bench.memory import answer_text, replay
from agentkv_bench.methods import METHODS
from agentkv_bench.workloads import load_workloads


def score(model, ids: list[int], positions: list[int], n_target: int) -> tuple[float, list[int]]:  # noqa: ANN001
    """Summed log-prob of the last `n_target` tokens, and the greedy ids at those positions."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    rows = range(len(ids) - n_target - 1, len(ids) - 1)
    total = sum(float(logp[r, ids[r + 1]]) for r in rows)
    return total, [int(logp[r].argmax()) for r in rows]


def main() -> None:
    """Print the span map and the four scores."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--method", default="agentkv-nohost")
    parser.add_argument("--budget", type=float, default=0.25)
    args = parser.parse_args()
    model, tokenizer = load_model()
    (workload,) = load_workloads([args.workload])
    question = next(q for q in workload.questions if q.source == "chosen")
    full_backend = TransformersBackend(model, tokenizer, METHODS["full"].config(None))
    full = full_backend.session("full")
    history = replay(full, workload, events=False)
    messages = [*history, {"role": "user", "content": question.question, "id": "q"}]
    full.extend(messages)
    budget = max(1, round(args.budget * full.stats().attended_tokens))
    method = METHODS[args.method]
    session = TransformersBackend(model, tokenizer, method.config(budget)).session("s")
    history = replay(session, workload, events=method.events)
    session.extend(messages)
    fmt = session.format
    prompt = fmt.generation_prompt_ids(session.messages) + fmt.encode(question.prefix)
    target = fmt.encode(answer_text(question.prefix, question.gold))
    print(f"{workload.name} {args.method} budget {budget} tokens; question {question.question!r}")
    for span in session.spans:
        text = tokenizer.decode(span.token_ids, skip_special_tokens=True).replace("\n", " ")[:70]
        print(
            f"  {span.span_id:3d} t{span.turn:<2d} {span.kind.value:11s} {span.state.value:9s} "
            f"{span.tier.value:8s} held {span.held_tokens:4d}/{span.length:<4d} @{span.start:<5d} {text}"
        )
    physical = session.store.physical
    order = torch.argsort(physical.slot_position)
    positions = physical.slot_position[order].tolist()
    all_ids = session.token_ids()
    held = [all_ids[p] for p in positions]
    gaps = sum(1 for a, b in zip(positions, positions[1:], strict=False) if b != a + 1)
    print(f"  attended {len(positions)} of {len(all_ids)} tokens, {gaps} position gaps")
    start = session.logical_length
    tail = prompt + target
    tail_positions = list(range(start, start + len(tail)))
    cases = {
        "gapped": (held + tail, positions + tail_positions),
        "renumbered": (held + tail, list(range(len(held) + len(tail)))),
        "full": (all_ids + tail, list(range(len(all_ids) + len(tail)))),
    }
    logits = session.continuation_logits(tail)
    logp = torch.log_softmax(logits.float(), -1)
    rows = range(len(tail) - len(target) - 1, len(tail) - 1)
    session_lp = sum(float(logp[r, tail[r + 1]]) for r in rows)
    greedy = tokenizer.decode([int(logp[r].argmax()) for r in rows])
    print(f"  session    logp(gold) {session_lp:8.3f} greedy {greedy!r}")
    for name, (ids, pos) in cases.items():
        lp, greedy = score(model, ids, pos, len(target))
        print(f"  {name:10s} logp(gold) {lp:8.3f} greedy {tokenizer.decode(greedy)!r}")
    print(f"  gold {tokenizer.decode(target)!r}")


if __name__ == "__main__":
    main()
