r"""Quantization-only probe: each question asked over the whole history with its KV fake-quantized.

The first 4 (sinks) and last 64 (residual window) history tokens stay exact, nothing is evicted
and no lifecycle runs: what is left is the error of the attended tier's arithmetic alone. Per
question and variant (k4v4 = keys and values at 4 bits, KIVI layout, groups of 32; k8v4 = keys at
8; -hv = values rotated by a Hadamard matrix first; -prerope = keys quantized before RoPE, as
KVQuant does; -hk-tok = keys rotated and quantized per token, as QuaRot does): greedy exact match
and the teacher-forced log-probability of the gold answer.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/quant_probe.py --workloads ferry,bakery \\
        --variants k4v4,k8v8,k4v8,k8v4 --out runs/probe.json
"""

import argparse
import copy
import json
import math
from pathlib import Path

import torch
from transformers import DynamicCache

from agentkv.backend.transformers import TransformersBackend
from agentkv.chat import normalize_messages
from agentkv.models import load_model
from agentkv_bench.memory import ANSWER_EXTRA_TOKENS, replay
from agentkv_bench.methods import METHODS
from agentkv_bench.scoring import answer_text, decided, exact_match
from agentkv_bench.workloads import load_workloads

SINK, RECENT, G = 4, 64, 32


def fq_along(x, bits, dim):
    """Fake-quantize (quantize, then dequantize) along `dim`, asymmetric round-to-nearest."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    lo = lo.half().float()
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
    q = torch.round((x - lo) / scale).clamp(0, 2**bits - 1)
    return q * scale + lo


def fq_keys_channel(k, bits):  # [B,H,n,D], groups of G tokens per channel
    """Keys per channel over groups of G tokens (KIVI)."""
    b, h, n, d = k.shape
    out = torch.empty_like(k)
    for s in range(0, n, G):
        out[:, :, s : s + G] = fq_along(k[:, :, s : s + G], bits, 2)
    return out


def fq_tok(v, bits, g=G):  # per token, groups of g channels
    """Per token, over groups of `g` channels (KIVI values)."""
    b, h, n, d = v.shape
    x = v.reshape(b, h, n, d // g, g)
    return fq_along(x, bits, -1).reshape(b, h, n, d)


def fq_tok_high_crumb(v, g=G):  # per token, groups of g channels
    """4-bit value codes read from their top 2 bits alone, at the middle of each 4-code bucket."""
    b, h, n, d = v.shape
    x = v.reshape(b, h, n, d // g, g)
    lo = x.amin(dim=-1, keepdim=True).half().float()
    scale = ((x.amax(dim=-1, keepdim=True) - lo) / 15).clamp_min(1e-8)
    q = torch.round((x - lo) / scale).clamp(0, 15)
    coarse = torch.div(q, 4, rounding_mode="floor") * 4 + 1.5
    return (coarse * scale + lo).reshape(b, h, n, d)


def hadamard(d):
    """The normalized `d x d` Hadamard matrix (d a power of two)."""
    H = torch.ones(1, 1)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / math.sqrt(d)


def rotate_half(x):
    """The RoPE helper of Llama-type models."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def variant_fn(name, cos, sin):
    """The fake quantization of one variant: `(keys, values) -> (keys, values)`."""

    def kv(k, v):
        d = k.shape[-1]
        Hd = hadamard(d)
        if name == "k4v4":
            return fq_keys_channel(k, 4), fq_tok(v, 4)
        if name == "k8v8":
            return fq_keys_channel(k, 8), fq_tok(v, 8)
        if name == "k4v8":
            return fq_keys_channel(k, 4), fq_tok(v, 8)
        if name == "k8v4":
            return fq_keys_channel(k, 8), fq_tok(v, 4)
        if name == "k4v2":
            return fq_keys_channel(k, 4), fq_tok(v, 2)
        if name == "k4v2-plane":
            return fq_keys_channel(k, 4), fq_tok_high_crumb(v)
        if name == "k2v2":
            return fq_keys_channel(k, 2), fq_tok(v, 2)
        if name == "k4v4-hv":
            return fq_keys_channel(k, 4), fq_tok(v @ Hd, 4) @ Hd.T
        if name == "k4v4-v16":
            return fq_keys_channel(k, 4), fq_tok(v, 4, 16)
        if name == "k4v4-prerope":
            c, s = cos[..., : k.shape[2], :], sin[..., : k.shape[2], :]
            pre = k * c - rotate_half(k) * s
            pq = fq_keys_channel(pre, 4)
            return pq * c + rotate_half(pq) * s, fq_tok(v, 4)
        if name == "k4v4-prerope-hv":
            c, s = cos[..., : k.shape[2], :], sin[..., : k.shape[2], :]
            pre = k * c - rotate_half(k) * s
            pq = fq_keys_channel(pre, 4)
            return pq * c + rotate_half(pq) * s, fq_tok(v @ Hd, 4) @ Hd.T
        if name == "k4v4-hk-tok":
            return fq_tok(k @ Hd, 4) @ Hd.T, fq_tok(v @ Hd, 4) @ Hd.T
        raise KeyError(name)

    return kv


