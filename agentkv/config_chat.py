"""The `chat:` section: how the chat template is read (tool-call format, template switches)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from agentkv.config_sections import Section

__all__ = ["ChatConfig"]


class ChatConfig(Section):
    """How messages are rendered with the model's chat template (backend-wide).

    One chat format renders every session's prompts, the tool prompts, the grammars
    and the stop tokens of a backend, so these keys belong to the config that loads
    the model: a later `ChatAgentKV(config=...)` or `with_kv_lifecycle(config=...)`
    asking for others is an error, and `configurable.agentkv.chat` or a
    `backend.session(id, config=...)` asking for others is ignored with a warning.
    """

    tool_format: str | None = None
    """Tool-call format: hermes, qwen, llama3_json, mistral, granite, phi4, pythonic; null = detected."""
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template, e.g. `enable_thinking: false` (Qwen3, SmolLM3)."""
    template: str | None = None
    """A built-in template (chatml, gemma, llama3) or a .jinja file instead of the tokenizer's; null = the
    tokenizer's (one without: the built-in its turn tokens name, else ChatML as plain text, warned)."""

    @field_validator("tool_format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        from agentkv.toolformats import FORMATS  # the registry imports the grammar library

        if value is not None and value not in FORMATS:
            msg = f"unknown tool format {value!r}; allowed: {', '.join(FORMATS)}"
            raise ValueError(msg)
        return value

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        from agentkv.templates.builtin import BUILTIN_TEMPLATES

        if value is not None and value not in BUILTIN_TEMPLATES and not value.endswith(".jinja"):
            names = ", ".join(BUILTIN_TEMPLATES)
            msg = f"unknown template {value!r}; allowed: {names}, or a path ending in .jinja"
            raise ValueError(msg)
        return value
