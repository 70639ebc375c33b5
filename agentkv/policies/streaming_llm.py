"""StreamingLLM: attention sinks plus a recent window.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
https://arxiv.org/abs/2309.17453. The first few tokens of a sequence absorb a
large share of every query's attention whatever they contain ("sinks"); dropping
them breaks the model, keeping them plus the most recent tokens keeps it stable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.policies.base import Policy, SpanView, check_count, lift


@dataclass
class StreamingLLMPolicy(Policy):
    """Keep the first `sink_tokens` logical positions, then the most recent tokens."""

    sink_tokens: int = 4
    """Logical positions 0 .. sink_tokens-1 are sinks, always ranked first."""

    needs_attention = False
    needs_query = False

    def __post_init__(self) -> None:
        check_count("StreamingLLMPolicy", "sink_tokens", self.sink_tokens)

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` recency (logical position), with sinks lifted above every other token."""
        positions = view.positions.cpu()
        # Sinks are the conversation's first positions (logical), wherever they sit physically.
        return lift(positions.float(), positions < self.sink_tokens)
