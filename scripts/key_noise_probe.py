r"""Probe: would correcting attention logits for int4 key noise help? Gold log-prob per question.

Rounding a key to a grid of step `s` leaves an error of variance `s^2 / 12` per channel, so
a query `q` reads the key's logit with noise of variance
`v = scaling^2 * sum_d q_d^2 s_d^2 / 12`. Softmax weighs `exp(logit)`, and
`E[exp(x + e)] = exp(x) exp(v / 2)`: over thousands of int4 keys the quantized ones draw
more attention than they would exact, at the expense of the exact ones (sinks, the residual
window, a span exact recall recomputed). The correction subtracts `v / 2` from each
quantized key's logit; it needs only each key group's scales.

Each workload's conversation is encoded once at full precision; then, per question, the
gold answer's teacher-forced log-prob is read with the history held (a) exact, (b) at int4
except the sinks and the last 64 tokens (`all`), (c) as (b) with the gold's own tokens and
16 on each side exact (`goldx`, what exact recall aims at), each without the correction,
with each quantized key corrected by its own variance (`+b`), and with every quantized key
shifted by the mean of their variances (`+m`: the partition function's inflation only).
The quantizer is the tier's (`agentkv.store.kivi`); the attention is computed in the probe
(causal), not by the store.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/key_noise_probe.py berths grants ferry
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache

from agentkv.models import load_model
from agentkv.store.kivi import key_groups, quantize_along, value_groups
from agentkv_bench.workloads import load_workloads

SINKS, RESIDUAL, GROUP, BITS, GOLD_MARGIN = 4, 64, 32, 4, 16

NOISE: dict[int, torch.Tensor] = {}
"""Per layer, the history's key noise variance `[1, H, S, D]` (read by `probe_attention`)."""
CORRECT = [""]
"""The correction in force: "" none, "key" each key by its variance, "mean" all by their mean."""


