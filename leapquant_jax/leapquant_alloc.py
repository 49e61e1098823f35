"""LeapQuant with lifetime-aware widths (``leapquant-alloc-6``, ``leapquant-alloc-4``).

Every head of every layer stores its window-boundary checkpoint with its own residual width (2, 4,
6 or 8 bits, ``width_plan``'s options) and, where an option has them, Compensator Tokens, chosen
once by a calibration that spends a budget of checkpoint bytes over all the heads of the model
where the errors are large and long-lived: head ``h`` at option ``o`` costs the error energy of its
flush ``||decode(encode_o(S)) - S||^2`` on the calibration states ``S``, each key row's share
weighted by its lifetime (``lifetime``), and weighs the bytes of its checkpoint as the pytree
holds them (codes, fp32 smoothing and column scales, fp16 Compensator Tokens). Every head keeps
smoothing; the window and its high-precision records are LeapQuant's.

Defaults, and why:
* the budget (``default_budget``) is that of the per-step ``int<bits>`` format, codes and one fp32
  scale per value column (4.25 and 6.25 bits per value at ``dk = 128``), so that the name's width
  counts every byte of the checkpoint, scales included, as the per-step formats' names do;
* the options (``DEFAULT_OPTIONS``) hold no Compensator Tokens: at these budgets a token (a quarter
  bit per value at ``dk = dv = 128``) is better spent on a wider residual (docs/long-memory.md).

Layout: the heads are grouped by option, one ``LeapQuantState`` per option used in the layer
(``AllocState.groups``, in ``options`` order, each holding its heads in ascending order): a static
head permutation, so the step and flush kernels run each group as it is, with its own
``LeapQuantConfig`` (the kernels take one width per launch: a group). A group keeps its key
records per value head (its heads need not share key heads), which a live stream pays for in
window-buffer bytes under GVA. Prefix states keep each group's checkpoint
(``models.prefix_state`` finds the ``LeapQuantState`` leaves).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from . import windowed
from .bit_allocation import allocate
from .lifetime import WIDTH_OPTIONS as WIDTHS
from .lifetime import LayerStatistics, WidthPlan, WindowedPlanMethod, significant
from .quantizers import PER_STEP_WIDTHS, IntFormat, check_per_step_bits, tree_bytes
from .recurrence import Token
from .runner import Runner, check_dense, check_dims
from .state import LeapQuantConfig, resolve_key_heads
from .windowed_method import WindowedMethod

Array = jax.Array

DEFAULT_OPTIONS = tuple((bits, 0) for bits in WIDTHS)
NAMES = {"leapquant-alloc-6": 6, "leapquant-alloc-4": 4}


def _config(option: tuple, window: int, impl: str) -> LeapQuantConfig:
    bits, rank = option
    return LeapQuantConfig(bits=bits, rank=rank, window=window, impl=impl)


@functools.lru_cache(maxsize=None)
def option_bytes(option: tuple, dk: int, dv: int) -> int:
    """Bytes of one head's checkpoint at ``option = (bits, rank)`` (``rank`` ``None``: LeapQuant's
    default), measured on the pytree ``windowed.encode_checkpoint`` returns."""
    bits, rank = option
    config = LeapQuantConfig(bits=bits, rank=rank)
    config.check_head_size(dk, dv)
    return tree_bytes(jax.eval_shape(lambda: windowed.encode_checkpoint(config, jnp.zeros((1, 1, dk, dv)))))


def default_budget(bits: int, dk: int, dv: int) -> float:
    """Bits per value of the per-step ``int<bits>`` format on ``dk x dv`` heads (codes and one fp32
    scale per value column, measured on its pytree): the budget of ``leapquant-alloc-<bits>``."""
    check_per_step_bits(bits)
    return 8 * tree_bytes(jax.eval_shape(IntFormat(bits).quantize, jax.ShapeDtypeStruct((1, dk, dv), jnp.float32))) \
        / (dk * dv)


def check_options(options) -> tuple:
    """``options`` as a tuple of ``(bits, rank)`` pairs; ``ValueError`` naming an unknown width."""
    out = []
    for o in options:
        bits, rank = (int(v) for v in o)
        if bits not in WIDTHS:
            raise ValueError(f"unknown width {bits}: leapquant-alloc residuals are {', '.join(map(str, WIDTHS))} bits")
        if rank < 0:
            raise ValueError(f"option {list(o)}: the rank (Compensator Tokens) must be >= 0")
        out.append((bits, rank))
    if not out or len(set(out)) != len(out):
        raise ValueError(f"options must be distinct (bits, rank) pairs, at least one, got {list(options)}")
    return tuple(out)


# ----------------------------------------------------------------------------- the state and the method


@flax.struct.dataclass
class AllocState:
    """One layer's state: ``groups``, a ``LeapQuantState`` per option used (module docstring)."""

    groups: tuple

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, _, dk, dv = self.groups[0].shape
        return b, sum(g.shape[1] for g in self.groups), dk, dv

    @property
    def per_channel_decay(self) -> bool:
        return self.groups[0].per_channel_decay


