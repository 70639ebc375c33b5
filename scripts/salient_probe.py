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
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

import torch
from transformers import DynamicCache

from agentkv.bench.workloads import load_workloads
from agentkv.models import load_model
from agentkv.store.kivi import key_groups, quantize_along, value_groups

SINKS, RESIDUAL, GROUP, BITS, GOLD_MARGIN = 4, 64, 32, 4, 16
FRACS = os.environ.get("FRACS", "0.05,0.1").split(",")


def quantized(k: torch.Tensor, v: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`k`, `v` `[1, H, S, D]` with `rows` at int4 (KIVI: keys per channel in groups of rows)."""
    k, v = k.clone(), v.clone()
    index = torch.tensor(rows, dtype=torch.long)
    n, heads, dim = len(rows), k.shape[1], k.shape[-1]
    groups = key_groups(k[:, :, index], GROUP)  # [1, H, n/G, G, D]
    codes, scales, zeros = quantize_along(groups, BITS, dim=-2)
    k[:, :, index] = (codes.float() * scales.float().unsqueeze(-2) + zeros.float().unsqueeze(-2)).reshape(
        1, heads, -1, dim
    )[:, :, :n]
    values = v[:, :, index]
    codes, scales, zeros = quantize_along(value_groups(values, GROUP), BITS, dim=-1)
    v[:, :, index] = (codes.float() * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).reshape(
        values.shape
    )
    return k, v


def render(workload: Any) -> str:
    """The workload's conversation as ChatML text: tool calls as assistant messages, results as `tool`."""
    parts = [("system", workload.system)]
    for turn in workload.turns:
        parts.append(("user", turn.user))
        for tool in turn.tools:
            call = json.dumps({"name": tool.name, "arguments": dict(tool.args)})
            parts += [("assistant", f"<tool_call>{call}</tool_call>"), ("tool", tool.result)]
        if turn.branches is not None:
            parts += [("assistant", option.reasoning) for option in turn.branches.options]
        parts += [("assistant", proposal.text) for proposal in turn.proposals]
        if turn.assistant:
            parts.append(("assistant", turn.assistant))
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in parts)


def main() -> None:
    """Print one JSON line per question, then the means and how often the correction helps."""
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
            start = text.rfind(question.gold)
            gold = [
                i
                for i, (a, b) in enumerate(spans)
                if start >= 0 and b > start and a < start + len(question.gold)
            ]
            window = set(range(gold[0] - GOLD_MARGIN, gold[-1] + GOLD_MARGIN + 1)) if gold else set()
            prompt = (
                f"<|im_start|>user\n{question.question}<|im_end|>\n<|im_start|>assistant\n{question.prefix}"
            )
            q_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            target = tokenizer(" " + question.gold, add_special_tokens=False)["input_ids"]
            row: dict[str, Any] = {"workload": workload.name, "question": question.id}
            row["full"] = gold_logprob(exact, q_ids, target)
            row["gold_in_bg"] = {
                str(f): sum(p not in set(configs[f"bg{f}"]) for p in gold) / max(1, len(gold)) for f in fracs
            }
            cfgs = dict(configs)
            cfgs["goldx"] = [p for p in history if p not in window]
            for label, held in cfgs.items():
                row[label] = gold_logprob([quantized(k, v, held) for k, v in exact], q_ids, target)
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
