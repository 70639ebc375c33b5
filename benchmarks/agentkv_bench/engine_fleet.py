"""`agentkv bench engine --engines N`: the same tool agents on one engine and on a fleet, and a failover.

The stack is a fleet started with `AGENTKV_ENGINES=N bash scripts/serve.sh start`: engine
i serves on the vLLM port + i, every engine connects to the one LMCache server (one
coordinator, one L2). Three runs, one after the other, each from cold caches (every
engine's prefix cache reset, LMCache's L1 emptied) and with its own salts:

- `1 engine`: the agents on engine 0 alone (the `events` mode: hints on, policy `full`).
- `N engines`: the same agents on the fleet (`EngineFleet`: sticky threads, least-loaded
  placement).
- `failover`: the fleet again; once `kill_after` calls have been answered, engine N-1 is
  killed (`serve.sh kill-engine`: SIGKILL to its process group, a crash that cuts its
  calls in flight); its threads move to the others, a cut call is sent again there.
  Afterwards the engine is started again and a new thread must land on it (the fleet's
  health check picks it up).

Figures per run: prompt and recomputed (prefilled) tokens from the engines' own usage of
every call (robust to an engine that dies: its `/metrics` go with it), vLLM and LMCache
hits from `/metrics` (the stopped engine's read just before the stop), latency p50 / p95,
prefetches completed (L2 -> L1 loads of parked or moved histories), the L2 bytes the
run added. The failover run adds: calls that failed (goal 0), for each moved thread its
first call after the move (prompt, recomputed, and the floor: the tokens outside the
whole chunks of its previous sequence, which no cache could hold), and the seconds from
the stop to the first answer after it (of any thread, and of a moved thread).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentkv.config import AgentKVConfig
from agentkv.engines.backend import EngineBackend
from agentkv.engines.lmcache import CoordinatorClient
from agentkv.engines.store import common_prefix
from agentkv.engines.vllm import EngineMetrics, VLLMClient
from agentkv_bench.engine import EngineBenchSettings, _quantile, _tool_agent
from agentkv_bench.workloads import load_workloads

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class FleetBenchSettings:
    """The engine bench's settings plus the fleet's (the CLI flags of the same names)."""

    base: EngineBenchSettings
    engines: int = 2
    kill_after: int | None = None
    """Answered calls before the failover run stops an engine; None = half of the run's calls."""
    engine_run: str = "runs/engine"
    """serve.sh's run directory of the stack (`AGENTKV_ENGINE_RUN`): where the engines' pids are."""
    restart: bool = True
    """Start the stopped engine again after the failover run and check a new thread lands on it."""

    def __post_init__(self) -> None:
        if self.engines < 2:
            msg = f"engines: expected >= 2 (a fleet), got {self.engines}"
            raise ValueError(msg)
        if self.kill_after is not None and self.kill_after < 1:
            msg = f"kill_after: expected >= 1 answered calls, got {self.kill_after}"
            raise ValueError(msg)


def engine_urls(vllm_url: str, engines: int) -> list[str]:
    """Engine i at the port of `vllm_url` + i (the serve.sh scheme)."""
    parts = urllib.parse.urlsplit(vllm_url)
    if parts.port is None or parts.hostname is None:
        msg = f"vllm_url: expected a URL with a host and a port, got {vllm_url!r}"
        raise ValueError(msg)
    return [f"{parts.scheme}://{parts.hostname}:{parts.port + i}" for i in range(engines)]


@dataclass
class MovedCall:
    """A moved thread's first call after its move."""

    thread: str
    from_engine: int
    to_engine: int
    prompt_tokens: int
    recomputed_tokens: int
    floor_tokens: int
    """Tokens outside the whole chunks of the thread's previous sequence: no cache could hold them."""
    seconds_after_stop: float


@dataclass
class FleetRun:
    """One run's figures (totals over every call of every thread)."""

    name: str
    engines: int
    requests: int
    failed_calls: int
    seconds: float
    prompt_tokens: int
    computed_tokens: int
    """Prompt tokens the engines prefilled (their own usage: prompt - cached, per call)."""
    local_hits: float
    lmcache_hits: float
    latency_p50: float
    latency_p95: float
    requests_per_s: float
    prefetches: int
    l2_bytes: int
    calls_per_engine: dict[int, int] = field(default_factory=dict)
    moved: list[MovedCall] = field(default_factory=list)
    stop_seconds: float = 0.0
    """How long killing the engine took (SIGKILL until its process group was gone)."""
    first_answer_after_stop_s: float | None = None
    first_moved_answer_after_stop_s: float | None = None
    fleet: dict[str, Any] = field(default_factory=dict)
    restarted_engine_used: bool | None = None
    restart_seconds: float = 0.0


