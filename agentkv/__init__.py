"""agentkv: KV-cache lifecycle middleware for agents on local Transformers models."""

from typing import TYPE_CHECKING

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
"""Either backend (`TransformersBackend`, `EngineBackend`): one protocol, the same sessions API."""
AnySession = AgentSession
"""A session of either backend (`Session`, `EngineSession`): one protocol, the same lifecycle."""

if TYPE_CHECKING:  # mypy holds both runners to the one protocol here

    def _one_protocol(
        local: TransformersBackend, engine: EngineBackend, session: Session, engine_session: EngineSession
    ) -> tuple[AgentBackend, AgentBackend, AgentSession, AgentSession]:
        return local, engine, session, engine_session


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