@dataclasses.dataclass(frozen=True, eq=False)
class GroupLayout:
    """Static head grouping: ``options`` used (one group each) and ``heads[g]``, the ascending
    heads of group ``g``; ``order`` concatenates them, ``inverse`` undoes it."""

    options: tuple
    heads: tuple

    @property
    def order(self) -> np.ndarray:
        return np.concatenate([np.asarray(h, np.int64) for h in self.heads])

    @property
    def inverse(self) -> np.ndarray:
        return np.argsort(self.order)

    @property
    def sizes(self) -> list:
        return [len(h) for h in self.heads]


@functools.lru_cache(maxsize=None)
def _zero_head(config: LeapQuantConfig, dk: int, dv: int, per_channel_decay: bool):
    """One head's all-zero live stream (``windowed.init_state`` at ``[1, 1]``), its leaves on the
    host. Every head's checkpoint is encoded from its own state alone (the fit's seeded start is
    the same for every head), so the zero stream of ``[B, H]`` heads is this one broadcast: one
    encoding per option instead of one per group shape, run op by op. Computed eagerly even
    under a trace (it is cached for every later call)."""
    with jax.ensure_compile_time_eval():
        return jax.device_get(windowed.init_state(config, 1, 1, dk, dv, per_channel_decay))


def _take(x: Array, index: np.ndarray) -> Array:
    return jnp.take(x, jnp.asarray(index), axis=1)


def _split(x: Array, sizes: list) -> list:
    return jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=1)


