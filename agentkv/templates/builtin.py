r"""Chat templates agentkv ships, for tokenizers that have none (base models) or a user who names one.

A base model's tokenizer carries no chat template, yet its vocabulary often has its
family's turn tokens (Gemma 3 270M has `<start_of_turn>`, a Llama 3 base model
`<|start_header_id|>`): rendering a conversation in those tokens is what the family's
instruction-tuned sibling reads, and one token then ends a turn. So a tokenizer
without a template gets the built-in template whose turn tokens its vocabulary has,
else ChatML; `chat.template` in the config names one (or a `.jinja` file) instead.

The templates are written here in the families' published turn layouts:
- `chatml`: `<|im_start|>role\\n…<|im_end|>\\n` (Qwen, SmolLM, Hermes);
- `gemma`: `<start_of_turn>user|model\\n…<end_of_turn>\\n`, system text leading the first
  user turn (Gemma's turns are user and model only; tool messages are folded by
  `agentkv.templates.roles`);
- `llama3`: `<|start_header_id|>role<|end_header_id|>\\n\\n…<|eot_id|>`, tool results in
  the `ipython` role.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv.chat import FALLBACK_CHAT_TEMPLATE

__all__ = ["BUILTIN_TEMPLATES", "BuiltinTemplate", "resolve_template", "template_for_vocabulary", "with_bos"]


@dataclass(frozen=True)
class BuiltinTemplate:
    """One shipped template: its Jinja source and the turn tokens it is written in."""

    name: str
    source: str
    turn_tokens: tuple[str, ...]
    """Tokens the template writes as markers (a vocabulary holding all of them reads it best)."""


_GEMMA = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- set content = (message['content'] or '') | trim -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + content + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- if role not in ['user', 'model'] -%}"
    "{{ raise_exception('Gemma turns are user or model, got ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + content }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{{ ((message['content'] or '') | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)

BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    t.name: t
    for t in (
        BuiltinTemplate("chatml", FALLBACK_CHAT_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
        BuiltinTemplate("gemma", _GEMMA, ("<start_of_turn>", "<end_of_turn>")),
        BuiltinTemplate("llama3", _LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    )
}
"""The shipped templates by name (`chat.template`)."""


def template_for_vocabulary(tokenizer: Any) -> BuiltinTemplate | None:
    """The built-in template whose turn tokens the tokenizer has as single tokens; None when no built-in's."""
    for template in BUILTIN_TEMPLATES.values():
        if all(_single_token(tokenizer, token) for token in template.turn_tokens):
            return template
    return None


def resolve_template(spec: str, tokenizer: Any) -> str:
    """The Jinja source `chat.template` names: a built-in (`BUILTIN_TEMPLATES`) or a `.jinja` file.

    ChatML gets the tokenizer's `bos` in front when it has one (the others write `bos_token`).

    Raises:
        ValueError: neither a built-in name nor a readable `.jinja` file.
    """
    builtin = BUILTIN_TEMPLATES.get(spec)
    if builtin is not None:
        return with_bos(builtin, tokenizer)
    path = Path(spec).expanduser()
    if path.suffix == ".jinja" and path.is_file():
        return path.read_text(encoding="utf-8")
    names = ", ".join(BUILTIN_TEMPLATES)
    msg = f"chat.template: {spec!r} is neither a built-in template ({names}) nor a .jinja file"
    raise ValueError(msg)


def with_bos(template: BuiltinTemplate, tokenizer: Any) -> str:
    """The template's source; ChatML, which names no `bos`, gets the tokenizer's in front when it has one."""
    if template.name == "chatml" and getattr(tokenizer, "bos_token", None):
        return "{{ bos_token }}" + template.source
    return template.source


def _single_token(tokenizer: Any, text: str) -> bool:
    """Whether `text` is one token of the tokenizer's vocabulary."""
    ids = tokenizer.convert_tokens_to_ids(text)
    unknown = getattr(tokenizer, "unk_token_id", None)
    return isinstance(ids, int) and ids >= 0 and ids != unknown
