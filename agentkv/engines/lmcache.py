"""A small client for the LMCache coordinator's REST control plane (LMCache >= 0.5, MP mode).

Routes and bodies as served by `lmcache coordinator` (read from its source,
`lmcache/v1/mp_coordinator/http_apis/*.py` and `controllers/eviction_http_api.py`):

| call | route | notes |
|---|---|---|
| pin / unpin | `POST` / `DELETE /cache/pins` | L2 eviction protection, counted per chunk key |
| pin table | `GET /cache/pins?cache_salt=...` | each pinned key with its count, paged |
| delete | `POST /cache/delete` | on one instance; tier l1 / l2 / all; pins hold unless `force` |
| prefetch | `POST /cache/prefetches` | warm L1 from L2 on one instance; then poll |
| prefetch status | `GET /cache/prefetches/{instance}/{request}` | `pending` / `completed` |
| lookup | `POST /directory/lookup` | placements (instance, tier, bytes) of each chunk key |
| instances | `GET /instances` | registered LMCache servers |
| L2 budget | `GET /quota/{salt}`, `GET /quota/config` | per-salt L2 quota, else the default |

Every body names a token sequence **from position 0** (`token_ids`), the model
(`model_name`: vLLM's model path) and `world_size`; keys are prefix-chained chunk
hashes, so a mid-sequence slice names different keys, and a trailing partial chunk
names none. Pins are fleet-wide per salt and only served when the coordinator runs
its eviction controller (the default). This module only speaks the protocol; what to send when is
`agentkv.engines.mapping`.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

from agentkv.engines.http import EngineRequestError, Transport, UrllibTransport, call, checked_endpoint

TierName = Literal["l1", "l2", "all"]
TIERS: tuple[str, ...] = ("l1", "l2", "all")
GIB = 1024**3
"""The coordinator's quota unit (`limit_gb` is GiB in LMCache's quota API)."""


@dataclass(frozen=True)
class ChunkPlacement:
    """Where one chunk of a looked-up sequence lives (empty `tiers` = nowhere)."""

    index: int
    tiers: tuple[str, ...]
    """Tiers holding it (`l1`, `l2`), one entry per placement."""
    sizes: tuple[int, ...]
    """Bytes of each placement, in the order of `tiers`."""
    keys: tuple[dict[str, Any], ...] = ()
    """The chunk's object keys (one per rank), in the wire form `DELETE /cache/objects` takes."""


@dataclass(frozen=True)
class Lookup:
    """Reply of `/directory/lookup` for one token sequence."""

    chunks: int
    placements: tuple[ChunkPlacement, ...]

    def held_chunks(self, tier: str | None = None) -> int:
        """Leading chunks held (on `tier`, or anywhere): what a prefix request could load."""
        count = 0
        for placement in self.placements:
            if not placement.tiers or (tier is not None and tier not in placement.tiers):
                break
            count += 1
        return count

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes per tier over all chunks (`l1`, `l2`)."""
        totals = {"l1": 0, "l2": 0}
        for placement in self.placements:
            for tier, size in zip(placement.tiers, placement.sizes, strict=True):
                totals[tier] = totals.get(tier, 0) + size
        return totals


@dataclass(frozen=True)
class OpResult:
    """Reply of pin / unpin / delete / prefetch: chunks named, keys affected, the server's status."""

    requested: int
    affected: int
    skipped: int
    status: str
    request_id: str = ""


