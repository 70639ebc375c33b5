"""llguidance against xgrammar on this machine: compile time per schema, mask time per token.

Both libraries get the default model's tokenizer and the 21 tool schemas of
`agentkv bench tools`. Compile: a fresh compile of each schema (the tokenizer
view is built once before timing; xgrammar's compiler cache is off). Mask: the
token mask computed before each token of a valid call's arguments (the argument
values are written by hand below, one per tool: the first prompt's answer),
then the token consumed; mean over every token.

    PYTHONPATH=.:integrations .venv/bin/python scripts/grammar_libraries.py
"""

from __future__ import annotations

import json
import statistics
import time
from importlib.metadata import version
from typing import Any

import llguidance
import llguidance.hf
import torch
import xgrammar

from agentkv import load_model
from agentkv.grammar import strict_schema
from agentkv.grammar.grammars import JSON_FORMAT
from agentkv_bench.tool_bench import load_tool_set


def sample_args(schema: dict[str, Any]) -> Any:
    """A small valid instance of `schema` (first enum value, smallest number, required keys)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema["type"]
    if kind == "object":
        return {k: sample_args(v) for k, v in schema["properties"].items() if k in schema.get("required", [])}
    if kind == "array":
        return [sample_args(schema["items"])] * max(1, schema.get("minItems", 1))
    return {
        "string": "Paris and the north",
        "integer": schema.get("minimum", 3),
        "number": schema.get("minimum", 2) + 0.5,
        "boolean": True,
    }[kind]


def main() -> None:
    """Measure both libraries and print one row each."""
    _, tokenizer = load_model(device="cpu")
    tools = load_tool_set()
    schemas = [strict_schema(t["parameters"]) for t in tools]
    texts = [json.dumps(sample_args(s)) for s in schemas]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    vocab = len(tokenizer)

    started = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer)
    ll_tok_s = time.perf_counter() - started
    started = time.perf_counter()
    xg_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    xg_compiler = xgrammar.GrammarCompiler(xg_info, max_threads=1, cache_enabled=False)
    xg_tok_s = time.perf_counter() - started

    results: dict[str, dict[str, float]] = {}
    ll_compile, ll_mask, xg_compile, xg_mask = [], [], [], []
    for schema, tokens in zip(schemas, ids, strict=True):
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": JSON_FORMAT})
        matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        ll_compile.append(time.perf_counter() - started)
        for token in tokens:
            started = time.perf_counter()
            matcher.compute_bitmask()
            ll_mask.append(time.perf_counter() - started)
            assert matcher.consume_token(token), matcher.get_error()

        started = time.perf_counter()
        compiled = xg_compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        xmatcher = xgrammar.GrammarMatcher(compiled)
        xg_compile.append(time.perf_counter() - started)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        for token in tokens:
            started = time.perf_counter()
            xmatcher.fill_next_token_bitmask(bitmask)
            xg_mask.append(time.perf_counter() - started)
            assert xmatcher.accept_token(token)
    for name, tok_s, compile_s, mask_s in (
        (f"llguidance {version('llguidance')}", ll_tok_s, ll_compile, ll_mask),
        (f"xgrammar {version('xgrammar')}", xg_tok_s, xg_compile, xg_mask),
    ):
        results[name] = {
            "tokenizer_s": tok_s,
            "compile_ms_median": 1000 * statistics.median(compile_s),
            "compile_ms_max": 1000 * max(compile_s),
            "mask_us_mean": 1e6 * statistics.mean(mask_s),
            "mask_us_p95": 1e6 * sorted(mask_s)[int(0.95 * len(mask_s))],
        }
    print(
        f"{len(schemas)} schemas, {sum(map(len, ids))} tokens, vocab {vocab}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'library':<22}{'tokenizer s':>12}{'compile ms med':>16}{'compile ms max':>16}"
        f"{'mask us mean':>14}{'mask us p95':>13}"
    )
    for name, r in results.items():
        print(
            f"{name:<22}{r['tokenizer_s']:>12.2f}{r['compile_ms_median']:>16.1f}{r['compile_ms_max']:>16.1f}"
            f"{r['mask_us_mean']:>14.0f}{r['mask_us_p95']:>13.0f}"
        )


if __name__ == "__main__":
    main()
