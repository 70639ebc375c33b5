"""`with_kv_lifecycle`: a compiled LangGraph graph whose runs drive the KV lifecycle.

The graph returned is still the compiled graph (same class underneath, so
`invoke`, `stream`, `get_state`, interrupts, use as a subgraph all work): it is
`graph.with_config(callbacks=[handler])` — LangGraph's `with_config` returns a copy
of the graph, not a `RunnableBinding` — with one addition: before each run it reads
the per-run settings from `config["configurable"]["agentkv"]`.

Per-run settings (`configurable.agentkv`, same shape as the YAML section) are
merged over the graph's config (`AgentKVConfig.with_overrides`) and apply to the
sessions that run **creates**: the thread's session on its first run, and the
branch sessions forked from it (a fork keeps its parent's config). Everything a
session reads at creation is honoured — `budget`, `policy`, `archive_tier`,
`quantization`, `commit`, `recall`, `rules`. A thread whose session already exists
keeps the settings it started with (a cache cannot be re-budgeted mid-conversation
without demoting under the agent's feet; close the session to start over).
`model`, `device`, `dtype`, `attn_implementation`, `sessions` and `chat` belong to
the backend and `callbacks` to the handler: per run they are ignored, with a warning
(`prefix_cache.enabled: false` opts a run's new sessions out of the shared cache; the
cache's other keys are the backend's, warned about by the backend).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import merge_configs
from langgraph.pregel import Pregel

from agentkv import AgentKVConfig, AnySession, Backend
from agentkv_langchain.backends import (
    BACKEND_WIDE,
    ConfigLike,
    check_backend_wide,
    resolve_config,
    shared_backend,
)
from agentkv_langchain.callbacks import KVLifecycleCallbackHandler
from agentkv_langchain.fanout import BranchSelector
from agentkv_langchain.sessions import DEFAULT_THREAD

__all__ = ["KVLifecycle", "shared_backend", "with_kv_lifecycle"]

logger = logging.getLogger("agentkv.langgraph")

G = TypeVar("G", bound=Pregel)

_BACKEND_WIDE = BACKEND_WIDE
"""Config keys a run cannot change: they belong to the backend (model, device, dtype) or the handler."""


@dataclass
class KVLifecycle:
    """What `with_kv_lifecycle` attached to a graph: the backend, the handler and the base config."""

    backend: Backend
    """Where the sessions live."""
    handler: KVLifecycleCallbackHandler
    """The callback handler that turns the graph's runs into events."""
    config: AgentKVConfig
    """Settings of the sessions this graph's runs create (before per-run overrides)."""
    _warned: set[str] = field(default_factory=set, repr=False)

    def config_for(self, run_config: RunnableConfig | None) -> AgentKVConfig:
        """The settings a run's new sessions get: `config` with `configurable.agentkv` merged in.

        Raises:
            ValueError: The overrides are invalid (the message names `configurable.agentkv.<key>`).
        """
        overrides = ((run_config or {}).get("configurable") or {}).get("agentkv")
        if not overrides:
            return self.config
        if not isinstance(overrides, Mapping):
            msg = f"configurable.agentkv: must be a mapping, got {type(overrides).__name__}"
            raise ValueError(msg)
        ignored = ", ".join(sorted(k for k in overrides if k in _BACKEND_WIDE))
        if ignored and ignored not in self._warned:
            self._warned.add(ignored)
            logger.warning(
                "configurable.agentkv: %s cannot change per run (backend- or handler-wide); ignored", ignored
            )
        return self.config.with_overrides({k: v for k, v in overrides.items() if k not in _BACKEND_WIDE})

    def prepare(self, run_config: RunnableConfig | None) -> AnySession | None:
        """Create the run's thread session with the run's settings, if it does not exist yet.

        Returns:
            The thread's session when this run's settings differ from the backend's
            (created now, or existing), else None (the chat model creates it on first use).
        """
        config = self.config_for(run_config)
        if config == self.backend.config:
            return None
        configurable = (run_config or {}).get("configurable") or {}
        thread = str(configurable.get("thread_id") or DEFAULT_THREAD)
        session = self.backend.session(thread, config=config)
        if session.config != config and thread not in self._warned:
            self._warned.add(thread)
            logger.info(
                "session %r already exists: per-run agentkv settings apply to new sessions only", thread
            )
        return session

    def session(self, thread_id: str = DEFAULT_THREAD) -> AnySession:
        """A thread's session (created with the graph's settings if absent)."""
        return self.backend.session(thread_id, config=self.config)


