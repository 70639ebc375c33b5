"""The examples as real compiled graphs on the tiny model: events reach sessions, states follow the rules."""

from __future__ import annotations

from collections import Counter
from typing import Any

from agentkv import AgentKVConfig, SpanState, TransformersBackend

RELEASED = {"evictable", "evicted"}


def spans_by_owner(result: dict[str, Any]) -> dict[str | None, dict[str, Any]]:
    return {s["owner"]: s for s in result["spans"]}


# -- tool assistant ------------------------------------------------------------------------------


def test_tool_assistant_commits_results_and_releases_calls(example, tiny_backend):
    example = example("tool_assistant")
    turns = 7  # includes the failing lookup (turn 5)
    result = example.main(tiny_backend, turns=turns, max_new_tokens=6, measure=True)
    assert result["handler_errors"] == 0
    by_owner = spans_by_owner(result)
    completed = [t for _, name, t in result["events"] if name == "ToolCallCompleted"]
    failed = [t for _, name, t in result["events"] if name == "ToolCallFailed"]
    tool_turns = [t for t in example.SCRIPT[:turns] if t.tool]
    assert len(completed) + len(failed) == len(tool_turns)
    assert len(failed) == 1  # order-9999 does not exist
    for call_id in completed:
        assert by_owner[call_id]["kind"] == "tool_result"
        assert by_owner[call_id]["state"] == "committed"
    # The failed lookup's error text is kept like a result (an observation); its call is released.
    assert by_owner[failed[0]]["kind"] == "tool_result" and by_owner[failed[0]]["state"] == "committed"
    calls = [s for s in result["spans"] if s["kind"] == "tool_call"]
    assert len(calls) == len(tool_turns)
    assert all(s["state"] in RELEASED for s in calls)
    assert result["stats"]["tokens_by_state"]["active"] == 0  # every turn ended
    assert sum(1 for _, name, _ in result["events"] if name == "TurnEnded") == turns
    assert all(s["state"] == "committed" for s in result["spans"] if s["kind"] in ("user", "system"))
    # Reuse: each model call encoded only what the cache did not hold.
    reuse = result["reuse"]
    assert sum(r["incremental_prefill"] for r in reuse) < sum(r["reencode_prefill"] for r in reuse) / 2
    assert all(r["incremental_prefill"] < r["reencode_prefill"] for r in reuse[1:])


def test_tool_assistant_budget_demotes_released_spans_first(example, tiny_backend):
    example = example("tool_assistant")
    free = example.main(tiny_backend, turns=5, max_new_tokens=6, thread_id="free")
    budget_tokens = 900
    tight = example.main(
        tiny_backend, turns=5, max_new_tokens=6, thread_id="tight", device_tokens=budget_tokens
    )
    session = tiny_backend.get("tight")
    assert session.config.budget.device_tokens == budget_tokens  # the per-graph config reached the session
    assert tight["stats"]["device_bytes"] < free["stats"]["device_bytes"]
    assert tight["stats"]["device_bytes"] <= budget_tokens * tiny_backend.runner.bytes_per_token
    states = {s["kind"]: set() for s in tight["spans"]}
    for s in tight["spans"]:
        states[s["kind"]].add(s["state"])
    # Released scaffolding goes first: it waits in the grace queue (evictable) or is evicted, and
    # while any of it is still on the device no committed span has been archived or evicted.
    assert states["tool_call"] <= {"evictable", "evicted"}
    if "evictable" in states["tool_call"]:
        committed_kinds = ("user", "system", "assistant", "tool_result")
        assert all(states.get(kind, set()) <= {"committed"} for kind in committed_kinds)
    assert "evicted" not in states["system"]  # pinned


# -- plan, interrupt, confirm --------------------------------------------------------------------


