"""Sliding window: keep the most recent tokens.

The simplest baseline (e.g. the "window attention" row of StreamingLLM, Xiao et
al. 2023, https://arxiv.org/abs/2309.17453): it forgets early facts as soon as the
conversation outgrows the budget, which is exactly what agentkv's benchmarks show.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.policies.base import Policy, SpanView


@dataclass
class SlidingWindowPolicy(Policy):
    """Pure recency: score = logical position, so the last k tokens are kept."""

    needs_attention = False
    needs_query = False

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` logical positions as float scores (later = higher)."""
        return view.positions.cpu().float()
