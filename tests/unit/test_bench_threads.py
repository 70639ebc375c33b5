"""`agentkv bench threads` on the tiny model: the prefix is encoded once and answers do not change."""

from __future__ import annotations

import json

from agentkv_bench.threads import run_threads_bench, system_prompt


def test_threads_bench_shares_the_prefix_and_keeps_the_answers(tiny_model, tiny_tokenizer, tmp_path):
    system = system_prompt()[:600]
    result = run_threads_bench(
        tiny_model, tiny_tokenizer, counts=(1, 3), turns=2, max_new_tokens=3, system=system, out_dir=tmp_path
    )
    assert json.loads((tmp_path / "threads.json").read_text())["rows"] == result["rows"]
    one, three = result["rows"]
    assert one["answers_identical"] and three["answers_identical"]
    assert one["shared_prefix_tokens"] == 0  # a single thread has no one to share with
    prefix = three["shared_prefix_tokens"] // 2  # threads 2 and 3 took it from the cache
    assert prefix >= result["settings"]["system_prompt_tokens"] // 2
    assert three["prefill_tokens_unshared"] - three["prefill_tokens_shared"] == 2 * prefix
    # Device bytes: one prefix for all threads instead of one per thread.
    per_token = tiny_model.config.num_hidden_layers * 2 * 2 * 16 * 4  # layers, K+V, kv heads, dim, fp32
    assert three["device_bytes_unshared"] - three["device_bytes_shared"] == 2 * prefix * per_token
    assert three["prefix_bytes"] == prefix * per_token
