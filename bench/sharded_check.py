"""The Pallas kernels per shard, compiled, against the reference recurrence unsharded.

    python -m bench.sharded_check

Tiny random models of both architectures (4 value heads), batch 4, 40 tokens (8 prefilled, 32
decoded), on meshes 1x1, 1x2 and 2x1 of the visible devices: ``score`` with the fp32 state and
with LeapQuant-8 (window 4) on ``impl="pallas"`` under ``models.sharding.shard_method``, against
``impl="reference"`` without a mesh. Prints one JSON line per run: ``to_reference``,
``to_fp32`` and ``reference_to_fp32`` (relative logit differences). The fp32 state must match
the reference to round-off; a LeapQuant state as close to the fp32 one as the reference's.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from bench.inputs import rel
from leapquant_jax import make_method
from models.checkpoint import architecture_for_config
from models.decode import score, to_device
from models.sharding import make_mesh
from models.training.model import hf_config, init_params

MESHES = ((1, 1), (1, 2), (2, 1))


def tiny(arch: str, heads: int = 4, key_heads: int = 2):
    """``(arch, config, params)`` of a tiny random model with ``heads`` linear-attention value heads
    (GDN: ``key_heads`` key heads) and as many attention heads (GDN: ``key_heads`` KV heads)."""
    cj = hf_config(arch, vocab_size=64, eos_token_id=0, size="tiny")
    if arch == "gdn":
        cj.update(linear_num_value_heads=heads, linear_num_key_heads=key_heads, num_attention_heads=heads,
                  num_key_value_heads=key_heads)
    else:
        cj["linear_attn_config"]["num_heads"] = heads
        cj.update(num_attention_heads=heads, num_key_value_heads=heads)
    a = architecture_for_config(cj)
    return a, a.config_from_hf(cj), to_device(init_params(cj, seed=0))


def main() -> int:
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
