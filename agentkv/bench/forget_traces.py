"""Tool-heavy traces for `agentkv bench forget`, written fresh for it.

Each trace is a scripted agent conversation (the `agentkv.bench.workloads` shapes)
with two tool calls in most turns. Some results hold a fact a later question asks
about ("needed"); the others are stale by construction: a weather check, a
currency conversion, a failed or superseded search, a log dump that led nowhere.
A tool result is *needed* exactly when some question's gold answer occurs in it
(`needed_handles`), so the labels cannot drift from the questions.

Questions are completion-style (the prefix quotes the words before the fact in the
tool result), as the default 135M model needs; the phrasings were checked against
the full-cache run only.
"""

from __future__ import annotations

import random

from agentkv.bench.workloads import Question, ToolStep, Turn, Workload

__all__ = ["forget_traces", "needed_handles"]


def _noise(seed: int, kind: str, lines: int) -> str:
    """Plausible filler rows for a tool result (listings, log lines, search hits)."""
    rng = random.Random(seed)
    words = ["north", "south", "harbour", "central", "market", "station"]
    words += ["river", "park", "old", "new", "east", "west"]
    rows = []
    for i in range(lines):
        a, b = rng.sample(words, 2)
        n = rng.randint(100, 999)
        if kind == "log":
            rows.append(
                f"09:{rng.randint(10, 59)}:{rng.randint(10, 59)} INFO worker-{i % 7} {a} batch {n} ok"
            )
        elif kind == "listing":
            rows.append(
                f"- {a.title()} {b.title()} {rng.randint(2, 90)} | {n + 600} EUR | {rng.randint(40, 110)} m2"
            )
        else:
            rows.append(f"- {a} {b} report {n}: summary of {b} {a} figures, page {rng.randint(1, 40)}")
    return "\n".join(rows)


def _apartment() -> Workload:
    turns = (
        Turn(
            user="I am moving to Rotterdam. Find two-room apartments near the centre, and check the weather.",
            tools=(
                ToolStep(
                    "search_listings",
                    {"city": "Rotterdam", "rooms": 2},
                    "search_listings city=Rotterdam rooms=2 results=9\n"
                    + _noise(1, "listing", 5)
                    + "\n- Kade 17 | rent 1,340 EUR | 68 m2 | balcony, lift\n"
                    + _noise(2, "listing", 3),
                ),
                ToolStep(
                    "get_weather", {"city": "Rotterdam"}, "Rotterdam today: 14 C, light rain, wind 5 Bft."
                ),
            ),
            assistant="I found nine apartments; Kade 17 looks good. It is rainy in Rotterdam today.",
        ),
        Turn(
            user="How long is the commute from Kade 17 to my office? Also convert 1,340 EUR to dollars.",
            tools=(
                ToolStep(
                    "route_planner",
                    {"from": "Kade 17", "to": "office"},
                    "route_planner: Kade 17 -> Weena 505 (office)\nfastest: tram 23, travel time 24 minutes, "
                    "2 stops, departs every 8 minutes\nby bike: 17 minutes\n" + _noise(3, "search", 3),
                ),
                ToolStep("convert_currency", {"amount": 1340}, "1,340.00 EUR = 1,452.56 USD (rate 1.0840)"),
            ),
            assistant="The tram takes under half an hour. In dollars the rent is about 1,450.",
        ),
        Turn(
            user="Who is the landlord of Kade 17? Any news about the neighbourhood?",
            tools=(
                ToolStep(
                    "company_registry",
                    {"name": "Kade 17 owner"},
                    "company_registry: owner of Kade 17 is Verhoeven Vastgoed B.V., chamber of commerce "
                    "number KvK 55120983, registered 2011, Rotterdam.",
                ),
                ToolStep("news_search", {"q": "Kade Rotterdam"}, "news_search:\n" + _noise(4, "search", 7)),
            ),
            assistant="The owner is a property company registered in 2011. The news is routine.",
        ),
        Turn(
            user="Search again for something cheaper, under 1,000 EUR.",
            tools=(
                ToolStep(
                    "search_listings",
                    {"city": "Rotterdam", "max_rent": 1000},
                    "search_listings city=Rotterdam max_rent=1000 results=0\nno apartments match; "
                    "try widening the area.",
                ),
            ),
            assistant="Nothing under 1,000 EUR, so Kade 17 stays the best option.",
        ),
        Turn(
            user="Book a viewing for Kade 17 this week.",
            tools=(
                ToolStep(
                    "calendar_slots",
                    {"listing": "Kade 17"},
                    "calendar_slots for Kade 17: viewing confirmed on Thursday at 14:30 with agent Mila "
                    "Bakker; bring ID.\nother slots: " + _noise(5, "search", 2),
                ),
                ToolStep("get_weather", {"city": "Rotterdam", "day": "Thursday"}, "Thursday: 17 C, dry."),
            ),
            assistant="Your viewing is booked for Thursday; the weather should be dry.",
        ),
        Turn(
            user="Great, thanks. What should I bring?",
            assistant="Bring your ID, a recent payslip and your questions about the service costs.",
        ),
    )
    questions = (
        Question(
            "rent",
            "What is the rent of Kade 17?",
            'The listing said: "Kade 17 | rent',
            "1,340 EUR",
            "tool",
            1,
        ),
        Question(
            "commute",
            "How long does the tram take?",
            'The route planner said: "fastest: tram 23, travel time',
            "24 minutes",
            "tool",
            2,
        ),
        Question(
            "kvk",
            "What is the landlord's registry number?",
            'The registry said: "chamber of commerce number',
            "KvK 55120983",
            "tool",
            3,
        ),
        Question(
            "viewing",
            "When is the viewing?",
            'The calendar said: "viewing confirmed on',
            "Thursday at 14:30",
            "tool",
            5,
        ),
    )
    return Workload(
        "apartment",
        "apartment hunt (9 tool calls)",
        "You are a helpful relocation assistant.",
        turns,
        questions,
    )


