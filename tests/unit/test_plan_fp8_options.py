"""The planner against one H200's FP8 options (tests/fixtures/h200_fp8_options.json): compiled FP8 with
separate projections (the default), joined ones (train.fuse_projections) and the head in FP8 too
(train.fp8_head).

Before the two fitted terms (constants.FP8_JOINED_OUTPUT_BYTES, FP8_EAGER_HEAD_GRAD_BYTES) the planner
priced both options as gains (886M: 137.8 -> 132.2 -> 128.5 ms a step) where the H200 measured losses
(142.7 -> 150.8 -> 163.4 ms): -12.3% and -21.3%, and the held-out 2.4B row -14.7%. Measured today:
-3.5%, +0.9%, +0.8%, and -2.0% held out. The bar is the planner's 10%.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.plan.fit import predict, runs_from_table

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "h200_fp8_options.json"
STEP_RTOL = 0.10
MEMORY_RTOL = 0.10


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, float, float, float, float | None]]:
    """(name, predicted step s, measured step s, predicted peak bytes, measured peak bytes or None)."""
    out = []
    for run in runs_from_table(FIXTURE):
        step, peak, eager = predict(run)
        assert not eager, run.name
        out.append((run.name, step, run.step_time_s, peak, run.peak_bytes))
    return out


def test_every_fp8_option_row_within_ten_percent_in_step_time(rows):
    assert len(rows) == 4
    for name, predicted, measured, _, _ in rows:
        assert abs(predicted / measured - 1) <= STEP_RTOL, (name, predicted, measured)


def test_the_planner_ranks_the_options_as_measured(rows):
    """What a user reads from `plan evaluate`: on this GPU both options cost time under compiled FP8."""
    separate, joined, joined_head = (step for _, step, _, _, _ in rows[:3])
    assert separate < joined < joined_head


def test_the_886m_rows_peaks_within_ten_percent(rows):
    """The 2.4B row's peak is not held (null in the fixture: gpu_throughput.py's peaks of a 2.4B model depend
    on the pass order by up to 8 GiB, tests/unit/test_plan_h100.py MEMORY_OPEN)."""
    held = [(name, peak, measured) for name, _, _, peak, measured in rows if measured is not None]
    assert len(held) == 3
    for name, predicted, measured in held:
        assert abs(predicted / measured - 1) <= MEMORY_RTOL, (name, predicted / measured - 1)
