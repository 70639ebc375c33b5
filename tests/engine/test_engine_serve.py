"""`scripts/serve.sh` refuses settings vLLM would refuse, before starting anything.

vLLM checks `--max-model-len` against its block cache only at the end of its start-up
(minutes on CPU); with `--num-gpu-blocks-override` it accepts at most (blocks - 1) x block
size tokens. serve.sh checks that first and names both ways out.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def serve(tmp_path: Path, *verb: str, **env: str) -> subprocess.CompletedProcess[str]:
    settings = {
        **os.environ,
        "AGENTKV_ENGINE_RUN": str(tmp_path / "run"),
        "AGENTKV_ENGINE_VENV": str(tmp_path / "no-venv"),  # never created: the check comes first
        "PYTHON": "false",  # were the check missing, creating the env would fail at once
        "AGENTKV_VLLM_PORT": "18900",
        "AGENTKV_COORDINATOR_PORT": "18901",
        "AGENTKV_LMCACHE_PORT": "18902",
        "AGENTKV_LMCACHE_HTTP_PORT": "18903",
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "serve.sh"), *(verb or ("start",))],
        env=settings,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.engine
def test_max_model_len_beyond_the_block_cache_is_refused_before_start(tmp_path: Path) -> None:
    done = serve(tmp_path, AGENTKV_VLLM_BLOCKS="64", AGENTKV_MAX_MODEL_LEN="2048")
    assert done.returncode != 0
    assert "AGENTKV_MAX_MODEL_LEN=2048" in done.stderr and "(blocks - 1) x 32 = 2016" in done.stderr
    assert "lower AGENTKV_MAX_MODEL_LEN to 2016 or raise AGENTKV_VLLM_BLOCKS to 65" in done.stderr
    assert not (tmp_path / "no-venv").exists() and not (tmp_path / "run").exists()  # nothing started


@pytest.mark.engine
def test_block_settings_must_be_positive_integers(tmp_path: Path) -> None:
    done = serve(tmp_path, AGENTKV_VLLM_BLOCKS="many")
    assert done.returncode != 0
    assert "AGENTKV_VLLM_BLOCKS: expected a positive integer, got 'many'" in done.stderr
    done = serve(tmp_path, AGENTKV_MAX_MODEL_LEN="-1")
    assert done.returncode != 0
    assert "AGENTKV_MAX_MODEL_LEN: expected a positive integer, got '-1'" in done.stderr


@pytest.mark.engine
def test_fleet_settings_are_checked_before_anything_starts(tmp_path: Path) -> None:
    done = serve(tmp_path, AGENTKV_ENGINES="0")
    assert done.returncode != 0
    assert "AGENTKV_ENGINES: expected a positive integer, got '0'" in done.stderr
    done = serve(tmp_path, "stop-engine", "2", AGENTKV_ENGINES="2")
    assert done.returncode != 0 and "engine 2: expected an index 0..1 (AGENTKV_ENGINES=2)" in done.stderr
    done = serve(tmp_path, "start-engine", "1", AGENTKV_ENGINES="2")
    assert done.returncode != 0 and "no running stack in" in done.stderr
    assert not (tmp_path / "no-venv").exists() and not (tmp_path / "run").exists()  # nothing started
