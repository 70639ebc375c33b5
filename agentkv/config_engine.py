"""The `engine:` section of the config: a served engine (vLLM + LMCache) and its fleet controls.

Kept apart from `agentkv.config_sections` (the local sections) so that each module stays
one reader's sitting; `agentkv.config` composes it into `AgentKVConfig`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from agentkv.config_sections import Section, shaped
from agentkv.config_text import show_value

_URL_SHAPE = r"^https?://[^\s/]+(/\S*)?$"
_URL_PROBLEM = "expected an http:// or https:// URL, got {value}"
_Url = Annotated[str, shaped(_URL_SHAPE, _URL_PROBLEM)]
"""An http:// or https:// URL with a host."""

SALT_POLICIES: tuple[str, ...] = ("conversation", "shared")
"""`engine.salt`: one `cache_salt` per conversation (branches share it), or none (all share prefixes)."""


class EngineConfig(Section):
    """A served engine (vLLM + LMCache) that carries out the lifecycle instead of local tensors.

    The same events, rules and budgets drive it: commits pin prefixes on LMCache's
    coordinator, releases leave spans out of the prompt and delete stale chunks,
    recalls prefetch (see docs/scale-out.md).
    """

    vllm_url: str | list[str]
    """Base URL of vLLM's OpenAI server, e.g. http://127.0.0.1:8000; a list = a fleet sharing one LMCache."""
    served_model: str = Field(default="agentkv-default", min_length=1)
    """The model name vLLM serves (--served-model-name)."""
    model_path: str | None = Field(default=None, min_length=1)
    """The model as LMCache knows it (vLLM's --model path); null = the default model's."""
    coordinator_url: _Url | None = None
    """LMCache coordinator, e.g. http://127.0.0.1:9300; null = vLLM alone, no hints."""
    salt: Literal["conversation", "shared"] = Field(
        default="conversation", json_schema_extra={"enum": list(SALT_POLICIES)}
    )
    """cache_salt per conversation (branches share it), or shared = no salt."""
    salt_prefix: str = Field(default="", max_length=64)
    """Prefix of every cache_salt (a tenant namespace); with salt: shared, the one salt they all use."""
    chunk_size: int = Field(default=256, gt=0, strict=True)
    """LMCache's --chunk-size (pins and deletes cover whole chunks)."""
    hint_timeout_s: float = Field(default=10.0, gt=0, strict=True)
    """Seconds per coordinator call (a late hint is dropped)."""
    request_timeout_s: float = Field(default=300.0, gt=0, strict=True)
    """Seconds per completion request."""
    prefetch_wait_s: float = Field(default=5.0, ge=0, strict=True)
    """Seconds a recall waits for its prefetch before the call."""

    pin_budget_tokens: int | None = Field(default=None, ge=0, strict=True)
    """Most tokens a conversation pins on LMCache (whole chunks); null = its L2 quota, if any."""
    fleet_pin_budget_tokens: int | None = Field(default=None, ge=0, strict=True)
    """L2 tokens a backend's conversations pin together: whole histories, first come first; null = off."""
    admission_tokens: int | None = Field(default=None, gt=0, strict=True)
    """Working-set tokens the resident conversations hold together; the others wait (FIFO); null = off."""
    admission_quantum_turns: int = Field(default=4, gt=0, strict=True)
    """Turns a resident conversation keeps its residency while others wait (then it yields)."""
    admission_wait_s: float = Field(default=300.0, gt=0, strict=True)
    """Most seconds a model call waits for residency; then it proceeds unadmitted (logged)."""
    admission_tool_ttl_s: float = Field(default=60.0, gt=0, strict=True)
    """Seconds a resident may spend between the calls of a turn (tool calls) before losing it."""
    admission_park_ttl_s: float = Field(default=10.0, gt=0, strict=True)
    """Seconds a resident that ended its turn may idle before others may take its place."""
    down_after_failures: int = Field(default=2, gt=0, strict=True)
    """Timed-out requests in a row that mark a fleet engine down (a refused connection: at once)."""
    health_interval_s: float = Field(default=5.0, gt=0, strict=True)
    """Seconds between health checks of the fleet's engines (a down engine that answers is used again)."""

    @field_validator("vllm_url")
    @classmethod
    def _some_url(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and (not value or len(set(value)) < len(value)):
            raise ValueError(f"expected one URL or a list of distinct URLs, got {show_value(value)}")
        for url in [value] if isinstance(value, str) else value:
            if not re.match(_URL_SHAPE, url):
                raise ValueError(_URL_PROBLEM.format(value=show_value(url)))
        return value

    @property
    def urls(self) -> tuple[str, ...]:
        """The fleet's vLLM servers, in the order given (one for a single `vllm_url`)."""
        return (self.vllm_url,) if isinstance(self.vllm_url, str) else tuple(self.vllm_url)

    @field_validator("salt_prefix")
    @classmethod
    def _salt_chars(cls, value: str) -> str:
        if set(value) & set("@/\\\x00"):
            raise ValueError(f"LMCache refuses '@', '/', '\\' and NUL in a salt, got {show_value(value)}")
        return value
