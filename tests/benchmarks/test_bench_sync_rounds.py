"""``sluice bench sync``'s round budget: small models, whose single rounds vary most, get many more rounds."""

from __future__ import annotations

import pytest

from pipeline.benchmarks.sync import MAX_ROUNDS_FACTOR, SyncBenchParams, more_rounds, quartiles


def _rounds_run(round_s: float, params: SyncBenchParams) -> int:
    done, spent = 0, 0.0
    while more_rounds(done, spent, params):
        done, spent = done + 1, spent + round_s
    return done


def test_a_fast_round_is_repeated_until_min_seconds_a_slow_one_only_rounds_times_and_never_past_the_cap() -> None:
    params = SyncBenchParams(rounds=5, min_seconds=4.0)
    assert _rounds_run(0.0625, params) == 64  # a 50 MB model's round: 4 s of them
    assert _rounds_run(1.6, params) == 5  # a 2 GB model's: the minimum already takes longer
    assert _rounds_run(0.001, params) == MAX_ROUNDS_FACTOR * 5
    assert _rounds_run(0.05, SyncBenchParams(rounds=5, min_seconds=0.0)) == 5


def test_quartiles_bound_the_middle_half_of_the_rounds() -> None:
    q1, q3 = quartiles([0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4])
    assert q1 == pytest.approx(0.9) and q3 == pytest.approx(1.3)
    assert quartiles([0.7]) == [0.7, 0.7]
