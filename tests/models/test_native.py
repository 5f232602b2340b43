"""The native kernels' build (models/native.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BUILD = """
import codecs, locale, sys
from pathlib import Path
from lightspec_core.models import native
lib = native.build(Path(sys.argv[1]), compiler=sys.argv[2], out_dir=Path(sys.argv[3]))
print(lib.exists(), codecs.lookup(locale.getpreferredencoding(False)).name)
"""


def test_a_compiler_warning_in_utf8_builds_in_an_interpreter_that_decodes_ascii(tmp_path: Path):
    """Triton's Python stub may decode text as ASCII while GCC quotes names in UTF-8 (‘f’): a warning
    must not turn into a UnicodeDecodeError, which failed a stage model's first step."""
    source = tmp_path / "k.c"
    source.write_text("int lightspec_answer(void) { return 42; }\n")
    cc = tmp_path / "cc-warns"
    cc.write_text(
        "#!/bin/sh\nprintf 'k.c: In function \\342\\200\\230f\\342\\200\\231: warning\\n' >&2\nexec cc \"$@\"\n"
    )
    cc.chmod(0o755)
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(source), str(cc), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "ascii"]  # the build ran where text decodes as ASCII
