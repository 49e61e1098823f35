"""The paper's Figure 3 in miniature: relative state error against decoded tokens.

Every method decodes the same synthetic long-memory heads (vmapped over seeds, batched
over heads) and is compared with the fp32 trajectory every ``every`` tokens:
``||S_method - S_fp32||_F / ||S_fp32||_F`` per head, averaged over heads and seeds, and the
relative output error ``||o_method - o_fp32|| / ||o_fp32||`` over all tokens. Each method's
error sits next to what its state costs: bytes per state element, measured on the method's own
state pytree (for windowed methods both the window-boundary checkpoint and the live stream with
its window buffer).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import check_positive
from ..damp import DampMethod, calibrate
from ..method_names import METHOD_LABELS, STUDY_METHODS
from ..methods import WINDOWED_METHODS, make_method
from ..quantizers import tree_bytes
from ..synthetic import HeadBatchSize, SyntheticSpec, synthetic_batch
from .memory import boundary_state, state_shapes

# The studies' lineup (``STUDY_METHODS``, the default of `study errors`) and every label the
# studies and `eval` accept (``ALL_METHODS``): the one table of ``method_names``.
ALL_METHODS = METHOD_LABELS


@dataclasses.dataclass(frozen=True)
class ErrorStudyConfig(HeadBatchSize):
    """The error study's settings: ``seeds`` head batches of one size (``HeadBatchSize``)."""

    seeds: int = 2
    every: int = 128  # tokens between measurements
    window: int = 16  # LeapQuant window p of the windowed methods
    kda: bool = False  # per-channel decays (KDA) instead of scalar ones (GDN)

    def __post_init__(self):
        for name in ("tokens", "heads", "seeds", "dk", "dv", "every", "window"):
            check_positive(name, getattr(self, name))
        if self.tokens % self.every:
            raise ValueError(f"tokens ({self.tokens}) must be a multiple of every ({self.every})")
        if self.every % self.window:
            raise ValueError(f"every ({self.every}) must be a multiple of the window ({self.window})")

    @property
    def mode(self) -> str:
        """``"KDA"`` (per-channel decays) or ``"GDN"`` (scalar decays)."""
        return "KDA" if self.kda else "GDN"

    def describe(self) -> str:
        """One line naming every setting of the run (for titles and printed tables)."""
        return (f"{self.mode}: tokens={self.tokens}, heads={self.heads}, seeds={self.seeds}, dk={self.dk}, "
                f"dv={self.dv}, window={self.window}, error measured every {self.every} tokens")


def build_method(label: str, window: int):
    """The state method behind a study label (a key of ``ALL_METHODS``)."""
    if label not in ALL_METHODS:
        raise ValueError(f"unknown study method {label!r}; known: {', '.join(ALL_METHODS)}")
    name, opts = ALL_METHODS[label]
    if name in WINDOWED_METHODS:
        opts = dict(opts, window=window)
    return make_method(name, **opts)


# The synthetic draw DAMP is calibrated on: independent of the study's (seed 0).
DAMP_CALIBRATION_SEED = 1


