"""The cheap attention signal: recompute the last W queries and score them against the cache.

With SDPA (or flash) attention the model never materialises attention weights, and
asking for them (`output_attentions=True`) forces the slow eager path for the whole
forward. Attention-based policies (SnapKV, TOVA, H2O, lifecycle) only need the
attention of the *last few* queries, so `AttentionProbe` hooks every decoder
layer's `self_attn`, recomputes those W queries from the layer's input
(`q_proj` → optional `q_norm` → RoPE), reads the layer's cached keys after the
cache update and computes `softmax(q·kᵀ · scaling)` for the window only — the same
numbers eager attention would give for those rows (docs/design.md §5), at a cost of
O(W·S) per layer instead of O(S²).

The probe is a context manager: hooks exist only inside the `with` block, so a
session pays for it only when a policy needs attention (commit time, budget
pressure), and `hook_count` returns to zero on exit, exceptions included.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from agentkv.policies.base import Policy

__all__ = ["AttentionProbe", "attention_modules", "attention_window"]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a decoder, in layer order.

    Found generically (any module with a `q_proj` and an integer `layer_idx`) rather
    than through `model.model.layers[i].self_attn`, so Llama, Mistral, Qwen, Gemma
    and wrapped models (PEFT, multimodal text towers) all work without special cases.

    Raises:
        ValueError: The model has no such module.
    """
    found: list[Any] = [
        m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    if not found:
        msg = (
            f"{type(model).__name__} has no attention module with `q_proj` and an integer `layer_idx`; "
            "AttentionProbe supports transformers decoder models (Llama, Mistral, Qwen, Gemma, ...)"
        )
        raise ValueError(msg)
    return sorted(found, key=lambda m: int(m.layer_idx))


def attention_window(policy: Policy | None, default: int = 32) -> int:
    """How many trailing queries the session should probe for `policy`.

    A policy that cares declares a `window` attribute (SnapKV's observation window,
    TOVA's single last query); wrappers expose their parts through `inner` / `parts`.
    With several windows in one composition the largest wins: one probe run then
    serves every part (TOVA then sees a wider window than its paper's single query).
    """
    windows = [int(w) for p in _walk(policy) if isinstance(w := getattr(p, "window", None), int)]
    return max(windows) if windows else default


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

    Slots are *physical* cache slots: entry i is the i-th slot of the layer's cache
    (shared prefix first, see `SharedPrefixLayer.full`). The W new tokens are the
    last W slots; without an explicit 4D mask, window query j (slot S-W+j) attends
    to slots ≤ S-W+j. A 4D mask passed to the model (`[B, 1, q, S]`, bool or
    additive) is used instead when its shape matches, so logical masks
    (rehydration, branches) are honoured.
    """

    def __init__(self, model: nn.Module, window: int, *, keep_queries: bool = False) -> None:
        """Prepare a probe; nothing is attached until `__enter__`.

        Args:
            model: A transformers causal LM (or its decoder).
            window: W, how many trailing queries of each forward to score (>= 1).
            keep_queries: Also keep each layer's window queries (`query_states`), for
                intent scoring; off by default because they cost memory on the device.
        """
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            msg = f"AttentionProbe window must be an int >= 1, got {window!r}"
            raise ValueError(msg)
        self.model = model
        self.window = window
        self.keep_queries = keep_queries
        self._handles: list[RemovableHandle] = []
        self._attention: dict[int, torch.Tensor] = {}
        self._queries: dict[int, torch.Tensor] = {}

    # -- attach / detach ----------------------------------------------------------------------

    def __enter__(self) -> AttentionProbe:
        if self._handles:
            msg = "AttentionProbe is already attached; use one `with` block at a time"
            raise RuntimeError(msg)
        self._attention.clear()
        self._queries.clear()
        try:
            for module in attention_modules(self.model):
                self._handles.append(module.register_forward_hook(self._hook, with_kwargs=True))
        except BaseException:
            self._detach()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._detach()

    def _detach(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    @property
    def hook_count(self) -> int:
        """Hooks currently registered by this probe (0 outside the `with` block)."""
        return len(self._handles)

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

    @property
    def query_states(self) -> tuple[torch.Tensor, ...] | None:
        """Per layer (in order), the RoPE'd window queries `[B, H_q, W, D]`; None unless `keep_queries`."""
        if not self.keep_queries or not self._queries:
            return None
        return tuple(self._queries[i] for i in sorted(self._queries))

    # -- the hook -----------------------------------------------------------------------------

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, q, hidden]
        position_embeddings = kwargs.get("position_embeddings")
        if position_embeddings is None:
            msg = (
                f"{type(module).__name__} got no `position_embeddings` (cos, sin); "
                "AttentionProbe needs a transformers model that computes RoPE outside the attention module"
            )
            raise RuntimeError(msg)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layer_idx = int(module.layer_idx)
        with torch.no_grad():
            w = min(self.window, int(hidden.shape[-2]))
            q = _window_queries(module, hidden, position_embeddings, w)  # [B, H_q, W, D]
            keys = _layer_keys(module, cache, hidden, position_embeddings)  # [B, H_kv, S, D]
            probs = _window_probs(module, q, keys, kwargs.get("attention_mask"))  # [B, H_q, W, S]
        self._attention[layer_idx] = probs.mean(dim=(0, 1, 2)).cpu()  # [S]
        if self.keep_queries:
            self._queries[layer_idx] = q.detach()


