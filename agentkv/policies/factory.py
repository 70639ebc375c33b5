"""Build a policy from its config name (`agentkv.policy` in YAML) and parameters.

An explicit table, not a registry: a reader sees every name in one place, and
importing a module never changes what the factory knows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from agentkv.policies.base import Policy
from agentkv.policies.h2o import H2OPolicy
from agentkv.policies.intent import IntentPolicy
from agentkv.policies.key_norm import KeyNormPolicy
from agentkv.policies.kind_prior import KindPriorPolicy
from agentkv.policies.snapkv import SnapKVPolicy
from agentkv.policies.streaming_llm import StreamingLLMPolicy
from agentkv.policies.tova import TOVAPolicy
from agentkv.policies.window import SlidingWindowPolicy

POLICIES: Mapping[str, type[Policy] | None] = {
    "lifecycle": KindPriorPolicy,
    "full": None,
    "window": SlidingWindowPolicy,
    "streaming_llm": StreamingLLMPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "tova": TOVAPolicy,
    "key_norm": KeyNormPolicy,
    "intent": IntentPolicy,
}
"""Config name → policy class; `full` (None) keeps everything and never compresses."""

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
"""Every name `make_policy` accepts."""


def policy_params(name: str) -> tuple[str, ...]:
    """The parameter names a policy accepts (its dataclass init fields).

    Raises:
        ValueError: Unknown policy name.
    """
    cls = _lookup(name)
    if cls is None:
        return ()
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)  # type: ignore[arg-type]


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy | None:
    """Instantiate the policy called `name` with `params`.

    Args:
        name: One of `POLICY_NAMES`.
        params: Keyword arguments for the policy's dataclass (e.g. `{"window": 16}`).

    Returns:
        The policy, or None for `full` (keep everything).

    Raises:
        ValueError: Unknown name, unknown parameter or an invalid value; the message
            lists the allowed names / parameters.
    """
    cls = _lookup(name)
    params = dict(params or {})
    allowed = policy_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        msg = f"policy {name!r}: unknown parameter(s) {unknown}; allowed: {list(allowed) or 'none'}"
        raise ValueError(msg)
    if cls is None:
        return None
    try:
        return cls(**params)
    except TypeError as e:
        msg = f"policy {name!r}: invalid parameters {params}: {e}"
        raise ValueError(msg) from e


def param_problems(name: str, params: Mapping[str, Any]) -> dict[str, str]:
    """What the policy `name` rejects in `params`: `{parameter: message}` (empty = valid).

    Each known parameter is tried alone over the defaults, so a config error names
    the one value that is wrong; a combination that fails only together is reported
    under the empty key. Unknown parameter names are not checked here.

    Raises:
        ValueError: Unknown policy name.
    """
    cls = _lookup(name)
    if cls is None:
        return {}
    allowed = set(policy_params(name))
    known = {k: v for k, v in params.items() if k in allowed}
    problems: dict[str, str] = {}
    for key, value in known.items():
        message = _construct_problem(cls, {key: value})
        if message is not None:
            problems[key] = message.removeprefix(f"{cls.__name__}.{key} ")
    if not problems and known:
        message = _construct_problem(cls, known)
        if message is not None:
            problems[""] = message
    return problems


def _construct_problem(cls: type[Policy], params: Mapping[str, Any]) -> str | None:
    try:
        cls(**params)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _lookup(name: str) -> type[Policy] | None:
    if name not in POLICIES:
        msg = f"unknown policy {name!r}; allowed: {list(POLICY_NAMES)}"
        raise ValueError(msg)
    return POLICIES[name]
