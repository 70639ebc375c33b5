r"""Probe: does attending only the history the question attends to beat attending all of it?

Each workload's conversation is encoded once at full precision. Per question, the question
prompt is run over the whole history once to read where it attends: each history token's
attention weight from the question's positions, averaged over layers, heads and positions.
The history is cut into pages (a message, or 64-token pages of a long one). Then the gold
answer's teacher-forced log-prob is read with the history (a) whole (`full`), and (b) with
only a share `f` of its tokens attended, the rest masked out: the pages the question attends
most (`attn`), the pages with the highest peak token weight (`peak`), the most recent
pages (`recent`) and random pages (`rnd`, the control). The system message, the attention
sinks and the last 64 tokens are always attended. Everything is exact: this measures what
the selection does, not what quantization does. Shares from `FRACS` (default `0.25,0.5`).

    FRACS=0.25,0.5 OMP_NUM_THREADS=1 .venv/bin/python scripts/focus_probe.py printrush berths
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
from functools import partial
from typing import Any

import torch
from key_noise_probe import RESIDUAL, grouped_scores, question_tokens, render
from transformers import AttentionInterface, DynamicCache

from agentkv.models import load_model
from agentkv_bench.workloads import load_workloads

FRACS = [float(f) for f in os.environ.get("FRACS", "0.25,0.5").split(",")]
PAGE = 64

MASKED: list[torch.Tensor | None] = [None]
"""History positions masked out of attention in the current forward (`[S]` bool), or None."""
MASS: list[torch.Tensor] = []
"""Per layer, the attention weight each history position gets (`[S]`, mean over heads and queries)."""


def probe_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over `[history, new]` with `MASKED` history left out; records `MASS`."""
    q = query.shape[2]
    scores, k, v, _ = grouped_scores(query, key, value, kwargs.get("scaling"))  # [1, H, q, S]
    s = k.shape[2]
    blocked = torch.arange(s)[None, :] > torch.arange(q)[:, None] + s - q  # [q, S]
    masked = MASKED[0]
    if masked is not None:
        blocked = blocked | torch.nn.functional.pad(masked, (0, s - masked.shape[0]))[None, :]
    scores = scores.masked_fill(blocked, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    MASS.append(weights[0].mean(dim=(0, 1)))  # [S]
    return (weights @ v).transpose(1, 2).contiguous(), weights


def pages(ids: list[int], start_id: int, length: int) -> list[tuple[int, int]]:
    """`[start, end)` of each message, long messages cut into `PAGE`-token pages."""
    starts = [i for i, t in enumerate(ids[:length]) if t == start_id] + [length]
    out = []
    for a, b in itertools.pairwise(starts):
        if b - a > 2 * PAGE:
            out += [(p, min(p + PAGE, b)) for p in range(a, b, PAGE)]
        else:
            out.append((a, b))
    return out


def gold_read(
    model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], ids: list[int], target: list[int]
) -> tuple[float, bool]:
    """Gold log-prob after `ids` over `kv` (teacher-forced), and whether every gold token is the argmax."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), layer)
    MASS.clear()
    with torch.no_grad():
        logits = model(torch.tensor([ids + target]), past_key_values=cache).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    rows = [len(ids) - 1 + i for i in range(len(target))]
    lp = float(sum(logprobs[r, t] for r, t in zip(rows, target, strict=True)))
    return lp, all(int(logprobs[r].argmax()) == t for r, t in zip(rows, target, strict=True))


def main() -> None:
    """Print one JSON line per question, then each selection's mean loss against the full history."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workloads", nargs="+")
    args = parser.parse_args()
    model, tokenizer = load_model()
    AttentionInterface.register("agentkv_focus", probe_attention)
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")

    run = partial(gold_read, model)

    results: list[dict[str, Any]] = []
    for workload in load_workloads(args.workloads):
        text = render(workload)
        encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
        model.set_attn_implementation("agentkv_focus")
        exact = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        length = len(ids) - RESIDUAL
        units = pages(ids, start_id, length)
        system = units[0]
        movable = units[1:]
        total = sum(b - a for a, b in movable)
        rng = random.Random(0)
        for question in workload.questions:
            _, q_ids, target = question_tokens(tokenizer, text, offsets, question)
            MASKED[0] = None
            run(exact, q_ids, [])
            mass = torch.stack([m[: len(ids)] for m in MASS]).mean(0)  # [S]
            by_sum = [float(mass[a:b].sum()) for a, b in movable]
            by_peak = [float(mass[a:b].max()) for a, b in movable]
            orders = {
                "attn": sorted(range(len(movable)), key=lambda i: -by_sum[i]),
                "peak": sorted(range(len(movable)), key=lambda i: -by_peak[i]),
                "recent": list(range(len(movable) - 1, -1, -1)),
                "rnd": rng.sample(range(len(movable)), len(movable)),
            }
            row: dict[str, Any] = {"workload": workload.name, "question": question.id}
            row["full"], row["full_em"] = run(exact, q_ids, target)
            for frac in FRACS:
                for label, order in orders.items():
                    kept, budget = [], frac * total
                    for i in order:
                        if sum(movable[j][1] - movable[j][0] for j in kept) >= budget:
                            break
                        kept.append(i)
                    masked = torch.ones(len(ids), dtype=torch.bool)
                    masked[: system[1]] = False
                    masked[length:] = False
                    for i in kept:
                        masked[movable[i][0] : movable[i][1]] = False
                    MASKED[0] = masked
                    row[f"{label}{frac}"], row[f"{label}{frac}_em"] = run(exact, q_ids, target)
            MASKED[0] = None
            results.append(row)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    labels = [k for k in results[0] if k not in ("workload", "question") and not k.endswith("_em")]
    for label in labels:
        gain = sum(r[label] - r["full"] for r in results) / len(results)
        em = sum(r[f"{label}_em"] for r in results)
        better = sum(r[label] > r["full"] for r in results)
        print(
            f"{label}: {gain:+.3f} nats/question vs full; argmax-gold {em}/{len(results)}; "
            f"above full on {better}"
        )


if __name__ == "__main__":
    main()