def _incident() -> Workload:
    turns = (
        Turn(
            user="The checkout service is timing out since this morning. Look at the logs and the config.",
            tools=(
                ToolStep(
                    "grep_logs",
                    {"service": "checkout"},
                    "grep_logs checkout --since 09:00\n" + _noise(6, "log", 9),
                ),
                ToolStep(
                    "get_config",
                    {"service": "checkout"},
                    "checkout.yaml: replicas=4\ndb.pool.max_connections=240\ndb.timeout_ms=1500\n"
                    "cache.ttl_s=60\nfeature.new_pricing=true",
                ),
            ),
            assistant="The logs look normal so far; the database pool and timeout are set in the config.",
        ),
        Turn(
            user="What was deployed today? And run the test suite.",
            tools=(
                ToolStep(
                    "list_deploys",
                    {"service": "checkout", "day": "today"},
                    "list_deploys checkout today:\n- deploy 8f3a2c1 at 09:12 by ana: enable new pricing\n"
                    "- deploy 77b01de at 08:40 by joe: bump logging library",
                ),
                ToolStep(
                    "run_tests",
                    {"suite": "checkout"},
                    "run_tests checkout: 412 passed, 0 failed, 3 skipped (71 s)",
                ),
            ),
            assistant="Two deploys this morning, one enabling new pricing. All tests pass.",
        ),
        Turn(
            user="Show me the database metrics and resolve the database host.",
            tools=(
                ToolStep(
                    "db_metrics",
                    {"db": "orders"},
                    "db_metrics orders (last hour): connections in use 238 of 240, p99 query 1,420 ms, "
                    "lock waits 5,112\n" + _noise(7, "log", 4),
                ),
                ToolStep(
                    "dns_lookup",
                    {"host": "orders-db.internal"},
                    "orders-db.internal has address 10.4.17.22 (ttl 300)",
                ),
            ),
            assistant="The pool is nearly exhausted and queries are slow.",
        ),
        Turn(
            user="Check the CDN status page too, just in case.",
            tools=(
                ToolStep(
                    "status_page",
                    {"vendor": "cdn"},
                    "CDN status: all systems operational.\n" + _noise(8, "search", 3),
                ),
            ),
            assistant="The CDN is fine, so the problem is on our side.",
        ),
        Turn(
            user="Open an incident ticket with what we know.",
            tools=(
                ToolStep(
                    "create_ticket",
                    {"title": "checkout timeouts"},
                    "create_ticket: created INC-20931 (sev2) assigned to team payments, "
                    "link https://tickets.internal/INC-20931",
                ),
                ToolStep(
                    "grep_logs",
                    {"service": "pricing"},
                    "grep_logs pricing --since 09:00\n" + _noise(9, "log", 6),
                ),
            ),
            assistant="The ticket is open and assigned to payments.",
        ),
        Turn(
            user="Thanks, I'll take it from here.",
            assistant="Good luck; the pool size is the first thing to check.",
        ),
    )
    questions = (
        Question(
            "pool",
            "What is the maximum pool size?",
            'The config said: "db.pool.max_connections=',
            "240",
            "tool",
            1,
        ),
        Question(
            "deploy",
            "Which deploy enabled new pricing?",
            'The deploy list said: "- deploy',
            "8f3a2c1",
            "tool",
            2,
        ),
        Question(
            "dbip",
            "What is the database IP?",
            'The DNS lookup said: "orders-db.internal has address',
            "10.4.17.22",
            "tool",
            3,
        ),
        Question(
            "ticket",
            "What is the ticket number?",
            'The ticket tool said: "create_ticket: created',
            "INC-20931",
            "tool",
            5,
        ),
    )
    return Workload(
        "incident",
        "incident triage (9 tool calls)",
        "You are an on-call engineering assistant.",
        turns,
        questions,
    )


