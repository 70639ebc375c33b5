"""What a difference in exact match between two runs on the same questions is worth.

Two methods asked the same questions differ only on the questions one answers and
the other misses (the discordant pairs), so they are compared pair by pair:

- `mcnemar_exact`: McNemar's exact test, the two-sided binomial probability of a
  split of the discordant pairs at least this uneven if neither method were better.
  It treats questions as independent.
- `paired_difference`: the difference in exact match with a 95% interval from a
  bootstrap over *workloads* (`paired_mean`: the same for a continuous score, the
  gold answer's log-prob). The questions of one workload share one conversation
  and one cache, so a change that moves a single plan moves several of its answers
  together; resampling whole workloads keeps that dependence, where resampling
  questions would understate the spread.

A goal read off one number ("2.4 points under the full cache, goal 2") means little
without its interval: on a few hundred questions a 135M model's answers shift by
several points whenever its cache changes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RESAMPLES = 4000
"""Bootstrap resamples (the interval's ends move by well under a point between seeds)."""


@dataclass(frozen=True)
class PairedDifference:
    """Method A against method B on the same questions (points are percentage points of EM)."""

    questions: int
    gained: int
    """Questions A answers right and B wrong."""
    lost: int
    """Questions A answers wrong and B right."""
    points: float
    """EM of A minus EM of B, in percentage points."""
    low: float
    """Lower end of the interval, in points (workload bootstrap)."""
    high: float
    """Upper end of the interval, in points."""
    p_value: float
    """McNemar's exact two-sided p-value over the discordant pairs."""

    def describe(self, level: float = 0.95) -> str:
        """One line: the difference, its interval, the discordant pairs and the p-value."""
        return (
            f"{self.points:+.1f} points over {self.questions} questions "
            f"({100 * level:.0f}% interval {self.low:+.1f} to {self.high:+.1f}, workload bootstrap); "
            f"gained {self.gained}, lost {self.lost}, McNemar p = {self.p_value:.3f}"
        )


def mcnemar_exact(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: P(a split of `gained + lost` pairs at least this uneven | p = 1/2)."""
    if gained < 0 or lost < 0:
        msg = f"counts must be non-negative, got {gained} and {lost}"
        raise ValueError(msg)
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference(
    pairs: Mapping[str, Sequence[tuple[bool, bool]]],
    *,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> PairedDifference:
    """Compare A and B from `(a_right, b_right)` per question, grouped by workload.

    The EM difference and its interval are `paired_mean`'s over right = 1, wrong = 0
    (each bootstrap draw keeps a workload's questions together), in points; McNemar's
    p is over the discordant questions. Deterministic for a given `seed`.

    Raises:
        ValueError: no questions, or `level` outside (0, 1).
    """
    scores = {workload: [(float(a), float(b)) for a, b in qs] for workload, qs in pairs.items()}
    mean = paired_mean(scores, level=level, resamples=resamples, seed=seed)
    gained = sum(int(a and not b) for qs in pairs.values() for a, b in qs)
    lost = sum(int(b and not a) for qs in pairs.values() for a, b in qs)
    return PairedDifference(
        questions=mean.questions,
        gained=gained,
        lost=lost,
        points=100.0 * mean.mean,
        low=100.0 * mean.low,
        high=100.0 * mean.high,
        p_value=mcnemar_exact(gained, lost),
    )


@dataclass(frozen=True)
class PairedMean:
    """The mean per-question difference of a continuous score (A minus B), e.g. the gold log-prob."""

    questions: int
    mean: float
    low: float
    """Lower end of the interval (workload bootstrap)."""
    high: float

    def describe(self, unit: str = "nats", level: float = 0.95) -> str:
        """One line: the mean difference and its interval."""
        return (
            f"{self.mean:+.3f} {unit} per question ({100 * level:.0f}% interval "
            f"{self.low:+.3f} to {self.high:+.3f}, workload bootstrap)"
        )


def paired_mean(
    pairs: Mapping[str, Sequence[tuple[float, float]]],
    *,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> PairedMean:
    """Mean of `a - b` over questions, grouped by workload, with its workload-bootstrap interval.

    For the teacher-forced log-prob of the gold answer: a continuous score moves with
    every change to the cache, where exact match flips only when the argmax does, so it
    tells a lever that helps a little from one that does nothing on fewer questions.

    Raises:
        ValueError: no questions, or `level` outside (0, 1).
    """
    groups = [(sum(a - b for a, b in qs), len(qs)) for qs in pairs.values() if qs]
    questions = sum(n for _, n in groups)
    if not questions:
        msg = "no questions to compare"
        raise ValueError(msg)
    low, high = workload_interval(groups, level=level, resamples=resamples, seed=seed)
    return PairedMean(questions, sum(d for d, _ in groups) / questions, low, high)


def workload_interval(
    groups: Sequence[tuple[float, int]], *, level: float, resamples: int, seed: int
) -> tuple[float, float]:
    """Percentile interval of `sum(difference) / sum(questions)` over draws of whole workloads.

    `groups`: per workload, (summed difference, questions). Each draw takes as many
    workloads as there are, with replacement.
    """
    if not 0.0 < level < 1.0:
        msg = f"level must be in (0, 1), got {level}"
        raise ValueError(msg)
    rng = random.Random(seed)
    draws: list[float] = []
    for _ in range(resamples):
        picked = [groups[rng.randrange(len(groups))] for _ in groups]
        draws.append(sum(d for d, _ in picked) / sum(n for _, n in picked))
    draws.sort()
    tail = (1.0 - level) / 2
    return draws[math.floor(tail * (resamples - 1))], draws[math.ceil((1.0 - tail) * (resamples - 1))]
