"""The cheap attention signal: the attention of the last W queries, read from the model's own call.

With SDPA (or flash) attention the model never materialises attention weights, and
asking for them (`output_attentions=True`) forces the slow eager path for the whole
forward. Attention-based policies (SnapKV, TOVA, H2O, lifecycle) only need the
attention of the *last few* queries, so `AttentionProbe` routes each layer's attention
call through a recorder (`attention_call.routed`): the recorder gets the query and key
the family itself computed — fused or split projections, q/k norms, full, partial,
interleaved or no RoPE — with the kernel's scaling, softcap and mask, and computes
`softmax` for the window rows only (`attention_weights.row_weights`), at a cost of
O(W·S) per layer instead of O(S²). No family's q/k path is re-derived here.

The probe is a context manager: the model is routed only inside the `with` block, so
a session pays for it only when a policy needs attention (commit time, budget
pressure), and on exit, exceptions included, every config has its kernel back and
`hook_count` is zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from types import TracebackType

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from torch import nn

from agentkv.policies.attention_call import AttentionCall, attention_modules, routed
from agentkv.policies.attention_weights import row_weights
from agentkv.policies.base import Policy

__all__ = ["AttentionProbe", "attention_modules", "attention_window", "needs_accumulated_attention"]


def attention_window(policy: Policy | None, default: int = 32) -> int:
    """How many trailing queries the session should probe for `policy`.

    A policy that cares declares a `window` attribute (SnapKV's observation window,
    TOVA's single last query); wrappers expose their parts through `inner` / `parts`.
    With several windows in one composition the largest wins: one probe run then
    serves every part (TOVA then sees a wider window than its paper's single query).
    """
    windows = [int(w) for p in _walk(policy) if isinstance(w := getattr(p, "window", None), int)]
    return max(windows) if windows else default


def needs_accumulated_attention(policy: Policy | None) -> bool:
    """Whether `policy` or any part of it reads H2O's accumulated attention (probe every query)."""
    return any(bool(getattr(p, "needs_accumulated_attention", False)) for p in _walk(policy))


def _walk(policy: object) -> Iterator[object]:
    if policy is None:
        return
    yield policy
    inner = getattr(policy, "inner", None)
    if inner is not None:
        yield from _walk(inner)
    for part in getattr(policy, "parts", ()):
        yield from _walk(part[0] if isinstance(part, tuple) else part)


class AttentionProbe:
    """Collects, per layer, the attention the last `window` queries of a forward pay to each cached slot.

    Usage::

        with AttentionProbe(model, window=32, keep_queries=True) as probe:
            model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        attention = probe.attention()  # [S] float32 CPU, mean over layers, heads, window queries
        queries = probe.query_states  # per layer [B, H_q, W, D] (model device)

    Each forward inside the block *replaces* the previous one's result for a layer:
    a chunked prefill leaves the attention of the last chunk's last W queries, which
    are the conversation's last W tokens. A forward shorter than `window` (one
    decode step) contributes only its own tokens as queries.

    Slots are the keys the layer's kernel received, in order: the layer's physical
    cache slots (shared prefix first, see `SharedPrefixLayer.full`), the forward's own
    tokens last. The mask is the kernel's (causal, windowed or logical), so what the
    probe reports equals eager attention's weights for those rows.
    """

    def __init__(
        self, model: nn.Module, window: int, *, keep_queries: bool = False, heavy: bool = False
    ) -> None:
        """Prepare a probe; nothing is attached until `__enter__`.

        Args:
            model: A transformers causal LM (or its decoder).
            window: W, how many trailing queries of each forward to score (>= 1).
            keep_queries: Also keep each layer's window queries (`query_states`), for
                intent scoring; off by default because they cost memory on the device.
            heavy: Also sum the attention of *every* query of every forward inside the
                block (`heavy_attention`), as H2O accumulates it. Costs about one more
                attention pass (computed in blocks of `HEAVY_BLOCK` queries).
        """
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            msg = f"AttentionProbe window must be an int >= 1, got {window!r}"
            raise ValueError(msg)
        self.model = model
        self.window = window
        self.keep_queries = keep_queries
        self.heavy = heavy
        self._stack: ExitStack | None = None
        self._routed = 0
        self._attention: dict[int, torch.Tensor] = {}
        self._heavy: dict[int, torch.Tensor] = {}
        self._queries: dict[int, torch.Tensor] = {}
        self.key_slots: dict[int, torch.Tensor] = {}
        """Per layer whose kernel gets a subset of the slots (a sliding layer holding only its
        window), the slot of each of its keys, `long [K]`: its weights are scattered onto the
        slots, the others get 0. Set by whoever runs the forward, before each call."""

    # -- attach / detach ----------------------------------------------------------------------

    def __enter__(self) -> AttentionProbe:
        if self._stack is not None:
            msg = "AttentionProbe is already attached; use one `with` block at a time"
            raise RuntimeError(msg)
        self._attention.clear()
        self._heavy.clear()
        self._queries.clear()
        stack = ExitStack()
        self._routed = len(stack.enter_context(routed(self.model, self._record)))
        self._stack = stack
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack, self._routed = self._stack, None, 0
        if stack is not None:
            stack.close()

    @property
    def hook_count(self) -> int:
        """Attention layers currently routed through this probe (0 outside the `with` block)."""
        return self._routed

    # -- results ------------------------------------------------------------------------------

    @property
    def layer_attention(self) -> dict[int, torch.Tensor]:
        """Per layer index, `[S]` float32 CPU attention each slot received.

        Averaged over batch, heads and window queries.
        """
        return dict(self._attention)

    def attention(self) -> torch.Tensor:
        """`[S]` float32 CPU: the per-layer attention averaged over layers (sums to ~1).

        Raises:
            RuntimeError: No forward ran inside the probe.
            ValueError: Layers hold different numbers of slots (sliding-window layers).
        """
        if not self._attention:
            msg = "AttentionProbe saw no forward; run the model inside the `with` block first"
            raise RuntimeError(msg)
        lengths = {int(a.numel()) for a in self._attention.values()}
        if len(lengths) != 1:
            msg = f"layers hold different cache lengths {sorted(lengths)}; cannot average over layers"
            raise ValueError(msg)
        return torch.stack(list(self._attention.values())).mean(dim=0)  # [S]

    def heavy_attention(self) -> torch.Tensor:
        """`[S]` float32 CPU: attention summed over every query seen, averaged over layers and heads.

        Each query row sums to ~1, so the total is about the number of queries; slots
        that were not yet cached when an earlier chunk ran got nothing from it.

        Raises:
            RuntimeError: The probe was not built with `heavy=True`, or saw no forward.
        """
        if not self.heavy or not self._heavy:
            msg = "AttentionProbe.heavy_attention needs heavy=True and a forward inside the `with` block"
            raise RuntimeError(msg)
        length = max(int(a.numel()) for a in self._heavy.values())
        padded = [F.pad(a, (0, length - int(a.numel()))) for a in self._heavy.values()]
        return torch.stack(padded).mean(dim=0)  # [S]

    @property
    def query_states(self) -> tuple[torch.Tensor, ...] | None:
        """Per layer (in order), the window queries `[B, H_q, W, D]` the kernel got; None unless asked."""
        if not self.keep_queries or not self._queries:
            return None
        return tuple(self._queries[i] for i in sorted(self._queries))

    # -- the recorder -------------------------------------------------------------------------

    def _record(self, call: AttentionCall) -> None:
        q_len = int(call.query.shape[-2])
        w = min(self.window, q_len)
        with torch.no_grad():
            probs = row_weights(call, q_len - w, q_len)  # [B, H_q, W, K]
            self._attention[call.layer] = self._on_slots(call.layer, probs.mean(dim=(0, 1, 2)).cpu())  # [S]
            if self.keep_queries:
                self._queries[call.layer] = call.query[:, :, q_len - w :].detach().clone()
            if self.heavy:
                summed = self._on_slots(call.layer, _summed_weights(call))
                before = self._heavy.get(call.layer)
                if before is not None:
                    summed[: before.numel()] += before[: summed.numel()]
                self._heavy[call.layer] = summed

    def _on_slots(self, layer: int, weights: torch.Tensor) -> torch.Tensor:
        """`[S]`: a layer's per-key weights `[K]` on the cache's slots (`key_slots`)."""
        slots = self.key_slots.get(layer)
        if slots is None or int(slots.numel()) != int(weights.numel()):
            return weights
        out = torch.zeros(int(slots.max()) + 1 if slots.numel() else 0, dtype=weights.dtype)
        return out.index_copy_(0, slots, weights)


HEAVY_BLOCK = 256
"""Queries per block when `AttentionProbe(heavy=True)` sums every query's attention."""


def _summed_weights(call: AttentionCall) -> torch.Tensor:
    """`[S]` float32 CPU: attention of every query of the call, summed over queries, mean over heads.

    Computed in blocks of `HEAVY_BLOCK` queries so a 1k-token chunk over a long cache
    never materialises the whole `[H, q, S]` probability tensor.
    """
    q_len = int(call.query.shape[-2])
    total = torch.zeros(int(call.key.shape[-2]), dtype=torch.float32)  # [S]
    for begin in range(0, q_len, HEAVY_BLOCK):
        probs = row_weights(call, begin, min(q_len, begin + HEAVY_BLOCK))  # [B, H_q, b, S]
        total += probs.sum(dim=2).mean(dim=(0, 1)).cpu()
    return total
