"""Graph YAML: the `agentkv:` section of the file that describes a graph.

agentkv reads only its own section and ignores the rest (nodes, edges, prompts
belong to your loader). See `examples/graph.yaml` for every key. Typical use:

    document, config = load_graph_yaml("examples/graph.yaml")
    graph = build_my_graph(document["graph"])          # your loader, your nodes
    graph = with_kv_lifecycle(graph, backend=backend, config=config)
    # or simply: with_kv_lifecycle(graph, backend=backend, config="examples/graph.yaml")

Per-run overrides have the same shape, under `config["configurable"]["agentkv"]`
(see `agentkv_langgraph.graph` for what a run can change).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from agentkv import AgentKVConfig

__all__ = ["load_config", "load_graph_yaml"]


def load_config(path: str | os.PathLike[str], section: str = "agentkv") -> AgentKVConfig:
    """The validated `agentkv:` section of a graph YAML (`AgentKVConfig.from_yaml`).

    Args:
        path: The YAML file, e.g. `examples/graph.yaml`.
        section: The top-level key holding agentkv's settings.

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: Malformed YAML, a missing section or an invalid value (one line per
            problem, with its YAML path and line).
    """
    return AgentKVConfig.from_yaml(path, section=section)


def load_graph_yaml(
    path: str | os.PathLike[str], section: str = "agentkv"
) -> tuple[dict[str, Any], AgentKVConfig]:
    """The whole document (for your own graph loader) and its validated `agentkv:` section.

    Args:
        path: The YAML file.
        section: As for `load_config`.

    Returns:
        `(document, config)`; the document is plain `yaml.safe_load` output.
    """
    config = load_config(path, section)
    document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return dict(document), config
