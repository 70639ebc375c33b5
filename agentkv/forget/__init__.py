"""The agent decides what to forget: a side thread that names stale tool results.

Every other release in agentkv comes from a rule (a tool finished, a turn ended, a
branch lost). SideQuest (arXiv 2602.22603) lets the model itself, in an auxiliary
thread every K turns, name the tool outputs it no longer needs; they are deleted at
the next turn boundary. This module does that without training and without touching
the main conversation:

1. At a turn end (an explicit `TurnEnded`, or implicitly when the next user message
   arrives) the `ForgetController` of the session decides whether the side thread runs
   (`forget.every_turns`, `forget.on_high_watermark`).
2. It forks the session (`Session.fork`: the fork shares the KV prefix, no copy), adds
   one user message listing the committed tool results by short handles (`T3` = the
   conversation's third tool result), and lets the model answer with a
   `forget_tool_outputs` call whose opening is prefilled up to the list
   (`<tool_call>{"name": "forget_tool_outputs", "arguments": {"handles": [`, the
   forced-call decoding of `agentkv_langchain.tools.forced_call_prefix`) and stops at `]`.
3. The fork is closed at once (its own KV is freed); the answer is parsed strictly:
   anything but a JSON list of offered handles releases nothing (logged).
4. At the next turn boundary (a new user message, before it is encoded) each chosen
   result becomes a `ToolOutputForgotten` event (rule `custom:forget_tool_output`,
   default `evict`). Until then the main thread's cache and history are untouched.

Guard rails, checked when a decision is made and again when it is applied: pinned
spans, spans of the current turn and results the last answer cited are never
released. A released result keeps its token ids and stays recallable: when a later
question needs it, recall recomputes it (rehydration), so a wrong decision costs
time, not facts.

The same decision is open to the main agent as a tool (`ForgetRequested`, sent by
`agentkv_langchain.forget_tool_outputs`); it goes through the same guards and the
same boundary.
"""

from __future__ import annotations

from agentkv.forget.controller import (
    Candidate,
    ForgetController,
    ForgetDecision,
    ForgetSession,
    ForgetStats,
)
from agentkv.forget.protocol import (
    FORGET_EVENT,
    FORGET_TOOL_NAME,
    FORGET_TOOL_PARAMETERS,
    SIDE_THREAD_BRANCH,
    ForgetRequested,
    ToolOutputForgotten,
    check_handles,
    cites,
    handle_of,
    parse_forget_answer,
    side_thread_opening,
)

__all__ = [
    "FORGET_EVENT",
    "FORGET_TOOL_NAME",
    "FORGET_TOOL_PARAMETERS",
    "SIDE_THREAD_BRANCH",
    "Candidate",
    "ForgetController",
    "ForgetDecision",
    "ForgetRequested",
    "ForgetSession",
    "ForgetStats",
    "ToolOutputForgotten",
    "check_handles",
    "cites",
    "handle_of",
    "parse_forget_answer",
    "side_thread_opening",
]
