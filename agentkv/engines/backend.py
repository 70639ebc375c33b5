"""`EngineBackend`: sessions whose KV lives in a served engine (vLLM + LMCache).

The counterpart of `TransformersBackend` for a model served elsewhere: the same
session table API (`session`, `get`, `fork`, `close`, `apply`), the same config
(with an `engine:` block), the same lifecycle per session. The backend only needs
the model's tokenizer (to build the prompts as token ids) and its KV size per token.

With `engine.admission_tokens`, an `AdmissionGate` lets only as many conversations call
as whose working sets fit the engine's cache (the others wait their turn), and the pin
planner serves the residents first.

With several vLLM URLs (`engine.vllm_url: [...]`) the backend drives a fleet that shares
one LMCache (server, coordinator, L2): `EngineFleet` routes each call (sticky threads,
least-loaded new ones, failover when an engine stops answering). Hints go to one LMCache
instance (the first the coordinator lists), because deletes and prefetches act on one
instance: the one every engine of the fleet connects to.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentkv.backend.registry import SessionRegistry
from agentkv.config import AgentKVConfig
from agentkv.config_engine import EngineConfig
from agentkv.engines.admission import AdmissionGate
from agentkv.engines.fleet import EngineFleet, EngineLoad, Route
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
        vllm_urls: the fleet's vLLM servers, in place of `config.engine.vllm_url` (None = the config's).
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
        vllm_urls: Sequence[str] | None = None,
    ) -> None:
        if config.engine is None:
            msg = "EngineBackend: expected a config with an `engine:` block (vllm_url, ...), got none"
            raise ValueError(msg)
        engine: EngineConfig = config.engine
        if vllm_urls is not None:
            engine = EngineConfig.model_validate({**engine.model_dump(), "vllm_url": list(vllm_urls)})
            config = config.model_copy(update={"engine": engine})
        super().__init__()
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_format = ChatFormat(
            tokenizer,
            tool_format=self.config.chat.tool_format,
            template_kwargs=self.config.chat.template_kwargs,
            template=self.config.chat.template,
        )
        self.bytes_per_token = bytes_per_token
        self.max_positions = max_positions
        """Positions the served model supports (None = not declared)."""
        self.model_path = engine.model_path or model_path or engine.served_model
        self.fleet = EngineFleet(
            [
                VLLMClient(url, engine.served_model, timeout=engine.request_timeout_s, transport=transport)
                for url in engine.urls
            ],
            down_after_failures=engine.down_after_failures,
            health_interval_s=engine.health_interval_s,
        )
        """The vLLM servers and where each call goes (one engine = a fleet of one)."""
        self.vllm = self.fleet.engines[0].client
        """The first engine's client (the only one with a single `vllm_url`)."""
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
        self._warned: set[str] = set()
        self._route_lock = threading.Lock()

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

    def salt_for(self, session_id: str, *, share: bool = True) -> str:
        """The `cache_salt` of a conversation (`engine.salt`), behind `engine.salt_prefix`.

        `share=False` (the session's `prefix_cache.enabled: false`) gives it its own salt
        even under `salt: shared`: it shares no prefix with other conversations.
        """
        prefix = self.engine.salt_prefix
        return prefix if self.engine.salt == "shared" and share else f"{prefix}{session_id}"

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

    def route(self, session: Any, exclude: Sequence[int] = ()) -> Route:
        """Where `session`'s next call goes (`EngineFleet.route` over the loads the lifecycle knows).

        One decision at a time, and the session is placed on its engine within it: threads
        that start together see each other's placement (they spread instead of all taking
        the engine that looked least loaded to each of them).
        """
        self.fleet.check_health()
        parent = session.parent
        near = parent.engine_index if parent is not None and session.engine_index is None else None
        with self._route_lock:
            route = self.fleet.route(
                session.engine_index, self.engine_loads(), exclude=exclude, near=near, check=False
            )
            session.engine_index = route.engine
        return route

    def engine_loads(self) -> list[EngineLoad]:
        """Each engine's load: calls in flight, working-set tokens and live conversations placed there.

        A conversation's working set is the admission gate's figure when the gate holds it,
        else the sequence of its last call.
        """
        tokens = [0] * len(self.fleet)
        placed = [0] * len(self.fleet)
        for session in self.sessions():
            index = session.engine_index
            if session.closed or index is None:
                continue
            held = None if self.gate is None else self.gate.working_set(session.conversation_id)
            tokens[index] += len(session.engine_sequence) if held is None else held
            placed[index] += 1
        return [EngineLoad(self.fleet.in_flight(i), tokens[i], placed[i]) for i in range(len(self.fleet))]

    # -- session table ---------------------------------------------------------------------------

    def _new_session(
        self,
        session_id: str,
        *,
        parent: EngineSession | None,
        branch: str | None,
        config: AgentKVConfig | None,
    ) -> EngineSession:
        if config is not None:
            self._warn_backend_wide(session_id, config)
        return EngineSession(self, session_id, parent=parent, branch=branch, config=config)

    def _warn_backend_wide(self, session_id: str, config: AgentKVConfig) -> None:
        """A session's config cannot change what only the backend decides: say so once per key.

        `prefix_cache.enabled: false` is applied (`salt_for`: the conversation shares no
        prefix); the other `prefix_cache` fields size the local backend's cache, which an
        engine does not have (vLLM's own prefix cache shares prefixes): warned, like the
        other backend-wide settings (`AgentKVConfig.backend_wide_changes`).
        """
        mine, theirs = self.config.prefix_cache, config.prefix_cache
        ignored = [
            key
            for key in config.backend_wide_changes(self.config)
            if not key.startswith("agentkv.prefix_cache.")
        ]
        ignored += [
            f"agentkv.prefix_cache.{name}"
            for name in type(mine).model_fields
            if name != "enabled" and getattr(mine, name) != getattr(theirs, name)
        ]
        fresh = [key for key in ignored if key not in self._warned]
        if fresh:
            self._warned.update(fresh)
            logger.warning(
                "session %r: %s in its config ignored: backend-wide on an engine backend "
                "(give them to the EngineBackend's config)",
                session_id,
                ", ".join(fresh),
            )

    def adopt(self, session_id: str, branch: str) -> EngineSession:
        """Make the branch session `<session_id>/<branch>` the conversation's continuation.

        As `TransformersBackend.adopt`: the branch's spans are committed (`BranchSelected`),
        its siblings closed, the thread's old session closed, and the branch takes the
        thread's id. It stays on the engine it ran on (a fleet's branches may spread);
        the old session gives back its pins and deletes what it wrote except the branch's
        sequence, which the conversation goes on with.

        Raises:
            UnknownSessionError: no such thread or branch session.
            ValueError: the branch session is not a branch of `session_id`.
        """
        return self._adopt_branch(
            session_id, branch, lambda parent, child: parent.close(spare=[child.store.sent])
        )

    def sole_holder(self, session: EngineSession) -> bool:
        """Whether `session` is the only live session on its `cache_salt` (never with `engine.salt: shared`).

        Only then are the salt's pins all its own, so references its books do not list
        (left by a timed-out pin) can be given back without taking another holder's.
        """
        if self.engine.salt == "shared" and session.cache_salt == self.engine.salt_prefix:
            return False
        return not any(
            other is not session and not other.closed and other.cache_salt == session.cache_salt
            for other in self.sessions()
        )

    def device_bytes(self) -> int:
        """Engine KV bytes of every session's prompt (what the global budget counts)."""
        return sum(s.store.bytes_by_tier().device for s in self.sessions() if not s.closed)
