"""The real local engine stack for the `engine` tests, started once per test session.

When `AGENTKV_ENGINE_VLLM_URL` and `AGENTKV_ENGINE_COORDINATOR_URL` name a running stack, it is
used as is (and left running); otherwise `scripts/serve.sh start` starts one on its own ports
in a temporary run directory and `scripts/serve.sh stop` ends it after the session. A stack
that does not come up fails the tests with serve.sh's message: never a skip. A running fleet:
`AGENTKV_ENGINE_VLLM_URLS` lists its engines (comma-separated) and `AGENTKV_ENGINE_RUN` names
its serve.sh run directory (the fleet test stops and starts one of its engines).

The stack it starts is a fleet of `ENGINES` vLLM servers over one LMCache (`AGENTKV_ENGINES`):
the one-engine tests use engine 0 (`vllm_url`), the fleet test all of them, and it stops and
starts engine 1 (`stop_engine` / `start_engine`).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORTS = {  # away from the defaults, so a stack a developer runs by hand is not disturbed
    "AGENTKV_VLLM_PORT": "18000",
    "AGENTKV_COORDINATOR_PORT": "19300",
    "AGENTKV_LMCACHE_PORT": "15555",
    "AGENTKV_LMCACHE_HTTP_PORT": "18301",
}
CHUNK_SIZE = 64
ENGINES = 2


@dataclass
class EngineStack:
    """URLs and facts of the running stack."""

    vllm_url: str
    coordinator_url: str
    model_path: str
    served_name: str
    chunk_size: int
    bytes_per_token: int
    tokenizer: Any
    vllm_urls: tuple[str, ...] = ()
    """Every engine of the fleet (engine 0 is `vllm_url`)."""
    env: dict[str, str] | None = None
    """serve.sh's settings for this stack; None = a stack the tests did not start (no stop/start)."""

    def stop_engine(self, index: int) -> None:
        """Stop vLLM engine `index` (its process group ends: its port refuses connections)."""
        self._serve("stop-engine", index)

    def start_engine(self, index: int) -> None:
        """Start vLLM engine `index` again against the running LMCache and wait until it answers."""
        self._serve("start-engine", index)

    def _serve(self, verb: str, index: int) -> None:
        if self.env is None:
            pytest.fail(f"{verb} {index}: this stack was not started by the tests", pytrace=False)
        script = str(ROOT / "scripts" / "serve.sh")
        done = subprocess.run(
            ["bash", script, verb, str(index)], env=self.env, capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.fail(f"scripts/serve.sh {verb} {index} failed:\n{done.stderr[-3000:]}", pytrace=False)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (the server runs with VLLM_SERVER_DEV_MODE=1)."""
        request = urllib.request.Request(f"{self.vllm_url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 (local)
            assert response.status == 200


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 2) -> int:
    """Engine KV bytes per token (vLLM-CPU serves float32 checkpoints in bfloat16)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes


@pytest.fixture(scope="session")
def engine_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineStack]:
    from transformers import AutoTokenizer

    vllm_url = os.environ.get("AGENTKV_ENGINE_VLLM_URL")
    coordinator_url = os.environ.get("AGENTKV_ENGINE_COORDINATOR_URL")
    run_dir: Path | None = None
    env = {**os.environ, **PORTS, "AGENTKV_CHUNK_SIZE": str(CHUNK_SIZE), "AGENTKV_ENGINES": str(ENGINES)}
    if not (vllm_url and coordinator_url):
        # scripts/test_engine.sh names the run directory, so its exit trap can stop the stack
        # even when pytest itself is killed (a timeout) before this fixture's teardown runs.
        named = os.environ.get("AGENTKV_ENGINE_TEST_RUN")
        run_dir = Path(named) if named else tmp_path_factory.mktemp("engine-run")
        run_dir.mkdir(parents=True, exist_ok=True)
        env["AGENTKV_ENGINE_RUN"] = str(run_dir)
        started = subprocess.run(
            ["bash", str(ROOT / "scripts" / "serve.sh"), "start"], env=env, capture_output=True, text=True
        )
        if started.returncode != 0:
            subprocess.run(["bash", str(ROOT / "scripts" / "serve.sh"), "stop"], env=env, check=False)
            pytest.fail(
                f"scripts/serve.sh start failed (logs in {run_dir}):\n{started.stderr[-3000:]}", pytrace=False
            )
        first = int(PORTS["AGENTKV_VLLM_PORT"])
        vllm_urls = tuple(f"http://127.0.0.1:{first + i}" for i in range(ENGINES))
        vllm_url = vllm_urls[0]
        coordinator_url = f"http://127.0.0.1:{PORTS['AGENTKV_COORDINATOR_PORT']}"
        model_path = (run_dir / "model").read_text().strip()
    else:
        listed = os.environ.get("AGENTKV_ENGINE_VLLM_URLS", "")  # a running fleet: comma-separated
        vllm_urls = tuple(u for u in listed.split(",") if u) or (vllm_url,)
        model_path = os.environ.get("AGENTKV_ENGINE_MODEL") or _served_model_path(vllm_url)
        if os.environ.get("AGENTKV_ENGINE_RUN"):  # serve.sh's run directory: its engines may be stopped
            port = vllm_url.rsplit(":", 1)[-1].strip("/")
            # Its own settings (AGENTKV_LMCACHE_PORT, ...) from the environment, not the test ports.
            env = {**os.environ, "AGENTKV_VLLM_PORT": port, "AGENTKV_ENGINES": str(len(vllm_urls))}
    try:
        yield EngineStack(
            vllm_url=vllm_url,
            coordinator_url=coordinator_url,
            model_path=model_path,
            served_name="agentkv-default",
            chunk_size=int(os.environ.get("AGENTKV_CHUNK_SIZE", CHUNK_SIZE)),
            bytes_per_token=kv_bytes_per_token(model_path),
            tokenizer=AutoTokenizer.from_pretrained(model_path),
            vllm_urls=vllm_urls,
            env=env if run_dir is not None or os.environ.get("AGENTKV_ENGINE_RUN") else None,
        )
    finally:
        if run_dir is not None:
            subprocess.run(["bash", str(ROOT / "scripts" / "serve.sh"), "stop"], env=env, check=False)


def _served_model_path(vllm_url: str) -> str:
    with urllib.request.urlopen(f"{vllm_url}/v1/models", timeout=30) as response:  # noqa: S310 (local)
        return str(json.loads(response.read())["data"][0]["root"])
