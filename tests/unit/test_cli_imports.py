"""The `agentkv` command imports what a subcommand runs, when it runs: `--help` loads no model stack.

Speed is measured from outside (whole-process runs of `agentkv --help`), not here; this
keeps the reason it is fast: `import agentkv` and the CLI's own modules import neither
torch nor transformers, and `agentkv --help` still lists every subcommand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "matplotlib", "llguidance", "langchain_core")


def _loaded_after(code: str) -> list[str]:
    probe = f"import sys; {code}; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list


@pytest.mark.parametrize(
    "code", ["import agentkv", "import agentkv.cli", "import agentkv.cli; agentkv.cli.build_parser()"]
)
def test_the_cli_imports_no_model_stack(code: str) -> None:
    assert _loaded_after(code) == []


def test_help_lists_the_subcommands_without_loading_torch() -> None:
    code = "\n".join(
        [
            "import contextlib, io, sys, agentkv.cli",
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:",
            "    agentkv.cli.main(['--help'])",
            "print(out.getvalue())",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert all(name in result.stdout for name in ("demo", "bench", "inspect"))
    assert result.stdout.strip().endswith("False")


def test_public_names_still_import_from_the_package() -> None:
    import agentkv

    for name in agentkv.__all__:
        assert getattr(agentkv, name) is not None
    assert agentkv.Backend is agentkv.AgentBackend and agentkv.AnySession is agentkv.AgentSession
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = agentkv.nope  # type: ignore[attr-defined]
