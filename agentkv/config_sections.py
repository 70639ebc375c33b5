"""The section models of the `agentkv:` config, one pydantic model per section.

Budget, policy, quantization, commit, recall, forget, callbacks and engine, with
the constants and validators they share.

`agentkv.config` composes them into `AgentKVConfig` and owns loading, overrides and
rule validation; this module never imports it back.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from agentkv.config_text import ConfigProblems, Loc, parse_bytes, show_value, unknown_value
from agentkv.policies.factory import POLICY_NAMES, param_problems, policy_params
from agentkv.spans import SpanKind

ALLOWED_POLICIES: tuple[str, ...] = POLICY_NAMES
"""Policy names `PolicyConfig.name` accepts: those of `agentkv.policies.factory.POLICIES`."""

CUSTOM_EVENT_PREFIX = "custom:"
"""Rules keys for user `Custom` events are `custom:<event name>`."""

CUSTOM_EVENT_TARGETS: tuple[str, ...] = ("owner",)
"""The only target a custom-event rule can name: the span(s) named by the event's `owner`."""


def _bytes_or_none(value: object) -> object:
    return None if value is None else parse_bytes(value)


_ByteCount = Annotated[
    int | None,
    BeforeValidator(_bytes_or_none, json_schema_input_type=Annotated[int, Field(gt=0)] | str | None),
]
_Fraction = Annotated[float, Field(gt=0, le=1, strict=True)]


def shaped(pattern: str, problem: str) -> AfterValidator:
    """A string check: the value must match `pattern`, else `problem` ({value}: the value shown)."""
    regex = re.compile(pattern)

    def check(value: str) -> str:
        if not regex.match(value):
            raise ValueError(problem.format(value=show_value(value)))
        return value

    return AfterValidator(check)


TorchDevice = Annotated[
    str, shaped(r"^[a-z][a-z_]*(:\d+)?$", "not a torch device: {value}; e.g. cpu, cuda, cuda:1, mps")
]
"""A torch device name: `cpu`, `cuda`, `cuda:1`, `mps`."""

# ---------------------------------------------------------------------------- models


class Section(BaseModel):
    """Base of every config model: unknown keys are errors, instances never change.

    A container key written with nothing under it (`budget:` with every line
    commented out) is YAML null; it means "the defaults", not an error. A field's
    docstring is its description (`use_attribute_docstrings`): the JSON schema and
    docs/configuration.md read it from there.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    removed_keys: ClassVar[Mapping[str, str]] = {}
    """Keys that were settings once, each with why it went: the unknown-key error says so."""

    @model_validator(mode="before")
    @classmethod
    def _null_container_is_default(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        containers = {name for name, f in cls.model_fields.items() if _is_container(f.annotation)}
        return {k: v for k, v in data.items() if not (v is None and k in containers)}


def _is_container(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is dict:
        return True
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


class BudgetConfig(Section):
    """How much KV a session may hold, per tier; null limits mean unlimited.

    Over `high_watermark` of a limit the manager demotes spans along the lifecycle chain
    (archive, offload, quantize, evict) until usage is under `low_watermark`; the gap
    between the two keeps it from demoting again on every new token.
    """

    device_tokens: int | None = Field(default=None, gt=0, strict=True)
    """Per-session device KV budget, in full-precision token equivalents (with device_bytes: the tighter)."""
    device_bytes: _ByteCount = Field(default=None, gt=0)
    """Per-session KV budget on the device, in bytes (e.g. 64MiB, 1.5 GB); null = none."""
    host_tokens: int | None = Field(default=None, gt=0, strict=True)
    """Per-session host archive budget, in full-precision token equivalents (with host_bytes: the tighter)."""
    host_bytes: _ByteCount = Field(default=None, gt=0)
    """Per-session archive budget on the host tier, in bytes (e.g. 1GiB)."""
    global_device_bytes: _ByteCount = Field(default=None, gt=0)
    """Device KV budget across all sessions of a backend, in bytes."""
    high_watermark: _Fraction = 1.0
    """Fraction of a limit at which demotion starts (0 < x <= 1)."""
    low_watermark: _Fraction = 0.8
    """Fraction of a limit demotion brings usage back under (0 < x <= high_watermark)."""
    placement_order: Literal["needed_last", "attended_first"] = "attended_first"
    """needed_last: needed spans stay full until the rest is archived; attended_first: int4 all first."""
    rung_costs: Literal["calibrated", "fixed"] = "calibrated"
    """calibrated: each rung's loss measured on the loaded model once (cached); fixed: priors."""

    @model_validator(mode="after")
    def _low_not_above_high(self) -> BudgetConfig:
        problem = watermark_problem(self.high_watermark, self.low_watermark)
        if problem is not None:
            raise ConfigProblems([problem])
        return self

    @property
    def limited(self) -> bool:
        """True when any limit is set, i.e. the manager has to watch usage at all."""
        limits = (
            self.device_tokens,
            self.device_bytes,
            self.host_tokens,
            self.host_bytes,
            self.global_device_bytes,
        )
        return any(limit is not None for limit in limits)


