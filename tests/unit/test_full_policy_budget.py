"""Policy `full` keeps every token: a device budget is reported, and reported unmet above its limit."""

from __future__ import annotations

from typing import Any

from agentkv import AgentKVConfig, TransformersBackend
from tests.unit.session_history import HISTORY


def _session(tiny_model: Any, tiny_tokenizer: Any, budget: dict[str, Any]) -> Any:
    config = AgentKVConfig.from_dict({"policy": "full", "budget": budget})
    return TransformersBackend(tiny_model, tiny_tokenizer, config).session("t")


def test_full_over_its_budget_reports_it_unmet(tiny_model: Any, tiny_tokenizer: Any) -> None:
    session = _session(tiny_model, tiny_tokenizer, {"device_tokens": 16})
    session.extend(HISTORY)
    stats = session.stats()
    assert stats.budget_used_bytes > stats.budget_device_bytes  # nothing was demoted
    assert not stats.budget_satisfied
    assert stats.budget_unmet >= 1
    session.check()


def test_full_under_its_budget_reports_it_met(tiny_model: Any, tiny_tokenizer: Any) -> None:
    session = _session(tiny_model, tiny_tokenizer, {"device_tokens": 100_000})
    session.extend(HISTORY)
    stats = session.stats()
    assert stats.budget_used_bytes <= stats.budget_device_bytes
    assert stats.budget_satisfied and stats.budget_unmet == 0


def test_full_without_a_budget_is_met(tiny_model: Any, tiny_tokenizer: Any) -> None:
    session = _session(tiny_model, tiny_tokenizer, {})
    session.extend(HISTORY)
    assert session.stats().budget_satisfied
