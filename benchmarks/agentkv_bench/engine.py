"""`agentkv bench engine`: concurrent tool agents on vLLM + LMCache, with and without lifecycle hints.

N agent threads each play one of the shipped workloads (`benchmarks/agentkv_bench/workloads/`) as
a tool agent: per turn the user message, its tool calls and results, one model call
(the engine decodes a few tokens), the tool events, the scripted answer, `TurnEnded`.
Every thread has its own conversation (its own `cache_salt`). The engine's caches are
meant to be smaller than the working set (`scripts/serve.sh` with `AGENTKV_VLLM_BLOCKS`
and a small `AGENTKV_L1_GB`; `--l2-quota-gb` caps LMCache's L2 per conversation, or
`--fleet-l2-gb` gives the whole fleet one L2 budget: every conversation of a run shares
that run's salt, whose quota is then fleet-wide, and the events mode's planner pins whole
committed histories of as many conversations as fit in it (`engine.fleet_pin_budget_tokens`)).

Modes, run one after the other on the same stack, each from cold caches:

- `vllm`: vLLM prefix caching alone. Not a separate run: every prompt token that vLLM's
  own cache did not hold would be computed, so its computed tokens are the `lru` run's
  prompt tokens minus its local prefix-cache hits (vLLM's own counters).
- `lru`: vLLM + LMCache with no hints: the whole history every call (policy `full`, no
  budget), LMCache evicting least-recently-used chunks.
- `events`: the **same prompts** as `lru` (policy `full`: no span leaves the prompt), with
  agentkv's lifecycle telling LMCache where KV should live: commits pin the committed
  prefix within the conversation's pin budget (its L2 quota), stale tails (the generated
  answer the scripted one replaces) are deleted, a conversation that ended its turn gives
  up its L1 copy of what L2 keeps pinned, and its next call prefetches it back first.
  Answers must equal `lru`'s: only where KV lives differs.
- `events-gated` (optional, `modes=`): `events` behind an admission gate
  (`engine.admission_tokens`, `agentkv.engines.admission`): only as many conversations
  call as whose working sets fit the cache (by default the fleet L2 budget); the others
  wait their turn, and pins go to the residents first. Same prompts, same answers; the
  waits count in its latency (reported apart as well).
- `events+budget` (optional, `modes=`): the default lifecycle rules and a device budget
  also decide the prompt (released and archived spans leave it), so prompts and answers
  differ from `lru`; it shows what the budget adds on top.

Figures come from the engine itself (vLLM `/metrics`: prompt tokens by source, local and
LMCache hits; the coordinator's `/instances/usage`: bytes per tier). Latency is the wall
time of each call with a few new tokens (close to TTFT on this model; the machine is
shared, so compare ratios, not seconds).
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agentkv.config import AgentKVConfig
from agentkv.engines.backend import EngineBackend, kv_bytes_per_token
from agentkv.engines.http import FakeTransport
from agentkv.engines.lmcache import GIB, CoordinatorClient
from agentkv.engines.store import common_prefix as _common_prefix
from agentkv.engines.vllm import EngineMetrics
from agentkv.events import ToolCallCompleted, ToolCallFailed, TurnEnded
from agentkv_bench.workloads import Workload, load_workloads

MODES: tuple[str, ...] = ("vllm", "lru", "events", "events-gated", "events+budget")
RUN_MODES: tuple[str, ...] = ("lru", "events", "events-gated", "events+budget")


@dataclass(frozen=True)
class EngineBenchSettings:
    """What every mode of one `agentkv bench engine` run uses (the CLI flags of the same names)."""

    vllm_url: str
    coordinator_url: str
    threads: int = 8
    """Concurrent agents (1..64)."""
    turns: int = 4
    max_tokens: int = 8
    """Tokens each answer may generate."""
    chunk_size: int = 64
    """LMCache's chunk, in tokens."""
    device_tokens: int = 768
    """The device budget of `events+budget`."""
    l2_quota_gb: float | None = None
    """LMCache's L2 quota per conversation (or `fleet_l2_gb`, not both)."""
    fleet_l2_gb: float | None = None
    """One L2 budget for the whole fleet: every conversation shares the run's salt."""
    admission_tokens: int | None = None
    """The admission gate's capacity (`events-gated`); None = the fleet's L2 in tokens."""
    admission_quantum_turns: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.threads <= 64:
            msg = f"threads: expected 1..64, got {self.threads}"
            raise ValueError(msg)
        if self.l2_quota_gb is not None and self.fleet_l2_gb is not None:
            msg = (
                "l2_quota_gb (per conversation) and fleet_l2_gb (one for all): expected one of them, got both"
            )
            raise ValueError(msg)
        if self.fleet_l2_gb is not None and self.fleet_l2_gb <= 0:
            msg = f"fleet_l2_gb: expected > 0, got {self.fleet_l2_gb}"
            raise ValueError(msg)


