"""Key norm: tokens with *low* key L2 norm are the important ones.

Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", https://arxiv.org/abs/2406.11430. Key norm correlates negatively
with the attention a token receives, so it needs no attention signal at all: it
works with SDPA/flash and costs one norm per key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.policies.base import Policy, SpanView


@dataclass
class KeyNormPolicy(Policy):
    """Score = −(L2 norm of the keys, averaged over layers, batch and heads)."""

    needs_attention = False
    needs_query = False
    needs_keys = True

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` negated mean key norm (lower norm = higher score = keep)."""
        if not view.keys:
            return torch.zeros(view.num_tokens)
        per_layer = [k.float().norm(dim=-1).mean(dim=(0, 1)).cpu() for k in view.keys]  # each [n]
        return -torch.stack(per_layer).mean(dim=0)
