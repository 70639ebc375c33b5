"""Page digests: a few bytes per page of keys that let a query find the page that answers it.

Recall by words misses a fact that a question names in other words, and recall by
whole message cannot afford a 500-token tool result whose one useful line is
deep inside. A page digest keeps, per page of `page_tokens` consecutive tokens and
per (layer, kv head, channel), the minimum and maximum key: Quest's criterion
(Tang et al. 2024, https://arxiv.org/abs/2406.10774; ArkVale's page digests and
InfLLM's representative tokens serve the same purpose). For a query vector q the
largest dot product any key of the page can reach is bounded by

    sum_d max(q_d * min_d, q_d * max_d)

so scoring pages by that bound with the question's own query vectors ranks them
by how much attention the model could pay them, before any of their KV is brought
back. A digest costs `2 / page_tokens` of its page's keys (and no values): for
32-token pages, 1/16 of the keys, 1/32 of the page's KV.

This module builds digests and scores them; choosing which archived pages to
bring back (and how many fit the budget) is the lifecycle's recall.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.store.block import tensor_bytes

MIN_PAGE_TOKENS = 4
"""Smaller pages cost more digest than they save."""

QUEST_SKIP_LAYERS = 2
"""Leading layers left out of digests and scores (Quest does not apply its selection to the first two)."""

DIGEST_DTYPE = torch.float16
"""Bounds are stored at half precision, rounded outwards (still an upper bound): half the bytes."""


@dataclass(frozen=True, eq=False)
class PageDigest:
    """Per-page key bounds of one span, for every layer.

    `mins[l]`, `maxs[l]`: `[H_kv, P, D]` for layer l (P pages, batch 1).
    `page_starts[p]`: the span offset where page p begins (pages are `page_tokens`
    long; the last may be shorter).
    """

    mins: tuple[torch.Tensor, ...]
    maxs: tuple[torch.Tensor, ...]
    page_tokens: int
    num_tokens: int

    @property
    def num_pages(self) -> int:
        """Pages in the span."""
        return -(-self.num_tokens // self.page_tokens)

    @property
    def page_starts(self) -> list[int]:
        """Span offset of each page's first token."""
        return list(range(0, self.num_tokens, self.page_tokens))

    @property
    def nbytes(self) -> int:
        """Bytes held by the digest."""
        return sum(tensor_bytes(t) for t in (*self.mins, *self.maxs))

    def page_offsets(self, page: int) -> list[int]:
        """The span offsets a page covers."""
        if not 0 <= page < self.num_pages:
            msg = f"page: expected 0 to {self.num_pages - 1}, got {page}"
            raise ValueError(msg)
        start = page * self.page_tokens
        return list(range(start, min(start + self.page_tokens, self.num_tokens)))


