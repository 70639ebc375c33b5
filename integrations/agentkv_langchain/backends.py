"""The process-wide backend: one loaded model shared by the chat models and the lifecycle.

`ChatAgentKV()` and `with_kv_lifecycle(graph)` must meet in one session table (the
chat model creates the spans, the handler's events name them), so without an
explicit `backend=` both take `shared_backend(config)`: one `TransformersBackend`
per (model, device, dtype, attn_implementation), loaded on first use. Everything
that accepts agentkv settings accepts the same three forms (`resolve_config`): an `AgentKVConfig`, a
mapping shaped like the YAML section, or the path of a graph YAML whose `agentkv:`
section is read.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from agentkv import AgentKVConfig, TransformersBackend, load_model

__all__ = [
    "BACKEND_WIDE",
    "ConfigLike",
    "check_backend_wide",
    "resolve_config",
    "session_settings",
    "shared_backend",
]

ConfigLike = AgentKVConfig | Mapping[str, Any] | str | os.PathLike[str] | None
"""What `config=` accepts everywhere: a config, a YAML-shaped mapping, a graph YAML path, or None."""

BACKEND_WIDE: tuple[str, ...] = (
    "model",
    "device",
    "dtype",
    "attn_implementation",
    "sessions",
    "chat",
    "callbacks",
)
"""Config keys that belong to a backend (which model, where, its chat format) or to the callback handler."""

_backends: dict[tuple[str | None, str | None, str | None, str | None], TransformersBackend] = {}
_backends_lock = threading.Lock()


def resolve_config(config: ConfigLike, *, model: str | None = None) -> AgentKVConfig | None:
    """Read any accepted form of agentkv settings as an `AgentKVConfig`.

    Args:
        config: An `AgentKVConfig`; a mapping (the `agentkv:` section's contents); a
            path to a graph YAML (its `agentkv:` section); or None (the defaults).
        model: A model id / path that overrides `config.model` (`ChatAgentKV(model=...)`).

    Returns:
        The config; None when neither `config` nor `model` says anything.

    Raises:
        TypeError: `config` is none of the accepted forms.
        ValueError / FileNotFoundError: the mapping or file is invalid (with YAML path and line).
    """
    if config is None:
        resolved = None
    elif isinstance(config, AgentKVConfig):
        resolved = config
    elif isinstance(config, Mapping):
        resolved = AgentKVConfig.from_dict(config)
    elif isinstance(config, (str, os.PathLike)):
        resolved = AgentKVConfig.from_yaml(config)
    else:
        msg = (
            "config: expected an AgentKVConfig, a mapping like the `agentkv:` YAML section, "
            f"or the path of a graph YAML, got {type(config).__name__}"
        )
        raise TypeError(msg)
    if model is not None:
        resolved = (resolved or AgentKVConfig()).with_overrides({"model": model})
    return resolved


def session_settings(config: AgentKVConfig | None, backend_config: AgentKVConfig) -> AgentKVConfig | None:
    """The settings sessions need beyond the backend's own: None when `config` asks for nothing else.

    The shared backend is keyed by model, device and dtype only, so two `ChatAgentKV`s
    with different budgets or policies meet on one backend; each creates its sessions
    with its own settings (`backend.session(..., config=...)`), the way per-run
    `configurable.agentkv` settings apply. Keys in `BACKEND_WIDE` are the backend's.
    """
    if config is None:
        return None
    check_backend_wide(config, backend_config)
    return None if _session_part(config) == _session_part(backend_config) else config


def check_backend_wide(config: AgentKVConfig, backend_config: AgentKVConfig) -> None:
    """Refuse settings that only a backend can honour when the backend was made with others.

    `agentkv.sessions` bounds the backend's whole session table, `agentkv.prefix_cache`
    is one cache the backend's sessions share, and `agentkv.chat` is the one chat format
    that renders every session's prompts, tool prompts, grammars and stop tokens: a
    config that asks for other bounds, another cache or another template than the
    backend it lands on would be ignored, so it is an error. A session may still opt out
    of the shared cache (`prefix_cache.enabled: false`).

    Raises:
        ValueError: `config.sessions`, `config.prefix_cache` or `config.chat` differs from
            the backend's (the message says how to fix it).
    """
    wanted, have = config.prefix_cache, backend_config.prefix_cache
    if wanted.enabled and wanted != have:
        msg = (
            f"agentkv.prefix_cache is backend-wide: this backend's cache is {have.model_dump()}, "
            f"the config asks for {wanted.model_dump()}. Give it to the first ChatAgentKV(config=...) / "
            "with_kv_lifecycle(config=...) of the process, or pass backend=TransformersBackend(model, "
            "tokenizer, config) made with it (a session may still set prefix_cache.enabled: false)"
        )
        raise ValueError(msg)
    if config.sessions != backend_config.sessions:
        msg = (
            f"agentkv.sessions is backend-wide: this backend bounds its sessions with "
            f"{backend_config.sessions.model_dump()}, the config asks for {config.sessions.model_dump()}. "
            "Give the bounds to the first ChatAgentKV(config=...) / with_kv_lifecycle(config=...) of "
            "the process (the one that loads the model), or pass backend=TransformersBackend(model, "
            "tokenizer, config) made with them"
        )
        raise ValueError(msg)
    if config.chat != backend_config.chat:
        msg = (
            "agentkv.chat is backend-wide: this backend renders prompts with "
            f"{backend_config.chat.model_dump()}, the config asks for {config.chat.model_dump()}. "
            "Give it to the first ChatAgentKV(config=...) / "
            "with_kv_lifecycle(config=...) of the process (the one that loads the model), or pass "
            "backend=TransformersBackend(model, tokenizer, config) made with it"
        )
        raise ValueError(msg)


def _session_part(config: AgentKVConfig) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in BACKEND_WIDE}


def shared_backend(config: ConfigLike = None, *, model: str | None = None) -> TransformersBackend:
    """The process-wide backend for `config.model` on `config.device` / `config.dtype` (loaded once).

    `ChatAgentKV()` and `with_kv_lifecycle(graph)` without a backend use it, so the
    model calls and the lifecycle events meet in one session table.

    Args:
        config: Which model to load, and the default settings of its sessions (the
            first caller's, for a given model); any form `resolve_config` reads.
            None = the default model. A later caller with other session settings
            passes them per session (`session_settings`), as `ChatAgentKV` does.
        model: A model id / path, overriding `config.model`.
    """
    resolved = resolve_config(config, model=model) or AgentKVConfig()
    key = (resolved.model, resolved.device, resolved.dtype, resolved.attn_implementation)
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            loaded, tokenizer = load_model(
                resolved.model,
                device=resolved.device,
                dtype=resolved.dtype,
                attn_implementation=resolved.attn_implementation,
            )
            backend = _backends[key] = TransformersBackend(loaded, tokenizer, resolved)
        return backend
