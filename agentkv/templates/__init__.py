"""Chat templates: rendering messages, folding roles a template lacks, and finding message boundaries.

See `ChatFormat` (what a session uses), `RoleRules` / `fold` (roles a template lacks)
and `split_history` (message boundaries by comparing renderings).
"""

from agentkv.templates.builtin import BUILTIN_TEMPLATES, resolve_template
from agentkv.templates.format import FALLBACK_CHAT_TEMPLATE, ChatFormat, fallback_template
from agentkv.templates.roles import RoleRules, fold, template_dicts, template_id
from agentkv.templates.segments import Cached, Split, common_prefix, safe_cut, split_history

__all__ = [
    "BUILTIN_TEMPLATES",
    "Cached",
    "Split",
    "FALLBACK_CHAT_TEMPLATE",
    "ChatFormat",
    "RoleRules",
    "common_prefix",
    "fallback_template",
    "fold",
    "resolve_template",
    "safe_cut",
    "split_history",
    "template_dicts",
    "template_id",
]
