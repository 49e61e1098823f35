"""Decoding across devices with ``jax.sharding``: a ``("data", "model")`` mesh, weights and caches
placed on it, and the cache held to its layout inside the compiled decode loop.

* ``make_mesh(data, model)``: the first ``data * model`` devices as a ``Mesh`` with axes
  ``("data", "model")``: sequences split over ``data``, heads and channels over ``model``.
  ``check_mesh(config, data, model, batch=)`` refuses, naming the count, a model axis that does
  not divide the heads or experts it splits (``MODEL_AXIS_COUNTS``) or a data axis that does not
  divide the batch.
* ``shard_params(params, mesh, arch=, config=)``: the architecture's tensor-parallel layout
  (``arch.tensor_parallel_layout``: Qwen3.5's fused GDN ``qkv`` grouped so that each device's
  rows are its own q, k and v heads), then every leaf placed by ``param_specs``.
* ``param_specs(params, mesh)``: tensor parallel by leaf name, the usual Megatron split: the
  projections into heads or channels (``q``, ``k``, ``v``, ``qkv``, ``z``, ``a``, ``b``, ``gate``,
  ``up``, the KDA gates' up-projections, the short convolutions, the per-head decay parameters,
  the LM head over the vocabulary) are split along their output axis; the projections back to the
  hidden size (``o``, ``out``, ``down``) along their input axis; routed experts (``[E, ...]``
  under ``moe``) along the expert axis; norms, routers, low-rank down-projections and the
  embedding are replicated. A leaf whose axis does not divide by the
  model axis stays replicated (the partitioner keeps every placement exact; this one decides
  where the communication goes).
* ``cache_specs(cache, mesh)``: every leaf split over ``data`` along the batch; the recurrent
  state's leaves (any state method: LeapQuant's checkpoint, window buffer and position included)
  also over ``model`` along their head axis, so no device holds another's heads (a LeapQuant
  buffer's key records ``[B, Hk, p, dk]`` along their key-head axis: with ``Hk`` and ``H``
  both split over ``model``, device ``d`` holds value heads ``d H/m ..`` and the key heads
  ``d Hk/m ..`` they read); attention KV
  caches along their head axis and the short-convolution buffers along their channels; MLA's
  latent cache over ``data`` only.

``models.decode.score`` and ``generate`` take ``mesh=``: the weights are placed by
``param_specs``, the batch over ``data``, and the cache is constrained to ``cache_specs`` where it
is made and after every step, so XLA's partitioner (GSPMD) runs each device's part of every layer
and inserts the collectives. The recurrence itself runs per shard: ``shard_method(method, mesh)``
wraps the state method so that its ``step`` and ``prefill`` run under ``shard_map``, each device
on its own sequences and heads (the Pallas kernels are custom calls the partitioner cannot split,
and the recurrence needs no communication: heads are independent).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from leapquant_jax.checks import check_positive
from models.base import STACKED_SECTIONS

AXES = ("data", "model")
# Leaf names split along their output axis (0) and along their input axis (1); the rest replicate.
COLUMN_PARALLEL = frozenset({"q", "k", "v", "qkv", "z", "a", "b", "gate", "up", "f_b", "g_b", "g_b_bias", "kv_b",
                             "conv", "q_conv", "k_conv", "v_conv", "a_log", "dt_bias", "lm_head"})
ROW_PARALLEL = frozenset({"o", "out", "down"})


def make_mesh(data: int, model: int, devices: Optional[list] = None) -> Mesh:
    """A ``data x model`` mesh over the first ``data * model`` of ``devices`` (default ``jax.devices()``;
    over several processes, all of them, in process order)."""
    for name, n in (("data", data), ("model", model)):
        check_positive(f"mesh axis {name}", n)
    devices = list(jax.devices() if devices is None else devices)
    if data * model > len(devices):
        raise ValueError(f"a {data} x {model} mesh needs {data * model} devices, but {len(devices)} are available "
                         "(on the CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)")
    if jax.process_count() > 1 and data * model != len(devices):
        raise ValueError(f"a mesh over {jax.process_count()} processes takes all their {len(devices)} devices, "
                         f"not {data} x {model}")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), AXES)


# Config fields counting what the model axis splits, which it must divide. KV heads
# (``num_key_value_heads``) may also be fewer: each is then kept whole on every device of a group
# of the axis (the KV projection and cache replicated), so one of the two must divide the other.
MODEL_AXIS_COUNTS = {"linear_num_value_heads": "GDN value heads", "linear_num_key_heads": "GDN key heads",
                     "kda_num_heads": "KDA heads", "num_attention_heads": "attention heads",
                     "num_experts": "routed experts"}


def check_mesh(config: Any, data: int, model: int, *, batch: Optional[int] = None) -> None:
    """Raises ``ValueError`` (one line naming the count and the config field) unless a ``data x
    model`` mesh splits ``config``'s model (``MODEL_AXIS_COUNTS``; experts only where a layer is
    a mixture of experts) and, given, a ``batch`` of sequences."""
    for name, n in (("data", data), ("model", model)):
        check_positive(f"mesh axis {name}", n)
    for field, what in MODEL_AXIS_COUNTS.items():
        n = getattr(config, field, None)
        if n is None or (field == "num_experts" and "moe" not in getattr(config, "mlp_types", ())):
            continue
        if n % model:
            raise ValueError(f"a model axis of {model} does not divide the {n} {what} ({field})")
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and kv % model and model % kv:
        raise ValueError(f"a model axis of {model} and the {kv} KV heads (num_key_value_heads): neither divides "
                         "the other")
    if batch is not None and batch % data:
        raise ValueError(f"a data axis of {data} does not divide the batch of {batch} sequences")


def _split(shape: tuple, axis: int, size: int) -> bool:
    return len(shape) > axis and shape[axis] % size == 0


def _param_spec(keys: list, shape: tuple, model: int) -> P:
    name = keys[-1]
    if "moe" in keys and len(shape) in (3, 4):                # routed experts [E, ...] or [G, E/G, ...] over model
        return P("model") if _split(shape, 0, model) else P()
    if name in COLUMN_PARALLEL and _split(shape, 0, model):
        return P("model")
    if name in ROW_PARALLEL and _split(shape, 1, model):
        return P(None, "model")
    return P()


def _keys(path) -> list:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def _stacked(keys: list, shape: tuple, spec_of) -> P:
    # A scanned ``blocks`` leaf carries the repeats ahead of the layer's own axes: never split.
    if keys and keys[0] in STACKED_SECTIONS:
        return P(None, *spec_of(keys, shape[1:]))
    return spec_of(keys, shape)


def param_specs(params: Any, mesh: Mesh) -> Any:
    """``PartitionSpec`` per params leaf (module docstring): the pytree of ``params``, per-layer or
    scanned (``models.base.scan_params``)."""
    model = mesh.shape["model"]

    def spec(path, x):
        return _stacked(_keys(path), tuple(np.shape(x)), lambda k, s: _param_spec(k, s, model))

    return jax.tree_util.tree_map_with_path(spec, params)


def tensor_parallel_layout(params: Any, mesh: Mesh, *, arch: Any = None, config: Any = None) -> Any:
    """``params`` (arrays or ``jax.ShapeDtypeStruct`` leaves) in ``arch``'s layout for the mesh's
    model axis (``arch.tensor_parallel_layout(params, config, model)``), or as they are for an
    architecture without one (their fused projections then re-laid out by XLA every step)."""
    layout = getattr(arch, "tensor_parallel_layout", None)
    if layout is None or mesh.shape["model"] == 1:
        return params
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return jax.eval_shape(lambda p: layout(p, config, mesh.shape["model"]), params)
    return layout(params, config, mesh.shape["model"])


def shard_params(params: Any, mesh: Mesh, *, arch: Any = None, config: Any = None) -> Any:
    """``params`` placed on ``mesh`` by ``param_specs``, first in ``arch``'s tensor-parallel
    layout (``tensor_parallel_layout``) when ``arch`` and ``config`` are given. Every process of a
    multi-process mesh passes the same values (``place``)."""
    if arch is not None:
        params = tensor_parallel_layout(params, mesh, arch=arch, config=config)
    specs = param_specs(params, mesh)
    return jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), params, specs)


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array every device of ``mesh`` holds whole."""
    return NamedSharding(mesh, P())


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` (the same value in every process) as a global array of ``sharding``: each process
    puts its own devices' shards (``jax.make_array_from_callback``), so a mesh spanning several
    processes (``jax.distributed``) needs no transfer between them."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _cache_spec(keys: list, shape: tuple, data: int, model: int) -> P:
    batch = "data" if _split(shape, 0, data) else None
    if "state" in keys:                                       # [B, H, ...] (pos: [B])
        return P(batch, "model") if len(shape) >= 2 and _split(shape, 1, model) else P(batch)
    last = keys[-1]
    if last in ("k", "v") and len(shape) == 4:                # attention KV [B, L, H, d]
        return P(batch, None, "model") if _split(shape, 2, model) else P(batch)
    if last.endswith("conv") and len(shape) == 3:             # short-convolution buffer [B, K - 1, C]
        return P(batch, None, "model") if _split(shape, 2, model) else P(batch)
    return P(batch)                                           # pos, MLA latents [B, L, r]


def cache_specs(cache: Any, mesh: Mesh) -> Any:
    """``PartitionSpec`` per cache leaf (module docstring): the pytree of ``cache``, in either layout."""
    data, model = mesh.shape["data"], mesh.shape["model"]

    def spec(path, x):
        return _stacked(_keys(path), tuple(np.shape(x)), lambda k, s: _cache_spec(k, s, data, model))

    return jax.tree_util.tree_map_with_path(spec, cache)


def to_host(x: Any) -> Any:
    """The whole value of every array in ``x`` as NumPy, in every process (a mesh over several
    processes: gathered from all of them)."""
    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)

    return jax.tree.map(one, x)


def constrain_cache(cache: Any, mesh: Optional[Mesh]) -> Any:
    """Inside ``jit``: ``cache`` held to ``cache_specs`` on ``mesh`` (the identity without a mesh)."""
    if mesh is None:
        return cache
    specs = cache_specs(cache, mesh)
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), cache, specs)


def _state_specs(state: Any) -> Any:
    # every state leaf is [B, H, ...] (a stream's position: [B])
    return jax.tree.map(lambda x: P("data", "model") if np.ndim(x) >= 2 else P("data"), state)


def _check_split(mesh: Mesh, **sizes: int) -> None:
    data, model = mesh.shape["data"], mesh.shape["model"]
    for name, n in sizes.items():
        axis, size = ("data", data) if name == "batch" else ("model", model)
        if n % size:
            raise ValueError(f"a {name} of {n} does not split over the mesh's {axis} axis of {size}")


def _shard_map(fn, mesh: Mesh, in_specs, out_specs):
    # The kernels' custom calls carry no varying-axis annotations for the checker to read.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@dataclasses.dataclass(frozen=True)
class ShardedMethod:
    """A state method (``leapquant_jax.make_method``) whose ``step`` and ``prefill`` run per shard
    under ``shard_map`` on ``mesh``: sequences over ``data``, heads over ``model``. Every other
    attribute is the wrapped method's."""

    inner: Any
    mesh: Mesh

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "mesh"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def for_layer(self, i: int) -> "ShardedMethod":
        return ShardedMethod(self.inner.for_layer(i), self.mesh)

    def step(self, state: Any, *, q, k, v, g, beta, active=None):
        """The wrapped ``step`` per shard. q, k ``[B, Hk, dk]``; v ``[B, H, dv]``; g ``[B, H]`` or
        ``[B, H, dk]``; beta ``[B, H]``; active ``[B]``. Returns ``(o [B, H, dv], state)``."""
        _check_split(self.mesh, batch=q.shape[0], key_heads=q.shape[1], heads=v.shape[1])
        heads, batch = P("data", "model"), P("data")
        specs = _state_specs(state)
        args = (state, q, k, v, g, beta)
        in_specs = (specs, heads, heads, heads, heads, heads)

        def local(state, q, k, v, g, beta, *rest):
            return self.inner.step(state, q=q, k=k, v=v, g=g, beta=beta, active=rest[0] if rest else None)

        if active is not None:
            args, in_specs = args + (active,), in_specs + (batch,)
        return _shard_map(local, self.mesh, in_specs, (heads, specs))(*args)

    def prefill(self, *, q, k, v, g, beta, lengths=None, state=None):
        """The wrapped ``prefill`` per shard. q, k ``[B, T, Hk, dk]``; v ``[B, T, H, dv]``; g, beta
        ``[B, T, H, ...]``; lengths ``[B]``. Returns ``(o [B, T, H, dv], state)``."""
        _check_split(self.mesh, batch=q.shape[0], key_heads=q.shape[2], heads=v.shape[2])
        seq, batch = P("data", None, "model"), P("data")
        out_state = _state_specs(jax.eval_shape(lambda: self.inner.init(
            q.shape[0], v.shape[2], q.shape[-1], v.shape[-1], per_channel_decay=g.ndim == 4, key_heads=k.shape[2])))
        args, in_specs = (q, k, v, g, beta), (seq,) * 5
        names = ["lengths", "state"]
        given = [x for x in (lengths, state) if x is not None]
        in_specs += tuple(batch if n == "lengths" else _state_specs(state)
                          for n, x in zip(names, (lengths, state)) if x is not None)

        def local(q, k, v, g, beta, *rest):
            extra = dict(zip([n for n, x in zip(names, (lengths, state)) if x is not None], rest))
            return self.inner.prefill(q=q, k=k, v=v, g=g, beta=beta, **extra)

        return _shard_map(local, self.mesh, in_specs, (seq, out_state))(*args, *given)


def shard_method(method: Any, mesh: Optional[Mesh]) -> Any:
    """``method`` with its recurrence run per shard on ``mesh`` (``ShardedMethod``); ``method``
    itself without a mesh."""
    if mesh is None or isinstance(method, ShardedMethod):
        return method
    return ShardedMethod(method, mesh)


def shard_batch(ids: Any, mesh: Mesh, *, name: str = "ids") -> jax.Array:
    """``ids [B, ...]`` placed with the batch over ``data``; ``B`` must divide by the data axis."""
    data = mesh.shape["data"]
    if np.shape(ids)[0] % data:
        raise ValueError(f"{name}: a batch of {np.shape(ids)[0]} sequences does not split over the mesh's "
                         f"data axis of {data}")
    return place(ids, NamedSharding(mesh, P("data")))


__all__ = ["AXES", "MODEL_AXIS_COUNTS", "ShardedMethod", "cache_specs", "check_mesh", "constrain_cache", "make_mesh",
           "param_specs", "place", "replicated", "shard_batch", "shard_method", "shard_params", "tensor_parallel_layout", "to_host"]