@dataclasses.dataclass(frozen=True)
class AllocMethod(WindowedPlanMethod, Runner):
    """``leapquant-alloc-*``: LeapQuant with the per-head widths and ranks of the plan named
    ``plan`` in a ``LifetimeCalibration`` (module docstring), specialised to a layer with
    ``for_layer``. window: records per window ``p``; impl: the kernels, as ``LeapQuantConfig.impl``.
    Without a calibration every head is at the name's width without tokens (for ``leapquant
    memory``), and rounding is refused."""

    plan: str = "leapquant-alloc-4"

    NAMES = NAMES

    def layout(self, heads: int, dk: int, dv: int, *, need_plan: bool = True) -> GroupLayout:
        """The layer's grouping: its plan's, or without a calibration (``need_plan=False`` only)
        one group at the name's width without Compensator Tokens (``DEFAULT_OPTIONS``' kind)."""
        found = self.layer_plan(heads, dk, dv, need_plan=need_plan, plan_type=WidthPlan, kind="leapquant-alloc",
                                differs="layout")
        if found is None:
            return GroupLayout(options=((NAMES[self.plan], 0),), heads=(tuple(range(heads)),))
        plan, i = found
        choice = plan.choice[i]
        used = sorted(set(choice))
        return GroupLayout(options=tuple(plan.options[j] for j in used),
                           heads=tuple(tuple(h for h, c in enumerate(choice) if c == j) for j in used))

    def configs(self, layout: GroupLayout) -> list:
        return [_config(o, self.window, self.impl) for o in layout.options]

    def _methods(self, layout: GroupLayout) -> list:
        return [WindowedMethod(c, label=self.plan) for c in self.configs(layout)]

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False, *,
             key_heads: Optional[int] = None) -> AllocState:
        """An all-zero live stream ``[batch, heads]`` of ``dk x dv`` heads (``key_heads`` is checked;
        each group keeps its key records per value head)."""
        check_dims(batch, heads, dk, dv)
        resolve_key_heads(heads, key_heads)
        layout = self.layout(heads, dk, dv, need_plan=False)
        groups = []
        for config, n in zip(self.configs(layout), layout.sizes):
            config.check_head_size(dk, dv)
            head = _zero_head(config, dk, dv, bool(per_channel_decay))
            groups.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, n)[:x.ndim] + x.shape[2:]), head))
        return AllocState(groups=tuple(groups))

    def from_dense(self, state: Array, *, per_channel_decay: bool = False,
                   key_heads: Optional[int] = None) -> AllocState:
        """Rounds ``[B, H, dk, dv]`` fp32 into each group's checkpoint, with empty windows."""
        _, h, dk, dv = check_dense(state)
        layout = self.layout(h, dk, dv)
        parts = _split(_take(state, layout.order), layout.sizes)
        return AllocState(groups=tuple(m.from_dense(x, per_channel_decay=per_channel_decay)
                                       for m, x in zip(self._methods(layout), parts)))

    def to_dense(self, state: AllocState) -> Array:
        """The represented state ``[B, H, dk, dv]`` fp32 (checkpoints plus records), heads in model order."""
        _, h, dk, dv = state.shape
        layout = self.layout(h, dk, dv, need_plan=self.calibration is not None)
        dense = jnp.concatenate([m.to_dense(g) for m, g in zip(self._methods(layout), state.groups)], axis=1)
        return _take(dense, layout.inverse)

    def records_held(self, state: AllocState) -> Array:
        return state.groups[0].pos

    def per_channel_state(self, state: AllocState) -> bool:
        return state.per_channel_decay

    def with_decay_layout(self, state: AllocState, per_channel: bool) -> AllocState:
        _, h, dk, dv = state.shape
        methods = self._methods(self.layout(h, dk, dv, need_plan=self.calibration is not None))
        return AllocState(groups=tuple(m.with_decay_layout(g, per_channel) for m, g in zip(methods, state.groups)))

    def step_token(self, state: AllocState, token: Token, *, active: Optional[Array] = None):
        """Each group's LeapQuant step on its heads (read, append, flush when full).
        Returns ``(o [B, H, dv], state)``."""
        b, h, dk, dv = state.shape
        if token.w.shape[1] != h or token.q.shape != (b, h, dk) or token.v.shape != (b, h, dv):
            raise ValueError(f"the state holds [B, H, dk, dv] = {(b, h, dk, dv)} but the token gives q "
                             f"{tuple(token.q.shape)}, k {tuple(token.w.shape)}, v {tuple(token.v.shape)} (keys "
                             "repeated to the value heads)")
        layout = self.layout(h, dk, dv)
        fields = {f: _split(_take(getattr(token, f), layout.order), layout.sizes)
                  for f in ("q", "w", "b", "v", "g", "beta")}
        outs, groups = [], []
        for i, (m, g) in enumerate(zip(self._methods(layout), state.groups)):
            o, g = m.step_token(g, Token(**{f: parts[i] for f, parts in fields.items()}), active=active)
            outs.append(o)
            groups.append(g)
        return _take(jnp.concatenate(outs, axis=1), layout.inverse), AllocState(groups=tuple(groups))


# ----------------------------------------------------------------------------- calibration


