"""Hints to a served engine: where they go, what was asked, and failures as logged no-ops.

Every request a session sends to LMCache (pin, unpin, delete, prefetch, lookup) is a
*hint*: an engine that is down, slow or answers 4xx makes it a logged no-op, counted in
`HintStats.hint_failures` and told to the session (`on_failure`), never an error for the
agent, because the prompt itself carries the whole truth.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentkv.engines.http import EngineError
from agentkv.engines.lmcache import CoordinatorClient
from agentkv.engines.planner import EnginePinPlanner

logger = logging.getLogger("agentkv.engines")


@dataclass(frozen=True)
class EngineTarget:
    """One served engine as a session sees it: the coordinator, the LMCache server it lands on, units.

    Attributes:
        coordinator: the LMCache coordinator client (pins, lookup, prefetch, deletes).
        instance_id: the LMCache server this session's requests are routed to (sticky).
        instance_url: that server's own HTTP API (key-addressed deletes).
        chunk_size: LMCache's chunk size in tokens (pins and deletes act on whole chunks).
        prefetch_wait: seconds to wait for a prefetch to complete before the next call.
        pin_budget_tokens: most tokens one conversation pins (None = its L2 quota, if any).
        planner: the fleet's pin planner, shared by the backend's sessions (None = each
            conversation pins within its own budget only).
    """

    coordinator: CoordinatorClient
    instance_id: str
    instance_url: str
    chunk_size: int = 256
    prefetch_wait: float = 5.0
    pin_budget_tokens: int | None = None
    planner: EnginePinPlanner | None = None


@dataclass
class HintStats:
    """What the store asked of the engine, and what failed (failures are logged no-ops)."""

    pins: int = 0
    unpins: int = 0
    deleted_chunks: int = 0
    prefetches: int = 0
    prefetch_completed: int = 0
    demoted_chunks: int = 0
    """L1 copies given up at turn end because L2 holds the chunk under this session's pin."""
    hint_failures: int = 0
    last_failure: str = ""
    retried_deletes: int = 0
    """Deletes skipped by a failed hint and sent again at a later sync."""
    reconciled_unpins: int = 0
    """References a timed-out pin (or unpin) left on the coordinator, found and given back."""
    moves: int = 0
    """Times the conversation moved to another engine of the fleet (its next sync prefetched)."""
    log: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class HintSender:
    """Sends one session's hints: an answer, or None (logged, counted, told) when the engine failed."""

    def __init__(
        self,
        cache_salt: str,
        stats: HintStats,
        on_failure: Callable[[str, Exception], None] | None = None,
    ) -> None:
        self.cache_salt = cache_salt
        self.stats = stats
        self.on_failure = on_failure

    def send(self, what: str, call: Callable[[], Any]) -> Any:
        """Send one hint; an engine error is a logged no-op (None), never the agent's problem."""
        try:
            answer = call()
        except (EngineError, ValueError) as e:
            self.failed(what, e)
            return None
        self.stats.log.append((what, {"answer": answer}))
        return answer if answer is not None else True

    def failed(self, what: str, error: Exception) -> None:
        """Count and log a hint the engine did not take, and tell the session."""
        self.stats.hint_failures += 1
        self.stats.last_failure = f"{what}: {error}"
        logger.warning("engine hint %s for salt %r skipped: %s", what, self.cache_salt, error)
        if self.on_failure is not None:
            self.on_failure(what, error)
