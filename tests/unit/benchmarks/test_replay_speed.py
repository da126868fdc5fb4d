"""``kvwarm bench replay``'s evaluator timings call each evaluator on rows it has not
seen: the same rows call after call let the branch predictor learn their paths."""

import numpy as np

from benchmarks.replay_speed import fresh_slices


def test_slices_are_disjoint_while_the_pool_lasts() -> None:
    pool = np.arange(40, dtype=np.float32).reshape(20, 2)
    slices = fresh_slices(pool, 4, 5)
    assert [s.shape for s in slices] == [(4, 2)] * 5
    firsts = [float(s[0, 0]) for s in slices]
    assert firsts == [0.0, 8.0, 16.0, 24.0, 32.0]  # rows 0, 4, 8, 12, 16


def test_slices_wrap_round_without_a_short_one() -> None:
    pool = np.arange(10, dtype=np.float32).reshape(10, 1)
    slices = fresh_slices(pool, 4, 4)
    assert [s[:, 0].tolist() for s in slices] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_a_pool_smaller_than_a_call_is_used_whole() -> None:
    pool = np.ones((3, 2), dtype=np.float32)
    assert [s.shape for s in fresh_slices(pool, 16, 2)] == [(3, 2), (3, 2)]
