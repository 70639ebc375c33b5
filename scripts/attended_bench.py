r"""Budgeted runs of the attended quantized tier without re-running the `full` reference.

`agentkv bench memory` replays and questions the `full` cache before every workload
(the KL reference); on a loaded machine that doubles the time of each comparison.
This script sizes each budget as the bench does (a fraction of the tokens the full
cache attends once the final question is encoded, found by one replay without
questions) and runs only the budgeted methods with the bench's own `run_one`.
Exact match, bytes and overhead are the bench's; KL is left out (no reference).
Rows (with per-question results) are written after every run, so a long run that
is stopped still leaves what it measured.

    .venv/bin/python scripts/attended_bench.py --workloads buildfix,analytics \
        --methods agentkv-q4 --budgets 0.25 --out runs/attended/q4-25.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agentkv.backend.transformers import TransformersBackend
from agentkv.bench.memory import replay, run_one
from agentkv.bench.methods import METHODS
from agentkv.bench.workloads import Workload, load_workloads
from agentkv.models import load_model


def full_tokens(backend: TransformersBackend, workload: Workload) -> int:
    """Tokens the full cache attends once the final question is encoded (the bench's budget base)."""
    session = backend.session(f"{workload.name}:size")
    history = replay(session, workload, events=False)
    last = workload.questions[-1]
    session.extend([*history, {"role": "user", "content": last.question, "id": f"q-{last.id}"}])
    tokens = session.stats().attended_tokens
    backend.close(session.session_id)
    return tokens


def main() -> None:
    """Run each (workload, budget, method); write all rows as JSON after each run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", required=True, help="comma-separated names or JSON paths")
    parser.add_argument("--methods", required=True, help="comma-separated `METHODS` names")
    parser.add_argument("--budgets", default="0.25", help="comma-separated fractions of the full cache")
    parser.add_argument("--out", required=True, help="JSON file")
    args = parser.parse_args()
    model, tokenizer = load_model()
    budgets = [float(b) for b in args.budgets.split(",")]
    out: list[dict[str, Any]] = []
    for workload in load_workloads(args.workloads.split(",")):
        full = full_tokens(TransformersBackend(model, tokenizer, METHODS["full"].config(None)), workload)
        for budget in budgets:
            for name in args.methods.split(","):
                method = METHODS[name]
                tokens = max(1, round(budget * full))
                backend = TransformersBackend(model, tokenizer, method.config(tokens))
                run, rows, _, _ = run_one(
                    backend,
                    workload,
                    method,
                    budget=budget,
                    budget_tokens=tokens,
                    full_tokens=full,
                    reference=None,
                )
                row = {k: v for k, v in asdict(run).items() if k != "steps"}
                row["questions_detail"] = [asdict(r) for r in rows]
                out.append(row)
                print(
                    f"{workload.name} {name} {budget} ({tokens}/{full} tok): EM {100 * run.exact_match:.1f}% "
                    f"peak device {run.peak_device_bytes / 2**20:.2f} MiB "
                    f"host {run.peak_host_bytes / 2**20:.2f} MiB all {run.peak_total_bytes / 2**20:.2f} MiB "
                    f"overhead {run.overhead_pct:.1f}% unmet {row.get('budget_unmet')} "
                    + " ".join(f"{r.question}:{r.source}:{int(r.exact_match)}:{r.answer!r}" for r in rows),
                    flush=True,
                )
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
