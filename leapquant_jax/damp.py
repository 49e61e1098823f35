"""DAMP-style decay-aware mixed precision: calibrated key channels in fp16, the rest in INT8 + Hadamard.

DAMP keeps, in every layer and head, the ``K_hi`` key channels (rows of ``S [dk, dv]``) most at
risk in fp16 and stores the other rows with a 9-bit INT8 + Hadamard format; the choice of rows is
made once, offline, from recorded traces (``calibrate``) and saved as a small JSON file
(``DampCalibration.save`` / ``load``). Like every per-step method the state is re-quantized after
every decode token.

Storage of one head (``DampState``), rows permuted so the protected ones come first:

* ``hi``: fp16 ``[B, H, K_hi, dv]``, saturating at +-65504 (an fp32 value beyond it is stored as
  the largest finite fp16, never as an infinity);
* ``lo``: the other ``dk - K_hi`` rows, cut along ``dv`` into groups of ``G = min(32, dv)`` values;
  each group is rotated by the normalized ``G``-point Hadamard matrix, then rounded with an
  asymmetric affine INT8 code (``uint8 [B, H, dk - K_hi, dv]``) under an fp16 ``scale`` and fp16
  ``zero`` per group (``[B, H, dk - K_hi, dv / G]``): ``y = H x``, ``code = round((y - zero) / scale)``
  with ``zero = min y`` and ``scale = (max y - min y) / 255``; dequantize ``x = H (code scale + zero)``.

Bits per state value at ``dk = dv = 128``, ``K_hi = 16``: ``(16 * 16 + 112 * (8 + 2 * 16 / 32)) / 128
= 9.875`` (DAMP's "9.9"). The permutation is per layer and head and shared by every sequence (it is
stored once per model in the calibration file, not in the state).

Calibration (``calibrate``): the fp32 states of the traces every ``every`` tokens give, per layer,
head and key channel ``u``, the INT8 + Hadamard error energy ``E_u = sum over samples and values of
(Q(S) - S)[u, :]^2``; the decays give the persistence ``P_u``: with the geometric-mean retention
``a_u = exp(mean_t g_{t,u})`` (``g`` the log-decay; GDN's is one per head, so ``P`` is too and ``E``
alone orders the channels within a head), ``P_u = sum_{j < tau} a_u^{2j}``, the energy an error
written now keeps over the next ``tau`` tokens (capped at ``tau`` when ``a_u = 1``). The risk is
``C_u = E_u P_u``; the ``K_hi`` largest per head are protected (the same count in every head, so
every head has one layout).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .adapted_formats import hadamard_transform
from .calibration_files import model_mismatches, read_json, write_json
from .per_step import PerStepMethod
from .quantizers import check_state
from .runner import PerStepRunner, check_dense, check_dims
from .state import resolve_key_heads

Array = jax.Array

FP16_MAX = 65504.0
GROUP = 32           # values per INT8 + Hadamard group along dv (DAMP's value-dimension groups)
CODE_MAX = 255       # uint8 codes
DEFAULT_CHANNELS = 16
DEFAULT_TAU = 4096
CALIBRATION_FORMAT = "leapquant-damp-calibration"
CALIBRATION_VERSION = 1


class DampCalibrationError(ValueError):
    """A DAMP calibration file that cannot be read or does not match the model it is used with."""


def group_size(dv: int) -> int:
    """Values per group along ``dv``: ``min(32, dv)``; ``dv`` must be a power of two (the Hadamard)."""
    if dv < 2 or dv & (dv - 1):
        raise ValueError(f"damp rotates groups of values with a Hadamard matrix: dv must be a power of two >= 2, "
                         f"got dv={dv}")
    return min(GROUP, dv)


def _rotate_groups(x: Array) -> Array:
    """The normalized Hadamard transform of every group of ``G`` values along the last axis
    (``[..., rows, dv] -> [..., rows, dv]``); its own inverse."""
    g = group_size(x.shape[-1])
    lead, dv = x.shape[:-1], x.shape[-1]
    y = jnp.swapaxes(x.reshape(lead + (dv // g, g)), -1, -2)          # [..., rows, G, dv/G]
    return jnp.swapaxes(hadamard_transform(y), -1, -2).reshape(lead + (dv,))


@flax.struct.dataclass
class HadamardInt8Tensor:
    """INT8 + Hadamard rows: ``codes`` uint8 ``[..., rows, dv]`` (of the rotated groups), ``scale``
    and ``zero`` fp16 ``[..., rows, dv / G]``."""

    codes: Array
    scale: Array
    zero: Array


def quantize_rows(x: Array) -> HadamardInt8Tensor:
    """``x [..., rows, dv]`` fp32 -> ``HadamardInt8Tensor`` (asymmetric affine per rotated group)."""
    g = group_size(x.shape[-1])
    y = _rotate_groups(x.astype(jnp.float32))
    grouped = y.reshape(y.shape[:-1] + (y.shape[-1] // g, g))
    lo, hi = grouped.min(axis=-1), grouped.max(axis=-1)
    # The stored (fp16) scale and zero are the ones the codes are computed against.
    zero = jnp.clip(lo, -FP16_MAX, FP16_MAX).astype(jnp.float16)
    scale = jnp.minimum((hi - lo) / CODE_MAX, FP16_MAX).astype(jnp.float16)
    s32, z32 = scale.astype(jnp.float32), zero.astype(jnp.float32)
    codes = jnp.round((grouped - z32[..., None]) / jnp.where(s32 > 0, s32, 1.0)[..., None])
    codes = jnp.clip(codes, 0, CODE_MAX).astype(jnp.uint8).reshape(y.shape)
    return HadamardInt8Tensor(codes=codes, scale=scale, zero=zero)


def dequantize_rows(t: HadamardInt8Tensor) -> Array:
    """``HadamardInt8Tensor`` -> fp32 ``[..., rows, dv]``."""
    dv = t.codes.shape[-1]
    g = group_size(dv)
    c = t.codes.astype(jnp.float32).reshape(t.codes.shape[:-1] + (dv // g, g))
    y = c * t.scale.astype(jnp.float32)[..., None] + t.zero.astype(jnp.float32)[..., None]
    return _rotate_groups(y.reshape(t.codes.shape))


@flax.struct.dataclass
class DampState:
    """A DAMP state ``[B, H, dk, dv]``: protected rows ``hi`` fp16 ``[B, H, K_hi, dv]`` and the
    others ``lo`` (``HadamardInt8Tensor``, ``[B, H, dk - K_hi, dv]``), both in the layer's
    calibrated row order."""

    hi: Array
    lo: HadamardInt8Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        b, h, k, dv = self.hi.shape
        return (b, h, k + self.lo.codes.shape[-2], dv)


# ----------------------------------------------------------------------------- calibration file


@dataclasses.dataclass(frozen=True)
class DampCalibration:
    """Which key channels each linear-attention layer and head keeps in fp16.

    ``layers``: layer indices (as the model numbers its layers); ``channels[i][h]``: the sorted
    protected key channels of head ``h`` of layer ``layers[i]`` (``k_hi`` each); ``heads``, ``dk``,
    ``dv``: the head shape; ``model``: the fingerprint of the model it was made on
    (``models.calibrate.model_fingerprint``;
    ``""`` when made from bare traces); ``tau``: the persistence horizon used.
    """

    layers: tuple
    channels: tuple
    heads: int
    dk: int
    dv: int
    k_hi: int
    tau: int = DEFAULT_TAU
    model: str = ""

    def __post_init__(self):
        if len(self.layers) != len(self.channels) or not self.layers:
            raise DampCalibrationError("a DAMP calibration needs one channel table per layer, and at least one layer")
        if not 0 < self.k_hi < self.dk:
            raise DampCalibrationError(f"k_hi must be in [1, dk - 1] = [1, {self.dk - 1}], got {self.k_hi}")
        for layer, table in zip(self.layers, self.channels):
            if len(table) != self.heads:
                raise DampCalibrationError(f"layer {layer}: {len(table)} heads of channels, expected {self.heads}")
            for h, idx in enumerate(table):
                if len(idx) != self.k_hi or len(set(idx)) != self.k_hi or not all(0 <= i < self.dk for i in idx):
                    raise DampCalibrationError(f"layer {layer} head {h}: channels must be {self.k_hi} distinct "
                                               f"indices in [0, {self.dk}), got {list(idx)}")

    def table(self, layer: int) -> tuple:
        """The per-head protected channels of ``layer``; ``DampCalibrationError`` if it has none."""
        try:
            return self.channels[self.layers.index(layer)]
        except ValueError:
            raise DampCalibrationError(f"the DAMP calibration has no layer {layer} (it covers linear-attention "
                                       f"layers {list(self.layers)}): it was made for another model") from None

    def check_model(self, *, fingerprint: str, layers, heads: int, dk: int, dv: int, source: str = "calibration") -> None:
        """Raises ``DampCalibrationError`` naming ``source`` and what differs when this calibration
        was not made for the model described (its fingerprint, linear layers and head shape)."""
        problems = model_mismatches(self, fingerprint=fingerprint, layers=layers, heads=heads, dk=dk, dv=dv)
        if problems:
            raise DampCalibrationError(f"DAMP {source} does not match this model: " + "; ".join(problems))

    def to_json(self, extra: Optional[dict] = None) -> dict:
        """The file's content (``extra``: the scores and how the calibration was made)."""
        out = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "model": self.model,
               "heads": self.heads, "dk": self.dk, "dv": self.dv, "k_hi": self.k_hi, "tau": self.tau,
               "layers": {str(layer): [list(map(int, c)) for c in table]
                          for layer, table in zip(self.layers, self.channels)}}
        if extra:
            out["calibration"] = extra
        return out

    def save(self, path: str, extra: Optional[dict] = None) -> None:
        """Writes the JSON file at ``path`` atomically (a temporary file renamed over it)."""
        write_json(path, self.to_json(extra))

    @classmethod
    def load(cls, path: str) -> "DampCalibration":
        """Reads a file written by ``save``; ``DampCalibrationError`` naming ``path`` if it is not one."""
        d = read_json(path, what="DAMP calibration", fmt=CALIBRATION_FORMAT, version=CALIBRATION_VERSION,
                      error=DampCalibrationError)
        try:
            layers = sorted(d["layers"], key=int)
            return cls(layers=tuple(int(x) for x in layers),
                       channels=tuple(tuple(tuple(int(i) for i in c) for c in d["layers"][x]) for x in layers),
                       heads=int(d["heads"]), dk=int(d["dk"]), dv=int(d["dv"]), k_hi=int(d["k_hi"]),
                       tau=int(d["tau"]), model=str(d.get("model", "")))
        except DampCalibrationError as err:
            raise DampCalibrationError(f"DAMP calibration {path}: {err}") from None
        except (KeyError, TypeError, ValueError) as err:
            raise DampCalibrationError(f"DAMP calibration {path}: malformed ({type(err).__name__}: {err})") from None


