"""`EnginePinPlanner`: one L2 pin budget shared by the conversations of a backend.

Why a fleet-level planner: engines reuse KV by prefix only, and a conversation's next
call starts with its whole committed history. When every conversation pins a slice of
its own quota, each keeps its head on L2 and recomputes its tail at every call; the
L2 room is spread so thin that no conversation is served whole. Agents come back
in turn (every conversation calls again before any calls twice), the access pattern
LRU thrashes on; the optimal answer to a cyclic pattern that does not fit is to keep
a *fixed subset* whole and let the others miss (Belady), not to keep everything
partially.

The planner grants pin room greedily in order of arrival: the first conversation gets
its whole committed history, the next what is left, and so on until the budget is
spent; later ones pin nothing. A conversation that closes gives its room back and the
next ones move up. Grants are recomputed when a conversation asks (at its own `sync`),
so a conversation that lost room to an earlier one's growth shrinks its pin at its
next call: until then the fleet can hold more than the budget by that growth.

With an admission gate (`agentkv.engines.admission`), the order is the gate's: the
residents first (in order of admission), then the conversations in line; the room left
after the residents goes to the next ones to be admitted.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence


class EnginePinPlanner:
    """Whole committed histories of as many conversations as fit in `budget_tokens`.

    Args:
        budget_tokens: tokens all conversations of the backend pin together (whole chunks).
        chunk_size: LMCache's chunk size in tokens: grants are whole chunks.
    """

    def __init__(self, budget_tokens: int, chunk_size: int) -> None:
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
            msg = f"budget_tokens: expected an int >= 0, got {budget_tokens!r}"
            raise ValueError(msg)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            msg = f"chunk_size: expected an int > 0, got {chunk_size!r}"
            raise ValueError(msg)
        self.budget_tokens = budget_tokens
        self.chunk_size = chunk_size
        self._wanted: dict[str, int] = {}
        """Owner -> tokens it would pin uncapped, in order of arrival (dicts keep insertion order)."""
        self._lock = threading.Lock()

    def grant(self, owner: str, wanted_tokens: int) -> int:
        """Tokens `owner` may pin now (whole chunks, <= `wanted_tokens`); records what it wants.

        The first call of an owner fixes its place in the order.
        """
        if wanted_tokens < 0:
            msg = f"wanted_tokens: expected >= 0, got {wanted_tokens}"
            raise ValueError(msg)
        with self._lock:
            self._wanted[owner] = wanted_tokens
            return self._shares()[owner]

    def release(self, owner: str) -> None:
        """The conversation closed: its room goes to the ones after it (unknown owner: no-op)."""
        with self._lock:
            self._wanted.pop(owner, None)

    def prioritize(self, owners: Sequence[str], reserve: Mapping[str, int] | None = None) -> None:
        """Grant room to `owners` first, in this order; the others keep their order after them.

        The admission gate calls it with its residents, then its line, and reserves each
        resident's working set (`reserve`: it wants at least that much, even before its
        first pin): the room goes to the conversations that call now, and a conversation
        that gave up its place shrinks its pin at once. An owner not known yet takes its
        place now (wanting nothing until it asks, unless reserved).
        """
        reserve = reserve or {}
        with self._lock:
            first = {owner: max(self._wanted.get(owner, 0), reserve.get(owner, 0)) for owner in owners}
            rest = {owner: wanted for owner, wanted in self._wanted.items() if owner not in first}
            self._wanted = {**first, **rest}

    def shares(self) -> dict[str, int]:
        """Every known owner's grant as of the last requests (for stats and tests)."""
        with self._lock:
            return self._shares()

    def _shares(self) -> dict[str, int]:
        room = self.budget_tokens // self.chunk_size * self.chunk_size
        shares: dict[str, int] = {}
        for owner, wanted in self._wanted.items():
            share = min(wanted // self.chunk_size * self.chunk_size, room)
            shares[owner] = share
            room -= share
        return shares
