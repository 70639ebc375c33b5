"""A deterministic multi-turn agent conversation for the reuse benchmark and the demo.

Each turn is a user message, optionally followed by a tool call and a long, noisy
tool result (search pages, logs), then the model's answer. The text is built
from a seeded generator so every run sees exactly the same history.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

SYSTEM_PROMPT = (
    "You are a careful travel-and-logistics assistant. Use the tools when you need facts, "
    "keep answers short, and remember what the user told you earlier."
)

_CITIES = ["Paris", "Lisbon", "Osaka", "Quito", "Tallinn", "Nairobi", "Hobart", "Bergen", "Cusco", "Tbilisi"]
_TOPICS = ["weather", "train times", "hotel prices", "museum hours", "ferry schedule", "visa rules"]
_WORDS = [
    "route",
    "station",
    "platform",
    "delay",
    "ticket",
    "fare",
    "window",
    "seat",
    "luggage",
    "transfer",
    "terminal",
    "gate",
    "harbour",
    "forecast",
    "humidity",
    "breeze",
    "showers",
    "sunny",
    "cloudy",
    "north",
    "south",
    "coastal",
    "valley",
    "market",
    "square",
    "bridge",
    "opening",
    "closing",
    "holiday",
    "season",
    "discount",
    "booking",
    "reference",
    "desk",
    "counter",
    "express",
    "regional",
]


@dataclass(frozen=True)
class Turn:
    """One user turn, with an optional tool round trip before the answer."""

    user: str
    tool_name: str | None = None
    tool_args: dict[str, Any] = field(default_factory=dict)
    tool_result: str | None = None

    def messages_before_answer(self, index: int) -> list[dict[str, Any]]:
        """The messages this turn adds before the model answers."""
        out: list[dict[str, Any]] = [{"role": "user", "content": self.user}]
        if self.tool_name is not None:
            call_id = f"call_{index}"
            out.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": call_id, "name": self.tool_name, "args": self.tool_args}],
                }
            )
            out.append({"role": "tool", "content": self.tool_result or "", "tool_call_id": call_id})
        return out


def noisy_document(rng: random.Random, topic: str, city: str, words: int) -> str:
    """A long tool result: semi-structured lines of plausible noise."""
    lines = [f"# {topic} for {city} (source: search, {rng.randint(3, 12)} results)"]
    while sum(len(line.split()) for line in lines) < words:
        picked = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 16)))
        lines.append(
            f"- [{rng.randint(100, 999)}] {picked} ({rng.randint(1, 59)} min, {rng.randint(5, 95)} EUR)"
        )
    return "\n".join(lines)


def build_conversation(
    turns: int = 22, *, seed: int = 0, tool_every: int = 2, tool_words: int = 90
) -> list[Turn]:
    """A reproducible conversation of `turns` user turns; every `tool_every`-th turn calls a tool."""
    rng = random.Random(seed)
    out: list[Turn] = []
    for i in range(turns):
        city = _CITIES[i % len(_CITIES)]
        topic = _TOPICS[i % len(_TOPICS)]
        if i % tool_every == 1:
            out.append(
                Turn(
                    user=f"Can you check the {topic} in {city} for next week?",
                    tool_name="search",
                    tool_args={"query": f"{topic} {city}"},
                    tool_result=noisy_document(rng, topic, city, tool_words),
                )
            )
        else:
            out.append(
                Turn(
                    user=f"Note for later: my booking {i} is for {city}, reference {rng.randint(1000, 9999)}."
                )
            )
    return out


def iter_histories(turns: list[Turn], answers: list[str]) -> Iterator[list[dict[str, Any]]]:
    """For each turn, the full history up to (not including) its answer; `answers` fills earlier turns."""
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for index, turn in enumerate(turns):
        history = history + turn.messages_before_answer(index)
        yield history
        if index < len(answers):
            history = [*history, {"role": "assistant", "content": answers[index]}]