def test_plan_confirm_pins_the_approved_plan_and_releases_the_rejected_one(example, tiny_backend):
    result = example("plan_confirm").main(tiny_backend, max_new_tokens=8)
    rejected, approved = result["plans"]
    assert result["states"][rejected]["state"] in RELEASED
    assert not result["states"][rejected]["pinned"]
    assert result["states"][approved] == {"state": "committed", "tier": "device", "pinned": True}
    events = [(name, owner) for _, name, owner in result["events"]]
    assert events == [("UserRejected", rejected), ("UserConfirmed", approved), ("TurnEnded", None)]
    assert result["handler_errors"] == 0


def test_resume_reruns_the_node_without_duplicate_spans_or_transitions(example, tiny_backend):
    result = example("plan_confirm").main(tiny_backend, max_new_tokens=8)
    # LangGraph re-ran the review node on each resume...
    assert Counter(result["reviews"]) == {plan: 2 for plan in result["plans"]}
    # ...yet every plan has one span, and no span went through the same move twice.
    owners = Counter(s["owner"] for s in result["spans"] if s["owner"] in result["plans"])
    assert owners == {plan: 1 for plan in result["plans"]}
    moves = [
        (span, state)
        for r in result["log"]
        if r["kind"] == "event"
        for span, state in r.get("transitions", [])
    ]
    assert len(moves) == len(set(moves))
    applied = [r["event"] for r in result["log"] if r["kind"] == "event" and r["applied"]]
    assert applied.count("user_confirmed") == 1 and applied.count("user_rejected") == 1
    assert result["stats"]["events_noop"] == 0


def test_confirmed_plan_survives_budget_pressure(example, tiny_backend):
    result = example("plan_confirm").main(tiny_backend, max_new_tokens=8, device_tokens=200)
    approved = result["plans"][-1]
    assert result["states"][approved] == {"state": "committed", "tier": "device", "pinned": True}
    demoted = [s for s in result["spans"] if s["state"] in ("archived", "evicted")]
    assert demoted  # the budget did bite, on other spans


# -- tree of thought --------------------------------------------------------------------------------


def test_tree_of_thought_plain_send_forks_prunes_and_adopts(example, tiny_backend):
    """Plain `Send`, no agentkv call in the nodes: forks share the prefix, losers freed, winner adopted."""
    k = 3
    thread = "tree-of-thought"
    result = example("tree_of_thought").main(tiny_backend, k=k, max_new_tokens=8, thread_id=thread)
    memory = result["memory"]
    own = memory["branch_own_bytes"]
    assert sorted(own) == result["branches"] and len(own) == k and all(n > 0 for n in own.values())
    assert all(len(b) == 36 for b in result["branches"])  # the Send tasks' ids
    # With k branches alive the prefix is held once: the thread's KV + the branches' own suffixes,
    # plus the system prompt's prefix cache entry, kept for the next thread (the fork copied it).
    cached = memory["cached_prefix_bytes"]
    assert cached > 0 and cached % tiny_backend.bytes_per_token == 0
    assert memory["alive_bytes"] == memory["prefix_bytes"] + sum(own.values()) + cached
    assert memory["alive_bytes"] < memory["copied_prefix_bytes"]
    # After the run no branch holds anything: losers pruned, the winner is the thread's session.
    assert memory["branch_bytes_after_run"] == {b: 0 for b in result["branches"]}
    assert result["sessions"] == [thread]
    ((adopted_thread, winner),) = result["adopted"]
    assert adopted_thread == thread and winner in result["branches"]
    events = Counter((sid, name) for sid, name, _ in result["events"])
    assert events == {
        (thread, "BranchOpened"): k,
        (thread, "BranchPruned"): k - 1,
        (thread, "BranchSelected"): 1,
        (thread, "TurnEnded"): 1,
    }
    # The final call re-encodes nothing of the winner's thought: only its own new message.
    nodes = [node for node, _ in result["prefill"]]
    assert nodes == ["frame", *["think"] * k, "answer"]
    assert result["stats"]["tokens_by_state"]["active"] == 0
    assert result["handler_errors"] == 0  # the branches called the handler from worker threads


