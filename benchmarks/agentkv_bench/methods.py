"""The methods `agentkv bench memory` compares, and which workloads are which.

A method is a session config plus whether the session hears lifecycle events. To
add a lifecycle variant (a different archive tier, quantization or commit setting),
add one line to `LIFECYCLE_VARIANTS`; any other method is one `Method(...)` in
`METHODS`. The runner, the tables and the plots read everything from `METHODS`,
and `--methods` selects from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentkv.config import AgentKVConfig

NOHOST_TIER = "drop"
"""Archive tier of `agentkv-nohost`: archived spans are dropped and recomputed on recall."""


SNAP: Mapping[str, Any] = {"commit": {"observe": "question", "keep_ratio": {"tool_result": 0.5}}}
"""Question-observed compression at commit: a tool result keeps half its tokens (chosen a priori)."""

Q4: Mapping[str, Any] = {"quantization": {"attended_bits": 4, "attended_key_bits": 4}}
"""The attended tier with int4 keys and values (KIVI groups of 32, 4 sink and 64 recent tokens exact).

Every `agentkv*` method holds spans quantized in attention before archiving any; by
default keys at 8 bits up to the budget's limit (`agentkv-k8` names that), `Q4` holds
them at int4 from the start (the KIVI paper's setting).
"""

ARCHIVE_ONLY: Mapping[str, Any] = {"quantization": {"attended_bits": None}}
"""No attended quantized tier: pressure archives spans at once."""


HOST8: Mapping[str, Any] = {"quantization": {"host_bits": 8}}
"""The host archive as int8 codes (KIVI groups of 32): about a quarter of the fp32 host bytes."""


@dataclass(frozen=True)
class Method:
    """One way to run a session under a budget."""

    name: str
    policy: str
    """`AgentKVConfig.policy` name."""
    archive_tier: str = "host"
    budgeted: bool = True
    """False for `full`: it runs once per workload, with no budget."""
    events: bool = False
    """True when the session gets the lifecycle events an agent framework sends."""
    baseline: bool = False
    """A generic compressor from the literature (token mode, no events); `acceptance` compares with these."""
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    """Parameters of the policy (`policy: {name: ..., params: ...}`), e.g. a variant's window."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further top-level config keys (e.g. `{"commit": {...}}`) for variants."""

    def config(self, budget_tokens: int | None) -> AgentKVConfig:
        """The session config of this method at a device budget in tokens (None = unlimited)."""
        policy: Any = (
            {"name": self.policy, "params": dict(self.policy_params)} if self.policy_params else self.policy
        )
        data: dict[str, Any] = {**dict(self.extra), "policy": policy, "archive_tier": self.archive_tier}
        if self.budgeted and budget_tokens is not None:
            data["budget"] = {"device_tokens": int(budget_tokens)}
        return AgentKVConfig.from_dict(data)


LIFECYCLE_VARIANTS: tuple[tuple[str, str, Mapping[str, Any]], ...] = (
    # The defaults: under pressure spans are first held at int4 in attention, then archived.
    ("agentkv", "host", {}),
    ("agentkv-nohost", NOHOST_TIER, {}),
    # Archived spans go to the int4 archive (on the device, not attended).
    ("agentkv-int4", "int4", {}),
    # Without the attended tier: pressure archives whole spans at once (host / dropped / int4 archive).
    ("agentkv-archive", "host", ARCHIVE_ONLY),
    ("agentkv-nohost-archive", NOHOST_TIER, ARCHIVE_ONLY),
    ("agentkv-int4-archive", "int4", ARCHIVE_ONLY),
    # The host archive held as int8 codes (`quantization.host_bits`), with and without the attended tier.
    ("agentkv-host8", "host", HOST8),
    ("agentkv-archive-host8", "host", {"quantization": {"attended_bits": None, "host_bits": 8}}),
    # agentkv-nohost with an attended quantized tier (KIVI, agentkv.store.attended): under pressure
    # spans are quantized in attention (int4 / int2 / int4 keys + int2 values) before any is archived.
    ("agentkv-q4", NOHOST_TIER, Q4),
    ("agentkv-q2", NOHOST_TIER, {"quantization": {"attended_bits": 2, "attended_key_bits": 2}}),
    ("agentkv-k4v2", NOHOST_TIER, {"quantization": {"attended_bits": 2, "attended_key_bits": 4}}),
    # The default, named: keys at 8 bits in two 4-bit planes (agentkv.store.key_planes), values at 4;
    # under more pressure a span's keys drop to 4 bits before any span is archived.
    ("agentkv-k8", NOHOST_TIER, {"quantization": {"attended_bits": 4, "attended_key_bits": 8}}),
    # Tool results compressed at commit by their turn's question (SnapKV window).
    ("agentkv-snap", NOHOST_TIER, SNAP),
    ("agentkv-q4-snap", NOHOST_TIER, {**SNAP, **Q4}),
)
"""The lifecycle methods (policy `lifecycle`, with events): name, archive tier, further config keys."""

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("full", "full", budgeted=False),
        *(Method(name, name, baseline=True) for name in ("window", "streaming_llm", "h2o", "snapkv", "tova")),
        *(
            Method(name, "lifecycle", archive_tier=tier, events=True, extra=extra)
            for name, tier, extra in LIFECYCLE_VARIANTS
        ),
    )
}
"""Every method the benchmark knows, in report order."""

BASELINES: tuple[str, ...] = tuple(name for name, m in METHODS.items() if m.baseline)
"""Generic compressors (token mode, no events)."""

TUNED_WORKLOADS: tuple[str, ...] = ("incident", "research", "support", "travel")
"""The four workloads written while the recall heuristics were tuned (recall code cites their spans).

Every other workload is reported as `fresh`: written afterwards, never used to tune.
"""

SUITES: tuple[str, ...] = ("tuned", "fresh")
"""How the summary groups workloads (plus `all`)."""


def suite_of(workload: str) -> str:
    """`tuned` for the original four workloads, `fresh` for every other one."""
    return "tuned" if workload in TUNED_WORKLOADS else "fresh"
