"""`AdmissionGate`: load control by working set for the conversations of one engine backend.

Why a gate: when the live conversations' histories do not fit the engine's cache (vLLM
blocks + LMCache L1/L2), agents that come back in turn make every cache thrash: each
call finds its own history evicted by the others' (LRU on a cyclic pattern), and hints
cannot help because every L2 hit is staged through a small L1 that everyone in flight
fills. The classical fix is load control (Denning, "The working set model for program
behavior", CACM 1968): run only as many programs as whose working sets fit, let the
others wait. Continuum (Li et al. 2025, "KV cache time-to-live for multi-turn agents")
applies it to agents: keep a conversation's KV across its tool calls, schedule by it.

The policy, in one place:

- A conversation issues a model call only while *resident* (`acquire` makes it resident
  or waits). Its working set is the prompt it sends (its whole attended history).
- Residency is granted in order of arrival (FIFO, strict: a later, smaller conversation
  never overtakes the head of the line, so a large one is not starved) while the
  residents' working sets plus the head's fit `capacity_tokens`. With nobody resident the
  head is admitted whatever its size: an oversized conversation runs alone (no deadlock).
- A resident keeps its residency across its model calls, its tool calls and its turns. It
  gives it up
  - at session close (`release`);
  - at a turn end when others wait and it has had `quantum_turns` turns in this
    residency (fair share: round robin by quanta, a yielder joins the back of the line);
  - at a turn end when the residents have outgrown the capacity (histories grow) and it
    is the most recently admitted one (load shedding, youngest first);
  - when others wait and it has been idle longer than a TTL: `tool_ttl_s` between the
    calls of a turn (a stalled tool), `park_ttl_s` after its turn ended (an idle user).
    Never during a model call.
- A wait is bounded by `wait_s`: then the call proceeds unadmitted (logged and counted)
  and the conversation keeps its place in line. Correctness never depends on the gate:
  the prompt carries the whole truth, the gate only decides *when* a call goes out.

`on_change` hears the new order (residents in admission order, then the line) and the
residents' working sets after every change: the fleet's pin planner grants its room in
that order, reserving each resident's working set, so pins go to the residents first and
then to the next in line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger("agentkv.engines")

Phase = Literal["call", "between_calls", "parked"]
"""Where a resident is: a model call in flight, between the calls of a turn (tools), turn ended."""

Outcome = Literal["resident", "admitted", "alone", "timeout"]
"""How `acquire` ended: already resident, admitted (after a wait or not), admitted alone
(its working set alone exceeds the capacity), or the wait timed out (proceeds unadmitted)."""

_TICK_S = 0.5
"""Waiters look again this often (idle TTLs expire without anyone notifying)."""


@dataclass(frozen=True)
class Admission:
    """What `acquire` answered: whether the call goes out resident, and how long it waited."""

    owner: str
    resident: bool
    outcome: Outcome
    waited_s: float


@dataclass
class AdmissionStats:
    """Counters of the gate (all conversations together)."""

    admitted: int = 0
    admitted_alone: int = 0
    waits: int = 0
    """Calls that found no room and waited."""
    timeouts: int = 0
    """Waits that ran past `wait_s` (the call went out unadmitted)."""
    yielded_quantum: int = 0
    shed: int = 0
    revoked_idle: int = 0
    waited_s_total: float = 0.0
    waited_s_max: float = 0.0


@dataclass
class _Resident:
    tokens: int
    last_active: float
    phase: Phase = "between_calls"
    calls_in_flight: int = 0
    turns: int = 0
    """Turns ended in this residency (the quantum counts them)."""


@dataclass
class AdmissionGate:
    """Residency for as many conversations as whose working sets fit `capacity_tokens`.

    Args:
        capacity_tokens: tokens the residents' working sets may hold together.
        quantum_turns: turns a resident keeps its residency while others wait.
        wait_s: most seconds one `acquire` waits; then it proceeds unadmitted.
        tool_ttl_s: idle seconds between the calls of a turn before others may take the place.
        park_ttl_s: idle seconds after a turn ended before others may take the place.
        on_change: told the order (residents in admission order, then the line) and the
            residents' working sets after a change (`EnginePinPlanner.prioritize`).
        clock: monotonic seconds (tests pass a fake one to expire TTLs without sleeping).
    """

    capacity_tokens: int
    quantum_turns: int = 4
    wait_s: float = 300.0
    tool_ttl_s: float = 60.0
    park_ttl_s: float = 10.0
    on_change: Callable[[Sequence[str], Mapping[str, int]], None] | None = None
    clock: Callable[[], float] = time.monotonic
    stats: AdmissionStats = field(default_factory=AdmissionStats)
    _residents: dict[str, _Resident] = field(default_factory=dict, init=False, repr=False)
    """Owner -> residency, in order of admission (dicts keep insertion order)."""
    _line: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    """Owner -> working set, of the conversations waiting, in order of arrival."""
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("capacity_tokens", "quantum_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                msg = f"{name}: expected an int > 0, got {value!r}"
                raise ValueError(msg)
        for name in ("wait_s", "tool_ttl_s", "park_ttl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                msg = f"{name}: expected a number > 0, got {value!r}"
                raise ValueError(msg)

    # -- what a session calls --------------------------------------------------------------------

    def acquire(self, owner: str, working_set_tokens: int) -> Admission:
        """Block until `owner` is resident (or `wait_s` passed); a resident returns at once."""
        tokens = _checked_tokens(working_set_tokens)
        started = self.clock()
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            resident = self._residents.get(owner)
            if resident is not None:
                self._start_call(resident, tokens)
                return Admission(owner, True, "resident", 0.0)
            self._line[owner] = tokens  # a conversation that timed out before keeps its place
            self._admit()
            waited = owner not in self._residents
            if waited:
                self.stats.waits += 1
            while owner not in self._residents:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return self._timed_out(owner, started)
                self._cond.wait(timeout=min(remaining, _TICK_S))
                self._admit()
            resident = self._residents[owner]
            self._start_call(resident, tokens)
            alone = tokens > self.capacity_tokens
            waited_s = self.clock() - started if waited else 0.0
            self._note_wait(waited_s)
            return Admission(owner, True, "alone" if alone else "admitted", waited_s)

    def call_done(self, owner: str, working_set_tokens: int) -> None:
        """A model call of `owner` ended (answered or failed): it is between calls now."""
        tokens = _checked_tokens(working_set_tokens)
        with self._cond:
            resident = self._residents.get(owner)
            if resident is None:
                return
            resident.calls_in_flight = max(0, resident.calls_in_flight - 1)
            resident.tokens = tokens
            resident.last_active = self.clock()
            if resident.calls_in_flight == 0:
                resident.phase = "between_calls"
            self._admit()

    def turn_ended(self, owner: str, working_set_tokens: int) -> bool:
        """`owner` ended a turn; True = it stays resident, False = it gave its place up (or had none)."""
        tokens = _checked_tokens(working_set_tokens)
        with self._cond:
            resident = self._residents.get(owner)
            if resident is None:
                return False
            resident.tokens = tokens
            resident.turns += 1
            resident.last_active = self.clock()
            if resident.calls_in_flight == 0:
                resident.phase = "parked"
            youngest = next(reversed(self._residents))
            if len(self._residents) > 1 and self._used() > self.capacity_tokens and owner == youngest:
                self.stats.shed += 1
                logger.info("admission: %s yields (residents outgrew %d tokens)", owner, self.capacity_tokens)
            elif self._line and resident.turns >= self.quantum_turns:
                self.stats.yielded_quantum += 1
                logger.info("admission: %s yields after %d turns (others wait)", owner, resident.turns)
            else:
                return True
            del self._residents[owner]
            self._admit(changed=True)
            return False

    def release(self, owner: str) -> None:
        """The conversation closed: its place (resident or in line) goes to the next ones."""
        with self._cond:
            was_there = self._residents.pop(owner, None) is not None
            was_there = self._line.pop(owner, None) is not None or was_there
            if was_there:
                self._admit(changed=True)

    # -- reading ---------------------------------------------------------------------------------

    def residents(self) -> list[str]:
        """Resident owners, in order of admission."""
        with self._cond:
            return list(self._residents)

    def waiting(self) -> list[str]:
        """Owners in line, in order of arrival."""
        with self._cond:
            return list(self._line)

    def working_set(self, owner: str) -> int | None:
        """`owner`'s working set as the gate last heard it (resident or in line); None = unknown here."""
        with self._cond:
            resident = self._residents.get(owner)
            return resident.tokens if resident is not None else self._line.get(owner)

    def resident_tokens(self) -> int:
        """The residents' working sets together (may exceed the capacity by growth, or alone)."""
        with self._cond:
            return self._used()

    # -- internals (under the lock) --------------------------------------------------------------

    def _used(self) -> int:
        return sum(r.tokens for r in self._residents.values())

    def _start_call(self, resident: _Resident, tokens: int) -> None:
        resident.tokens = tokens
        resident.phase = "call"
        resident.calls_in_flight += 1
        resident.last_active = self.clock()

    def _admit(self, *, changed: bool = False) -> None:
        """Give up idle places if others wait, admit the line's head while it fits; notify on change."""
        if self._line:
            changed = self._revoke_idle() or changed
        while self._line:
            owner, tokens = next(iter(self._line.items()))
            if self._residents and self._used() + tokens > self.capacity_tokens:
                break
            del self._line[owner]
            self._residents[owner] = _Resident(tokens=tokens, last_active=self.clock())
            self.stats.admitted += 1
            if tokens > self.capacity_tokens:
                self.stats.admitted_alone += 1
                logger.info("admission: %s (%d tokens > %d) runs alone", owner, tokens, self.capacity_tokens)
            changed = True
        if changed:
            if self.on_change is not None:
                reserve = {owner: r.tokens for owner, r in self._residents.items()}
                self.on_change([*self._residents, *self._line], reserve)
            self._cond.notify_all()

    def _revoke_idle(self) -> bool:
        now = self.clock()
        revoked = False
        for owner, resident in list(self._residents.items()):
            if resident.calls_in_flight:
                continue
            ttl = self.park_ttl_s if resident.phase == "parked" else self.tool_ttl_s
            if now - resident.last_active > ttl:
                del self._residents[owner]
                self.stats.revoked_idle += 1
                revoked = True
                logger.info(
                    "admission: %s idle (%s) beyond %.1f s, its place goes on", owner, resident.phase, ttl
                )
        return revoked

    def _timed_out(self, owner: str, started: float) -> Admission:
        self.stats.timeouts += 1
        waited_s = self.clock() - started
        self._note_wait(waited_s)
        logger.warning(
            "admission: %s waited %.1f s (admission_wait_s) for residency; its call proceeds unadmitted",
            owner,
            waited_s,
        )
        return Admission(owner, False, "timeout", waited_s)

    def _note_wait(self, waited_s: float) -> None:
        self.stats.waited_s_total += waited_s
        self.stats.waited_s_max = max(self.stats.waited_s_max, waited_s)


def _checked_tokens(tokens: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        msg = f"working_set_tokens: expected an int >= 0, got {tokens!r}"
        raise ValueError(msg)
    return tokens