def flush_energy(stats: LayerStatistics, option: tuple) -> np.ndarray:
    """``[H, dk]``: the mean over calibration states of each key row's squared flush error,
    ``sum_j (decode(encode(S)) - S)_ij^2``, at ``option = (bits, rank)``."""
    return flush_energies(stats, (option,))[0]


def flush_energies(stats: LayerStatistics, options) -> np.ndarray:
    """``[options, H, dk]``: ``flush_energy`` at each of ``options``. The options of one rank run
    as one compiled program: their Compensator Token fits are the same computation, which the
    compiler makes once."""
    samples = jnp.asarray(stats.samples)
    out = {}
    for rank in dict.fromkeys(rank for _, rank in options):
        same = tuple(o for o in options if o[1] == rank)
        energies = _flush_energies(samples, tuple(LeapQuantConfig(bits=bits, rank=rank) for bits, _ in same))
        out.update(zip(same, energies))
    return np.stack([np.asarray(out[o], np.float64) for o in options])


@functools.partial(jax.jit, static_argnums=1)
def _flush_energies(s: Array, configs: tuple) -> tuple:
    def energy(config):
        err = windowed.decode_checkpoint(config, windowed.encode_checkpoint(config, s)) - s
        return jnp.mean(jnp.sum(jnp.square(err), axis=-1), axis=0)

    return tuple(energy(c) for c in configs)


def width_plan(stats: dict, bits: Optional[int] = None, *, budget: Optional[float] = None, name: Optional[str] = None,
               options=DEFAULT_OPTIONS) -> tuple[WidthPlan, dict]:
    """The plan of ``leapquant-alloc-<bits>`` over the layers of ``stats`` (``{layer: LayerStatistics}``).

    budget: checkpoint bits per value (default ``default_budget(bits)``); options: the ``(bits,
    rank)`` choices of a head. Returns ``(plan, scores)``, scores per layer (``cost [H, options]``)
    for the file. Raises ``ValueError`` naming an unknown width or a budget
    below the cheapest option.
    """
    options = check_options(options)
    layers = sorted(stats)
    h, dk, dv = stats[layers[0]].samples.shape[1:]
    if budget is None:
        if bits not in PER_STEP_WIDTHS:
            raise ValueError(f"unknown width {bits}: leapquant-alloc budgets are named by 4, 6 or 8 bits, or given")
        budget = default_budget(bits, dk, dv)
    nbytes = np.asarray([option_bytes(o, dk, dv) for o in options], np.int64)
    per_value = 8 * nbytes / (dk * dv)
    if not np.isfinite(budget) or budget < per_value.min() - 1e-9:
        cheap = options[int(np.argmin(per_value))]
        raise ValueError(f"budget {budget:g} bits per value is below the smallest width's: a {cheap[0]}-bit residual "
                         f"with {cheap[1]} Compensator Tokens takes {per_value.min():.4g} bits per value (codes, "
                         "scales and tokens of the checkpoint)")
    energy = {x: flush_energies(stats[x], options) for x in layers}                              # [options, H, dk]
    cost = np.concatenate([np.sum(stats[x].row_lifetime * energy[x], axis=-1).T for x in layers])   # [L H, options]
    total = int(np.floor(budget * cost.shape[0] * dk * dv / 8 + 1e-6))
    choice = allocate(cost, nbytes, total)
    per_layer = np.split(choice, len(layers))
    plan = WidthPlan(name=name or f"leapquant-alloc-{bits}", budget=float(budget), options=options,
                     choice=tuple(tuple(int(j) for j in c) for c in per_layer))
    scores = {str(x): {"cost": significant(c)} for x, c in zip(layers, np.split(cost, len(layers)))}
    return plan, scores


__all__ = ["AllocMethod", "AllocState", "DEFAULT_OPTIONS", "GroupLayout", "NAMES", "WIDTHS", "check_options",
           "default_budget", "flush_energies", "flush_energy", "option_bytes", "width_plan"]
