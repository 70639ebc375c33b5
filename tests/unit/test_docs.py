"""The documentation's code runs: the policy example in docs/policies.md scores real keys."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)


def test_policy_example_runs_and_plugs_into_a_session(tiny_model, tiny_tokenizer):
    from agentkv import AgentKVConfig, TransformersBackend, TurnEnded

    namespace: dict[str, object] = {}
    exec(compile(python_blocks("policies.md")[0], "docs/policies.md", "exec"), namespace)  # noqa: S102
    policy_cls = namespace["FirstAndLastPolicy"]
    exec(compile(python_blocks("policies.md")[1], "docs/policies.md", "exec"), namespace)  # noqa: S102

    backend = TransformersBackend(
        tiny_model, tiny_tokenizer, AgentKVConfig.from_dict({"commit": {"keep_ratio": {"user": 0.5}}})
    )
    session = backend.session("docs")
    session.policy = policy_cls(head=4)  # type: ignore[operator]
    session.extend([{"role": "user", "content": "the user asked about the weather in Paris " * 3}])
    session.generate(max_new_tokens=2)
    session.apply(TurnEnded())
    user = session.spans[0]
    assert user.kept is not None and len(user.kept) == round(0.5 * user.length)
    # The head of the conversation is always kept by this policy.
    assert all(offset in user.kept for offset in range(4))
    composed = namespace["policy"]
    view = session.scoring_view()
    assert composed.score(view).shape == (view.num_tokens,)  # type: ignore[attr-defined]
    session.check()