def grouped_scores(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Scaled scores `[1, H, q, S]`, the keys and values repeated over their query heads, and the scaling."""
    heads, dim = query.shape[1], query.shape[-1]
    repeat = heads // key.shape[1]
    scaling = scaling or dim**-0.5
    k, v = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    return query @ k.transpose(-1, -2) * scaling, k, v, scaling


def probe_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over `[history, new]`, less `v / 2` on each quantized key's logit when asked."""
    _, heads, q, dim = query.shape
    repeat = heads // key.shape[1]
    scores, k, v, scaling = grouped_scores(query, key, value, kwargs.get("scaling"))  # [1, H, q, S]
    noise = NOISE.get(module.layer_idx)
    if CORRECT[0] and noise is not None:
        var = torch.zeros(k.shape[0], key.shape[1], k.shape[2], dim)
        var[:, :, : noise.shape[2]] = noise
        bias = 0.5 * scaling**2 * (query**2 @ var.repeat_interleave(repeat, dim=1).transpose(-1, -2))
        if CORRECT[0] == "mean":  # one shift for every quantized key: the mean of their corrections
            held = (var.sum(-1) > 0).repeat_interleave(repeat, dim=1)[:, :, None, :]  # [1, H, 1, S]
            mean = (bias * held).sum(-1, keepdim=True) / held.sum(-1, keepdim=True).clamp(min=1)
            bias = mean * held
        scores = scores - bias
    s = k.shape[2]
    scores = scores.masked_fill(torch.arange(s)[None, :] > torch.arange(q)[:, None] + s - q, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return (weights @ v).transpose(1, 2).contiguous(), weights


def quantized(
    k: torch.Tensor, v: torch.Tensor, rows: list[int], *, key_bits: int = BITS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`k`, `v` `[1, H, S, D]` with `rows` quantized (KIVI; keys at `key_bits`), and the key noise."""
    k, v, noise = k.clone(), v.clone(), torch.zeros_like(k)
    index = torch.tensor(rows, dtype=torch.long)
    n, heads, dim = len(rows), k.shape[1], k.shape[-1]
    groups = key_groups(k[:, :, index], GROUP)  # [1, H, n/G, G, D]
    codes, scales, zeros = quantize_along(groups, key_bits, dim=-2)
    k[:, :, index] = (codes.float() * scales.float().unsqueeze(-2) + zeros.float().unsqueeze(-2)).reshape(
        1, heads, -1, dim
    )[:, :, :n]
    noise[:, :, index] = (
        (scales.float() ** 2 / 12).unsqueeze(-2).expand_as(groups).reshape(1, heads, -1, dim)[:, :, :n]
    )
    values = v[:, :, index]
    codes, scales, zeros = quantize_along(value_groups(values, GROUP), BITS, dim=-1)
    v[:, :, index] = (codes.float() * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).reshape(
        values.shape
    )
    return k, v, noise


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


def question_tokens(
    tokenizer: Any, text: str, offsets: list[tuple[int, int]], question: Any
) -> tuple[list[int], list[int], list[int]]:
    """A question's gold positions in `text` (by token offsets), its prompt ids, and the gold's ids."""
    start = text.rfind(question.gold)
    gold = [
        i for i, (a, b) in enumerate(offsets) if start >= 0 and b > start and a < start + len(question.gold)
    ]
    prompt = f"<|im_start|>user\n{question.question}<|im_end|>\n<|im_start|>assistant\n{question.prefix}"
    q_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target = tokenizer(" " + question.gold, add_special_tokens=False)["input_ids"]
    return gold, q_ids, target


def main() -> None:
    """Print one JSON line per question, then the means and how often the correction helps."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workloads", nargs="+")
    args = parser.parse_args()
    model, tokenizer = load_model()
    AttentionInterface.register("agentkv_probe", probe_attention)
    model.set_attn_implementation("agentkv_probe")

    def gold_logprob(
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        noise: list[torch.Tensor] | None,
        ids: list[int],
        target: list[int],
        correct: bool,
    ) -> float:
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), layer)
        NOISE.clear()
        NOISE.update(enumerate(noise or []))
        CORRECT[0] = correct
        with torch.no_grad():
            logits = model(torch.tensor([ids + target]), past_key_values=cache).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1)
        return float(sum(logprobs[len(ids) - 1 + i, t] for i, t in enumerate(target)))

    rows: list[dict[str, Any]] = []
    for workload in load_workloads(args.workloads):
        text = render(workload)
        encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, spans = encoded["input_ids"], encoded["offset_mapping"]
        with torch.no_grad():
            NOISE.clear()
            out = model(torch.tensor([ids]), use_cache=True)
        exact = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        history = list(range(SINKS, len(ids) - RESIDUAL))
        for question in workload.questions:
            gold, q_ids, target = question_tokens(tokenizer, text, spans, question)
            window = set(range(gold[0] - GOLD_MARGIN, gold[-1] + GOLD_MARGIN + 1)) if gold else set()
            row: dict[str, Any] = {"workload": workload.name, "question": question.id}
            row["full"] = gold_logprob(exact, None, q_ids, target, "")
            for label, held in (("all", history), ("goldx", [p for p in history if p not in window])):
                parts = [quantized(k, v, held) for k, v in exact]
                kv, noise = [(k, v) for k, v, _ in parts], [n for _, _, n in parts]
                row[label] = gold_logprob(kv, noise, q_ids, target, "")
                row[label + "+b"] = gold_logprob(kv, noise, q_ids, target, "key")
                row[label + "+m"] = gold_logprob(kv, noise, q_ids, target, "mean")
            rows.append(row)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    for label in ("all", "goldx"):
        loss = sum(r["full"] - r[label] for r in rows) / len(rows)
        print(f"{label}: int4 loses {loss:.3f} nats per question against exact")
        for mode in ("+b", "+m"):
            gains = [r[label + mode] - r[label] for r in rows]
            print(
                f"  {label}{mode}: the correction changes it by {sum(gains) / len(gains):+.3f} "
                f"(better on {sum(g > 0 for g in gains)} of {len(gains)})"
            )


if __name__ == "__main__":
    main()
