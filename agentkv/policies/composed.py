"""Composition by wrapping: a policy made of policies is still a policy.

Instead of a plugin system, scorers combine the way kvpress presses do: a wrapper
holds its parts and fills in `score`. Two needs keep recurring — "mix these
signals" and "but never drop the sinks / the last few tokens" — so those are the
wrappers here. A wrapper's `needs_*` flags are the union of its parts' (`_read_what_parts_read`),
so the session collects what any part reads.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from agentkv.policies.base import Policy, SpanView, check_count, lift, recent_mask


def _check_policy(owner: str, value: object) -> None:
    if not isinstance(value, Policy):
        msg = f"{owner}: expected a Policy, got {type(value).__name__}"
        raise TypeError(msg)


def _read_what_parts_read(wrapper: Policy, parts: Sequence[Policy]) -> None:
    """A wrapper needs every signal any of its parts reads (attention, queries, keys, H2O sums)."""
    wrapper.needs_attention = any(p.needs_attention for p in parts)
    wrapper.needs_query = any(p.needs_query for p in parts)
    wrapper.needs_keys = any(p.needs_keys for p in parts)
    wrapper.needs_accumulated_attention = any(p.needs_accumulated_attention for p in parts)


@dataclass
class WeightedSumPolicy(Policy):
    """Score = Σ weight · z(part score): each part is z-normalised so scales do not matter.

    Example: `WeightedSumPolicy(((KeyNormPolicy(), 0.5), (H2OPolicy(), 1.0)))`.
    """

    parts: tuple[tuple[Policy, float], ...]
    """(policy, weight) pairs; weights may be negative to penalise a signal."""

    def __post_init__(self) -> None:
        self.parts = tuple((p, w) for p, w in self.parts)
        if not self.parts:
            msg = "WeightedSumPolicy needs at least one (policy, weight) part, got none"
            raise ValueError(msg)
        for policy, weight in self.parts:
            _check_policy("WeightedSumPolicy", policy)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
                name = type(policy).__name__
                msg = f"WeightedSumPolicy: weight for {name} must be a finite number, got {weight!r}"
                raise ValueError(msg)
        _read_what_parts_read(self, [p for p, _ in self.parts])

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` weighted sum of the parts' z-scores."""
        total = torch.zeros(view.num_tokens)
        for policy, weight in self.parts:
            total += float(weight) * _zscore(policy.score(view).float().cpu())
        return total


@dataclass
class ProtectPolicy(Policy):
    """`inner`'s scores, with the tokens `protected_mask` marks ranked above everything.

    The base of the "never drop these" wrappers: a subclass names its count field in
    `count_field` and fills in `protected_mask`; the check, the lift and the signals
    `inner` reads are shared.
    """

    inner: Policy
    """The policy that ranks the remaining tokens."""

    count_field: ClassVar[str]
    """The name of the field that says how many tokens are protected (a count >= 0)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_policy(owner, self.inner)
        check_count(owner, self.count_field, getattr(self, self.count_field))
        _read_what_parts_read(self, [self.inner])

    @abstractmethod
    def protected_mask(self, view: SpanView) -> torch.Tensor:
        """`[n]` bool: the tokens ranked first."""

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` inner scores, the protected tokens lifted above all others."""
        return lift(self.inner.score(view).float().cpu(), self.protected_mask(view))


@dataclass
class ProtectRecentPolicy(ProtectPolicy):
    """`inner`'s scores, with the last `recent_tokens` of the conversation ranked above everything."""

    recent_tokens: int = 32
    """Tokens within this many logical positions of the end are always ranked first."""
    count_field: ClassVar[str] = "recent_tokens"

    def protected_mask(self, view: SpanView) -> torch.Tensor:
        """`[n]` bool: the tokens within `recent_tokens` of the end."""
        return recent_mask(view, self.recent_tokens)


@dataclass
class ProtectSinksPolicy(ProtectPolicy):
    """`inner`'s scores, with the first `sink_tokens` logical positions ranked first (StreamingLLM sinks)."""

    sink_tokens: int = 4
    """Logical positions 0 .. sink_tokens-1 are always ranked first."""
    count_field: ClassVar[str] = "sink_tokens"

    def protected_mask(self, view: SpanView) -> torch.Tensor:
        """`[n]` bool: the logical positions below `sink_tokens`."""
        return view.positions.cpu() < self.sink_tokens


def _zscore(scores: torch.Tensor) -> torch.Tensor:
    """(s − mean) / std; all zeros when the scores are constant (the part then has no say)."""
    if scores.numel() < 2:
        return torch.zeros_like(scores)
    std = scores.std(unbiased=False)
    if not bool(std > 0) or not bool(torch.isfinite(std)):
        return torch.zeros_like(scores)
    return (scores - scores.mean()) / std