class _KVLifecycleGraph:
    """Mixin over a compiled graph's class: prepares the run's sessions, then runs as usual.

    `invoke`, `batch` and `stream_events` go through `stream`; `ainvoke` and
    `astream_events` through `astream`, so these two overrides cover every entry point.
    """

    agentkv: KVLifecycle

    def __init__(self, *args: Any, agentkv: KVLifecycle, **kwargs: Any) -> None:
        # Pregel.copy() rebuilds the graph from its __dict__, so the binding travels as a kwarg.
        super().__init__(*args, **kwargs)
        self.agentkv = agentkv

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        self.agentkv.prepare(merge_configs(cast(Pregel, self).config, config))
        return super().stream(input, config, **kwargs)  # type: ignore[misc]

    def astream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        self.agentkv.prepare(merge_configs(cast(Pregel, self).config, config))
        return super().astream(input, config, **kwargs)  # type: ignore[misc]


@functools.cache
def _lifecycle_class(base: type[Pregel]) -> type[Pregel]:
    if issubclass(base, _KVLifecycleGraph):
        return base
    return cast(type[Pregel], type(f"KVLifecycle{base.__name__}", (_KVLifecycleGraph, base), {}))


def with_kv_lifecycle(
    graph: G,
    *,
    backend: Backend | None = None,
    config: ConfigLike = None,
    raise_error: bool | None = None,
    adopt_branches: bool = True,
    branch_selector: BranchSelector | None = None,
) -> G:
    """Attach the KV lifecycle to a compiled graph.

    One session per `thread_id` (the chat model's choice, see
    `agentkv_langchain.sessions`); a model call inside a `Send` task runs on a fork of
    it (or `agentkv_langgraph.branch_config` names the branch). Fan-outs settle by
    themselves: the thread's next model call adopts the branch it continues with and
    prunes the others; branches still open when the run ends are pruned unless
    selected (`select_branch`, `branch_selector`). Tool results, turn ends, interrupts
    and resumes and the `agentkv_langchain.helpers` events reach the sessions through
    the handler.

    Args:
        graph: A compiled graph (`StateGraph(...).compile(...)`, `create_agent(...)`).
        backend: The backend the graph's `ChatAgentKV` models use; None = `shared_backend(config)`.
        config: Session settings, in any form `shared_backend` accepts: an
            `AgentKVConfig`, a mapping shaped like the YAML `agentkv:` section, or a
            graph YAML path whose `agentkv:` section is read; None = the backend's config.
        raise_error: Let handler errors stop runs (default: `config.callbacks.raise_error`).
        adopt_branches: Adopt the branch the thread continues with (False: prune it too,
            and re-encode its messages in the thread's session).
        branch_selector: `(thread, open branch ids) -> id | None`, asked when a run ends
            with branches nobody selected; the one it names is kept for the next run.

    Returns:
        The same graph (a copy, of a subclass of its class) with the handler attached;
        `graph.agentkv` holds the backend, the handler and the config.

    Raises:
        TypeError: `graph` is not a compiled graph (an uncompiled `StateGraph`, a chat model).
    """
    if not isinstance(graph, Pregel):
        msg = (
            f"with_kv_lifecycle: expected a compiled graph (builder.compile(...)), got {type(graph).__name__}"
        )
        if not hasattr(graph, "compile"):
            msg += " (a chat model needs no wrapping: wrap the graph that calls it)"
        raise TypeError(msg)
    settings = resolve_config(config)
    if backend is None:
        backend = shared_backend(settings)
    if settings is not None:
        check_backend_wide(settings, backend.config)
    base = settings or backend.config
    handler = KVLifecycleCallbackHandler(
        backend,
        config=base,
        raise_error=raise_error,
        adopt_branches=adopt_branches,
        branch_selector=branch_selector,
    )
    binding = KVLifecycle(backend=backend, handler=handler, config=base)
    bound = graph.with_config(callbacks=[handler])
    attrs = {k: v for k, v in bound.__dict__.items() if k not in ("__orig_class__", "agentkv")}
    cls: Any = _lifecycle_class(type(graph))
    return cast(G, cls(**attrs, agentkv=binding))
