r"""Probe: how well could any placement answer at a device budget? An oracle's bound, per question.

The fidelity goals ask a placement at 25% and 12.5% of the full cache's bytes to answer
within 2 and 5 points of the full cache. This probe asks what a placement that knows
more than any real one would score at the same bytes. Each workload's conversation is
encoded once at full precision. Per question, the question prompt is run over the whole
exact history to read where it attends (each history token's attention weight from the
question's positions, mean over layers, heads and positions; `focus_probe`). The history
is cut into pages (a message, or 64-token pages of a long one). Then the gold answer's
teacher-forced log-prob and whether every gold token is the argmax are read with the
history placed three ways at each budget:

- `orc` (the oracle): the system message, then the gold's own tokens and 16 on each side,
  then pages by the question's attention: held at int4 (KIVI,
  `agentkv.store.kivi`) in that order while the bytes allow; once every page is in, lifted
  to exact in the same order while they allow.
- `att`: the same without the gold window (the question's attention alone).
- `rec`: the same with pages by recency (a window held at int4, then exact).
- `orx` (not read unless `ORDERS` names it): the gold's window held exact from the start,
  with the sinks and the last tokens, then `att`'s order.

What is not held is not attended. The attention sinks, the last 64 tokens and the question
itself are always exact, and the system message is always held (as a pinned span is; lifted
to exact last), all counted against the budget. A token
costs 1 exact and `INT4_SHARE` at int4 (codes plus statistics, the lifecycle's figure);
the budget is a share of the exact bytes of everything the answer attends in the full
cache. Everything is read the same way for the full history (`full`), so the probe's
own full cache is the reference. Budgets from `BUDGETS` (default `0.25,0.125`).

    BUDGETS=0.25,0.125 OMP_NUM_THREADS=1 .venv/bin/python scripts/oracle_probe.py ferry berths
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from functools import partial
from typing import Any

import torch
from focus_probe import MASKED, MASS, gold_read, pages, probe_attention
from key_noise_probe import GOLD_MARGIN, RESIDUAL, SINKS, quantized, question_tokens, render
from transformers import AttentionInterface

from agentkv.models import load_model
from agentkv_bench.workloads import load_workloads

BUDGETS = [float(b) for b in os.environ.get("BUDGETS", "0.25,0.125").split(",")]
LADDERS = os.environ.get("LADDERS", "int4").split(",")
"""`int4`: int4 then exact; `k8`: int4, then 8-bit keys, then exact (labels ending `+k8`)."""
ORDERS = os.environ.get("ORDERS", "orc,att,rec").split(",")
"""Which placements to read (`orx`: the gold window exact, then pages by attention at int4)."""
INT4_SHARE = 0.16
"""Device bytes of a token at int4 per exact byte (codes plus statistics), as the probe's figures were run."""

K8_SHARE = (0.3 + INT4_SHARE) / 2
"""Device bytes of a token with 8-bit keys and int4 values per exact byte (int8 at 0.3), as run."""

Placement = tuple[set[int], set[int], set[int]]
"""History positions held exact, with 8-bit keys (int4 values), and at int4; the rest are not attended."""


def place(units: list[set[int]], fixed: set[int], budget: float, *, k8: bool = False) -> Placement:
    """Hold `fixed` exact, then `units` in order at int4, then (`k8`) with 8-bit keys, then exact.

    Each step goes over every unit in order before the next starts, while `budget` allows.

    `budget` is in exact tokens; a unit overlapping a unit before it pays only for the rest.
    The first unit is always held (a pinned span is never dropped) and is lifted to exact
    last, once every other unit is.
    """
    exact = set(fixed)
    left = budget - len(exact)
    int4: set[int] = set()
    rest: list[set[int]] = []
    for unit in units:
        rest.append(unit - exact - set().union(*rest))
    for i, positions in enumerate(rest):  # everything at int4 first, as the lifecycle's order does
        cost = len(positions) * INT4_SHARE
        if cost <= left or i == 0:
            int4 |= positions
            left -= cost
    eight: set[int] = set()
    if k8:
        for positions in rest[1:] + rest[:1]:  # then 8-bit keys, same order
            if positions <= int4:
                cost = len(positions) * (K8_SHARE - INT4_SHARE)
                if cost <= left:
                    int4 -= positions
                    eight |= positions
                    left -= cost
    for positions in rest[1:] + rest[:1]:  # then exact, same order, while the bytes last
        if positions <= int4 | eight:
            share = K8_SHARE if positions <= eight else INT4_SHARE
            cost = len(positions) * (1 - share)
            if cost <= left:
                int4 -= positions
                eight -= positions
                exact |= positions
                left -= cost
    return exact, eight, int4


