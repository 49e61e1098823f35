"""STEPQuant (``stepquant-6``, ``stepquant-4``): a per-step state with calibrated widths per key row
and key-row-aware dual-axis scaling (arXiv 2609.38169, written here from its description).

*When* (``stepquant_plan``): every unit (a head for GDN, a key row for KDA) gets a width from the
candidates ({4, 6, 8} at a budget of 6 bits, {2, 4, 6, 8} below) or 16, an fp16 *pivot*, minimising
the summed calibration error times lifetime (``lifetime``) over all layers at once: GDN by exact
dynamic programming over heads, KDA by a Lagrangian with repair (``bit_allocation``). The pivots
are the units of largest risk (GDN: the cost at the first allocation; KDA: what fp16 saves over 8
bits). The budget is nominal, a pivot counted as 8 bits: the method's own accounting; the bytes
the state holds are those of its pytree (``quantizers.tree_bytes``).

*Where*: a head's state ``x [dk, dv]`` is stored as ``r_i c_j n_i z_ij``:
* row factors ``r_i = sqrt(mean_j |x_ij| / w_i)`` in fp16, ``w`` the calibrated impact weights
  (``impact_weights``: ``lifetime.row_impact`` tempered by ``gamma / 2 = 1/8`` in log space,
  geometric mean 1 per head): a row that moves the read-out more gets a finer grid. GDN heads at 2
  bits keep one factor per row and group of ``G = min(32, dv)`` values;
* column scales ``c_j`` in fp16, one per head and value column: the largest ``|x_ij| / r_i`` over the
  head's integer rows mapped to the code range, then one least-squares refit weighted by ``w_i^2``;
* codes ``z = round(x / (r c n))`` in ``[-qmax, qmax]``, ``qmax = 2^(b-1) - 1``. KDA rows of one head
  share the column scales whatever their width, so a ``b``-bit row steps ``n = 2^(8-b)`` on the 8-bit
  grid; GDN's 2-bit codes are ``{-3, -1, 1, 3}`` (``n = 1``).
Pivot rows are fp16 (saturating at +-65504); every scale is fitted against its fp16 value.

State of one layer (``StepQuantState``), rows ``h dk + i`` gathered per width in a static order
from the plan: ``codes``, per width present (8, 6, 4, 2) ``[B, packed(dv), rows]`` packed along
``dv`` (``quantizers.pack_codes``; four 2-bit codes a byte, planar); ``rows`` fp16 ``[B, rows]``;
``groups`` fp16 ``[B, rows, dv / G]`` (GDN's 2-bit rows); ``columns`` fp16 ``[B, heads, dv]`` (heads
with an integer row); ``pivots`` fp16 ``[B, rows, dv]``. Re-rounded after every token like every
per-step method; the plan differs per layer (``for_layer``). Without a calibration a method has
the layout of its budget on every row (for ``leapquant memory``) and refuses to round.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .bit_allocation import allocate_exact, allocate_lagrangian
from .lifetime import (IMPACT_FLOOR, LayerStatistics, LifetimeCalibration, PlanMethod, StepQuantPlan, as_calibration,
                       significant)
from .quantizers import pack_codes, unpack_codes
from .runner import PerStepRunner, check_dense, check_dims
from .state import resolve_key_heads

Array = jax.Array

FP16_MAX = 65504.0
FP16_TINY = 2.0 ** -24       # the least positive fp16: scales never round to 0
PIVOT = 16
WIDTHS = (8, 6, 4, 2)        # integer widths, in the order the state keeps them
GROUP = 32                   # values per row factor of GDN's 2-bit rows
GAMMA = 0.25                 # tempering of the impact weights (log-space exponent gamma / 2)
# Pivots as a share of the units: about what the method's own calibration keeps in fp16 on its
# large models (32 GDN heads, 512 KDA key rows), as a share so that it scales with the model.
PIVOT_SHARE = {"gdn": 0.015, "kda": 0.006}
NAMES = {"stepquant-6": 6, "stepquant-4": 4}
IMPACT_DIGITS = 6            # significant digits of the impact weights a plan keeps (fp32 has about 7)


def candidates_for(budget: float) -> tuple:
    """The integer widths a budget allocates: (4, 6, 8) from 6 bits, (2, 4, 6, 8) below."""
    return (4, 6, 8) if budget >= 6 else (2, 4, 6, 8)


def impact_weights(impact: np.ndarray, gamma: float = GAMMA) -> np.ndarray:
    """``[H, dk]`` row weights ``exp(gamma / 2 (log w - mean_i log w))`` of read-out impacts ``w``."""
    log = np.log(np.maximum(np.asarray(impact, np.float64), IMPACT_FLOOR)) * (gamma / 2)
    return np.exp(log - log.mean(axis=-1, keepdims=True))


def _half(x: Array) -> Array:
    """A positive scale rounded to the fp16 it is stored as (kept in fp32)."""
    return jnp.clip(x, FP16_TINY, FP16_MAX).astype(jnp.float16).astype(jnp.float32)


def _fp16(x: Array) -> Array:
    return jnp.clip(x, -FP16_MAX, FP16_MAX).astype(jnp.float16)


def group_size(dv: int) -> int:
    return min(GROUP, dv)


# ----------------------------------------------------------------------------- the fit


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """One layer's static layout: bits ``[H, dk]`` (16 = pivot), impact weights ``[H, dk]``,
    architecture (``gdn``: GDN's 2-bit rows use grouped factors and ``{-3, -1, 1, 3}``)."""

    bits: np.ndarray
    impact: np.ndarray
    architecture: str

    @property
    def integer(self) -> np.ndarray:
        return self.bits != PIVOT

    @property
    def grouped(self) -> np.ndarray:
        """``[H, dk]``: GDN rows at 2 bits (row factors per group of values)."""
        return (self.bits == 2) & (self.architecture == "gdn")

    @property
    def qmax(self) -> np.ndarray:
        q = 2.0 ** (np.minimum(self.bits, 8) - 1) - 1
        return np.where(self.grouped, 3.0, np.where(self.integer, q, 1.0))

    @property
    def step(self) -> np.ndarray:
        """``n``: the code step on the 8-bit grid (KDA), 1 elsewhere."""
        if self.architecture != "kda":
            return np.ones(self.bits.shape)
        return np.where(self.integer, 2.0 ** (8 - np.minimum(self.bits, 8)), 1.0)

    def rows(self, width: int) -> np.ndarray:
        """Flat row indices ``h dk + i`` of ``width`` (``PIVOT`` for the pivots), ascending."""
        return np.flatnonzero(self.bits.reshape(-1) == width)

    @property
    def widths(self) -> tuple:
        return tuple(b for b in WIDTHS if np.any(self.bits == b))

    @property
    def scaled_rows(self) -> np.ndarray:
        return np.flatnonzero((self.integer & ~self.grouped).reshape(-1))

    @property
    def grouped_rows(self) -> np.ndarray:
        return np.flatnonzero(self.grouped.reshape(-1))

    @property
    def integer_heads(self) -> np.ndarray:
        return np.flatnonzero(self.integer.any(axis=1))


def fit(x: Array, layout: Layout) -> tuple[Array, Array, Optional[Array], Array, Array]:
    """The dual-axis fit of ``x [B, H, dk, dv]`` (module docstring).

    Returns ``(z, r, rg, c, recon)``: codes ``[B, H, dk, dv]`` (float, integers), row factors
    ``[B, H, dk]``, grouped row factors ``[B, H, dk, dv / G]`` (``None`` without grouped rows),
    column scales ``[B, H, dv]`` (fp16 values in fp32) and the reconstruction ``[B, H, dk, dv]``
    (pivot rows in fp16) the stored state decodes to.
    """
    z, r, rg, c, recon = fit_arrays(x, impact=layout.impact, integer=layout.integer, qmax=layout.qmax,
                                    step=layout.step, grouped=layout.grouped,
                                    has_groups=bool(layout.grouped.any()))
    return z, r, (rg if layout.grouped.any() else None), c, recon


@functools.partial(jax.jit, static_argnames="has_groups")
def fit_arrays(x: Array, *, impact, integer, qmax, step, grouped, has_groups: bool):
    """``fit`` on the layout's ``[H, dk]`` arrays (traced: one program serves every layout of a
    shape); ``rg`` is zeros without ``has_groups``."""
    x = x.astype(jnp.float32)
    dv = x.shape[-1]
    w = jnp.asarray(impact, jnp.float32)
    integer = jnp.asarray(integer)[..., None]
    grouped = jnp.asarray(grouped)[..., None]
    qmax = jnp.asarray(qmax, jnp.float32)[..., None]
    step = jnp.asarray(step, jnp.float32)[..., None]
    r = _half(jnp.sqrt(jnp.maximum(jnp.mean(jnp.abs(x), axis=-1), IMPACT_FLOOR) / w))          # [B, H, dk]
    full = r[..., None]
    g = group_size(dv)
    rg = jnp.zeros(x.shape[:-1] + (dv // g,), jnp.float32)
    if has_groups:
        blocks = jnp.abs(x).reshape(x.shape[:-1] + (dv // g, g)).mean(axis=-1)                 # [B, H, dk, dv/G]
        rg = _half(jnp.sqrt(jnp.maximum(blocks, IMPACT_FLOOR) / w[..., None]))
        full = jnp.where(grouped, jnp.repeat(rg, g, axis=-1), full)
    y = x / full
    c0 = _half(jnp.max(jnp.where(integer, jnp.abs(y) / (qmax * step), 0.0), axis=-2, keepdims=True))   # [B, H, 1, dv]

    def encode(c):
        t = y / (c * step)
        z = jnp.clip(jnp.round(t), -qmax, qmax)
        if has_groups:
            odd = jnp.where(t >= 0, 1.0, -1.0) * jnp.where(jnp.abs(t) >= 2, 3.0, 1.0)
            z = jnp.where(grouped, odd, z)
        return z

    z = encode(c0)
    v = full * step * z
    weight = jnp.where(integer, jnp.square(w)[..., None], 0.0)
    num = jnp.sum(weight * v * x, axis=-2, keepdims=True)
    den = jnp.sum(weight * v * v, axis=-2, keepdims=True)
    c = _half(jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), c0))
    z = encode(c)
    recon = jnp.where(integer, full * c * step * z, _fp16(x).astype(jnp.float32))
    return z, r, rg, c[..., 0, :], recon


# ----------------------------------------------------------------------------- packing


def pack_2bit(codes: Array) -> Array:
    """Unsigned 2-bit codes ``[..., n, m]`` -> uint8 ``[..., n/4, m]``: byte row ``i`` holds code rows
    ``i, i + n/4, i + n/2, i + 3n/4`` in bits 0-1, 2-3, 4-5, 6-7 (planar, like ``pack_codes``)."""
    n = codes.shape[-2]
    if n % 4:
        raise ValueError(f"2-bit packing needs a multiple of 4 codes, got {n}")
    q = n // 4
    c = codes.astype(jnp.uint8)
    return sum((c[..., p * q:(p + 1) * q, :] << (2 * p)) for p in range(4)).astype(jnp.uint8)


def unpack_2bit(packed: Array) -> Array:
    """Inverse of ``pack_2bit``: int32 codes ``[..., 4 n, m]``."""
    p = packed.astype(jnp.int32)
    return jnp.concatenate([(p >> (2 * i)) & 3 for i in range(4)], axis=-2)


def _pack(z: Array, width: int, grouped: bool) -> Array:
    """Signed codes of one width ``[B, rows, dv]`` -> packed ``[B, packed(dv), rows]``."""
    zt = jnp.swapaxes(z, -1, -2).astype(jnp.int32)
    if width == 2:
        return pack_2bit((zt + 3) // 2 if grouped else zt + 2)
    return pack_codes(zt + 2 ** (width - 1), width)


def _unpack(packed: Array, width: int, grouped: bool) -> Array:
    if width == 2:
        u = unpack_2bit(packed)
        z = 2 * u - 3 if grouped else u - 2
    else:
        z = unpack_codes(packed, width) - 2 ** (width - 1)
    return jnp.swapaxes(z, -1, -2).astype(jnp.float32)


@flax.struct.dataclass
class StepQuantState:
    """One layer's STEPQuant state (module docstring); ``widths`` says which width each entry of
    ``codes`` holds; ``heads``, ``dk``, ``dv`` the state it stands for."""

    codes: tuple
    rows: Array
    groups: Array
    columns: Array
    pivots: Array
    widths: tuple = flax.struct.field(pytree_node=False, default=())
    heads: int = flax.struct.field(pytree_node=False, default=0)
    dk: int = flax.struct.field(pytree_node=False, default=0)
    dv: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.rows.shape[0], self.heads, self.dk, self.dv


def encode(x: Array, layout: Layout) -> StepQuantState:
    """Rounds ``x [B, H, dk, dv]`` into the layout's state."""
    b, h, dk, dv = x.shape
    z, r, rg, c, _ = fit(x, layout)
    flat = lambda a: a.reshape((b, h * dk) + a.shape[3:])                      # noqa: E731
    grouped = layout.architecture == "gdn"
    codes = tuple(_pack(flat(z)[:, layout.rows(w)], w, grouped) for w in layout.widths)
    g = group_size(dv)
    groups = flat(rg)[:, layout.grouped_rows] if rg is not None else jnp.zeros((b, 0, dv // g), jnp.float32)
    return StepQuantState(codes=codes, rows=flat(r)[:, layout.scaled_rows].astype(jnp.float16),
                          groups=groups.astype(jnp.float16),
                          columns=c[:, layout.integer_heads].astype(jnp.float16),
                          pivots=_fp16(flat(x.astype(jnp.float32))[:, layout.rows(PIVOT)]),
                          widths=layout.widths, heads=h, dk=dk, dv=dv)


def zero_state(batch: int, heads: int, dk: int, dv: int, layout: Layout) -> StepQuantState:
    """``encode`` of a zero state, built from constants: every code 0 (GDN's 2-bit codes, which
    have no 0, +1), every scale the least fp16 (what the fit gives an all-zero row and column).
    Inside ``jit`` XLA would otherwise spend seconds constant-folding the fit of a constant zero state."""
    grouped = layout.architecture == "gdn"
    codes = tuple(_pack(jnp.full((batch, layout.rows(w).size, dv), 1.0 if grouped and w == 2 else 0.0), w, grouped)
                  for w in layout.widths)
    tiny = lambda *shape: jnp.full(shape, FP16_TINY, jnp.float16)            # noqa: E731
    return StepQuantState(codes=codes, rows=tiny(batch, layout.scaled_rows.size),
                          groups=tiny(batch, layout.grouped_rows.size, dv // group_size(dv)),
                          columns=tiny(batch, layout.integer_heads.size, dv),
                          pivots=jnp.zeros((batch, layout.rows(PIVOT).size, dv), jnp.float16),
                          widths=layout.widths, heads=heads, dk=dk, dv=dv)


def decode(state: StepQuantState, layout: Layout) -> Array:
    """``[B, H, dk, dv]`` fp32 of a state."""
    b, h, dk, dv = state.shape
    n = h * dk
    grouped = layout.architecture == "gdn"
    z = jnp.zeros((b, n, dv), jnp.float32)
    for w, packed in zip(state.widths, state.codes):
        z = z.at[:, layout.rows(w)].set(_unpack(packed, w, grouped))
    factor = jnp.ones((b, n, dv), jnp.float32).at[:, layout.scaled_rows].set(
        jnp.broadcast_to(state.rows.astype(jnp.float32)[..., None], (b, layout.scaled_rows.size, dv)))
    if layout.grouped_rows.size:
        factor = factor.at[:, layout.grouped_rows].set(jnp.repeat(state.groups.astype(jnp.float32), group_size(dv), -1))
    c = jnp.ones((b, h, dv), jnp.float32).at[:, layout.integer_heads].set(state.columns.astype(jnp.float32))
    step = jnp.asarray(layout.step.reshape(-1), jnp.float32)[None, :, None]
    x = (factor * step * z).reshape(b, h, dk, dv) * c[:, :, None, :]
    x = x.reshape(b, n, dv).at[:, layout.rows(PIVOT)].set(state.pivots.astype(jnp.float32))
    return x.reshape(b, h, dk, dv)


# ----------------------------------------------------------------------------- the method


@dataclasses.dataclass(frozen=True)
class StepQuantMethod(PlanMethod, PerStepRunner):
    """``stepquant-*``: the per-step STEPQuant state (module docstring) of the plan named ``plan``
    in a ``LifetimeCalibration``, specialised to a layer with ``for_layer``."""

    plan: str = "stepquant-6"
    calibration: Optional[LifetimeCalibration] = None
    layer: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "calibration", as_calibration(self.calibration))
        if self.calibration is None and self.plan not in NAMES:
            raise ValueError(f"unknown STEPQuant method {self.plan!r}; known: {', '.join(NAMES)}")

    def layout(self, heads: int, dk: int, dv: int, *, need_plan: bool = True) -> Layout:
        """The layer's layout (``method_layout`` at the name's budget)."""
        return method_layout(self, NAMES.get(self.plan), heads, dk, dv, need_plan=need_plan)

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False, *,
             key_heads: Optional[int] = None) -> StepQuantState:
        """A zero state ``[batch, heads, dk, dv]`` (``key_heads`` is checked; the state keeps no keys)."""
        check_dims(batch, heads, dk, dv)
        resolve_key_heads(heads, key_heads)
        check_size(dk, dv)
        return zero_state(batch, heads, dk, dv, self.layout(heads, dk, dv, need_plan=False))

    def from_dense(self, state: Array, *, per_channel_decay: bool = False,
                   key_heads: Optional[int] = None) -> StepQuantState:
        """Rounds ``[B, H, dk, dv]`` fp32 into the layer's layout."""
        _, h, dk, dv = check_dense(state)
        check_size(dk, dv)
        return encode(state, self.layout(h, dk, dv))

    def to_dense(self, state: StepQuantState) -> Array:
        """``[B, H, dk, dv]`` fp32."""
        _, h, dk, dv = state.shape
        return decode(state, self.layout(h, dk, dv, need_plan=self.calibration is not None))



def method_layout(method: PlanMethod, bits: Optional[int], heads: int, dk: int, dv: int, *,
                  need_plan: bool = True) -> Layout:
    """The layout of ``method``'s layer (a ``PlanMethod`` running a ``StepQuantPlan``): its plan's,
    or without a calibration (``need_plan=False`` only) ``bits`` on every row (no 2-bit row: the
    same for GDN and KDA)."""
    found = method.layer_plan(heads, dk, dv, need_plan=need_plan, plan_type=StepQuantPlan, kind="STEPQuant",
                              differs="plan")
    if found is None:
        return Layout(bits=np.full((heads, dk), bits), impact=np.ones((heads, dk)), architecture="gdn")
    plan, i = found
    return Layout(bits=np.asarray(plan.bits[i]), impact=np.asarray(plan.impact[i], np.float64),
                  architecture=method.calibration.architecture)


def check_size(dk: int, dv: int) -> None:
    """Refuses a head the layout cannot pack: ``dv`` in fours, and in groups of ``GROUP`` above it."""
    if dv % 4 or (dv > GROUP and dv % GROUP):
        raise ValueError(f"stepquant packs codes along dv in fours and groups values by {GROUP}: dv must be a multiple "
                         f"of 4 (and of {GROUP} above it), got dv={dv}")


# ----------------------------------------------------------------------------- calibration


def _distortion(stats: LayerStatistics, bits: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``[H, dk]``: mean over samples and values of the ``w^2``-weighted squared error of the fit
    with ``bits`` (``[H, dk]``)."""
    layout = Layout(bits=bits, impact=weights, architecture=stats.architecture)
    x = jnp.asarray(stats.samples)
    recon = fit(x, layout)[-1]
    err = np.asarray(jnp.mean(jnp.square(recon - x), axis=(0, -1)), np.float64)
    return err * np.square(weights)


def stepquant_plan(stats: dict, budget: float, *, name: Optional[str] = None, pivots: Optional[int] = None,
                   gamma: float = GAMMA) -> tuple[StepQuantPlan, dict]:
    """The STEPQuant plan of ``budget`` nominal bits per value over the layers of ``stats``
    (``{layer: LayerStatistics}``); ``pivots``: fp16 units (default ``PIVOT_SHARE`` of the units).

    Returns ``(plan, scores)``: scores per layer (``cost [units, candidates]``) for the calibration
    file. Raises ``ValueError`` for a budget below the smallest
    candidate width or more pivots than the budget allows.
    """
    layers = sorted(stats)
    arch = stats[layers[0]].architecture
    cands = candidates_for(budget)
    if not np.isfinite(budget) or budget < min(cands) or budget > max(cands):
        raise ValueError(f"stepquant budget {budget} bits per value is outside its widths [{min(cands)}, "
                         f"{max(cands)}]: a budget below the smallest width {min(cands)} cannot be met")
    weights = {layer: impact_weights(stats[layer].impact, gamma) for layer in layers}
    h, dk = weights[layers[0]].shape

    def unit(x):  # [H, dk] -> per unit: GDN a head (mean over its rows), KDA a row
        return x.mean(axis=-1) if arch == "gdn" else x.reshape(-1)

    def costs(mask: dict) -> np.ndarray:
        out = []
        for layer in layers:
            life = stats[layer].row_lifetime
            per = [unit(life * _distortion(stats[layer], np.where(mask[layer], PIVOT, b), weights[layer]))
                   for b in cands]
            out.append(np.stack(per, axis=-1))
        return np.concatenate(out)

    none = {layer: np.zeros((h, dk), bool) for layer in layers}
    cost = costs(none)
    n = cost.shape[0]
    p = int(round(PIVOT_SHARE[arch] * n)) if pivots is None else int(pivots)
    total = int(np.floor(budget * n + 1e-9))
    if not 0 <= p <= n or total - 8 * p < (n - p) * min(cands):
        raise ValueError(f"stepquant: {p} pivots of {n} units leave too few bits for the rest at a budget of "
                         f"{budget} (each pivot counts 8)")
    if arch == "gdn":
        first = allocate_exact(cost, np.asarray(cands), total)
        risk = cost[np.arange(n), first]
    else:
        fp16 = np.concatenate([unit(stats[x].row_lifetime * _fp16_error(stats[x], weights[x])) for x in layers])
        risk = cost[:, -1] - fp16
    pivot = np.zeros(n, bool)
    pivot[np.argsort(-risk, kind="stable")[:p]] = True
    if arch == "kda" and p:  # the pivots leave the column fit: the others' errors change
        mask = dict(zip(layers, np.split(pivot.reshape(len(layers), h, dk), len(layers))))
        cost = costs({k: v[0] for k, v in mask.items()})
    solve = allocate_exact if arch == "gdn" else allocate_lagrangian
    choice = np.full(n, -1)
    choice[~pivot] = solve(cost[~pivot], np.asarray(cands), total - 8 * p)
    widths = np.where(pivot, PIVOT, np.asarray(cands)[np.maximum(choice, 0)])
    per_layer = np.split(widths, len(layers))
    bits = [np.repeat(b[:, None], dk, axis=1) if arch == "gdn" else b.reshape(h, dk) for b in per_layer]
    plan = StepQuantPlan(name=name or f"stepquant-{budget:g}", budget=float(budget), candidates=cands, pivots=p,
                         bits=tuple(tuple(tuple(int(v) for v in r) for r in b) for b in bits),
                         impact=tuple(tuple(tuple(r) for r in significant(weights[x], IMPACT_DIGITS)) for x in layers))
    scores = {str(x): {"cost": significant(c)} for x, c in zip(layers, np.split(cost, len(layers)))}
    return plan, scores


def _fp16_error(stats: LayerStatistics, weights: np.ndarray) -> np.ndarray:
    x = stats.samples.astype(np.float32)
    err = np.mean(np.square(np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float64) - x), axis=(0, -1))
    return err * np.square(weights)


__all__ = ["GAMMA", "Layout", "NAMES", "PIVOT", "PIVOT_SHARE", "StepQuantMethod", "StepQuantState", "candidates_for",
           "check_size", "decode", "encode", "fit", "impact_weights", "method_layout", "pack_2bit", "stepquant_plan",
           "unpack_2bit"]
