"""The allocation solvers against brute force: the exact one finds the optimum of every small
case; the relaxation is always feasible, finds the optimum where costs are convex in the weight
(quantization errors are), and never does worse than every unit at its cheapest option."""

import itertools

import numpy as np
import pytest

from leapquant_jax.bit_allocation import AllocationError, allocate, allocate_exact, allocate_lagrangian


def brute_force(cost, weight, budget):
    n, m = cost.shape
    w = np.broadcast_to(weight, cost.shape)
    best, arg = np.inf, None
    for choice in itertools.product(range(m), repeat=n):
        idx = np.arange(n), np.asarray(choice)
        if w[idx].sum() <= budget and cost[idx].sum() < best - 1e-12:
            best, arg = cost[idx].sum(), choice
    return best, np.asarray(arg)


def total(cost, weight, choice):
    idx = np.arange(cost.shape[0]), choice
    return cost[idx].sum(), np.broadcast_to(weight, cost.shape)[idx].sum()


@pytest.mark.parametrize("seed", range(12))
def test_exact_allocation_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    cost = rng.uniform(0, 10, (n, m))
    weight = rng.integers(1, 9, (n, m)) * (4 if seed % 2 else 1)          # a common divisor for the table
    least, most = weight.min(axis=1).sum(), weight.max(axis=1).sum()
    budget = int(rng.integers(least, most + 2))
    want, _ = brute_force(cost, weight, budget)
    got = allocate_exact(cost, weight, budget)
    c, w = total(cost, weight, got)
    assert w <= budget and c == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert np.array_equal(allocate(cost, weight, budget), got)               # small: the exact one


@pytest.mark.parametrize("seed", range(8))
def test_relaxation_is_feasible_and_optimal_on_convex_costs(seed):
    rng = np.random.default_rng(100 + seed)
    n, bits = 6, np.array([2, 4, 6, 8])
    # each unit: error falling geometrically with bits (convex), scaled by a lifetime
    cost = rng.uniform(0.1, 5.0, (n, 1)) * 4.0 ** (-bits[None, :] / 2) * rng.uniform(0.5, 2.0, (n, 1))
    for budget in range(2 * n, 8 * n + 1, 2):
        want, _ = brute_force(cost, bits, budget)
        c, w = total(cost, bits, allocate_lagrangian(cost, bits, budget))
        assert w <= budget and c == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_relaxation_is_feasible_on_any_costs(seed):
    rng = np.random.default_rng(200 + seed)
    n, m = 5, 3
    cost, weight = rng.uniform(0, 1, (n, m)), rng.integers(1, 6, (n, m))
    budget = int(rng.integers(weight.min(axis=1).sum(), weight.max(axis=1).sum() + 1))
    c, w = total(cost, weight, allocate_lagrangian(cost, weight, budget))
    want, _ = brute_force(cost, weight, budget)
    cheapest = np.argmin(weight + np.arange(m) * 1e-9, axis=1)
    assert w <= budget and want - 1e-12 <= c <= total(cost, weight, cheapest)[0] + 1e-12


def test_bad_problems_are_refused_by_name():
    cost = np.ones((3, 2))
    with pytest.raises(AllocationError, match="budget 5 is below 6"):
        allocate(cost, np.array([2, 4]), 5)
    with pytest.raises(AllocationError, match="budget 5 is below 6"):
        allocate_lagrangian(cost, np.array([2, 4]), 5)
    with pytest.raises(AllocationError, match="non-negative integers"):
        allocate(cost, np.array([2.5, 4.0]), 20)
    with pytest.raises(AllocationError, match="finite"):
        allocate(np.array([[np.nan, 1.0]]), np.array([2, 4]), 20)
    with pytest.raises(AllocationError, match=r"\[units, options\]"):
        allocate(np.ones(3), np.array([2]), 20)
