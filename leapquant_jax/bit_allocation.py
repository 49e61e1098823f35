"""Bit allocation: one option per unit (a head, a key row) at the least total cost under a budget.

    choice = allocate(cost, weight, budget)      # cost [n, m] float, weight [m] or [n, m] int -> [n]

Unit ``i`` takes option ``choice[i]`` (an index into its ``m`` options); the sum of the chosen
``cost`` is minimal subject to the sum of the chosen ``weight`` being at most ``budget`` (a
multiple-choice knapsack). Costs are what a unit's rounding error will do (error energy times its
lifetime, ``lifetime``); weights are what it stores (bits, or bytes counted on the state pytrees).

* ``allocate_exact``: dynamic programming over the units on the integer weights, divided first by
  their greatest common divisor: exact, ``O(n m budget)`` time and ``n budget`` memory.
* ``allocate_lagrangian``: the budget relaxed with a multiplier ``lam`` (each unit's argmin of
  ``cost + lam weight``, ``lam`` bisected to the cheapest feasible choice), then a repair that spends
  what is left of the budget on the upgrades saving the most cost per unit of weight. Not exact;
  for problems whose table would not fit.
* ``allocate``: the exact one when its table holds at most ``EXACT_CELLS`` cells, else the other.

Ties go to the lower option index, so list options cheapest first. A budget below the cheapest
choice of every unit is refused by name (``AllocationError``).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

# Cells of the exact table (units x budget steps) above which ``allocate`` uses the relaxation.
EXACT_CELLS = 50_000_000
BISECTIONS = 100


class AllocationError(ValueError):
    """An allocation problem without a solution (budget too small) or with malformed input."""


def _check(cost, weight, budget) -> tuple[np.ndarray, np.ndarray, int]:
    cost = np.asarray(cost, np.float64)
    if cost.ndim != 2 or cost.shape[1] < 1:
        raise AllocationError(f"cost must be [units, options], got shape {cost.shape}")
    if not np.all(np.isfinite(cost)):
        raise AllocationError("cost must be finite")
    w = np.asarray(weight)
    if not np.issubdtype(w.dtype, np.integer) or np.any(w < 0):
        raise AllocationError(f"weights must be non-negative integers, got {w.dtype}")
    w = np.broadcast_to(w.astype(np.int64), cost.shape)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise AllocationError(f"budget must be an integer, got {budget!r}")
    least = int(w.min(axis=1).sum())
    if budget < least:
        raise AllocationError(f"budget {int(budget)} is below {least}, what every unit at its cheapest option takes")
    return cost, w, int(budget)


def allocate_exact(cost, weight, budget: int) -> np.ndarray:
    """The optimal choice ``[n]`` int (module docstring) by dynamic programming."""
    cost, w, budget = _check(cost, weight, budget)
    n, m = cost.shape
    g = math.gcd(*[int(x) for x in np.unique(w)]) or 1
    w = w // g
    cap = min(budget // g, int(w.max(axis=1).sum()))
    best = np.zeros(cap + 1)                                   # least cost at each total weight <= c
    back = np.zeros((n, cap + 1), np.int16)
    for i in range(n):
        new = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, np.int16)
        for j in range(m):
            wj = int(w[i, j])
            if wj > cap:
                continue
            trial = np.full(cap + 1, np.inf)
            trial[wj:] = best[:cap + 1 - wj] + cost[i, j]
            better = trial < new
            new[better], pick[better] = trial[better], j
        best, back[i] = new, pick
    # best[c] is the least cost with total weight <= c (best starts at 0 everywhere: weight "at most")
    c = cap
    choice = np.zeros(n, np.int64)
    for i in range(n - 1, -1, -1):
        choice[i] = back[i, c]
        c -= int(w[i, choice[i]])
    return choice


def allocate_lagrangian(cost, weight, budget: int) -> np.ndarray:
    """A feasible, near-optimal choice ``[n]`` int: Lagrangian relaxation and greedy repair."""
    cost, w, budget = _check(cost, weight, budget)
    n = cost.shape[0]
    rows = np.arange(n)

    def choose(lam: float) -> np.ndarray:
        # lowest index among ties (argmin), then the lighter option among exact ties of cost + lam w
        return np.argmin(cost + lam * w, axis=1)

    pick = choose(0.0)
    if w[rows, pick].sum() > budget:
        lo, hi = 0.0, 1.0
        cheapest = np.argmin(w + np.arange(w.shape[1]) * 1e-9, axis=1)
        while w[rows, choose(hi)].sum() > budget and hi < 1e300:
            hi *= 4.0
        pick = choose(hi) if w[rows, choose(hi)].sum() <= budget else cheapest
        for _ in range(BISECTIONS):
            mid = 0.5 * (lo + hi)
            trial = choose(mid)
            if w[rows, trial].sum() > budget:
                lo = mid
            else:
                hi, pick = mid, trial
    left = budget - int(w[rows, pick].sum())
    heap = []

    def offer(i: int) -> None:
        j = pick[i]
        for k in range(cost.shape[1]):
            extra, gain = int(w[i, k] - w[i, j]), cost[i, j] - cost[i, k]
            if gain > 0 and extra <= left:
                heapq.heappush(heap, (-gain / max(extra, 1e-12), i, int(j), k))

    for i in range(n):
        offer(i)
    while heap:
        _, i, j, k = heapq.heappop(heap)
        extra = int(w[i, k] - w[i, j])
        if pick[i] != j or extra > left:
            continue
        pick[i], left = k, left - extra
        offer(i)
    return pick.astype(np.int64)


def allocate(cost, weight, budget: int) -> np.ndarray:
    """``allocate_exact`` when its table fits ``EXACT_CELLS``, else ``allocate_lagrangian``."""
    cost, w, budget = _check(cost, weight, budget)
    g = math.gcd(*[int(x) for x in np.unique(w)]) or 1
    cells = cost.shape[0] * (min(budget, int(w.max(axis=1).sum())) // g + 1)
    return allocate_exact(cost, w, budget) if cells <= EXACT_CELLS else allocate_lagrangian(cost, w, budget)


__all__ = ["AllocationError", "EXACT_CELLS", "allocate", "allocate_exact", "allocate_lagrangian"]
