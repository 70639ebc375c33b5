"""The `agentkv:` YAML section: defaults, loading, shorthands, errors, overrides, docs."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import agentkv.config as config_module
import agentkv.config_engine as config_engine
import agentkv.config_sections as config_sections
import agentkv.config_sessions as config_sessions
from agentkv.config import (
    ALLOWED_POLICIES,
    AgentKVConfig,
    BudgetConfig,
    PolicyConfig,
    QuantizationConfig,
    parse_bytes,
)
from agentkv.config_docs import REGENERATE_COMMAND, render_config_reference
from agentkv.events import ACTIONS, EVENT_NAMES, EVENT_TARGETS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "graph.yaml"
DOCS = ROOT / "docs" / "configuration.md"


def error_of(data: Any, **kwargs: Any) -> str:
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_dict(data, **kwargs)
    assert type(info.value) is ValueError  # never pydantic's ValidationError or a private subclass
    return str(info.value)


# ------------------------------------------------------------------ defaults and loading


def test_defaults() -> None:
    config = AgentKVConfig()
    assert config.model is None and config.device is None and config.dtype is None
    assert config.budget == BudgetConfig()
    assert not config.budget.limited
    assert (config.budget.high_watermark, config.budget.low_watermark) == (1.0, 0.8)
    assert config.policy == PolicyConfig(name="lifecycle", params={})
    assert config.archive_tier == "host"
    assert (config.quantization.group_size, config.quantization.residual_tokens) == (32, 0)
    assert (config.commit.keep_ratio, config.commit.min_keep_tokens, config.commit.window) == ({}, 8, 32)
    assert config.recall.enabled and config.recall.max_spans == 4 and config.recall.min_score is None
    assert config.recall.rehydrate_evicted
    assert config.rules == {}
    assert config.callbacks.raise_error is False
    assert AgentKVConfig.from_dict(None) == config
    assert AgentKVConfig.from_dict({}) == config


def test_models_are_frozen() -> None:
    config = AgentKVConfig()
    with pytest.raises(ValueError):
        config.archive_tier = "drop"  # type: ignore[misc]
    with pytest.raises(ValueError):
        config.budget.device_tokens = 5  # type: ignore[misc]


def test_example_graph_yaml_loads() -> None:
    config = AgentKVConfig.from_yaml(EXAMPLE)
    assert config.budget.device_tokens == 1024
    assert config.budget.device_bytes == 64 * 1024**2
    assert config.budget.global_device_bytes == 1_500_000_000
    assert config.budget.limited
    assert config.policy.name == "lifecycle" and config.policy.params == {"attention_weight": 1.0}
    assert config.archive_tier == "int8"
    assert config.commit.keep_ratio == {"tool_result": 0.5, "reasoning": 0.25}
    assert config.rules["custom:plan_approved"] == {"owner": "pin"}
    # The rest of the graph YAML is someone else's business, but it is there.
    assert yaml.safe_load(EXAMPLE.read_text())["graph"]["entry"] == "agent"
    assert AgentKVConfig.from_yaml(str(EXAMPLE)) == config


def test_to_dict_round_trips() -> None:
    config = AgentKVConfig.from_yaml(EXAMPLE)
    assert AgentKVConfig.from_dict(config.to_dict()) == config
    dumped = yaml.safe_dump({"agentkv": config.to_dict()})
    assert AgentKVConfig.from_yaml_text(dumped) == config


def test_other_section_name() -> None:
    text = "graph: {entry: agent}\nkv:\n  archive_tier: drop\n"
    assert AgentKVConfig.from_yaml_text(text, section="kv").archive_tier == "drop"


@pytest.mark.parametrize("text", ["agentkv:\n", "agentkv: null\n", "agentkv: {}\n", "x: 1\nagentkv: ~\n"])
def test_empty_section_means_defaults(text: str) -> None:
    assert AgentKVConfig.from_yaml_text(text) == AgentKVConfig()


def test_null_subsection_means_defaults() -> None:
    text = "agentkv:\n  budget:\n    # device_tokens: 1024\n  rules:\n  policy: {name: h2o, params: null}\n"
    config = AgentKVConfig.from_yaml_text(text)
    assert config.budget == BudgetConfig()
    assert config.rules == {}
    assert config.policy == PolicyConfig(name="h2o")


# ------------------------------------------------------------------ bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1024, 1024),
        ("1024", 1024),
        ("1024B", 1024),
        ("512kB", 512_000),
        ("512 KB", 512_000),
        ("4KiB", 4096),
        ("64MiB", 64 * 1024**2),
        ("64 mib", 64 * 1024**2),
        ("1.5 GB", 1_500_000_000),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("2TB", 2 * 1000**4),
        ("0.5KiB", 512),
        (" 8 MB ", 8_000_000),
        (2048.0, 2048),
    ],
)
def test_parse_bytes(value: object, expected: int) -> None:
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    "value", [-1, "-5MiB", "64 MBs", "1e9", "MiB", "", "1.5 B", 1.5, True, None, [1], "1,024"]
)
def test_parse_bytes_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="accepted: .*KiB.*64MiB"):
        parse_bytes(value)


def test_byte_budgets_from_yaml() -> None:
    text = (
        "agentkv:\n  budget:\n    device_bytes: 64MiB\n    host_bytes: 2 GB\n    global_device_bytes: 1024\n"
    )
    budget = AgentKVConfig.from_yaml_text(text).budget
    assert (budget.device_bytes, budget.host_bytes, budget.global_device_bytes) == (2**26, 2 * 10**9, 1024)


def test_byte_budget_errors_name_the_path() -> None:
    message = error_of({"budget": {"device_bytes": "64 MBs"}})
    assert message.startswith("agentkv.budget.device_bytes: cannot read '64 MBs'")
    assert "MiB" in message and "kB" in message
    assert error_of({"budget": {"host_bytes": 0}}) == "agentkv.budget.host_bytes: must be > 0, got 0"


# ------------------------------------------------------------------ policy


@pytest.mark.parametrize(
    ("policy", "name", "params"),
    [
        ("snapkv", "snapkv", {}),
        ("SnapKV", "snapkv", {}),
        ("streaming-llm", "streaming_llm", {}),
        ({"name": "snapkv"}, "snapkv", {}),
        ({"name": "snapkv", "window": 32}, "snapkv", {"window": 32}),
        (
            {"name": "snapkv", "params": {"kernel_size": 5}, "window": 16},
            "snapkv",
            {"kernel_size": 5, "window": 16},
        ),
        ({"name": "tova", "params": {"window": 8}}, "tova", {"window": 8}),
        ({"recency_weight": 0.5}, "lifecycle", {"recency_weight": 0.5}),
    ],
)
def test_policy_shorthands(policy: Any, name: str, params: dict[str, Any]) -> None:
    config = AgentKVConfig.from_dict({"policy": policy})
    assert config.policy == PolicyConfig(name=name, params=params)


def test_policy_shorthand_in_yaml() -> None:
    assert AgentKVConfig.from_yaml_text("agentkv:\n  policy: h2o\n").policy.name == "h2o"
    text = "agentkv:\n  policy:\n    name: snapkv\n    window: 16\n"
    assert AgentKVConfig.from_yaml_text(text).policy.params == {"window": 16}


def test_every_allowed_policy_loads() -> None:
    for name in ALLOWED_POLICIES:
        assert AgentKVConfig.from_dict({"policy": name}).policy.name == name


def test_policy_errors() -> None:
    message = error_of({"policy": "snapkvv"})
    assert message.startswith("agentkv.policy.name: unknown policy 'snapkvv' (did you mean 'snapkv'?)")
    assert "allowed: " + ", ".join(ALLOWED_POLICIES) in message
    message = error_of({"policy": {"name": "snapkv", "window": 3, "params": {"window": 4}}})
    assert message.startswith("agentkv.policy.params.window: given both")
    assert error_of({"policy": 5}).startswith("agentkv.policy: must be a mapping, got int 5")
    assert error_of({"policy": {"params": [1]}}).startswith("agentkv.policy.params: must be a mapping")


# ------------------------------------------------------------------ errors name the path


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"budget": {"device_tokens": -5}}, "agentkv.budget.device_tokens: must be > 0, got -5"),
        (
            {"budget": {"device_tokens": "many"}},
            "agentkv.budget.device_tokens: must be an integer, got 'many'",
        ),
        ({"budget": {"device_tokens": True}}, "agentkv.budget.device_tokens: must be an integer, got True"),
        ({"budget": {"high_watermark": 1.5}}, "agentkv.budget.high_watermark: must be <= 1, got 1.5"),
        ({"budget": {"low_watermark": 0}}, "agentkv.budget.low_watermark: must be > 0, got 0"),
        ({"budget": [1]}, "agentkv.budget: must be a mapping, got a list [1]"),
        ({"quantization": {"group_size": 4}}, "agentkv.quantization.group_size: must be >= 8, got 4"),
        (
            {"quantization": {"residual_tokens": -1}},
            "agentkv.quantization.residual_tokens: must be >= 0, got -1",
        ),
        ({"commit": {"min_keep_tokens": 0}}, "agentkv.commit.min_keep_tokens: must be >= 1, got 0"),
        ({"commit": {"window": 0}}, "agentkv.commit.window: must be >= 1, got 0"),
        ({"commit": {"keep_ratio": {"user": 0}}}, "agentkv.commit.keep_ratio.user: must be > 0, got 0"),
        ({"commit": {"keep_ratio": {"user": 1.5}}}, "agentkv.commit.keep_ratio.user: must be <= 1, got 1.5"),
        ({"recall": {"max_spans": -1}}, "agentkv.recall.max_spans: must be >= 0, got -1"),
        ({"recall": {"enabled": "yes"}}, "agentkv.recall.enabled: must be true or false, got 'yes'"),
        (
            {"recall": {"min_score": float("nan")}},
            "agentkv.recall.min_score: must be a finite number, got nan",
        ),
        ({"callbacks": {"raise_error": 1}}, "agentkv.callbacks.raise_error: must be true or false, got 1"),
        ({"model": ""}, "agentkv.model: must not be empty, got ''"),
        ({"model": 7}, "agentkv.model: must be a string, got 7"),
        ({1: "x"}, "agentkv.1: keys must be strings, got 1"),
    ],
)
def test_value_errors_name_the_path(data: dict[Any, Any], expected: str) -> None:
    assert error_of(data) == expected


def test_quantization_group_size_power_of_two() -> None:
    for size in (8, 16, 32, 64, 128, 256):
        assert QuantizationConfig(group_size=size).group_size == size
    message = error_of({"quantization": {"group_size": 48}})
    assert (
        message
        == "agentkv.quantization.group_size: must be a power of two, got 48; allowed: 8, 16, 32, 64, 128, 256"
    )
    assert error_of({"quantization": {"group_size": 512}}).endswith("must be <= 256, got 512")


def test_unknown_span_kind() -> None:
    message = error_of({"commit": {"keep_ratio": {"tool": 0.5}}})
    assert message.startswith("agentkv.commit.keep_ratio.tool: unknown span kind")
    assert "allowed: system, user, assistant, tool_call, tool_result, reasoning, prompt" in message


def test_unknown_keys_list_allowed_keys() -> None:
    message = error_of({"polcy": "h2o"})
    assert message.startswith(
        "agentkv.polcy: unknown key (did you mean 'policy'?); "
        "allowed: model, device, dtype, attn_implementation, budget"
    )
    message = error_of({"budget": {"limit": 5}})
    assert message.startswith("agentkv.budget.limit: unknown key; allowed: device_tokens, device_bytes")
    assert error_of({"recall": {"enable": True}}).startswith(
        "agentkv.recall.enable: unknown key (did you mean 'enabled'?)"
    )


def test_removed_keys_say_why_they_went() -> None:
    message = error_of({"recall": {"pages": True}})
    assert message.startswith("agentkv.recall.pages: removed: page recall lost to the attended int4 tier")
    assert message.endswith("delete the key")
    assert error_of({"recall": {"attention_weight": 0.5}}).startswith(
        "agentkv.recall.attention_weight: removed: it weighted page recall"
    )
    # A removed key is not offered as a near miss of an unknown one.
    assert "pages" not in error_of({"recall": {"page": True}})
    assert AgentKVConfig.from_dict({"recall": {"page_tokens": 16}}).recall.page_tokens == 16


def test_literal_errors_list_allowed_values() -> None:
    assert error_of({"archive_tier": "disk"}) == (
        "agentkv.archive_tier: unknown value 'disk'; allowed: host, int8, int4, drop"
    )
    assert error_of({"dtype": "fp16"}) == (
        "agentkv.dtype: unknown value 'fp16'; allowed: auto, float32, float16, bfloat16"
    )


def test_device_shape() -> None:
    for device in ("cpu", "cuda", "cuda:1", "mps"):
        assert AgentKVConfig.from_dict({"device": device}).device == device
    assert error_of({"device": "CUDA 0"}).startswith("agentkv.device: not a torch device: 'CUDA 0'")


def test_one_line_per_problem() -> None:
    message = error_of(
        {"budget": {"device_tokens": -5, "host_tokens": 0}, "archive_tier": "disk", "polcy": 1}
    )
    lines = message.splitlines()
    assert len(lines) == 4
    assert {line.split(":")[0] for line in lines} == {
        "agentkv.budget.device_tokens",
        "agentkv.budget.host_tokens",
        "agentkv.archive_tier",
        "agentkv.polcy",
    }


def test_prefix_names_the_location() -> None:
    message = error_of({"budget": {"device_tokens": 0}}, prefix="graph.agentkv")
    assert message == "graph.agentkv.budget.device_tokens: must be > 0, got 0"


def test_section_not_a_mapping() -> None:
    assert error_of(["a"]) == "agentkv: must be a mapping, got a list ['a']"
    with pytest.raises(ValueError, match=r"^agentkv: must be a mapping, got str 'fast' \(g.yaml, line 1\)$"):
        AgentKVConfig.from_yaml_text("agentkv: fast\n", source="g.yaml")


# ------------------------------------------------------------------ watermarks


def test_watermarks() -> None:
    budget = AgentKVConfig.from_dict({"budget": {"high_watermark": 0.9, "low_watermark": 0.9}}).budget
    assert budget.high_watermark == budget.low_watermark == 0.9
    assert AgentKVConfig.from_dict({"budget": {"high_watermark": 1}}).budget.high_watermark == 1.0
    message = error_of({"budget": {"high_watermark": 0.5}})  # default low 0.8 is now above high
    assert message == "agentkv.budget.low_watermark: must be <= high_watermark (0.5), got 0.8"
    message = error_of({"budget": {"high_watermark": 0.7, "low_watermark": 0.75}})
    assert "low_watermark" in message and "high_watermark (0.7)" in message


def test_limited() -> None:
    assert not BudgetConfig().limited
    for key in ("device_tokens", "device_bytes", "host_tokens", "host_bytes", "global_device_bytes"):
        assert AgentKVConfig.from_dict({"budget": {key: 100}}).budget.limited


# ------------------------------------------------------------------ rules


def test_rules_accept_every_event_target_and_action() -> None:
    for event, targets in EVENT_TARGETS.items():
        rules = {event: {target: action for target, action in zip(targets, ACTIONS * 2, strict=False)}}
        assert AgentKVConfig.from_dict({"rules": rules}).rules == rules
    rules = {"custom:plan_approved": {"owner": "pin"}, "branch_opened": {}}
    assert AgentKVConfig.from_dict({"rules": rules}).rules == rules


def test_rules_errors() -> None:
    message = error_of({"rules": {"tool_call_done": {"result": "commit"}}})
    assert message.startswith("agentkv.rules.tool_call_done: unknown event")
    assert "allowed: " + ", ".join(EVENT_NAMES) + ", custom:<name>" in message

    message = error_of({"rules": {"turn_ended": {"answers": "keep"}}})
    assert message.startswith(
        "agentkv.rules.turn_ended.answers: unknown target for turn_ended (did you mean 'answer'?)"
    )
    assert "allowed: " + ", ".join(EVENT_TARGETS["turn_ended"]) in message

    message = error_of({"rules": {"turn_ended": {"reasoning": "drop"}}})
    assert message == (
        "agentkv.rules.turn_ended.reasoning: unknown action 'drop'; allowed: " + ", ".join(ACTIONS)
    )

    assert error_of({"rules": {"branch_opened": {"branch": "keep"}}}) == (
        "agentkv.rules.branch_opened.branch: unknown target for branch_opened; allowed: (none)"
    )
    assert error_of({"rules": {"custom:x": {"target": "pin"}}}) == (
        "agentkv.rules.custom:x.target: unknown target for custom:x; allowed: owner"
    )
    assert error_of({"rules": {"custom: ": {"owner": "pin"}}}).startswith(
        "agentkv.rules.custom: : custom event needs a name"
    )
    assert error_of({"rules": {"turn_ended": {"reasoning": 3}}}) == (
        "agentkv.rules.turn_ended.reasoning: must be a string, got 3"
    )
    assert error_of({"rules": {"turn_ended": "evict"}}) == (
        "agentkv.rules.turn_ended: must be a mapping, got str 'evict'"
    )


def test_rules_report_every_problem() -> None:
    rules = {
        "nope": {},
        "turn_ended": {"reasoning": "drop", "user": "commit"},
        "session_closed": {"x": "keep"},
    }
    lines = error_of({"rules": rules}).splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "agentkv.rules.nope",
        "agentkv.rules.turn_ended.reasoning",
        "agentkv.rules.session_closed.x",
    ]


# ------------------------------------------------------------------ YAML text and files


def test_a_directory_given_as_the_yaml_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml(tmp_path)
    assert str(info.value) == f"{tmp_path}: a directory, expected a YAML file with an `agentkv:` section"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "agentkv:\n  budget:\n    device_tokens: 512\n    device_tokens: 64\n",
            "line 4: invalid YAML: duplicate key 'device_tokens' in agentkv.budget (first at line 3)",
        ),
        ("agentkv: {policy: h2o, policy: full}\n", "line 1: invalid YAML: duplicate key 'policy' in agentkv"),
        ("agentkv: {}\nagentkv: {}\n", "line 2: invalid YAML: duplicate key 'agentkv' at the top level"),
    ],
)
def test_a_duplicate_key_is_an_error_with_file_and_line(tmp_path: Path, text: str, expected: str) -> None:
    file = tmp_path / "dup.yaml"
    file.write_text(text)
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml(file)
    assert str(info.value).startswith(f"{file}, {expected}")


def test_merge_keys_may_still_be_overridden() -> None:
    text = "base: &base {device_tokens: 512}\nagentkv:\n  budget:\n    <<: *base\n    device_tokens: 64\n"
    assert AgentKVConfig.from_yaml_text(text).budget.device_tokens == 64


def test_yaml_errors_name_path_and_line(tmp_path: Path) -> None:
    file = tmp_path / "graph.yaml"
    file.write_text("graph:\n  entry: agent\nagentkv:\n  budget:\n    device_tokens: -5\n  polcy: h2o\n")
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml(file)
    lines = str(info.value).splitlines()
    assert lines[0] == f"invalid agentkv config in {file}:"
    assert lines[1] == "agentkv.budget.device_tokens: must be > 0, got -5 (line 5)"
    assert lines[2].startswith("agentkv.polcy: unknown key (did you mean 'policy'?)")
    assert lines[2].endswith("(line 6)")


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    file = tmp_path / "broken.yaml"
    file.write_text("graph:\n  entry: agent\nagentkv:\n  budget: [1, 2\n  policy: h2o\n")
    with pytest.raises(ValueError, match=rf"^{file}, line \d+, column \d+: invalid YAML: "):
        AgentKVConfig.from_yaml(file)
    with pytest.raises(ValueError, match=r"^<string>, line 1, column \d+: invalid YAML"):
        AgentKVConfig.from_yaml_text("agentkv: {budget: [")


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        AgentKVConfig.from_yaml(missing)


def test_not_utf8(tmp_path: Path) -> None:
    file = tmp_path / "latin1.yaml"
    file.write_bytes("agentkv:\n  model: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.yaml: not UTF-8"):
        AgentKVConfig.from_yaml(file)


def test_missing_section() -> None:
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml_text("graph: {entry: agent}\nprompts: {}\n", source="graph.yaml")
    assert str(info.value) == "no `agentkv:` section in graph.yaml; top-level keys: graph, prompts"
    with pytest.raises(ValueError, match="no `agentkv:` section in <string>: the document is empty"):
        AgentKVConfig.from_yaml_text("# nothing here\n")


@pytest.mark.parametrize("text", ["- agentkv\n", "just text\n", "42\n"])
def test_top_level_not_a_mapping(text: str) -> None:
    with pytest.raises(ValueError, match="the top level must be a mapping"):
        AgentKVConfig.from_yaml_text(text, source="g.yaml")


@pytest.mark.parametrize(
    "text",
    [
        "a: 2024-13-45\n",  # PyYAML's own ValueError from an impossible date
        "\x01agentkv: {}\n",  # reader error: control character
        "a: !!python/object:os.system {}\n",  # unsafe tag refused by safe loading
        "a: 1\n---\nb: 2\n",  # two documents
        "agentkv: &a [*a]\n",  # alias cycle
        "[" * 2000,  # deeper than the parser's recursion
    ],
)
def test_hostile_yaml_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml_text(text)
    assert type(info.value) is ValueError


# ------------------------------------------------------------------ overrides


def test_with_overrides_deep_merges() -> None:
    base = AgentKVConfig.from_yaml(EXAMPLE)
    run = base.with_overrides({"budget": {"device_tokens": 512}, "rules": {"turn_ended": {"user": "pin"}}})
    assert run.budget.device_tokens == 512
    assert run.budget.host_tokens == base.budget.host_tokens == 8192
    assert run.rules["turn_ended"] == {"reasoning": "archive", "user": "pin"}
    assert run.rules["tool_call_failed"] == base.rules["tool_call_failed"]
    assert base.budget.device_tokens == 1024  # the original is untouched
    assert base.with_overrides(None) is base
    assert base.with_overrides({}) is base


def test_with_overrides_can_unset() -> None:
    base = AgentKVConfig.from_dict({"budget": {"device_tokens": 100}})
    assert not base.with_overrides({"budget": {"device_tokens": None}}).budget.limited


def test_with_overrides_policy() -> None:
    base = AgentKVConfig.from_dict({"policy": {"name": "snapkv", "window": 32, "kernel_size": 5}})
    assert base.with_overrides({"policy": {"window": 64}}).policy.params == {"window": 64, "kernel_size": 5}
    assert base.with_overrides({"policy": {"params": {"window": 8}}}).policy.params == {
        "window": 8,
        "kernel_size": 5,
    }
    assert base.with_overrides({"policy": {"name": "SnapKV", "window": 8}}).policy.params == {
        "window": 8,
        "kernel_size": 5,
    }
    # A different policy does not inherit the old one's parameters.
    assert base.with_overrides({"policy": "h2o"}).policy == PolicyConfig(name="h2o")
    assert base.with_overrides({"policy": {"name": "tova", "window": 4}}).policy == PolicyConfig(
        name="tova", params={"window": 4}
    )


def test_with_overrides_errors_name_the_override() -> None:
    base = AgentKVConfig()
    with pytest.raises(ValueError) as info:
        base.with_overrides({"budget": {"device_tokens": 0}})
    assert str(info.value) == "configurable.agentkv.budget.device_tokens: must be > 0, got 0"
    with pytest.raises(ValueError, match=r"^configurable.agentkv.polcy: unknown key"):
        base.with_overrides({"polcy": "h2o"})
    with pytest.raises(ValueError, match=r"^configurable.agentkv: must be a mapping, got str"):
        base.with_overrides("h2o")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^run.budget.low_watermark: must be <= high_watermark"):
        base.with_overrides({"budget": {"high_watermark": 0.5}}, prefix="run")


# ------------------------------------------------------------------ random documents


_keys = st.sampled_from(
    [
        "agentkv",
        "budget",
        "policy",
        "rules",
        "name",
        "params",
        "device_tokens",
        "device_bytes",
        "high_watermark",
        "low_watermark",
        "archive_tier",
        "keep_ratio",
        "turn_ended",
        "custom:x",
        "reasoning",
        "model",
        "group_size",
        "recall",
        "commit",
    ]
) | st.text(max_size=12)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**6), max_value=10**12)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["64MiB", "1.5 GB", "snapkv", "evict", "host", "int4", "0.5", "-1"])
)
_documents = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=5),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.dictionaries(st.just("agentkv"), _documents, min_size=1), _documents))
def test_random_documents_load_or_raise_value_error(document: Any) -> None:
    text = yaml.safe_dump(document, allow_unicode=True)
    try:
        config = AgentKVConfig.from_yaml_text(text)
    except ValueError as e:
        assert type(e) is ValueError
        assert str(e)
    else:
        assert isinstance(config, AgentKVConfig)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200) | st.text(alphabet="agentkv:{}[]- \n\t'\"&*!|>#%@`,?0123456789.", max_size=120))
def test_random_text_loads_or_raises_value_error(text: str) -> None:
    try:
        config = AgentKVConfig.from_yaml_text(text)
    except ValueError as e:
        assert type(e) is ValueError
    else:
        assert isinstance(config, AgentKVConfig)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_keys, _documents, max_size=4))
def test_random_overrides_give_a_config_or_value_error(overrides: dict[str, Any]) -> None:
    base = AgentKVConfig.from_yaml(EXAMPLE)
    try:
        config = base.with_overrides(overrides)
    except ValueError as e:
        assert type(e) is ValueError
    else:
        assert isinstance(config, AgentKVConfig)


# ------------------------------------------------------------------ schema and docs


def _config_models() -> list[type[BaseModel]]:
    return [
        cls
        for _, cls in inspect.getmembers(config_module, inspect.isclass)
        if issubclass(cls, BaseModel)
        and cls.__module__
        in (
            config_module.__name__,
            config_sections.__name__,
            config_engine.__name__,
            config_sessions.__name__,
        )
        and cls is not config_sections.Section
    ]


def test_every_field_is_described_and_its_docstring_matches() -> None:
    source = (
        inspect.getsource(config_module)
        + inspect.getsource(config_sections)
        + inspect.getsource(config_engine)
        + inspect.getsource(config_sessions)
    )
    tree = ast.parse(source)
    docstrings: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for stmt, after in zip(node.body, node.body[1:], strict=False):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                ):
                    docstrings[(node.name, stmt.target.id)] = str(after.value.value)
    models = _config_models()
    assert len(models) == 11
    for model in models:
        assert model.model_config.get("extra") == "forbid" and model.model_config.get("frozen") is True
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert docstrings.get((model.__name__, name)) == field.description, f"{model.__name__}.{name}"


def test_docs_configuration_md_is_current() -> None:
    rendered = render_config_reference()
    current = DOCS.read_text(encoding="utf-8") if DOCS.exists() else ""
    assert current == rendered, f"docs/configuration.md is stale; regenerate it with: {REGENERATE_COMMAND}"


def test_reference_covers_every_key_and_event() -> None:
    rendered = render_config_reference()
    for model in _config_models():
        for name, field in model.model_fields.items():
            assert f"`{name}`" in rendered
            assert str(field.description) in rendered
    for event in EVENT_NAMES:
        assert f"| `{event}` |" in rendered
    for action in ACTIONS:
        assert f"`{action}`" in rendered
    defaults = yaml.safe_load(
        rendered.split("```yaml\nagentkv:", 1)[1].split("```", 1)[0].join(["agentkv:", ""])
    )
    assert AgentKVConfig.from_dict(defaults["agentkv"]) == AgentKVConfig()


def test_example_graph_yaml_builds_its_policy():
    from agentkv.policies.factory import make_policy

    config = AgentKVConfig.from_yaml(EXAMPLE)
    assert make_policy(config.policy.name, config.policy.params) is not None


def test_policy_parameter_typo_fails_at_load_with_path_line_and_hint(tmp_path: Any) -> None:
    """A misspelt policy parameter is a load-time error, not a crash when the first session opens."""
    path = tmp_path / "graph.yaml"
    path.write_text("graph: {}\nagentkv:\n  policy:\n    name: snapkv\n    windw: 32\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml(path)
    message = str(info.value)
    assert "agentkv.policy.windw: unknown parameter of policy 'snapkv'" in message
    assert "(did you mean 'window'?)" in message and "(line 5)" in message
    assert "allowed: window, kernel_size, pooling" in message
    nested = error_of({"policy": {"name": "h2o", "params": {"recent_tokns": 8}}})
    assert nested.startswith("agentkv.policy.params.recent_tokns: unknown parameter of policy 'h2o'")
    assert "did you mean 'recent_tokens'?" in nested


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ('    window: "sixteen"\n', "agentkv.policy.window: must be an int >= 1, got 'sixteen' (line 5)"),
        ("    window: -3\n", "agentkv.policy.window: must be an int >= 1, got -3 (line 5)"),
        ("    params:\n      kernel_size: 4\n", "agentkv.policy.params.kernel_size: must be odd"),
    ],
)
def test_policy_parameter_values_fail_at_load_with_path_and_line(
    tmp_path: Path, written: str, expected: str
) -> None:
    """A value the policy rejects is a load-time error at its YAML path, not a failure at the first call."""
    path = tmp_path / "graph.yaml"
    path.write_text(f"graph: {{}}\nagentkv:\n  policy:\n    name: snapkv\n{written}", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml(path)
    assert type(info.value) is ValueError
    assert expected in str(info.value)
    if "kernel_size" in written:
        assert str(info.value).rstrip().endswith("(line 6)")


def test_policy_parameter_values_from_overrides_are_checked() -> None:
    config = AgentKVConfig.from_dict({"policy": {"name": "h2o"}})
    message = str(pytest.raises(ValueError, config.with_overrides, {"policy": {"recent_ratio": 2}}).value)
    assert message == "configurable.agentkv.policy.params.recent_ratio: must be a number in [0, 1], got 2"


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    """The watermark order is checked even when another field of the same section is wrong."""
    text = (
        "agentkv:\n"
        "  budget:\n"
        "    device_tokens: -1\n"
        "    high_watermark: 0.5\n"
        "    low_watermark: 0.9\n"
        "  policy:\n"
        "    name: snapkv\n"
        "    window: -3\n"
    )
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml_text(text)
    assert str(info.value).splitlines()[1:] == [
        "agentkv.budget.device_tokens: must be > 0, got -1 (line 3)",
        "agentkv.policy.window: must be an int >= 1, got -3 (line 8)",
        "agentkv.budget.low_watermark: must be <= high_watermark (0.5), got 0.9 (line 5)",
    ]


def test_unknown_policy_name_and_section_as_list_name_their_line() -> None:
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml_text("graph: {}\nagentkv:\n  policy: snapkvv\n")
    assert str(info.value).endswith(
        "(did you mean 'snapkv'?); " + f"allowed: {', '.join(ALLOWED_POLICIES)} (line 3)"
    )
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml_text("graph: {}\nagentkv:\n  - policy: snapkv\n")
    assert (
        str(info.value) == "agentkv: must be a mapping, got a list [{'policy': 'snapkv'}] (<string>, line 2)"
    )
    with pytest.raises(ValueError) as info:
        AgentKVConfig.from_yaml_text("agentkv:\n  budget:\n    - device_tokens: 5\n")
    assert "agentkv.budget: must be a mapping, got a list" in str(info.value)
    assert str(info.value).endswith("(line 2)")
