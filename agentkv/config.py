"""Configuration: the `agentkv:` section of a graph YAML, validated by pydantic.

The section lives next to whatever else a graph YAML holds (nodes, edges, prompts),
so loading reads the whole file and validates only `agentkv:`. Every model forbids
unknown keys and is frozen: a typo is an error at load time, never a silently
ignored setting, and a config shared by many sessions cannot change under them.

Every problem is reported as a plain `ValueError`, one line per problem, naming
the YAML path, what was wrong and the allowed values, e.g.
`agentkv.budget.device_tokens: must be > 0, got -5`. Pydantic's own
`ValidationError` never escapes: callers catch one exception type.

Per-run overrides (LangGraph's `config["configurable"]["agentkv"]`) are deep
merged over a loaded config and validated again, see `AgentKVConfig.with_overrides`.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agentkv.config_text import (
    ConfigProblems,
    Loc,
    format_errors,
    kind_of,
    load_yaml,
    parse_bytes,
    show_value,
    truncate,
    unknown_value,
)
from agentkv.events import ACTIONS, EVENT_NAMES, EVENT_TARGETS
from agentkv.policies.factory import POLICY_NAMES, policy_params
from agentkv.spans import SpanKind

__all__ = [
    "ALLOWED_POLICIES",
    "AgentKVConfig",
    "BudgetConfig",
    "CallbacksConfig",
    "CommitConfig",
    "ForgetConfig",
    "PolicyConfig",
    "QuantizationConfig",
    "RecallConfig",
    "parse_bytes",
    "rule_problems",
]

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

# ---------------------------------------------------------------------------- models


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors, instances never change.

    A container key written with nothing under it (`budget:` with every line
    commented out) is YAML null; it means "the defaults", not an error.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

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


class BudgetConfig(_Section):
    """How much KV a session may hold, per tier; null limits mean unlimited.

    Over `high_watermark` of a limit the manager demotes spans along the lifecycle chain
    (archive, offload, quantize, evict) until usage is under `low_watermark`; the gap
    between the two keeps it from demoting again on every new token.
    """

    device_tokens: int | None = Field(
        default=None,
        gt=0,
        strict=True,
        description="Per-session KV budget on the device, in tokens; null = none.",
    )
    """Per-session KV budget on the device, in tokens; null = none."""
    device_bytes: _ByteCount = Field(
        default=None,
        gt=0,
        description="Per-session KV budget on the device, in bytes (e.g. 64MiB, 1.5 GB); null = none.",
    )
    """Per-session KV budget on the device, in bytes (e.g. 64MiB, 1.5 GB); null = none."""
    host_tokens: int | None = Field(
        default=None, gt=0, strict=True, description="Per-session archive budget on the host tier, in tokens."
    )
    """Per-session archive budget on the host tier, in tokens."""
    host_bytes: _ByteCount = Field(
        default=None, gt=0, description="Per-session archive budget on the host tier, in bytes (e.g. 1GiB)."
    )
    """Per-session archive budget on the host tier, in bytes (e.g. 1GiB)."""
    global_device_bytes: _ByteCount = Field(
        default=None, gt=0, description="Device KV budget across all sessions of a backend, in bytes."
    )
    """Device KV budget across all sessions of a backend, in bytes."""
    high_watermark: float = Field(
        default=1.0,
        gt=0,
        le=1,
        strict=True,
        description="Fraction of a limit at which demotion starts (0 < x <= 1).",
    )
    """Fraction of a limit at which demotion starts (0 < x <= 1)."""
    low_watermark: float = Field(
        default=0.8,
        gt=0,
        le=1,
        strict=True,
        description="Fraction of a limit demotion brings usage back under (0 < x <= high_watermark).",
    )
    """Fraction of a limit demotion brings usage back under (0 < x <= high_watermark)."""

    @model_validator(mode="after")
    def _low_not_above_high(self) -> BudgetConfig:
        if self.low_watermark > self.high_watermark:
            msg = f"must be <= high_watermark ({self.high_watermark}), got {self.low_watermark}"
            raise ConfigProblems([(("low_watermark",), msg)])
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


class PolicyConfig(_Section):
    """Which policy scores tokens when a span is committed or the budget is exceeded.

    Three spellings are accepted: `policy: snapkv`; `policy: {name: snapkv, window: 32}`
    (keys other than `name` and `params` are the policy's parameters); and the full
    `policy: {name: snapkv, params: {window: 32}}`.
    """

    name: str = Field(
        default="lifecycle",
        description="Policy name (case-insensitive; '-' reads as '_').",
        json_schema_extra={"enum": list(ALLOWED_POLICIES)},
    )
    """Policy name (case-insensitive; '-' reads as '_')."""
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the policy's constructor."
    )
    """Keyword arguments for the policy's constructor."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        _check_policy_keys(data)  # on the data as written, so an error names the key's own path
        data = _policy_as_mapping(data)
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


class QuantizationConfig(_Section):
    """How spans are quantized on the int8/int4 archive tiers (KIVI-style).

    Keys are quantized per channel and values per token, in groups along the
    channel/token axis; the most recent tokens stay full precision because
    quantization error hurts most where attention is sharpest.
    """

    group_size: int = Field(
        default=32,
        ge=8,
        le=256,
        strict=True,
        description="Elements per quantization group: a power of two from 8 to 256.",
    )
    """Elements per quantization group: a power of two from 8 to 256."""
    residual_tokens: int = Field(
        default=0, ge=0, strict=True, description="Most recent tokens of a span kept in full precision."
    )
    """Most recent tokens of a span kept in full precision."""
    attended_bits: Literal[4, 2] | None = Field(
        default=None,
        description="Attended cache held at 4 or 2 bits (KIVI), dequantized on read; null = full precision.",
    )
    """Attended cache held at 4 or 2 bits (KIVI), dequantized on read; null = full precision."""
    attended_residual_tokens: int = Field(
        default=64,
        ge=0,
        strict=True,
        description="Most recent attended tokens kept in full precision when attended_bits is set.",
    )
    """Most recent attended tokens kept in full precision when attended_bits is set."""

    @field_validator("group_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            allowed = ", ".join(str(2**i) for i in range(3, 9))
            raise ValueError(f"must be a power of two, got {value}; allowed: {allowed}")
        return value


class CommitConfig(_Section):
    """How a span is compressed when it is committed; it is then frozen (commit then freeze).

    Scores come from the attention of the last `window` queries that consumed the
    span; re-scoring old turns later is the documented failure mode, so it never happens.
    """

    keep_ratio: dict[str, _Fraction] = Field(
        default_factory=dict,
        description="Per span kind, fraction of tokens kept at commit (0 < r <= 1); unlisted kinds keep all.",
        json_schema_extra={"propertyNames": {"enum": [kind.value for kind in SpanKind]}},
    )
    """Per span kind, fraction of tokens kept at commit (0 < r <= 1); unlisted kinds keep all."""
    min_keep_tokens: int = Field(
        default=8, ge=1, strict=True, description="Never compress a span below this many tokens."
    )
    """Never compress a span below this many tokens."""
    window: int = Field(
        default=32,
        ge=1,
        strict=True,
        description="Observation window: recent queries whose attention scores a span.",
    )
    """Observation window: recent queries whose attention scores a span."""

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


class RecallConfig(_Section):
    """Bringing archived spans back before the model answers a new user turn.

    Archived spans whose key summaries match the new query best are restored to the
    device; evicted ones can be recomputed from their token ids.
    """

    enabled: bool = Field(
        default=True, strict=True, description="Recall archived spans relevant to each new user turn."
    )
    """Recall archived spans relevant to each new user turn."""
    max_spans: int = Field(
        default=4, ge=0, strict=True, description="At most this many spans recalled per turn."
    )
    """At most this many spans recalled per turn."""
    min_score: float | None = Field(
        default=None,
        strict=True,
        allow_inf_nan=False,
        description="Relevance a span needs to be recalled; null = the top max_spans regardless.",
    )
    """Relevance a span needs to be recalled; null = the top max_spans regardless."""
    relative_floor: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        strict=True,
        allow_inf_nan=False,
        description=(
            "Recall spans at least this fraction as relevant as the best; the most relevance that fits."
        ),
    )
    """Recall spans at least this fraction as relevant as the best; the most relevance that fits."""
    rehydrate_evicted: bool = Field(
        default=True, strict=True, description="Recompute evicted spans from their tokens when recalled."
    )
    """Recompute evicted spans from their tokens when recalled."""


FORGET_PROMPT_FIELD = "{handles}"
"""The placeholder `ForgetConfig.prompt` must contain: the listing of candidate tool results."""

DEFAULT_FORGET_PROMPT = (
    "Housekeeping, not a question for the user. These earlier tool results are still in your memory:\n"
    f"{FORGET_PROMPT_FIELD}\n"
    "Which of them will not be needed for any later question? Call forget_tool_outputs with their "
    "handles; an empty list keeps them all."
)
"""What the side thread asks (`{handles}` becomes one line per candidate: handle, tool, preview)."""


class ForgetConfig(_Section):
    """The agent decides what to forget: a side thread that names stale tool results (SideQuest-style).

    Off by default. When on, at a turn end (every `every_turns` turns and/or when the device
    budget is at its watermarks) a fork of the session lists the committed tool results by
    short handles (`T1`, `T2`: the k-th tool result of the conversation), the model answers
    with a constrained `forget_tool_outputs` call, the fork is closed at once, and the named
    results are released at the next turn boundary (rule `custom:forget_tool_output`).
    """

    enabled: bool = Field(
        default=False, strict=True, description="Run the forgetting side thread (off by default)."
    )
    """Run the forgetting side thread (off by default)."""
    every_turns: int | None = Field(
        default=1,
        ge=1,
        strict=True,
        description="Run it every this many turns; null = only on the budget's watermark.",
    )
    """Run it every this many turns; null = only on the budget's watermark."""
    on_high_watermark: bool = Field(
        default=False,
        strict=True,
        description="Also run it at a turn end when the device budget reached its high watermark.",
    )
    """Also run it at a turn end when the device budget reached its high watermark."""
    prompt: str = Field(
        default=DEFAULT_FORGET_PROMPT,
        min_length=1,
        description="What the side thread asks; must contain {handles} (the candidate listing).",
    )
    """What the side thread asks; must contain {handles} (the candidate listing)."""
    max_candidates: int = Field(
        default=8,
        ge=1,
        le=64,
        strict=True,
        description="At most this many tool results offered (oldest first).",
    )
    """At most this many tool results offered (oldest first)."""
    preview_chars: int = Field(
        default=80, ge=0, le=2000, strict=True, description="Characters of each result shown in the listing."
    )
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
        if self.enabled and self.every_turns is None and not self.on_high_watermark:
            msg = "an enabled side thread needs a trigger: set every_turns or on_high_watermark: true"
            raise ConfigProblems([(("every_turns",), msg)])
        return self


class CallbacksConfig(_Section):
    """Behaviour of the LangChain callback handler that turns runs into events."""

    raise_error: bool = Field(
        default=False,
        strict=True,
        description="Let handler errors stop the run; false logs them (hints never break a run).",
    )
    """Let handler errors stop the run; false logs them (hints never break a run)."""


_DEVICE_RE = re.compile(r"^[a-z][a-z_]*(:\d+)?$")


_URL_RE = re.compile(r"^https?://[^\s/]+(/\S*)?$")
SALT_POLICIES: tuple[str, ...] = ("conversation", "shared")
"""`engine.salt`: one `cache_salt` per conversation (branches share it), or none (all share prefixes)."""


class EngineConfig(_Section):
    """A served engine (vLLM + LMCache) that carries out the lifecycle instead of local tensors.

    The same events, rules and budgets drive it: commits pin prefixes on LMCache's
    coordinator, releases leave spans out of the prompt and delete stale chunks,
    recalls prefetch (see docs/scale-out.md).
    """

    vllm_url: str = Field(description="Base URL of vLLM's OpenAI server, e.g. http://127.0.0.1:8000.")
    """Base URL of vLLM's OpenAI server, e.g. http://127.0.0.1:8000."""
    served_model: str = Field(
        default="agentkv-default",
        min_length=1,
        description="The model name vLLM serves (--served-model-name).",
    )
    """The model name vLLM serves (--served-model-name)."""
    model_path: str | None = Field(
        default=None,
        min_length=1,
        description="The model as LMCache knows it (vLLM's --model path); null = the default model's.",
    )
    """The model as LMCache knows it (vLLM's --model path); null = the default model's."""
    coordinator_url: str | None = Field(
        default=None,
        description="LMCache coordinator, e.g. http://127.0.0.1:9300; null = vLLM alone, no hints.",
    )
    """LMCache coordinator, e.g. http://127.0.0.1:9300; null = vLLM alone, no hints."""
    salt: Literal["conversation", "shared"] = Field(
        default="conversation",
        description="cache_salt per conversation (branches share it), or shared = no salt.",
        json_schema_extra={"enum": list(SALT_POLICIES)},
    )
    """cache_salt per conversation (branches share it), or shared = no salt."""
    chunk_size: int = Field(
        default=256,
        gt=0,
        strict=True,
        description="LMCache's --chunk-size (pins and deletes cover whole chunks).",
    )
    """LMCache's --chunk-size (pins and deletes cover whole chunks)."""
    hint_timeout_s: float = Field(
        default=10.0, gt=0, strict=True, description="Seconds per coordinator call (a late hint is dropped)."
    )
    """Seconds per coordinator call (a late hint is dropped)."""
    request_timeout_s: float = Field(
        default=300.0, gt=0, strict=True, description="Seconds per completion request."
    )
    """Seconds per completion request."""
    prefetch_wait_s: float = Field(
        default=5.0, ge=0, strict=True, description="Seconds a recall waits for its prefetch before the call."
    )
    """Seconds a recall waits for its prefetch before the call."""

    @field_validator("vllm_url", "coordinator_url")
    @classmethod
    def _url_shape(cls, value: str | None) -> str | None:
        if value is not None and not _URL_RE.match(value):
            raise ValueError(f"expected an http:// or https:// URL, got {show_value(value)}")
        return value


class AgentKVConfig(_Section):
    """Everything agentkv reads from the `agentkv:` section of a graph YAML."""

    model: str | None = Field(
        default=None,
        min_length=1,
        description="null = the default model; or an HF id, a directory or a .gguf path.",
    )
    """null = the default model; or an HF id, a directory or a .gguf path."""
    device: str | None = Field(
        default=None,
        description="Torch device for the model and its KV (cpu, cuda, cuda:1, mps); null = auto.",
    )
    """Torch device for the model and its KV (cpu, cuda, cuda:1, mps); null = auto."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = Field(
        default=None, description="Model and KV dtype; null or auto = the checkpoint's (float32 on CPU)."
    )
    """Model and KV dtype; null or auto = the checkpoint's (float32 on CPU)."""
    budget: BudgetConfig = Field(default_factory=BudgetConfig, description="KV limits per tier.")
    """KV limits per tier."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Token scoring policy.")
    """Token scoring policy."""
    archive_tier: Literal["host", "int8", "int4", "drop"] = Field(
        default="host", description="Where archived spans go: CPU, quantized on device, or dropped."
    )
    """Where archived spans go: CPU, quantized on device, or dropped."""
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig, description="Settings of the int8/int4 tiers."
    )
    """Settings of the int8/int4 tiers."""
    commit: CommitConfig = Field(default_factory=CommitConfig, description="Compression at commit.")
    """Compression at commit."""
    recall: RecallConfig = Field(default_factory=RecallConfig, description="Recall of archived spans.")
    """Recall of archived spans."""
    rules: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="Event -> {target: action} overrides of the default rules.",
    )
    """Event -> {target: action} overrides of the default rules."""
    callbacks: CallbacksConfig = Field(
        default_factory=CallbacksConfig, description="LangChain callback handler settings."
    )
    """LangChain callback handler settings."""
    engine: EngineConfig | None = Field(
        default=None, description="A served engine (vLLM + LMCache); null = the local Transformers model."
    )
    """A served engine (vLLM + LMCache); null = the local Transformers model."""
    forget: ForgetConfig = Field(
        default_factory=ForgetConfig,
        description="The forgetting side thread (SideQuest-style), off by default.",
    )
    """The forgetting side thread (SideQuest-style), off by default."""

    @field_validator("device")
    @classmethod
    def _device_shape(cls, value: str | None) -> str | None:
        if value is not None and not _DEVICE_RE.match(value):
            raise ValueError(f"not a torch device: {show_value(value)}; e.g. cpu, cuda, cuda:1, mps")
        return value

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, value: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        problems: list[tuple[Loc, str]] = list(rule_problems(value))
        if problems:
            raise ConfigProblems(problems)
        return value

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], section: str = "agentkv") -> AgentKVConfig:
        """Load the `section` of any YAML file (typically a graph YAML) as a config.

        Args:
            path: The YAML file.
            section: The top-level key holding agentkv's settings.

        Returns:
            The validated config; defaults when the section is present but empty.

        Raises:
            FileNotFoundError: `path` does not exist (the message names it).
            ValueError: The YAML is malformed (file and line), the section is missing or
                any value is invalid (one line per problem, with its YAML path).
        """
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError as e:
            msg = f"agentkv config file not found: {file}"
            raise FileNotFoundError(msg) from e
        except UnicodeDecodeError as e:
            msg = f"{file}: not UTF-8 text ({e.reason} at byte {e.start})"
            raise ValueError(msg) from e
        return cls.from_yaml_text(text, section=section, source=str(file))

    @classmethod
    def from_yaml_text(cls, text: str, section: str = "agentkv", source: str = "<string>") -> AgentKVConfig:
        """Like `from_yaml`, for YAML already in memory; `source` names it in errors."""
        document, lines = load_yaml(text, source)
        if document is None:
            msg = f"no `{section}:` section in {source}: the document is empty"
            raise ValueError(msg)
        if not isinstance(document, Mapping):
            got = kind_of(document)
            msg = f"{source}: the top level must be a mapping with the key `{section}:`, got {got}"
            raise ValueError(msg)
        if section not in document:
            keys = ", ".join(truncate(str(k), 40) for k in list(document)[:20]) or "(none)"
            more = ", ..." if len(document) > 20 else ""
            msg = f"no `{section}:` section in {source}; top-level keys: {keys}{more}"
            raise ValueError(msg)
        return cls._validate(
            document[section],
            prefix=section,
            source=source,
            line_of=lambda loc: lines.get((section, *map(str, loc))),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, prefix: str = "agentkv") -> AgentKVConfig:
        """Validate the contents of an `agentkv:` section given as Python data.

        Args:
            data: The section's mapping; None means the defaults.
            prefix: How error messages name the section (its path in the user's document).

        Raises:
            ValueError: One line per problem, each starting with its path under `prefix`.
        """
        return cls._validate(data, prefix=prefix)

    def with_overrides(
        self, overrides: Mapping[str, Any] | None, prefix: str = "configurable.agentkv"
    ) -> AgentKVConfig:
        """A copy with `overrides` deep-merged in, validated again.

        Used for per-run settings from LangGraph's `config["configurable"]["agentkv"]`:
        nested mappings merge key by key (`{"budget": {"device_tokens": 512}}` keeps
        the other budget keys), anything else replaces. Naming a different policy
        starts from that policy's own parameters rather than inheriting the old ones.

        Args:
            overrides: Partial config in the same shape as the YAML section; None or
                empty returns `self`.
            prefix: How error messages name the overrides' location.

        Raises:
            ValueError: The merged config is invalid (one line per problem).
        """
        if not overrides:
            return self
        if not isinstance(overrides, Mapping):
            msg = f"{prefix}: must be a mapping, got {kind_of(overrides)}"
            raise ValueError(msg)
        base = self.to_dict()
        merged = _deep_merge(base, {k: v for k, v in overrides.items() if k != "policy"})
        if "policy" in overrides:
            merged["policy"] = _merge_policy(base["policy"], overrides["policy"])
        return self._validate(merged, prefix=prefix)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts in the YAML section's shape; `from_dict` reads it back."""
        return self.model_dump(mode="python")

    @classmethod
    def _validate(
        cls,
        data: object,
        prefix: str,
        source: str | None = None,
        line_of: Callable[[Loc], int | None] | None = None,
    ) -> AgentKVConfig:
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            where = f" ({source})" if source else ""
            msg = f"{prefix}: must be a mapping, got {kind_of(data)}{where}"
            raise ValueError(msg)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            lines = format_errors(e, prefix, line_of, AgentKVConfig)
            head = f"invalid agentkv config in {source}:\n" if source else ""
            raise ValueError(head + "\n".join(lines)) from None
        except RecursionError as e:
            msg = f"{prefix}: nested too deeply to validate"
            raise ValueError(msg) from e


# ---------------------------------------------------------------------------- helpers


def rule_problems(rules: Mapping[str, Mapping[str, str]]) -> list[tuple[tuple[str, ...], str]]:
    """What is wrong with rule overrides: `(path under rules, message)` pairs (empty = valid).

    The one validation of rules: the config's validator and `agentkv.lifecycle.rules.Rules` both call it.
    """
    problems: list[tuple[tuple[str, ...], str]] = []
    for event, targets in rules.items():
        if event.startswith(CUSTOM_EVENT_PREFIX):
            if not event[len(CUSTOM_EVENT_PREFIX) :].strip():
                problems.append(((event,), "custom event needs a name, e.g. custom:plan_approved"))
                continue
            allowed = CUSTOM_EVENT_TARGETS
        elif event in EVENT_TARGETS:
            allowed = EVENT_TARGETS[event]
        else:
            events = (*EVENT_NAMES, f"{CUSTOM_EVENT_PREFIX}<name>")
            problems.append(((event,), unknown_value("event", event, events, in_path=True)))
            continue
        for target, action in targets.items():
            if target not in allowed:
                what = f"target for {event}"
                problems.append(((event, target), unknown_value(what, target, allowed, in_path=True)))
            elif action not in ACTIONS:
                problems.append(((event, target), unknown_value("action", action, ACTIONS)))
    return problems


def _deep_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _check_policy_keys(data: Any) -> None:
    """Unknown parameters of a known policy, each at the path where it was written.

    `policy: {name: snapkv, windw: 32}` reports `policy.windw`, and the `params:`
    spelling `policy.params.windw`, each with did-you-mean and the allowed names.
    An unknown policy name is left to the `name` validator.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("name", "lifecycle"), str):
        return
    name = str(data.get("name", "lifecycle")).strip().lower().replace("-", "_")
    if name not in ALLOWED_POLICIES:
        return
    allowed = policy_params(name)
    written: list[tuple[Loc, object]] = [((k,), k) for k in data if k not in ("name", "params")]
    params = data.get("params")
    if isinstance(params, Mapping):
        written += [(("params", k), k) for k in params]
    problems = [
        (loc, unknown_value(f"parameter of policy {name!r}", key, allowed, in_path=True))
        for loc, key in written
        if str(key) not in allowed
    ]
    if problems:
        raise ConfigProblems([(tuple(map(str, loc)), msg) for loc, msg in problems])


def _policy_as_mapping(data: Any) -> Any:
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


def _merge_policy(base: Mapping[str, Any], patch: object) -> object:
    """Merge a policy override over the current `{name, params}`.

    `{"policy": {"window": 64}}` tunes the current policy: parameters merge.
    `{"policy": "h2o"}` over a SnapKV config must not hand SnapKV's parameters to
    H2O, so naming a different policy replaces the whole policy section.
    """
    patch = _policy_as_mapping(patch)
    if not isinstance(patch, Mapping):
        return patch
    name = patch.get("name", base.get("name"))
    if not isinstance(name, str) or name.strip().lower().replace("-", "_") != base.get("name"):
        return patch
    return _deep_merge(base, patch)
