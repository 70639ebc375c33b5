"""Chat messages in, template text and token ids per message out.

`ChatFormat` renders messages with the tokenizer's chat template and splits the
rendering into one text per message (`agentkv.templates.segments`), so the session
can hold each message as a span. It never relies on a marker surviving the template:
the generation prompt is what `add_generation_prompt=True` adds, the end of an
assistant turn is what follows a probe answer, and message boundaries come from
comparing renderings. A template that lacks a role gets the messages folded the
family's way (`agentkv.templates.roles`), and tool calls are written in the
template's own tool-call format (`agentkv.toolformats`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateSyntaxError

from agentkv.chat import FALLBACK_CHAT_TEMPLATE, ChatMessage, ToolCall, check_unicode
from agentkv.templates.builtin import (
    BUILTIN_TEMPLATES,
    BuiltinTemplate,
    resolve_template,
    template_for_vocabulary,
    with_bos,
)
from agentkv.templates.probe import probe_rules
from agentkv.templates.roles import RoleRules, template_dicts
from agentkv.templates.segments import Cached, Split, common_prefix, safe_cut, split_history
from agentkv.toolformats import ReasoningTags, ToolFormat, detect_reasoning, detect_tool_format, tool_format

__all__ = ["FALLBACK_CHAT_TEMPLATE", "ChatFormat"]

logger = logging.getLogger("agentkv.chat")


_PROBE_ANSWER = "Agentkvprobeanswer"
"""A probe answer's text: letters only, so `trim` and friends leave it whole."""
_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")
"""End-of-turn tokens of common families (added to the stop ids when the vocabulary has them)."""
_DEFAULT_KWARGS = {"tools_in_user_message": False}
"""Template switches set unless the caller sets them: Llama 3.x then lists tools in the system
message, which does not move, instead of in the first user message."""


def fallback_template(tokenizer: Any) -> str:
    """The template a tokenizer without one gets: the built-in one its vocabulary's turn tokens name.

    ChatML (with the tokenizer's `bos` in front when it has one) unless the vocabulary has
    another family's turn tokens (`agentkv.templates.builtin.template_for_vocabulary`).
    """
    return with_bos(template_for_vocabulary(tokenizer) or BUILTIN_TEMPLATES["chatml"], tokenizer)


def _guess_template(tokenizer: Any) -> BuiltinTemplate:
    """The built-in template a tokenizer without one gets, with a warning that says why."""
    names = ", ".join(BUILTIN_TEMPLATES)
    guessed = template_for_vocabulary(tokenizer)
    if guessed is not None:
        logger.warning(
            "tokenizer has no chat template; using the built-in %r template (its turn tokens are in "
            "the vocabulary). Name one with chat.template (%s or a .jinja file) to choose another.",
            guessed.name,
            names,
        )
        return guessed
    chatml = BUILTIN_TEMPLATES["chatml"]
    logger.warning(
        "tokenizer has no chat template, and no built-in template's turn tokens are tokens of its "
        "vocabulary; using ChatML, whose markers (%s) this tokenizer encodes as plain text (an answer "
        "stops where the model writes '<|im_end|>', or at EOS). A model not trained on ChatML will "
        "answer poorly: name its format with chat.template (%s or a .jinja file).",
        ", ".join(chatml.turn_tokens),
        names,
    )
    return chatml


