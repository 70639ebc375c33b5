"""A session's attended keys as the store protocol reads them (`KVStoreProtocol.attended_tokens`).

Tests that compare the KV a session holds with a plain full forward read it here, through the
store's public token access, instead of reaching into its physical cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def span_keys(session: Any, span: Any, offsets: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Per layer, the keys `[B, H, n, D]` of `span`'s attended tokens at `offsets` (None: every held
    offset), in the order of `offsets` (sorted when None). Fails when one of them is not attended."""
    tokens = session.store.attended_tokens(span, keys=True, queries=False)
    assert tokens is not None, "the store has no tokens to read"
    held = tokens.offsets.tolist()
    wanted = sorted(held) if offsets is None else list(offsets)
    missing = set(wanted) - set(held)
    assert not missing, f"span {span.span_id} does not attend offsets {sorted(missing)}"
    index = torch.tensor([held.index(o) for o in wanted], dtype=torch.long)
    return [keys.index_select(-2, index) for keys in tokens.keys]
