"""A checkpoint of another family (Qwen3, made by transformers) served by ``lightspec serve
--model-dir`` returns the text the in-process engine gives."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from tests.e2e.test_triton_cli import read_until
from tests.models.factories import CASES, save_hf_checkpoint

pytestmark = pytest.mark.triton
PROMPT = "def fibonacci(n):\n    if n < 2:\n"


def test_serve_model_dir_of_another_family_matches_the_engine(tmp_path, default_model):
    model_type, overrides, how = CASES["qwen3"]
    path = save_hf_checkpoint(tmp_path / "qwen3", model_type, {**overrides, "vocab_size": 4096}, **how)
    shutil.copy(default_model / "target" / "tokenizer.json", path / "tokenizer.json")
    eng = LLMEngine(EngineConfig(model_dir=str(path), speculation="none", num_kv_blocks=32, block_size=16))
    want = eng.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    eng.close()
    env = {**os.environ, "LIGHTSPEC_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable,
        "-m",
        "lightspec_backend.cli",
        "serve",
        "--model-dir",
        str(path),
        "--speculation",
        "ngram",
        "--set",
        "num_kv_blocks=32",
        "--set",
        "num_threads=1",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--openai-port",
        "0",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = read_until(proc, "Ctrl-C to stop", timeout=600)
        url = re.search(r"HTTP\s+(http://\S+/generate)", out)
        assert url, out
        body = json.dumps({"text_input": PROMPT, "max_tokens": 16, "ignore_eos": True, "exclude_input_in_output": True})
        with urllib.request.urlopen(urllib.request.Request(url.group(1), data=body.encode()), timeout=120) as r:
            got = json.loads(r.read())["text_output"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got == want
