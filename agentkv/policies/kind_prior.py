"""agentkv's default scorer: attention, what kind of message a token is in, and a little recency.

Generic compressors score tokens by attention alone and forget the early facts an
agent needs later (the system prompt's rules, what the user said, a tool's
answer). The agent framework *knows* what each span is, so the kind of span is a
prior: user and system text outrank the model's own scaffolding (tool-call
syntax, reasoning) that has already served its purpose. Attention refines the
choice within and across spans; recency breaks ties toward the present.

Per docs/design.md ("commit then freeze", after FlowKV, Chen et al. 2025), the session
scores a span once at commit; `span_score` gives each span one number that later
orders whole-span demotion under pressure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from agentkv.policies.base import Policy, SpanView
from agentkv.spans import SpanKind

DEFAULT_KIND_PRIORS: Mapping[SpanKind, float] = MappingProxyType(
    {
        SpanKind.SYSTEM: 1.0,
        SpanKind.USER: 1.0,
        SpanKind.TOOL_RESULT: 0.6,
        SpanKind.ASSISTANT: 0.5,
        SpanKind.TOOL_CALL: 0.2,
        SpanKind.REASONING: 0.1,
        SpanKind.PROMPT: 0.0,
    }
)
"""Prior importance of each span kind (on the same [0, 1] scale as normalised attention)."""

UNKNOWN_KIND_PRIOR = 0.5
"""Prior for a token whose span id has no kind in the view."""

SPAN_TOP_FRACTION = 0.25
"""`span_score` averages the top quarter of a span's token scores: a span is as
valuable as its best part (the one number in a long tool result), but one outlier
token should not carry it."""


def _default_priors() -> dict[SpanKind, float]:
    return dict(DEFAULT_KIND_PRIORS)


@dataclass
class KindPriorPolicy(Policy):
    """Score = attention_weight · normalised attention + kind prior + recency_weight · recency.

    All three terms are in [0, 1] so the weights read as trade-offs: with the
    defaults, a SYSTEM token (prior 1.0) outranks a REASONING token (0.1) unless the
    reasoning token draws clearly more attention.
    """

    attention_weight: float = 1.0
    """Weight of the normalised attention term (0 = attention is not collected at all)."""
    recency_weight: float = 0.1
    """Weight of recency (logical position / conversation length)."""
    kind_priors: dict[SpanKind, float] = field(default_factory=_default_priors)
    """Prior per span kind; kinds not given keep their `DEFAULT_KIND_PRIORS` value. Keys may be strings."""

    needs_attention = True
    needs_query = False
    whole_spans = True
    scores_spans = True

    def __post_init__(self) -> None:
        for name in ("attention_weight", "recency_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                msg = f"KindPriorPolicy.{name} must be a finite number, got {value!r}"
                raise ValueError(msg)
        self.kind_priors = _parse_priors(self.kind_priors)
        self.needs_attention = self.attention_weight != 0

    def score(self, view: SpanView) -> torch.Tensor:
        """`[n]` float32 CPU composite score."""
        span_ids = view.span_ids.cpu()
        scores = torch.full((view.num_tokens,), UNKNOWN_KIND_PRIOR, dtype=torch.float32)  # [n]
        for span_id, kind in view.span_kinds.items():
            scores[span_ids == span_id] = self.kind_priors.get(kind, UNKNOWN_KIND_PRIOR)
        if self.recency_weight:
            scores += self.recency_weight * _recency(view)
        attention = view.attention if view.attention is not None else view.accumulated_attention
        if self.attention_weight and attention is not None:
            scores += self.attention_weight * _normalised_attention(attention.float().cpu())
        return scores

    def span_score(self, view: SpanView) -> dict[int, float]:
        """Per span id in the view, the mean of its top-25% token scores (at least one token)."""
        scores = self.score(view)
        span_ids = view.span_ids.cpu()
        result: dict[int, float] = {}
        for span_id in torch.unique(span_ids).tolist():
            mine = scores[span_ids == span_id]  # [n_span]
            top = max(1, math.ceil(SPAN_TOP_FRACTION * mine.numel()))
            result[int(span_id)] = float(torch.topk(mine, top).values.mean())
        return result


def _recency(view: SpanView) -> torch.Tensor:
    """`[n]` logical position scaled to [0, 1] by the conversation length."""
    scale = max(view.sequence_length - 1, 1)
    return (view.positions.cpu().float() / scale).clamp(0.0, 1.0)


def _normalised_attention(attention: torch.Tensor) -> torch.Tensor:
    """`[n]` attention mapped to [0, 1]: log1p(a / mean a), divided by its max.

    A plain a / max(a) would squash everything but the attention sinks (which take
    most of the mass) to ~0; the log compresses the sinks and keeps the ordering.
    """
    attention = attention.clamp_min(0.0)
    mean = attention.mean() if attention.numel() else torch.tensor(0.0)
    if not bool(mean > 0):
        return torch.zeros_like(attention)
    relative = torch.log1p(attention / mean)
    return relative / relative.max()


def _parse_priors(priors: Mapping[SpanKind, float] | Mapping[str, float]) -> dict[SpanKind, float]:
    """Defaults overridden by `priors`, with string keys (from YAML) turned into `SpanKind`s."""
    allowed = [k.value for k in SpanKind]
    merged = dict(DEFAULT_KIND_PRIORS)
    for key, value in priors.items():
        try:
            kind = SpanKind(key)
        except ValueError as e:
            msg = f"KindPriorPolicy.kind_priors: unknown span kind {key!r}; allowed: {allowed}"
            raise ValueError(msg) from e
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            msg = f"KindPriorPolicy.kind_priors[{kind.value!r}] must be a finite number, got {value!r}"
            raise ValueError(msg)
        merged[kind] = float(value)
    return merged
