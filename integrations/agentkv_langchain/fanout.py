"""Settling a fan-out: which branch the thread went on with, and what becomes of the rest.

A `Send` fan-out (or `branch_config` branches) leaves one branch session per task,
each holding its own suffix over the thread's shared prefix. Nothing in a plain
LangGraph app says which one won, but the thread's next model call shows it: when
its messages continue with a branch's own messages (the judge put the winner's
thoughts into the state), that branch is the winner, and its session already holds
their KV. `continued_branch` finds it; the handler then adopts it
(`TransformersBackend.adopt`: the branch becomes the thread's session, nothing is
re-encoded) and prunes the others (`BranchPruned`: their own KV is freed).
`settlement` decides both: which branch is adopted and which stay open.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentkv import Backend, TransformersBackend
from agentkv.chat import normalize_messages
from agentkv.session_ids import branch_session_id

__all__ = ["BranchSelector", "Settlement", "continued_branch", "own_message_count", "settlement"]

BranchSelector = Callable[[str, Sequence[str]], str | None]
"""`(thread, open branch ids) -> the branch to keep, or None`: the user's pick when a run ends."""


def own_message_count(backend: TransformersBackend, thread: str, branch: str) -> int:
    """How many messages the branch session holds beyond the prefix it shares (0 when gone)."""
    session_id = branch_session_id(thread, branch)
    if session_id not in backend:
        return 0
    session = backend.get(session_id)
    with session.lock:
        return sum(1 for s in session.spans if s.branch == branch and s.message_index >= 0)


def continued_branch(
    backend: TransformersBackend, thread: str, branches: Sequence[str], messages: Sequence[Any]
) -> str | None:
    """The branch whose own messages the thread's call continues with, at the same positions.

    Args:
        backend: Where the sessions live.
        thread: The thread (the branches' parent session).
        branches: The open branch ids.
        messages: The thread's model call input (LangChain messages or chat dicts).

    Returns:
        The branch with the most own messages that all match (role, content, tool
        calls; ids ignored), or None when the call continues none of them.
    """
    try:
        incoming = normalize_messages(messages)
    except (TypeError, ValueError):
        return None  # the model call reports a malformed input itself
    best: tuple[int, str] | None = None
    for branch in branches:
        session_id = branch_session_id(thread, branch)
        if session_id not in backend:
            continue
        session = backend.get(session_id)
        with session.lock:
            own = [s for s in session.spans if s.branch == branch and s.message_index >= 0]
            # Offset 1: a call with tools but no system message gets the tool prompt as message 0.
            matched = bool(own) and any(
                all(
                    0 <= s.message_index - shift < len(incoming)
                    and incoming[s.message_index - shift].fingerprint() in s.fingerprints
                    for s in own
                )
                for shift in (0, 1)
            )
        if matched and (best is None or len(own) > best[0]):
            best = (len(own), branch)
    return best[1] if best else None


@dataclass(frozen=True)
class Settlement:
    """What settling a thread's open branches does: one adopted, some kept open, the rest pruned."""

    adopted: str | None
    """The branch the thread goes on with (its session becomes the thread's)."""
    kept: frozenset[str]
    """Branches kept open, selected, for the next run to adopt."""
    pruned: tuple[str, ...]
    """Every other settled branch, in order: `BranchPruned` frees its own KV."""


def settlement(
    backend: Backend,
    thread: str,
    settling: Sequence[str],
    selected: set[str],
    *,
    messages: Sequence[Any] | None = None,
    at_end: bool = False,
    adopt: bool = True,
    selector: BranchSelector | None = None,
) -> Settlement:
    """Settle a thread's open branches.

    Args:
        backend: Where the sessions live; only a `TransformersBackend` adopts a branch
            (an engine's branches are pruned).
        thread: The thread whose fan-out is settled.
        settling: The open branches being settled.
        selected: Those of them a `select_branch` kept.
        messages: The thread's model call input, when a call settles them: the branch
            it continues is adopted (`adopt`).
        at_end: The run ended: the selected branches (else the `selector`'s pick) stay
            open for the next run.
        adopt: Adopt the continued branch; False = prune it with the others.
        selector: `(thread, open branch ids) -> id | None`, asked at the end when none is selected.
    """
    adopted = None
    if messages is not None and adopt and isinstance(backend, TransformersBackend):
        adopted = continued_branch(backend, thread, settling, messages)
    kept: set[str] = set()
    if at_end:
        kept = set(selected)
        if not kept and selector is not None:
            pick = selector(thread, sorted(settling))
            kept = {pick} if pick is not None and pick in settling else set()
    pruned = tuple(b for b in settling if b != adopted and b not in kept)
    return Settlement(adopted, frozenset(kept), pruned)
