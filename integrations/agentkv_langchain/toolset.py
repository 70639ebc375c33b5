"""Tool sets that change inside one thread, without rewriting the cached prefix.

A chat template renders the bound tools into the system prompt (or the `<tool_call>`
protocol puts them there), so binding another tool set — or none — in the next
node of a graph changes message 0, and the session would crop its cache at the
first token and re-encode the whole history. A tool-bound agent node followed by
an unbound answer node is the most common graph shape, so that is most calls.

Instead, a thread keeps the tools block it started with, and a change is said
where it happens: a short system note after the call's last message ("no tools
for this answer", or the new tool list). The note is remembered with the message
it follows (by fingerprint) and re-inserted at the same place on every later call,
so the history the session sees only grows, and its cache stays valid. With no
tools now, the `<tool_call>` tag is also kept from being written (the answer is
text); a call that names a tool outside the current set is reported invalid.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv import AnySession
from agentkv.chat import normalize_message
from agentkv.toolformats import HERMES, ToolFormat
from agentkv_langchain.tools import render_tool_prompt, tool_names

__all__ = ["CHANGED_HEADER", "NO_TOOLS_NOTE", "RESTORED_NOTE", "ThreadTools", "outside", "thread_tools"]

NO_TOOLS_NOTE = "No tools can be called for this answer: reply to the user in plain text."
"""The note that says "no tools now" in a thread whose prompt describes tools."""
RESTORED_NOTE = "The tools described at the start can be called again."
"""The note that says the thread's own tools are back."""
CHANGED_HEADER = "For the next answers, only these tools can be called (they replace the ones above).\n"
"""Heads the note that lists a different tool set."""


@dataclass
class _Note:
    """A system note placed after message `after` (matched by its fingerprint)."""

    after: int
    fingerprint: str
    message: dict[str, Any]


@dataclass
class ThreadTools:
    """What one session's conversation knows about its tools."""

    started: list[dict[str, Any]] | None = None
    """The tool schemas rendered into the thread's system prompt (None: not started yet)."""
    system: str | None = None
    """The system prompt's own text at the start (a different one starts a new conversation)."""
    current: list[dict[str, Any]] = field(default_factory=list)
    """The tools the latest note (or the start) made callable."""
    notes: list[_Note] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    """Fingerprints of the previous call's messages after the system prompt: a call that does not
    continue them starts a new conversation on this session (a rewrite, or another caller)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def plan(
        self, chat: list[dict[str, Any]], tools: list[dict[str, Any]], fmt: ToolFormat = HERMES
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The chat with its notes, and the tools block to render in the system prompt.

        Args:
            chat: The call's messages as chat dicts (no tool prompt yet).
            tools: The tools bound to this call (possibly none).
            fmt: The tool-call format a note describing new tools uses.

        Returns:
            `(chat with notes inserted, tools for the system prompt)`.
        """
        with self.lock:
            system = chat[0]["content"] if chat and chat[0].get("role") == "system" else ""
            body = [_fingerprint(m) for m in (chat[1:] if system else chat)]
            # A continuation carries every message of the previous call plus at least its answer;
            # the same messages again (a retry, or another caller asking the same) start over.
            continues = len(body) > len(self.seen) and body[: len(self.seen)] == self.seen
            self.seen = body
            if self.started is None or system != self.system or not continues or not self._anchored(chat):
                # The first call, or a new conversation on this session: tools as given.
                self.started, self.system, self.current, self.notes = list(tools), system, list(tools), []
                return chat, list(tools)
            out = self._with_notes(chat)
            if _key(tools) != _key(self.current) and chat:
                note = {"role": "system", "content": self._note_text(tools, fmt)}
                self.notes.append(_Note(len(chat) - 1, _fingerprint(chat[-1]), note))
                self.current = list(tools)
                out.append(note)
            return out, list(self.started)

    def _anchored(self, chat: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the notes' anchors are still in place (else the history was rewritten)."""
        return all(
            note.after < len(chat) and _fingerprint(chat[note.after]) == note.fingerprint
            for note in self.notes
        )

    def _with_notes(self, chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        by_anchor: dict[int, list[dict[str, Any]]] = {}
        for note in self.notes:
            by_anchor.setdefault(note.after, []).append(note.message)
        for i, message in enumerate(chat):
            out.append(message)
            out.extend(by_anchor.get(i, ()))
        return out

    def _note_text(self, tools: list[dict[str, Any]], fmt: ToolFormat) -> str:
        if not tools:
            return NO_TOOLS_NOTE
        if _key(tools) == _key(self.started or []):
            return RESTORED_NOTE
        if not self.started:
            return render_tool_prompt(tools, fmt)
        return CHANGED_HEADER + render_tool_prompt(tools, fmt)

    def copy(self) -> ThreadTools:
        """An independent copy (a branch continues its parent's conversation)."""
        with self.lock:
            return ThreadTools(
                self.started, self.system, list(self.current), list(self.notes), list(self.seen)
            )


_TABLE: weakref.WeakKeyDictionary[AnySession, ThreadTools] = weakref.WeakKeyDictionary()
_TABLE_LOCK = threading.Lock()


def thread_tools(session: AnySession) -> ThreadTools:
    """The tool state of a session's conversation (created on first use, gone with the session)."""
    with _TABLE_LOCK:
        state = _TABLE.get(session)
        if state is None:
            # A branch's cached prefix was rendered with its parent's tools block and notes.
            parent = _TABLE.get(session.parent) if session.parent is not None else None
            state = _TABLE[session] = parent.copy() if parent is not None else ThreadTools()
        return state


def outside(calls: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indexes of calls that name a tool not in `tools` (the prompt may still list it)."""
    names = set(tool_names(tools))
    return [i for i, call in enumerate(calls) if call.get("name") not in names]


def _key(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True, default=str)


def _fingerprint(message: Mapping[str, Any]) -> str:
    return normalize_message(dict(message)).fingerprint()
