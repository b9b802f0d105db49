"""The knapsack solver against brute force, and its bucketed and greedy paths."""

import itertools
import random

import pytest

from sac2.policies import knapsack
from sac2.policies.knapsack import solve


def _brute_force(weights, values, capacity):
    best = 0.0
    for r in range(len(weights) + 1):
        for subset in itertools.combinations(range(len(weights)), r):
            if sum(weights[i] for i in subset) <= capacity:
                best = max(best, sum(values[i] for i in subset))
    return best


def test_matches_brute_force_on_small_random_instances():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 9)
        weights = [rng.choice([0, rng.randint(1, 40)]) for _ in range(n)]
        values = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
        capacity = rng.randint(0, 120)
        sol = solve(weights, values, capacity)
        assert sol.method == "exact"
        assert sol.weight <= capacity
        assert sol.value == pytest.approx(_brute_force(weights, values, capacity), abs=1e-7)


def test_solution_totals_are_those_of_the_chosen_items():
    weights, values = [3, 4, 5], [4.0, 5.0, 6.0]
    sol = solve(weights, values, 8)
    assert sol.chosen == frozenset({0, 2})
    assert (sol.weight, sol.value) == (8, 10.0)


def test_large_byte_counts_are_bucketed_and_stay_within_capacity():
    rng = random.Random(1)
    weights = [rng.randint(1, 10**9) * 2 + 1 for _ in range(12)]
    values = [rng.uniform(0, 10) for _ in range(12)]
    capacity = sum(weights) // 2
    sol = solve(weights, values, capacity)
    assert sol.method.startswith("dp (bytes in buckets of ")
    assert sol.weight <= capacity
    assert sol.value >= 0.97 * _brute_force(weights, values, capacity)


def test_greedy_is_the_reported_fallback_when_no_table_fits():
    old = knapsack.MAX_CELLS
    knapsack.MAX_CELLS = 10
    try:
        sol = solve([5, 4, 3], [10.0, 4.0, 9.0], 8)
    finally:
        knapsack.MAX_CELLS = old
    assert sol.method == "greedy (fallback)"
    assert sol.chosen == frozenset({0, 2})


def test_negative_capacity_is_an_error():
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        solve([1], [1.0], -1)
