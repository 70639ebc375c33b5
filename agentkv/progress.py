"""Progress reports from long operations (model conversion, benchmarks) to whoever shows them.

Library code never prints: a long operation takes an optional `progress` callback
and calls it with a `ProgressStep` after each unit of work; the `agentkv` CLI turns
those into rich progress bars on stderr (off when stderr is not a terminal, or with
`--no-progress`). A plain `print` or `list.append` works as a callback too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ProgressCallback", "ProgressStep", "report"]


@dataclass(frozen=True)
class ProgressStep:
    """Where one task of a long operation stands."""

    task: str
    """What is running, e.g. "reuse: re-encode"; steps of one task share it (one bar per task)."""
    done: int
    """Units finished so far."""
    total: int | None
    """Units in all (None = unknown)."""
    detail: str = ""
    """What the unit that just finished (or is starting) was, for a status line."""

    def __str__(self) -> str:
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        return f"[{count}] {self.task}" + (f": {self.detail}" if self.detail else "")


ProgressCallback = Callable[[ProgressStep], None]
"""What a `progress=` argument takes."""


def report(
    progress: ProgressCallback | None, task: str, done: int, total: int | None, detail: str = ""
) -> None:
    """Call `progress` with one step, if there is a callback (the one-liner every caller needs)."""
    if progress is not None:
        progress(ProgressStep(task, done, total, detail))
