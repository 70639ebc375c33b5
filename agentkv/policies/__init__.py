"""Policies: which tokens to keep. Each scorer fills in `Policy.score(view)` (higher = keep)."""

from agentkv.policies.attention import (
    AttentionProbe,
    attention_modules,
    attention_window,
    needs_accumulated_attention,
)
from agentkv.policies.base import Policy, SpanView, check_count, lift, recent_mask, require_attention
from agentkv.policies.composed import (
    ProtectPolicy,
    ProtectRecentPolicy,
    ProtectSinksPolicy,
    WeightedSumPolicy,
)
from agentkv.policies.factory import POLICIES, POLICY_NAMES, make_policy, policy_params
from agentkv.policies.h2o import H2OPolicy
from agentkv.policies.intent import IntentPolicy, span_relevance
from agentkv.policies.key_norm import KeyNormPolicy
from agentkv.policies.kind_prior import DEFAULT_KIND_PRIORS, KindPriorPolicy
from agentkv.policies.snapkv import SnapKVPolicy
from agentkv.policies.streaming_llm import StreamingLLMPolicy
from agentkv.policies.tova import TOVAPolicy
from agentkv.policies.window import SlidingWindowPolicy

__all__ = [
    "DEFAULT_KIND_PRIORS",
    "POLICIES",
    "POLICY_NAMES",
    "AttentionProbe",
    "H2OPolicy",
    "IntentPolicy",
    "KeyNormPolicy",
    "KindPriorPolicy",
    "Policy",
    "ProtectPolicy",
    "ProtectRecentPolicy",
    "ProtectSinksPolicy",
    "SlidingWindowPolicy",
    "SnapKVPolicy",
    "SpanView",
    "StreamingLLMPolicy",
    "TOVAPolicy",
    "WeightedSumPolicy",
    "attention_modules",
    "attention_window",
    "needs_accumulated_attention",
    "check_count",
    "lift",
    "make_policy",
    "policy_params",
    "recent_mask",
    "require_attention",
    "span_relevance",
]
