"""agentkv: KV-cache lifecycle middleware for agents on local Transformers models."""

from agentkv.backend import SamplingParams, TransformersBackend, UnknownSessionError
from agentkv.backend.contracts import ExtendResult, SessionClosedError
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

Backend = TransformersBackend | EngineBackend
"""Either backend: the integrations take both (same sessions API, same lifecycle)."""
AnySession = Session | EngineSession
"""A session of either backend."""

__version__ = "0.1.0"

__all__ = [
    "AgentKVConfig",
    "AnySession",
    "Backend",
    "ApplyResult",
    "BranchOpened",
    "BranchPruned",
    "BranchSelected",
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
