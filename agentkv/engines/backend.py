"""`EngineBackend`: sessions whose KV lives in a served engine (vLLM + LMCache).

The counterpart of `TransformersBackend` for a model served elsewhere: the same
session table API (`session`, `get`, `fork`, `close`, `apply`), the same config
(with an `engine:` block), the same lifecycle per session. The backend only needs
the model's tokenizer (to build the prompts as token ids) and its KV size per token.

With `engine.admission_tokens`, an `AdmissionGate` lets only as many conversations call
as whose working sets fit the engine's cache (the others wait their turn), and the pin
planner serves the residents first.

Routing is sticky: every session of this backend lands on one LMCache instance (the
first the coordinator lists), because deletes and prefetches act on one instance.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from agentkv.backend.registry import SessionRegistry
from agentkv.config import AgentKVConfig
from agentkv.config_engine import EngineConfig
from agentkv.engines.admission import AdmissionGate
from agentkv.engines.http import EngineError, Transport
from agentkv.engines.lmcache import CoordinatorClient
from agentkv.engines.planner import EnginePinPlanner
from agentkv.engines.session import EngineSession
from agentkv.engines.store import EngineTarget
from agentkv.engines.vllm import VLLMClient
from agentkv.templates import ChatFormat

logger = logging.getLogger("agentkv.engines")


def kv_bytes_per_token(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """Engine KV bytes of one token: layers x (K, V) x KV heads x head dim x dtype bytes.

    vLLM serves a float32 checkpoint in bfloat16 on CPU (2 bytes), as on most GPUs.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes)


class EngineBackend(SessionRegistry[EngineSession]):
    """Sessions over a served model.

    Args:
        tokenizer: the served model's tokenizer (prompts are sent as its token ids).
        config: agentkv settings; `config.engine` names the engine (required).
        bytes_per_token: engine KV bytes per token (`kv_bytes_per_token(model_dir)`).
        transport: how requests are sent (a `FakeTransport` in tests); None = urllib.
    """

    def __init__(
        self,
        tokenizer: Any,
        config: AgentKVConfig,
        *,
        bytes_per_token: int,
        model_path: str | None = None,
        max_positions: int | None = None,
        transport: Transport | None = None,
    ) -> None:
        if config.engine is None:
            msg = "EngineBackend: expected a config with an `engine:` block (vllm_url, ...), got none"
            raise ValueError(msg)
        engine: EngineConfig = config.engine
        super().__init__()
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_format = ChatFormat(
            tokenizer,
            tool_format=self.config.chat.tool_format,
            template_kwargs=self.config.chat.template_kwargs,
        )
        self.bytes_per_token = bytes_per_token
        self.max_positions = max_positions
        """Positions the served model supports (None = not declared)."""
        self.model_path = engine.model_path or model_path or engine.served_model
        self.vllm = VLLMClient(
            engine.vllm_url, engine.served_model, timeout=engine.request_timeout_s, transport=transport
        )
        self.coordinator = (
            None
            if engine.coordinator_url is None
            else CoordinatorClient(
                engine.coordinator_url, self.model_path, timeout=engine.hint_timeout_s, transport=transport
            )
        )
        self.planner = (
            None
            if engine.fleet_pin_budget_tokens is None
            else EnginePinPlanner(engine.fleet_pin_budget_tokens, engine.chunk_size)
        )
        """The fleet's pin planner (`engine.fleet_pin_budget_tokens`), shared by every session."""
        self.gate = (
            None
            if engine.admission_tokens is None
            else AdmissionGate(
                engine.admission_tokens,
                quantum_turns=engine.admission_quantum_turns,
                wait_s=engine.admission_wait_s,
                tool_ttl_s=engine.admission_tool_ttl_s,
                park_ttl_s=engine.admission_park_ttl_s,
                on_change=None if self.planner is None else self.planner.prioritize,
            )
        )
        """Load control by working set (`engine.admission_tokens`): who may call now; None = everyone."""
        self._target: EngineTarget | None = None
        self._target_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: AgentKVConfig) -> EngineBackend:
        """Build from a config alone: the tokenizer and KV size come from the served model's directory."""
        from transformers import AutoTokenizer

        from agentkv.models import converted_model_dir

        if config.engine is None:
            msg = "EngineBackend.from_config: expected a config with an `engine:` block, got none"
            raise ValueError(msg)
        model_dir = config.engine.model_path or str(converted_model_dir())
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        declared = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        return cls(
            tokenizer,
            config,
            bytes_per_token=kv_bytes_per_token(model_dir),
            model_path=model_dir,
            max_positions=declared.get("max_position_embeddings"),
        )

    # -- the engine ----------------------------------------------------------------------------

    def salt_for(self, session_id: str) -> str:
        """The `cache_salt` of a conversation (`engine.salt`), behind `engine.salt_prefix`."""
        prefix = self.engine.salt_prefix
        return prefix if self.engine.salt == "shared" else f"{prefix}{session_id}"

    def target(self) -> EngineTarget | None:
        """The LMCache instance this backend's sessions use (sticky); None without a coordinator.

        Resolved on first use; a coordinator that does not answer yet means no hints
        for now (logged), and the next session asks again.
        """
        if self.coordinator is None:
            return None
        with self._target_lock:
            if self._target is None:
                try:
                    instances = self.coordinator.instances()
                except EngineError as e:
                    logger.warning("LMCache coordinator unavailable (%s); this session runs without hints", e)
                    return None
                if not instances:
                    logger.warning("no LMCache server registered with the coordinator; no hints for now")
                    return None
                instance_id = sorted(instances)[0]
                self._target = EngineTarget(
                    self.coordinator,
                    instance_id,
                    instances[instance_id],
                    chunk_size=self.engine.chunk_size,
                    prefetch_wait=self.engine.prefetch_wait_s,
                    pin_budget_tokens=self.engine.pin_budget_tokens,
                    planner=self.planner,
                )
            return self._target

    # -- session table ---------------------------------------------------------------------------

    def _new_session(
        self,
        session_id: str,
        *,
        parent: EngineSession | None,
        branch: str | None,
        config: AgentKVConfig | None,
    ) -> EngineSession:
        return EngineSession(self, session_id, parent=parent, branch=branch, config=config)

    def sole_holder(self, session: EngineSession) -> bool:
        """Whether `session` is the only live session on its `cache_salt` (never with `engine.salt: shared`).

        Only then are the salt's pins all its own, so references its books do not list
        (left by a timed-out pin) can be given back without taking another holder's.
        """
        if self.engine.salt == "shared":
            return False
        return not any(
            other is not session and not other.closed and other.cache_salt == session.cache_salt
            for other in self.sessions()
        )

    def device_bytes(self) -> int:
        """Engine KV bytes of every session's prompt (what the global budget counts)."""
        return sum(s.store.bytes_by_tier().device for s in self.sessions() if not s.closed)
