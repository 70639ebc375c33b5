"""H2O: heavy hitters (accumulated attention) plus the most recent tokens.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
of Large Language Models", https://arxiv.org/abs/2306.14048. A small set of tokens
collects most of the attention over time; keeping them and a recent window
preserves quality. The paper splits the KV budget between the two halves equally
(e.g. a 20% cache = 10% heavy hitters + 10% recent tokens), and a token's
heavy-hitter score is the attention it has received, *summed* over every query so
far (no decay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agentkv.policies.base import Policy, SpanView, check_count, lift, recent_mask, require_attention


@dataclass
class H2OPolicy(Policy):
    """Score = accumulated attention; the recent share of the budget is always kept.

    `score` alone ranks by accumulated attention with a fixed recent window lifted
    (`recent_tokens`); `select` is where the budget is known, so it protects the
    most recent `recent_ratio · keep` tokens and fills the rest with heavy hitters,
    as the paper splits its budget.
    """

    recent_ratio: float = 0.5
    """Share of the kept tokens reserved for the most recent ones (the paper: 0.5)."""
    recent_tokens: int = 0
    """A fixed recent window ranked first by `score` too (0 = only the budget share in `select`)."""

    needs_attention = True
    needs_query = False
    needs_accumulated_attention = True

    def __post_init__(self) -> None:
        check_count("H2OPolicy", "recent_tokens", self.recent_tokens)
        ratio = self.recent_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            msg = f"H2OPolicy.recent_ratio must be a number in [0, 1], got {ratio!r}"
            raise ValueError(msg)

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` accumulated attention (the view's, else the window's), a fixed recent window lifted."""
        attention = require_attention(view, type(self).__name__, accumulated=True)
        return lift(attention, recent_mask(view, self.recent_tokens))

    def select(self, view: SpanView, keep: int, *, protected: torch.Tensor | None = None) -> torch.Tensor:
        """Top `keep` tokens: the `recent_ratio · keep` most recent, then the heaviest hitters."""
        n = view.num_tokens
        pinned = torch.zeros(n, dtype=torch.bool) if protected is None else protected.cpu().bool()
        # Protected tokens count toward `keep` first; the recent share comes out of what is left.
        room = max(0, keep - int(pinned.sum()))
        recent = min(room, math.floor(self.recent_ratio * max(0, keep)))
        if recent > 0:
            order = torch.argsort(view.positions.cpu(), descending=True, stable=True)
            order = order[~pinned[order]]  # newest first, among the unprotected
            newest = torch.zeros(n, dtype=torch.bool)
            newest[order[:recent]] = True
            protected = pinned | newest
        return super().select(view, keep, protected=protected)
