"""Page digests (Quest min/max key bounds): they bound the real scores and find a planted page."""

from __future__ import annotations

import pytest
import torch

from agentkv.store.digest import build_digest, score_pages, top_pages


def _keys(layers: int = 3, heads: int = 2, n: int = 200, dim: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, dim, generator=g) * 0.3 for _ in range(layers)]


def test_bound_is_never_below_the_best_real_key() -> None:
    keys = _keys()
    digest = build_digest(keys, page_tokens=32)
    queries = [torch.randn(4, 3, 16) for _ in keys]  # 4 query heads over 2 kv heads (GQA)
    bound = score_pages(digest, queries)
    for page in range(digest.num_pages):
        offsets = digest.page_offsets(page)
        real = torch.zeros(())
        for k, q in zip(keys, queries, strict=True):
            kv = k[0][:, offsets].repeat_interleave(2, dim=0)  # [4, T, D]
            real = real + (q @ kv.transpose(1, 2)).amax() / 4.0
        assert float(real) / len(keys) <= float(bound[page]) + 1e-5


@pytest.mark.parametrize("page_tokens", [16, 32, 64])
def test_digest_picks_the_planted_page(page_tokens: int) -> None:
    keys = _keys(n=300)
    direction = torch.randn(16)
    direction /= direction.norm()
    planted = 4 * page_tokens + 5  # a few tokens into page 4, not its first token
    for k in keys:
        k[0, :, planted : planted + 3] += 3.0 * direction  # the "fact": three tokens
    digest = build_digest(keys, page_tokens=page_tokens)
    queries = [direction.expand(4, 2, 16).clone() for _ in keys]
    assert top_pages(digest, queries, k=1) == [4]
    assert 4 * page_tokens in digest.page_starts and planted in digest.page_offsets(4)
    # Two key vectors (min, max) per page, per layer and head: 2 / page_tokens of the keys.
    assert digest.nbytes == len(keys) * 2 * digest.num_pages * 16 * 4 * 2


def test_short_last_page_and_bad_inputs() -> None:
    keys = _keys(n=70)
    digest = build_digest(keys, page_tokens=32)
    assert digest.num_pages == 3 and digest.page_offsets(2) == list(range(64, 70))
    with pytest.raises(ValueError, match="page_tokens: expected an int >= 4, got 2"):
        build_digest(keys, page_tokens=2)
    with pytest.raises(ValueError, match="same n"):
        build_digest([keys[0], keys[1][:, :, :10]])
    with pytest.raises(ValueError, match="one tensor per digest layer"):
        score_pages(digest, [torch.randn(4, 1, 16)])
    with pytest.raises(ValueError, match="multiple of 2"):
        score_pages(digest, [torch.randn(3, 1, 16) for _ in keys])
    with pytest.raises(ValueError, match="page: expected 0 to 2, got 3"):
        digest.page_offsets(3)
    with pytest.raises(ValueError, match="k: expected an int >= 1"):
        top_pages(digest, [torch.randn(4, 1, 16) for _ in keys], k=0)
