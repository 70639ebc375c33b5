"""SnapKV: keep what the observation window attends to, pooled so neighbours come along.

Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
https://arxiv.org/abs/2404.14469. The attention of the last `window` queries (the
"observation window") predicts which earlier tokens generation will need; pooling
that attention along the sequence with a small kernel keeps whole clusters (a
number, a name) instead of isolated tokens. The window itself is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias

from agentkv.policies.base import Policy, SpanView, check_count, lift, recent_mask, require_attention

POOLINGS: tuple[str, ...] = ("avg", "max")
"""Accepted values of `SnapKVPolicy.pooling`."""


@dataclass
class SnapKVPolicy(Policy):
    """Score = window attention pooled along logical order; the observation window ranks first.

    `view.attention` must be collected over the last `window` queries (the session
    reads this `window` attribute, see `agentkv.policies.attention.attention_window`).
    """

    window: int = 32
    """Observation window: the conversation's last `window` tokens, the probed queries; always kept."""
    kernel_size: int = 5
    """Odd pooling kernel along the sequence (1 = no pooling)."""
    pooling: Literal["avg", "max"] = "avg"
    """`avg` as the paper's reference code and kvpress, or `max`."""

    needs_attention = True
    needs_query = False

    def __post_init__(self) -> None:
        check_count("SnapKVPolicy", "window", self.window, minimum=1)
        check_count("SnapKVPolicy", "kernel_size", self.kernel_size, minimum=1)
        if self.kernel_size % 2 == 0:
            msg = f"SnapKVPolicy.kernel_size must be odd (a centred window), got {self.kernel_size}"
            raise ValueError(msg)
        if self.pooling not in POOLINGS:
            msg = f"SnapKVPolicy.pooling must be one of {POOLINGS}, got {self.pooling!r}"
            raise ValueError(msg)

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` pooled attention, with the observation window lifted above everything else."""
        attention = require_attention(view, type(self).__name__)
        # Pool neighbours in *logical* order: physical slots may be permuted or compacted.
        order = _logical_order(view)  # [n]
        pooled = torch.empty_like(attention)
        pooled[order] = self._pool(attention[order])
        return lift(pooled, recent_mask(view, self.window))

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_size == 1 or x.numel() == 0:
            return x
        pad = self.kernel_size // 2
        row = x.view(1, 1, -1)  # [1, 1, n]
        if self.pooling == "max":
            return F.max_pool1d(row, self.kernel_size, stride=1, padding=pad).view(-1)
        return F.avg_pool1d(row, self.kernel_size, stride=1, padding=pad, count_include_pad=False).view(-1)


def _logical_order(view: SpanView) -> torch.Tensor:
    """Indices sorting candidates by (position, span id): deterministic even if branches share positions."""
    by_span = torch.argsort(view.span_ids.cpu(), stable=True)
    return by_span[torch.argsort(view.positions.cpu()[by_span], stable=True)]
