"""LangGraph integration: `with_kv_lifecycle`, `Send` branch helpers, confirmation helpers, YAML loading."""

from agentkv_langchain.callbacks import OWNER_KEY, KVLifecycleCallbackHandler, resume_decision
from agentkv_langchain.helpers import confirm, kv_event, pin, prune_branch, reject, select_branch, send_event
from agentkv_langgraph.branches import branch_config, branch_id, current_branch, is_send_task
from agentkv_langgraph.config import load_config, load_graph_yaml
from agentkv_langgraph.graph import KVLifecycle, shared_backend, with_kv_lifecycle

__all__ = [
    "OWNER_KEY",
    "KVLifecycle",
    "KVLifecycleCallbackHandler",
    "branch_config",
    "branch_id",
    "confirm",
    "current_branch",
    "is_send_task",
    "kv_event",
    "load_config",
    "load_graph_yaml",
    "pin",
    "prune_branch",
    "reject",
    "resume_decision",
    "select_branch",
    "send_event",
    "shared_backend",
    "with_kv_lifecycle",
]