def build_digest(
    keys: list[torch.Tensor], page_tokens: int = 32, *, dtype: torch.dtype | None = None
) -> PageDigest:
    """Digest a span's keys.

    Args:
        keys: per layer, the span's keys `[1, H_kv, n, D]` (RoPE applied, as cached).
        page_tokens: tokens per page, >= `MIN_PAGE_TOKENS` (16-64 is the useful range).
        dtype: storage dtype of the bounds (default: the keys'). A narrower float is
            rounded outwards (minimums down, maximums up), so `score_pages` stays an
            upper bound of every key's logit.

    Raises:
        ValueError: Bad page size, no layers, or keys that are not `[1, H, n, D]` with one n.
    """
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < MIN_PAGE_TOKENS:
        msg = f"page_tokens: expected an int >= {MIN_PAGE_TOKENS}, got {page_tokens!r}"
        raise ValueError(msg)
    if not keys:
        msg = "keys: expected one tensor per layer, got none"
        raise ValueError(msg)
    lengths = {int(k.shape[-2]) for k in keys}
    if any(k.dim() != 4 or k.shape[0] != 1 for k in keys) or len(lengths) != 1:
        shapes = sorted({tuple(k.shape) for k in keys})
        msg = f"keys: expected [1, H, n, D] per layer with the same n, got shapes {shapes}"
        raise ValueError(msg)
    (n,) = lengths
    if n == 0:
        msg = "keys: expected at least one token"
        raise ValueError(msg)
    pages = -(-n // page_tokens)
    mins: list[torch.Tensor] = []
    maxs: list[torch.Tensor] = []
    for k in keys:
        x = k[0].float()  # [H, n, D]
        pad = pages * page_tokens - n
        if pad:
            # Repeat the last token: the padded page keeps its own bounds.
            x = torch.cat([x, x[:, -1:].expand(-1, pad, -1)], dim=1)
        paged = x.reshape(x.shape[0], pages, page_tokens, x.shape[-1])  # [H, P, T, D]
        store = k.dtype if dtype is None else dtype
        mins.append(_round(paged.amin(dim=2), store, down=True))  # [H, P, D]
        maxs.append(_round(paged.amax(dim=2), store, down=False))
    return PageDigest(mins=tuple(mins), maxs=tuple(maxs), page_tokens=page_tokens, num_tokens=n)


def _round(x: torch.Tensor, dtype: torch.dtype, *, down: bool) -> torch.Tensor:
    """`x` (float32) in `dtype`, rounded towards -inf (`down`) or +inf, never to the nearest value."""
    y = x.to(dtype)
    if y.dtype == x.dtype:
        return y
    wrong = y.float() > x if down else y.float() < x
    if bool(wrong.any()):
        limit = torch.tensor(float("-inf") if down else float("inf"), dtype=dtype)
        y = torch.where(wrong, torch.nextafter(y, limit.expand_as(y)), y)
    return y


def score_pages(digest: PageDigest, queries: list[torch.Tensor]) -> torch.Tensor:
    """Quest's upper bound of the attention logit each page can receive, `[P]`.

    Args:
        digest: the span's digest.
        queries: per layer (same layers as the digest), query vectors `[H_q, m, D]`
            (m query tokens, e.g. the question's; RoPE applied at their positions).
            `H_q` is a multiple of `H_kv` (grouped-query attention: query head h
            reads kv head `h // (H_q / H_kv)`).

    Returns:
        Per page, the bound maxed over query tokens and heads, averaged over layers
        (each layer's bounds scaled by 1/sqrt(D), as attention scales its logits).
    """
    if len(queries) != len(digest.mins):
        msg = f"queries: expected one tensor per digest layer ({len(digest.mins)}), got {len(queries)}"
        raise ValueError(msg)
    total = torch.zeros(digest.num_pages)
    for q, lo, hi in zip(queries, digest.mins, digest.maxs, strict=True):
        if q.dim() != 3 or q.shape[-1] != lo.shape[-1] or q.shape[0] % lo.shape[0]:
            expected = f"[H_q, m, {lo.shape[-1]}] with H_q a multiple of {lo.shape[0]}"
            msg = f"queries: expected {expected}, got {list(q.shape)}"
            raise ValueError(msg)
        group = q.shape[0] // lo.shape[0]
        lo_q = lo.float().repeat_interleave(group, dim=0)  # [H_q, P, D]
        hi_q = hi.float().repeat_interleave(group, dim=0)
        qf = q.float().unsqueeze(2)  # [H_q, m, 1, D]
        bound = torch.maximum(qf * lo_q.unsqueeze(1), qf * hi_q.unsqueeze(1)).sum(-1)  # [H_q, m, P]
        total += bound.amax(dim=(0, 1)).cpu() / (lo.shape[-1] ** 0.5)
    return total / len(queries)


def top_pages(digest: PageDigest, queries: list[torch.Tensor], k: int) -> list[int]:
    """The `k` pages with the highest bound, best first."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        msg = f"k: expected an int >= 1, got {k!r}"
        raise ValueError(msg)
    scores = score_pages(digest, queries)
    return [int(i) for i in torch.argsort(scores, descending=True)[:k]]
