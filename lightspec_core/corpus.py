"""The embedded model's corpus: the running interpreter's standard library, split once.

Every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages``; files with a path
component named ``test`` are held out. The default model was trained on the first part, and every
benchmark prompt comes from the held-out one.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), each sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, valid = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        (valid if "test" in rel[:-1] else train).append(p)
    return train, valid
