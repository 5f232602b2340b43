"""The training loop: budgets by steps and by time, checkpoints between steps, stopping on request."""

from __future__ import annotations

import pytest

from lightspec_core.training.loop import Budget, Clock, Progress, run_training


class CountingTrainer:
    """Stands in for ``HeadTrainer``: records the budget fraction of every step."""

    def __init__(self):
        self.fracs: list[float] = []

    def step(self, frac: float) -> float:
        self.fracs.append(frac)
        return 1.0


def test_a_step_budget_runs_exactly_that_many_steps_with_the_fraction_rising_from_zero():
    trainer = CountingTrainer()
    progress, finished = run_training(trainer, Budget(steps=4))
    assert finished and progress.step == 4
    assert trainer.fracs == [0.0, 0.25, 0.5, 0.75]


def test_a_time_budget_counts_the_time_already_spent_and_starts_the_schedule_at_zero():
    budget = Budget(minutes=1.0)
    assert budget.fraction(0, 0.0, elapsed=20.0) == 0.0  # preparation took 20 s: training has 40 s left
    assert budget.fraction(10, 20.0, elapsed=40.0) == pytest.approx(0.5)
    assert budget.fraction(10, 20.0, elapsed=61.0) == 1.0
    # both: whichever is further along
    assert Budget(minutes=1.0, steps=10).fraction(8, 20.0, elapsed=40.0) == 0.8


def test_a_resumed_clock_carries_on_from_the_checkpoints_elapsed_time():
    trainer = CountingTrainer()
    progress, finished = run_training(trainer, Budget(minutes=0.5), Progress(step=7, elapsed=31.0), Clock(31.0))
    assert finished and progress.step == 7 and trainer.fracs == []  # the budget was spent before


@pytest.mark.parametrize("bad", [{}, {"minutes": 0}, {"steps": 0}, {"steps": -3}])
def test_a_budget_needs_minutes_or_steps_above_zero(bad):
    with pytest.raises(ValueError, match="--minutes|--steps"):
        Budget(**bad)


def test_stopping_ends_between_steps_and_writes_the_checkpoint_once_more():
    trainer, saved = CountingTrainer(), []
    progress, finished = run_training(
        trainer, Budget(steps=100), checkpoint=lambda p: saved.append(p.step), checkpoint_seconds=0.0,
        should_stop=lambda: len(trainer.fracs) == 3,
    )  # fmt: skip
    assert not finished and progress.step == 3
    assert saved == [1, 2, 3, 3]  # after every step (interval 0), then the final one


def test_checkpoints_wait_for_their_interval():
    trainer, saved = CountingTrainer(), []
    run_training(trainer, Budget(steps=5), checkpoint=lambda p: saved.append(p.step), checkpoint_seconds=3600)
    assert saved == [5]
