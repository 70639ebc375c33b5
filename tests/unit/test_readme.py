"""The README is the product's face: its two commands come first and its figures are generated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentkv_bench import figures

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# A measured figure: a ratio (3.2x), a share (54%), a size (21.9 MiB) or a time (390 ms).
FIGURE = re.compile(r"\b\d[\d,]*(\.\d+)?\s*(x\b|%|MiB\b|GiB\b|KiB\b|ms\b)")


def test_readme_starts_with_the_two_setup_commands() -> None:
    block = re.search(r"```bash\n(.*?)```", README, flags=re.S)
    assert block is not None and README.index("```bash") < README.index("## ")
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert lines == [
        "bash scripts/setup.sh && .venv/bin/agentkv demo",
        "bash scripts/setup.sh && bash scripts/test.sh",
    ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/setup.sh && bash scripts/test.sh" in ci


def test_readme_figures_equal_their_rendering_from_the_committed_json() -> None:
    collected = figures.load()
    assert collected, "docs/figures/ holds no collected bench JSON"
    assert figures.readme_block(README) == figures.render(collected)


def test_no_figure_in_the_readme_outside_the_rendered_table() -> None:
    outside = README.replace(figures.readme_block(README), "")
    found = [m.group(0) for m in FIGURE.finditer(outside)]
    assert not found, f"figures typed into the README by hand (render them from bench JSON): {found}"


def test_every_collected_figure_says_where_it_was_measured() -> None:
    for name, data in figures.load().items():
        where = data["_provenance"]
        assert where["command"].startswith("agentkv "), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", where["date"]), name


def test_rendering_follows_the_json() -> None:
    """A changed figure in the JSON changes the table: the check can fail."""
    data = figures.load()["demo"]
    before = figures.render({"demo": data})
    data["summary"]["ttft_speedup_last_turn"] += 1.0
    assert figures.render({"demo": data}) != before


def test_a_missing_marker_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="figures markers are missing"):
        figures.readme_block("# no table here")
