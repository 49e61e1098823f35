"""Decoding across devices with ``jax.sharding``: a ``("data", "model")`` mesh, weights and caches
placed on it, and the cache held to its layout inside the compiled decode loop.

* ``make_mesh(data, model)``: the first ``data * model`` devices as a ``Mesh`` with axes
  ``("data", "model")``: sequences split over ``data``, heads and channels over ``model``.
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
  also over ``model`` along their head axis, so no device holds another's heads; attention KV
  caches along their head axis and the short-convolution buffers along their channels; MLA's
  latent cache over ``data`` only.

``models.decode.score`` and ``generate`` take ``mesh=``: the weights are placed by
``param_specs``, the batch over ``data``, and the cache is constrained to ``cache_specs`` where it
is made and after every step, so XLA's partitioner (GSPMD) runs each device's part of every layer
and inserts the collectives. On a GPU the Pallas kernels are custom calls the partitioner cannot
split: a sharded decode there runs the reference recurrence (``impl="reference"``) until the
kernels run per shard under ``shard_map`` (``check_method`` refuses anything else there).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.base import STACKED_SECTIONS

AXES = ("data", "model")
# Leaf names split along their output axis (0) and along their input axis (1); the rest replicate.
COLUMN_PARALLEL = frozenset({"q", "k", "v", "qkv", "z", "a", "b", "gate", "up", "f_b", "g_b", "g_b_bias", "kv_b",
                             "conv", "q_conv", "k_conv", "v_conv", "a_log", "dt_bias", "lm_head"})
ROW_PARALLEL = frozenset({"o", "out", "down"})


def make_mesh(data: int, model: int, devices: Optional[list] = None) -> Mesh:
    """A ``data x model`` mesh over the first ``data * model`` of ``devices`` (default ``jax.devices()``)."""
    for name, n in (("data", data), ("model", model)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"mesh axis {name} must be a positive integer, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    if data * model > len(devices):
        raise ValueError(f"a {data} x {model} mesh needs {data * model} devices, but {len(devices)} are available "
                         "(on the CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)")
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), AXES)


def _split(shape: tuple, axis: int, size: int) -> bool:
    return len(shape) > axis and shape[axis] % size == 0


def _param_spec(keys: list, shape: tuple, model: int) -> P:
    name = keys[-1]
    if "moe" in keys and len(shape) == 3:                     # routed experts [E, ...]: experts over model
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


def shard_params(params: Any, mesh: Mesh) -> Any:
    """``params`` placed on ``mesh`` by ``param_specs``."""
    specs = param_specs(params, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


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


def constrain_cache(cache: Any, mesh: Optional[Mesh]) -> Any:
    """Inside ``jit``: ``cache`` held to ``cache_specs`` on ``mesh`` (the identity without a mesh)."""
    if mesh is None:
        return cache
    specs = cache_specs(cache, mesh)
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), cache, specs)


def check_method(method: Any) -> None:
    """Raises ``ValueError`` for a state method a sharded decode cannot run here: on a GPU, a
    windowed method whose ``impl`` may pick the Pallas kernels (they are not split per shard yet)."""
    config = getattr(method, "config", None)
    if config is not None and getattr(config, "impl", "reference") != "reference" and jax.default_backend() == "gpu":
        raise ValueError(f"a sharded decode on GPUs runs the reference recurrence: build {method.name!r} with "
                         f"impl='reference' (got impl={config.impl!r}; the Pallas kernels do not run per shard yet)")


def shard_batch(ids: Any, mesh: Mesh, *, name: str = "ids") -> jax.Array:
    """``ids [B, ...]`` placed with the batch over ``data``; ``B`` must divide by the data axis."""
    data = mesh.shape["data"]
    if np.shape(ids)[0] % data:
        raise ValueError(f"{name}: a batch of {np.shape(ids)[0]} sequences does not split over the mesh's "
                         f"data axis of {data}")
    return jax.device_put(ids, NamedSharding(mesh, P("data")))


__all__ = ["AXES", "cache_specs", "check_method", "constrain_cache", "make_mesh", "param_specs", "shard_batch", "shard_params"]
