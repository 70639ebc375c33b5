"""The lifecycle: events → rules → span moves, placement (budgets, recall), over a public span table.

One module per idea; the module map is in docs/architecture.md.
"""

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
from agentkv.spans import Lease

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
