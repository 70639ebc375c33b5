"""Fault injection for one session: make offload, restore, quantization, a policy or a forward fail.

The lifecycle promises that a failure inside the cache machinery never loses what
the agent said: a failed offload keeps the span on the device, a failed restore
recomputes the span from its token ids, a failing policy keeps the whole span, a
full host tier is a recorded fault, not a crash. `inject_faults` is how tests
(and curious users) check those promises: it patches the failing step *on one
session's objects only* (its store, its cache layers, its policy instance), so
other sessions on the same backend and model keep working, and it puts every
patch back on exit, even when the body raises.

Example:
    >>> with inject_faults(session, "offload", times=2) as fault:  # doctest: +SKIP
    ...     session.extend(history)  # budget pressure: the first two offloads fail
    >>> fault.injected, session.stats().faults  # doctest: +SKIP
    (2, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentkv.store.host import HostMemoryError

if TYPE_CHECKING:
    from agentkv.backend.session import Session
    from agentkv.spans import Span, Tier
    from agentkv.store.protocol import MoveResult

FAULT_SITES: tuple[str, ...] = (
    "offload",
    "host_limit",
    "quantize",
    "attended",
    "restore",
    "policy",
    "forward",
)
"""Where a fault can be injected.

- `offload`: moving a span to the host tier raises (e.g. pinned memory could not be allocated).
- `host_limit`: the host tier is full: the offload raises `HostMemoryError`.
- `quantize`: moving a span to the int8/int4 tier raises.
- `attended`: holding spans quantized in attention fails *half way*, after the first half of
  the layers were rewritten (an out-of-memory while building codes), so layers disagree on
  which slots are quantized until a later demotion completes them.
- `restore`: bringing an archived span back fails *half way*, after some layers were
  written (an out-of-memory in the middle of the copy), so the store must roll back.
- `policy`: the policy's `score` / `select` raise (a buggy user policy).
- `forward`: a model forward over this session's cache fails half way (after some
  layers appended their KV), whatever called it: prefill, decode or rehydration.
"""


class InjectedFault(RuntimeError):
    """An error raised on purpose by `inject_faults` (never by agentkv itself)."""


@dataclass
class FaultInjection:
    """What an `inject_faults` block did; read it after (or during) the block."""

    where: str
    """The fault site, one of `FAULT_SITES`."""
    times: int | None
    """How many faults to raise; None = every time the site is reached."""
    skip: int = 0
    """Arrivals at the site let through before the first fault (e.g. fail the 3rd forward)."""
    injected: int = 0
    """Faults raised so far."""
    reached: int = 0
    """Times the site was reached (faulted or not)."""

    def fire(self) -> bool:
        """Count one arrival at the site; True when this one must fail."""
        self.reached += 1
        if self.reached <= self.skip or (self.times is not None and self.injected >= self.times):
            return False
        self.injected += 1
        return True


@contextmanager
def inject_faults(
    session: Session, where: str, *, times: int | None = 1, skip: int = 0
) -> Iterator[FaultInjection]:
    """Make one step of one session's cache machinery fail, `times` times, inside the block.

    Args:
        session: The session whose store, cache layers or policy are patched.
        where: One of `FAULT_SITES`.
        times: Faults to raise before the site works again; None = every time.
        skip: Arrivals at the site to let through first (`forward` with `skip=1` fails
            the first decode step after a prefill, not the prefill).

    Yields:
        A `FaultInjection` counting the faults raised.

    Raises:
        ValueError: Unknown `where`, a negative `times` or `skip`, or `policy` on a session
            without a policy.
    """
    if where not in FAULT_SITES:
        msg = f"inject_faults: unknown site {where!r}; allowed: {', '.join(FAULT_SITES)}"
        raise ValueError(msg)
    if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times < 0):
        msg = f"inject_faults: times must be an int >= 0 or None, got {times!r}"
        raise ValueError(msg)
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        msg = f"inject_faults: skip must be an int >= 0, got {skip!r}"
        raise ValueError(msg)
    fault = FaultInjection(where, times, skip)
    undo: list[Callable[[], None]] = []
    try:
        if where in ("offload", "host_limit", "quantize"):
            undo.append(_patch(session.store, "archive", _failing_archive(session, fault)))
        elif where == "attended":
            undo.append(_patch(session.store.physical, "quantize_slots", _failing_attended(session, fault)))
        elif where == "restore":
            undo.append(_patch(session.store, "restore_many", _failing_restore(session, fault)))
        elif where == "policy":
            undo.extend(_patch_policy(session, fault))
        else:
            undo.append(_patch_middle_layer(session, lambda: fault.fire(), "forward"))
        yield fault
    finally:
        for restore in reversed(undo):
            restore()


# -- patches (instance attributes: only this session's objects change) --------------------------------


def _patch(obj: object, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Shadow a method with an instance attribute; the returned callable removes it again."""
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, replacement)

    def restore() -> None:
        if had_own:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)

    return restore