class CoordinatorClient:
    """The coordinator at `url`, for one served model.

    Args:
        url: base URL, e.g. `http://127.0.0.1:9300`.
        model_name: the model as the LMCache server knows it (vLLM's model path).
        world_size: tensor-parallel world size of the engine (1 on one device).
        timeout: seconds per request; control calls are small and should be fast.
        transport: how requests are sent (a `FakeTransport` in tests).
    """

    def __init__(
        self,
        url: str,
        model_name: str,
        *,
        world_size: int = 1,
        timeout: float = 10.0,
        transport: Transport | None = None,
    ) -> None:
        self.url = checked_endpoint(url, "coordinator", timeout)
        if world_size < 1:
            msg = f"world_size: expected >= 1, got {world_size}"
            raise ValueError(msg)
        self.model_name = model_name
        self.world_size = world_size
        self.timeout = timeout
        self.transport: Transport = transport or UrllibTransport()

    def _body(self, token_ids: list[int], cache_salt: str) -> dict[str, Any]:
        if not token_ids:
            msg = "token_ids: expected the sequence from position 0, got an empty list"
            raise ValueError(msg)
        return {
            "model_name": self.model_name,
            "world_size": self.world_size,
            "token_ids": list(token_ids),
            "cache_salt": cache_salt,
        }

    def _call(self, method: str, path: str, body: Any | None) -> Any:
        return call(self.transport, method, f"{self.url}{path}", body, self.timeout)

    # -- control ---------------------------------------------------------------------------

    def pin(self, token_ids: list[int], cache_salt: str = "") -> OpResult:
        """Protect the sequence's complete chunks from L2 eviction (one reference per call)."""
        return _op(self._call("POST", "/cache/pins", self._body(token_ids, cache_salt)))

    def unpin(self, token_ids: list[int], cache_salt: str = "") -> OpResult:
        """Give back one reference on each of the sequence's chunks."""
        return _op(self._call("DELETE", "/cache/pins", self._body(token_ids, cache_salt)))

    def delete(
        self,
        instance_id: str,
        token_ids: list[int],
        cache_salt: str = "",
        *,
        tier: TierName = "all",
        force: bool = False,
    ) -> OpResult:
        """Delete the sequence's chunks on one instance (pinned L2 chunks survive unless `force`)."""
        if tier not in TIERS:
            msg = f"tier: expected one of {', '.join(TIERS)}, got {tier!r}"
            raise ValueError(msg)
        body = {**self._body(token_ids, cache_salt), "instance_id": instance_id, "tier": tier, "force": force}
        return _op(self._call("POST", "/cache/delete", body))

    def prefetch(self, instance_id: str, token_ids: list[int], cache_salt: str = "") -> OpResult:
        """Start bringing the sequence from L2 back into the instance's L1; returns its request id."""
        body = {**self._body(token_ids, cache_salt), "instance_id": instance_id}
        return _op(self._call("POST", "/cache/prefetches", body))

    def prefetch_status(self, instance_id: str, request_id: str) -> str:
        """`pending` or `completed` (the first `completed` poll forgets the job on the server)."""
        answer = self._call("GET", f"/cache/prefetches/{instance_id}/{request_id}", None)
        return str(answer.get("status", "")) if isinstance(answer, dict) else str(answer)

    def set_default_quota(self, limit_gb: float | None) -> None:
        """L2 byte budget per salt for salts without their own (None = exempt from L2 eviction)."""
        if limit_gb is not None and limit_gb < 0:
            msg = f"limit_gb: expected >= 0 or None, got {limit_gb}"
            raise ValueError(msg)
        self._call("PUT", "/quota/config", {"default_limit_gb": limit_gb, "tier": "l2"})

    def clear_l1(self, instance_url: str) -> None:
        """Empty one LMCache server's L1 (`POST /cache/clear` on its own API; benchmarks start cold)."""
        call(self.transport, "POST", f"{instance_url.rstrip('/')}/cache/clear", {"tier": "l1"}, self.timeout)

    def l2_limit_bytes(self, cache_salt: str) -> int | None:
        """The L2 byte budget that applies to `cache_salt` (its own quota, else the default; None = none).

        Pins are exempt from L2 eviction, so a session caps what it pins at this budget:
        pinned chunks never take more L2 than the conversation is allowed to hold.
        """
        salt = urllib.parse.quote(cache_salt or "_default", safe="")
        answer = self._call("GET", f"/quota/{salt}", None)
        if isinstance(answer, dict) and answer.get("quota_exists"):
            return int(float(answer.get("quota_limit_gb", 0) or 0) * GIB)
        config = self._call("GET", "/quota/config", None)
        limit = config.get("default_limit_gb") if isinstance(config, dict) else None
        return None if limit is None else int(float(limit) * GIB)

    def usage(self) -> dict[str, int]:
        """Bytes used per tier (`l1`, `l2`) over the fleet (`GET /instances/usage`)."""
        answer = self._call("GET", "/instances/usage", None)
        totals: dict[str, int] = {"l1": 0, "l2": 0}
        if not isinstance(answer, dict):
            return totals
        modules = [m for i in answer.get("instances") or [] for m in i.get("modules") or []]
        for module in [*modules, *(answer.get("shared_modules") or [])]:
            tier = str(module.get("tier", ""))
            totals[tier] = totals.get(tier, 0) + int(module.get("used_bytes", 0) or 0)
        return totals

    # -- inspection ------------------------------------------------------------------------

    def lookup(self, token_ids: list[int], cache_salt: str = "") -> Lookup:
        """Where each complete chunk of the sequence lives now."""
        answer = self._call("POST", "/directory/lookup", self._body(token_ids, cache_salt))
        return _lookup(answer, self.world_size)

    def pins(self, cache_salt: str = "") -> int:
        """Pinned chunk keys for this salt (all salts when empty)."""
        query = f"?cache_salt={cache_salt}&model_name={self.model_name}" if cache_salt else ""
        answer = self._call("GET", f"/cache/pins{query}", None)
        return int(answer.get("total", 0)) if isinstance(answer, dict) else 0

    def pin_counts(self, cache_salt: str, *, page: int = 1000) -> dict[tuple[str, int], int]:
        """The salt's pin table: `(chunk_hash_hex, kv_rank)` -> references, over every page."""
        counts: dict[tuple[str, int], int] = {}
        salt = urllib.parse.quote(cache_salt, safe="")
        model = urllib.parse.quote(self.model_name, safe="")
        offset = 0
        while True:
            path = f"/cache/pins?cache_salt={salt}&model_name={model}&offset={offset}&limit={page}"
            answer = self._call("GET", path, None)
            if not isinstance(answer, dict):
                msg = f"coordinator pins: expected a JSON object, got {str(answer)[:200]}"
                raise EngineRequestError(msg, status=200, body=answer)
            listed = answer.get("pins") or []
            for item in listed:
                key = item.get("key") or {}
                ident = (str(key.get("chunk_hash_hex", "")), int(key.get("kv_rank", 0) or 0))
                counts[ident] = counts.get(ident, 0) + int(item.get("pin_count", 0) or 0)
            offset += len(listed)
            if not listed or offset >= int(answer.get("total", 0) or 0):
                return counts

    def instances(self) -> dict[str, str]:
        """The registered LMCache servers: instance id -> the base URL of its own HTTP API."""
        answer = self._call("GET", "/instances", None)
        items = answer.get("instances", answer) if isinstance(answer, dict) else answer
        return {
            str(item["instance_id"]): f"http://{item.get('ip', '127.0.0.1')}:{item.get('http_port', 0)}"
            for item in items or []
            if isinstance(item, dict) and "instance_id" in item
        }

    def delete_chunks(
        self, instance_url: str, keys: list[dict[str, Any]], *, tier: TierName = "all", force: bool = False
    ) -> OpResult:
        """Delete chunks by key on one LMCache server (`DELETE /cache/objects` on its own API).

        The coordinator's `/cache/delete` names a whole sequence from position 0, so it
        would also delete the prefix a session keeps; this names only the stale chunks.
        """
        if tier not in TIERS:
            msg = f"tier: expected one of {', '.join(TIERS)}, got {tier!r}"
            raise ValueError(msg)
        if not keys:
            return OpResult(requested=0, affected=0, skipped=0, status="noop")
        body = {"keys": keys, "tier": tier, "force": force}
        answer = call(
            self.transport, "DELETE", f"{instance_url.rstrip('/')}/cache/objects", body, self.timeout
        )
        if not isinstance(answer, dict):
            msg = f"DELETE {instance_url}/cache/objects: expected a JSON object, got {str(answer)[:200]}"
            raise EngineRequestError(msg, status=200, body=answer)
        return OpResult(
            requested=len(keys),
            affected=int(answer.get("deleted", 0) or 0),
            skipped=int(answer.get("skipped", 0) or 0),
            status="deleted" if answer.get("ok", True) else str(answer.get("error", "error")),
        )

    def health(self) -> bool:
        """True when `/healthz` answers 200 (never raises)."""
        try:
            self._call("GET", "/healthz", None)
        except Exception:  # noqa: BLE001 (a health probe reports, it does not raise)
            return False
        return True


