"""Which maybe-applied pin references a session holds without knowing it.

A pin or unpin request that timed out may still be applied when the coordinator
resumes (its request sits in the coordinator's queue): the session cannot tell from
the failure whether the reference exists. LMCache counts pins per chunk key (every
`POST /cache/pins` adds one reference on each complete chunk of the sequence, every
`DELETE` takes one away), and `GET /cache/pins?cache_salt=...` lists each key with its
count. When one session is the only holder on its salt, every reference above the
session's own books is one it must give back.

Pins name prefix-chained chunks, so chunk `j` of two sequences is one key when the
sequences agree through that chunk. A sequence whose request may or may not have been
applied is *surplus* when every one of its chunks carries a reference beyond the
books (and beyond the surplus sequences found before it): an applied request adds one
on all of them at once, and giving back a sequence that was not applied would take a
reference someone still needs.
"""

from __future__ import annotations

from collections.abc import Sequence


def chunks_shared(a: Sequence[int], b: Sequence[int], chunk_size: int) -> int:
    """Leading whole chunks two token sequences have in common (the same keys on LMCache)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i // chunk_size


def surplus_sequences(
    uncertain: Sequence[Sequence[int]],
    held: Sequence[Sequence[int]],
    observed: Sequence[Sequence[int]],
    chunk_size: int,
) -> list[int]:
    """Indices of the `uncertain` sequences whose reference the coordinator holds beyond `held`.

    Args:
        uncertain: sequences whose pin (or unpin) request failed: the session does not want
            a reference on them, and the coordinator may hold one.
        held: sequences the session's books hold one reference on each (commit, archive,
            selection pins), taken as applied.
        observed: for each uncertain sequence, the coordinator's pin count of each of its
            complete chunks (same order; 0 for a key it does not list).
        chunk_size: tokens per chunk.

    Returns:
        The indices to unpin once each, in order. The others hold no reference of the
        session's that the coordinator shows (never applied, or given back already).
    """
    if len(observed) != len(uncertain):
        msg = f"observed: expected {len(uncertain)} count lists (one per sequence), got {len(observed)}"
        raise ValueError(msg)
    counted: list[Sequence[int]] = list(held)
    surplus: list[int] = []
    for index, (sequence, counts) in enumerate(zip(uncertain, observed, strict=True)):
        n = len(sequence) // chunk_size
        if n == 0 or len(counts) < n:
            continue
        expected = [0] * n
        for other in counted:
            for j in range(min(n, chunks_shared(sequence, other, chunk_size), len(other) // chunk_size)):
                expected[j] += 1
        if all(counts[j] > expected[j] for j in range(n)):
            surplus.append(index)
            counted.append(sequence)
    return surplus
