"""`budget.device_tokens` counts full-precision token equivalents, and every figure says so.

`N` tokens are `N` times one token's KV bytes at the model's dtype; tokens held at int4
in attention take less, so more than `N` stay attended while the budget is met. The
stats give the limit and the usage in bytes and in those tokens; the unmet-budget
warning prints both.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.config import BudgetConfig
from agentkv.lifecycle.limits import BudgetLimits

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "graph.yaml"


def notes(n: int) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(n):
        history.append({"role": "user", "content": f"note {i}: the secret code is 44{i}7 lorem ipsum dolor"})
        history.append({"role": "assistant", "content": f"noted {i}"})
    return history


def test_limits_resolve_tokens_as_full_precision_bytes_and_hold_the_watermarks() -> None:
    budget = BudgetConfig(device_tokens=100, host_tokens=50, high_watermark=0.9, low_watermark=0.5)
    limits = BudgetLimits.resolve(budget, bytes_per_token=1000)
    assert limits.device_bytes == 100_000 and limits.host_bytes == 50_000
    assert limits.high_bytes(100_000) == 90_000 and limits.low_bytes(100_000) == 50_000
    assert limits.over(90_001, 100_000) and not limits.over(90_000, 100_000)
    assert not limits.over(10**9, None)
    assert limits.in_tokens(25_000) == 25.0
    assert "25 full-precision tokens" in limits.describe(25_000)
    # A tier given in tokens and in bytes gets the tighter of the two, device and host alike.
    both = BudgetLimits.resolve(BudgetConfig(device_tokens=100, device_bytes=1234), bytes_per_token=1000)
    assert both.device_bytes == 1234


@pytest.mark.parametrize("tier", ["device", "host"])
def test_tokens_and_bytes_together_give_the_tighter_limit(tier: str) -> None:
    """examples/graph.yaml's pair: 1,024 tokens next to 64MiB (1,456 tokens of the default model)."""
    per_token = 46_080  # SmolLM2-135M at fp32: 30 layers x K and V x 3 heads x 64 x 4 bytes
    tokens_first = BudgetConfig.model_validate({f"{tier}_tokens": 1024, f"{tier}_bytes": "64MiB"})
    bytes_first = BudgetConfig.model_validate({f"{tier}_tokens": 4096, f"{tier}_bytes": "64MiB"})
    assert getattr(BudgetLimits.resolve(tokens_first, per_token), f"{tier}_bytes") == 1024 * per_token
    assert getattr(BudgetLimits.resolve(bytes_first, per_token), f"{tier}_bytes") == 64 * 2**20


def test_the_example_yaml_budget_is_its_token_figure(tiny_model, tiny_tokenizer) -> None:
    config = AgentKVConfig.from_yaml(EXAMPLE)
    assert config.budget.device_tokens == 1024 and config.budget.device_bytes is not None
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("yaml")
    assert session.limits.device_bytes == 1024 * session.backend.bytes_per_token


def test_global_excess_lowers_the_growing_sessions_limit() -> None:
    budget = BudgetConfig(
        device_tokens=100, global_device_bytes=10_000, high_watermark=1.0, low_watermark=0.5
    )
    limits = BudgetLimits.resolve(budget, bytes_per_token=1000)
    assert limits.device_share(own_usage=4_000, backend_usage=9_000) == 100_000  # under the global limit
    # 12 000 held in all, 5 000 over the global low watermark: this session keeps 8 000 - 7 000.
    assert limits.device_share(own_usage=8_000, backend_usage=12_000) == 1_000


def test_int4_holds_more_tokens_than_the_budget_counts_and_the_stats_say_so(tiny_model, tiny_tokenizer):
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())
    free = backend.session("free")
    free.extend(notes(8))
    full_tokens = free.stats().attended_tokens
    budget = full_tokens // 2
    # The old order by name: every span at int4 before any archive (the default keeps needed spans full).
    config = AgentKVConfig.from_dict(
        {"budget": {"device_tokens": budget, "placement_order": "attended_first"}}
    )
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")
    session.extend(notes(8))
    stats = session.stats()
    per_token = session.runner.bytes_per_token
    assert stats.budget_satisfied
    assert stats.budget_device_bytes == budget * per_token
    assert stats.budget_device_tokens == pytest.approx(budget)
    assert stats.budget_used_tokens == pytest.approx(stats.budget_used_bytes / per_token)
    assert stats.budget_used_tokens <= budget
    # More tokens attended than the budget's count: some are held at int4 in attention.
    assert stats.attended_quantized_tokens > 0
    assert stats.attended_tokens > budget


def test_an_unmet_budget_warns_in_bytes_and_full_precision_tokens(tiny_model, tiny_tokenizer, caplog):
    config = AgentKVConfig.from_dict({"budget": {"device_tokens": 4}})
    session = TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")
    with caplog.at_level(logging.WARNING, logger="agentkv"):
        session.extend(notes(2))
    assert not session.stats().budget_satisfied
    assert "full-precision tokens" in caplog.text and " B (= " in caplog.text
