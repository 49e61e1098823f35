"""Decoding over a device mesh (``models.sharding``) on 8 forced CPU devices: for both architectures
(tiny configs with 8 heads, two linear-attention layers and an attention layer), the fp32 state
on the meshes 2x4 and 8x1 and the LeapQuant state on 2x4, the sharded logits equal the unsharded
ones (fp32: to round-off; LeapQuant: a different summation order can move a code across a
rounding boundary, so the sharded logits must be as close to fp32's as the unsharded ones),
greedy tokens are the same, and every state leaf is split by head. The Pallas kernels (interpret
mode) run per shard with the layers scanned (the two linear-attention layers as one block), on
the 2x4 mesh (the dense fp32 step on GDN, the LeapQuant step and flush on KDA), against the same
unsharded reference runs. A GDN model with GVA (8 value heads over 4 key heads) checks that
LeapQuant's key records, kept per key head, split over the model axis with the value heads that
read them (reference and kernels on the 2x4 mesh).

The collectives of one compiled decode step (``bench.sharded_check.step_collectives``) of
``bench.decode``'s ``tiny-tp`` (Qwen3.5's layers, the fused GDN projection grouped per shard) and
``tiny-kimi`` (Kimi-Linear's, experts over the model axis): none under data parallelism, and under
tensor parallelism (1x2, 1x4, 1x8, 2x4) one all-reduce per mixer and per MLP and the greedy
token's gather over the vocabulary, nothing else (no re-layout); their logits on those meshes
equal the unsharded ones (the model-only meshes' logits). The checks run in one child process: the
device count is fixed when JAX starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import child_xla_flags

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("sharding")

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json
import jax
import numpy as np
from leapquant_jax import make_method
from models.decode import generate, score
from models.sharding import constrain_cache, make_mesh
from bench.inputs import rel
from bench.sharded_check import tiny as tiny_model

# three layers: two linear-attention layers (a scanned block of two in the kernel runs) and attention
models = {arch: tiny_model(arch, heads=8, key_heads=8, layers=3) for arch in ("gdn", "kda")}
out = {"devices": len(jax.devices()), "runs": []}
ids = np.random.default_rng(0).integers(1, 64, (8, 10))
refs = {}        # unsharded logits per (arch, method), shared with the kernel runs below
for arch in ("gdn", "kda"):
    a, cfg, params = models[arch]
    fp32 = refs[arch, "fp32"] = score(a, params, cfg, ids, method=make_method("fp32"))[0]
    for name in ("fp32", "leapquant"):
        m = make_method(name, window=4) if name == "leapquant" else make_method(name)
        ref = refs[arch, name] = fp32 if name == "fp32" else score(a, params, cfg, ids, method=m)[0]
        # 2x4 splits heads and sequences, 8x1 sequences alone (fp32's only: LeapQuant's state splits
        # as fp32's); the logits on model-only meshes are checked with the collectives below
        for shape in ((2, 4), (8, 1)) if name == "fp32" else ((2, 4),):
            mesh = make_mesh(*shape)
            got = score(a, params, cfg, ids, method=m, mesh=mesh)[0]
            run = {"arch": arch, "method": name, "mesh": shape, "to_unsharded": rel(got, ref),
                   "to_fp32": rel(got, fp32), "unsharded_to_fp32": rel(ref, fp32)}
            if shape == (2, 4):
                prompts = [list(map(int, r[:4])) for r in ids]
                run["same_tokens"] = (generate(a, params, cfg, prompts, method=m, max_new_tokens=5).tokens ==
                                      generate(a, params, cfg, prompts, method=m, max_new_tokens=5, mesh=mesh).tokens)
                cache = jax.jit(lambda: constrain_cache(a.init_cache(cfg, batch=8, max_len=10, method=m), mesh))()
                state = cache["layers"][0]["state"]
                run["state_shards"] = [[list(x.shape), list(x.sharding.shard_shape(x.shape))]
                                       for x in jax.tree.leaves(state)]
            out["runs"].append(run)
# the kernels per shard: Pallas (interpret mode here) under shard_map, scanned layers, against the
# unsharded reference runs above (the same ids)
import dataclasses
from models.base import scan_params
mesh = make_mesh(2, 4)
for arch, name in (("gdn", "fp32"), ("kda", "leapquant")):
    a, cfg, params = models[arch]
    ker_m = make_method(name, window=4, impl="pallas") if name == "leapquant" else make_method(name, impl="pallas")
    ref, fp32 = refs[arch, name], refs[arch, "fp32"]
    scfg = dataclasses.replace(cfg, scan_layers=True)
    got = score(a, scan_params(params, cfg), scfg, ids, method=ker_m, mesh=mesh)[0]
    out["runs"].append({"arch": arch, "method": name + "-pallas", "mesh": [2, 4], "to_unsharded": rel(got, ref),
                        "to_fp32": rel(got, fp32), "unsharded_to_fp32": rel(ref, fp32)})
# GVA: 8 value heads over 4 key heads; LeapQuant's key records [B, 4, p, dk] split over the model
# axis with the value heads, one key head and its two value heads per device
a, cfg, params = tiny_model("gdn", heads=8, key_heads=4, layers=3)
fp32 = score(a, params, cfg, ids, method=make_method("fp32"))[0]
ref = score(a, params, cfg, ids, method=make_method("leapquant", window=4, impl="reference"))[0]
for impl in ("reference", "pallas"):
    m = make_method("leapquant", window=4, impl=impl)
    got = score(a, params, cfg, ids, method=m, mesh=mesh)[0]
    run = {"arch": "gdn-gva", "method": "leapquant" + ("-pallas" if impl == "pallas" else ""), "mesh": [2, 4],
           "to_unsharded": rel(got, ref), "to_fp32": rel(got, fp32), "unsharded_to_fp32": rel(ref, fp32)}
    if impl == "reference":
        cache = jax.jit(lambda: constrain_cache(a.init_cache(cfg, batch=8, max_len=10, method=m), mesh))()
        state = cache["layers"][0]["state"]
        run["state_shards"] = [[list(x.shape), list(x.sharding.shard_shape(x.shape))]
                               for x in jax.tree.leaves(state)]
        run["key_records"] = list(state.buffer.k.shape)
    out["runs"].append(run)
from models.sharding import shard_batch
try:
    shard_batch(np.zeros((3, 2), np.int32), make_mesh(2, 4))
except ValueError as err:
    out["batch_error"] = str(err)
print("RUNS " + json.dumps(out))
'''


COLLECTIVES_CHILD = r'''
import json
import jax
import numpy as np
from leapquant_jax import make_method
from bench.decode import WEIGHT_STD, model_config, placed_shapes
from bench.inputs import rel
from bench.sharded_check import step_collectives
from models.decode import score
from models.sharding import make_mesh

out = {"steps": [], "logits": []}
for name, meshes in (("tiny-tp", ((2, 1), (1, 2), (1, 4), (1, 8), (2, 4))), ("tiny-kimi", ((2, 1), (1, 8), (2, 4)))):
    for shape in meshes:
        out["steps"].append({"model": name, "mesh": shape, "state": "fp32", "layers": 4,
                             "collectives": step_collectives(name, shape)})
out["steps"].append({"model": "tiny-tp", "mesh": (2, 4), "state": "lq8", "layers": 4,
                     "collectives": step_collectives("tiny-tp", (2, 4), "lq8")})
ids = np.random.default_rng(0).integers(1, 64, (8, 6))
for name, meshes in (("tiny-tp", ((1, 2), (1, 4))), ("tiny-kimi", ((1, 8), (2, 4)))):
    arch, config, _ = model_config(name, None, "exact", scan_layers=False)
    rng = np.random.default_rng(1)   # host weights: no program compiled per leaf shape
    params = jax.tree.map(lambda x: (WEIGHT_STD * rng.standard_normal(x.shape)).astype(x.dtype),
                          placed_shapes(arch, config))
    ref = score(arch, params, config, ids, method=make_method("fp32"))[0]
    for shape in meshes:
        got = score(arch, params, config, ids, method=make_method("fp32"), mesh=make_mesh(*shape))[0]
        out["logits"].append({"model": name, "mesh": shape, "to_unsharded": rel(got, ref)})
print("STEPS " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def child() -> dict:
    """Both scripts in one child process (one JAX start): ``{"RUNS": ..., "STEPS": ...}``. The child's
    XLA favours compile time (``helpers.child_xla_flags``), for its sharded and unsharded programs
    alike; the partitioner places the collectives before XLA's backend runs."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {child_xla_flags()}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-c", CHILD + COLLECTIVES_CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    found = {x.split(" ", 1)[0]: json.loads(x.split(" ", 1)[1]) for x in proc.stdout.splitlines()
             if x.startswith(("RUNS ", "STEPS "))}
    assert proc.returncode == 0 and set(found) == {"RUNS", "STEPS"}, proc.stderr[-3000:]
    return found