@dataclass
class ModeResult:
    """One mode's figures (totals over every call of every thread)."""

    mode: str
    requests: int
    seconds: float
    prompt_tokens: float
    computed_tokens: float
    """Prompt tokens the engine prefilled (neither vLLM's cache nor LMCache had them)."""
    local_hits: float
    lmcache_hits: float
    latency_p50: float
    latency_p95: float
    requests_per_s: float
    lmcache_bytes: dict[str, int] = field(default_factory=dict)
    """LMCache bytes per tier after the run (`l1` CPU memory; `l2` storage this run added)."""
    engine_device_bytes: int = 0
    """vLLM's own KV cache capacity (bytes), the same in every mode."""
    answers: dict[str, str] = field(default_factory=dict)
    hint_failures: int = 0
    hints: dict[str, int] = field(default_factory=dict)
    """What the sessions asked of LMCache: pins, deleted / demoted chunks, prefetches completed."""
    wait_p50: float = 0.0
    wait_p95: float = 0.0
    """Seconds calls waited for residency (events-gated; included in the latencies above)."""
    gate: dict[str, float] = field(default_factory=dict)
    """The admission gate's counters (`AdmissionStats`), events-gated only."""


def _tool_agent(
    backend: EngineBackend, session_id: str, workload: Workload, turns: int, max_tokens: int
) -> tuple[dict[str, str], list[float], list[float]]:
    """Play one workload as a tool agent: the generated text per turn, each call's latency and wait.

    A call's latency includes its wait for residency at the admission gate (0 without one).
    """
    session = backend.session(session_id)
    history: list[dict[str, Any]] = [{"role": "system", "content": workload.system}]
    answers: dict[str, str] = {}
    latencies: list[float] = []
    waits: list[float] = []
    for t, turn in enumerate(workload.turns[:turns]):
        history.append({"role": "user", "content": turn.user})
        events: list[Any] = []
        for j, tool in enumerate(turn.tools):
            call_id = f"call_{t}_{j}"
            call = {"id": call_id, "name": tool.name, "args": dict(tool.args)}
            history.append({"role": "assistant", "content": "", "tool_calls": [call]})
            history.append({"role": "tool", "content": tool.result, "tool_call_id": call_id})
            events.append(ToolCallFailed(tool_call_id=call_id) if tool.failed else ToolCallCompleted(call_id))
        session.extend(history)
        started = time.perf_counter()
        answers[f"{session_id.rsplit('-', 1)[-1]}:{t}"] = session.generate(max_tokens)
        latencies.append(time.perf_counter() - started)
        waits.append(0.0 if session.last_admission is None else session.last_admission.waited_s)
        for event in events:
            session.apply(event)
        scripted = [p.text for p in turn.proposals] + ([turn.assistant] if turn.assistant else [])
        history.extend({"role": "assistant", "content": text} for text in scripted)
        session.extend(history)  # the scripted answer replaces the generated one: same history in every mode
        session.apply(TurnEnded())
    return answers, latencies, waits


def _mode_config(
    mode: str,
    settings: EngineBenchSettings,
    *,
    fleet_salt: str | None = None,
    fleet_pin_tokens: int | None = None,
) -> AgentKVConfig:
    engine: dict[str, Any] = {
        "vllm_url": settings.vllm_url,
        "chunk_size": settings.chunk_size,
        "request_timeout_s": 900.0,
    }
    if fleet_salt is not None:  # one L2 budget for the fleet: every conversation shares the run's salt
        engine = {**engine, "salt": "shared", "salt_prefix": fleet_salt}
    hinted = {**engine, "coordinator_url": settings.coordinator_url}
    if fleet_pin_tokens is not None:
        hinted["fleet_pin_budget_tokens"] = fleet_pin_tokens
    if mode == "events":  # same prompts as lru: the lifecycle only decides where KV lives
        return AgentKVConfig.model_validate({"engine": hinted, "policy": "full"})
    if mode == "events-gated":  # and only the conversations whose working sets fit call
        if settings.admission_tokens is None:
            msg = "events-gated: expected admission_tokens (or fleet_l2_gb, its default), got none"
            raise ValueError(msg)
        gated = {
            **hinted,
            "admission_tokens": settings.admission_tokens,
            "admission_quantum_turns": settings.admission_quantum_turns,
            "admission_wait_s": 1800.0,  # the bench measures the gate: a wait should not time out
        }
        return AgentKVConfig.model_validate({"engine": gated, "policy": "full"})
    if mode == "events+budget":
        budget = {"device_tokens": settings.device_tokens}
        return AgentKVConfig.model_validate({"engine": hinted, "budget": budget})
    if mode != "lru":
        msg = f"mode: expected one of {', '.join(RUN_MODES)}, got {mode!r}"
        raise ValueError(msg)
    return AgentKVConfig.model_validate({"engine": engine, "policy": "full"})


