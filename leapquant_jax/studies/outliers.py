"""The paper's Figure 6: how outlier-heavy a state is, before and after each fix.

For a head's state ``S [dk, dv]`` report peak/median magnitude of ``S``, of the residual
``R = S - K U^T`` after Compensator Tokens, and of the smoothed residual ``C^-1 R`` (each
normalised by its own median), with a three-panel heat map.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..compensators import compensator_matrix, fit_svd, smoothing_scales
from ..recurrence import recurrent_scan


def peak_over_median(x: np.ndarray) -> float:
    """``max|x| / median|x|`` (inf-safe: a zero median gives inf only if the peak is non-zero)."""
    a = np.abs(np.asarray(x, np.float64))
    med = np.median(a)
    return float(a.max() / med) if med > 0 else (0.0 if a.max() == 0 else float("inf"))


@functools.partial(jax.jit, static_argnames=("rank",))
def _panels(s: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    # one compiled program per head shape and rank, which every head of a study reuses
    k_rows, u_rows = fit_svd(s, rank)
    residual = s - compensator_matrix(k_rows, u_rows)
    return residual, residual / smoothing_scales(residual)[:, None]


def outlier_panels(state: jax.Array, rank: int = 4) -> dict[str, np.ndarray]:
    """``{"state", "residual", "smoothed"}`` magnitude maps ``[dk, dv]`` for one head ``state [dk, dv]``."""
    s = jnp.asarray(state, jnp.float32)
    residual, smoothed = _panels(s, rank)
    return {n: np.abs(np.asarray(x)) for n, x in (("state", s), ("residual", residual), ("smoothed", smoothed))}


def final_states(inputs: dict, s0: Optional[np.ndarray] = None) -> np.ndarray:
    """fp32 states after a sequence: inputs ``[1, T, H, ...]`` -> ``[H, dk, dv]``."""
    state = None if s0 is None else jnp.asarray(s0)[None]
    _, final = jax.jit(lambda x, s: recurrent_scan(s, **x))(inputs, state)
    return np.asarray(final[0])


def run_outlier_study(states: np.ndarray, rank: int = 4, head: Optional[int] = None) -> dict:
    """Peak/median per head for ``states [H, dk, dv]``; ``head`` picks the head to detail
    (default: the one whose state is most outlier-heavy)."""
    per_head = []
    for h in range(states.shape[0]):
        panels = outlier_panels(states[h], rank)
        per_head.append({n: peak_over_median(p) for n, p in panels.items()})
    if head is None:
        head = int(np.argmax([r["state"] for r in per_head]))
    if not 0 <= head < states.shape[0]:
        raise ValueError(f"head {head} out of range for {states.shape[0]} heads")
    return {
        "head": head,
        "rank": rank,
        "peak_over_median": per_head[head],
        "mean_over_heads": {n: float(np.mean([r[n] for r in per_head])) for n in per_head[0]},
        "per_head": per_head,
    }


def plot_outliers(state: np.ndarray, rank: int, path: str, title: str = "") -> None:
    """Writes three heat maps of one head's ``state [dk, dv]``: magnitude of the state, of the
    residual after ``rank`` Compensator Tokens and of the smoothed residual, each divided by its
    own median (the colour bars say so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = outlier_panels(state, rank)
    names = {"state": "(a) state S", "residual": f"(b) residual R = S - K U^T after {rank} Compensator Tokens",
             "smoothed": "(c) smoothed residual C^-1 R"}
    symbols = {"state": "S", "residual": "R", "smoothed": "C^-1 R"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, (key, mag) in zip(axes, panels.items()):
        med = np.median(mag)
        im = ax.imshow(mag / (med if med > 0 else 1.0), aspect="auto", cmap="viridis")
        ax.set_title(f"{names[key]}\npeak/median = {peak_over_median(mag):.1f}", fontsize=10)
        ax.set_xlabel("value channel")
        ax.set_ylabel("key channel")
        sym = symbols[key]
        fig.colorbar(im, ax=ax).set_label(f"|{sym}| / median |{sym}|")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["final_states", "outlier_panels", "peak_over_median", "plot_outliers", "run_outlier_study"]
