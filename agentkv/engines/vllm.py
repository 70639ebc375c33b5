"""A small client for vLLM's OpenAI-compatible server: completions on token ids, metrics.

agentkv keeps the logical token sequence itself (the span table), so it sends the
engine **token ids**, never text: the prompt the engine sees is exactly the attended
spans, and an assistant message the model produced is sent back with the ids it
produced (re-tokenising text can change ids at boundaries). Two request fields carry
lifecycle information:
- `cache_salt`: one per conversation; branches of a conversation share it, so a fork
  reuses the parent's prefix blocks without copying (vLLM mixes the salt into the
  first block's hash: different salts never share KV).
- `kv_transfer_params`: passed through to the KV connector (LMCache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentkv.engines.http import EngineRequestError, Transport, UrllibTransport, call, checked_endpoint


@dataclass(frozen=True)
class Completion:
    """One completion: the generated text and ids, and the engine's own token counts."""

    text: str
    token_ids: tuple[int, ...]
    """Generated ids when the server returned them (`return_token_ids`), else empty."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the engine served from its prefix cache (usage.prompt_tokens_details)."""
    completion_tokens: int
    finish_reason: str | None


@dataclass(frozen=True)
class EngineMetrics:
    """Counters scraped from vLLM's Prometheus `/metrics` (totals since the server started)."""

    prompt_tokens: float
    """Prompt tokens of all requests (computed + served from a cache)."""
    prefix_cache_queries: float
    """Tokens looked up in vLLM's own (GPU) prefix cache."""
    prefix_cache_hits: float
    """Tokens found there."""
    external_queries: float
    """Tokens looked up in the KV connector (LMCache)."""
    external_hits: float
    """Tokens the connector served."""
    computed_tokens: float
    """Prompt tokens the engine actually prefilled (`prompt_tokens_by_source{source="local_compute"}`)."""

    def minus(self, before: EngineMetrics) -> EngineMetrics:
        """The counters accumulated since `before`."""
        return EngineMetrics(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))


_METRIC_NAMES = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "computed_tokens": 'vllm:prompt_tokens_by_source_total{source="local_compute"}',
}


def parse_metrics(text: str) -> EngineMetrics:
    """Sum each counter over its label sets in a Prometheus text exposition."""
    totals = dict.fromkeys(_METRIC_NAMES, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}") if rest else ("", "", name.split()[-1])
        name = name.split()[0]
        for field_name, metric in _METRIC_NAMES.items():
            metric_name, _, wanted = metric.partition("{")
            if name != metric_name or (wanted and wanted.rstrip("}") not in labels):
                continue
            try:
                totals[field_name] += float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return EngineMetrics(**totals)


class VLLMClient:
    """vLLM's OpenAI server at `url` serving `model` (the name the server was started with).

    Args:
        url: base URL, e.g. `http://127.0.0.1:8000`.
        model: the served model name (vLLM's `--served-model-name`, default its path).
        timeout: seconds per request (a completion on a loaded CPU can take a while).
        transport: how requests are sent (a `FakeTransport` in tests).
    """

    def __init__(
        self, url: str, model: str, *, timeout: float = 120.0, transport: Transport | None = None
    ) -> None:
        self.url = checked_endpoint(url, "vLLM", timeout)
        self.model = model
        self.timeout = timeout
        self.transport: Transport = transport or UrllibTransport()

    def complete(
        self,
        prompt_token_ids: list[int],
        *,
        max_tokens: int = 64,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        stop: list[str] | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """Greedy completion of a prompt given as token ids.

        Raises:
            ValueError: empty prompt or `max_tokens < 1`.
            EngineUnavailableError: the server did not answer.
            EngineRequestError: it answered 4xx/5xx (the message quotes it).
        """
        if not prompt_token_ids:
            msg = "prompt_token_ids: expected at least one token, got an empty list"
            raise ValueError(msg)
        if max_tokens < 1:
            msg = f"max_tokens: expected >= 1, got {max_tokens}"
            raise ValueError(msg)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_token_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if stop:
            body["stop"] = stop
        if request_id is not None:
            body["request_id"] = request_id
        answer = call(self.transport, "POST", f"{self.url}/v1/completions", body, self.timeout)
        return _completion(answer, f"{self.url}/v1/completions")

    def metrics(self) -> EngineMetrics:
        """Scrape the prefix-cache counters from `/metrics`."""
        text = call(self.transport, "GET", f"{self.url}/metrics", None, self.timeout)
        if not isinstance(text, str):
            msg = f"GET {self.url}/metrics: expected Prometheus text, got {type(text).__name__}"
            raise EngineRequestError(msg, status=200, body=text)
        return parse_metrics(text)

    def health(self) -> bool:
        """True when `/health` answers 200 (never raises)."""
        try:
            self.check_health()
        except Exception:  # noqa: BLE001 (a health probe reports, it does not raise)
            return False
        return True

    def check_health(self) -> None:
        """Return when `/health` answers 200 within 5 s; else raise what went wrong.

        Raises:
            EngineUnavailableError: no answer (refused, dropped or timed out).
            EngineRequestError: an error status (the server is up but not healthy).
        """
        call(self.transport, "GET", f"{self.url}/health", None, min(self.timeout, 5.0))


def _completion(answer: Any, where: str) -> Completion:
    try:
        choice = answer["choices"][0]
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            text=str(choice.get("text", "")),
            token_ids=tuple(int(t) for t in (choice.get("token_ids") or ())),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            finish_reason=choice.get("finish_reason"),
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        msg = f"POST {where}: unexpected completion body {str(answer)[:300]} ({e!r})"
        raise EngineRequestError(msg, status=200, body=answer) from e