def _reset(backend: EngineBackend, coordinator: CoordinatorClient) -> None:
    """Cold caches: vLLM's prefix cache and LMCache's L1 (each mode also has its own salts)."""
    request = urllib.request.Request(f"{backend.vllm.url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=120):  # noqa: S310 (local stack)
        pass
    for url in coordinator.instances().values():
        coordinator.clear_l1(url)


def run_mode(
    mode: str,
    settings: EngineBenchSettings,
    *,
    fleet_l2_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModeResult:
    """Run one mode once, from cold caches (`fleet_l2_tokens`: one L2 budget for all)."""
    nonce = time.strftime("%H%M%S")
    config = _mode_config(
        mode,
        settings,
        fleet_salt=None if fleet_l2_tokens is None else f"{mode}-{nonce}",
        fleet_pin_tokens=fleet_l2_tokens,
    )
    backend = EngineBackend.from_config(config)
    # The LMCache stack is there in both modes; only the events mode sends it hints.
    coordinator = CoordinatorClient(settings.coordinator_url, backend.model_path)
    _reset(backend, coordinator)
    workloads = load_workloads()
    before = backend.vllm.metrics()
    usage_before = coordinator.usage()  # L2 still holds earlier runs' conversations (their own salts)
    started = time.perf_counter()
    answers: dict[str, str] = {}
    latencies: list[float] = []
    waits: list[float] = []
    lock = threading.Lock()

    def agent(i: int) -> None:
        session_id = f"{mode}-{nonce}-{i}"
        workload = workloads[i % len(workloads)]
        got, took, waited = _tool_agent(backend, session_id, workload, settings.turns, settings.max_tokens)
        if backend.gate is not None:  # the conversation is over: its place goes to the next in line
            backend.gate.release(session_id)  # (the session stays open until the end, as in every mode)
        with lock:
            answers.update(got)
            latencies.extend(took)
            waits.extend(waited)
        if progress is not None:
            progress(f"{mode}: agent {i} done")

    with ThreadPoolExecutor(max_workers=settings.threads) as pool:
        list(pool.map(agent, range(settings.threads)))
    seconds = time.perf_counter() - started
    delta: EngineMetrics = backend.vllm.metrics().minus(before)
    after = coordinator.usage()
    # L1 was emptied before the run: all of it is this run's. L2 is fleet-wide: this run's share
    # is what it added.
    usage = {"l1": after.get("l1", 0), "l2": max(0, after.get("l2", 0) - usage_before.get("l2", 0))}
    stores = [s.store.stats for s in backend.sessions()]
    failures = sum(st.hint_failures for st in stores)
    hints = {
        name: sum(getattr(st, name) for st in stores)
        for name in ("pins", "unpins", "deleted_chunks", "demoted_chunks", "prefetch_completed")
    }
    for session in list(backend.sessions()):
        backend.close(session.session_id)
    ordered = sorted(latencies)
    gate = {} if backend.gate is None else {k: float(v) for k, v in asdict(backend.gate.stats).items()}
    return ModeResult(
        mode=mode,
        requests=len(latencies),
        seconds=seconds,
        prompt_tokens=delta.prompt_tokens,
        computed_tokens=delta.computed_tokens,
        local_hits=delta.prefix_cache_hits,
        lmcache_hits=delta.external_hits,
        latency_p50=statistics.median(ordered) if ordered else 0.0,
        latency_p95=_quantile(latencies, 0.95),
        requests_per_s=len(latencies) / seconds if seconds else 0.0,
        lmcache_bytes=usage,
        engine_device_bytes=_device_capacity(backend),
        answers=answers,
        hint_failures=failures,
        hints=hints,
        wait_p50=_quantile(waits, 0.5),
        wait_p95=_quantile(waits, 0.95),
        gate=gate,
    )


def _quantile(values: list[float], q: float) -> float:
    """The `q` quantile by rank (the bench's p95 convention); 0 for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _device_capacity(backend: EngineBackend) -> int:
    """VLLM's KV cache capacity in bytes (blocks x block size x bytes per token; 0 when not exposed)."""
    try:
        with urllib.request.urlopen(f"{backend.vllm.url}/metrics", timeout=60) as response:  # noqa: S310
            text = response.read().decode()
    except OSError:
        return 0
    blocks = re.search(r'num_gpu_blocks="(\d+)"', text)
    block = re.search(r'block_size="(\d+)"', text)
    if not (blocks and block):
        return 0
    return int(blocks.group(1)) * int(block.group(1)) * backend.bytes_per_token


def vllm_alone(lru: ModeResult) -> ModeResult:
    """VLLM prefix caching alone, from the `lru` run: what LMCache served would have been computed."""
    return ModeResult(
        mode="vllm",
        requests=lru.requests,
        seconds=lru.seconds,
        prompt_tokens=lru.prompt_tokens,
        computed_tokens=lru.prompt_tokens - lru.local_hits,
        local_hits=lru.local_hits,
        lmcache_hits=0.0,
        latency_p50=float("nan"),
        latency_p95=float("nan"),
        requests_per_s=float("nan"),
        engine_device_bytes=lru.engine_device_bytes,
        answers=lru.answers,
    )


def prefill_floor(*, threads: int, turns: int, max_tokens: int, chunk_size: int) -> int:
    """Prefill tokens no cache policy can avoid on this workload (the bench's own prompts).

    Replays the agents against a recording stand-in for vLLM (no server): each call could
    at best reuse the whole chunks its conversation's previous sequence shares with its
    prompt; everything else is computed whatever the caches hold.
    """
    sent: dict[str, list[list[int]]] = {}
    produced = [0] * max_tokens  # what the model says does not matter: the scripted answer replaces it

    def complete(_method: str, _path: str, body: Any) -> Any:
        sent.setdefault(str(body.get("cache_salt")), []).append(list(body["prompt"]))
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": max_tokens}
        return {"choices": [{"text": "", "token_ids": produced, "finish_reason": "length"}], "usage": usage}

    config = AgentKVConfig.model_validate(
        {"engine": {"vllm_url": "http://replay.invalid", "chunk_size": chunk_size}, "policy": "full"}
    )
    real = EngineBackend.from_config(config)  # the served model's tokenizer and KV size
    backend = EngineBackend(
        real.tokenizer,
        config,
        bytes_per_token=real.bytes_per_token,
        transport=FakeTransport(routes={"POST /v1/completions": complete}),
    )
    workloads = load_workloads()
    for i in range(threads):
        _tool_agent(backend, f"floor-{i}", workloads[i % len(workloads)], turns, max_tokens)
    floor = 0
    for prompts in sent.values():
        previous: list[int] = []
        for prompt in prompts:
            shared = _common_prefix(previous, prompt) // chunk_size * chunk_size
            floor += len(prompt) - shared
            previous = prompt + produced
    return floor


def run_engine_bench(
    settings: EngineBenchSettings,
    *,
    out_dir: str | Path = "runs",
    modes: tuple[str, ...] = ("lru", "events"),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `lru` and the other `modes` and write `engine_bench.json`; returns the summary."""
    unknown = [m for m in modes if m not in RUN_MODES]
    if unknown:
        msg = f"modes: expected some of {', '.join(RUN_MODES)}, got {', '.join(unknown)}"
        raise ValueError(msg)
    fleet_l2_tokens: int | None = None
    if settings.fleet_l2_gb is not None:
        from agentkv.models import converted_model_dir

        fleet_l2_tokens = int(settings.fleet_l2_gb * GIB) // kv_bytes_per_token(converted_model_dir())
    if settings.admission_tokens is None:  # the gate's default capacity: the L2 the fleet's pins may hold
        settings = replace(settings, admission_tokens=fleet_l2_tokens)
    if "events-gated" in modes and settings.admission_tokens is None:
        msg = "modes: events-gated needs admission_tokens or fleet_l2_gb (its default), got neither"
        raise ValueError(msg)
    quota = settings.l2_quota_gb if settings.fleet_l2_gb is None else settings.fleet_l2_gb
    if quota is not None:  # a run's shared salt: fleet-wide
        CoordinatorClient(settings.coordinator_url, "-").set_default_quota(quota)
    lru = run_mode("lru", settings, fleet_l2_tokens=fleet_l2_tokens, progress=progress)
    others = [
        run_mode(m, settings, fleet_l2_tokens=fleet_l2_tokens, progress=progress) for m in modes if m != "lru"
    ]
    rows = [vllm_alone(lru), lru, *others]
    summary: dict[str, Any] = {
        "settings": {
            **{k: v for k, v in asdict(settings).items() if not k.endswith("_url")},
            "fleet_pin_budget_tokens": fleet_l2_tokens,
        },
        "modes": [asdict(m) for m in rows],
        "prefill_floor": prefill_floor(
            threads=settings.threads,
            turns=settings.turns,
            max_tokens=settings.max_tokens,
            chunk_size=settings.chunk_size,
        ),
    }
    for other in others:
        same = sum(other.answers.get(k) == v for k, v in lru.answers.items())
        summary[f"computed_ratio_lru_over_{other.mode}"] = lru.computed_tokens / max(
            1.0, other.computed_tokens
        )
        summary[f"computed_ratio_vllm_over_{other.mode}"] = rows[0].computed_tokens / max(
            1.0, other.computed_tokens
        )
        summary[f"answers_identical_{other.mode}"] = f"{same}/{len(lru.answers)}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_bench.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary
