r"""Budgeted runs of `agentkv bench memory` without re-running the `full` reference each time.

`agentkv bench memory` replays and questions the `full` cache before every
workload (it is the KL reference). On a loaded machine that doubles the time of a
lever-by-lever comparison, so this script sizes each budget the same way (a
fraction of the tokens the full cache attends at the final question, computed by
replaying the workload once without questions) and runs only the budgeted
methods, with the bench's own `run_one`. Exact match, bytes and overhead are the
bench's; KL is left out (no reference).

    .venv/bin/python scripts/recall_bench.py --workloads buildfix,analytics \\
        --methods agentkv-nohost,agentkv-snap --budgets 0.25,0.125 --out runs/recall/a.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from agentkv.backend.transformers import TransformersBackend
from agentkv.models import load_model
from agentkv_bench.memory import replay, run_one
from agentkv_bench.methods import METHODS
from agentkv_bench.workloads import load_workloads


def full_tokens(backend: TransformersBackend, workload) -> int:  # noqa: ANN001 - a Workload
    """Tokens the full cache attends once the final question is encoded (the bench's budget base)."""
    session = backend.session(f"{workload.name}:size")
    history = replay(session, workload, events=False)
    last = workload.questions[-1]
    session.extend([*history, {"role": "user", "content": last.question, "id": f"q-{last.id}"}])
    tokens = session.stats().attended_tokens
    backend.close(session.session_id)
    return tokens


def main() -> None:
    """Run each (workload, budget, method) and write the rows as JSON after each run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", required=True)
    parser.add_argument("--methods", required=True)
    parser.add_argument("--budgets", default="0.25,0.125")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--full-tokens", type=int, default=None, help="the full cache's tokens (skip sizing; one workload)"
    )
    args = parser.parse_args()
    model, tokenizer = load_model()
    budgets = [float(b) for b in args.budgets.split(",")]
    out: list[dict] = []
    for workload in load_workloads(args.workloads.split(",")):
        full = args.full_tokens or full_tokens(
            TransformersBackend(model, tokenizer, METHODS["full"].config(None)), workload
        )
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
                    f"{workload.name} {name} {budget}: EM {100 * run.exact_match:.1f}% "
                    f"device {run.answer_device_bytes / 2**20:.2f} MiB "
                    f"total {run.answer_total_bytes / 2**20:.2f} MiB "
                    f"overhead {run.overhead_pct:.1f}% "
                    + " ".join(f"{r.question}:{r.source}:{int(r.exact_match)}" for r in rows),
                    flush=True,
                )
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
