"""`agentkv bench forget` on the tiny model: the figures are computed and the labels hold."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from agentkv_bench.forget import forget_table, run_forget_bench
from agentkv_bench.forget_traces import forget_traces, needed_handles


def test_traces_label_needed_results_by_their_questions():
    for trace in forget_traces():
        labels = needed_handles(trace)
        assert any(labels.values()) and not all(labels.values())
        for question in trace.questions:
            turn = trace.turns[question.turn - 1]
            assert any(question.gold in tool.result for tool in turn.tools), question.id


@pytest.fixture(scope="module")
def long_tiny_model(tiny_model: torch.nn.Module) -> torch.nn.Module:
    """The tiny random Llama with room for the traces (its byte-level tokenizer spells them long)."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(tiny_model.config)
    config.max_position_embeddings = 8192
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def test_the_oracle_releases_only_stale_results_and_holds_fewer_tokens(
    long_tiny_model, tiny_tokenizer, tmp_path
):
    result = run_forget_bench(
        long_tiny_model, tiny_tokenizer, budgets=(None,), methods=("off", "oracle"), out_dir=tmp_path
    )
    assert json.loads((tmp_path / "forget.json").read_text())["summary"] == result["summary"]
    runs = {(r["trace"], r["method"]): r for r in result["runs"]}
    for trace in forget_traces():
        off, oracle = runs[(trace.name, "off")], runs[(trace.name, "oracle")]
        assert off["released"] == 0 and off["side_runs"] == 0
        assert oracle["released"] >= 1 and oracle["released_needed"] == 0
        assert oracle["released_stale"] == oracle["released"] <= oracle["stale_total"]
        assert oracle["mean_device_tokens"] < off["mean_device_tokens"]
    assert forget_table(result).row_count == 2
