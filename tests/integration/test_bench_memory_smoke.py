"""`agentkv bench memory` end to end on the default model: one workload, full + agentkv + window at 25%.

Checks structure only (the JSON, the plots, that the full cache's exact match was
computed); accuracy thresholds and timings belong to the benchmark's own report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentkv_bench.memory import run_memory_bench
from agentkv_bench.workloads import load_workload

pytestmark = pytest.mark.integration

WORKLOAD = "support"
"""The shortest shipped workload."""


@pytest.fixture(scope="module")
def default_model() -> tuple[Any, Any]:
    from agentkv.models import load_model

    return load_model()


def test_memory_bench_smoke(default_model: tuple[Any, Any], tmp_path: Path) -> None:
    model, tokenizer = default_model
    result = run_memory_bench(
        model,
        tokenizer,
        budgets=(0.25,),
        methods=("full", "agentkv", "window"),
        workloads=[WORKLOAD],
        out_dir=tmp_path,
        show_table=False,
    )
    assert (tmp_path / "memory.json").is_file()
    assert json.loads((tmp_path / "memory.json").read_text())["config"]["workloads"] == [WORKLOAD]
    for png in ("memory_accuracy.png", "memory_device.png"):
        assert (tmp_path / png).stat().st_size > 0

    questions = len(load_workload(WORKLOAD).questions)
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"full", "agentkv", "window"}
    assert runs["full"]["budget"] is None and runs["agentkv"]["budget"] == 0.25
    assert runs["agentkv"]["budget_tokens"] == runs["window"]["budget_tokens"] > 0
    for run in runs.values():
        assert run["questions"] == questions
        assert 0.0 <= run["exact_match"] <= 1.0
        assert run["forward_seconds"] > 0 and run["peak_device_bytes"] > 0
    assert runs["agentkv"]["events_applied"] > runs["window"]["events_applied"]
    assert runs["agentkv"]["peak_device_bytes"] < runs["full"]["peak_device_bytes"]

    summary = {(s["method"], s["budget"]): s for s in result["summary"]}
    full = summary[("full", None)]
    assert full["questions"] == questions and 0.0 <= full["exact_match_pct"] <= 100.0
    assert len(result["questions"]) == 3 * questions
    figures = result["acceptance"]
    assert figures["best_baseline"] == "window"
    assert {"full_em_pct", "agentkv_em_pct", "agentkv_overhead_pct"} <= set(figures)