class PolicyConfig(Section):
    """Which policy scores tokens when a span is committed or the budget is exceeded.

    Three spellings are accepted: `policy: snapkv`; `policy: {name: snapkv, window: 32}`
    (keys other than `name` and `params` are the policy's parameters); and the full
    `policy: {name: snapkv, params: {window: 32}}`.
    """

    name: str = Field(default="lifecycle", json_schema_extra={"enum": list(ALLOWED_POLICIES)})
    """Policy name (case-insensitive; '-' reads as '_')."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the policy's constructor."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        _check_policy_keys(data)  # on the data as written, so an error names the key's own path
        data = policy_as_mapping(data)
        if isinstance(data, Mapping) and isinstance(data.get("params"), Mapping):
            params = data["params"]
            both = [k for k in data if k not in ("name", "params") and k in params]
            if both:
                msg = "given both beside `name` and under `params`; write it once"
                raise ConfigProblems([(("params", str(k)), msg) for k in both])
        return data

    @field_validator("name", mode="before")
    @classmethod
    def _known_policy(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value  # the str type check reports it
        name = value.strip().lower().replace("-", "_")
        if name not in ALLOWED_POLICIES:
            raise ValueError(unknown_value("policy", value, ALLOWED_POLICIES))
        return name


class QuantizationConfig(Section):
    """How spans are quantized on the int8/int4 archive tiers (KIVI-style).

    Keys are quantized per channel and values per token, in groups along the
    channel/token axis; the most recent tokens stay full precision because
    quantization error hurts most where attention is sharpest.
    """

    group_size: int = Field(default=32, ge=8, le=256, strict=True)
    """Elements per quantization group: a power of two from 8 to 256."""
    residual_tokens: int = Field(default=0, ge=0, strict=True)
    """Most recent tokens of a span kept in full precision."""
    attended_bits: Literal[4, 2] | None = 4
    """Under pressure, spans are first held at 4 or 2 bits, still attended; null = archive at once."""
    attended_key_bits: Literal[8, 4, 2] | None = 8
    """Key bits (null = attended_bits); 8 = two 4-bit planes, dropped to 4 before any span leaves."""
    host_bits: Literal[8, 4] | None = None
    """Host archive held as int8 / int4 codes (~1/4, ~1/8 of fp32 bytes); null = full precision, exact."""
    attended_residual_tokens: int = Field(default=64, ge=0, strict=True)
    """Most recent attended tokens never quantized (KIVI's residual window)."""
    attended_sink_tokens: int = Field(default=4, ge=0, strict=True)
    """First positions never quantized (attention sinks, kept by StreamingLLM and KVQuant)."""

    @field_validator("group_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            allowed = ", ".join(str(2**i) for i in range(3, 9))
            raise ValueError(f"must be a power of two, got {value}; allowed: {allowed}")
        return value


class CommitConfig(Section):
    """How a span is compressed when it is committed; it is then frozen (commit then freeze).

    Scores come from the attention of the last `window` queries that consumed the
    span; re-scoring old turns later is the documented failure mode, so it never happens.
    """

    keep_ratio: dict[str, _Fraction] = Field(
        default_factory=dict, json_schema_extra={"propertyNames": {"enum": [kind.value for kind in SpanKind]}}
    )
    """Per span kind, fraction of tokens kept at commit (0 < r <= 1); unlisted kinds keep all."""
    min_keep_tokens: int = Field(default=8, ge=1, strict=True)
    """Never compress a span below this many tokens."""
    window: int = Field(default=32, ge=1, strict=True)
    """Observation window: recent queries whose attention scores a span."""
    observe: Literal["recent", "question"] = "recent"
    """At commit, score a tool result by the `recent` queries or the turn's `question` (SnapKV window)."""

    @field_validator("keep_ratio")
    @classmethod
    def _known_kinds(cls, value: dict[str, float]) -> dict[str, float]:
        kinds = tuple(kind.value for kind in SpanKind)
        problems: list[tuple[Loc, str]] = [
            ((key,), unknown_value("span kind", key, kinds, in_path=True))
            for key in value
            if key not in kinds
        ]
        if problems:
            raise ConfigProblems(problems)
        return value


class RecallConfig(Section):
    """Bringing archived spans back before the model answers a new user turn.

    Archived spans whose key summaries match the new query best are restored to the
    device; evicted ones can be recomputed from their token ids.
    """

    removed_keys: ClassVar[Mapping[str, str]] = {
        "pages": (
            "page recall lost to the attended int4 tier at a 25% budget and added nothing on top"
            " of it (docs/benchmarks.md, 'Pruned recall switches'); delete the key"
        ),
        "attention_weight": "it weighted page recall, which is removed (see recall.pages); delete the key",
        "restore_displaced": (
            "it moved 2 of 225 answers for 40-55% more prefill"
            " (docs/benchmarks.md, 'Pruned recall switches'); delete the key"
        ),
    }

    enabled: bool = Field(default=True, strict=True)
    """Recall archived spans relevant to each new user turn."""
    max_spans: int = Field(default=4, ge=0, strict=True)
    """At most this many spans recalled per turn."""
    min_score: float | None = Field(default=None, strict=True, allow_inf_nan=False)
    """Relevance a span needs to be recalled; null = the top max_spans regardless."""
    relative_floor: float = Field(default=0.5, ge=0.0, le=1.0, strict=True, allow_inf_nan=False)
    """Recall spans at least this fraction as relevant as the best; the most relevance that fits."""
    rehydrate_evicted: bool = Field(default=True, strict=True)
    """Recompute evicted spans from their tokens when recalled."""
    recompute_quantized: bool = Field(default=True, strict=True)
    """Recompute the relevant spans the budget holds quantized at full precision, when the room allows."""
    page_tokens: int = Field(default=32, ge=8, le=128, strict=True)
    """Tokens per page when exact recall recomputes part of a long quantized span."""


FORGET_PROMPT_FIELD = "{handles}"
"""The placeholder `ForgetConfig.prompt` must contain: the listing of candidate tool results."""

DEFAULT_FORGET_PROMPT = (
    "Housekeeping, not a question for the user. These earlier tool results are still in your memory:\n"
    f"{FORGET_PROMPT_FIELD}\n"
    "Which of them will not be needed for any later question? Call forget_tool_outputs with their "
    "handles; an empty list keeps them all."
)
"""What the side thread asks (`{handles}` becomes one line per candidate: handle, tool, preview)."""


class ForgetConfig(Section):
    """The agent decides what to forget: a side thread that names stale tool results (SideQuest-style).

    Off by default. When on, at a turn end (every `every_turns` turns and/or when the device
    budget is at its watermarks) a fork of the session lists the committed tool results by
    short handles (`T1`, `T2`: the k-th tool result of the conversation), the model answers
    with a constrained `forget_tool_outputs` call, the fork is closed at once, and the named
    results are released at the next turn boundary (rule `custom:forget_tool_output`).
    """

    enabled: bool = Field(default=False, strict=True)
    """Run the forgetting side thread (off by default)."""
    every_turns: int | None = Field(default=1, ge=1, strict=True)
    """Run it every this many turns; null = only on the budget's watermark."""
    on_high_watermark: bool = Field(default=False, strict=True)
    """Also run it at a turn end when the device budget reached its high watermark."""
    prompt: str = Field(default=DEFAULT_FORGET_PROMPT, min_length=1)
    """What the side thread asks; must contain {handles} (the candidate listing)."""
    max_candidates: int = Field(default=8, ge=1, le=64, strict=True)
    """At most this many tool results offered (oldest first)."""
    preview_chars: int = Field(default=80, ge=0, le=2000, strict=True)
    """Characters of each result shown in the listing."""

    @field_validator("prompt")
    @classmethod
    def _has_placeholder(cls, value: str) -> str:
        if FORGET_PROMPT_FIELD not in value:
            msg = f"must contain {FORGET_PROMPT_FIELD} (where candidates are listed), got {show_value(value)}"
            raise ValueError(msg)
        rest = value.replace(FORGET_PROMPT_FIELD, "")
        if "{" in rest or "}" in rest:
            msg = f"only the placeholder {FORGET_PROMPT_FIELD} may use braces"
            raise ValueError(msg)
        return value

    @model_validator(mode="after")
    def _has_trigger(self) -> ForgetConfig:
        problem = trigger_problem(self.enabled, self.every_turns, self.on_high_watermark)
        if problem is not None:
            raise ConfigProblems([problem])
        return self


class PrefixCacheConfig(Section):
    """The cross-session prefix cache: threads that start alike share their leading system messages' KV.

    The first thread to encode a prefix (the system prompt with the tool descriptions)
    keeps its KV as a read-only entry; later threads whose history starts with the same
    token ids attend it instead of encoding it (vLLM's automatic prefix caching, SGLang's
    radix cache). Unreferenced entries stay while there is room and go first under
    pressure (the global device budget or `max_tokens`).
    """

    enabled: bool = Field(default=True, strict=True)
    """Share leading system messages' KV across sessions."""
    max_tokens: int | None = Field(default=8192, ge=1, strict=True)
    """Tokens all entries may hold; null = only the global device budget bounds them."""
    block_tokens: int = Field(default=16, ge=1, le=4096, strict=True)
    """Tokens per hashed block (a prefix is found by its blocks)."""
    eviction: Literal["lru", "lfu"] = "lru"
    """Which unreferenced entry goes first: least recently or least often used."""


class CallbacksConfig(Section):
    """Behaviour of the LangChain callback handler that turns runs into events."""

    raise_error: bool = Field(default=False, strict=True)
    """Let handler errors stop the run; false logs them (hints never break a run)."""

    event_log: int = Field(default=10_000, ge=0, strict=True)
    """Events the handler keeps for inspection (`handler.events`); the oldest leave first; 0 = none."""


# ---------------------------------------------------------------------------- cross-field checks
#
# Pydantic runs a section's "after" validators only when all its fields are valid, so
# a file with a bad field and a watermark-order error would show the second only once
# the first is fixed. These checks take plain values: the validators call them on the
# model, `agentkv.config.cross_field_lines` on the raw data when validation failed.


def watermark_problem(high: float, low: float) -> tuple[Loc, str] | None:
    """The low watermark must not be above the high one: `(path under budget, message)` or None."""
    if low > high:
        return (("low_watermark",), f"must be <= high_watermark ({high}), got {low}")
    return None


def trigger_problem(
    enabled: bool, every_turns: int | None, on_high_watermark: bool
) -> tuple[Loc, str] | None:
    """An enabled forgetting side thread needs a trigger: `(path under forget, message)` or None."""
    if enabled and every_turns is None and not on_high_watermark:
        msg = "an enabled side thread needs a trigger: set every_turns or on_high_watermark: true"
        return (("every_turns",), msg)
    return None


# ---------------------------------------------------------------------------- policy shorthands


def _check_policy_keys(data: Any) -> None:
    """Unknown parameters and invalid values of a known policy, each at the path where it was written.

    `policy: {name: snapkv, windw: 32}` reports `policy.windw`, and the `params:`
    spelling `policy.params.windw`, each with did-you-mean and the allowed names;
    `window: -3` is reported at load, by the policy's own checks, not at the first
    model call. An unknown policy name is left to the `name` validator.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("name", "lifecycle"), str):
        return
    name = str(data.get("name", "lifecycle")).strip().lower().replace("-", "_")
    if name not in ALLOWED_POLICIES:
        return
    allowed = policy_params(name)
    written: list[tuple[Loc, object, object]] = [
        ((k,), k, v) for k, v in data.items() if k not in ("name", "params")
    ]
    params = data.get("params")
    if isinstance(params, Mapping):
        written += [(("params", k), k, v) for k, v in params.items()]
    problems: list[tuple[Loc, str]] = []
    values: dict[str, object] = {}
    where: dict[str, Loc] = {}
    for loc, key, value in written:
        if str(key) not in allowed:
            problems.append((loc, unknown_value(f"parameter of policy {name!r}", key, allowed, in_path=True)))
        else:
            values[str(key)] = value
            where[str(key)] = loc
    for key, message in param_problems(name, values).items():
        problems.append((where[key] if key else ("params",), message))
    if problems:
        raise ConfigProblems([(tuple(map(str, loc)), msg) for loc, msg in problems])


def policy_as_mapping(data: Any) -> Any:
    """Read the policy shorthands as `{name, params}`; anything else comes back unchanged.

    `"snapkv"` becomes `{"name": "snapkv"}`; `{"name": "snapkv", "window": 32}`
    becomes `{"name": "snapkv", "params": {"window": 32}}`. A key given both ways is
    left in place for the validator to report.
    """
    if isinstance(data, str):
        return {"name": data}
    if not isinstance(data, Mapping):
        return data
    extra = {k: v for k, v in data.items() if k not in ("name", "params")}
    params = data.get("params")
    if params is None:
        params = {}
    if not extra or not isinstance(params, Mapping) or extra.keys() & params.keys():
        return data
    head = {"name": data["name"]} if "name" in data else {}
    return head | {"params": {**params, **extra}}
