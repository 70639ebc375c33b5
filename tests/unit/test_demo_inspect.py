"""The demo and `inspect` run end to end on the tiny model and write what they promise."""

from __future__ import annotations

import copy
import io
import json
import logging
import re
import sys

import pytest
import torch
from rich.console import Console

from agentkv.cli import build_parser, main
from agentkv.config import AgentKVConfig
from agentkv.demo import DEFAULT_BUDGET_TOKENS, RecallAnswer, demo_config, first_word
from agentkv.inspection import (
    load_snapshot,
    message_text,
    plot_span_strip,
    print_inspection,
    span_strip_figure,
    span_table,
)
from agentkv_bench.cli import build_parser as bench_parser


@pytest.fixture(scope="module")
def demo_model(tiny_model) -> torch.nn.Module:
    """The tiny random Llama with room for the agent's histories (its tokenizer is verbose)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = copy.deepcopy(tiny_model.config)
    config.max_position_embeddings = 16384
    model = LlamaForCausalLM(config).eval().to(torch.float32)
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def demo_run(demo_model, tiny_tokenizer, tmp_path_factory):
    """One demo run (3 turns: a tool turn, an answer turn, a tool turn) shared by the checks below."""
    pytest.importorskip("langgraph")
    from agentkv_langgraph.demo import run_demo

    out = tmp_path_factory.mktemp("demo")
    seen = []
    with open(out / "console.txt", "w") as f:
        summary = run_demo(
            demo_model,
            tiny_tokenizer,
            turns=3,
            budget_tokens=600,
            max_new_tokens=4,
            out_dir=out,
            console=Console(file=f, width=200),
            on_turn=seen.append,
        )
    return summary, seen, out


def test_demo_runs_the_agent_twice_and_reports_each_turn(demo_run):
    summary, seen, out = demo_run
    rows = json.loads((out / "demo.json").read_text())["turns"]
    # The runs alternate turn by turn (load drift on the machine slows both alike).
    assert [(r["run"], r["turn"]) for r in rows] == [
        (run, t) for t in (1, 2, 3) for run in ("agentkv", "full")
    ]
    assert [(r.run, r.turn) for r in seen] == [(r["run"], r["turn"]) for r in rows]  # on_turn saw each, live
    ours = [r for r in rows if r["run"] == "agentkv"]
    full = [r for r in rows if r["run"] == "full"]
    # The script: turns 1 and 3 force a tool call (call + answer), turn 2 answers directly.
    assert [r["model_calls"] for r in ours] == [r["model_calls"] for r in full] == [2, 1, 2]
    # The lifecycle run encodes only what is new; the baseline re-encodes every call's whole history.
    assert summary["total_prefilled"]["agentkv"] < summary["total_prefilled"]["full"]
    assert all(r["reused"] > 0 for r in ours[1:]) and all(r["reused"] == 0 for r in full)
    assert ours[-1]["prefilled"] < full[-1]["prefilled"]
    # Events: the handler's, per turn. Tool turns complete their call; every turn ends.
    assert ours[0]["events"] == ["tool_call_completed", "turn_ended"]
    assert ours[1]["events"] == ["turn_ended"]
    assert all(r["events"] == [] for r in full)
    assert any(r["moves"].get("committed") for r in ours)
    assert all(sum(r["tokens_by_state"].values()) > 0 for r in rows)
    assert all(r["ttft_ms"] > 0 for r in rows)
    # The budget holds the agentkv session's device KV below the baseline's full cache.
    assert summary["budget_tokens"] == 600 and summary["budget_bytes"] > 0
    assert summary["final_device_bytes"]["agentkv"] < summary["final_device_bytes"]["full"]
    assert summary["device_saved"] > 0
    # Total counts the host tier too: what was archived there is not "saved".
    final = summary["final_total_bytes"]["agentkv"]
    assert final == (
        summary["final_device_bytes"]["agentkv"]
        + summary["final_quantized_bytes"]["agentkv"]
        + summary["final_host_bytes"]["agentkv"]
    )
    assert summary["total_saved"] <= summary["device_saved"]
    assert summary["budget_checks_unmet"] >= 0
    assert summary["handler_errors"] == 0
    assert [a["gold"] for a in summary["recall"]] == ["1889", "Lyon"]
    for answer in summary["recall"]:
        assert answer["same"] == (first_word(answer["agentkv"]) == first_word(answer["full"]))
        assert answer["agentkv_correct"] == (first_word(answer["agentkv"]) == answer["gold"].casefold())
    assert summary["recall_matches_full_cache"] == all(a["same"] for a in summary["recall"])
    assert summary["wall_seconds"]["agentkv"] > 0 and summary["wall_seconds"]["full"] > 0


def test_demo_writes_its_files_and_summary(demo_run):
    summary, _, out = demo_run
    for name in ("demo.json", "device_bytes.png", "spans.png", "session.json"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "demo.json").read_text())["summary"] == json.loads(json.dumps(summary))
    snapshot = load_snapshot(out / "session.json")
    assert snapshot["session_id"] == "demo"
    assert {"tool_call", "tool_result", "user", "assistant"} <= {s["kind"] for s in snapshot["spans"]}
    text = (out / "console.txt").read_text()
    for phrase in ("agentkv demo", "TTFT ms", "tool_call_completed", "same answer as the full cache", "1889"):
        assert phrase in text
    flat = " ".join(text.split())
    assert "KV at the end: device" in flat and "total" in flat and "600-token device budget" in flat


def test_demo_budget_convention():
    assert demo_config(None, None).budget.device_tokens == DEFAULT_BUDGET_TOKENS
    assert demo_config(None, 100).budget.device_tokens == 100
    unlimited = demo_config(AgentKVConfig.from_dict({"budget": {"device_bytes": "1MiB"}}), 0)
    assert unlimited.budget.device_tokens is None and unlimited.budget.device_bytes is None
    own = AgentKVConfig.from_dict({"budget": {"device_bytes": "1MiB"}})
    assert demo_config(own, None) == own  # the config's own budget wins when --budget is not given
    with pytest.raises(ValueError, match="budget"):
        demo_config(None, -1)


def test_recall_answers_compare_the_fact_not_the_rambling():
    answer = RecallAnswer(
        "Which city?", "It went to", "Lyon", agentkv=" Lyon, France.", full=" Lyon.\n\nThe E"
    )
    assert answer.same and answer.to_dict()["agentkv_correct"] and answer.to_dict()["full_correct"]
    wrong = RecallAnswer("Which year?", "It was done in", "1889", agentkv=" 1987.", full=" 1889 for the")
    assert not wrong.same
    assert wrong.to_dict()["full_correct"] and not wrong.to_dict()["agentkv_correct"]
    assert first_word("") == ""


def test_inspect_renders_a_saved_snapshot(tiny_model, tiny_tokenizer, tmp_path):
    from agentkv import TransformersBackend

    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig())
    session = backend.session("inspect-me")
    session.extend([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    path = tmp_path / "snap.json"
    session.save_snapshot(str(path))
    snapshot = load_snapshot(path)
    assert [s["kind"] for s in snapshot["spans"]] == ["system", "user"]
    assert snapshot["stats"]["device_bytes"] == sum(s["bytes"] for s in snapshot["spans"])
    out = tmp_path / "console.txt"
    with open(out, "w") as f:
        print_inspection(path, Console(file=f, width=200))
    assert "inspect-me" in out.read_text()
    assert plot_span_strip(path, tmp_path / "strip.png").stat().st_size > 0


def test_cli_help_names_the_commands_and_demo_options(capsys):
    parser = build_parser()
    text = parser.format_help()
    for command in ("demo", "bench", "inspect"):
        assert command in text
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    demo_help = " ".join(capsys.readouterr().out.split())
    options = ("--model", "--budget", "--config", "--turns", "--out", "--max-new-tokens", "--no-progress")
    assert all(option in demo_help for option in options)
    assert "0 = unlimited" in demo_help and "agentkv:" in demo_help and "re-encoded" in demo_help
    args = parser.parse_args(["demo", "--turns", "3", "--budget", "0"])
    assert args.turns == 3 and args.budget == 0
    assert parser.parse_args(["demo"]).budget is None  # the config's budget, else 512


def test_cli_bench_memory_scoping_options(capsys):
    args = bench_parser().parse_args(
        ["memory", "--methods", "agentkv, h2o", "--workloads", "travel", "--budgets", "0.5,0.25"]
    )
    assert (args.methods, args.workloads, args.budgets) == ("agentkv, h2o", "travel", "0.5,0.25")
    assert main(["bench", "memory", "--budgets", "half"]) == 2  # checked before the model loads
    assert "--budgets: expected comma-separated fractions" in " ".join(capsys.readouterr().err.split())


def test_cli_demo_bad_config_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "graph.yaml"
    bad.write_text("agentkv:\n  budget:\n    device_tokens: -5\n")
    assert main(["demo", "--config", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "agentkv.budget.device_tokens" in err
    assert main(["demo", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_cli_demo_without_langgraph_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "agentkv_langgraph.demo", None)  # import fails as if not installed
    assert main(["demo", "--turns", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "pip install 'agentkv-lifecycle[agents]'" in err


def test_budget_warnings_become_one_summary_line(caplog):
    from agentkv.demo import budget_line, quiet_budget_warnings

    lifecycle = logging.getLogger("agentkv.lifecycle")
    with caplog.at_level(logging.WARNING), quiet_budget_warnings() as quiet:
        for _ in range(3):
            lifecycle.warning("session %s: device budget %d B cannot be met (%d B held)", "demo", 10, 20)
        lifecycle.warning("session demo: rehydrate of span 3 failed")
    assert quiet.dropped == 3
    assert [r.getMessage() for r in caplog.records] == ["session demo: rehydrate of span 3 failed"]
    lifecycle.warning("session %s: device budget %d B cannot be met (%d B held)", "demo", 10, 20)
    assert len(caplog.records) == 2  # outside the block, warnings show again
    summary = {
        "budget_tokens": 512,
        "budget_bytes": 2**20,
        "budget_checks_unmet": 4,
        "peak_device_bytes": {"agentkv": 3 * 2**20},
    }
    line = budget_line(summary)
    assert "512-token device budget was exceeded after 4 operation(s)" in line and "3.0 MiB" in line
    assert "was met after every operation" in budget_line({**summary, "budget_checks_unmet": 0})
    assert budget_line({**summary, "budget_bytes": None}) == "device budget: none (unlimited)"


def _snapshot(spans: int = 3) -> dict:
    kinds = [
        ("system", None, "committed", "attended_quantized"),
        ("user", "msg-7a1f3c2e-44", "archived", "host"),
    ]
    kinds.append(("tool_result", "call_abcdef123456", "evicted", "dropped"))
    rows = [
        {
            "span_id": i,
            "kind": kind,
            "owner": owner,
            "start": 120 * i,
            "tokens": 120,
            "held_tokens": 60,
            "state": state,
            "tier": tier,
            "pinned": i == 0,
            "bytes": 123456 * i,
            "preview": "You are a helpful assistant. The order QX-7305 has shipped",
        }
        for i, (kind, owner, state, tier) in enumerate(kinds[:spans])
    ]
    return {"session_id": "thread-1", "stats": {"device_bytes": 10}, "spans": rows}


def test_cli_inspect_or_config_of_a_directory_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err and "IsADirectoryError" not in err
    assert "a directory, expected a JSON snapshot file" in err
    assert main(["demo", "--config", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "a directory, expected a YAML file with an `agentkv:` section" in err


@pytest.mark.parametrize(
    ("broken", "expected"),
    [
        (lambda s: s["spans"][1].pop("state"), r"spans\[1\] has no 'state'"),
        (lambda s: s.pop("stats"), r"not a session snapshot: missing 'stats'"),
        (lambda s: s["spans"].append(7), r"spans\[3\] must be an object, got int"),
        (lambda s: s["spans"][0].update(tokens="many"), r"spans\[0\]\.tokens must be int, got 'many'"),
    ],
)
def test_cli_inspect_malformed_snapshot_is_a_clear_error(tmp_path, capsys, broken, expected) -> None:
    """A snapshot missing what `inspect` reads exits with rc 2 and a message naming the span and key."""
    snapshot = _snapshot()
    broken(snapshot)
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(snapshot))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyError" not in err
    flat = "".join(err.split())  # the console wraps long lines at the terminal's width
    assert re.search(expected.replace(" ", ""), flat), err
    assert str(path) in flat


def test_span_table_keeps_every_fixed_column_whole_at_80_columns() -> None:
    """At 80 columns only owner and preview are cut; ids, kinds, states, tiers and sizes stay whole."""
    with io.StringIO() as out:
        Console(file=out, width=80, color_system=None).print(span_table(_snapshot()))
        text = out.getvalue()
    lines = [line for line in text.splitlines() if line.strip()]
    header = next(line for line in lines if " kind " in line)
    for column in ("id", "kind", "owner", "state", "tier", "pin", "tokens", "held", "bytes"):
        assert re.search(rf"\b{column}\b", header), header
    rows = [line for line in lines if re.match(r"^\s*\d+ ", line)]
    assert len(rows) == 3  # one line per span: nothing wrapped
    for value in ("tool_result", "committed", "archived", "evicted", "dropped", "241.1 KiB", "120.6 KiB"):
        assert value in text
    assert "attended-q" in text  # the attended quantized tier, by its short name
    assert all(len(line) <= 80 for line in lines)


@pytest.mark.parametrize(
    "preview",
    [
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>",
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the weather in Paris?<|eot_id|>",
        "<start_of_turn>user\nWhat is the weather in Paris?<end_of_turn>",
    ],
    ids=["chatml", "llama3", "gemma"],
)
def test_the_preview_at_80_columns_shows_the_message_not_the_template(preview: str) -> None:
    snapshot = _snapshot()
    for span in snapshot["spans"]:
        span["preview"] = preview
    assert message_text(preview) == "What is the weather in Paris?"
    with io.StringIO() as out:
        Console(file=out, width=80, color_system=None).print(span_table(snapshot))
        text = out.getvalue()
    rows = [line for line in text.splitlines() if re.match(r"^\s*\d+ ", line)]
    assert len(rows) == 3 and all(re.search(r" What\b", row) for row in rows), text
    assert "<|" not in text and "im_s" not in text and "‹" not in text


def test_span_strip_legend_does_not_overlap_the_axis_label() -> None:
    import matplotlib.pyplot as plt

    figure = span_strip_figure(_snapshot())
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
        label = figure.axes[0].xaxis.label.get_window_extent(renderer)
        legend = figure.legends[0].get_window_extent(renderer)
        assert not label.overlaps(legend)
        assert legend.y1 <= label.y0  # the legend is its own row, below the label
    finally:
        plt.close(figure)
