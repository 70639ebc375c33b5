"""`agentkv bench reuse` on the tiny model: reuse vs re-encode, the bare-forward floor, no FutureWarning."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from agentkv_bench.reuse import BareForward, OverheadRow, decode_rate_ratio, overhead_summary, run_reuse_bench


def test_reuse_bench_reports_the_ratio_to_a_bare_forward(
    tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    result = run_reuse_bench(
        tiny_model, tiny_tokenizer, turns=4, max_new_tokens=3, tool_words=20, repeats=2, out_dir=tmp_path
    )
    assert json.loads((tmp_path / "reuse.json").read_text())["summary"]["turns"] == 4
    assert (tmp_path / "reuse.png").stat().st_size > 0
    reuse, overhead = result["reuse"], result["overhead"]
    assert [r["turn"] for r in overhead] == [2, 3, 4]  # turn 1 has no cache to reuse
    for row in overhead:
        turn = reuse[row["turn"] - 1]
        assert row["cached_tokens"] == turn["cached_tokens"] == turn["reused_tokens"] > 0
        assert row["new_tokens"] == turn["new_tokens"] == turn["prefill_tokens"]  # + the prompt
        assert row["session_ttft_s"] > 0 and row["bare_ttft_s"] > 0
        assert row["ratio_to_bare"] == row["session_ttft_s"] / row["bare_ttft_s"]
    # Each turn's history extends the previous one: cached + new of one turn <= cached of the next.
    for a, b in zip(reuse, reuse[1:], strict=False):
        assert a["cached_tokens"] + a["new_tokens"] <= b["cached_tokens"]
    assert result["summary"]["last_turn_ttft_bare_s"] == overhead[-1]["bare_ttft_s"]
    assert result["summary"]["overhead"]["target"] == 1.15


def test_bare_forward_matches_a_plain_forward_and_crops_back(tiny_model: Any) -> None:
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    bare = BareForward(tiny_model)
    assert bare.first_token_seconds(ids[:30], 6) > 0
    assert bare.cache.get_seq_length() == 24 and bare.ids == ids[:24]  # cropped back to the prefix
    bare.first_token_seconds(ids, 10)  # extends what it holds
    assert bare.ids == ids[:30] and bare.cache.get_seq_length() == 30
    other = [7, *ids[1:]]
    bare.first_token_seconds(other, 5)  # a different history: rebuilt from scratch
    assert bare.ids == other[:35] and bare.cache.get_seq_length() == 35
    with torch.inference_mode():
        plain = tiny_model(input_ids=torch.tensor([other])).logits[0, -1]
        held = tiny_model(
            input_ids=torch.tensor([other[35:]]),
            position_ids=torch.arange(35, 40)[None],
            cache=bare.cache,
            use_cache=True,
        ).logits[0, -1]
    torch.testing.assert_close(held, plain, atol=1e-4, rtol=1e-4)


def test_decode_comparison_raises_no_future_warning(tiny_model: Any) -> None:
    ids = list(range(3, 23))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures = decode_rate_ratio(tiny_model, ids, new_tokens=3)
    assert figures["ratio"] > 0
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def test_overhead_summary_picks_the_first_turn_past_the_cache_size() -> None:
    def row(turn: int, new: int, cached: int, ratio: float) -> OverheadRow:
        return OverheadRow(turn, new, cached, ratio * 0.1, 0.1, ratio, 3)

    rows = [row(1, 28, 2900, 2.0), row(2, 218, 3010, 1.1), row(3, 28, 3250, 1.3), row(4, 28, 3300, 1.1)]
    summary = overhead_summary(rows)
    assert summary["short"]["turn"] == 3 and summary["short"]["worst_ratio"] == 1.3
    assert summary["short"]["median_ratio"] == pytest.approx(1.2) and not summary["short"]["within_target"]
    assert summary["long"]["turn"] == 2 and summary["long"]["within_target"]
