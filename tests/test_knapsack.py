"""The knapsack solver against brute force, and its bucketed and greedy paths."""

import itertools
import random

from expecttest import TestCase

from sac2.policies import knapsack
from sac2.policies.knapsack import solve


def _brute_force(weights, values, capacity):
    best = 0.0
    for r in range(len(weights) + 1):
        for subset in itertools.combinations(range(len(weights)), r):
            if sum(weights[i] for i in subset) <= capacity:
                best = max(best, sum(values[i] for i in subset))
    return best


class TestKnapsack(TestCase):
    def test_matches_brute_force_on_small_random_instances(self):
        rng = random.Random(0)
        for _ in range(200):
            n = rng.randint(0, 9)
            weights = [rng.choice([0, rng.randint(1, 40)]) for _ in range(n)]
            values = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
            capacity = rng.randint(0, 120)
            sol = solve(weights, values, capacity)
            self.assertEqual(sol.method, "exact")
            self.assertLessEqual(sol.weight, capacity)
            self.assertAlmostEqual(sol.value, _brute_force(weights, values, capacity))

    def test_solution_totals_are_those_of_the_chosen_items(self):
        weights, values = [3, 4, 5], [4.0, 5.0, 6.0]
        sol = solve(weights, values, 8)
        self.assertEqual(sol.chosen, frozenset({0, 2}))
        self.assertEqual((sol.weight, sol.value), (8, 10.0))

    def test_large_byte_counts_are_bucketed_and_stay_within_capacity(self):
        rng = random.Random(1)
        weights = [rng.randint(1, 10**9) * 2 + 1 for _ in range(12)]
        values = [rng.uniform(0, 10) for _ in range(12)]
        capacity = sum(weights) // 2
        sol = solve(weights, values, capacity)
        self.assertTrue(sol.method.startswith("dp (bytes in buckets of "))
        self.assertLessEqual(sol.weight, capacity)
        self.assertGreaterEqual(sol.value, 0.97 * _brute_force(weights, values, capacity))

    def test_greedy_is_the_reported_fallback_when_no_table_fits(self):
        old = knapsack.MAX_CELLS
        knapsack.MAX_CELLS = 10
        try:
            sol = solve([5, 4, 3], [10.0, 4.0, 9.0], 8)
        finally:
            knapsack.MAX_CELLS = old
        self.assertEqual(sol.method, "greedy (fallback)")
        self.assertEqual(sol.chosen, frozenset({0, 2}))

    def test_negative_capacity_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "capacity must be >= 0"):
            solve([1], [1.0], -1)
