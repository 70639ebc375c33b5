"""The lifecycle: events → rules → span moves, budgets and recall, over a public span table.

Modules (each owns one idea; see docs/architecture.md):

- `rules`: states, allowed transitions, the event → target → action table
- `targets`: for each event type, the spans its targets name (a table)
- `table`: the span table a session owns (spans, messages, leases, turn, counters, log)
- `leases`: pins as receipts
- `mover`: the only place a span's state and tier change together
- `compression`: commit-time compression and token-mode eviction (policy work)
- `rehydration`: recomputing a dropped span from its token ids
- `budget`: the one place a token budget becomes bytes; relieving pressure
- `demotion`: the order pressure demotes committed spans in (value per byte)
- `recall` / `recall_ranking`: bringing relevant spans back before an answer
- `invariants`: what must always hold
- `manager`: one per session, wiring the above
- `port`: what the lifecycle needs from its session (a protocol)
"""

from agentkv.lifecycle.leases import Lease
from agentkv.lifecycle.limits import BudgetLimits
from agentkv.lifecycle.manager import LifecycleManager
from agentkv.lifecycle.port import SessionPort
from agentkv.lifecycle.results import ApplyResult, Transition
from agentkv.lifecycle.rules import (
    ACTION_STATES,
    DEFAULT_RULES,
    DEMOTED_STATES,
    TRANSITIONS,
    Rules,
    check_transition,
)
from agentkv.lifecycle.table import SpanTable

__all__ = [
    "ACTION_STATES",
    "DEFAULT_RULES",
    "DEMOTED_STATES",
    "TRANSITIONS",
    "ApplyResult",
    "BudgetLimits",
    "Lease",
    "LifecycleManager",
    "Rules",
    "SessionPort",
    "SpanTable",
    "Transition",
    "check_transition",
]
