"""TOVA: keep the tokens the last query attends to most.

Oren et al. 2024, "Transformers are Multi-State RNNs" (Token Omission Via
Attention), https://arxiv.org/abs/2401.06104. At each step TOVA drops the token
with the lowest attention from the *current* (last) query, averaged over heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.policies.base import Policy, SpanView, check_count, require_attention


@dataclass
class TOVAPolicy(Policy):
    """Score = attention of the last query (mean over layers and heads), as provided in `view.attention`.

    The session collects `view.attention` with an `AttentionProbe` whose window it
    reads from this policy's `window` attribute (see
    `agentkv.policies.attention.attention_window`): 1 = the last query only, as in
    the paper.
    """

    window: int = 1
    """How many trailing queries the session should probe for this policy (TOVA: 1)."""

    needs_attention = True
    needs_query = False

    def __post_init__(self) -> None:
        check_count("TOVAPolicy", "window", self.window, minimum=1)

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` the attention each candidate received from the probed query."""
        return require_attention(view, type(self).__name__)
