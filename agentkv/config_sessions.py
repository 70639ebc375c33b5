"""The `sessions:` section of the config: how many sessions a backend keeps holding KV, and how long.

Kept apart from `agentkv.config_sections` (the per-session sections): these bounds
belong to the backend's session table (`agentkv.backend.retention` applies them);
`agentkv.config` composes it into `AgentKVConfig`.
"""

from __future__ import annotations

from pydantic import Field

from agentkv.config_sections import Section


class SessionsConfig(Section):
    """How long a backend's sessions hold KV: a most-sessions limit and an idle time.

    A session ended by either bound is closed (its KV freed); its thread's next call
    opens a new session that re-encodes the history the call sends, so nothing of the
    conversation is lost, only its cache. Checked whenever the backend opens or looks
    up a session (`TransformersBackend.end_idle_sessions` runs it on demand). A
    session busy in a call, and a thread with open branches, are never ended.
    """

    max_live: int | None = Field(default=None, ge=1, strict=True)
    """Most sessions holding KV at once; beyond it the least recently used is closed; null = no limit."""
    idle_seconds: float | None = Field(default=None, gt=0, strict=True, allow_inf_nan=False)
    """A session unused this many seconds is closed (history re-encoded on its next call)."""

    @property
    def bounded(self) -> bool:
        """True when either bound is set."""
        return self.max_live is not None or self.idle_seconds is not None
