"""Fixtures for the training tests: a few kilobytes of the user's text, in files and a directory."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """Python sources, a text file in a subdirectory and a JSON-lines file: every kind ``--data`` reads."""
    d = tmp_path_factory.mktemp("text")
    for name in ("json/decoder.py", "json/encoder.py", "json/scanner.py", "json/__init__.py", "json/tool.py"):
        (d / Path(name).name).write_text((STDLIB / name).read_text())
    (d / "notes").mkdir()
    (d / "notes" / "textwrap.txt").write_text((STDLIB / "textwrap.py").read_text())
    lines = [json.dumps({"text": (STDLIB / "colorsys.py").read_text()}), json.dumps({"other": "skipped"})]
    (d / "notes" / "records.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="session")
def smoke_text(smoke_model, text_dir):
    """``text_dir`` as the smoke target's token ids [N] (int32)."""
    from tokenizers import Tokenizer

    from lightspec_core.training.data import encode_documents, find_files, read_documents

    tok = Tokenizer.from_file(str(smoke_model / "target" / "tokenizer.json"))
    return encode_documents(tok, read_documents(find_files([text_dir])), eos_id=2)


@pytest.fixture(scope="module")
def bos_model(smoke_model, tmp_path_factory) -> Path:
    """The smoke target with a tokenizer that puts ``<s>`` (id 1) before a prompt, as Llama's does."""
    import shutil

    from tokenizers import Tokenizer, processors

    d = tmp_path_factory.mktemp("bos") / "target"
    shutil.copytree(smoke_model / "target", d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    return d
