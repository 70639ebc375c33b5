r"""Replay `agentkv bench calls` traces under one method, against the full rows of an earlier run.

`agentkv bench calls` runs the full cache first and then every budgeted setting. To
compare a variant (a patch on another tree, put first on `PYTHONPATH`) or a further
method with the defaults, this script replays only the budgeted runs and reads the
full cache's rows, and the defaults' rows to pair with, from a `calls.json`
(`{"rows": [...]}`). `--kv-bf16` runs the *full* cache with every key and value
projection rounded to bfloat16 as it is written (RoPE is applied after, in the
model's dtype): the full cache at the KV precision a GPU user runs, read against the
float32 full cache, which is how far calls move on noise no budget causes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/calls_replay.py runs/calls/main.json apiary,carhire \
        --method snapkv --budgets 0.25 --out runs/calls-snapkv.json
    OMP_NUM_THREADS=1 .venv/bin/python scripts/calls_replay.py runs/calls/main.json apiary --kv-bf16 \
        --out runs/calls-bf16.json
    .venv/bin/python scripts/calls_replay.py runs/calls/main.json --compare runs/calls-snapkv.json

The comparison prints, per method and budget, on the calls replayed: how many have the
full cache's tool, its tool and arguments, with the tool forced its arguments, and the
trace's values written (`agentkv_bench.call_bench.calls_summary`'s shares, as counts),
and the mean device / host / total MiB at the call, beside the same figures for the
defaults' budgeted rows on the same calls.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from agentkv.backend.transformers import TransformersBackend
from agentkv.models import load_model
from agentkv_bench.call_bench import CallRow, calls_summary, load_call_traces, replay_calls
from agentkv_bench.methods import METHODS

REFERENCE = "agentkv-nohost"
"""The method whose budgeted rows the comparison pairs with."""


def round_kv_to_bf16(model: torch.nn.Module) -> int:
    """Round every `k_proj` / `v_proj` output to bfloat16 and back; the number of hooks."""

    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(torch.bfloat16).to(output.dtype)

    hooks = 0
    for name, module in model.named_modules():
        if name.endswith(("k_proj", "v_proj")):
            module.register_forward_hook(hook)
            hooks += 1
    return hooks


def replay(reference: Sequence[CallRow], traces: list[str], args: argparse.Namespace) -> list[CallRow]:
    """The budgeted (or `--kv-bf16` full) runs of `traces`, written to `args.out` as they finish."""
    model, tokenizer = load_model()
    if args.kv_bf16 and not round_kv_to_bf16(model):
        raise SystemExit("--kv-bf16: the model has no k_proj / v_proj modules")
    method = METHODS["full" if args.kv_bf16 else args.method]
    label = "full+kv-bf16" if args.kv_bf16 else args.label or method.name
    budgets = [1.0] if args.kv_bf16 else [float(b) for b in args.budgets.split(",")]
    rows: list[CallRow] = []
    for trace in load_call_traces(traces):
        full = [r for r in reference if r.trace == trace.name and r.method == "full"]
        if not full:
            raise SystemExit(f"{args.calls_json} has no full rows for trace {trace.name!r}")
        full_tokens = max(r.attended_tokens for r in full)
        for budget in budgets:
            tokens = None if not method.budgeted else max(1, round(budget * full_tokens))
            backend = TransformersBackend(model, tokenizer, method.config(tokens))
            rows += replay_calls(backend, trace, method=label, budget=budget, events=method.events)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"rows": [asdict(r) for r in rows]}, f)
            print(f"{trace.name} {budget}", flush=True)
    return rows


def described(line: dict[str, Any]) -> str:
    """One `calls_summary` line as counts: same tool / same call / forced same arguments / values, and MiB."""
    n = line["calls"]
    shares = ("same_tool_as_full", "same_call_as_full", "forced_same_as_full")
    agreed = " / ".join(str(round(line[key] * n)) for key in shares)
    memory = f"{line['device_mib']:.1f} / {line['host_mib']:.1f} / {line['total_mib']:.1f} MiB"
    return f"{agreed} / {line['script_values'] * n:.2f} of {n}; device / host / total {memory}"


def compare(reference: Sequence[CallRow], paths: list[str]) -> None:
    """Print each replayed method's counts beside the reference method's on the same calls."""
    full = [r for r in reference if r.method == "full"]
    ref = {(r.trace, r.step, r.budget): r for r in reference if r.method == REFERENCE}
    rows: list[CallRow] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows += [CallRow(**r) for r in json.load(f)["rows"]]
    print("same tool / same call / forced: same arguments / trace's values (counts), mean bytes at the call")
    for line in calls_summary(full + rows):
        if line["method"] == "full":
            continue
        group = [r for r in rows if (r.method, r.budget) == (line["method"], line["budget"])]
        paired = [ref[key] for r in group if (key := (r.trace, r.step, r.budget)) in ref]
        text = f"{line['method']} at {line['budget']:g}: {described(line)}"
        if paired and len(paired) == len(group):
            base = next(b for b in calls_summary(full + paired) if b["method"] == REFERENCE)
            text += f"\n    {REFERENCE} on the same calls: {described(base)}"
        print(text)


def main() -> None:
    """Replay, or compare replays with the reference run."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("calls_json", help="an `agentkv bench calls` run with full rows ({'rows': [...]})")
    parser.add_argument("traces", nargs="?", default="", help="comma-separated trace names")
    parser.add_argument("--method", default=REFERENCE, choices=sorted(METHODS))
    parser.add_argument("--label", help="the method name the rows carry (default: the method's)")
    parser.add_argument("--budgets", default="0.25,0.125")
    parser.add_argument(
        "--kv-bf16", action="store_true", help="the full cache with K and V rounded to bfloat16"
    )
    parser.add_argument("--out", help="where the replayed rows go")
    parser.add_argument("--compare", nargs="+", metavar="ROWS_JSON", help="print counts of these replays")
    args = parser.parse_args()
    with open(args.calls_json, encoding="utf-8") as f:
        reference = [CallRow(**r) for r in json.load(f)["rows"]]
    if args.compare:
        compare(reference, args.compare)
        return
    if not args.traces or not args.out:
        parser.error("a replay needs traces and --out")
    replay(reference, [t for t in args.traces.split(",") if t], args)


if __name__ == "__main__":
    main()
