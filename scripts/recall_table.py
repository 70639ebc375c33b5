"""The fidelity table of issue 11 from `scripts/recall_bench.py` outputs (JSON rows), as markdown.

One row per (method, budget): exact match pooled over every question the row's runs
asked, split by where the fact was stated and by how the question reaches it; device,
host and total bytes at answer time (mean over runs); the device bytes as a share of a
bf16 full cache (what a GPU user running the model in bf16 reads: full-precision KV
at half its fp32 bytes, int4/int2 codes and their float16 statistics unchanged);
whether the device stayed within the budget after every budget check; overhead pooled
over the runs (lifecycle + policy + store seconds over forward seconds).

`--diff A B` lists the questions method A answers right and B wrong (gained) and the
reverse (lost), per budget, with the EM difference, its 95% interval from a bootstrap
over workloads and McNemar's exact p, and the mean difference of the gold answer's
teacher-forced log-prob with its interval (`agentkv_bench.paired`); `METHOD@BUDGET`
names one budget of a method (a method's 25% against its 12.5%); B may be a method run at
one budget only (the full cache), then compared at every budget of A.

    .venv/bin/python scripts/recall_table.py runs/s6b/*.json old-recall=runs/a/contracts.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from agentkv.models import converted_model_dir
from agentkv.store.kivi import token_bytes
from agentkv_bench.paired import paired_difference, paired_mean
from agentkv_bench.workloads import load_workloads

SOURCES = ("user", "tool", "confirmed", "chosen")
STYLES = ("quote", "paraphrase")
MIB = 2**20


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    """Every run row of the files, the last one kept where a (workload, method, budget) repeats.

    A path given as `LABEL=PATH` marks its rows' method `method (LABEL)`: runs of one
    method on two versions of the code stay apart.
    """
    rows: dict[tuple[str, str, float], dict[str, Any]] = {}
    for given in paths:
        label, _, path = given.rpartition("=")
        for row in json.loads(Path(path).read_text()):
            if label:
                row["method"] = f"{row['method']} ({label})"
            rows[(row["workload"], row["method"], float(row["budget"]))] = row
    return list(rows.values())


def styles_of(workloads: set[str]) -> dict[tuple[str, str], str]:
    """(workload, question id) -> style, from the workload files."""
    return {(w.name, q.id): q.style for w in load_workloads(sorted(workloads)) for q in w.questions}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table, one row per (method, budget), largest budget first."""
    styles = styles_of({r["workload"] for r in rows})
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["method"], float(row["budget"]))].append(row)
    head = (
        "| method | budget | workloads | EM | user | tool | confirmed | chosen | quote | paraphrase "
        "| answer dev / host / total MiB | dev % of fp32 / bf16 full "
        "| peak dev ≤ budget | overhead % of forward |"
    )
    lines = [head, "|" + "---|" * 14]
    for (method, budget), runs in sorted(groups.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        asked = [q for r in runs for q in r["questions_detail"]]
        right = sum(int(q["exact_match"]) for q in asked)

        def share(key: str, value: str, questions: list[dict[str, Any]] = asked) -> str:
            picked = [q for q in questions if key_of(q, key, styles) == value]
            return f"{sum(int(q['exact_match']) for q in picked)}/{len(picked)}" if picked else "—"

        n = len(runs)
        dev = sum(r["answer_device_bytes"] + r["answer_quantized_bytes"] for r in runs) / n / MIB
        host = sum(r["answer_host_bytes"] for r in runs) / n / MIB
        fp32_share, bf16_share = full_cache_shares(runs)
        within = all(r["budget_unmet"] == 0 and r["peak_device_bytes"] <= r["budget_bytes"] for r in runs)
        forward = sum(r["forward_seconds"] for r in runs)
        overhead = 100 * sum(r["overhead_seconds"] for r in runs) / forward if forward else 0.0
        cells = [
            method,
            f"{budget:g}",
            str(n),
            f"{100 * right / len(asked):.1f}% ({right}/{len(asked)})",
            *(share("source", s) for s in SOURCES),
            *(share("style", s) for s in STYLES),
            f"{dev:.1f} / {host:.1f} / {dev + host:.1f}",
            f"{fp32_share:.1f} / {bf16_share:.1f}",
            "yes" if within else "no",
            f"{overhead:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def int4_token_bytes(group_size: int = 32) -> float:
    """One token's bytes in the attended int4 tier on the default model (codes + float16 statistics)."""
    config = json.loads((converted_model_dir() / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    one = token_bytes(
        1, kv_heads, head_dim, bits=4, key_bits=4, group_size=group_size, tokens=1, amortized=True
    )
    return float(one * config["num_hidden_layers"])


def full_cache_shares(runs: list[dict[str, Any]]) -> tuple[float, float]:
    """Answer-time device bytes in % of the full cache's, in fp32 (as run) and as they would be in bf16.

    The full cache is `full_tokens` tokens at the run's full-precision bytes per token
    (`budget_bytes / budget_tokens`). In bf16 it and the full-precision part of the
    attended KV halve, while int4 codes and their float16 statistics do not; the
    full-precision part is what the attended tokens and the device bytes leave once the
    int4 tokens are counted at `int4_token_bytes` (the attended tier's layout).
    """
    fp32 = bf16 = 0.0
    quantized_token = int4_token_bytes()
    for r in runs:
        token = r["budget_bytes"] / r["budget_tokens"] if r["budget_tokens"] else None
        if token is None:  # the full cache: every token at full precision
            fp32, bf16 = fp32 + 1.0, bf16 + 1.0
            continue
        full = r["full_tokens"] * token
        device, attended = r["answer_device_bytes"], r["answer_attended_tokens"]
        exact_tokens = min(
            attended, max(0.0, (device - attended * quantized_token) / (token - quantized_token))
        )
        fp32 += (device + r["answer_quantized_bytes"]) / full
        bf16 += (device - exact_tokens * token / 2 + r["answer_quantized_bytes"]) / (full / 2)
    return 100 * fp32 / len(runs), 100 * bf16 / len(runs)


def diff(rows: list[dict[str, Any]], a: str, b: str) -> str:
    """Questions `a` answers right and `b` wrong (gained), the reverse (lost), and what it is worth.

    Per budget of `a`: the EM difference with its 95% workload-bootstrap interval and
    McNemar's p, the mean gold log-prob difference with its interval
    (`agentkv_bench.paired`), then the questions gained and lost. A method run at one
    budget only (the full cache) is compared at every budget of `a`.
    """
    right: dict[str, dict[tuple[str, float, str], bool]] = defaultdict(dict)
    logprob: dict[str, dict[tuple[str, float, str], float]] = defaultdict(dict)
    budgets: dict[str, set[float]] = defaultdict(set)
    for row in rows:
        budgets[row["method"]].add(float(row["budget"]))
        for q in row["questions_detail"]:
            key = (row["workload"], float(row["budget"]), q["question"])
            right[row["method"]][key] = bool(q["exact_match"])
            logprob[row["method"]][key] = float(q["logprob"])
    only = next(iter(budgets[b])) if len(budgets[b]) == 1 else None
    lines: list[str] = []
    for budget in sorted(budgets[a], reverse=True):
        gained: list[str] = []
        lost: list[str] = []
        pairs: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
        scores: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for (workload, at, question), ok in sorted(right[a].items()):
            theirs = (workload, at if only is None else only, question)
            other = right[b].get(theirs)
            if at != budget or other is None:
                continue
            pairs[workload].append((ok, other))
            scores[workload].append((logprob[a][(workload, at, question)], logprob[b][theirs]))
            if ok != other:
                (gained if ok else lost).append(f"{workload}/{question}")
        if not pairs:
            continue
        lines.append(f"at {budget:g}: {a} against {b}: {paired_difference(pairs).describe()}")
        lines.append(f"  gold log-prob: {paired_mean(scores).describe()}")
        lines.append(f"  gained ({len(gained)}): {', '.join(gained) or '-'}")
        lines.append(f"  lost ({len(lost)}): {', '.join(lost) or '-'}")
    return "\n".join(lines) or f"no questions asked of both {a!r} and {b!r}"


def key_of(question: dict[str, Any], key: str, styles: dict[tuple[str, str], str]) -> str:
    """A question's `source` (from its row) or `style` (from its workload)."""
    if key == "style":
        return styles.get((question["workload"], question["question"]), "quote")
    return str(question[key])


def main() -> None:
    """Print the table of the files given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="recall_bench.py JSON outputs")
    parser.add_argument(
        "--diff",
        nargs=2,
        metavar=("A", "B"),
        help="questions method A gains and loses against B (METHOD@BUDGET: one budget of a method)",
    )
    args = parser.parse_args()
    rows = load_rows(args.paths)
    if args.diff:
        rows += [row for spec in args.diff for row in at_budget(rows, spec)]
    print(diff(rows, *args.diff) if args.diff else table(rows))


def at_budget(rows: list[dict[str, Any]], spec: str) -> list[dict[str, Any]]:
    """`METHOD@BUDGET`: that method's rows at that budget, as a method of its own (else none).

    `--diff agentkv-nohost@0.25 agentkv-nohost@0.125` pairs one method's two budgets question
    for question: whether more memory answers at least as well.
    """
    method, at, budget = spec.rpartition("@")
    if not at:
        return []
    return [
        {**r, "method": spec} for r in rows if r["method"] == method and float(r["budget"]) == float(budget)
    ]


if __name__ == "__main__":
    main()