def persistence(mean_log_decay: np.ndarray, tau: int) -> np.ndarray:
    """``P = sum_{j < tau} a^{2j}`` with ``a = exp(mean_log_decay)`` (``<= 0``), elementwise, in float64
    without forming powers that underflow: ``expm1(2 tau m) / expm1(2 m)``, ``tau`` where ``m = 0``."""
    m = np.minimum(np.asarray(mean_log_decay, np.float64), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.expm1(2 * tau * m) / np.expm1(2 * m)
    return np.where(m < -1e-12, p, float(tau))


def channel_scores(states: np.ndarray, g: np.ndarray, tau: int) -> dict:
    """The risk scores of one layer.

    states ``[N, H, dk, dv]``: fp32 calibration states; g: the log-decays of the tokens, ``[M, H]``
    (GDN) or ``[M, H, dk]`` (KDA). Returns ``{"energy", "persistence", "risk"}``, each ``[H, dk]``
    float64 (``risk = energy * persistence``).
    """
    s = jnp.asarray(states, jnp.float32)
    err = dequantize_rows(quantize_rows(s)) - s
    energy = np.asarray(jnp.sum(jnp.square(err), axis=(0, -1)), np.float64)            # [H, dk]
    m = np.asarray(g, np.float64).mean(axis=0)                                           # [H] or [H, dk]
    p = persistence(m, tau)
    p = np.broadcast_to(p[:, None] if p.ndim == 1 else p, energy.shape)
    return {"energy": energy, "persistence": np.array(p), "risk": energy * p}


def select_channels(risk: np.ndarray, k_hi: int) -> tuple:
    """The ``k_hi`` largest-risk channels of every head (``risk [H, dk]``), each sorted ascending
    (ties: the lower index first)."""
    order = np.argsort(-risk, axis=-1, kind="stable")[:, :k_hi]
    return tuple(tuple(int(i) for i in sorted(row)) for row in order)


def calibrate(traces: dict, *, k_hi: int = DEFAULT_CHANNELS, tau: int = DEFAULT_TAU, every: int = 8,
              model: str = "") -> tuple[DampCalibration, dict]:
    """Calibrates DAMP on recorded fp32 inputs.

    traces: ``{layer: {"q", "k", "v", "g", "beta": [B, T, ...]}}`` (a model's ``record=True``
    output); the fp32 state after every ``every`` tokens of each row is a calibration sample.
    Returns ``(calibration, scores)``, ``scores = {layer: {"energy", "persistence", "risk": [H, dk]
    lists}}`` for the file.
    """
    if not traces:
        raise ValueError("damp calibration needs the traces of at least one linear-attention layer")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive integer, got {every!r}")
    layers = sorted(traces)
    first = traces[layers[0]]
    b, t, heads, dv = first["v"].shape
    dk = first["k"].shape[-1]
    if not 0 < k_hi < dk:
        raise ValueError(f"damp: the protected channels per head must be in [1, dk - 1] = [1, {dk - 1}], got {k_hi}")
    if t < every:
        raise ValueError(f"damp calibration: rows of {t} tokens give no sample every {every} tokens")
    tables, scores = [], {}
    for layer in layers:
        samples = state_samples(traces[layer], every)                                     # [S * B, H, dk, dv]
        g = np.asarray(traces[layer]["g"], np.float32).reshape((b * t,) + traces[layer]["g"].shape[2:])
        sc = channel_scores(samples, g, tau)
        tables.append(select_channels(sc["risk"], k_hi))
        scores[str(layer)] = {k: [[float(f"{x:.7g}") for x in row] for row in v] for k, v in sc.items()}
    cal = DampCalibration(layers=tuple(int(x) for x in layers), channels=tuple(tables), heads=heads, dk=dk, dv=dv,
                          k_hi=k_hi, tau=tau, model=model)
    return cal, scores


def state_samples(inputs: dict, every: int) -> np.ndarray:
    """The exact fp32 states ``[S * B, H, dk, dv]`` after every ``every`` tokens of each row of one
    layer's inputs ``{"q", "k", "v", "g", "beta": [B, T, ...]}`` (``S = T // every``; the tokens past
    the last multiple of ``every`` give none), sample-major: sample ``s`` of row ``b`` is ``s * B + b``."""
    x = {n: jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")}
    b, t, heads, dv = x["v"].shape
    dk = x["k"].shape[-1]
    if t < every:
        raise ValueError(f"rows of {t} tokens give no state sample every {every} tokens")
    blocks = {n: jnp.moveaxis(a[:, :t // every * every].reshape((b, t // every, every) + a.shape[2:]), 1, 0)
              for n, a in x.items()}
    samples = _fp32_samples(PerStepMethod("fp32").init(b, heads, dk, dv), blocks)        # [S, B, H, dk, dv]
    return np.asarray(samples).reshape((-1, heads, dk, dv))


@jax.jit
def _fp32_samples(state, blocks):
    # blocks {name: [S, B, every, ...]} -> the exact state after each block, [S, B, H, dk, dv].
    fp32 = PerStepMethod("fp32")

    def body(s, xs):
        _, s = fp32.decode(s, **xs)
        return s, fp32.to_dense(s)

    return jax.lax.scan(body, state, blocks)[1]


# ----------------------------------------------------------------------------- the method


def _permutation(table: tuple, dk: int) -> tuple[np.ndarray, np.ndarray]:
    """``perm [H, dk]`` (protected rows first, then the rest, each ascending) and its inverse."""
    perm = np.stack([np.concatenate([np.asarray(idx, np.int32),
                                     np.asarray([i for i in range(dk) if i not in set(idx)], np.int32)])
                     for idx in table])
    return perm, np.argsort(perm, axis=-1).astype(np.int32)


def _take_rows(x: Array, index: np.ndarray) -> Array:
    """``x [B, H, dk, dv]`` with the rows of head ``h`` taken in the order ``index[h]`` (``[H, dk]``)."""
    return jnp.take_along_axis(x, jnp.asarray(index)[None, :, :, None], axis=-2)


@dataclasses.dataclass(frozen=True)
class DampMethod(PerStepRunner):
    """``damp``: per-step DAMP state (module docstring) with a ``DampCalibration``.

    The protected channels differ between layers, so the method is specialised to a layer with
    ``for_layer(i)`` (the models and the replays do this); ``init`` and the memory accounting need
    neither the calibration nor the layer, every rounding needs both. Without a calibration,
    ``layout_k_hi`` gives the layout alone (for ``leapquant memory``).
    """

    calibration: Optional[DampCalibration] = None
    layer: Optional[int] = None
    layout_k_hi: int = DEFAULT_CHANNELS

    @property
    def k_hi(self) -> int:
        """Protected key channels per head (the calibration's, else ``layout_k_hi``)."""
        return self.layout_k_hi if self.calibration is None else self.calibration.k_hi

    @property
    def name(self) -> str:
        return "damp"

    def for_layer(self, layer: int) -> "DampMethod":
        """This method specialised to model layer ``layer`` (its calibrated channels; a layer the
        calibration does not cover is refused when a state of it is rounded)."""
        return dataclasses.replace(self, layer=int(layer))

    def _table(self, heads: int, dk: int, dv: int) -> tuple:
        if self.calibration is None:
            raise DampCalibrationError("method 'damp' needs a calibration file (`leapquant calibrate-damp`; pass "
                                       "it with --damp-calibration, or make_method('damp', calibration=...))")
        if self.layer is None:
            raise DampCalibrationError("method 'damp' keeps different channels per layer: specialise it with "
                                       "method.for_layer(layer) before rounding a state")
        cal = self.calibration
        if (cal.heads, cal.dk, cal.dv) != (heads, dk, dv):
            raise DampCalibrationError(f"the DAMP calibration is for heads x dk x dv = {cal.heads} x {cal.dk} x "
                                       f"{cal.dv}, but layer {self.layer}'s state is {heads} x {dk} x {dv}")
        return cal.table(self.layer)

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False, *,
             key_heads: Optional[int] = None) -> DampState:
        """A zero state ``[batch, heads, dk, dv]`` (``key_heads`` is checked; the state keeps no keys)."""
        check_dims(batch, heads, dk, dv)
        resolve_key_heads(heads, key_heads)
        if not 0 < self.k_hi < dk:
            raise ValueError(f"damp protects {self.k_hi} key channels per head, which needs dk > {self.k_hi}, got dk={dk}")
        g = group_size(dv)
        rows = dk - self.k_hi
        return DampState(hi=jnp.zeros((batch, heads, self.k_hi, dv), jnp.float16),
                         lo=HadamardInt8Tensor(codes=jnp.zeros((batch, heads, rows, dv), jnp.uint8),
                                               scale=jnp.zeros((batch, heads, rows, dv // g), jnp.float16),
                                               zero=jnp.zeros((batch, heads, rows, dv // g), jnp.float16)))

    def from_dense(self, state: Array, *, per_channel_decay: bool = False,
                   key_heads: Optional[int] = None) -> DampState:
        """Rounds ``[B, H, dk, dv]`` fp32 into the layer's DAMP layout."""
        _, h, dk, dv = check_dense(state)
        check_state(state)
        perm, _ = _permutation(self._table(h, dk, dv), dk)
        x = _take_rows(state.astype(jnp.float32), perm)
        return DampState(hi=jnp.clip(x[..., :self.k_hi, :], -FP16_MAX, FP16_MAX).astype(jnp.float16),
                         lo=quantize_rows(x[..., self.k_hi:, :]))

    def to_dense(self, state: DampState) -> Array:
        """``[B, H, dk, dv]`` fp32 in the model's row order."""
        _, h, dk, dv = state.shape
        _, inverse = _permutation(self._table(h, dk, dv), dk)
        x = jnp.concatenate([state.hi.astype(jnp.float32), dequantize_rows(state.lo)], axis=-2)
        return _take_rows(x, inverse)



def bits_per_value(dk: int, dv: int, k_hi: int = DEFAULT_CHANNELS) -> float:
    """The layout's bits per state value (``9.875`` at ``dk = dv = 128``, ``k_hi = 16``)."""
    g = group_size(dv)
    return (k_hi * dv * 16 + (dk - k_hi) * (dv * 8 + (dv // g) * 32)) / (dk * dv)


__all__ = ["CALIBRATION_FORMAT", "DEFAULT_CHANNELS", "DEFAULT_TAU", "DampCalibration", "DampCalibrationError",
           "DampMethod", "DampState", "HadamardInt8Tensor", "bits_per_value", "calibrate", "channel_scores",
           "dequantize_rows", "persistence", "quantize_rows", "select_channels", "state_samples"]
