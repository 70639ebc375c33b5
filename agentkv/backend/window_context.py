"""Sliding KV a recompute needs and the cache dropped: recomputed exactly from the token ids.

A session's sliding layers hold only the slots a query at the conversation's end can
attend (`PhysicalCache.trim_window`). A span recomputed at its old positions
(rehydration, exact recall, a pending tail encoded after later messages, a history
rewrite) attends, on its sliding layers, the window *before* it, which may be gone.
Those slots' sliding KV is recomputed here: the token ids from the conversation's
start up to the last missing position run through a temporary plain cache (every
layer holds every token, transformers' own masks: a plain forward), and the sliding
layers take the missing slots' KV from it. Exact, never approximate; it costs one
forward over that many tokens (`PhysicalCache.window_recomputed_tokens` counts them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentkv.store.cache import ManagedCache, PhysicalCache

__all__ = ["restore_window"]


@torch.inference_mode()
def restore_window(
    model: torch.nn.Module,
    cache: PhysicalCache,
    positions: Sequence[int],
    hidden: torch.Tensor | None = None,
    *,
    chunk: int = 1024,
) -> int:
    """Make the sliding layers hold every slot a query at `positions` attends; slots restored.

    `hidden` (`long`, physical slots) are never attended (old copies being recomputed).

    Raises:
        RuntimeError: Sliding KV is missing and the cache has no `context_source` (token ids)
            or the source holds fewer tokens than the missing positions need.
    """
    missing = cache.missing_window(positions, hidden)
    if not missing.numel():
        return 0
    upto = int(cache.slot_position[missing].max()) + 1
    source = cache.context_source
    ids = source(upto) if source is not None else []
    if len(ids) < upto:
        msg = (
            f"sliding-window KV of {int(missing.numel())} slots is needed and not held, and the cache "
            f"has {len(ids)} token ids to recompute it from, expected {upto} (set `context_source`)"
        )
        raise RuntimeError(msg)
    plain = ManagedCache(cache.num_layers)  # every layer holds every token: a plain forward
    device = next(model.parameters()).device
    for begin in range(0, upto, chunk):
        stop = min(upto, begin + chunk)
        model(
            input_ids=torch.tensor([ids[begin:stop]], dtype=torch.long, device=device),
            position_ids=torch.arange(begin, stop, device=device)[None],
            cache=plain,
            use_cache=True,
            logits_to_keep=1,
        )
    index = cache.slot_position[missing].to(device)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i in cache.sliding_layers:
        full = plain.managed_layers[i].full()
        if full is None:
            msg = f"the plain forward left layer {i} empty, expected {upto} tokens"
            raise RuntimeError(msg)
        keys.append(full[0].index_select(-2, index))  # [B, H, m, D]
        values.append(full[1].index_select(-2, index))
    cache.hold_window(missing, keys, values)
    cache.window_recomputed_tokens += upto
    return int(missing.numel())