@pytest.fixture(scope="module")
def runs(child):
    return child["RUNS"]


@pytest.fixture(scope="module")
def steps(child):
    return child["STEPS"]


def test_decode_step_collectives_are_tensor_parallelism_minimum(steps):
    assert len(steps["steps"]) == 9
    for r in steps["steps"]:
        counts = {kind: c["count"] for kind, c in r["collectives"].items()}
        data, model = r["mesh"]
        if model == 1:
            assert counts == {}, r                   # data parallel: each device on its own sequences
            continue
        # one all-reduce after each mixer and each MLP (row-parallel output projections); the
        # greedy token's argmax over the vocabulary split over the model axis gathers its
        # [B, model] maxima and indices; no re-layout of a projection or of the experts
        assert counts == {"all-reduce": 2 * r["layers"], "all-gather": 2}, r


def test_tensor_parallel_logits_match_unsharded(steps):
    assert {(r["model"], tuple(r["mesh"])) for r in steps["logits"]} == {
        ("tiny-tp", (1, 2)), ("tiny-tp", (1, 4)), ("tiny-kimi", (1, 8)), ("tiny-kimi", (2, 4))}
    for r in steps["logits"]:
        assert r["to_unsharded"] < 1e-5, r


def test_sharded_decoding_matches_unsharded(runs):
    assert runs["devices"] == 8
    got = {(r["arch"], r["method"], tuple(r["mesh"])) for r in runs["runs"]}
    assert got == ({(a, "fp32", s) for a in ("gdn", "kda") for s in ((2, 4), (8, 1))}
                   | {(a, "leapquant", (2, 4)) for a in ("gdn", "kda")}
                   | {("gdn", "fp32-pallas", (2, 4)), ("kda", "leapquant-pallas", (2, 4)),
                      ("gdn-gva", "leapquant", (2, 4)), ("gdn-gva", "leapquant-pallas", (2, 4))})
    for r in runs["runs"]:
        if r["method"] in ("fp32", "fp32-pallas"):
            assert r["to_unsharded"] < 1e-5, r
        else:
            # the quantized state is as far from fp32 sharded as unsharded (code flips at rounding
            # boundaries move it, but never by more than the quantization error itself)
            assert 0 < r["unsharded_to_fp32"] and r["to_fp32"] < 1.5 * r["unsharded_to_fp32"], r
            assert r["to_unsharded"] < 1.5 * r["unsharded_to_fp32"], r
        if "same_tokens" in r:
            assert r["same_tokens"], r


