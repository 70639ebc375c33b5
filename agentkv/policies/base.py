"""The one abstraction every policy fills in: `score(view) -> Tensor` (higher = keep).

As in kvpress's `ScorerPress`, a policy only scores; the base class turns scores
into a decision (top-k under a budget, always keeping what must be kept). A
`SpanView` is what a policy may look at: the candidate tokens' keys, their
logical positions and spans, and — when the session collected it — the attention
the most recent queries paid to them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from agentkv.spans import SpanKind


@dataclass(frozen=True)
class SpanView:
    """The tokens a policy scores.

    All per-token tensors are on the CPU, length n, in the same order as the
    physical slots they describe.
    """

    keys: tuple[torch.Tensor, ...]
    """Per layer, the candidates' keys `[B, H_kv, n, D]` (on the model's device)."""
    positions: torch.Tensor
    """`[n]` logical (RoPE) positions."""
    span_ids: torch.Tensor
    """`[n]` the span each token belongs to."""
    span_kinds: dict[int, SpanKind]
    """Kind of each span id present."""
    sequence_length: int
    """Logical length of the whole conversation (recency is measured from here)."""
    attention: torch.Tensor | None = None
    """`[n]` attention the last probed observation window (W queries) paid to each token.

    Mean over layers, heads and the window's queries; W is the policy's `window`
    (SnapKV's observation window, TOVA's last query), see `attention_window`.
    """
    accumulated_attention: torch.Tensor | None = None
    """`[n]` attention summed over every probed query so far, undecayed (H2O's heavy-hitter score)."""
    decayed_attention: torch.Tensor | None = None
    """`[n]` window attention folded into an EMA over forwards (the lifecycle policy's signal)."""
    query_keys: tuple[torch.Tensor, ...] | None = None
    """Per layer, keys of the new input `[B, H_kv, m, D]` (intent: what the user now asks about)."""
    query_states: tuple[torch.Tensor, ...] | None = None
    """Per layer, RoPE'd queries of the new input `[B, H_q, m, D]`, when collected."""

    @property
    def num_tokens(self) -> int:
        """n, the number of candidate tokens."""
        return int(self.positions.numel())


class Policy(ABC):
    """Scores tokens; higher means keep."""

    needs_attention: bool = False
    """True when `score` reads `view.attention` (the session then runs the attention hook)."""
    needs_query: bool = False
    """True when `score` reads `view.query_keys` / `view.query_states`."""
    needs_keys: bool = False
    """True when `score` reads `view.keys`; otherwise the view carries none (reading the keys of a
    span held in the attended quantized tier means dequantizing them)."""
    needs_accumulated_attention: bool = False
    """True when `score` reads `view.accumulated_attention` (the probe then sums every query, H2O)."""
    whole_spans: bool = False
    """True: the lifecycle compresses a span once, at commit, and budget pressure then moves
    whole spans (agentkv's own policy). False: pressure re-scores every attended token and
    keeps the top ones, as the generic compressors (window, StreamingLLM, H2O, SnapKV) do."""
    scores_spans: bool = False
    """True when `span_score` gives each span one number (otherwise a span's score is the
    mean of its token scores)."""

    def span_score(self, view: SpanView) -> dict[int, float]:
        """Per span id in the view, one importance number (only when `scores_spans`)."""
        msg = f"{type(self).__name__} does not score spans (scores_spans is False)"
        raise NotImplementedError(msg)

    @abstractmethod
    def score(self, view: SpanView) -> torch.Tensor:
        """Return `[n]` finite float scores, one per candidate token (higher = keep)."""

    def select(self, view: SpanView, keep: int, *, protected: torch.Tensor | None = None) -> torch.Tensor:
        """Indices (into the view, sorted) of the `keep` tokens to keep.

        `protected` (`[n]` bool) marks tokens that are always kept; they count
        toward `keep`. Ties break toward later positions, deterministically.
        """
        n = view.num_tokens
        keep = max(0, min(keep, n))
        if keep >= n:
            return torch.arange(n)
        scores = self.score(view).float().cpu()
        if scores.shape != (n,):
            msg = f"{type(self).__name__}.score returned shape {tuple(scores.shape)}, expected ({n},)"
            raise ValueError(msg)
        scores = torch.nan_to_num(scores, nan=float("-inf"))
        if protected is not None and protected.any():
            scores = scores.masked_fill(protected.cpu(), float("inf"))
        # Deterministic ties: among equal scores the later position wins (two stable sorts).
        by_position = torch.argsort(view.positions.cpu(), descending=True, stable=True)
        by_score = torch.argsort(scores[by_position], descending=True, stable=True)
        ranked = by_position[by_score]
        return torch.sort(ranked[:keep]).values


# -- helpers shared by the scorers (not part of the Policy API) ---------------------------------


def lift(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Raise the `mask`ed scores above every other score, keeping order inside each group.

    Scorers use this for "always keep" tokens (sinks, the recent window) instead of
    `inf`: scores stay finite, so wrappers can still z-normalise and sum them.
    """
    scores = scores.float()
    if scores.numel() == 0 or not bool(mask.any()):
        return scores
    offset = (scores.max() - scores.min()).abs() + 1.0
    return scores + mask.to(scores.device, torch.float32) * offset


def recent_mask(view: SpanView, recent_tokens: int) -> torch.Tensor:
    """`[n]` bool: tokens among the last `recent_tokens` logical positions of the conversation.

    Recency is measured from `view.sequence_length`, not from the candidates: when a
    single span is compressed at commit, its own tail is not "recent" unless it is
    the end of the conversation.
    """
    return view.positions.cpu() >= view.sequence_length - max(0, recent_tokens)


def require_attention(view: SpanView, who: str, *, accumulated: bool = False) -> torch.Tensor:
    """`[n]` float32 CPU attention from the view (accumulated first when asked), or a clear error.

    Raises:
        ValueError: The view carries no attention: the session did not run the probe
            although the policy declares `needs_attention`.
    """
    attention = view.accumulated_attention if accumulated and view.accumulated_attention is not None else None
    attention = view.attention if attention is None else attention
    if attention is None:
        msg = (
            f"{who} needs view.attention (needs_attention=True) but the view has none; "
            "collect it with agentkv.policies.AttentionProbe"
        )
        raise ValueError(msg)
    attention = attention.float().cpu()
    if attention.shape != (view.num_tokens,):
        msg = f"{who}: view.attention has shape {tuple(attention.shape)}, expected ({view.num_tokens},)"
        raise ValueError(msg)
    return attention


def check_count(owner: str, name: str, value: object, *, minimum: int = 0) -> None:
    """Validate an integer parameter (policies come from YAML, so say what was wrong).

    Raises:
        ValueError: `value` is not an int (bools rejected) or is below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{owner}.{name} must be an int >= {minimum}, got {value!r}"
        raise ValueError(msg)
