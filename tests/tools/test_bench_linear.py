"""``python tools/bench_linear.py``: a step's products at a few rows on each path, on the smoke model."""

from __future__ import annotations

import pytest
import torch

from lightspec_core.models import cpu_linear
from tools import bench_linear

needs_kernel = pytest.mark.skipif(cpu_linear.kernel() is None, reason="no C compiler on this machine")


@needs_kernel
def test_each_path_is_timed_at_each_row_count_and_the_table_names_them(smoke_model, capsys):
    before = torch.get_num_threads()
    argv = ["--model-dir", str(smoke_model / "target"), "--rows", "1", "3", "--repeats", "2", "--working-set", "1",
            "--threads", "1"]  # fmt: skip
    res = bench_linear.main(argv)
    assert sorted(res) == [(1, "native"), (1, "numpy"), (1, "torch"), (3, "native"), (3, "torch")]
    assert all(t > 0 for t in res.values())
    out = capsys.readouterr().out
    assert "| 3 |" in out and "threads: 1" in out
    assert torch.get_num_threads() == before


@needs_kernel
def test_a_path_that_computes_other_products_is_refused_before_it_is_timed(smoke_model, monkeypatch):
    monkeypatch.setattr(cpu_linear, "linear", lambda x, w: torch.nn.functional.linear(x, w) * 1.01)
    with pytest.raises(AssertionError, match="native"):
        bench_linear.measure(str(smoke_model / "target"), [2], repeats=1, working_set_mb=1)