def _failing_archive(session: Session, fault: FaultInjection) -> Callable[[Span, str], Tier]:
    store = session.store
    original = store.archive
    tiers = ("host",) if fault.where in ("offload", "host_limit") else ("int8", "int4")

    def archive(span: Span, tier: str) -> Tier:
        if tier in tiers and fault.fire():
            if fault.where == "host_limit":
                # What the real check raises when the tier is full: the limit is what is held now.
                held = store.host_bytes()
                adding = max(1, span.held_tokens * store.physical.bytes_per_token())
                raise HostMemoryError(held, adding, held)
            what = "offload to the host tier" if tier == "host" else f"quantization to {tier}"
            msg = f"injected fault: {what} of span {span.span_id} failed"
            raise InjectedFault(msg)
        return original(span, tier)

    return archive


def _failing_attended(session: Session, fault: FaultInjection) -> Callable[..., int]:
    physical = session.store.physical
    original = physical.quantize_slots

    def quantize_slots(slots: Any) -> int:
        if not fault.fire():
            return original(slots)
        # Quantize the first half of the layers, then fail, as an allocation failure would.
        physical.compact_pending()
        layers = physical.cache.managed_layers
        if physical.ensure_quantizable():
            layers = physical.cache.managed_layers
            type(layers[0]).quantize_all(layers[: len(layers) // 2], slots)
        msg = f"injected fault: quantization in attention failed half way ({len(layers)} layers)"
        raise InjectedFault(msg)

    return quantize_slots


def _failing_restore(session: Session, fault: FaultInjection) -> Callable[[Sequence[Span]], MoveResult]:
    store = session.store
    original = store.restore_many

    def restore_many(spans: Sequence[Span]) -> MoveResult:
        if not fault.fire():
            return original(spans)
        # Fail in the middle of the copy back, after the first layers were written.
        remove = _patch_middle_layer(session, lambda: True, "restore")
        try:
            return original(spans)
        finally:
            remove()

    return restore_many


def _patch_middle_layer(session: Session, should_fail: Callable[[], bool], what: str) -> Callable[[], None]:
    """Make the middle cache layer's `update` fail, so earlier layers have already grown."""
    layers = session.store.physical.cache.managed_layers
    layer = layers[len(layers) // 2]
    original = layer.update

    def update(key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        if should_fail():
            msg = f"injected fault: {what} failed half way (layer {layers.index(layer)} of {len(layers)})"
            raise InjectedFault(msg)
        return original(key_states, value_states, *args, **kwargs)

    return _patch(layer, "update", update)


def _patch_policy(session: Session, fault: FaultInjection) -> list[Callable[[], None]]:
    policy = session.manager.policy
    if policy is None:
        msg = f"inject_faults: session {session.session_id!r} has no policy to fail (policy 'full'?)"
        raise ValueError(msg)
    undo: list[Callable[[], None]] = []
    for name in ("score", "select", "span_score"):
        original = getattr(policy, name, None)
        if original is None:
            continue

        def failing(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            if fault.fire():
                msg = f"injected fault: {type(policy).__name__}.{_name} raised"
                raise InjectedFault(msg)
            return _original(*args, **kwargs)

        undo.append(_patch(policy, name, failing))
    return undo
