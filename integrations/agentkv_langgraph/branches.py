"""Branches: LangGraph `Send` tasks that fork their thread's KV instead of sharing it.

A `Send` fan-out runs one task per branch, in parallel. If they all used the
thread's session they would overwrite each other's history; instead each gets a
branch session, `backend.fork(thread, branch)`, that shares the thread's KV as a
read-only prefix (no copy) and holds only its own suffix. `ChatAgentKV` forks by
itself for a model call made inside a `Send` task (no agentkv call needed in the
node), and when the run metadata carries `agentkv_branch`, which `branch_config`
puts there to name a branch yourself.

The branch id is the one you give (`branch_config(config, "b1")`), or else the
task's id: LangGraph runs a `Send` task with `langgraph_triggers == ("__pregel_push",)`
and `langgraph_checkpoint_ns == "<node>:<task_id>"` (verified in langgraph 1.2,
`pregel/_algo.py: prepare_push_task_send`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig, ensure_config

from agentkv_langchain.sessions import BRANCH_KEY, PUSH_TRIGGER, is_send_task, send_task_id

__all__ = ["BRANCH_KEY", "PUSH_TRIGGER", "branch_config", "branch_id", "current_branch", "is_send_task"]


def branch_id(metadata: Mapping[str, Any] | None) -> str | None:
    """The branch a run belongs to: `agentkv_branch` if set, else a `Send` task's id, else None.

    Args:
        metadata: Run metadata (`config["metadata"]` in a node, `run_manager.metadata` in a model).
    """
    metadata = metadata or {}
    explicit = metadata.get(BRANCH_KEY)
    if explicit:
        return str(explicit)
    return send_task_id(metadata)


def current_branch(config: RunnableConfig | None = None) -> str | None:
    """The branch of the run `config` belongs to (the current run when None); see `branch_id`."""
    return branch_id(ensure_config(config).get("metadata"))


def branch_config(config: RunnableConfig | None = None, branch: str | None = None) -> RunnableConfig:
    """A config whose model calls run in a branch session (a fork of the thread's).

    Inside a `Send` node: `model.invoke(messages, config=branch_config(config))`, or
    with your own id, `branch_config(config, state["branch"])`. Pass it to every call
    of the branch (its tools too), so their events reach the branch's session. Prune
    or select it later with `agentkv_langchain.helpers.prune_branch(branch)` /
    `select_branch`. Ids must be new in each fan-out (events are idempotent: pruning
    an id a second time is ignored); task ids are.

    Args:
        config: The node's config (None = the current run's).
        branch: The branch id; None = `current_branch(config)`.

    Returns:
        A copy of the config with `metadata["agentkv_branch"]` set.

    Raises:
        ValueError: No `branch` was given and the run is not a `Send` task.
    """
    config = ensure_config(config)
    metadata = dict(config.get("metadata") or {})
    branch = branch or branch_id(metadata)
    if not branch:
        msg = (
            "branch_config: this run is not a LangGraph Send task, so it has no task id to name a branch; "
            "pass branch='<id>'"
        )
        raise ValueError(msg)
    metadata[BRANCH_KEY] = str(branch)
    return RunnableConfig(**{**config, "metadata": metadata})
