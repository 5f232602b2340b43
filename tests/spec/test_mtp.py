"""The MTP proposer's handling of the drafts a fused target stage proposes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from lightspec_core.config import SamplingParams
from lightspec_core.spec.mtp import _keep_fused


def stage_result(accepted: int) -> SimpleNamespace:
    return SimpleNamespace(
        accepted=np.array([accepted], np.int32),
        next_draft_ids=np.array([[7, 8, -1]]),
        next_draft_conf=np.array([[0.9, 0.8, 0.0]], np.float32),
    )


def sequence(min_tokens: int, num_output: int) -> SimpleNamespace:
    params = SamplingParams(max_tokens=64, min_tokens=min_tokens)
    return SimpleNamespace(request_id="r", params=params, num_output=num_output, num_tokens=10 + num_output)


def test_agreeing_verifications_keep_the_stages_drafts_for_the_next_step():
    seq = sequence(0, 4)
    _keep_fused(seq, stage_result(2), 0, 2)
    assert seq.fused_ids == [7, 8] and seq.draft_room == 2 and seq.fused_at == 14


@pytest.mark.parametrize(("min_tokens", "level"), [(0, logging.WARNING), (20, logging.DEBUG)])
def test_a_disagreement_drops_the_drafts_and_warns_unless_end_tokens_were_masked(caplog, min_tokens, level):
    """Below ``min_tokens`` the engine masks the end tokens and the stage's greedy check does not:
    their verifications differ whenever an end token is the target's top-1, which a request kept
    past its natural end meets at every step. That is expected, not worth a warning per step."""
    seq = sequence(min_tokens, 4)
    with caplog.at_level(logging.DEBUG, logger="lightspec"):
        _keep_fused(seq, stage_result(2), 0, 1)
    assert seq.fused_ids is None and seq.draft_room == 0
    assert [r.levelno for r in caplog.records] == [level]
    assert "stage accepted 2 drafts of r, the engine 1; drafts dropped" in caplog.text
