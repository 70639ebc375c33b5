"""`TransformersBackend`: a local Transformers model serving many sessions.

The backend owns the model, the tokenizer's chat format and the session table.
Sessions are isolated (each has its own cache and lock); model forwards are
serialised by one lock because attention hooks are installed on the shared
model and a CPU forward gains nothing from running two at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from agentkv.backend.calibration import describe, rung_costs
from agentkv.backend.prefix import build_prefix_cache
from agentkv.backend.registry import SessionRegistry, UnknownSessionError
from agentkv.backend.runner import ModelRunner
from agentkv.backend.session import Session
from agentkv.config import AgentKVConfig
from agentkv.lifecycle.rungs import Rung
from agentkv.models import MANIFEST_NAME
from agentkv.store.prefix_cache import PrefixCache
from agentkv.templates import ChatFormat

logger = logging.getLogger("agentkv.backend")

__all__ = ["TransformersBackend", "UnknownSessionError"]


class TransformersBackend(SessionRegistry[Session]):
    """Sessions over one in-process Transformers causal LM.

    Args:
        model: a causal LM (`AutoModelForCausalLM`), already on its device, in eval mode.
        tokenizer: its tokenizer; a chat template is used when present, else ChatML (with a warning).
        config: the agentkv configuration (defaults when None). Its `model`, `dtype`, `device`
            and `attn_implementation` choose what `load_model` loads; naming others than the
            model passed here has no effect, and is warned with the values in use.
        prefill_chunk: tokens per forward when encoding long inputs (bounds peak memory).
        clock: the clock of the idle bound (`agentkv.sessions.idle_seconds`), in seconds.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: AgentKVConfig | None = None,
        *,
        prefill_chunk: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or AgentKVConfig()
        ignored = _load_settings_ignored(self.config, model)
        if ignored:
            logger.warning(
                "TransformersBackend: %s; the config's loading settings only choose what "
                "load_model / shared_backend load, not a model passed in",
                "; ".join(ignored),
            )
        self.chat_format = ChatFormat(
            tokenizer,
            tool_format=self.config.chat.tool_format,
            template_kwargs=self.config.chat.template_kwargs,
            template=self.config.chat.template,
        )
        self.runner = ModelRunner(model, prefill_chunk=prefill_chunk)
        self.prefix_cache: PrefixCache | None = build_prefix_cache(
            self.config.prefix_cache, self.runner.bytes_per_token
        )
        """Leading system messages' KV shared across sessions (`prefix_cache` in the config)."""
        self.model_lock = self.runner.model_lock
        self._rung_costs: dict[tuple[object, ...], dict[Rung, float]] = {}
        self._warned: set[str] = set()
        """Backend-wide keys a session's config asked for, already warned about."""

    def rung_fidelity(self, config: AgentKVConfig) -> Mapping[Rung, float]:
        """Each rung's measured loss on this model for `config`'s quantization and archive tier.

        Measured once per setting (`agentkv.backend.calibration`; cached on disk per model),
        the first time a session's budget plans.
        """
        q = config.quantization
        setting = (q.group_size, q.attended_bits, q.attended_key_bits, q.host_bits, config.archive_tier)
        if setting not in self._rung_costs:
            with self.model_lock:
                costs = rung_costs(self.model, self.tokenizer, q)
            logger.info("rung costs for %s: %s", setting, describe(costs))
            self._rung_costs[setting] = costs.as_fidelity(config.archive_tier, q.host_bits)
        return self._rung_costs[setting]

    # -- session table -------------------------------------------------------------------------

    def _new_session(
        self, session_id: str, *, parent: Session | None, branch: str | None, config: AgentKVConfig | None
    ) -> Session:
        if config is not None:
            self._warn_backend_wide(session_id, config)
        return Session(self, session_id, parent=parent, branch=branch, config=config)

    def _warn_backend_wide(self, session_id: str, config: AgentKVConfig) -> None:
        """Say once per key what a session's config asks for that only the backend decides.

        The chat format, the session bounds, the prefix cache and the model are the
        backend's (`AgentKVConfig.backend_wide_changes`): the session runs with the backend's.
        """
        fresh = [key for key in config.backend_wide_changes(self.config) if key not in self._warned]
        if fresh:
            self._warned.update(fresh)
            logger.warning(
                "session %r: %s in its config ignored: backend-wide, the session uses the backend's "
                "(give them to the TransformersBackend's config)",
                session_id,
                ", ".join(fresh),
            )

    def adopt(self, session_id: str, branch: str) -> Session:
        """Make the branch session `<session_id>/<branch>` the conversation's continuation.

        When a thread goes on with a branch's answer (a tree of thought's winner), the
        branch already holds that answer's KV on top of the shared prefix: it takes the
        thread's id instead of the thread re-encoding it. The branch's spans are
        committed (`BranchSelected`), its siblings closed, and the old thread session
        closed; the prefix tensors it shared stay alive through the branch.

        Returns:
            The adopted session, now `session_id`.

        Raises:
            UnknownSessionError: no such thread or branch session.
        """
        return self._adopt_branch(session_id, branch, lambda parent, _child: parent.close())

    # -- global accounting ---------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Device KV bytes of one token; `EngineBackend` has the same."""
        return self.runner.bytes_per_token

    @property
    def max_positions(self) -> int | None:
        """Positions the model supports (None = not declared); `EngineBackend` has the same."""
        return self.runner.max_positions

    def device_bytes(self) -> int:
        """Device KV bytes across all sessions and the prefix cache, shared tensors counted once.

        Shared KV (a fork's parent prefix, a prefix cache entry) is counted once, by
        its storage: a session attending the first n tokens of an entry holds a view
        of the entry's storage, and the whole storage stays allocated while it does.

        A session enforcing a global budget calls this *while holding its own lock*;
        if it waited for the other sessions' locks, two sessions doing so at once would
        deadlock. So a session whose lock is busy is read without it: its tensors are
        replaced whole, never resized in place, so the figure is exact when the
        sessions are idle and at most one operation stale while they run.
        """
        storages: dict[int, int] = {}
        total = 0
        if self.prefix_cache is not None:
            for tensor in self.prefix_cache.tensors():
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        for session in self.sessions():
            locked = session.lock.acquire(blocking=False)
            try:
                tensors = list(session.store.physical.tensors())
                quantized = session.store.archived_device_bytes()
            finally:
                if locked:
                    session.lock.release()
            for tensor in tensors:
                if tensor.numel():
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            total += quantized
        return total + sum(storages.values())

    def relieve_device(self, free_bytes: int) -> int:
        """Free device bytes no session attends (unreferenced prefix cache entries); bytes freed."""
        if self.prefix_cache is None or free_bytes <= 0:
            return 0
        return self.prefix_cache.evict(free_bytes)