class _Calls:
    """What every answered call did, per thread: tokens, engine, moves (filled from the agents' threads)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk = chunk_size
        self.lock = threading.Lock()
        self.per_engine: dict[int, int] = {}
        self.answered = 0
        self.stopped_at: float | None = None
        self.first_after_stop: float | None = None
        self.first_moved_after_stop: float | None = None
        self.moved: list[MovedCall] = []
        self._seen: dict[str, tuple[int, int, int, list[int]]] = {}
        """Thread -> (prefill, generated, moves, sequence) after its last call."""
        self.on_answer: Callable[[int], None] | None = None

    def __call__(self, session: Any, latency: float) -> None:
        del latency
        now = time.perf_counter()
        c = session.counters
        with self.lock:
            prefill, generated, moves, previous = self._seen.get(session.session_id, (0, 0, 0, []))
            sequence = list(session.engine_sequence)
            self._seen[session.session_id] = (c.prefill_tokens, c.generated_tokens, c.engine_moves, sequence)
            engine = session.engine_index
            self.per_engine[engine] = self.per_engine.get(engine, 0) + 1
            self.answered += 1
            answered = self.answered
            if self.stopped_at is not None and now > self.stopped_at:
                if self.first_after_stop is None:
                    self.first_after_stop = now - self.stopped_at
                if c.engine_moves > moves:
                    prompt = sequence[: len(sequence) - (c.generated_tokens - generated)]
                    shared = common_prefix(previous, prompt) // self.chunk * self.chunk
                    route = session.last_route
                    self.moved.append(
                        MovedCall(
                            thread=session.session_id,
                            from_engine=-1 if route is None or route.moved_from is None else route.moved_from,
                            to_engine=engine,
                            prompt_tokens=len(prompt),
                            recomputed_tokens=c.prefill_tokens - prefill,
                            floor_tokens=len(prompt) - shared,
                            seconds_after_stop=now - self.stopped_at,
                        )
                    )
                    if self.first_moved_after_stop is None:
                        self.first_moved_after_stop = now - self.stopped_at
        if self.on_answer is not None:
            self.on_answer(answered)


def _config(settings: EngineBenchSettings, urls: list[str]) -> AgentKVConfig:
    engine = {
        "vllm_url": urls if len(urls) > 1 else urls[0],
        "coordinator_url": settings.coordinator_url,
        "chunk_size": settings.chunk_size,
        "request_timeout_s": 900.0,
        "health_interval_s": 2.0,
    }
    return AgentKVConfig.model_validate({"engine": engine, "policy": "full"})


def _reset(urls: list[str], coordinator: CoordinatorClient) -> None:
    """Cold caches: every engine's prefix cache and LMCache's L1."""
    import urllib.request

    for url in urls:
        request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=120):  # noqa: S310 (local stack)
            pass
    for url in coordinator.instances().values():
        coordinator.clear_l1(url)


def _serve(verb: str, index: int, settings: FleetBenchSettings) -> float:
    """`scripts/serve.sh <verb> <index>` on the bench's stack; the seconds it took."""
    env = {**os.environ, "AGENTKV_ENGINE_RUN": settings.engine_run, "AGENTKV_ENGINES": str(settings.engines)}
    port = urllib.parse.urlsplit(settings.base.vllm_url).port
    env["AGENTKV_VLLM_PORT"] = str(port)
    started = time.perf_counter()
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "serve.sh"), verb, str(index)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        msg = f"scripts/serve.sh {verb} {index} failed: {done.stderr[-2000:]}"
        raise RuntimeError(msg)
    return time.perf_counter() - started


