"""Every tool runs as a script from the repository root (``python tools/<name>.py``), importing only
the installed packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    "train_default",
    "bench_engine",
    "bench_runner",
    "bench_linear",
    "bench_scheduler",
    "compare_hf",
    "compare_heads",
    "peer_vllm_inprocess",
]


def test_every_script_in_tools_is_checked():
    assert sorted(p.stem for p in (ROOT / "tools").glob("*.py")) == sorted(TOOLS)


@pytest.mark.parametrize("name", TOOLS)
def test_tool_runs_as_a_script_from_the_repository_root(name):
    script = f"tools/{name}.py"
    cmd = [sys.executable, script, "--help"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python {script}"), done.stdout
    # the module docstring's usage line names the same command
    assert f"python {script}" in (ROOT / script).read_text().split('"""')[1]
