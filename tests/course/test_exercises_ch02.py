"""Chapter 2's exercise checks (widgets.exercises.ch02) on the tiny engine: right and not-yet cases."""

from __future__ import annotations

import pytest

from widgets.exercises import ch02


def test_prefill_chunks_follow_the_budget():
    assert ch02.prefill_chunks(16) == [16, 16, 8]
    assert ch02.prefill_chunks(64) == [40]
    assert ch02.prefill_chunks(13) == [13, 13, 13, 1]  # the last token's chunk runs the decode kernel


@pytest.mark.parametrize("budget, right", [(..., False), (14, True), (16, True), (19, True), (20, False),
                                           (13, False), (0, False), ("16", False)])
def test_check_prefill_chunks(budget, right):
    result = ch02.check_prefill_chunks(budget)
    assert result.right is right and result.exercise == "2.1"
    assert str(result).startswith("Exercise 2.1: " + ("right." if right else "not yet. Hint:"))


def test_policy_timeline_differs_by_policy():
    # (A's last token, B's first token): prefill_first pauses A one step, static makes B wait for A
    assert ch02.policy_timeline("fcfs") == (10, 4)
    assert ch02.policy_timeline("prefill_first") == (11, 4)
    assert ch02.policy_timeline("static") == (10, 11)


@pytest.mark.parametrize("policy, right, says", [
    (..., False, "set policy"),
    ("fcfs", False, "A was not held back"),     # the default: A decodes in B's admission step
    ("static", False, "keeps B waiting"),        # A is not delayed, but B waits for A to finish
    ("prefill_first", True, "skipped exactly that one step"),
    ("lifo", False, "the engine knows the policies"),
])
def test_check_policy(policy, right, says):
    result = ch02.check_policy(policy)
    assert result.right is right and says in " ".join(str(result).split())
    if policy in ("fcfs", "static"):
        assert "prefill_first" not in str(result)  # a hint says what is wrong, not the answer


def test_steps_for_workload():
    n = len(ch02.OUTPUT_LENGTHS)
    assert ch02.steps_for_workload(n) == (10, n)       # no limit: the longest answer sets the pace
    assert ch02.steps_for_workload(5) == (10, 5)
    assert ch02.steps_for_workload(4) == (12, 4)
    assert ch02.steps_for_workload(2)[0] > 12
    assert ch02.fewest_seats() == 5


@pytest.mark.parametrize("seqs, right, says", [
    (..., False, "set max_num_seqs"),
    (5, True, "one seat fewer takes longer"),
    (14, False, "a smaller max_num_seqs is just as fast"),  # no limit at all
    (7, False, "a smaller max_num_seqs is just as fast"),   # half the requests: fast, not the fewest
    (4, False, "more than the 10 they take with no limit"),  # the two long answers leave too few seats
    (2, False, "more than the 10"),
    (0, False, "whole number >= 1"),
])
def test_check_max_num_seqs(seqs, right, says):
    result = ch02.check_max_num_seqs(seqs)
    assert result.right is right and says in " ".join(str(result).split())
    if not right:
        assert "max_num_seqs=5" not in str(result)


MEDIANS = dict(zip(ch02.PHASES, (0.093, 0.104, 0.146, 0.848, 0.034, 0.356)))  # chapter 2's tiny model, ms


def test_control_plane_share_reads_phases_by_name():
    # schedule + block manager + prepare + update over all six: 0.699 / 1.581
    assert ch02.control_plane_share(MEDIANS) == pytest.approx(0.699 / 1.581)
    shuffled = dict(reversed(list(MEDIANS.items())))  # order does not matter, names do
    assert ch02.control_plane_share(shuffled) == ch02.control_plane_share(MEDIANS)
    with pytest.raises(ValueError, match="model"):
        ch02.control_plane_share({k: v for k, v in MEDIANS.items() if k != "model"})
    assert "(44%): a large share" in ch02.control_plane_reading("tiny", MEDIANS)


def _with_share(share: float) -> dict[str, float]:
    """Medians whose control-plane share is ``share``: control phases 1 ms in all, model the rest."""
    control = {p: 0.25 for p in ch02.CONTROL_PHASES}
    return control | {"model": (1 - share) / share, "sample": 0.0}


@pytest.mark.parametrize("share, words", [
    (0.01, "a thin slice"), (0.099, "a thin slice"), (0.101, "a noticeable share"),
    (0.329, "a noticeable share"), (0.331, "a large share"), (0.499, "a large share"),
    (0.501, "more than the model itself"), (0.9, "more than the model itself"),
])
def test_control_plane_reading_changes_its_words_at_each_threshold(share, words):
    medians = _with_share(share)
    assert ch02.control_plane_share(medians) == pytest.approx(share)
    assert words in ch02.control_plane_reading("x", medians)


def test_compare_control_planes_follows_the_numbers():
    real = dict(zip(ch02.PHASES, (0.034, 0.014, 0.229, 24.0, 0.25, 0.316)))
    text = ch02.compare_control_planes(("real", real), ("tiny", MEDIANS))
    assert "the model's cost follows the model" in text and "grows from 2% (real) to 44% (tiny)" in text
    # a cheap model whose bookkeeping grew as much as its model shrank: the reading says so
    same = {p: 10 * v for p, v in real.items() if p != "model"} | {"model": 2.4}
    text = ch02.compare_control_planes(("real", real), ("other", same))
    assert "the bookkeeping changed about as much as the model" in text
    # the second run's share smaller than the first's: no growth claimed
    text = ch02.compare_control_planes(("tiny", MEDIANS), ("real", real))
    assert "does not grow" in text
