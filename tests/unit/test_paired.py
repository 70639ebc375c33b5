"""Paired comparison of two runs' answers: McNemar's exact test and the workload bootstrap."""

from __future__ import annotations

import math

import pytest

from agentkv_bench.paired import mcnemar_exact, paired_difference, paired_mean


def test_mcnemar_exact_matches_the_binomial_tail() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 * 0.5**10)
    # 8 against 2: P(X <= 2 | n = 10, p = 1/2), twice.
    assert mcnemar_exact(8, 2) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert mcnemar_exact(2, 8) == mcnemar_exact(8, 2)
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 3)


def test_identical_runs_differ_by_nothing() -> None:
    pairs = {f"w{i}": [(True, True), (False, False), (True, True)] for i in range(5)}
    result = paired_difference(pairs)
    assert (result.points, result.low, result.high, result.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert (result.gained, result.lost, result.questions) == (0, 0, 15)


def test_a_consistent_gain_has_an_interval_above_zero() -> None:
    # In every workload A answers one question B misses, out of four.
    pairs = {f"w{i}": [(True, False), (True, True), (False, False), (True, True)] for i in range(8)}
    result = paired_difference(pairs)
    assert result.points == pytest.approx(25.0)
    assert result.low > 0.0 and result.low <= result.points <= result.high
    assert result.gained == 8 and result.lost == 0
    assert result.p_value < 0.01


def test_a_gain_from_one_workload_is_not_significant_across_workloads() -> None:
    # Ten answers gained, all in one workload of ten: McNemar (questions independent) calls it
    # significant; resampling workloads leaves that workload out of about a third of the draws.
    pairs = {"lucky": [(True, False)] * 10}
    pairs.update({f"w{i}": [(True, True)] * 10 for i in range(9)})
    result = paired_difference(pairs)
    assert result.p_value < 0.01
    assert result.low == 0.0
    assert result.high >= result.points == pytest.approx(10.0)


def test_the_interval_is_deterministic_for_a_seed() -> None:
    pairs = {f"w{i}": [(i % 2 == 0, i % 3 == 0), (True, i % 4 == 0)] for i in range(7)}
    first = paired_difference(pairs, seed=3)
    assert paired_difference(pairs, seed=3) == first
    assert math.isfinite(first.low) and first.low <= first.points <= first.high


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no questions"):
        paired_difference({"w": []})
    with pytest.raises(ValueError, match="level"):
        paired_difference({"w": [(True, False)]}, level=1.5)


def test_the_mean_log_prob_difference_and_its_interval() -> None:
    # A adds 0.5 nats to every question of three workloads and loses 1.5 on one question of a fourth.
    pairs = {f"w{i}": [(-1.0, -1.5), (-2.0, -2.5)] for i in range(3)}
    pairs["w3"] = [(-3.0, -1.5), (-1.0, -1.0)]
    result = paired_mean(pairs)
    assert result.questions == 8
    assert result.mean == pytest.approx((6 * 0.5 - 1.5) / 8)
    assert result.low <= result.mean <= result.high
    # A quarter of the draws hold w3 twice or more (a net loss); a third hold no w3 at all.
    assert result.low < 0.0
    assert result.high == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no questions"):
        paired_mean({})