def held_at(
    k: torch.Tensor, v: torch.Tensor, eight: set[int], int4: set[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`k`, `v` `[1, H, S, D]` with `eight` at 8-bit keys and int4 values, `int4` at int4 (KIVI)."""
    if eight:
        k8, _, _ = quantized(k, v, sorted(eight), key_bits=8)
        k = k8
    rows = sorted(eight | int4)
    if not rows:
        return k, v
    k4, v4, _ = quantized(k, v, rows)
    if int4:
        index = torch.tensor(sorted(int4), dtype=torch.long)
        k = k.clone()
        k[:, :, index] = k4[:, :, index]
    return k, v4


def main() -> None:
    """Print one JSON line per question, then each placement's answers and loss against the full history."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--out", help="write the per-question rows here (JSON lines)")
    args = parser.parse_args()
    model, tokenizer = load_model()
    AttentionInterface.register("agentkv_oracle", probe_attention)
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")

    run = partial(gold_read, model)

    results: list[dict[str, Any]] = []
    sink = open(args.out, "a") if args.out else None  # noqa: SIM115 - appended to as rows arrive
    for workload in load_workloads(args.workloads):
        text = render(workload)
        encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
        model.set_attn_implementation("agentkv_oracle")
        exact_kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        length = len(ids) - RESIDUAL
        units = pages(ids, start_id, length)
        system, movable = units[0], units[1:]
        fixed = set(range(SINKS)) | set(range(length, len(ids)))
        held_system = set(range(system[1]))
        for question in workload.questions:
            gold, q_ids, target = question_tokens(tokenizer, text, offsets, question)
            window = (
                {p for p in range(gold[0] - GOLD_MARGIN, gold[-1] + GOLD_MARGIN + 1) if 0 <= p < length}
                if gold
                else set()
            )
            MASKED[0] = None
            run(exact_kv, q_ids, [])
            mass = torch.stack([m[: len(ids)] for m in MASS]).mean(0)  # [S]
            by_attention = sorted(
                range(len(movable)), key=lambda i: -float(mass[movable[i][0] : movable[i][1]].sum())
            )
            ranked = [set(range(*movable[i])) for i in by_attention]
            recent = [set(range(a, b)) for a, b in reversed(movable)]
            orders = {
                "orc": [held_system, window, *ranked] if window else [held_system, *ranked],
                "att": [held_system, *ranked],
                "rec": [held_system, *recent],
                "orx": [held_system, *ranked],
            }
            orders = {label: units for label, units in orders.items() if label in ORDERS}
            row: dict[str, Any] = {"workload": workload.name, "question": question.id, "tokens": len(ids)}
            row["full"], row["full_em"] = run(exact_kv, q_ids, target)
            whole = len(ids) + len(q_ids) + len(target)  # what the full cache holds at the answer
            for budget in BUDGETS:
                for (label, units_in_order), ladder in itertools.product(orders.items(), LADDERS):
                    room = budget * whole - len(q_ids) - len(target)
                    held_exact = fixed | window if label == "orx" else fixed
                    exact, eight, int4 = place(units_in_order, held_exact, room, k8=ladder == "k8")
                    masked = torch.ones(len(ids), dtype=torch.bool)
                    masked[sorted(exact | eight | int4)] = False
                    kv = [held_at(k, v, eight, int4) for k, v in exact_kv]
                    MASKED[0] = masked
                    name = f"{label}{budget}{'+k8' if ladder == 'k8' else ''}"
                    row[name], row[f"{name}_em"] = run(kv, q_ids, target)
                    row[f"{name}_held"] = round((len(exact) + len(eight) + len(int4)) / len(ids), 3)
            MASKED[0] = None
            results.append(row)
            line = json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(line, flush=True)
            if sink is not None:
                sink.write(line + "\n")
                sink.flush()
    if sink is not None:
        sink.close()
    labels = [
        k
        for k in results[0]
        if k not in ("workload", "question", "tokens") and not k.endswith(("_em", "_held"))
    ]
    for label in labels:
        loss = sum(r[label] - r["full"] for r in results) / len(results)
        em = sum(r[f"{label}_em"] for r in results)
        print(f"{label}: argmax-gold {em}/{len(results)}; {loss:+.3f} nats/question vs full")


if __name__ == "__main__":
    main()