def _head_dim(module: Any) -> int:
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    config = module.config
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE exactly as transformers' `apply_rotary_pos_emb` (half-split rotation); x: [B, H, T, D].

    Written out rather than imported from `modeling_llama` so the probe does not tie
    itself to one architecture's module; cos/sin `[B, T, D]` come from the model.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return (x * cos) + (rotated * sin)


def _project(
    module: Any,
    proj: nn.Module,
    norm: nn.Module | None,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """`proj` → heads → optional per-head norm → RoPE, exactly as the attention forward does."""
    batch, t = hidden.shape[0], hidden.shape[-2]
    x = proj(hidden).view(batch, t, -1, _head_dim(module))  # [B, T, H, D]
    if norm is not None:
        x = norm(x)  # Qwen3-style per-head RMSNorm, applied before the transpose
    x = x.transpose(1, 2)  # [B, H, T, D]
    cos, sin = position_embeddings
    return _rope(x, cos[..., -t:, :], sin[..., -t:, :])


def _window_queries(
    module: Any, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], w: int
) -> torch.Tensor:
    """Queries of the last w tokens of the forward's input, `[B, H_q, w, D]`."""
    q_norm = getattr(module, "q_norm", None)
    return _project(module, module.q_proj, q_norm, hidden[..., -w:, :], position_embeddings)


def _layer_keys(
    module: Any, cache: Any, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The layer's keys after this forward's update, `[B, H_kv, S, D]`.

    Prefers the cache (`.full()` of our `SharedPrefixLayer`, which includes a shared
    prefix, else a plain layer's `.keys`); without a cache the keys are recomputed
    from this forward's input, which is then all there is to attend to.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None and int(module.layer_idx) < len(layers):
        layer = layers[int(module.layer_idx)]
        full = getattr(layer, "full", None)
        if callable(full):
            held = full()
            if held is not None:
                return held[0]
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            return keys
    return _project(module, module.k_proj, getattr(module, "k_norm", None), hidden, position_embeddings)


def _window_probs(module: Any, q: torch.Tensor, keys: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask) for the window rows, float32 `[B, H_q, W, S]`."""
    w, s = q.shape[-2], keys.shape[-2]
    groups = q.shape[1] // keys.shape[1]
    # GQA: repeat_interleave maps query head h to key head h // groups, as transformers' repeat_kv.
    k = keys.to(q.device).repeat_interleave(groups, dim=1).float()  # [B, H_q, S, D]
    scaling = float(getattr(module, "scaling", _head_dim(module) ** -0.5))
    logits = torch.matmul(q.float(), k.transpose(-1, -2)) * scaling  # [B, H_q, W, S]
    logits = logits + _window_bias(attention_mask, w, s, logits.device)
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)  # a fully masked (padding) row attends to nothing


def _window_bias(attention_mask: Any, w: int, s: int, device: torch.device) -> torch.Tensor:
    """Additive mask for the window rows, broadcastable to `[B, H, W, S]`.

    Uses the model's 4D mask when it is a tensor covering exactly the S cached slots
    (bool: True = attend; float: additive), otherwise plain causality over the last
    W slots.
    """
    usable = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
    if usable and attention_mask.shape[-1] == s:
        rows = attention_mask[..., -w:, :].to(device)  # [B, 1, W, S]
        if rows.dtype == torch.bool:
            return torch.zeros(rows.shape, device=device).masked_fill(~rows, float("-inf"))
        return rows.float()
    slots = torch.arange(s, device=device)  # [S]
    query_slots = torch.arange(s - w, s, device=device)  # [W]
    allowed = slots[None, :] <= query_slots[:, None]  # [W, S]
    return torch.zeros(w, s, device=device).masked_fill(~allowed, float("-inf"))
