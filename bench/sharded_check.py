"""The Pallas kernels per shard, compiled, against the reference recurrence unsharded; the
collectives of the compiled decode step on each mesh.

    python -m bench.sharded_check
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench.sharded_check --collectives

Tiny random models of both architectures (4 value heads), batch 4, 40 tokens (8 prefilled, 32
decoded), on meshes 1x1, 1x2 and 2x1 of the visible devices: ``score`` with the fp32 state and
with LeapQuant-8 (window 4) on ``impl="pallas"`` under ``models.sharding.shard_method``, against
``impl="reference"`` without a mesh. Prints one JSON line per run: ``to_reference``,
``to_fp32`` and ``reference_to_fp32`` (relative logit differences). The fp32 state must match
the reference to round-off; a LeapQuant state as close to the fp32 one as the reference's.

``--collectives``: for ``bench.decode``'s ``tiny-tp`` (Qwen3.5's layers) and ``tiny-kimi``
(Kimi-Linear's, experts over the model axis), on the meshes ``COLLECTIVE_MESHES`` that fit the
visible devices, one JSON line per model, mesh and state with the collectives of one compiled
decode step (``bench.decode.collective_bytes``: count and bytes per kind). Tensor parallelism's
minimum is one all-reduce per mixer and per MLP; anything more is a re-layout.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import numpy as np

from bench.inputs import rel
from leapquant_jax import make_method
from models.base import FULL_ATTENTION, LINEAR_ATTENTION
from models.checkpoint import architecture_for_config
from models.decode import score, to_device
from models.sharding import make_mesh
from models.training.model import hf_config, init_params

MESHES = ((1, 1), (1, 2), (2, 1))
COLLECTIVE_MESHES = ((2, 1), (1, 2), (1, 4), (1, 8), (2, 4))


def tiny(arch: str, heads: int = 4, key_heads: int = 2, layers: int = 4):
    """``(arch, config, params)`` of a tiny random model with ``heads`` linear-attention value heads
    (GDN: ``key_heads`` key heads) and as many attention heads (GDN: ``key_heads`` KV heads), and
    ``layers`` layers: linear attention, the last one softmax attention (4: the tiny size's 3:1)."""
    cj = hf_config(arch, vocab_size=64, eos_token_id=0, size="tiny")
    types = [LINEAR_ATTENTION] * (layers - 1) + [FULL_ATTENTION]
    cj.update(num_hidden_layers=layers, layer_types=types)
    if arch == "kda":
        cj.update(mlp_layer_types=["dense"] * layers)
        cj["linear_attn_config"].update(kda_layers=list(range(1, layers)), full_attn_layers=[layers])
    if arch == "gdn":
        cj.update(linear_num_value_heads=heads, linear_num_key_heads=key_heads, num_attention_heads=heads,
                  num_key_value_heads=key_heads)
    else:
        cj["linear_attn_config"]["num_heads"] = heads
        cj.update(num_attention_heads=heads, num_key_value_heads=heads)
    a = architecture_for_config(cj)
    return a, a.config_from_hf(cj), to_device(init_params(cj, seed=0))


def step_collectives(name: str, mesh_shape: tuple[int, int], state: str = "fp32", *, batch: int = 8) -> dict:
    """The collectives of one decode step of ``bench.decode``'s model ``name`` (its layers one by
    one) with ``state`` on a ``mesh_shape`` mesh, as ``bench.decode.collective_bytes`` counts them
    in the program compiled for the placed weights and cache (``bench.decode.placed_shapes``,
    ``models.sharding.cache_specs``); nothing is allocated or run."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from bench.decode import build_method, collective_bytes, make_steps, model_config, placed_shapes
    from models.sharding import cache_specs

    mesh = make_mesh(*mesh_shape)
    arch, config, _ = model_config(name, None, "fast", scan_layers=False)
    method = build_method(state, mesh)
    cache = jax.eval_shape(lambda: arch.init_cache(config, batch=batch, max_len=16, method=method))
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                         cache, cache_specs(cache, mesh))
    ids = jax.ShapeDtypeStruct((1, batch), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(None, "data")))
    compiled = make_steps(arch, config, method, mesh).lower(placed_shapes(arch, config, mesh), cache, ids).compile()
    return collective_bytes(compiled.as_text())


def collectives_main(states: list) -> int:
    meshes = [m for m in COLLECTIVE_MESHES if m[0] * m[1] <= len(jax.devices())]
    for name in ("tiny-tp", "tiny-kimi"):
        for shape in meshes:
            for state in states:
                print(json.dumps(dict(model=name, mesh=shape, state=state,
                                      collectives=step_collectives(name, shape, state))), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sharded_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--collectives", action="store_true", help="count the collectives of a decode step per mesh")
    ap.add_argument("--states", nargs="+", default=["fp32", "lq8"], help="states for --collectives")
    args = ap.parse_args(argv)
    if args.collectives:
        return collectives_main(args.states)
    ids = np.random.default_rng(0).integers(1, 64, (4, 40))
    meshes = [m for m in MESHES if m[0] * m[1] <= len(jax.devices())]
    for arch in ("gdn", "kda"):
        a, cfg, params = tiny(arch)
        fp32 = score(a, params, cfg, ids, method=make_method("fp32", impl="reference"), prefill_len=8)[0]
        for name in ("fp32", "leapquant"):
            kw = dict(window=4) if name == "leapquant" else {}
            ref = score(a, params, cfg, ids, method=make_method(name, impl="reference", **kw), prefill_len=8)[0]
            for shape in meshes:
                got = score(a, params, cfg, ids, method=make_method(name, impl="pallas", **kw), prefill_len=8,
                            mesh=make_mesh(*shape))[0]
                print(json.dumps(dict(arch=arch, method=name, mesh=shape, to_reference=rel(got, ref),
                                      to_fp32=rel(got, fp32), reference_to_fp32=rel(ref, fp32))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
