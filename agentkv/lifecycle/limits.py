"""Budget limits: the one place a budget becomes bytes and a watermark becomes a byte figure.

A token budget (`budget.device_tokens`, `budget.host_tokens`) counts **full-precision
token equivalents**: `N` tokens are `N` times the bytes one token's KV takes at the
model's dtype, all layers, keys and values (`SessionPort.bytes_per_token`). A token
held at int4 in attention or archived at int8 takes less, so more than `N` tokens
can be held under a budget of `N`. Everything that compares usage with a limit asks
this module (`high_bytes`, `low_bytes`, `over`), so the watermark arithmetic lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.config import BudgetConfig


@dataclass(frozen=True)
class BudgetLimits:
    """A session's budget in bytes (None = no limit), with its watermarks."""

    device_bytes: int | None
    """Per-session device limit: attended KV plus quantized archives."""
    host_bytes: int | None
    """Per-session limit on the host tier."""
    global_device_bytes: int | None
    """Device limit across every session of the backend."""
    high: float
    """Fraction of a limit at which demotion starts."""
    low: float
    """Fraction of a limit demotion brings usage back under."""
    token_bytes: int = 0
    """Bytes of one full-precision token (all layers, keys and values); 0 = unknown."""

    @staticmethod
    def resolve(budget: BudgetConfig, bytes_per_token: int) -> BudgetLimits:
        """Bytes for every limit; a tier given in tokens and in bytes gets the tighter of the two.

        `bytes_per_token`: one full-precision token's KV bytes, the unit of `device_tokens`
        and `host_tokens`.
        """
        device = _tighter(budget.device_bytes, budget.device_tokens, bytes_per_token)
        host = _tighter(budget.host_bytes, budget.host_tokens, bytes_per_token)
        return BudgetLimits(
            device_bytes=device,
            host_bytes=host,
            global_device_bytes=budget.global_device_bytes,
            high=budget.high_watermark,
            low=budget.low_watermark,
            token_bytes=bytes_per_token,
        )

    def high_bytes(self, limit: int) -> int:
        """The high watermark of `limit`: usage above it is over budget."""
        return int(limit * self.high)

    def low_bytes(self, limit: int) -> int:
        """The low watermark of `limit`: where demotion brings usage back to."""
        return int(limit * self.low)

    def over(self, usage: int, limit: int | None) -> bool:
        """Whether `usage` is over the high watermark of `limit` (never, without a limit)."""
        return limit is not None and usage > self.high_bytes(limit)

    def device_share(self, own_usage: int, backend_usage: int) -> int | None:
        """This session's device limit now: its own, lowered by its share of a global excess.

        Over the global high watermark, the session that is growing pays for the excess
        of all sessions: its limit becomes what it holds less the excess over the global
        low watermark.
        """
        limit = self.device_bytes
        global_limit = self.global_device_bytes
        if global_limit is not None and backend_usage > self.high_bytes(global_limit):
            share = max(0, own_usage - (backend_usage - self.low_bytes(global_limit)))
            limit = share if limit is None else min(limit, share)
        return limit

    def global_relief(self, backend_usage: int) -> int:
        """Bytes the backend frees first over the global high watermark (down to the low one); 0 under it."""
        limit = self.global_device_bytes
        if limit is None or backend_usage <= self.high_bytes(limit):
            return 0
        return backend_usage - self.low_bytes(limit)

    def in_tokens(self, nbytes: int) -> float:
        """`nbytes` in full-precision token equivalents (the unit of `device_tokens`)."""
        return nbytes / self.token_bytes if self.token_bytes else float("nan")

    def describe(self, nbytes: int) -> str:
        """`nbytes` for a message: bytes and full-precision token equivalents."""
        return f"{nbytes} B (= {self.in_tokens(nbytes):.0f} full-precision tokens)"


def _tighter(nbytes: int | None, tokens: int | None, bytes_per_token: int) -> int | None:
    """The smaller of a byte limit and a token limit in bytes (None where neither is set)."""
    limits = [nbytes, tokens * bytes_per_token if tokens else None]
    return min((limit for limit in limits if limit is not None), default=None)
