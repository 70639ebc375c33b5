"""H2O: heavy hitters (accumulated attention) plus the most recent tokens.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
of Large Language Models", https://arxiv.org/abs/2306.14048. A small set of tokens
collects most of the attention over time; keeping them and a recent window
preserves quality.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.policies.base import Policy, SpanView, check_count, lift, recent_mask, require_attention


@dataclass
class H2OPolicy(Policy):
    """Score = accumulated attention (`accumulated_attention`, else `attention`); recent tokens first."""

    recent_tokens: int = 32
    """Tokens within this many of the end of the conversation are always ranked first."""

    needs_attention = True
    needs_query = False

    def __post_init__(self) -> None:
        check_count("H2OPolicy", "recent_tokens", self.recent_tokens)

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` heavy-hitter attention, with the recent window lifted above it."""
        attention = require_attention(view, type(self).__name__, accumulated=True)
        return lift(attention, recent_mask(view, self.recent_tokens))
