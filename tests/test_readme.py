"""The README's library example runs as written and does what it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_library_example_runs_as_written():
    text = README.read_text()
    section = text[text.index("## As a library") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 5
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    m = re.search(r"\[(\d+) tokens, (\d+)/(\d+) drafts accepted\]", out.getvalue())
    assert m, out.getvalue()
    assert int(m.group(1)) == 48 and int(m.group(2)) <= int(m.group(3))


def test_quickstart_commands_name_what_exists():
    text = README.read_text()
    assert "lightspec serve --http-port 0 --grpc-port 0 --metrics-port 0 --sample" in text
    assert "bash .ci/run" in text and (README.parent / ".ci" / "run").is_file()
