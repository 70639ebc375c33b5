"""What each rung costs the loaded model: measured once per model and quantization setting, cached on disk.

The placement planner (`agentkv.lifecycle.placement`) weighs holding a span at a
cheaper rung by the fraction of its value lost there. Those fractions differ by
model: a 135M model's attention is sharp enough that int4 keys move its next token,
a 7B model's barely. So they are measured on the model itself:

1. Encode a held-aside text (`CALIBRATION_TEXT`, not any benchmark's) once, the last
   `QUERY_TOKENS` tokens being the continuation to predict.
2. Hold the middle of the context (after the attention sinks) at each rung: its keys
   and values quantized and read back with the attended tier's arithmetic (KIVI,
   `agentkv.store.kivi`), or masked out (not attended).
3. The rung's cost is the mean KL(full || rung) of the next-token distributions
   over the continuation, as a fraction of the cost of not attending the span at all:
   0 = no loss, 1 = as bad as dropping it.

A rung that cannot be measured this way keeps a stated prior: an archived span is
not attended now but comes back exactly when recall finds it, so it loses
`ARCHIVE_MISS` of a drop (the chance recall misses it, not measurable on a text); a
quantized archive adds its measured quantization cost for the share recall finds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.runner import Feed, ModelRunner
from agentkv.config_sections import QuantizationConfig
from agentkv.lifecycle.rungs import DEFAULT_FIDELITY, Rung
from agentkv.models import cache_root
from agentkv.store.cache import PhysicalCache
from agentkv.store.key_planes import floor_key_bits as planes_floor
from agentkv.store.kivi import round_trip_keys, round_trip_values

logger = logging.getLogger("agentkv.calibration")

CALIBRATION_VERSION = 3
"""Bumped when the measurement changes, so cached figures of an older method are not reused."""

QUERY_TOKENS = 48
"""Continuation tokens whose next-token distributions are compared."""

SINK_TOKENS = 4
"""First positions left exact (the attended tier never quantizes them either)."""

ARCHIVE_MISS = DEFAULT_FIDELITY[Rung.ARCHIVED]
"""Prior share of a drop's loss an archived span costs: recall may not bring it back when needed."""

CALIBRATION_TEXT = """\
Minutes of the quarterly review, harbour logistics working group.
Present: Ilse Marwick (chair), Tobias Ferreira-Lund, Aoife Bramley, Kenji Okonkwo, Ruth Sandoval.
Item 1. The crane replacement at berth 6 is behind schedule. The supplier, Halvorsen Lifting AS,
confirmed delivery of the second trolley unit for week 41 instead of week 37. Order reference
HL-2291-B. Tobias noted that the temporary mobile crane costs 3,450 per day and that the budget line
MX-77 has 41,200 left, enough for roughly twelve more days.
Item 2. Reefer plugs. Aoife reported that 18 of the 240 reefer points on the east apron tripped during
the heat spell; 11 were traced to corroded sockets in rows R4 and R5, the rest to a faulty breaker in
substation SS-East-2. Replacement sockets are on order (PO 77815), expected in nine working days.
Until then, temperature-critical boxes go to rows R1 to R3 only.
Item 3. Gate throughput. The new appointment system moved average truck turnaround from 58 to 44
minutes. Peak queue at gate B still exceeds 30 trucks on Monday mornings; Kenji proposes opening lane
B4 from 05:30 on Mondays, staffed by two clerks moved from the night shift.
Item 4. Safety. One near miss: a straddle carrier reversed into a pedestrian walkway near block C12 on
the 3rd. No injuries. The walkway barriers will be extended by 40 metres and the carrier's reversing
camera, unit SC-19, was found disconnected and has been repaired.
Item 5. Any other business. Ruth asked that the next review be held on the 14th rather than the 21st,
because the auditors arrive on the 20th. Agreed.
Actions: Tobias to extend the mobile crane hire and report costs against MX-77; Aoife to confirm the
socket delivery date with the supplier; Kenji to draft the Monday staffing for lane B4; Ruth to move the
meeting. Summary for the board: the berth 6 crane now arrives in week 41, reefer capacity is reduced to
rows R1 to R3 until the sockets arrive, gate turnaround improved to 44 minutes, and the next review is on
the 14th, chaired again by Ilse Marwick, with the crane order HL-2291-B as the first item."""
"""A held-aside text: facts (codes, figures, names) stated early and restated in the last lines."""


