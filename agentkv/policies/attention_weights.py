"""Attention weights of some query rows of one attention call, as the kernel computes them.

softmax(softcap(q·kᵀ · scaling) + mask), in float32, with grouped KV heads repeated the
way transformers' `repeat_kv` does (query head h reads KV head h // groups) and a head's
attention-sink logit, when the call has one, taking its share of each row. Only the asked
rows are computed: O(rows · S) per layer instead of the O(q · S) the call does.
"""

from __future__ import annotations

import torch

from agentkv.policies.attention_call import AttentionCall

__all__ = ["row_weights"]


def row_weights(call: AttentionCall, first: int, stop: int) -> torch.Tensor:
    """Float32 `[B, H_q, stop - first, S]`: the weights of query rows `first .. stop - 1` of `call`.

    A fully masked row (padding) attends to nothing (all zeros).

    Raises:
        ValueError: The rows are outside the call's queries, or its mask has a shape the
            rows cannot be read from.
    """
    q_len, s = int(call.query.shape[-2]), int(call.key.shape[-2])
    if not 0 <= first < stop <= q_len:
        msg = f"rows must satisfy 0 <= first < stop <= {q_len} (the call's queries), got {first}..{stop}"
        raise ValueError(msg)
    query = call.query[:, :, first:stop].float()  # [B, H_q, r, D]
    groups = query.shape[1] // call.key.shape[1]
    key = call.key.to(query.device).float().repeat_interleave(groups, dim=1)  # [B, H_q, S, D]
    logits = torch.matmul(query, key.transpose(-1, -2)) * call.scaling  # [B, H_q, r, S]
    if call.softcap is not None:
        logits = torch.tanh(logits / call.softcap) * call.softcap
    logits = logits + _bias(call.mask, first, stop, q_len, s, logits.device)
    if call.sinks is not None:  # one more column per head, dropped after the softmax
        sinks = call.sinks.to(logits.device).float().reshape(1, -1, 1, 1)  # [1, H_q, 1, 1]
        logits = torch.cat([logits, sinks.expand(*logits.shape[:-1], 1)], dim=-1)
        return torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)[..., :-1]
    return torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)


def _bias(
    mask: torch.Tensor | None, first: int, stop: int, q_len: int, s: int, device: torch.device
) -> torch.Tensor:
    """Additive bias of the rows, broadcastable to `[B, H, r, S]`.

    A 4D mask is the kernel's (bool: True = attend; float: added to the scores), cut to the
    S keys the way eager attention cuts it; None means causal with the q queries in the
    last q slots (what SDPA's `is_causal` and a single decode query both mean).
    """
    if mask is None:
        slots = torch.arange(s, device=device)  # [S]
        query_slots = torch.arange(s - q_len + first, s - q_len + stop, device=device)  # [r]
        allowed = slots[None, :] <= query_slots[:, None]  # [r, S]
        return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
    if mask.dim() != 4 or mask.shape[-1] < s or mask.shape[-2] not in (1, q_len):
        msg = f"attention mask of shape {tuple(mask.shape)}: expected [B, 1 or H, {q_len} or 1, >= {s}]"
        raise ValueError(msg)
    rows = mask[..., :s] if mask.shape[-2] == 1 else mask[..., first:stop, :s]
    rows = rows.to(device)
    if rows.dtype == torch.bool:
        return torch.zeros(rows.shape, device=device).masked_fill(~rows, float("-inf"))
    return rows.float()
