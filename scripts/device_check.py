"""Decode and prefill speed of the attended int4 tier and the pinned host tier, on one device.

Run on a CUDA machine (the lead's single short GPU run)::

    OUT=/some/dir python scripts/device_check.py            # CUDA; speed table < 4 min on one GPU

from the repository root with `PYTHONPATH=.:integrations:benchmarks` (the family matrix is
built by `tests/families.py`; `bench reuse` needs `agentkv_bench`);

or on a CPU to check the script itself::

    python scripts/device_check.py --cpu --context 1024 --decode 32

Where the default model cannot travel (its GGUF is 94 MiB), `--random-weights 135m` builds the
same architecture with random weights (speed does not depend on the values), and
`--random-weights 1b` a Llama-3.2-1B-like shape.

It loads the default model (SmolLM2-135M-Instruct) and, over the same token history,
measures:

- `full`: the full-precision attended cache (agentkv's physical cache);
- `int4-attended`: the attended quantized tier (`QuantizedAttendedLayer`, KIVI int4,
  groups of 32) under full pressure: after the prefill every token but the 4 sink
  positions and the 64-token residual window is quantized (as the budget does when
  nothing else fits), then decoded, dequantized per layer on every read;
- `int2-attended`: the same at int2; `k4v2-attended`: int4 keys, int2 values;
- `host-recall`: the whole history offloaded to the host tier (pinned memory on CUDA)
  and restored into the attended cache, then decoded at full precision: the restore
  rate (tokens/s and GB/s) against re-encoding the same tokens (the prefill rate).

On CUDA the same run then checks (each stage can be left out, and on a CPU each runs
only when asked):

- `--families`: every family of the matrix (`tests/families.py`, plus windowed Phi-3,
  Qwen2, Qwen3) on the device in fp32 and bf16, archive + restore, evict + rehydrate
  and a recall of a result several windows long, each against a plain forward on the
  same device and dtype (fp32 must agree within `DEVICE_TOL`; bf16 is reported);
- `--bench-reuse`: `agentkv bench reuse --turns 8` (its table and JSON under `$OUT`).

Prefill tokens/s time one forward over the history; decode tokens/s time greedy
single-token steps after it. Modes are measured in alternation, `--repeats` rounds,
and the median is reported, so a background load hits every mode alike. The table
is printed and, when `$OUT` is set, written to `$OUT/device_check.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentkv import load_model
from agentkv.backend.runner import Feed, ModelRunner
from agentkv.store.attended import QuantizedAttendedLayer
from agentkv.store.cache import LayerFactory, PhysicalCache, SharedPrefixLayer
from agentkv.store.host import HostBlock
from agentkv_bench.conversation import SYSTEM_PROMPT, build_conversation

MODES: dict[str, LayerFactory] = {
    "full": SharedPrefixLayer,
    "int4-attended": partial(QuantizedAttendedLayer, 4, 32, 64),
    "int2-attended": partial(QuantizedAttendedLayer, 2, 32, 64),
    "k4v2-attended": partial(QuantizedAttendedLayer, 2, 32, 64, 4),
}
SINK_TOKENS = 4
RESIDUAL_TOKENS = 64
"""What the attended modes keep in full precision (the store's defaults)."""


def history_ids(tokenizer: Any, tokens: int) -> list[int]:
    """A deterministic agent-like history (tool results, user facts) of exactly `tokens` ids."""
    text = SYSTEM_PROMPT
    for turn in build_conversation(turns=200, tool_words=120):
        text += "\n" + turn.user + ("\n" + turn.tool_result if turn.tool_result else "")
        if len(text) > tokens * 6:
            break
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) < tokens:
        msg = f"history too short: {len(ids)} tokens, wanted {tokens}"
        raise ValueError(msg)
    return ids[:tokens]


SHAPES: dict[str, dict[str, int]] = {
    # SmolLM2-135M-Instruct's architecture (the default model).
    "135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
    },
    # A Llama-3.2-1B-like shape, to see how the tiers scale with the model.
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 49152,
    },
}
"""Architectures for `--random-weights`: speed does not depend on the weights' values."""


def random_model(shape: str, device: str) -> Any:
    """A Llama of `shape` with random weights, for machines the default GGUF cannot travel to."""
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=16384, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def sync(device: torch.device) -> None:
    """Wait for queued device work (timings must include it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def feed_of(ids: list[int], start: int) -> Feed:
    """Tokens at logical positions `start…`, all in span 0."""
    n = len(ids)
    return Feed(list(ids), list(range(start, start + n)), [0] * n, list(range(start, start + n)))


def prefill(runner: ModelRunner, cache: PhysicalCache, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Encode `ids` into `cache`; returns (seconds, last logits)."""
    sync(runner.device)
    started = time.perf_counter()
    logits = runner.forward(cache, feed_of(ids, 0))
    sync(runner.device)
    assert logits is not None
    return time.perf_counter() - started, logits