@torch.no_grad()
def answer(model, cache, rest_ids, start, gold, max_new, tok, fmt):
    """Greedy answer of the question over `cache`, stopped as the bench stops it."""
    cache = copy.deepcopy(cache)
    ids = torch.tensor([rest_ids])
    pos = torch.arange(start, start + len(rest_ids))[None]
    out = model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True)
    logits = out.logits[0, -1]
    _pieces, n = [], start + len(rest_ids)
    stops = fmt.stop_token_ids()
    gen = []
    for _ in range(max_new):
        t = int(logits.argmax())
        if t in stops:
            break
        gen.append(t)
        text = tok.decode(gen)
        if "\n" in text or decided(text, gold):
            break
        out = model(
            input_ids=torch.tensor([[t]]), cache=cache, position_ids=torch.tensor([[n]]), use_cache=True
        )
        n += 1
        logits = out.logits[0, -1]
    return tok.decode(gen).split("\n")[0]


@torch.no_grad()
def gold_lp(model, cache, rest_ids, target, start):
    """Teacher-forced log-probability of the gold answer tokens."""
    cache = copy.deepcopy(cache)
    ids = torch.tensor([rest_ids + target])
    pos = torch.arange(start, start + ids.shape[1])[None]
    lg = model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True).logits[0].float().log_softmax(-1)
    p = len(rest_ids)
    return float(sum(lg[p - 1 + i, t] for i, t in enumerate(target)))


def main():
    """Probe each workload: one history forward, then every question over every variant."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--variants", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model, tok = load_model()
    model.eval()
    variants = a.variants.split(",")
    rows = []
    for w in load_workloads(a.workloads.split(",")):
        backend = TransformersBackend(model, tok, METHODS["full"].config(None))
        session = backend.session(w.name)
        history = replay(session, w, events=False)
        fmt = session.format
        session.extend(history)
        hist_ids = list(session.token_ids())
        qprompts = []
        for q in w.questions:
            msgs = [*history, {"role": "user", "content": q.question, "id": f"q-{q.id}"}]
            session.extend(msgs)
            ids = (
                list(session.token_ids())
                + fmt.generation_prompt_ids(normalize_messages(msgs))
                + fmt.encode(q.prefix)
            )
            qprompts.append(ids)
        L = 0
        while (
            all(len(p) > L and p[L] == qprompts[0][L] for p in qprompts)
            and len(hist_ids) > L
            and hist_ids[L] == qprompts[0][L]
        ):
            L += 1
        base = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([hist_ids[:L]]), cache=base, use_cache=True)
        pos = torch.arange(L)[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = cos[:, None], sin[:, None]  # [1,1,L,D]
        caches = {"full": base}
        for v in variants:
            c = copy.deepcopy(base)
            fn = variant_fn(v, cos, sin)
            for layer in c.layers:
                k, vv = layer.keys, layer.values
                qs, qe = SINK, L - RECENT
                kq, vq = fn(k[:, :, :qe], vv[:, :, :qe])
                layer.keys = torch.cat([k[:, :, :qs], kq[:, :, qs:qe], k[:, :, qe:]], 2)
                layer.values = torch.cat([vv[:, :, :qs], vq[:, :, qs:qe], vv[:, :, qe:]], 2)
            caches[v] = c
        for q, ids in zip(w.questions, qprompts, strict=False):
            rest = ids[L:]
            target = fmt.encode(answer_text(q.prefix, q.gold))
            row = {"workload": w.name, "q": q.id, "source": q.source}
            for name, c in caches.items():
                ans = answer(model, c, rest, L, q.gold, len(target) + ANSWER_EXTRA_TOKENS, tok, fmt)
                row[name] = [int(exact_match(ans, q.gold)), gold_lp(model, c, rest, target, L), ans]
            rows.append(row)
            print(w.name, q.id, {k: row[k][:2] for k in caches}, flush=True)
        backend.close(session.session_id)
        Path(a.out).write_text(json.dumps(rows, indent=1))
    for name in ["full", *variants]:
        em = sum(r[name][0] for r in rows)
        gap = sum(r[name][1] - r["full"][1] for r in rows) / max(1, len(rows))
        print(f"{name:16s} EM {em}/{len(rows)}  mean gold log-prob vs full {gap:+.3f}")


main()
