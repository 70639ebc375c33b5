r"""How well recall's ranking finds the message holding each question's fact, without running a budget.

For every question of the given workloads, each message of the conversation (system prompt,
user turns, tool results, assistant turns) is a candidate span, ranked against the question
by `agentkv.lifecycle.recall_ranking.rank_for_recall`, the function recall itself uses. The
rank of the message that holds the gold fact gives the mean reciprocal rank (MRR) and how
often it is in the top 3, per source of the fact. `--no-background` weighs words by session
IDF alone (without the model's surprisal) for comparison.

    .venv/bin/python scripts/recall_retrieval.py --workloads bakery,museumloans,rampshift,busdepot
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from agentkv.lifecycle.recall_ranking import rank_for_recall
from agentkv.models import load_model
from agentkv.spans import Span, SpanKind, SpanState
from agentkv_bench.workloads import WORKLOAD_DIR


def messages(data: dict) -> list[tuple[int, str]]:
    """(turn, text) of every message of a workload's conversation, in order."""
    out = [(0, data["system"])]
    for turn, step in enumerate(data["turns"], 1):
        out.append((turn, step["user"]))
        out += [
            (turn, json.dumps(tool.get("args", {})) + " " + str(tool.get("result", "")))
            for tool in step.get("tools", [])
        ]
        out.append((turn, step.get("assistant", "")))
    return out


def main() -> None:
    """Print MRR and top-3 hits per source, and over all questions."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", required=True)
    parser.add_argument("--no-background", action="store_true", help="session IDF alone")
    args = parser.parse_args()
    model, tokenizer = load_model()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokenizer.encode("\n")])).logits[0, -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)

    def information(word: str) -> float:
        ids = tokenizer.encode(" " + word)
        return float(-logprobs[ids[0]]) if ids else 0.0

    ranks: dict[str, list[int]] = defaultdict(list)
    unscored: dict[str, int] = defaultdict(int)
    """Questions whose fact's message shares no word with them (score 0: recall cannot find it)."""
    absent = 0
    for name in args.workloads.split(","):
        data = json.loads((Path(WORKLOAD_DIR) / f"{name}.json").read_text())
        docs = messages(data)
        spans = [
            Span(i, SpanKind.USER, tokenizer.encode(text), 1000 * i, state=SpanState.COMMITTED)
            for i, (_, text) in enumerate(docs)
        ]
        for question in data["questions"]:
            gold = {
                i
                for i, (turn, text) in enumerate(docs)
                if question["gold"] in text and turn == question["turn"]
            }
            gold = gold or {i for i, (_, text) in enumerate(docs) if question["gold"] in text}
            if not gold:  # the fact is in no message the session holds (a branch's own reasoning)
                absent += 1
                continue
            ranked = rank_for_recall(
                question["question"],
                spans,
                spans,
                text_of=lambda s, docs=docs: docs[s.span_id][1],
                information=None if args.no_background else information,
            )
            order = [span.span_id for span, _ in ranked]
            scores = {span.span_id: score for span, score in ranked}
            ranks[question["source"]].append(1 + min(order.index(g) for g in gold))
            unscored[question["source"]] += all(scores[g] <= 0 for g in gold)
    everything = [r for values in ranks.values() for r in values]
    unscored["all"] = sum(unscored.values())
    for source, values in [*sorted(ranks.items()), ("all", everything)]:
        mrr = sum(1 / r for r in values) / len(values)
        print(
            f"{source:<10} {len(values):>4} questions  MRR {mrr:.2f}  top-3 {sum(r <= 3 for r in values)}"
            f"  score 0 {unscored[source]}"
        )
    if absent:
        print(f"({absent} questions whose fact is in no message of the conversation left out)")


if __name__ == "__main__":
    main()