def decode(runner: ModelRunner, cache: PhysicalCache, logits: torch.Tensor, start: int, steps: int) -> float:
    """Greedy single-token steps after position `start`; returns seconds."""
    token = int(logits.argmax())
    sync(runner.device)
    started = time.perf_counter()
    for i in range(steps):
        out = runner.forward(cache, feed_of([token], start + i))
        assert out is not None
        token = int(out.argmax())
    sync(runner.device)
    return time.perf_counter() - started


def measure_attended(
    runner: ModelRunner, factory: LayerFactory, ids: list[int], steps: int
) -> dict[str, float]:
    """Prefill and decode over a fresh cache made of `factory` layers."""
    cache = PhysicalCache(runner.num_layers, factory)
    with torch.inference_mode():
        seconds, logits = prefill(runner, cache, ids)
        sync(runner.device)
        started = time.perf_counter()
        cache.quantize_slots(torch.arange(SINK_TOKENS, max(SINK_TOKENS, len(ids) - RESIDUAL_TOKENS)))
        sync(runner.device)
        quantize_s = time.perf_counter() - started
        held = cache.nbytes()
        decode_s = decode(runner, cache, logits, len(ids), steps)
    return {
        "prefill_tok_s": len(ids) / seconds,
        "quantize_tok_s": len(ids) / quantize_s if quantize_s > 0 else 0.0,
        "decode_tok_s": steps / decode_s,
        "kv_bytes_after_prefill": float(held),
    }


def measure_host_recall(runner: ModelRunner, ids: list[int], steps: int) -> dict[str, float]:
    """Offload the history to the host tier, restore it, then decode over the restored cache."""
    cache = PhysicalCache(runner.num_layers)
    with torch.inference_mode():
        _, logits = prefill(runner, cache, ids)
        slots = torch.arange(cache.length)
        block = cache.extract(slots)
        host = HostBlock.offload(block, fresh=True)
        sync(runner.device)
        cache.truncate(0)
        del block
        nbytes = host.nbytes
        sync(runner.device)
        started = time.perf_counter()
        restored = host.restore(runner.device)
        cache.append_blocks([(0, restored, torch.arange(len(ids)))])
        sync(runner.device)
        restore_s = time.perf_counter() - started
        decode_s = decode(runner, cache, logits, len(ids), steps)
    return {
        "restore_tok_s": len(ids) / restore_s,
        "restore_gb_s": nbytes / restore_s / 1e9,
        "decode_tok_s": steps / decode_s,
        "host_bytes": float(nbytes),
        "pinned": float(all(t.is_pinned() for t in (*host.block.keys, *host.block.values))),
    }


DEVICE_TOL = 1e-3
"""fp32 tolerance on a GPU (TF32-free, but kernels sum in another order than the CPU's)."""


def family_matrix(device: str) -> list[dict[str, Any]]:
    """Each family and move on `device`, fp32 and bf16: max |logit| delta against a plain forward."""
    from tests.conftest import build_tiny_tokenizer
    from tests.unit.window_models import (
        FULL_CASES,
        MOVES,
        WINDOWED_CASES,
        build_case,
        logit_delta,
        open_session,
    )

    tokenizer = build_tiny_tokenizer()
    rows: list[dict[str, Any]] = []
    for case in WINDOWED_CASES + FULL_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for move, apply in MOVES.items():
                row: dict[str, Any] = {
                    "family": case,
                    "dtype": str(dtype).removeprefix("torch."),
                    "move": move,
                }
                try:
                    model = copy.deepcopy(build_case(case)).to(device=device, dtype=dtype)
                    session = open_session(model, tokenizer)
                    apply(session)
                    row["max_abs_logit_delta"] = logit_delta(session, model)
                except Exception as e:  # a family that fails here is reported, the others still run
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
    return rows


def print_family_matrix(rows: list[dict[str, Any]]) -> int:
    """Print the matrix; returns how many fp32 rows failed (an error, or beyond `DEVICE_TOL`)."""
    failed = 0
    print(f"{'family':14} {'dtype':9} {'move':16} {'max |dlogit|':>13}")
    for row in rows:
        delta = row.get("max_abs_logit_delta")
        bad = "error" in row or (row["dtype"] == "float32" and delta is not None and delta > DEVICE_TOL)
        failed += int(bad)
        shown = row.get("error", f"{delta:13.3g}")
        print(f"{row['family']:14} {row['dtype']:9} {row['move']:16} {shown}{'  FAIL' if bad else ''}")
    return failed


def bench_reuse(out: str | None) -> int:
    """`agentkv bench reuse --turns 8` in a child process (its own device choice); its exit status."""
    command = [sys.executable, "-m", "agentkv.cli", "bench", "reuse", "--turns", "8", "--no-progress"]
    if out:
        command += ["--out", str(Path(out) / "bench_reuse")]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, check=False).returncode


