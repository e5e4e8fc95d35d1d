"""The proposal vocabulary the smol_build recipe ships beside the CPU default's heads."""

from medusa_core.smol_build import most_used


def test_most_used_ranks_by_count_then_id_and_reports_what_it_covers():
    answers = [[5, 5, 9, 2], [9, 5, 7, 2], [8]]
    ids, coverage = most_used(answers, 3)
    assert ids == [5, 2, 9]                 # 5 thrice; 2 and 9 twice each: the lower id first
    assert coverage == 7 / 9
    assert most_used(answers, 10) == ([5, 2, 9, 7, 8], 1.0)
    assert most_used([], 4) == ([], 0.0)
