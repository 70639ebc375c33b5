"""Served engines behind the same lifecycle: vLLM + LMCache over HTTP (see docs/scale-out.md).

`EngineBackend` is the counterpart of `TransformersBackend`: the same sessions, events,
rules and budgets, with "where KV lives" carried out by the engine (`EngineStore`);
`AdmissionGate` decides which conversations may call while the cache cannot hold them all;
`EngineFleet` routes the calls over several vLLM servers sharing one LMCache.
"""

from agentkv.engines.admission import Admission, AdmissionGate, AdmissionStats
from agentkv.engines.backend import EngineBackend, kv_bytes_per_token
from agentkv.engines.fleet import EngineFleet, EngineLoad, FleetStats, Route
from agentkv.engines.http import (
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    FakeTransport,
    UrllibTransport,
)
from agentkv.engines.lmcache import CoordinatorClient, Lookup
from agentkv.engines.session import EngineSession
from agentkv.engines.store import EngineStore, EngineTarget
from agentkv.engines.vllm import Completion, EngineMetrics, VLLMClient

__all__ = [
    "Admission",
    "AdmissionGate",
    "AdmissionStats",
    "Completion",
    "CoordinatorClient",
    "EngineBackend",
    "EngineError",
    "EngineFleet",
    "EngineLoad",
    "EngineMetrics",
    "EngineRequestError",
    "EngineSession",
    "EngineStore",
    "EngineTarget",
    "EngineUnavailableError",
    "FakeTransport",
    "FleetStats",
    "Lookup",
    "Route",
    "UrllibTransport",
    "VLLMClient",
    "kv_bytes_per_token",
]
