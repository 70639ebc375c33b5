"""Rung costs measured on the loaded model, and the planner taking them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.backend import calibration
from agentkv.backend.calibration import ARCHIVE_MISS, RungCosts, fractions, measure_rung_costs, rung_costs
from agentkv.config_sections import QuantizationConfig
from agentkv.lifecycle.placement import plan_placement, step_chain
from agentkv.lifecycle.rungs import DEFAULT_FIDELITY, Rung, RungOption, SpanOptions


def test_fractions_are_shares_of_a_drop_ordered_by_rung() -> None:
    kl = {"keys8": 0.3, "attended_q": 0.1, "archive8": 0.0, "archive4": 0.5, "dropped": 2.0}
    out = fractions(kl)
    assert out["dropped"] == 1.0 and out["full"] == 0.0
    assert out["keys8"] == pytest.approx(0.15)
    assert out["attended_q"] == pytest.approx(0.15)  # never cheaper than 8-bit keys
    assert out["archived"] == ARCHIVE_MISS  # exact archive: the recall-miss prior
    assert out["archive8"] == pytest.approx(ARCHIVE_MISS)
    assert out["archive4"] == pytest.approx(ARCHIVE_MISS + (1 - ARCHIVE_MISS) * 0.25)
    worse_than_drop = fractions({**kl, "attended_q": 9.0})
    assert worse_than_drop["attended_q"] == 1.0  # clipped


def test_archive_fidelity_follows_the_configured_tier() -> None:
    costs = RungCosts(
        fidelity=fractions(
            {"keys8": 0.01, "attended_q": 0.1, "archive8": 0.02, "archive4": 0.4, "dropped": 2.0}
        ),
        kl={},
        key="k",
    )
    assert costs.as_fidelity("host")[Rung.ARCHIVED] == ARCHIVE_MISS
    assert costs.as_fidelity("int4")[Rung.ARCHIVED] == pytest.approx(costs.fidelity["archive4"])
    assert costs.as_fidelity("host", host_bits=8)[Rung.ARCHIVED] == pytest.approx(costs.fidelity["archive8"])
    assert costs.as_fidelity("drop")[Rung.ATTENDED_Q] == pytest.approx(0.05)


def test_measured_on_a_model(tiny_model: Any, tiny_tokenizer: Any) -> None:
    costs = measure_rung_costs(tiny_model, tiny_tokenizer, QuantizationConfig())
    assert all(math.isfinite(v) and v >= 0 for v in costs.kl.values())
    assert costs.kl["dropped"] > 0
    assert costs.kl["archive8"] < costs.kl["archive4"]  # 8-bit codes read back closer than 4-bit ones
    two_bit = measure_rung_costs(tiny_model, tiny_tokenizer, QuantizationConfig(attended_bits=2))
    assert two_bit.kl["attended_q"] > costs.kl["attended_q"]
    assert two_bit.kl["dropped"] == pytest.approx(costs.kl["dropped"])  # the same text, the same reference


def test_cached_per_model_and_setting(
    tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    first = rung_costs(tiny_model, tiny_tokenizer, QuantizationConfig(), cache_dir=tmp_path)
    (stored,) = tmp_path.glob("*.json")
    assert json.loads(stored.read_text())["fidelity"] == first.fidelity

    def no_measuring(*args: Any, **kwargs: Any) -> RungCosts:
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "measure_rung_costs", no_measuring)
    assert rung_costs(tiny_model, tiny_tokenizer, QuantizationConfig(), cache_dir=tmp_path) == first
    with pytest.raises(AssertionError, match="measured again"):  # another setting is another key
        rung_costs(tiny_model, tiny_tokenizer, QuantizationConfig(attended_bits=2), cache_dir=tmp_path)


def test_backend_measures_once_and_fixed_keeps_the_priors(
    tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    calls: list[int] = []
    real = calibration.measure_rung_costs

    def counted(*args: Any, **kwargs: Any) -> RungCosts:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "measure_rung_costs", counted)
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path))
    backend = TransformersBackend(tiny_model, tiny_tokenizer)
    config = AgentKVConfig()
    first = backend.rung_fidelity(config)
    assert backend.rung_fidelity(config) is first and calls == [1]
    assert first[Rung.DROPPED] == 1.0 and first[Rung.FULL] == 0.0
    # Under pressure a `fixed` session plans with the priors: nothing is measured for its setting
    # (another group size), while a calibrated session with the same setting measures it.
    notes = [{"role": "user", "content": f"note {i}: the secret code is 44{i}7 lorem"} for i in range(4)]
    pressure = {"quantization": {"group_size": 16}, "budget": {"device_tokens": 24}}
    fixed = AgentKVConfig.model_validate({**pressure, "budget": {"device_tokens": 24, "rung_costs": "fixed"}})
    session = backend.session("fixed", config=fixed)
    session.extend(notes)
    assert session.stats().budget_satisfied and calls == [1]
    measured = backend.session("measured", config=AgentKVConfig.model_validate(pressure))
    measured.extend(notes)
    assert measured.stats().budget_satisfied and calls == [1, 1]


def _two_spans(fidelity: dict[Rung, float]) -> list[SpanOptions]:
    options = (
        RungOption(Rung.FULL, 1000, 0.0),
        RungOption(Rung.ATTENDED_Q, 280, fidelity[Rung.ATTENDED_Q]),
        RungOption(Rung.ARCHIVED, 0, fidelity[Rung.ARCHIVED]),
    )
    return [SpanOptions(1, 1.0, options, order=0), SpanOptions(2, 1.0, options, order=10)]


def test_the_same_code_plans_differently_for_different_models() -> None:
    """int4 nearly free (keys that quantize well): held attended; int4 as bad as not attending: archived."""
    cheap_int4 = {**DEFAULT_FIDELITY, Rung.ATTENDED_Q: 0.01}
    costly_int4 = {**DEFAULT_FIDELITY, Rung.ATTENDED_Q: 0.95}
    kept = plan_placement(_two_spans(cheap_int4), usage=2000, target=1300)
    assert set(kept.rungs.values()) == {Rung.ATTENDED_Q} and kept.met
    archived = plan_placement(_two_spans(costly_int4), usage=2000, target=1300)
    assert set(archived.rungs.values()) == {Rung.ARCHIVED} and archived.met
    assert [o.rung for o in step_chain(_two_spans(costly_int4)[0].options)] == [Rung.FULL, Rung.ARCHIVED]


def test_step_chain_is_the_lower_convex_hull() -> None:
    options = (
        RungOption(Rung.FULL, 1000, 0.0),
        RungOption(Rung.KEYS8, 700, 0.01),
        RungOption(Rung.ATTENDED_Q, 300, 0.6),  # above the line from 8-bit keys to the archive
        RungOption(Rung.ARCHIVED, 160, 0.62),
        RungOption(Rung.DROPPED, 0, 1.0),
    )
    chain = step_chain(options)
    assert [o.rung for o in chain] == [Rung.FULL, Rung.KEYS8, Rung.ARCHIVED, Rung.DROPPED]
    rates = [
        (b.fidelity - a.fidelity) / (a.device_bytes - b.device_bytes)
        for a, b in zip(chain, chain[1:], strict=False)
    ]
    assert rates == sorted(rates)


@st.composite
def _plans(draw: Any) -> tuple[list[SpanOptions], dict[Rung, float]]:
    attended_q = draw(st.floats(0.0, 1.0))
    fidelity = {
        **DEFAULT_FIDELITY,
        Rung.ATTENDED_Q: attended_q,
        Rung.KEYS8: attended_q * draw(st.floats(0, 1)),
    }
    spans = []
    for span_id in range(draw(st.integers(1, 8))):
        full = draw(st.integers(10, 500)) * 100
        pinned = draw(st.booleans())
        options = [
            RungOption(Rung.FULL, full, 0.0),
            RungOption(Rung.ATTENDED_Q, full // 4, fidelity[Rung.ATTENDED_Q]),
        ]
        if not pinned:
            options.append(RungOption(Rung.ARCHIVED, 0, fidelity[Rung.ARCHIVED]))
        value = draw(st.floats(0.01, 10.0))
        spans.append(SpanOptions(span_id, value, tuple(options), klass=3 if pinned else 0, order=span_id))
    return spans, fidelity


@settings(max_examples=200, deadline=None)
@given(_plans(), st.floats(0.05, 1.0))
def test_any_costs_the_limit_holds_and_pinned_spans_stay_attended(case: Any, share: float) -> None:
    spans, _ = case
    usage = sum(s.options[0].device_bytes for s in spans)
    floor = sum(min(o.device_bytes for o in s.options) for s in spans)
    target = int(usage * share)
    plan = plan_placement(spans, usage, target)
    assert plan.met == (plan.device_bytes <= target)
    if floor <= target:
        assert plan.met
    pinned = {s.span_id for s in spans if s.klass == 3}
    assert all(plan.rungs.get(i, Rung.FULL) in (Rung.FULL, Rung.ATTENDED_Q) for i in pinned)


@settings(max_examples=200, deadline=None)
@given(_plans(), st.floats(0.05, 0.95), st.floats(0.01, 0.5))
def test_any_costs_more_budget_never_loses_more_value(case: Any, share: float, more: float) -> None:
    spans, _ = case
    usage = sum(s.options[0].device_bytes for s in spans)
    small = plan_placement(spans, usage, int(usage * share))
    large = plan_placement(spans, usage, int(usage * min(1.0, share + more)))
    if small.met:
        assert large.loss <= small.loss + 1e-9
