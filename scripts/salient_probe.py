r"""Probe: which tokens, kept exact among int4 ones, save the most gold log-prob? Per question.

Each workload's conversation is encoded once at full precision; then, per question, the
gold answer's teacher-forced log-prob is read with the history held exact (`full`), at
int4 except the sinks and the last 64 tokens (`all`), and at int4 except a share `f` of
the history kept exact, chosen three ways: the tokens most surprising in context
(`cx`: `-log p(token | before)` from the encoding forward), the most surprising with no
context (`bg`: the model's next-token distribution after a newline), and at random
(`rnd`, the control). `goldx` keeps the gold's own tokens and 16 on each side exact
(the oracle exact recall aims at). Shares from `FRACS` (default `0.05,0.1`).

    FRACS=0.05,0.1 OMP_NUM_THREADS=1 .venv/bin/python scripts/salient_probe.py courtlist ferry

The quantizer, the conversation's rendering and the questions' tokens are the key-noise
probe's (`scripts/key_noise_probe.py`), so the two probes read the same int4 history.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

import torch
from key_noise_probe import GOLD_MARGIN, RESIDUAL, SINKS, quantized, question_tokens, render
from transformers import DynamicCache

from agentkv.models import load_model
from agentkv_bench.workloads import load_workloads

FRACS = os.environ.get("FRACS", "0.05,0.1").split(",")


def main() -> None:
    """Print one JSON line per question, then each history's mean loss and how often it beats all-int4."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workloads", nargs="+")
    args = parser.parse_args()
    model, tokenizer = load_model()

    def gold_logprob(kv: list[tuple[torch.Tensor, torch.Tensor]], ids: list[int], target: list[int]) -> float:
        """The gold's teacher-forced log-prob after `ids`, over the history `kv` (one pair per layer)."""
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), layer)
        with torch.no_grad():
            logits = model(torch.tensor([ids + target]), past_key_values=cache).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1)
        return float(sum(logprobs[len(ids) - 1 + i, t] for i, t in enumerate(target)))

    with torch.no_grad():
        nl = tokenizer("\n", add_special_tokens=False)["input_ids"]
        background = -torch.log_softmax(model(torch.tensor([nl])).logits[0, -1].float(), -1)  # [V]
    rows: list[dict[str, Any]] = []
    fracs = [float(f) for f in FRACS]
    for workload in load_workloads(args.workloads):
        text = render(workload)
        encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, spans = encoded["input_ids"], encoded["offset_mapping"]
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
        ctx = torch.zeros(len(ids))
        lp = torch.log_softmax(out.logits[0].float(), -1)
        ctx[1:] = -lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        exact = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        history = list(range(SINKS, len(ids) - RESIDUAL))
        hist_t = torch.tensor(history)
        bg = background[torch.tensor(ids)][hist_t]
        cx = ctx[hist_t]
        rng = random.Random(0)

        def top(score: torch.Tensor, frac: float, history: list[int] = history) -> list[int]:
            """The history less its `frac` highest-scored positions (what is quantized)."""
            k = round(frac * len(history))
            keep = set(torch.tensor(history)[torch.topk(score, k).indices].tolist()) if k else set()
            return [p for p in history if p not in keep]

        configs = {"all": history}
        for f in fracs:
            configs[f"bg{f}"] = top(bg, f)
            configs[f"cx{f}"] = top(cx, f)
            configs[f"rnd{f}"] = top(torch.tensor([rng.random() for _ in history]), f)
        for question in workload.questions:
            gold, q_ids, target = question_tokens(tokenizer, text, spans, question)
            window = set(range(gold[0] - GOLD_MARGIN, gold[-1] + GOLD_MARGIN + 1)) if gold else set()
            row: dict[str, Any] = {"workload": workload.name, "question": question.id}
            row["full"] = gold_logprob(exact, q_ids, target)
            row["gold_in_bg"] = {
                str(f): sum(p not in set(configs[f"bg{f}"]) for p in gold) / max(1, len(gold)) for f in fracs
            }
            cfgs = dict(configs)
            cfgs["goldx"] = [p for p in history if p not in window]
            for label, held in cfgs.items():
                kv = [(k, v) for k, v, _ in (quantized(k, v, held) for k, v in exact)]  # noise unused
                row[label] = gold_logprob(kv, q_ids, target)
            rows.append(row)
            rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            print(json.dumps(rounded), flush=True)
    labels = [k for k in rows[0] if k not in ("workload", "question", "full", "gold_in_bg")]
    for label in labels:
        loss = sum(r["full"] - r[label] for r in rows) / len(rows)
        better = sum(r[label] > r["all"] for r in rows)
        print(f"{label}: loses {loss:.3f} nats/question vs exact; above all-int4 on {better}/{len(rows)}")


if __name__ == "__main__":
    main()
