"""What every `agentkv` subcommand shares: user-facing errors, progress bars, loading the model.

Library code reports progress through callbacks (`agentkv.progress`); here it becomes
visible: rich progress bars on stderr while the model loads (its first-load conversion)
and while benchmarks run, off when stderr is not a terminal or with `--no-progress`.
"""

from __future__ import annotations

import argparse
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from agentkv.progress import ProgressStep

AGENTS_EXTRA_HINT = "pip install 'agentkv-lifecycle[agents]'"
"""How to get the optional LangChain / LangGraph dependencies the demo agent needs."""

BENCH_HINT = "pip install -e benchmarks  (from a checkout: the `agentkv-bench` distribution)"
"""How to get `agentkv bench`: the benches and their workloads ship apart from the product."""


class CommandError(Exception):
    """A failure the user can fix (missing extra, bad model path): printed in red, exit status 2."""


class RichProgress:
    """A `ProgressCallback` that draws one rich bar per task on stderr.

    Use it as a context manager around the work. The bars are transient (they vanish
    when done) and drawn only when `enabled` and stderr is a terminal; with
    `log_details`, each step's `detail` is also printed as a line (kept in logs).
    """

    def __init__(self, *, enabled: bool = True, log_details: bool = False, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.log_details = log_details
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}"),
            console=self.console,
            transient=True,
            disable=not (enabled and self.console.is_terminal),
        )
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RichProgress:
        self.bars.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.bars.stop()

    def __call__(self, step: ProgressStep) -> None:
        """Move the step's task bar (created on its first step)."""
        task = self.tasks.get(step.task)
        if task is None:
            task = self.tasks[step.task] = self.bars.add_task(step.task, total=step.total, detail="")
        self.bars.update(task, completed=step.done, total=step.total, detail=step.detail)
        if self.log_details and step.detail:
            self.console.log(str(step))


def progress_bars(args: argparse.Namespace, *, log_details: bool = False) -> RichProgress:
    """Progress bars for a command, off with `--no-progress`."""
    return RichProgress(enabled=not args.no_progress, log_details=log_details)


def load_for_command(args: argparse.Namespace, config: Any = None) -> tuple[Any, Any]:
    """The model named by `--model`, else by the config, else the default; with a progress bar."""
    from transformers.utils import logging as hf_logging

    from agentkv.models import ModelLoadError, load_model

    # Our bar covers the load; Transformers' own per-tensor bar would print even into a pipe.
    hf_logging.disable_progress_bar()
    name = args.model or (config.model if config is not None else None)
    device = getattr(args, "device", None) or (config.device if config is not None else None)
    dtype = config.dtype if config is not None else None
    kernel = config.attn_implementation if config is not None else None
    try:
        with progress_bars(args) as bars:
            return load_model(name, device=device, dtype=dtype, progress=bars, attn_implementation=kernel)
    except ModelLoadError as e:
        raise CommandError(str(e)) from e
