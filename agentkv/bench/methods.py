"""The methods `agentkv bench memory` compares, and which workloads are which.

A method is a session config plus whether the session hears lifecycle events. To
add a variant (a different archive tier, a policy parameter, recall in pages),
add one `Method(...)` line to `METHODS`: the runner, the tables and the plots
read everything from this table, and `--methods` selects from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentkv.config import AgentKVConfig

NOHOST_TIER = "drop"
"""Archive tier of `agentkv-nohost`: archived spans are dropped and recomputed on recall."""


PAGES: Mapping[str, Any] = {"recall": {"pages": True}}
"""Config of page recall (defaults: 32-token pages, attention weight 0.5; not tuned on any workload)."""

SNAP: Mapping[str, Any] = {"commit": {"observe": "question", "keep_ratio": {"tool_result": 0.5}}}
"""Question-observed compression at commit: a tool result keeps half its tokens (chosen a priori)."""

Q4: Mapping[str, Any] = {"quantization": {"attended_bits": 4}}
"""The attended int4 tier (KIVI groups of 32, 4 sink and 64 recent tokens exact: paper defaults).

The default: every `agentkv*` method holds spans at int4 in attention
before archiving any; `Q4` names it explicitly.
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


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("full", "full", budgeted=False),
        Method("window", "window", baseline=True),
        Method("streaming_llm", "streaming_llm", baseline=True),
        Method("h2o", "h2o", baseline=True),
        Method("snapkv", "snapkv", baseline=True),
        Method("tova", "tova", baseline=True),
        # The defaults: under pressure spans are first held at int4 in attention, then archived.
        Method("agentkv", "lifecycle", archive_tier="host", events=True),
        Method("agentkv-nohost", "lifecycle", archive_tier=NOHOST_TIER, events=True),
        # Archived spans go to the int4 archive (on the device, not attended).
        Method("agentkv-int4", "lifecycle", archive_tier="int4", events=True),
        # Without the attended tier: pressure archives whole spans at once (host / dropped / int4 archive).
        Method("agentkv-archive", "lifecycle", archive_tier="host", events=True, extra=ARCHIVE_ONLY),
        Method(
            "agentkv-nohost-archive", "lifecycle", archive_tier=NOHOST_TIER, events=True, extra=ARCHIVE_ONLY
        ),
        Method("agentkv-int4-archive", "lifecycle", archive_tier="int4", events=True, extra=ARCHIVE_ONLY),
        # The host archive held as int8 codes (`quantization.host_bits`), with and without the attended tier.
        Method("agentkv-host8", "lifecycle", archive_tier="host", events=True, extra=HOST8),
        Method(
            "agentkv-archive-host8",
            "lifecycle",
            archive_tier="host",
            events=True,
            extra={"quantization": {"attended_bits": None, "host_bits": 8}},
        ),
        # agentkv-nohost with an attended quantized tier (KIVI, agentkv.store.attended): under pressure
        # spans are quantized in attention (int4 / int2 / int4 keys + int2 values) before any is archived.
        Method(
            "agentkv-q4",
            "lifecycle",
            archive_tier=NOHOST_TIER,
            events=True,
            extra={"quantization": {"attended_bits": 4}},
        ),
        Method(
            "agentkv-q2",
            "lifecycle",
            archive_tier=NOHOST_TIER,
            events=True,
            extra={"quantization": {"attended_bits": 2}},
        ),
        Method(
            "agentkv-k4v2",
            "lifecycle",
            archive_tier=NOHOST_TIER,
            events=True,
            extra={"quantization": {"attended_bits": 2, "attended_key_bits": 4}},
        ),
        # Keys at 8 bits in two 4-bit planes (agentkv.store.key_planes), values at 4: under more pressure
        # a span's keys drop to 4 bits before any span is archived.
        Method(
            "agentkv-k8",
            "lifecycle",
            archive_tier=NOHOST_TIER,
            events=True,
            extra={"quantization": {"attended_bits": 4, "attended_key_bits": 8}},
        ),
        # Lever 2: archived spans recalled by pages (Quest digests + word overlap), nothing on host.
        Method("agentkv-pages", "lifecycle", archive_tier=NOHOST_TIER, events=True, extra=PAGES),
        # Lever 3: tool results compressed at commit by their turn's question (SnapKV window).
        Method("agentkv-snap", "lifecycle", archive_tier=NOHOST_TIER, events=True, extra=SNAP),
        Method(
            "agentkv-pages-snap",
            "lifecycle",
            archive_tier=NOHOST_TIER,
            events=True,
            extra={**PAGES, **SNAP},
        ),
        # Page recall into the attended int4 tier.
        Method(
            "agentkv-q4-pages",
            "lifecycle",
            archive_tier=NOHOST_TIER,
            events=True,
            extra={**PAGES, **Q4},
        ),
        Method("agentkv-q4-snap", "lifecycle", archive_tier=NOHOST_TIER, events=True, extra={**SNAP, **Q4}),
        # All three levers together.
        Method(
            "agentkv-q4-pages-snap",
            "lifecycle",
            archive_tier=NOHOST_TIER,
            events=True,
            extra={**PAGES, **SNAP, **Q4},
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
