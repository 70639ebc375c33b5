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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from agentkv.config_chat import ChatConfig
from agentkv.config_engine import EngineConfig
from agentkv.config_sections import (
    ALLOWED_POLICIES,
    CUSTOM_EVENT_PREFIX,
    CUSTOM_EVENT_TARGETS,
    BudgetConfig,
    CallbacksConfig,
    CommitConfig,
    ForgetConfig,
    PolicyConfig,
    PrefixCacheConfig,
    QuantizationConfig,
    RecallConfig,
    Section,
    TorchDevice,
    policy_as_mapping,
    trigger_problem,
    watermark_problem,
)
from agentkv.config_sessions import SessionsConfig
from agentkv.config_text import (
    ConfigProblems,
    Loc,
    format_errors,
    kind_of,
    line_near,
    load_yaml,
    parse_bytes,
    truncate,
    unknown_value,
)
from agentkv.events import ACTIONS, EVENT_NAMES, EVENT_TARGETS

__all__ = [
    "ALLOWED_POLICIES",
    "AgentKVConfig",
    "BudgetConfig",
    "CallbacksConfig",
    "ChatConfig",
    "CommitConfig",
    "ForgetConfig",
    "PolicyConfig",
    "PrefixCacheConfig",
    "QuantizationConfig",
    "RecallConfig",
    "SessionsConfig",
    "parse_bytes",
    "rule_problems",
]


