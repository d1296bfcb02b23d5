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


def test_admission_step_differs_by_policy():
    assert ch02.admission_step("prefill_first") == {"B": (8, True)}
    assert ch02.admission_step("fcfs") == {"A": (1, False), "B": (8, True)}
    assert ch02.admission_step("static") == {"A": (1, False)}


@pytest.mark.parametrize("policy, right", [(..., False), ("fcfs", False), ("static", False),
                                           ("prefill_first", True), ("lifo", False)])
def test_check_policy(policy, right):
    assert ch02.check_policy(policy).right is right


def test_steps_for_workload():
    assert ch02.steps_for_workload(256) == (6, 8)
    assert ch02.steps_for_workload(4) == (12, 4)
    assert ch02.steps_for_workload(2)[0] == 24


@pytest.mark.parametrize("seqs, right", [(..., False), (8, False), (4, True), (7, True), (3, False), (0, False)])
def test_check_max_num_seqs(seqs, right):
    assert ch02.check_max_num_seqs(seqs).right is right