class ChatFormat:
    """Renders messages with a tokenizer's chat template, message by message.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        tool_format: the tool-call format's name (`agentkv.toolformats.FORMATS`); None:
            detected from the template (Hermes when it has none).
        template_kwargs: extra variables for the template (`enable_thinking=False`, ...).
        template: a built-in template's name (`agentkv.templates.builtin.BUILTIN_TEMPLATES`)
            or a `.jinja` file, used instead of the tokenizer's; None: the tokenizer's, and
            for a tokenizer without one the built-in its vocabulary's turn tokens name.

    Raises:
        ValueError: `template` names neither a built-in template nor a `.jinja` file, or the
            template is not valid Jinja (the message names the setting or the tokenizer, and the line).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_format: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.uses_fallback = not own and template is None
        """True when the tokenizer has no template and none was named: a built-in one is guessed."""
        origin = f"chat.template {template!r}" if template is not None else "the tokenizer's chat template"
        if not own and template is None:
            origin = "the built-in fallback template"
        if template is not None:
            source = resolve_template(template, tokenizer)
        elif own:
            source = own if isinstance(own, str) else str(own)
        else:
            source = with_bos(_guess_template(tokenizer), tokenizer)
        template = source
        self.template: str = template if isinstance(template, str) else str(template)
        self._check_syntax(origin)
        self.template_kwargs: dict[str, Any] = {
            **{k: v for k, v in _DEFAULT_KWARGS.items() if k in self.template},
            **dict(template_kwargs or {}),
        }
        self.tool_format: ToolFormat = (
            tool_format_named(tool_format) if tool_format else detect_tool_format(self.template)
        )
        self.reasoning: ReasoningTags | None = detect_reasoning(self.template)
        self.special_tokens: dict[str, int] = _special_tokens(tokenizer)
        """Special tokens (text → id): never cut in two, and named by id in grammars."""
        self._specials_by_length = sorted(
            _added_tokens(tokenizer) | set(self.special_tokens), key=len, reverse=True
        )
        """Every added token's text (special or not): a message boundary never cuts one in two."""
        self._empty_tools = self._needs_tool_list()
        self.hidden_special_ids: frozenset[int] = self._hidden_special_ids()
        """Special tokens left out of an answer's text: all but those a call or reasoning is written with."""
        self.rules: RoleRules = probe_rules(self._render_dicts)
        self._gen_extends = self._generation_prompt_extends()
        self._tail_stable = self._answers_extend()
        self._suffix: str | None = None
        self._grammar_specials: dict[str, int] | None = None
        self._stop_ids: frozenset[int] | None = None

    @property
    def grammar_specials(self) -> dict[str, int]:
        """Added tokens the grammar library matches only by id (text → id), for grammars' literals."""
        if self._grammar_specials is None:
            from agentkv.grammar.tokenizer import grammar_tokenizer  # builds the library's tokenizer once

            library = grammar_tokenizer(self.tokenizer, self.stop_token_ids())
            self._grammar_specials = {
                text: i for text, i in _added_token_ids(self.tokenizer).items() if library.is_special_token(i)
            }
        return self._grammar_specials

    def use_tool_format(self, name: str) -> None:
        """Write, constrain and read calls in the format called `name` from now on (ValueError if unknown).

        Held messages whose calls render differently in it are re-encoded on the next call.
        """
        self.tool_format = tool_format_named(name)
        self.hidden_special_ids = self._hidden_special_ids()

    @property
    def tools_in_template(self) -> bool:
        """Whether the template lists the tools itself (else they are described in the system prompt)."""
        return self.rules.tools

    # -- rendering --------------------------------------------------------------------------

    def _render_dicts(
        self,
        dicts: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> str:
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        if not tools and self._empty_tools:
            extra["tools"] = []
        text = self.tokenizer.apply_chat_template(
            [dict(d) for d in dicts],
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
            **extra,
        )
        return str(text)

    def _check_syntax(self, origin: str) -> None:
        """Compile the template now: a syntax error names `origin` and its line here, not deep in a render."""
        try:
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hello."}], chat_template=self.template, tokenize=False
            )
        except TemplateSyntaxError as e:
            msg = f"{origin}: not a valid Jinja template: line {e.lineno}: {e.message}"
            raise ValueError(msg) from e
        except Exception:  # noqa: BLE001 - it compiled; a template may refuse a lone user turn
            pass

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = False) -> str:
        """The template's text for a conversation (folded, calls in the tool format)."""
        if not messages:
            return ""
        dicts = template_dicts(messages, self.rules, self.tool_format)
        tools_json = next((m.tools_json for m in messages if m.tools_json), None)
        tools = json.loads(tools_json) if tools_json and self.rules.tools else None
        if not dicts:  # everything folded away (a lone system message): the template's frame only
            return self._render_dicts([], tools, add_generation_prompt=add_generation_prompt) if tools else ""
        return self._render_dicts(dicts, tools, add_generation_prompt=add_generation_prompt)

    def history_text(self, messages: Sequence[ChatMessage]) -> str:
        """A conversation's text as history: the part of its rendering that an answer follows.

        Most templates render the same text either way. One that closes the conversation
        when no answer follows (Phi-3.5 writes `eos`; DeepSeek-R1 closes its tool outputs)
        has that close left out: it is part of the generation prompt instead.
        """
        plain = self.render(messages)
        if self._gen_extends and self._tail_stable:
            return plain
        cut = common_prefix(plain, self.render(messages, add_generation_prompt=True))
        if messages:
            try:
                answered = self.render([*messages, ChatMessage("assistant", _PROBE_ANSWER)])
            except Exception:  # noqa: BLE001 - no answer may follow (strict alternation): the prompt decides
                answered = plain
            cut = min(cut, common_prefix(plain, answered))
        return plain[: safe_cut(plain, cut, self._specials_by_length)]

    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of template text (special tokens written in it are parsed)."""
        if not text:
            return []
        check_unicode(text, "text to encode")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- message boundaries ---------------------------------------------------------------------

    def split(self, messages: Sequence[ChatMessage], cached: Sequence[Cached]) -> Split:
        """How many held messages still render as they are held, and the texts after them.

        Args:
            messages: the whole conversation.
            cached: what the spans of the first messages (matched by fingerprint) hold.

        See `split_history`; an answer the model produced keeps its tokens when the
        template renders it with the same words, and is re-encoded when the template
        drops its reasoning (the cache then holds exactly what the template renders).
        """
        return split_history(
            lambda i: self.history_text(messages[:i]),
            len(messages),
            cached,
            self._specials_by_length,
            self._keeps_produced,
        )

    def _keeps_produced(self, produced: str, rendered: str) -> bool:
        tags = self.reasoning
        return tags is None or tags.close not in produced or tags.close in rendered

    def message_texts(self, messages: Sequence[ChatMessage], start: int = 0) -> list[str]:
        """Text of each message from index `start` on, as the whole conversation renders it."""
        return self.split(messages, []).texts[start:]

    def message_ids(self, messages: Sequence[ChatMessage], start: int = 0) -> list[list[int]]:
        """Token ids of each message from index `start` on."""
        return [self.encode(text) for text in self.message_texts(messages, start)]

    # -- answers --------------------------------------------------------------------------------

    def generation_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The text the template adds to ask for an answer (e.g. `<|im_start|>assistant`, newline)."""
        history = self.history_text(messages)
        prompted = self.render(messages, add_generation_prompt=True)
        if not prompted.startswith(history):
            msg = "the chat template's generation prompt rewrites earlier text"
            raise ValueError(msg)
        return prompted[len(history) :]

    def generation_prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Ids of `generation_prompt`."""
        return self.encode(self.generation_prompt(messages))

    def assistant_suffix(self) -> str:
        """The text the template writes after an assistant message's content (e.g. `<|im_end|>`, newline)."""
        if self._suffix is None:
            probe = [ChatMessage("user", "Hello."), ChatMessage("assistant", _PROBE_ANSWER)]
            text = self.history_text(probe)
            at = text.rfind(_PROBE_ANSWER)
            self._suffix = text[at + len(_PROBE_ANSWER) :] if at >= 0 else ""
        return self._suffix

    def assistant_suffix_ids(self) -> list[int]:
        """Ids of `assistant_suffix`."""
        return self.encode(self.assistant_suffix())

    def stop_strings(self) -> tuple[str, ...]:
        """End-of-turn text an answer stops at when no single token ends a turn, else ().

        The ChatML fallback on a vocabulary without `<|im_end|>` (a base model) ends a turn
        with that text spelled in ordinary tokens: the answer stops where the model writes it.
        """
        suffix = self.assistant_suffix().strip()
        ids = self.assistant_suffix_ids()
        if not suffix or (ids and ids[0] in set(self.special_tokens.values())):
            return ()
        return (suffix,)

    def stop_token_ids(self) -> set[int]:
        """Token ids that end an assistant turn: EOS and the template's end-of-turn token.

        Computed once: `get_vocab()` builds a dict of the whole vocabulary (~135 ms for
        a 49k vocabulary on a loaded CPU), which was paid before every answer's first token.
        """
        if self._stop_ids is None:
            self._stop_ids = frozenset(self._find_stop_token_ids())
        return set(self._stop_ids)

    def _find_stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        suffix = self.assistant_suffix_ids()
        special = set(self.special_tokens.values())
        if suffix and suffix[0] in special:
            ids.add(suffix[0])
        vocab = self.tokenizer.get_vocab()
        for token in _END_TOKENS:
            if token in vocab:
                ids.add(vocab[token])
        return ids

    def _answers_extend(self) -> bool:
        """Whether appending an answer only appends to a conversation's rendering (most templates)."""
        user = ChatMessage("user", "Hello.")
        call = ChatMessage("assistant", "", tool_calls=(ToolCall("a1b2c3d4e", "probe_tool_fn", {"x": "1"}),))
        result = ChatMessage("tool", "Result.", tool_call_id="a1b2c3d4e")
        answer = ChatMessage("assistant", _PROBE_ANSWER)
        for conversation in ([user], [user, call, result]):
            try:
                if not self.render([*conversation, answer]).startswith(self.render(conversation)):
                    return False
            except Exception:  # noqa: BLE001 - a template that refuses the probe: compare every time
                return False
        return True

    def _needs_tool_list(self) -> bool:
        """Whether the template fails without a tool list (then it gets an empty one).

        Such a template tests `tools is defined`, and a missing list arrives as None.
        """
        self._empty_tools = False
        probe = [{"role": "user", "content": "Hello."}]
        try:
            self._render_dicts(probe)
        except Exception:  # noqa: BLE001 - any failure: try with a list
            self._empty_tools = True
            try:
                self._render_dicts(probe)
            except Exception:  # noqa: BLE001 - it fails either way: leave it, the first render says why
                return False
            return True
        return False

    def _hidden_special_ids(self) -> frozenset[int]:
        fmt = self.tool_format
        written = [fmt.opening("x"), fmt.render_calls([("x", {}, "a1b2c3d4e")]), fmt.trigger]
        if self.reasoning is not None:
            written += [self.reasoning.open, self.reasoning.close]
        shown = {token for token in self.special_tokens if any(token in text for text in written)}
        return frozenset(i for token, i in self.special_tokens.items() if token not in shown)

    def _generation_prompt_extends(self) -> bool:
        """Whether asking for an answer only appends to a conversation's rendering (most templates)."""
        probe = [ChatMessage("user", "Hello.")]
        try:
            plain = self.render(probe)
            prompted = self.render(probe, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that cannot render one user turn fails later, clearly
            return True
        return prompted.startswith(plain)


def tool_format_named(name: str) -> ToolFormat:
    """The tool format called `name` (ValueError listing the names)."""
    return tool_format(name)


def _special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens, text → id."""
    out: dict[str, int] = {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token_id, token in decoder.items():
        if getattr(token, "special", False) and str(token):
            out[str(token)] = int(token_id)
    for text, token_id in zip(
        getattr(tokenizer, "all_special_tokens", []) or [],
        getattr(tokenizer, "all_special_ids", []) or [],
        strict=False,
    ):
        out.setdefault(str(text), int(token_id))
    return out


def _added_tokens(tokenizer: Any) -> set[str]:
    """The text of every token added to the tokenizer's vocabulary (special or not)."""
    return set(_added_token_ids(tokenizer))


def _added_token_ids(tokenizer: Any) -> dict[str, int]:
    """Every token added to the tokenizer's vocabulary (special or not), text → id."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {str(token): int(i) for i, token in decoder.items() if str(token)}