def _load_settings_ignored(config: AgentKVConfig, model: torch.nn.Module) -> list[str]:
    """`config`'s loading keys that name another model, dtype, device or kernel than `model` has.

    One line per key, with the value asked for and the one in use; unset keys (and `dtype: auto`)
    ask for nothing.
    """
    ignored: list[str] = []
    param = next(model.parameters(), None)
    model_config = getattr(model, "config", None)
    if config.model is not None:
        names = _loaded_names(model_config)
        if not any(_same_model(config.model, name) for name in names):
            in_use = names[0] if names else "a model without a name_or_path"
            ignored.append(f"agentkv.model={config.model!r} ignored, the model passed is {in_use!r}")
    if (
        param is not None
        and config.dtype not in (None, "auto")
        and getattr(torch, config.dtype) != param.dtype
    ):
        ignored.append(f"agentkv.dtype={config.dtype!r} ignored, the model passed runs {param.dtype}")
    if param is not None and config.device is not None and not _same_device(config.device, param.device):
        ignored.append(f"agentkv.device={config.device!r} ignored, the model passed is on {param.device}")
    kernel = getattr(model_config, "_attn_implementation", None)
    if config.attn_implementation is not None and kernel != config.attn_implementation:
        ignored.append(
            f"agentkv.attn_implementation={config.attn_implementation!r} ignored, "
            f"the model passed uses {kernel!r}"
        )
    return ignored


def _loaded_names(model_config: Any) -> list[str]:
    """What a loaded model answers to: a converted GGUF's source, then its `name_or_path`."""
    path = str(getattr(model_config, "name_or_path", "") or "")
    if not path:
        return []
    try:
        source = json.loads(Path(path, MANIFEST_NAME).read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        source = None
    return [source, path] if isinstance(source, str) and source else [path]


def _same_model(asked: str, loaded: str) -> bool:
    if asked == loaded:
        return True
    a, b = Path(asked).expanduser(), Path(loaded).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _same_device(asked: str, actual: torch.device) -> bool:
    try:
        wanted = torch.device(asked)
    except (RuntimeError, TypeError):
        return False
    return wanted.type == actual.type and wanted.index in (None, actual.index)