def test_every_state_leaf_is_split_by_head_and_batch(runs):
    for r in runs["runs"]:
        if "state_shards" not in r:
            continue
        for shape, shard in r["state_shards"]:     # 2 x 4 mesh: batch 8 -> 4, heads 8 -> 2
            want = [shape[0] // 2] + ([shape[1] // 4] if len(shape) > 1 else []) + shape[2:]
            assert shard == want, (r["arch"], r["method"], shape, shard)
    assert "a batch of 3 sequences does not split over the mesh's data axis of 2" in runs["batch_error"]
    gva = next(r for r in runs["runs"] if r["arch"] == "gdn-gva" and "state_shards" in r)
    assert gva["key_records"] == [8, 4, 4, 16]              # one record per key head, 4 key heads


def test_bad_meshes_are_refused_by_name():
    import numpy as np

    from models.sharding import make_mesh, shard_batch

    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(4, 4, devices=[object()] * 8)
    with pytest.raises(ValueError, match="mesh axis model must be a positive integer"):
        make_mesh(1, 0)
    mesh = make_mesh(1, 1)
    assert shard_batch(np.zeros((3, 2), np.int32), mesh).shape == (3, 2)


def test_meshes_that_do_not_split_the_model_are_refused_by_name():
    import dataclasses

    from bench.decode import model_config
    from models.sharding import check_mesh

    _, tp, _ = model_config("tiny-tp", None, "fast")          # GDN 8 key / 16 value heads, 8 + 8 attention
    _, kimi, _ = model_config("tiny-kimi", None, "fast")      # 8 KDA heads, 8 MLA heads, 8 experts
    cases = [
        (tp, 1, 3, None, "a model axis of 3 does not divide the 16 GDN value heads (linear_num_value_heads)"),
        (dataclasses.replace(tp, linear_num_key_heads=4), 1, 8, None,
         "a model axis of 8 does not divide the 4 GDN key heads (linear_num_key_heads)"),
        (dataclasses.replace(tp, num_attention_heads=12, num_key_value_heads=4), 1, 8, None,
         "a model axis of 8 does not divide the 12 attention heads (num_attention_heads)"),
        (dataclasses.replace(tp, num_key_value_heads=3), 1, 2, None,
         "a model axis of 2 and the 3 KV heads (num_key_value_heads): neither divides the other"),
        (kimi, 1, 3, None, "a model axis of 3 does not divide the 8 KDA heads (kda_num_heads)"),
        (dataclasses.replace(kimi, num_experts=6), 1, 4, None,
         "a model axis of 4 does not divide the 6 routed experts (num_experts)"),
        (tp, 2, 1, 3, "a data axis of 2 does not divide the batch of 3 sequences"),
        (tp, 0, 1, None, "mesh axis data must be a positive integer, got 0"),
        (tp, 1, -2, None, "mesh axis model must be a positive integer, got -2"),
    ]
    for config, data, model, batch, message in cases:
        with pytest.raises(ValueError) as err:
            check_mesh(config, data, model, batch=batch)
        assert str(err.value) == message
    check_mesh(tp, 2, 8, batch=4)
    check_mesh(dataclasses.replace(tp, num_key_value_heads=2), 1, 8)     # KV heads kept whole per group
    check_mesh(dataclasses.replace(kimi, num_experts=6, mlp_types=("dense",) * 4), 1, 4)   # no routed layer


def test_bench_mesh_arguments_are_refused_by_name(capsys):
    from bench import decode, serve

    cases = [
        (decode, ["--models", "tiny-tp", "--mesh", "1", "3"],
         "--mesh 1 3: a model axis of 3 does not divide the 16 GDN value heads (linear_num_value_heads)"),
        (decode, ["--models", "tiny-tp", "--batches", "3", "--mesh", "2", "1"],
         "--mesh 2 1: a data axis of 2 does not divide the batch of 3 sequences"),
        (decode, ["--models", "tiny-tp", "--mesh", "0", "1"], "--mesh 0 1: mesh axis data must be a positive integer"),
        (decode, ["--models", "tiny-tp", "--batches", "64", "--mesh", "64", "1"],
         "--mesh 64 1: a 64 x 1 mesh needs 64 devices"),
        (serve, ["--models", "tiny-kimi", "--batches", "8", "--mesh", "1", "3"],
         "--mesh 1 3: a model axis of 3 does not divide the 8 KDA heads (kda_num_heads)"),
        (serve, ["--models", "tiny-tp", "--batches", "8", "--mesh", "1", "1", "--pool"],
         "--mesh runs static batches (--batches) only: drop --pool and --fit"),
        (serve, ["--models", "tiny-tp", "--batches", "8", "--mesh", "1", "-1"], "argument --mesh: must be >= 1"),
    ]
    for module, argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            module.parse_args(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in err, (argv, err)


def test_parameter_placement_by_name():
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from models.sharding import param_specs

    class FakeMesh:                      # param_specs reads only the axis sizes
        shape = {"data": 2, "model": 4}

    params = {"embed": np.zeros((64, 32)), "lm_head": np.zeros((64, 32)), "final_norm": np.zeros(32),
              "layers": [{"attn": {"q": np.zeros((64, 32)), "o": np.zeros((32, 64)), "q_norm": np.zeros(16),
                                   "k": np.zeros((6, 32))},
                          "moe": {"router": np.zeros((8, 32)), "w1": np.zeros((8, 32, 16)),
                                  "w2": np.zeros((8, 16, 32)), "shared": {"down": np.zeros((32, 48))}}}]}
    specs = param_specs(params, FakeMesh())
    layer = specs["layers"][0]
    assert (specs["embed"], specs["lm_head"], specs["final_norm"]) == (P(), P("model"), P())
    assert (layer["attn"]["q"], layer["attn"]["o"], layer["attn"]["q_norm"]) == (P("model"), P(None, "model"), P())
    assert layer["attn"]["k"] == P()                 # 6 rows do not split 4 ways: replicated
    assert (layer["moe"]["router"], layer["moe"]["w1"], layer["moe"]["w2"]) == (P(), P("model"), P("model"))
    assert layer["moe"]["shared"]["down"] == P(None, "model")
