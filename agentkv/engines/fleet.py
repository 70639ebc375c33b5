"""`EngineFleet`: several vLLM servers over one LMCache, with sticky routing and failover.

Every engine of a fleet connects to the same LMCache server (and so the same
coordinator and L2): a conversation's KV lives there, not in one engine's memory, so
any engine can continue it by loading its prefix instead of recomputing it. The fleet
decides which engine a call goes to (`route`), in one place:

- A thread **sticks** to its engine while that engine is up (vLLM's own prefix cache
  is warm there).
- A **new thread**, and a `Send` branch's first call, go to the **least-loaded** up
  engine by what the lifecycle knows: calls in flight, then the working-set tokens of
  the conversations placed there (the admission gate's figure when it holds one),
  then how many conversations are placed there. A branch breaks ties towards its
  parent's engine (the shared prefix is warm there); branches may spread.
- An engine that stops answering is marked **down**: a refused or dropped connection
  at once, timeouts after `down_after_failures` in a row, a failed health check the
  same way. The calls of its threads go to the least-loaded up engine (**failover**);
  a call that failed on it is sent again there, so no call fails while another engine
  is up. With every engine down, a call still tries them (one may be back).
- Health checks (`/health`, every `health_interval_s`, made by the calls themselves:
  no thread of ours) bring a down engine back: new threads use it again.

One engine is the fleet of one: routing is always "sticky" and no health check is sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from agentkv.engines.http import EngineError, EngineUnavailableError
from agentkv.engines.vllm import VLLMClient

logger = logging.getLogger("agentkv.engines")

T = TypeVar("T")

RouteReason = Literal["sticky", "least-loaded", "branch", "failover", "adopted", "all-down"]
"""Why a call went where it went (`Route.reason`)."""


@dataclass(frozen=True)
class EngineLoad:
    """What the lifecycle knows of one engine's load (compared in this order; lower = less loaded)."""

    calls: int
    """Model calls in flight there now."""
    tokens: int
    """Working-set tokens of the live conversations placed there."""
    sessions: int
    """Live conversations placed there."""

    def key(self) -> tuple[int, int, int]:
        """The order `route` picks the least-loaded engine by."""
        return (self.calls, self.tokens, self.sessions)


@dataclass(frozen=True)
class Route:
    """Where one call goes and why (`session.stats().engine` / `.route`)."""

    engine: int
    """Index of the engine in the fleet (the order of `engine.vllm_url`)."""
    url: str
    reason: RouteReason
    detail: str
    moved_from: int | None = None
    """The engine the thread was on before, when this route moves it."""


@dataclass
class FleetEngine:
    """One engine of the fleet and what the fleet knows of its health."""

    index: int
    client: VLLMClient
    up: bool = True
    failures: int = 0
    """Unanswered requests in a row (reset by an answer)."""
    in_flight: int = 0
    last_error: str = ""
    checked_at: float = float("-inf")

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return self.client.url


@dataclass
class FleetStats:
    """What happened to the fleet: engines marked down and back, calls sent again elsewhere."""

    marked_down: int = 0
    came_back: int = 0
    failovers: int = 0
    """Calls that failed on one engine and were sent again to another."""
    moves: int = 0
    """Threads moved to another engine (their sticky engine was down)."""
    health_checks: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)
    """`(monotonic seconds, what)` of every down / back, in order."""