def damp_for_study(config, spec):
    """``damp`` for the synthetic heads: calibrated (``damp.calibrate``, every 8 tokens) on an
    independent draw of the same spec (seed ``DAMP_CALIBRATION_SEED``, the study's first 256 tokens
    at most) as one layer, ``K_hi = dk / 8`` key channels per head (DAMP's 16 of 128)."""
    cal_spec = dataclasses.replace(spec, tokens=min(spec.tokens, 256))
    x = {k: np.asarray(v) for k, v in synthetic_batch(DAMP_CALIBRATION_SEED, config.seeds, cal_spec).items()}
    cal, _ = calibrate({0: x}, k_hi=max(1, config.dk // 8), every=8)
    return DampMethod(calibration=cal).for_layer(0)


def state_bytes_per_element(method, heads: int, dk: int, dv: int, kda: bool,
                            key_heads: int | None = None) -> dict[str, float]:
    """Bytes per state element of ``method``'s own state pytree for ``heads`` heads of ``[dk, dv]``
    (``key_heads`` key heads with GVA; ``None``: ``heads``).

    ``live``: everything a decoding stream holds (for windowed methods the checkpoint, the
    window buffer and the stream's window position, shared by its heads, and key records shared
    by the value heads of a key head); ``checkpoint``: the window-boundary checkpoint alone (for
    per-step methods the state itself).
    """
    # a method calibrated per layer: the mean over the layers of its calibration
    layers = getattr(getattr(method, "calibration", None), "layers", None) or (None,)
    shapes = [state_shapes(method if x is None else method.for_layer(x), heads, dk, dv, kda, key_heads)
              for x in layers]
    elems = heads * dk * dv * len(shapes)
    return {"live": tree_bytes(shapes) / elems, "checkpoint": tree_bytes([boundary_state(s) for s in shapes]) / elems}


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
    (label -> ``final_rel_state_error``, ``rel_output_error``, ``rel_state_error`` curve,
    ``bytes_per_element`` (live stream), ``checkpoint_bytes_per_element``, ``windowed``), the
    ``config`` (with ``mode`` GDN/KDA), its one-line ``description`` and the ``reference``
    (fp32, error 0 by definition)."""
    methods = list(STUDY_METHODS) if methods is None else list(methods)
    if not methods:
        raise ValueError("methods: give at least one study method")
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"methods: unknown study method(s) {', '.join(map(repr, unknown))}; known: {', '.join(ALL_METHODS)}")
    spec = SyntheticSpec(tokens=config.tokens, heads=config.heads, dk=config.dk, dv=config.dv, per_channel_decay=config.kda)
    inputs = synthetic_batch(0, config.seeds, spec)
    run = jax.jit(trajectory, static_argnums=(0, 2))
    ref_o, ref_states = run(build_method("fp32", config.window), inputs, config.every)
    results = {}
    iterator = progress(methods) if progress else methods
    for label in iterator:
        method = damp_for_study(config, spec) if label == "damp" else build_method(label, config.window)
        o, states = run(method, inputs, config.every)
        curve, out_err = relative_errors(states, ref_states, o, ref_o)
        nbytes = state_bytes_per_element(method, config.heads, config.dk, config.dv, config.kda)
        # A per-step format whose rounding noise grows with the state can diverge until fp32
        # overflows: said so, with where, and the non-finite numbers left out (null in JSON).
        bad = ~np.isfinite(curve)
        finite = lambda x: float(x) if np.isfinite(x) else None       # noqa: E731
        results[label] = {
            "final_rel_state_error": finite(curve[-1]),
            "rel_output_error": finite(out_err),
            "bytes_per_element": nbytes["live"],
            "checkpoint_bytes_per_element": nbytes["checkpoint"],
            "windowed": ALL_METHODS[label][0] in WINDOWED_METHODS,
            "rel_state_error": [finite(x) for x in curve],
            "diverged_by_token": int(config.every * (np.argmax(bad) + 1)) if bad.any() else None,
        }
    return {
        "tokens": list(range(config.every, config.tokens + 1, config.every)),
        "config": dataclasses.asdict(config) | {"mode": config.mode},
        "description": config.describe(),
        "reference": "fp32",
        "methods": results,
    }


# Line style by family: per-step, per-window without fixes, one fix, LeapQuant.
_FAMILY_STYLE = {"per-step": (":", "o"), "per-window": ("--", "s"), "one fix": ("-.", "^"), "leapquant": ("-", "D")}


def _family(label: str) -> str:
    if label.startswith("leapquant"):
        return "leapquant"
    if "+" in label:
        return "one fix"
    return "per-window" if label.endswith("-w") else "per-step"


def method_styles(labels: list[str]) -> dict[str, dict]:
    """Plot style per study label, the same in every figure of the project: ``{label: {"color",
    "linestyle", "marker", "linewidth"}}``. The line style and marker follow the family (per
    step, per window, one fix, LeapQuant); the colour (tab10 and black) is fixed by the label's
    place in ``STUDY_METHODS`` so a subset keeps its colours, black for LeapQuant at 8 bits."""
    import matplotlib

    tab10 = matplotlib.colormaps["tab10"].colors
    palette = [tab10[i] for i in (0, 1, 8, 3, 4, 5, 6, 7)] + [(0.0, 0.0, 0.0), tab10[2], tab10[9]]
    # the rival formats cycle through tab20b after the lineup's own colours
    palette += list(matplotlib.colormaps["tab20b"].colors) * (1 + len(ALL_METHODS) // 20)
    order = [m for m in ALL_METHODS if m != "fp32"]
    out = {}
    for label in labels:
        style, marker = _FAMILY_STYLE[_family(label)]
        out[label] = dict(color=palette[order.index(label)], linestyle=style, marker=marker,
                          linewidth=2.2 if _family(label) == "leapquant" else 1.5)
    return out


def _bytes_text(r: dict) -> str:
    if r["windowed"]:
        return f"{r['checkpoint_bytes_per_element']:.2f} ckpt / {r['bytes_per_element']:.2f} live B/el"
    return f"{r['bytes_per_element']:.2f} B/el"


def plot_error_study(result: dict, path: str) -> None:
    """Writes a PNG: (left) relative state error against decoded tokens, log scale; (right) each
    method's final error against its bytes per state element. The legend sits below both panels;
    fp32 is the reference (error 0) and is marked as such rather than drawn on the log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    labels = [m for m in result["methods"] if m != "fp32"]
    styles = method_styles(labels)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 6.2), gridspec_kw=dict(width_ratios=(1.35, 1)))
    handles = []
    for label in labels:
        r = result["methods"][label]
        st = styles[label]
        colour, marker = st["color"], st["marker"]
        curve = np.asarray(r["rel_state_error"], dtype=float)        # null (diverged) -> nan: a gap
        (line,) = ax.plot(result["tokens"], np.maximum(curve, 1e-12), linestyle=st["linestyle"],
                          color=st["color"], linewidth=st["linewidth"], label=f"{label}  ({_bytes_text(r)})")
        handles.append(line)
        if r["final_rel_state_error"] is None:       # diverged: no final error to place
            continue
        err = max(r["final_rel_state_error"], 1e-12)
        if r["windowed"]:
            # A windowed method holds between a bare checkpoint and a full window buffer per stream.
            bx.plot([r["checkpoint_bytes_per_element"], r["bytes_per_element"]], [err, err], "-",
                    color=colour, linewidth=1, alpha=0.7)
            bx.plot(r["checkpoint_bytes_per_element"], err, marker, color=colour, markerfacecolor="none", markersize=8)
        bx.plot(r["bytes_per_element"], err, marker, color=colour, markersize=8)
        # Windowed labels sit left of the checkpoint marker, per-step ones right of theirs: fewer overlaps.
        at, offset, align = ((r["checkpoint_bytes_per_element"], -7, "right") if r["windowed"]
                             else (r["bytes_per_element"], 7, "left"))
        bx.annotate(label, (at, err), textcoords="offset points", xytext=(offset, 0), ha=align, va="center",
                    fontsize=7, color=colour)
    fp32_bytes = 4.0 if "fp32" not in result["methods"] else result["methods"]["fp32"]["bytes_per_element"]
    bx.axvline(fp32_bytes, color="0.5", linestyle=(0, (1, 3)), linewidth=1.2)
    bx.annotate(f"fp32 reference\n(error 0, {fp32_bytes:.0f} B/el)", (fp32_bytes, 0.5), xycoords=("data", "axes fraction"),
                textcoords="offset points", xytext=(-4, 0), ha="right", fontsize=8, color="0.35")
    handles.append(Line2D([], [], color="0.5", linestyle=(0, (1, 3)),
                          label=f"fp32: the reference, error 0 by definition ({fp32_bytes:.2f} B/el)"))
    handles += [Line2D([], [], color="0.3", marker="D", linestyle="none", label="final error at live-stream bytes"),
                Line2D([], [], color="0.3", marker="D", markerfacecolor="none", linestyle="none",
                       label="same error at checkpoint bytes (windowed)")]

    ax.set_yscale("log")
    ax.set_xlabel("decoded tokens")
    ax.set_ylabel(r"relative state error  $\|S - S_{fp32}\|_F\, /\, \|S_{fp32}\|_F$")
    ax.set_title("error along the sequence", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    bx.set_yscale("log")
    bx.set_xlabel("bytes per state element (4 = fp32)")
    bx.set_ylabel(f"final relative state error (token {result['tokens'][-1]})")
    bx.set_title("final error against state size", fontsize=10)
    bx.grid(True, which="both", alpha=0.3)
    bx.set_xlim(0, max(4.4, fp32_bytes * 1.1))

    fig.suptitle(f"State error on synthetic long-memory heads\n{result['description']}", fontsize=11)
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False,
               title="method  (bytes per state element: per-step state, or windowed checkpoint / live stream with its window buffer)",
               title_fontsize=8)
    rows = (len(handles) + 2) // 3
    fig.tight_layout(rect=(0, 0.03 * rows + 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_error_table(result: dict) -> str:
    """The study as a printed table: configuration line, then one row per method."""
    rows = [f"state error on synthetic long-memory heads: {result['description']}",
            f"reference: {result['reference']} (error 0 by definition)",
            f"{'method':<16}{'B/el ckpt':>11}{'B/el live':>11}{'final rel. state err':>22}{'rel. output err':>18}"]
    for name, r in result["methods"].items():
        head = f"{name:<16}{r['checkpoint_bytes_per_element']:>11.3f}{r['bytes_per_element']:>11.3f}"
        if r.get("diverged_by_token") is not None:
            rows.append(head + f"   diverged: the state overflowed fp32 by token {r['diverged_by_token']}")
            continue
        rows.append(head + f"{r['final_rel_state_error']:>22.3e}{r['rel_output_error']:>18.3e}")
    rows.append("B/el: bytes per state element, measured on the method's state pytree; ckpt = window-boundary "
                "checkpoint, live = a decoding stream including its window buffer (equal for per-step methods)")
    return "\n".join(rows)


__all__ = [
    "ALL_METHODS",
    "ErrorStudyConfig",
    "STUDY_METHODS",
    "build_method",
    "format_error_table",
    "method_styles",
    "plot_error_study",
    "relative_errors",
    "run_error_study",
    "state_bytes_per_element",
    "trajectory",
]