def run_fleet(
    name: str,
    settings: FleetBenchSettings,
    urls: list[str],
    *,
    stop: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> FleetRun:
    """Run the agents once on `urls`, from cold caches; `stop`: the engine the failover stops."""
    base = settings.base
    backend = EngineBackend.from_config(_config(base, urls))
    coordinator = CoordinatorClient(base.coordinator_url, backend.model_path)
    _reset(urls, coordinator)
    clients = [e.client for e in backend.fleet.engines]
    before = [c.metrics() for c in clients]
    at_stop: dict[int, EngineMetrics] = {}
    usage_before = coordinator.usage()
    calls = _Calls(base.chunk_size)
    total = base.threads * base.turns
    kill_after = settings.kill_after or total // 2
    stopping = threading.Event()
    stopper: list[threading.Thread] = []
    stop_took: list[float] = []

    def stop_engine() -> None:
        assert stop is not None
        at_stop[stop] = clients[stop].metrics()
        stop_took.append(_serve("kill-engine", stop, settings))
        with calls.lock:
            calls.stopped_at = time.perf_counter()
        if progress is not None:
            progress(f"{name}: engine {stop} stopped after {kill_after} answered calls")

    def maybe_stop(answered: int) -> None:
        if stop is not None and answered >= kill_after and not stopping.is_set():
            stopping.set()
            worker = threading.Thread(target=stop_engine, name="stop-engine")
            stopper.append(worker)
            worker.start()

    calls.on_answer = maybe_stop
    workloads = load_workloads()
    latencies: list[float] = []
    failed: list[str] = []
    lock = threading.Lock()
    nonce = time.strftime("%H%M%S")

    def agent(i: int) -> None:
        session_id = f"fleet-{name.replace(' ', '')}-{nonce}-{i}"
        try:
            _, took, _ = _tool_agent(
                backend, session_id, workloads[i % len(workloads)], base.turns, base.max_tokens, on_call=calls
            )
        except Exception as e:  # noqa: BLE001 - a failed call is a figure of this bench
            with lock:
                failed.append(f"{session_id}: {e!r}"[:300])
            return
        with lock:
            latencies.extend(took)
        if progress is not None:
            progress(f"{name}: agent {i} done")

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=base.threads) as pool:
        list(pool.map(agent, range(base.threads)))
    seconds = time.perf_counter() - started
    for worker in stopper:
        worker.join()
    deltas = [(at_stop[i] if i in at_stop else c.metrics()).minus(before[i]) for i, c in enumerate(clients)]
    usage = coordinator.usage()
    sessions = list(backend.sessions())
    prompt = sum(s.counters.prefill_tokens + s.counters.reused_tokens for s in sessions)
    computed = sum(s.counters.prefill_tokens for s in sessions)
    run = FleetRun(
        name=name,
        engines=len(urls),
        requests=len(latencies),
        failed_calls=len(failed),
        seconds=seconds,
        prompt_tokens=prompt,
        computed_tokens=computed,
        local_hits=sum(d.prefix_cache_hits for d in deltas),
        lmcache_hits=sum(d.external_hits for d in deltas),
        latency_p50=statistics.median(latencies) if latencies else 0.0,
        latency_p95=_quantile(latencies, 0.95),
        requests_per_s=len(latencies) / seconds if seconds else 0.0,
        prefetches=sum(s.store.stats.prefetch_completed for s in sessions),
        l2_bytes=max(0, usage.get("l2", 0) - usage_before.get("l2", 0)),
        calls_per_engine=dict(sorted(calls.per_engine.items())),
        moved=calls.moved,
        stop_seconds=stop_took[0] if stop_took else 0.0,
        first_answer_after_stop_s=calls.first_after_stop,
        first_moved_answer_after_stop_s=calls.first_moved_after_stop,
        fleet={k: v for k, v in asdict(backend.fleet.stats).items() if k != "events"},
    )
    for message in failed:
        if progress is not None:
            progress(f"{name}: failed: {message}")
    if stop is not None and settings.restart:
        run.restart_seconds = _serve("start-engine", stop, settings)
        backend.fleet.check_health(force=True)
        fresh = backend.session(f"fleet-returned-{nonce}")
        fresh.extend([{"role": "user", "content": "Say hello."}])
        fresh.generate(4)
        run.restarted_engine_used = fresh.engine_index == stop
    for session in list(backend.sessions()):
        backend.close(session.session_id)
    return run


def run_fleet_bench(
    settings: FleetBenchSettings,
    *,
    out_dir: str | Path = "runs",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One engine, the fleet, the failover; writes `engine_fleet.json` and returns the summary."""
    import json

    base = settings.base
    urls = engine_urls(base.vllm_url, settings.engines)
    for url in urls:
        if not VLLMClient(url, "-").health():
            msg = f"engine {url} does not answer: start the fleet with AGENTKV_ENGINES={settings.engines}"
            raise RuntimeError(msg)
    if base.l2_quota_gb is not None:
        CoordinatorClient(base.coordinator_url, "-").set_default_quota(base.l2_quota_gb)
    one = run_fleet("1 engine", settings, urls[:1], progress=progress)
    many = run_fleet(f"{settings.engines} engines", settings, urls, progress=progress)
    failover = run_fleet("failover", settings, urls, stop=settings.engines - 1, progress=progress)
    runs = [one, many, failover]
    summary: dict[str, Any] = {
        "settings": {
            **{k: v for k, v in asdict(base).items() if not k.endswith("_url")},
            "engines": settings.engines,
            "kill_after": settings.kill_after or base.threads * base.turns // 2,
        },
        "runs": [asdict(r) for r in runs],
        "computed_ratio_fleet_over_one": many.computed_tokens / max(1, one.computed_tokens),
        "p50_ratio_fleet_over_one": many.latency_p50 / one.latency_p50 if one.latency_p50 else None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_fleet.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary
