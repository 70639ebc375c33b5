"""Long operations report progress through callbacks; the CLI draws them as rich bars on stderr."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentkv import models
from agentkv.cli_common import RichProgress
from agentkv.progress import ProgressStep
from agentkv_bench.soak import run_soak


def test_first_load_conversion_reports_each_step(
    tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF conversion's steps reach the callback (the slow parts stubbed: no real GGUF here)."""
    monkeypatch.setenv(models.CACHE_DIR_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really")
    written: list[Path] = []

    def read(path: Path, steps: Any) -> tuple[Any, Any]:
        with steps.step("tokenizer"):
            pass
        with steps.step("weights"):
            pass
        return tiny_model, tiny_tokenizer

    def write(models_dir: Path, digest: str, *args: Any, **kwargs: Any) -> Path:
        written.append(models_dir / digest[:16])
        return written[-1]

    def load_entry(entry: Path, *args: Any) -> tuple[Any, Any] | None:
        return (tiny_model, tiny_tokenizer) if entry in written else None

    monkeypatch.setattr(models, "_read_gguf", read)
    monkeypatch.setattr(models, "_write_cache_entry", write)
    monkeypatch.setattr(models, "_load_cache_entry", load_entry)
    steps: list[ProgressStep] = []
    model, _ = models.load_model(gguf, device="cpu", progress=steps.append)
    assert model is tiny_model
    assert {s.task for s in steps} == {"preparing tiny.gguf (first load only)"}
    assert all(s.total == 4 for s in steps)
    # Each step is reported as it starts (done unchanged) and as it ends (done + 1).
    assert [(s.done, s.detail) for s in steps] == [
        (0, "hashing"),
        (1, "hashing"),
        (1, "tokenizer"),
        (2, "tokenizer"),
        (2, "weights"),
        (3, "weights"),
        (3, "saving"),
        (4, "saving"),
    ]


def test_soak_reports_each_turn(tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path) -> None:
    steps: list[ProgressStep] = []
    run_soak(tiny_model, tiny_tokenizer, turns=3, out_dir=tmp_path, context_tokens=512, progress=steps.append)
    assert [(s.task, s.done, s.total) for s in steps] == [("soak", t, 3) for t in (1, 2, 3)]
    assert str(steps[-1]) == "[3/3] soak"


def test_rich_progress_draws_bars_only_on_a_terminal() -> None:
    step = ProgressStep("memory", 1, 2, "support agentkv @0.25: EM 100%")
    piped = io.StringIO()
    with RichProgress(console=Console(file=piped), log_details=True) as bars:
        assert bars.bars.disable  # not a terminal: no bar
        bars(step)
    assert "support agentkv @0.25" in piped.getvalue()  # details are still logged as lines

    terminal = io.StringIO()
    with RichProgress(console=Console(file=terminal, force_terminal=True, width=120)) as bars:
        assert not bars.bars.disable
        bars(ProgressStep("reuse: session", 1, 4))
        bars(ProgressStep("reuse: session", 2, 4))
        bars(ProgressStep("reuse: re-encode", 1, 4))
        tasks = {t.description: t for t in bars.bars.tasks}
        assert tasks["reuse: session"].completed == 2 and tasks["reuse: session"].total == 4
        assert tasks["reuse: re-encode"].completed == 1
    with RichProgress(enabled=False, console=Console(file=io.StringIO(), force_terminal=True)) as bars:
        assert bars.bars.disable  # --no-progress