@dataclass(frozen=True)
class RungCosts:
    """Measured costs of the rungs for one model and quantization setting."""

    fidelity: dict[str, float]
    """Rung name (`Rung.value`) -> fraction of a span's value lost there (0..1)."""
    kl: dict[str, float]
    """Rung name -> mean KL(full || rung) in nats over the continuation (the raw measurement)."""
    key: str
    """The cache key: model fingerprint, quantization setting and method version."""

    def as_fidelity(self, archive_tier: str = "host", host_bits: int | None = None) -> dict[Rung, float]:
        """The planner's input: a fraction for every rung, the archive's for the configured archive tier."""
        out = {rung: self.fidelity.get(rung.value, DEFAULT_FIDELITY[rung]) for rung in Rung}
        bits = {"int8": 8, "int4": 4}.get(archive_tier, host_bits if archive_tier == "host" else None)
        if bits is not None:
            out[Rung.ARCHIVED] = self.fidelity.get(f"archive{bits}", out[Rung.ARCHIVED])
        return out


def rung_costs(
    model: torch.nn.Module, tokenizer: Any, quantization: QuantizationConfig, *, cache_dir: Path | None = None
) -> RungCosts:
    """The model's rung costs for this quantization setting: from the disk cache, or measured and stored.

    Measuring costs one prefill of the text (~450 tokens) and one forward of
    `QUERY_TOKENS` tokens per rung; the figures are cached under `<cache root>/calibration/`.
    """
    key = _key(model, quantization)
    path = (cache_dir or cache_root() / "calibration") / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return RungCosts(fidelity=data["fidelity"], kl=data["kl"], key=data["key"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = measure_rung_costs(model, tokenizer, quantization, key=key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(costs), indent=1))
    except OSError as e:  # a read-only cache: measured again next time
        logger.warning("calibration: cannot cache rung costs at %s: %s", path, e)
    return costs


@torch.no_grad()
def measure_rung_costs(
    model: torch.nn.Module, tokenizer: Any, quantization: QuantizationConfig, *, key: str = ""
) -> RungCosts:
    """Measure every rung's KL against the full cache on `CALIBRATION_TEXT` (see the module docstring).

    Runs on agentkv's own cache and masks (`ModelRunner`, `PhysicalCache`), as a session
    attends: every layer holds every token of the context, and each layer type is masked
    by logical position, so a hybrid model's windowed layers see the window a plain
    forward shows them and its full layers the whole context, at every rung.
    """
    runner = ModelRunner(model)
    ids = list(tokenizer.encode(CALIBRATION_TEXT))
    n = len(ids)
    context = n - QUERY_TOKENS - 1
    if context <= SINK_TOKENS + quantization.group_size:
        msg = f"calibration text too short for this tokenizer ({n} tokens)"
        raise ValueError(msg)
    cache = PhysicalCache(runner.num_layers)
    runner.forward(cache, _feed(ids[:context], 0), logits="none")
    layers = cache.cache.managed_layers
    saved = [full for layer in layers if (full := layer.full()) is not None]  # each [1, H_kv, context, D]
    query = _feed(ids[context:], context)  # its logits predict ids[context + 1:]
    middle = slice(SINK_TOKENS, context)
    hidden = torch.arange(SINK_TOKENS, context)

    def continuation(*, transform: Any = None, hide: bool = False) -> torch.Tensor:
        """Log-probabilities `[Q, V]` of the continuation over the context held at one rung."""
        for layer, (keys, values) in zip(layers, saved, strict=True):
            keys, values = keys.clone(), values.clone()  # the exact context, each time
            if transform is not None:
                keys[:, :, middle], values[:, :, middle] = transform(keys[:, :, middle], values[:, :, middle])
            layer.set_all(keys, values)
        mask = runner.logical_mask(cache, query.positions, hidden=hidden if hide else None)
        try:
            logits = runner.forward(cache, query, logits="all", attention_mask=mask)
        finally:
            cache.truncate(context)
        if logits is None:
            msg = "calibration: the continuation forward returned no logits"
            raise RuntimeError(msg)
        return torch.log_softmax(logits[:-1].float(), dim=-1)

    reference = continuation()

    def kl_with(**how: Any) -> float:
        logp = continuation(**how)
        kl = float((reference.exp() * (reference - logp)).sum(-1).mean())
        return max(0.0, kl)  # >= 0 by definition; a lossless rung can round to -1e-8

    group = quantization.group_size
    bits = quantization.attended_bits or 4

    def at(key_bits: int, value_bits: int) -> Any:
        return lambda k, v: (
            round_trip_keys(k, key_bits, group).to(k.dtype),
            round_trip_values(v, value_bits, group).to(v.dtype),
        )

    kl = {
        Rung.KEYS8.value: kl_with(transform=at(8, bits)),
        Rung.ATTENDED_Q.value: kl_with(transform=at(floor_key_bits(quantization), bits)),
        "archive8": kl_with(transform=at(8, 8)),
        "archive4": kl_with(transform=at(4, 4)),
        Rung.DROPPED.value: kl_with(hide=True),
    }
    fidelity = fractions(kl)
    logger.info("calibration: rung costs %s (KL %s)", fidelity, kl)
    return RungCosts(fidelity=fidelity, kl=kl, key=key)


def _feed(ids: list[int], start: int) -> Feed:
    """Token ids at logical positions `start..`, as one span of the calibration text."""
    positions = list(range(start, start + len(ids)))
    return Feed(ids, positions, [0] * len(ids), positions)


def floor_key_bits(quantization: QuantizationConfig) -> int:
    """The key bits of the attended tier's floor: 8-bit keys drop to 4 under pressure, so 4 for them.

    The attended rung is what the budget may bring a span to (`AttendedFloor`): its bytes
    are the floor's, so its cost is measured at the floor's precision too.
    """
    bits = quantization.attended_bits or 4
    return planes_floor(quantization.attended_key_bits or bits)


def fractions(kl: dict[str, float]) -> dict[str, float]:
    """Each rung's KL as a share of not attending the span, clipped to 0..1 and ordered by rung.

    A cheaper rung never costs less than a dearer one (8-bit keys <= the attended tier's
    bits); an archive costs `ARCHIVE_MISS` of a drop plus, for the share recall finds,
    its quantization (`archive8` / `archive4`: the device archive tiers).
    """
    drop = kl[Rung.DROPPED.value]
    share = {name: min(1.0, max(0.0, value / drop)) if drop > 0 else 1.0 for name, value in kl.items()}
    keys8 = share[Rung.KEYS8.value]
    attended = max(keys8, share[Rung.ATTENDED_Q.value])
    out = {
        Rung.FULL.value: 0.0,
        Rung.KEYS8.value: keys8,
        Rung.ATTENDED_Q.value: attended,
        Rung.ARCHIVED.value: ARCHIVE_MISS,
        Rung.DROPPED.value: 1.0,
    }
    for tier in ("archive8", "archive4"):
        out[tier] = ARCHIVE_MISS + (1 - ARCHIVE_MISS) * share[tier]
    return out


def _key(model: torch.nn.Module, quantization: QuantizationConfig) -> str:
    """Model fingerprint (config, dtype, a sample of every weight) + quantization + method version."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    digest.update((config.to_json_string() if config is not None else type(model).__name__).encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 64)
        digest.update(name.encode())
        digest.update(flat[::step][:64].float().cpu().numpy().tobytes())
    digest.update(str(next(model.parameters()).dtype).encode())
    setting = (
        quantization.group_size,
        quantization.attended_bits,
        quantization.attended_key_bits,
        CALIBRATION_VERSION,
        hashlib.sha256(CALIBRATION_TEXT.encode()).hexdigest()[:8],
    )
    digest.update(repr(setting).encode())
    return digest.hexdigest()[:20]


def describe(costs: RungCosts) -> str:
    """One line: each rung's share of a drop and its KL."""
    parts = [
        f"{name} {costs.fidelity.get(name, math.nan):.3f} (KL {costs.kl[name]:.4f})"
        for name in costs.kl
        if name in costs.fidelity
    ]
    return ", ".join(parts)
