"""`agentkv bench memory`: workloads, replay, metrics and the runner's JSON, on the tiny model."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from agentkv import AgentKVConfig, TransformersBackend
from agentkv.spans import SpanKind, SpanState
from agentkv_bench import memory
from agentkv_bench.memory import (
    BASELINES,
    METHODS,
    Method,
    answer_text,
    decided,
    exact_match,
    gold_logprob,
    kl_divergence,
    normalise_answer,
    replay,
    run_memory_bench,
)
from agentkv_bench.methods import suite_of
from agentkv_bench.workloads import MAX_TURNS, MIN_TURNS, load_workload, load_workloads, parse_workload


def tiny_workload(name: str = "tiny") -> dict[str, Any]:
    """Eight short turns with every kind of step: facts, a tool, a failed tool, a confirmation, branches."""
    turns: list[dict[str, Any]] = [
        {"user": "The secret code is 4417. Remember it.", "assistant": "Noted the code."},
        {
            "user": "Search the weather in Paris.",
            "tools": [
                {
                    "name": "search",
                    "args": {"q": "Paris"},
                    "result": "lorem ipsum sunny skies, tracking ZX-99 dolor",
                }
            ],
            "assistant": "It is sunny.",
        },
        {"user": "Shall we go?", "assistant": "Shall I book seat 12?"},
        {"user": "Yes, book it.", "confirms_previous": True, "assistant": "Booked."},
        {
            "user": "Plan the day.",
            "branches": {
                "options": [
                    {"id": "museum", "reasoning": "the museum"},
                    {"id": "beach", "reasoning": "the beach"},
                ],
                "selected": "museum",
            },
            "assistant": "The museum it is.",
        },
        {
            "user": "Check the news.",
            "tools": [{"name": "news", "args": {}, "result": "error 503 upstream", "failed": True}],
            "assistant": "The news tool failed.",
        },
        {"user": "lorem ipsum dolor sit amet", "assistant": "consectetur adipiscing elit"},
        {"user": "the user asked about the weather", "assistant": "the tool returned sunny skies"},
    ]
    return {
        "name": name,
        "title": "tiny",
        "system": "You are a helpful assistant.",
        "turns": turns,
        "questions": [
            {
                "id": "code",
                "question": "What is the secret code?",
                "prefix": "The secret code is",
                "gold": "4417",
                "source": "user",
                "turn": 1,
            },
            {
                "id": "tracking",
                "question": "What was the tracking number?",
                "prefix": "tracking",
                "gold": "ZX-99",
                "source": "tool",
                "turn": 2,
            },
        ],
    }


# -- workloads --------------------------------------------------------------------------------------


def test_shipped_workloads_load_and_validate() -> None:
    workloads = load_workloads()
    assert len(workloads) >= 4
    for w in workloads:
        assert MIN_TURNS <= len(w.turns) <= MAX_TURNS
        assert any(t.tools for t in w.turns), w.name
        assert any(tool.failed for t in w.turns for tool in t.tools), w.name
        assert any(t.branches is not None for t in w.turns), w.name
        assert any(t.confirms_previous for t in w.turns), w.name
        assert {q.source for q in w.questions} >= {"user", "tool"}, w.name
        for q in w.questions:
            assert any(q.gold in text for text in w.turns[q.turn - 1].texts())


def test_chosen_and_paraphrase_questions_load() -> None:
    data = copy.deepcopy(tiny_workload())
    data["questions"].append(
        {
            "id": "plan",
            "question": "Where did we decide to spend the day?",
            "prefix": "We decided on",
            "gold": "museum",
            "source": "chosen",
            "turn": 5,
            "style": "paraphrase",
        }
    )
    workload = parse_workload(data)
    plan = workload.questions[-1]
    assert (plan.source, plan.style) == ("chosen", "paraphrase")
    assert workload.questions[0].style == "quote"  # the default
    data["turns"][4]["branches"]["selected"] = "beach"  # the fact is now in a pruned option only
    with pytest.raises(ValueError, match="not in its selected tree-of-thought option"):
        parse_workload(data)


def _with_proposals() -> dict[str, Any]:
    """The tiny workload with turn 7 listing three options as messages and turn 8 picking the second."""
    data = copy.deepcopy(tiny_workload())
    data["turns"][6] = {
        "user": "Which courier should we use?",
        "proposals": [
            {"id": "A", "text": "Option A: Northway, 2 days, 41 EUR."},
            {"id": "B", "text": "Option B: Kestrel Freight, next day, 57 EUR."},
            {"id": "C", "text": "Option C: Pellman, 3 days, 33 EUR."},
        ],
    }
    data["turns"][7] = {"user": "Go with B.", "chooses": "B", "assistant": "Kestrel Freight booked."}
    data["questions"].append(
        {
            "id": "courier",
            "question": "Which carrier did I pick?",
            "prefix": "You picked",
            "gold": "Kestrel Freight",
            "source": "chosen",
            "turn": 7,
            "style": "paraphrase",
        }
    )
    return data


def test_proposals_load_and_a_chosen_question_names_the_picked_one() -> None:
    workload = parse_workload(_with_proposals())
    options, pick = workload.turns[6], workload.turns[7]
    assert [p.id for p in options.proposals] == ["A", "B", "C"] and options.assistant == ""
    assert pick.chooses == "B"
    data = _with_proposals()
    data["turns"][7]["chooses"] = "C"  # the gold is now in an option nobody picked
    with pytest.raises(ValueError, match="not in its selected tree-of-thought option or chosen proposal"):
        parse_workload(data)
    data["turns"][7]["chooses"] = "D"
    with pytest.raises(
        ValueError, match=r"turns\[7\].chooses: 'D' is not one of the previous turn's proposals"
    ):
        parse_workload(data)
    data = _with_proposals()
    data["turns"][6]["proposals"] = data["turns"][6]["proposals"][:1]
    with pytest.raises(ValueError, match="a choice needs at least 2 proposals"):
        parse_workload(data)


def test_replay_writes_each_proposal_as_a_message_and_confirms_the_pick(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    session = backend.session("proposals")
    confirmations: list[Any] = []
    extend = session.extend

    def extend_spy(messages: Any, **kwargs: Any) -> Any:
        confirmations.extend(kwargs.get("events", ()))
        return extend(messages, **kwargs)

    session.extend = extend_spy  # type: ignore[method-assign]
    history = replay(session, parse_workload(_with_proposals()), events=True)
    options = [m for m in history if str(m.get("id", "")).startswith("a7")]
    assert [m["id"] for m in options] == ["a7-A", "a7-B", "a7-C"]  # three messages, no closing answer
    assert [(e.name, e.owner) for e in confirmations if e.owner and e.owner.startswith("a7")] == [
        ("user_confirmed", "a7-B")
    ]
    (chosen,) = session.spans_owned_by("a7-B")
    assert chosen.pinned
    assert not any(s.pinned for s in (*session.spans_owned_by("a7-A"), *session.spans_owned_by("a7-C")))
    session.check()


def test_load_by_path_and_unknown_name(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(tiny_workload("mine")))
    assert load_workload(path).name == "mine"
    with pytest.raises(FileNotFoundError, match="shipped workloads: .*travel"):
        load_workload("no-such-workload")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["turns"].pop(), r"tiny.turns: expected 8 to 15 turns, got 7"),
        (
            lambda d: d["questions"][0].update(gold="9999"),
            r"tiny.questions\[0\].gold: '9999' does not appear in turn 1",
        ),
        (
            lambda d: d["questions"][0].update(turn=99),
            r"tiny.questions\[0\].turn: expected a turn number from 1 to 8",
        ),
        (
            lambda d: d["questions"][0].update(source="memo"),
            r"source: unknown 'memo'; allowed: user, tool, confirmed",
        ),
        (
            lambda d: d["turns"][4]["branches"].update(selected="moon"),
            r"turns\[4\].branches.selected: 'moon' is not",
        ),
        (lambda d: d["turns"][0].update(colour="red"), r"tiny.turns\[0\]: unknown key\(s\) \['colour'\]"),
        (lambda d: d["turns"][0].update(confirms_previous=True), r"the first turn has no previous answer"),
        (
            lambda d: d["turns"][1]["tools"][0].update(result=""),
            r"turns\[1\].tools\[0\].result: expected a non-empty",
        ),
        (lambda d: d["questions"].append(dict(d["questions"][0])), r"duplicate ids \['code'\]"),
        (
            lambda d: d["questions"][0].update(style="verbatim"),
            r"questions\[0\].style: unknown 'verbatim'; allowed: quote, paraphrase",
        ),
        (
            lambda d: d["questions"][0].update(source="chosen"),
            r"questions\[0\].source: .* is in turn 1 but not in its selected tree-of-thought option",
        ),
        (
            lambda d: d["questions"][0].update(source="tool"),
            r"questions\[0\].source: .* is in turn 1 but not in its tool results",
        ),
    ],
)
def test_invalid_workloads_name_the_json_path(edit: Any, message: str) -> None:
    data = copy.deepcopy(tiny_workload())
    edit(data)
    with pytest.raises(ValueError, match=message):
        parse_workload(data)


# -- metrics --------------------------------------------------------------------------------------


def test_normalise_and_exact_match() -> None:
    assert normalise_answer("  KX7-4471.\n") == "kx7 4471"
    assert normalise_answer("Pensão  Rosa") == "pensão rosa"
    assert exact_match(" KX7-4471.", "KX7-4471")
    assert exact_match(' "kx7 4471" and more', "KX7-4471")
    assert exact_match('189.99"', "189.99")
    assert not exact_match(" KX7-44712", "KX7-4471")  # a different number
    assert not exact_match(" the code KX7-4471", "KX7-4471")  # not where the fact belongs
    assert not exact_match(" KX7", "KX7-4471")  # incomplete
    assert not exact_match("anything", "...")  # a gold answer without words never matches


def test_decided_agrees_with_exact_match() -> None:
    assert not decided("", "KX7-4471")
    assert not decided(" KX7-44", "KX7-4471")
    assert not decided(" KX7-4471", "KX7-4471")  # could still become KX7-44712
    assert decided(" KX7-4471. We", "KX7-4471") and exact_match(" KX7-4471. We", "KX7-4471")
    assert decided(" 2025", "KX7-4471") and not exact_match(" 2025", "KX7-4471")


def test_answer_text_glues_to_prefixes_that_end_inside_a_token() -> None:
    assert answer_text("The code is", "KX7") == " KX7"
    assert answer_text('"unit_price": "', "189.99") == "189.99"
    assert answer_text("number is C-", "558204") == "558204"
    assert answer_text("", "x") == "x"


def test_kl_divergence_on_handcrafted_distributions() -> None:
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.9, 0.1]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-6)  # float32 inputs
    assert kl_divergence(p, p) == 0.0
    assert kl_divergence(q, p) != pytest.approx(expected)  # not symmetric


def test_gold_logprob_on_handcrafted_logits() -> None:
    vocab = 4
    logits = torch.zeros(5, vocab)  # prompt of 3 tokens, target of 2
    logits[2, 1] = math.log(3.0)  # after the prompt: token 1 has p = 3/6
    logits[3, 2] = math.log(5.0)  # then token 2 has p = 5/8
    logprob, first = gold_logprob(logits, 3, [1, 2])
    assert logprob == pytest.approx(math.log(3 / 6) + math.log(5 / 8))
    assert first.exp().sum().item() == pytest.approx(1.0)
    assert first[1].exp().item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="prompt_len must be >= 1"):
        gold_logprob(logits, 0, [1])


def test_gold_logprob_matches_answer_logprob(tiny_model: Any, tiny_tokenizer: Any) -> None:
    session = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full")).session("lp")
    session.extend(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "The secret code is 4417."}]
    )
    prefix, answer = "The secret code is", " 4417"
    prompt = session.format.generation_prompt_ids(session.messages) + session.format.encode(prefix)
    target = session.format.encode(answer)
    logprob, _ = gold_logprob(session.continuation_logits(prompt + target), len(prompt), target)
    assert logprob == pytest.approx(session.answer_logprob(answer, prefix=prefix), abs=1e-4)


# -- replay ---------------------------------------------------------------------------------------


def _replayed(
    tiny_model: Any, tiny_tokenizer: Any, *, events: bool
) -> tuple[TransformersBackend, Any, list[tuple[str, bool]]]:
    backend = TransformersBackend(tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
    session = backend.session("replay")
    workload = parse_workload(tiny_workload())
    sent: list[tuple[str, bool]] = []
    apply = session.apply

    def spy(event: Any) -> Any:
        result = apply(event)
        sent.append((event.name, result.applied))
        return result

    extend = session.extend

    def extend_spy(messages: Any, **kwargs: Any) -> Any:
        # A confirmation arrives with the user message that gives it (`extend(..., events=...)`).
        result = extend(messages, **kwargs)
        for event, applied in zip(kwargs.get("events", ()), result.applied, strict=True):
            sent.append((event.name, applied.applied))
        return result

    session.apply = spy  # type: ignore[method-assign]
    session.extend = extend_spy  # type: ignore[method-assign]
    steps: list[str] = []
    history = replay(session, workload, events=events, on_step=steps.append)
    assert steps == [f"t{i}" for i in range(1, 9)]
    assert len(history) == 1 + 2 * 8 + 2 * 2  # system, user + answer per turn, call + result per tool
    session.check()
    return backend, session, sent


def test_replay_sends_the_events_an_agent_framework_would(tiny_model: Any, tiny_tokenizer: Any) -> None:
    backend, session, sent = _replayed(tiny_model, tiny_tokenizer, events=True)
    (result,) = session.spans_owned_by("call-2-0")
    assert result.kind is SpanKind.TOOL_RESULT and result.state is SpanState.COMMITTED
    (failed,) = session.spans_owned_by("call-6-0")
    assert failed.kind is SpanKind.TOOL_RESULT and failed.state is SpanState.COMMITTED  # its error is kept
    (call,) = session.spans_owned_by("a2-call0")
    assert call.kind is SpanKind.TOOL_CALL and call.state in (SpanState.EVICTABLE, SpanState.EVICTED)
    (confirmed,) = session.spans_owned_by("a3")
    assert confirmed.pinned and confirmed.state is SpanState.COMMITTED
    assert [s.session_id for s in backend.sessions()] == ["replay"]  # branch sessions closed
    assert [name for name, _ in sent] == [
        "turn_ended",
        "tool_call_completed",
        "turn_ended",
        "turn_ended",
        "user_confirmed",
        "turn_ended",
        "branch_opened",
        "branch_opened",
        "branch_pruned",
        "branch_selected",
        "turn_ended",
        "tool_call_failed",
        "turn_ended",
        "turn_ended",
        "turn_ended",
    ]
    assert all(applied for _, applied in sent)
    assert not any(s.state is SpanState.ACTIVE for s in session.spans)  # every turn ended


def test_replay_without_events_leaves_lifecycle_to_defaults(tiny_model: Any, tiny_tokenizer: Any) -> None:
    backend, session, sent = _replayed(tiny_model, tiny_tokenizer, events=False)
    assert sent == []
    (failed,) = session.spans_owned_by("call-6-0")
    assert failed.state is SpanState.COMMITTED  # only the implicit turn end saw it: kept as a tool result
    (confirmed,) = session.spans_owned_by("a3")
    assert not confirmed.pinned
    names = {r.detail.get("event") for r in session.log if r.kind == "event"}
    assert names <= {"turn_ended"}  # only the implicit turn end of each new user message
    assert [s.session_id for s in backend.sessions()] == ["replay"]  # branch tasks cleaned up anyway


# -- runner ---------------------------------------------------------------------------------------


def test_methods_configure_sessions() -> None:
    assert METHODS["full"].config(100).budget.device_tokens is None
    window = METHODS["window"].config(100)
    assert window.policy.name == "window" and window.budget.device_tokens == 100
    assert METHODS["agentkv"].config(100).archive_tier == "host"
    assert METHODS["agentkv-nohost"].config(100).archive_tier == memory.NOHOST_TIER != "host"
    assert METHODS["agentkv"].events and not METHODS["snapkv"].events


def test_runner_writes_json_and_plots(tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_workload()))
    lines: list[str] = []
    result = run_memory_bench(
        tiny_model,
        tiny_tokenizer,
        budgets=(0.25,),
        methods=("full", "agentkv"),
        workloads=[path],
        out_dir=tmp_path / "out",
        progress=lines.append,
        show_table=False,
    )
    assert len(lines) == 2
    assert {"config", "workloads", "runs", "questions", "summary", "acceptance", "wall_seconds"} <= set(
        result
    )
    written = json.loads((tmp_path / "out" / "memory.json").read_text())
    assert written["summary"] == json.loads(json.dumps(result["summary"]))
    for png in ("memory_accuracy.png", "memory_device.png"):
        assert (tmp_path / "out" / png).stat().st_size > 0
    (info,) = result["workloads"]
    assert info["name"] == "tiny" and info["full_tokens"] > 0
    runs = {(r["method"], r["budget"]): r for r in result["runs"]}
    assert set(runs) == {("full", None), ("agentkv", 0.25)}
    agentkv = runs[("agentkv", 0.25)]
    assert agentkv["budget_tokens"] == round(0.25 * info["full_tokens"])
    assert agentkv["peak_device_bytes"] < runs[("full", None)]["peak_device_bytes"]
    assert [s["step"] for s in agentkv["steps"]] == [f"t{i}" for i in range(1, 9)] + ["q:code", "q:tracking"]
    for run in runs.values():
        assert run["overhead_seconds"] == pytest.approx(
            run["lifecycle_seconds"] + run["policy_seconds"] + run["store_seconds"]
        )
        assert run["forward_seconds"] > 0
    assert len(result["questions"]) == 4
    for q in result["questions"]:
        assert set(q) >= {
            "workload",
            "method",
            "budget",
            "question",
            "answer",
            "exact_match",
            "logprob",
            "kl",
        }
        assert math.isfinite(q["logprob"]) and q["kl"] >= 0
        if q["method"] == "full":
            assert q["kl"] == 0.0
    summary = {(s["method"], s["budget"]): s for s in result["summary"]}
    assert list(summary) == [("full", None), ("agentkv", 0.25)]
    assert 0 <= summary[("full", None)]["exact_match_pct"] <= 100
    figures = result["acceptance"]
    assert figures["budget"] == 0.25 and "best_baseline" not in figures  # no baseline in this run
    assert "within_5_points_of_full" in figures and "overhead_at_most_5_pct" in figures
    assert (tmp_path / "out" / "memory.md").read_text().startswith("| suite | method |")


def test_runner_counts_every_tier(tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path) -> None:
    """Device, host and total bytes at peak and at answer time; the host tier is not left out."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_workload()))
    result = run_memory_bench(
        tiny_model,
        tiny_tokenizer,
        budgets=(0.25,),
        methods=("full", "agentkv", "window"),
        workloads=[path],
        out_dir=tmp_path / "out",
        show_table=False,
    )
    runs = {r["method"]: r for r in result["runs"]}
    for run in runs.values():
        assert run["suite"] == "fresh"  # not one of the four tuned workloads
        assert run["answer_total_bytes"] == pytest.approx(
            run["answer_device_bytes"] + run["answer_quantized_bytes"] + run["answer_host_bytes"]
        )
        assert run["peak_total_bytes"] >= run["peak_device_bytes"] > 0
    ours, full, window = runs["agentkv"], runs["full"], runs["window"]
    assert ours["peak_host_bytes"] > 0  # archived spans went to the host: they are counted
    assert ours["answer_total_bytes"] > ours["answer_device_bytes"]
    assert window["peak_host_bytes"] == 0 and full["peak_host_bytes"] == 0
    summary = {(s["suite"], s["method"]): s for s in result["summary"]}
    assert {suite for suite, _ in summary} == {"all"}  # one suite: no duplicate rows
    assert summary[("all", "full")]["answer_total_pct_of_full"] == pytest.approx(100.0)
    agentkv = summary[("all", "agentkv")]
    assert agentkv["answer_total_pct_of_full"] > agentkv["answer_device_pct_of_full"]
    assert agentkv["rehydrated_tokens"] == ours["rehydrated_tokens"] >= 0
    line = memory.acceptance_line(result["acceptance"])
    assert "in total (device + host)" in line


def test_suites_split_tuned_and_fresh_workloads() -> None:
    assert [suite_of(n) for n in ("travel", "support", "incident", "research")] == ["tuned"] * 4
    assert suite_of("tiny") == "fresh"


def test_every_baseline_is_a_method() -> None:
    assert set(BASELINES) == {"window", "streaming_llm", "h2o", "snapkv", "tova"}
    assert all(not METHODS[name].events for name in BASELINES)
    variant = Method("snapkv-w8", "snapkv", baseline=True, policy_params={"window": 8})
    config = variant.config(64)
    assert config.policy.params == {"window": 8} and config.budget.device_tokens == 64


def test_runner_rejects_unknown_methods_and_budgets(tiny_model: Any, tiny_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="unknown method.*allowed: full, window"):
        run_memory_bench(tiny_model, tiny_tokenizer, methods=("lru",), show_table=False)
    with pytest.raises(ValueError, match=r"budgets must be fractions in \(0, 1\]"):
        run_memory_bench(tiny_model, tiny_tokenizer, budgets=(1.5,), show_table=False)
