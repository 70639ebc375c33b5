r"""Where the values of the full cache's call are when the budgeted model writes its call.

Reads the rows `agentkv bench calls` wrote (`calls.json`), replays one trace under one
method and budget with the bench's own loop, and at each call step finds, for every
argument value of the *full cache's* call at that step (strings of 3+ characters and
numbers), the spans whose text holds it and whether its tokens are held at full
precision (`exact`), quantized in attention with their 8-bit key planes (`k8`) or at
4-bit keys (`int4`), or not attended (`out`). Each holder is named by its kind and by
how many tool results back it is (`r0` = the latest result, `u` = a user message), so
a changed call can be told apart: the value was not attended, was quantized, or was
exact and the model wrote something else.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/call_sources.py runs/calls/a/calls.json carhire --budget 0.125
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

from gold_at_answer import _precision, gold_offsets

import agentkv_bench.call_bench as bench
from agentkv.models import load_model
from agentkv.spans import SpanKind
from agentkv_bench.methods import METHODS


def leaves(value: Any) -> Iterator[str]:
    """The argument values worth locating: strings of 3+ characters and numbers, as text."""
    if isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from leaves(item)
    elif isinstance(value, bool):
        return
    elif isinstance(value, int | float):
        yield f"{value:g}" if isinstance(value, float) else str(value)
    elif isinstance(value, str) and len(value) >= 3:
        yield value


def main() -> None:
    """Replay the trace; print per call the budgeted call, the full one and where its values are."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("calls_json")
    parser.add_argument("trace")
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--method", default="agentkv-nohost", choices=sorted(METHODS))
    args = parser.parse_args()
    with open(args.calls_json, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    full = {r["step"]: r for r in rows if r["trace"] == args.trace and r["method"] == "full"}
    full_tokens = max(r["attended_tokens"] for r in full.values())
    model, tokenizer = load_model()
    row_of = bench._row

    def located(trace: Any, step: int, method: str, budget: float, *rest: Any) -> Any:
        row = row_of(trace, step, method, budget, *rest)
        session = rest[-1]
        reference = full[step]
        results = [s for s in session.table.spans if s.kind is SpanKind.TOOL_RESULT]
        places = []
        for value in leaves(reference["args"] or {}):
            held = []
            for span in session.table.spans:
                if span.generated:
                    continue
                offsets = gold_offsets(tokenizer, span.token_ids, value)
                if not offsets:
                    continue
                name = f"r{len(results) - 1 - results.index(span)}" if span in results else str(span.kind)[:4]
                if not span.tier.attended:
                    held.append(f"{name}:out")
                    continue
                quantized = set(session.store.quantized_offsets(span)).intersection(offsets)
                held.append(f"{name}:{_precision(session.store, span, sorted(quantized))}")
            places.append(f"{value[:18]}@{'|'.join(held) or 'nowhere'}")
        same = row.call is not None and row.call == bench.canonical(
            reference["name"], reference["args"] or {}
        )
        mark = "same" if same else ("tool" if row.name == reference["name"] else "DIFF")
        print(f"{mark} {step} attended={row.attended_tokens} {'  '.join(places)}")
        if not same:
            print(f"      full: {reference['name']} {json.dumps(reference['args'])[:150]}")
            print(f"      here: {row.name} {json.dumps(row.args)[:150]}")
        return row

    bench._row = located
    method = METHODS[args.method]
    tokens = max(1, round(args.budget * full_tokens))
    backend = bench.TransformersBackend(model, tokenizer, method.config(tokens))
    trace = bench.load_call_traces([args.trace])[0]
    bench.replay_calls(backend, trace, method=args.method, budget=args.budget, events=method.events)


if __name__ == "__main__":
    main()
