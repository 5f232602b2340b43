"""The batched front's shape handling (the forwarding itself runs in tests/e2e/test_conventions.py)."""

from __future__ import annotations

import numpy as np
import pytest
from lightspec_backend.front import batch, is_last, unbatch


def test_unbatch_drops_a_batch_of_one_and_refuses_others_by_name():
    assert unbatch("text_input", np.array([[b"x"]], dtype=object)).shape == (1,)
    assert unbatch("input_ids", np.array([[1, 2, 3]], np.int64)).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^max_tokens: expected a batch of one"):
        unbatch("max_tokens", np.array([[1], [2]], np.int32))


def test_batch_adds_the_dimension_and_the_final_response_is_the_one_with_a_finish_reason():
    assert batch(np.array([5, 6], np.int64)).shape == (1, 2)
    assert not is_last({"finish_reason": np.array([b""], dtype=object)})
    assert is_last({"finish_reason": np.array([b"length"], dtype=object)})
    assert not is_last({"text_output": np.array([b"x"], dtype=object)})
