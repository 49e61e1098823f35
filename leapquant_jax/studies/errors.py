"""The paper's Figure 3 in miniature: relative state error against decoded tokens.

Every method decodes the same synthetic long-memory heads (vmapped over seeds, batched
over heads) and is compared with the fp32 trajectory every ``every`` tokens:
``||S_method - S_fp32||_F / ||S_fp32||_F`` per head, averaged over heads and seeds, and the
relative output error ``||o_method - o_fp32|| / ||o_fp32||`` over all tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..methods import make_method
from ..synthetic import SyntheticSpec, synthetic_batch

# Study label -> (method name, options). Labels follow DESIGN §5, with -b6/-b4 for LeapQuant
# at 6 and 4 bits and the two partial fixes on top of int8-w.
STUDY_METHODS: dict[str, tuple[str, dict]] = {
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {}),
    "fp8": ("fp8", {}),
    "int8": ("int8", {}),
    "bf16-w": ("bf16-w", {}),
    "int8-w": ("int8-w", {}),
    "int8-w+ct": ("leapquant", dict(bits=8, smoothing=False)),
    "int8-w+smooth": ("leapquant", dict(bits=8, compensators=False)),
    "leapquant": ("leapquant", dict(bits=8)),
    "leapquant-b6": ("leapquant", dict(bits=6)),
    "leapquant-b4": ("leapquant", dict(bits=4)),
}


@dataclasses.dataclass(frozen=True)
class ErrorStudyConfig:
    """tokens, heads, seeds, dk, dv: problem size; every: tokens between measurements;
    window: LeapQuant window for the windowed methods; kda: per-channel decays."""

    tokens: int = 4096
    heads: int = 4
    seeds: int = 2
    dk: int = 128
    dv: int = 128
    every: int = 128
    window: int = 16
    kda: bool = False

    def __post_init__(self):
        if self.tokens % self.every:
            raise ValueError(f"tokens ({self.tokens}) must be a multiple of every ({self.every})")
        if self.every % self.window:
            raise ValueError(f"every ({self.every}) must be a multiple of the window ({self.window})")


def build_method(label: str, window: int):
    """The state method behind a study label."""
    if label not in STUDY_METHODS:
        raise ValueError(f"unknown study method {label!r}; known: {', '.join(STUDY_METHODS)}")
    name, opts = STUDY_METHODS[label]
    if name in ("bf16-w", "int8-w", "leapquant"):
        opts = dict(opts, window=window)
    return make_method(name, **opts)


def trajectory(method, inputs: dict, every: int):
    """Decodes ``inputs`` (``[B, T, H, ...]``) from a zero state.

    Returns ``(o [B, T, H, dv], states [T/every, B, H, dk, dv])``, the dense state after every
    ``every`` tokens.
    """
    b, t, h, dv = inputs["v"].shape
    dk = inputs["k"].shape[-1]
    chunks = {n: jnp.moveaxis(x.reshape((b, t // every, every) + x.shape[2:]), 1, 0) for n, x in inputs.items()}

    def body(state, xs):
        o, state = method.decode(state, **xs)
        return state, (o, method.to_dense(state))

    state0 = method.init(b, h, dk, dv, per_channel_decay=inputs["g"].ndim == 4)
    _, (o, states) = jax.lax.scan(body, state0, chunks)
    return jnp.moveaxis(o, 0, 1).reshape(b, t, h, dv), states


def relative_errors(states: jax.Array, ref_states: jax.Array, o: jax.Array, ref_o: jax.Array) -> tuple[np.ndarray, float]:
    """Per-measurement state error averaged over heads ``[T/every]`` and the overall output error."""
    num = jnp.linalg.norm((states - ref_states).reshape(states.shape[:3] + (-1,)), axis=-1)
    den = jnp.linalg.norm(ref_states.reshape(ref_states.shape[:3] + (-1,)), axis=-1)
    per_head = num / jnp.maximum(den, 1e-30)
    out_err = jnp.linalg.norm(o - ref_o) / jnp.maximum(jnp.linalg.norm(ref_o), 1e-30)
    return np.asarray(jnp.mean(per_head, axis=(1, 2))), float(out_err)


def run_error_study(
    config: ErrorStudyConfig,
    methods: Optional[list[str]] = None,
    progress: Optional[Callable] = None,
) -> dict:
    """Runs the study. Returns a JSON-ready dict with ``tokens`` (measurement points), ``methods``
    (label -> ``final_rel_state_error``, ``rel_output_error``, ``rel_state_error`` curve) and the config."""
    methods = list(STUDY_METHODS) if methods is None else methods
    spec = SyntheticSpec(tokens=config.tokens, heads=config.heads, dk=config.dk, dv=config.dv, per_channel_decay=config.kda)
    inputs = synthetic_batch(0, config.seeds, spec)
    run = jax.jit(trajectory, static_argnums=(0, 2))
    ref_o, ref_states = run(build_method("fp32", config.window), inputs, config.every)
    results = {}
    iterator = progress(methods) if progress else methods
    for label in iterator:
        o, states = run(build_method(label, config.window), inputs, config.every)
        curve, out_err = relative_errors(states, ref_states, o, ref_o)
        results[label] = {
            "final_rel_state_error": float(curve[-1]),
            "rel_output_error": out_err,
            "rel_state_error": [float(x) for x in curve],
        }
    return {
        "tokens": list(range(config.every, config.tokens + 1, config.every)),
        "config": dataclasses.asdict(config),
        "methods": results,
    }


def plot_error_study(result: dict, path: str) -> None:
    """Writes the error curves (log scale) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, r in result["methods"].items():
        if label == "fp32":
            continue
        style = "-" if label.startswith("leapquant") else ("--" if label.endswith("-w") or "+" in label else ":")
        ax.plot(result["tokens"], np.maximum(r["rel_state_error"], 1e-12), style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("decoded tokens")
    ax.set_ylabel("relative state error vs fp32")
    kind = "KDA" if result["config"]["kda"] else "GDN"
    ax.set_title(f"State error on synthetic long-memory {kind} heads")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["ErrorStudyConfig", "STUDY_METHODS", "build_method", "plot_error_study", "relative_errors", "run_error_study", "trajectory"]