def _op(answer: Any) -> OpResult:
    if not isinstance(answer, dict):
        msg = f"coordinator: expected a JSON object, got {str(answer)[:200]}"
        raise EngineRequestError(msg, status=200, body=answer)
    return OpResult(
        requested=int(answer.get("requested", answer.get("chunks", 0)) or 0),
        affected=int(answer.get("affected", 0) or 0),
        skipped=int(answer.get("skipped", 0) or 0),
        status=str(answer.get("status", "")),
        request_id=str(answer.get("request_id", "") or ""),
    )


def _lookup(answer: Any, world_size: int) -> Lookup:
    if not isinstance(answer, dict):
        msg = f"coordinator lookup: expected a JSON object, got {str(answer)[:200]}"
        raise EngineRequestError(msg, status=200, body=answer)
    results = answer.get("results") or []
    chunks = int(answer.get("chunks", 0) or 0)
    # results: chunks x per-rank fan-out, in request order; fold the ranks of one chunk.
    fan_out = max(1, len(results) // chunks) if chunks else max(1, world_size)
    placements = []
    for index in range(chunks):
        tiers: list[str] = []
        sizes: list[int] = []
        keys: list[dict[str, Any]] = []
        for result in results[index * fan_out : (index + 1) * fan_out]:
            if isinstance(result.get("key"), dict):
                keys.append(result["key"])
            for placement in result.get("placements") or []:
                tiers.append(str(placement.get("tier", "")))
                sizes.append(int(placement.get("size_bytes", 0) or 0))
        placements.append(
            ChunkPlacement(index=index, tiers=tuple(tiers), sizes=tuple(sizes), keys=tuple(keys))
        )
    return Lookup(chunks=chunks, placements=tuple(placements))
