"""Session ids: a conversation (`thread`) and, inside it, a branch (`<thread>/<branch>`).

The one place a branch session's id is built or taken apart: the backend's
`fork`, the lifecycle's branch bookkeeping and the integrations' session keys
all use these two functions.
"""

from __future__ import annotations

SEPARATOR = "/"


def branch_session_id(thread: str, branch: str | None) -> str:
    """`<thread>/<branch>`, or the thread itself when there is no branch."""
    return f"{thread}{SEPARATOR}{branch}" if branch else thread


def is_branch_of(session_id: str, thread: str) -> bool:
    """Whether `session_id` is a branch session of `thread` (not the thread itself)."""
    return session_id.startswith(f"{thread}{SEPARATOR}")
