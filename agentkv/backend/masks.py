"""Attention masks by logical position, one per layer type (full attention, sliding window).

The physical cache holds tokens in any order (removed from the middle, restored at
the end), while a model must see exactly the keys a plain forward over the logical
sequence gives it. transformers builds its masks from *physical* slots, which is
right for full-attention layers as long as every cached slot precedes the new
tokens, and wrong for sliding-window layers as soon as the order changes: it sizes
the window by slots, not positions. So every forward over a reordered cache, and
every forward of a windowed model, gets masks built here from logical positions:

- full layers: a key is attended when its position is at most the query's;
- sliding layers (`sliding_window` w): and when the query is less than w positions
  after it (`q - k < w`, transformers' `sliding_window_overlay`).

A model whose layers are all of one type takes one 4D mask; a hybrid model takes a
dict keyed by layer type (transformers 5 hybrid models: Gemma 2/3, Cohere2, Qwen2/3
with windowed layers), each mask reaching its layers' attention function as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FULL = "full_attention"
"""Layer type attending every earlier position."""
SLIDING = "sliding_attention"
"""Layer type attending the last `sliding_window` positions (itself included)."""
LAYER_TYPES = (FULL, SLIDING)
"""Layer types agentkv masks and accounts for."""

NO_CUSTOM_MASK = ("flash_attention", "paged")
"""Attention implementations (prefixes) that ignore or reject an arbitrary 4D mask."""
CUSTOM_MASK_OK = ("sdpa", "eager", "flex_attention")
"""Implementations the masks here are built for (named in the error)."""

Mask = torch.Tensor | dict[str, torch.Tensor]
"""What a model's `attention_mask` takes: one 4D mask, or one per layer type."""


def check_logical_positions(config: Any) -> None:
    """Refuse a model that places tokens by cache order instead of by the positions it is fed.

    agentkv feeds every token its logical position (`position_ids`) and reorders the
    physical cache (restores land at its end). Rotary and learned position embeddings
    read those positions; ALiBi biases (BLOOM, MPT, Falcon with `alibi`) are computed
    from slot order and the 2D mask, so a reordered cache would silently give other
    logits than a plain forward.

    Raises:
        ValueError: naming the model type and why.
    """
    model_type = str(getattr(config, "model_type", ""))
    attn_config = getattr(config, "attn_config", None)
    alibi = (
        model_type == "bloom"
        or bool(getattr(config, "alibi", False))
        or bool(getattr(attn_config, "alibi", False))
        or (isinstance(attn_config, Mapping) and bool(attn_config.get("alibi")))
    )
    if alibi:
        msg = (
            f"{model_type or type(config).__name__}: ALiBi position biases are computed from the "
            "cache's slot order, not from the positions agentkv feeds, so a restored or recalled "
            "span would change the logits; models with rotary, learned or no position embeddings "
            "are supported (docs/models.md)"
        )
        raise ValueError(msg)


@dataclass(frozen=True)
class AttentionLayout:
    """Each decoder layer's attention type and the window of the sliding ones."""

    layer_types: tuple[str, ...]
    """Per layer: `FULL` or `SLIDING`."""
    sliding_window: int | None
    """Positions a sliding layer attends (None when no layer slides)."""

    @classmethod
    def of(cls, config: Any) -> AttentionLayout:
        """The layout a (text) config declares: `layer_types`, else `sliding_window` on every layer.

        Raises:
            ValueError: a layer type agentkv cannot mask, or sliding layers without a window.
        """
        layers = int(config.num_hidden_layers)
        window = getattr(config, "sliding_window", None)
        declared = getattr(config, "layer_types", None)
        if declared is not None:
            types = tuple(str(t) for t in declared)[:layers]
        else:
            types = (SLIDING if window else FULL,) * layers
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            msg = f"layer_types: cannot mask layer types {unknown}; allowed {list(LAYER_TYPES)}"
            raise ValueError(msg)
        if SLIDING not in types:
            return cls(types, None)
        if not window or int(window) <= 0:
            msg = f"sliding_window: sliding layers need a window > 0, got {window!r}"
            raise ValueError(msg)
        return cls(types, int(window))

    @property
    def windowed(self) -> bool:
        """Whether some layer slides (its masks depend on positions, not only order)."""
        return self.sliding_window is not None

    @property
    def types(self) -> tuple[str, ...]:
        """The distinct layer types, in `LAYER_TYPES` order."""
        return tuple(t for t in LAYER_TYPES if t in self.layer_types)

    def layers_of(self, layer_type: str) -> list[int]:
        """Indices of the layers of one type."""
        return [i for i, t in enumerate(self.layer_types) if t == layer_type]

    def window_of(self, layer_type: str) -> int | None:
        """Positions a layer of this type attends (None: unbounded)."""
        return self.sliding_window if layer_type == SLIDING else None


def allowed_keys(
    key_positions: torch.Tensor, query_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """`bool [n, K]`: which keys each query attends, by logical position (True = attend).

    `key_positions` `[K]`, `query_positions` `[n]` (`long`); `window` None = full attention.
    """
    distance = query_positions[:, None] - key_positions[None, :]  # [n, K]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def logical_masks(
    layout: AttentionLayout,
    key_positions: torch.Tensor | Mapping[str, torch.Tensor],
    query_positions: torch.Tensor,
    *,
    implementation: str,
    dtype: torch.dtype,
    hidden: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
) -> Mask:
    """The masks a forward of `query_positions` over keys at `key_positions` takes, `[1, 1, n, K]` each.

    `key_positions` (`long [K]`) are the cached slots' positions followed by the new
    tokens', or a dict by layer type when the layer types hold different slots (sliding
    layers hold only those they can still attend); `hidden` (`long`, key indices, or a
    dict by layer type) are never attended (old copies of tokens being recomputed).
    One mask when every layer has the same type, else a dict by
    layer type. The mask takes the form the attention implementation reads: SDPA a
    bool mask (True = attend); eager and flex *add* it to the scores (0 = attend,
    the dtype's minimum = hidden), as transformers' own `eager_mask` builds it.

    Raises:
        ValueError: The implementation cannot take an arbitrary 4D mask (FlashAttention
            kernels only know causal and padding masks).
    """
    if implementation.startswith(NO_CUSTOM_MASK):
        msg = (
            f"attention implementation {implementation!r} cannot take a logical 4D mask "
            f"(needed to attend by logical position after the cache was reordered); "
            f"load the model with attn_implementation in {list(CUSTOM_MASK_OK)}"
        )
        raise ValueError(msg)
    masks: dict[str, torch.Tensor] = {}
    for layer_type in layout.types:
        keys = key_positions[layer_type] if isinstance(key_positions, Mapping) else key_positions
        hide = hidden.get(layer_type) if isinstance(hidden, Mapping) else hidden
        allowed = allowed_keys(keys, query_positions, layout.window_of(layer_type))
        if hide is not None and hide.numel():
            allowed[:, hide.to(allowed.device)] = False
        masks[layer_type] = _as_kernel_mask(allowed[None, None], implementation, dtype)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


def _as_kernel_mask(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) in the form `implementation` reads."""
    if implementation == "sdpa":
        return allowed
    lowest = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, lowest)