class AgentKVConfig(Section):
    """Everything agentkv reads from the `agentkv:` section of a graph YAML."""

    model: str | None = Field(default=None, min_length=1)
    """null = the default model; or an HF id, a directory or a .gguf path."""
    device: TorchDevice | None = None
    """Torch device for the model and its KV (cpu, cuda, cuda:1, mps); null = auto."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    """Model and KV dtype; null or auto = the checkpoint's (float32 on CPU)."""
    attn_implementation: Literal["sdpa", "eager"] | None = None
    """Attention kernel; null = the family's (SDPA where it runs, eager otherwise, e.g. Gemma 2)."""
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    """KV limits per tier."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Token scoring policy."""
    archive_tier: Literal["host", "int8", "int4", "drop"] = "host"
    """Where archived spans go: CPU, quantized on device, or dropped."""
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    """Settings of the int8/int4 tiers."""
    commit: CommitConfig = Field(default_factory=CommitConfig)
    """Compression at commit."""
    recall: RecallConfig = Field(default_factory=RecallConfig)
    """Recall of archived spans."""
    rules: dict[str, dict[str, str]] = Field(default_factory=dict)
    """Event -> {target: action} overrides of the default rules."""
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    """How many sessions hold KV, and for how long when idle (backend-wide)."""
    callbacks: CallbacksConfig = Field(default_factory=CallbacksConfig)
    """LangChain callback handler settings."""
    engine: EngineConfig | None = None
    """A served engine (vLLM + LMCache); null = the local Transformers model."""
    forget: ForgetConfig = Field(default_factory=ForgetConfig)
    """The forgetting side thread (SideQuest-style), off by default."""
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)
    """Sessions that start alike share their leading system messages' KV (on by default)."""
    chat: ChatConfig = Field(default_factory=ChatConfig)
    """How the chat template is read: tool-call format, template switches (backend-wide)."""

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
            ValueError: `path` is a directory or unreadable, the YAML is malformed (file and
                line), the section is missing or any value is invalid (one line per problem,
                with its YAML path).
        """
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError as e:
            msg = f"agentkv config file not found: {file}"
            raise FileNotFoundError(msg) from e
        except IsADirectoryError as e:
            msg = f"{file}: a directory, expected a YAML file with an `{section}:` section"
            raise ValueError(msg) from e
        except OSError as e:
            msg = f"{file}: cannot read the agentkv config ({e.strerror or e})"
            raise ValueError(msg) from e
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
            line_of=lambda loc: line_near(lines, (section, *map(str, loc))),
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

    def backend_wide_changes(self, backend: AgentKVConfig) -> list[str]:
        """The settings this config asks for that only a backend can honour, where `backend`'s differ.

        A backend loads one model (`model`, `device`, `dtype`, `attn_implementation`) or
        serves one `engine`, renders every session's prompts, tool prompts, grammars and
        stop tokens with one chat format (`chat`), bounds one session table (`sessions`)
        and shares one prefix cache (`prefix_cache`; a session may still opt out with
        `prefix_cache.enabled: false`). A session made with other values gets the backend's.

        Returns:
            `agentkv.<key>` paths (`agentkv.chat.template`), in field order; empty when none differs.
        """
        changed = [
            f"agentkv.{key}"
            for key in ("model", "device", "dtype", "attn_implementation", "engine", "sessions")
            if getattr(self, key) != getattr(backend, key)
        ]
        changed += [
            f"agentkv.chat.{name}"
            for name in type(self.chat).model_fields
            if getattr(self.chat, name) != getattr(backend.chat, name)
        ]
        if self.prefix_cache.enabled:
            changed += [
                f"agentkv.prefix_cache.{name}"
                for name in type(self.prefix_cache).model_fields
                if getattr(self.prefix_cache, name) != getattr(backend.prefix_cache, name)
            ]
        return changed

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
            line = line_of(()) if line_of else None
            where = ", ".join(w for w in (source, f"line {line}" if line else None) if w)
            where = f" ({where})" if where else ""
            msg = f"{prefix}: must be a mapping, got {kind_of(data)}{where}"
            raise ValueError(msg)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            lines = format_errors(e, prefix, line_of, AgentKVConfig)
            lines += [line for line in cross_field_lines(data, prefix, line_of) if line not in lines]
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


def cross_field_problems(data: Mapping[str, Any]) -> list[tuple[Loc, str]]:
    """Cross-field problems of a raw `agentkv:` mapping whose own values are each valid."""
    problems: list[tuple[Loc, str]] = []
    budget = data.get("budget")
    if isinstance(budget, Mapping):
        fields = BudgetConfig.model_fields
        high = budget.get("high_watermark", fields["high_watermark"].default)
        low = budget.get("low_watermark", fields["low_watermark"].default)
        if _is_fraction(high) and _is_fraction(low):
            problem = watermark_problem(float(high), float(low))
            if problem is not None:
                problems.append((("budget", *problem[0]), problem[1]))
    forget = data.get("forget")
    if isinstance(forget, Mapping) and forget.get("enabled") is True and "every_turns" in forget:
        problem = trigger_problem(True, forget["every_turns"], forget.get("on_high_watermark") is True)
        if problem is not None:
            problems.append((("forget", *problem[0]), problem[1]))
    return problems


def _is_fraction(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1


def cross_field_lines(
    data: Mapping[str, Any], prefix: str, line_of: Callable[[Loc], int | None] | None
) -> list[str]:
    """`cross_field_problems` of raw data as error lines, in `format_errors`' form."""
    out: list[str] = []
    for loc, message in cross_field_problems(data):
        line = line_of(loc) if line_of else None
        where = f" (line {line})" if line else ""
        out.append(f"{'.'.join([prefix, *map(str, loc)])}: {message}{where}")
    return out


def _deep_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _merge_policy(base: Mapping[str, Any], patch: object) -> object:
    """Merge a policy override over the current `{name, params}`.

    `{"policy": {"window": 64}}` tunes the current policy: parameters merge.
    `{"policy": "h2o"}` over a SnapKV config must not hand SnapKV's parameters to
    H2O, so naming a different policy replaces the whole policy section.
    """
    patch = policy_as_mapping(patch)
    if not isinstance(patch, Mapping):
        return patch
    name = patch.get("name", base.get("name"))
    if not isinstance(name, str) or name.strip().lower().replace("-", "_") != base.get("name"):
        return patch
    return _deep_merge(base, patch)