class EngineFleet:
    """The engines of one backend, their health, and where each call goes.

    Args:
        clients: one `VLLMClient` per engine, in the order of `engine.vllm_url`.
        down_after_failures: timed-out requests in a row that mark an engine down.
        health_interval_s: seconds between health checks of an engine.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        clients: Sequence[VLLMClient],
        *,
        down_after_failures: int = 2,
        health_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not clients:
            msg = "clients: expected at least one vLLM client, got none"
            raise ValueError(msg)
        if down_after_failures < 1:
            msg = f"down_after_failures: expected >= 1, got {down_after_failures}"
            raise ValueError(msg)
        self.engines = [FleetEngine(i, c) for i, c in enumerate(clients)]
        self.down_after_failures = down_after_failures
        self.health_interval_s = health_interval_s
        self.clock = clock
        self.stats = FleetStats()
        self._lock = threading.Lock()
        self._checking = False

    def __len__(self) -> int:
        return len(self.engines)

    def up(self) -> list[int]:
        """Indices of the engines marked up."""
        with self._lock:
            return [e.index for e in self.engines if e.up]

    # -- routing ---------------------------------------------------------------------------------

    def route(
        self,
        current: int | None,
        loads: Sequence[EngineLoad],
        *,
        exclude: Sequence[int] = (),
        near: int | None = None,
        check: bool = True,
    ) -> Route:
        """Where the next call of a conversation on `current` (None = not placed yet) goes.

        Args:
            current: the conversation's engine, None for its first call.
            loads: each engine's load, by index.
            exclude: engines this call already failed on.
            near: for a branch's first call, its parent's engine (preferred on a tie).
            check: run the due health checks first (`check_health`); False when the caller did.

        Raises:
            EngineUnavailableError: every engine is excluded.
        """
        if len(loads) != len(self.engines):
            msg = f"loads: expected one per engine ({len(self.engines)}), got {len(loads)}"
            raise ValueError(msg)
        if check:
            self.check_health()
        with self._lock:
            if current is not None and current not in exclude and self.engines[current].up:
                return Route(current, self.engines[current].url, "sticky", "its engine is up")
            candidates = [e for e in self.engines if e.up and e.index not in exclude]
            reason: RouteReason
            if candidates:
                if current is not None:
                    reason = "failover"
                else:
                    reason = "branch" if near is not None else "least-loaded"
            else:  # nothing up: try one marked down (it may be back) rather than fail untried
                candidates = [e for e in self.engines if e.index not in exclude]
                reason = "all-down"
            if not candidates:
                tried = ", ".join(f"{e.url} ({e.last_error or 'down'})" for e in self.engines)
                msg = f"no engine of the fleet answered: {tried}"
                raise EngineUnavailableError(msg)
            chosen = min(candidates, key=lambda e: (*loads[e.index].key(), e.index != near, e.index))
            detail = ", ".join(
                f"engine {e.index}: {loads[e.index].calls} in flight, {loads[e.index].tokens} tokens, "
                f"{loads[e.index].sessions} conversations"
                for e in candidates
            )
            moved_from = None
            if current is not None and current != chosen.index:
                moved_from = current
                self.stats.moves += 1
                down = self.engines[current]
                detail = f"engine {current} down ({down.last_error or 'failed'}); {detail}"
            return Route(chosen.index, chosen.url, reason, detail, moved_from)

    # -- calls -----------------------------------------------------------------------------------

    def call(self, index: int, request: Callable[[VLLMClient], T]) -> T:
        """Send `request` to engine `index`, counting it in flight; its outcome is the engine's health.

        Raises:
            EngineUnavailableError: the engine did not answer (counted: maybe marked down).
            EngineRequestError: it answered with an error (the engine is up).
        """
        engine = self.engines[index]
        with self._lock:
            engine.in_flight += 1
        try:
            answer = request(engine.client)
        except EngineUnavailableError as e:
            self.failed(index, e)
            raise
        finally:
            with self._lock:
                engine.in_flight -= 1
        self.answered(index)
        return answer

    def in_flight(self, index: int) -> int:
        """Calls in flight on engine `index`."""
        with self._lock:
            return self.engines[index].in_flight

    def failed(self, index: int, error: EngineUnavailableError) -> bool:
        """Engine `index` did not answer; True when that marks it down (refused, or too many timeouts)."""
        with self._lock:
            engine = self.engines[index]
            engine.failures += 1
            engine.last_error = str(error)[:200]
            if engine.up and (error.refused or engine.failures >= self.down_after_failures):
                engine.up = False
                self.stats.marked_down += 1
                self.stats.events.append((self.clock(), f"engine {index} down: {engine.last_error}"))
                logger.warning("engine %d (%s) marked down: %s", index, engine.url, error)
            return not engine.up

    def answered(self, index: int) -> None:
        """Engine `index` answered: it is up (back, if it was down)."""
        with self._lock:
            engine = self.engines[index]
            engine.failures = 0
            if not engine.up:
                engine.up = True
                self.stats.came_back += 1
                self.stats.events.append((self.clock(), f"engine {index} back"))
                logger.warning("engine %d (%s) is back", index, engine.url)

    def check_health(self, *, force: bool = False) -> None:
        """Probe the engines not checked for `health_interval_s` (one caller at a time; never raises).

        A fleet of one is never probed: its calls tell its health.
        """
        if len(self.engines) < 2:
            return
        now = self.clock()
        with self._lock:
            if self._checking:
                return
            due = [e for e in self.engines if force or now - e.checked_at >= self.health_interval_s]
            if not due:
                return
            self._checking = True
            for engine in due:
                engine.checked_at = now
        try:
            for engine in due:
                self.stats.health_checks += 1
                try:
                    engine.client.check_health()
                except EngineUnavailableError as e:
                    self.failed(engine.index, e)
                except EngineError as e:  # it answers, but not healthy: one more failure
                    self.failed(engine.index, EngineUnavailableError(str(e)))
                else:
                    self.answered(engine.index)
        finally:
            with self._lock:
                self._checking = False
