"""agentkv: KV-cache lifecycle middleware for agents on local Transformers models.

The public names below load on first use (PEP 562): `import agentkv` alone imports
neither torch nor transformers, so the `agentkv` command answers `--help` at once
and a subcommand imports only what it runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and the import graph
    from agentkv.backend import SamplingParams, TransformersBackend, UnknownSessionError
    from agentkv.backend.contracts import ContextLengthError, ExtendResult, SessionClosedError
    from agentkv.backend.public import AgentBackend, AgentSession
    from agentkv.backend.session import Session
    from agentkv.config import AgentKVConfig
    from agentkv.engines import EngineBackend, EngineSession
    from agentkv.events import (
        BranchOpened,
        BranchPruned,
        BranchSelected,
        Custom,
        Event,
        SessionClosed,
        ToolCallCompleted,
        ToolCallFailed,
        TurnEnded,
        UserConfirmed,
        UserRejected,
    )
    from agentkv.lifecycle import ApplyResult, Lease, Transition
    from agentkv.metrics import SessionStats
    from agentkv.models import load_model
    from agentkv.spans import Span, SpanKind, SpanState, Tier

    Backend = AgentBackend
    AnySession = AgentSession

    def _one_protocol(  # mypy holds both runners to the one protocol here
        local: TransformersBackend, engine: EngineBackend, session: Session, engine_session: EngineSession
    ) -> tuple[AgentBackend, AgentBackend, AgentSession, AgentSession]:
        return local, engine, session, engine_session


_HOMES = {
    "agentkv.backend": ("SamplingParams", "TransformersBackend", "UnknownSessionError"),
    "agentkv.backend.contracts": ("ContextLengthError", "ExtendResult", "SessionClosedError"),
    "agentkv.backend.public": ("AgentBackend", "AgentSession"),
    "agentkv.backend.session": ("Session",),
    "agentkv.config": ("AgentKVConfig",),
    "agentkv.engines": ("EngineBackend", "EngineSession"),
    "agentkv.events": (
        "BranchOpened",
        "BranchPruned",
        "BranchSelected",
        "Custom",
        "Event",
        "SessionClosed",
        "ToolCallCompleted",
        "ToolCallFailed",
        "TurnEnded",
        "UserConfirmed",
        "UserRejected",
    ),
    "agentkv.lifecycle": ("ApplyResult", "Lease", "Transition"),
    "agentkv.metrics": ("SessionStats",),
    "agentkv.models": ("load_model",),
    "agentkv.spans": ("Span", "SpanKind", "SpanState", "Tier"),
}
"""Module → the public names it defines (each public name has one home)."""
_ALIASES = {"Backend": "AgentBackend", "AnySession": "AgentSession"}
"""`Backend`: either backend (`TransformersBackend`, `EngineBackend`), one protocol, the same
sessions API; `AnySession`: a session of either (`Session`, `EngineSession`)."""
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here."""
    target = _ALIASES.get(name, name)
    module = _HOME_OF.get(target)
    if module is None:
        msg = f"module 'agentkv' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), target)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "AgentBackend",
    "AgentSession",
    "AgentKVConfig",
    "AnySession",
    "Backend",
    "ApplyResult",
    "BranchOpened",
    "BranchPruned",
    "BranchSelected",
    "ContextLengthError",
    "Custom",
    "EngineBackend",
    "EngineSession",
    "Event",
    "ExtendResult",
    "Lease",
    "SamplingParams",
    "Session",
    "SessionClosed",
    "SessionClosedError",
    "SessionStats",
    "Span",
    "SpanKind",
    "SpanState",
    "Tier",
    "ToolCallCompleted",
    "ToolCallFailed",
    "Transition",
    "TransformersBackend",
    "TurnEnded",
    "UnknownSessionError",
    "UserConfirmed",
    "UserRejected",
    "__version__",
    "load_model",
]