def _research() -> Workload:
    turns = (
        Turn(
            user="Find studies on walking and sleep quality.",
            tools=(
                ToolStep(
                    "search_papers",
                    {"q": "walking sleep quality"},
                    "search_papers: 27 hits\n" + _noise(10, "search", 8),
                ),
                ToolStep(
                    "fetch_abstract",
                    {"paper": "Okafor 2021"},
                    "Okafor et al. 2021, cohort study: daily walking and sleep, n=1,204 participants "
                    "followed for 18 months; 30 minutes of walking was linked to 22 minutes more sleep "
                    "per night.",
                ),
            ),
            assistant="The Okafor cohort looks most relevant.",
        ),
        Turn(
            user="Get me the citation for Okafor, and convert 18 months to weeks.",
            tools=(
                ToolStep(
                    "lookup_citation",
                    {"paper": "Okafor 2021"},
                    "Okafor N, Lind P, Sato K. Walking and sleep in adults. J Sleep Res. 2021;30(4). "
                    "doi:10.1111/jsr.13377",
                ),
                ToolStep(
                    "unit_convert", {"value": 18, "from": "months", "to": "weeks"}, "18 months = 78.2 weeks"
                ),
            ),
            assistant="Here is the citation; 18 months is about 78 weeks.",
        ),
        Turn(
            user="Is there a meta-analysis? Also search the web for news on it.",
            tools=(
                ToolStep(
                    "search_papers",
                    {"q": "walking sleep meta-analysis"},
                    "search_papers: 4 hits\n- Brenner 2023 meta-analysis of 19 trials: pooled effect size "
                    "d = 0.31 on sleep quality\n" + _noise(11, "search", 3),
                ),
                ToolStep(
                    "web_search", {"q": "walking sleep news"}, "web_search:\n" + _noise(12, "search", 6)
                ),
            ),
            assistant="Yes, a 2023 meta-analysis found a small-to-moderate effect.",
        ),
        Turn(
            user="Try to get the full text of Brenner.",
            tools=(
                ToolStep(
                    "fetch_fulltext",
                    {"paper": "Brenner 2023"},
                    "fetch_fulltext: error 403, the publisher blocks access.",
                ),
            ),
            assistant="The full text is paywalled; the abstract will have to do.",
        ),
        Turn(
            user="Draft a one-line summary for my notes.",
            tools=(ToolStep("word_count", {"text": "draft"}, "word_count: 31 words, 188 characters"),),
            assistant="Walking about 30 minutes a day goes with longer, better sleep in adults.",
        ),
        Turn(user="Perfect, thank you.", assistant="You are welcome."),
    )
    questions = (
        Question(
            "cohort",
            "How many participants were in the Okafor study?",
            'The abstract said: "n=',
            "1,204",
            "tool",
            1,
        ),
        Question(
            "doi",
            "What is the DOI of the Okafor paper?",
            'The citation said: "doi:',
            "10.1111/jsr.13377",
            "tool",
            2,
        ),
        Question(
            "effect",
            "What was the pooled effect size?",
            'The search said: "pooled effect size d =',
            "0.31",
            "tool",
            3,
        ),
    )
    return Workload(
        "research",
        "literature search (9 tool calls)",
        "You are a careful research assistant.",
        turns,
        questions,
    )


def forget_traces() -> list[Workload]:
    """The three traces, in a fixed order."""
    return [_apartment(), _incident(), _research()]


def needed_handles(workload: Workload) -> dict[str, bool]:
    """For each tool result's handle (`T1` = the first), whether a question's gold answer is in it."""
    out: dict[str, bool] = {}
    k = 0
    for turn in workload.turns:
        for tool in turn.tools:
            k += 1
            out[f"T{k}"] = any(q.gold in tool.result for q in workload.questions)
    return out