def median_rows(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per mode and figure, the median over rounds."""
    out: dict[str, dict[str, float]] = {}
    for mode in rounds[0]:
        out[mode] = {k: statistics.median(r[mode][k] for r in rounds) for k in rounds[0][mode]}
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print the table, write JSON to `$OUT`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script; slow)")
    parser.add_argument("--context", type=int, default=None, help="history tokens (CUDA 4096, CPU 1024)")
    parser.add_argument("--decode", type=int, default=None, help="decode steps (CUDA 128, CPU 32)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds (median reported)")
    parser.add_argument(
        "--random-weights",
        choices=sorted(SHAPES),
        help="random weights of this architecture instead of the default model (speed only; no tokenizer)",
    )
    parser.add_argument(
        "--modes",
        default=",".join([*MODES, "host-recall"]),
        help="comma-separated modes to measure (`full` is always measured: the ratios' base)",
    )
    parser.add_argument(
        "--families", action="store_true", help="the family matrix on the device (default on CUDA)"
    )
    parser.add_argument(
        "--bench-reuse", action="store_true", help="`bench reuse --turns 8` (default on CUDA)"
    )
    parser.add_argument("--no-families", action="store_true", help="leave the family matrix out")
    parser.add_argument("--no-bench-reuse", action="store_true", help="leave `bench reuse` out")
    args = parser.parse_args(argv)
    wanted = {"full", *args.modes.split(",")}
    unknown = wanted - {*MODES, "host-recall"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join([*MODES, 'host-recall'])}")
    if not args.cpu and not torch.cuda.is_available():
        print(
            "device_check: no CUDA device here; run with --cpu to check the script on the CPU",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if args.cpu else "cuda"
    context = args.context or (1024 if args.cpu else 4096)
    steps = args.decode or (32 if args.cpu else 128)
    started = time.perf_counter()
    if args.random_weights:
        model = random_model(args.random_weights, device)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(model.config.vocab_size, (context,), generator=generator).tolist()
    else:
        model, tokenizer = load_model(device=device)
        ids = history_ids(tokenizer, context)
    runner = ModelRunner(model)
    measure: dict[str, Callable[[], dict[str, float]]] = {
        name: partial(measure_attended, runner, factory, ids, steps)
        for name, factory in MODES.items()
        if name in wanted
    }
    if "host-recall" in wanted:
        measure["host-recall"] = partial(measure_host_recall, runner, ids, steps)
    measure_attended(runner, SharedPrefixLayer, ids[:256], 4)  # warm-up: kernels, allocator
    rounds = [{name: fn() for name, fn in measure.items()} for _ in range(max(1, args.repeats))]
    rows = median_rows(rounds)
    base = rows["full"]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "model": getattr(model.config, "name_or_path", type(model).__name__),
        "dtype": str(runner.dtype),
        "context_tokens": context,
        "decode_steps": steps,
        "repeats": args.repeats,
        "fp_kv_bytes": context * runner.bytes_per_token,
        "rows": rows,
        # Paired: each round's ratio to the `full` run next to it, then the median (a load that
        # comes and goes hits both sides of a pair alike).
        "decode_vs_full": {
            m: statistics.median(r[m]["decode_tok_s"] / r["full"]["decode_tok_s"] for r in rounds)
            for m in rows
        },
        "wall_seconds": time.perf_counter() - started,
    }
    where = f"{result['device']} ({result['dtype']})"
    print(f"device_check on {where}, {context} history tokens, {steps} decode steps")
    print(f"{'mode':16} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs full':>15} {'KV bytes':>12}")
    for mode, r in rows.items():
        kv = r.get("kv_bytes_after_prefill", r.get("host_bytes", 0.0))
        prefill_s = r.get("prefill_tok_s")
        shown = f"{prefill_s:14,.0f}" if prefill_s is not None else f"{'—':>14}"
        ratio = result["decode_vs_full"][mode]
        print(f"{mode:16} {shown} {r['decode_tok_s']:13,.1f} {ratio:15.2f} {kv:12,.0f}")
    recall = rows.get("host-recall")
    if recall is not None:
        print(
            f"host-recall restore: {recall['restore_tok_s']:,.0f} tok/s, {recall['restore_gb_s']:.2f} GB/s "
            f"(re-encoding: {base['prefill_tok_s']:,.0f} tok/s); pinned={bool(recall['pinned'])}"
        )
    out = os.environ.get("OUT")
    status = 0
    if (args.families or not args.cpu) and not args.no_families:
        result["families"] = family_matrix(device)
        failed = print_family_matrix(result["families"])
        print(f"family matrix: {failed} fp32 rows failed (tolerance {DEVICE_TOL})")
        status |= int(failed > 0)
    if out:
        path = Path(out) / "device_check.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    if (args.bench_reuse or not args.cpu) and not args.no_bench_reuse:
        status |= int(bench_reuse(out) != 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