def test_tree_of_thought_adoption_saves_the_winners_prefill(example, long_tiny_model, tiny_tokenizer):
    module = example("tree_of_thought")
    figures = {}
    for adopt in (True, False):
        backend = TransformersBackend(long_tiny_model, tiny_tokenizer, AgentKVConfig(policy="full"))
        result = module.main(backend, k=2, max_new_tokens=8, adopt=adopt)
        figures[adopt] = result
        assert result["sessions"] == ["tree-of-thought"]
        assert result["memory"]["branch_bytes_after_run"] == {b: 0 for b in result["branches"]}
    with_adoption, without = figures[True], figures[False]
    assert with_adoption["answer"] == without["answer"]  # same conversation, same greedy answer
    assert with_adoption["adopted"] and not without["adopted"]
    # Without adoption the thread re-encodes the winner's idea and answer before the new message.
    assert with_adoption["answer_prefill"] < without["answer_prefill"]


def test_tree_of_thought_again_on_the_same_thread(example, tiny_backend):
    result = example("tree_of_thought").main(tiny_backend, k=2, max_new_tokens=6, turns=2)
    first, second = result["runs"]
    # The second fan-out forks a longer prefix; its branches are settled all the same.
    assert second["memory"]["prefix_bytes"] > first["memory"]["prefix_bytes"]
    assert set(first["branches"]).isdisjoint(second["branches"])
    assert len(result["adopted"]) == 2
    assert result["sessions"] == ["tree-of-thought"]
    assert result["handler_errors"] == 0


# -- plain LangChain ---------------------------------------------------------------------------------


def test_plain_langchain_handler_without_langgraph(example, tiny_backend):
    example = example("plain_langchain")
    result = example.main(tiny_backend, max_new_tokens=6)
    by_owner = spans_by_owner(result)
    assert set(result["tool_calls"].values()) == {"ok", "failed"}
    for call_id in result["tool_calls"]:
        # A failed call's error text is kept like a result; every call itself is released (below).
        assert by_owner[call_id]["kind"] == "tool_result" and by_owner[call_id]["state"] == "committed"
    failed = [t for _, name, t in result["events"] if name == "ToolCallFailed"]
    assert failed == [c for c, outcome in result["tool_calls"].items() if outcome == "failed"]
    assert sum(1 for _, name, _ in result["events"] if name == "TurnEnded") == len(example.SCRIPT)
    assert result["stats"]["tokens_by_state"]["active"] == 0
    assert result["handler_errors"] == 0
    span_states = {s["state"] for s in result["spans"] if s["kind"] == "tool_call"}
    assert span_states == {SpanState.EVICTABLE.value}


# -- streaming ---------------------------------------------------------------------------------------


def test_streaming_example_keeps_each_thread_on_its_session(example, tiny_backend):
    module = example("streaming")
    result = module.main(tiny_backend, max_new_tokens=4)
    expected_sessions = sorted(f"{mode}-{thread}" for mode in module.MODES for thread in module.TURNS)
    assert result["sessions"] == expected_sessions  # no "default" session
    for mode, threads in result["modes"].items():
        for thread, turns in threads.items():
            assert [t["session"] for t in turns] == [f"{mode}-{thread}"] * 2
            assert turns[1]["cache_read"] > 0  # the second turn reads the first from the cache
    # Greedy decoding: every mode answers what the invoke-driven "updates" mode answers.
    reference = {t: [x["text"] for x in turns] for t, turns in result["modes"]["updates"].items()}
    for threads in result["modes"].values():
        assert {t: [x["text"] for x in turns] for t, turns in threads.items()} == reference
    graph_sessions = [s for s in expected_sessions if not s.startswith("model_stream")]
    turn_ends = [sid for sid, name in result["events"] if name == "TurnEnded"]
    assert sorted(turn_ends) == sorted(graph_sessions * 2)
    assert result["handler_errors"] == 0
