"""The demo and `inspect` run end to end on the tiny model and write what they promise."""

from __future__ import annotations

import json

from rich.console import Console

from agentkv.cli import build_parser
from agentkv.demo import run_demo
from agentkv.inspect import load_snapshot, plot_span_strip, print_inspection


def test_demo_runs_both_modes_and_writes_outputs(tiny_model, tiny_tokenizer, tmp_path):
    console = Console(file=open(tmp_path / "console.txt", "w"), width=160)  # noqa: SIM115
    summary = run_demo(
        tiny_model,
        tiny_tokenizer,
        turns=3,
        budget_tokens=96,
        max_new_tokens=3,
        out_dir=tmp_path,
        console=console,
    )
    assert summary["turns"] == 3
    assert summary["total_prefilled"]["agentkv"] < summary["total_prefilled"]["full"]
    assert summary["final_device_bytes"]["agentkv"] < summary["final_device_bytes"]["full"]
    for name in ("demo.json", "device_bytes.png", "spans.png", "session.json"):
        assert (tmp_path / name).stat().st_size > 0
    rows = json.loads((tmp_path / "demo.json").read_text())["turns"]
    assert {r["run"] for r in rows} == {"agentkv", "full"}
    assert any("turn_ended" in r["events"] for r in rows)


def test_inspect_renders_a_saved_snapshot(tiny_model, tiny_tokenizer, tmp_path):
    from agentkv import AgentKVConfig, TransformersBackend

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


def test_cli_help_names_the_commands():
    parser = build_parser()
    text = parser.format_help()
    for command in ("demo", "bench", "inspect"):
        assert command in text
    args = parser.parse_args(["demo", "--turns", "3", "--budget", "0"])
    assert args.turns == 3 and args.budget == 0
