"""Continuous batching (``models.serving``) and prefix states (``models.prefix_state``) on tiny
random models of both architectures (GDN and KDA: two linear-attention layers, then one full
attention), with the fp32 state and 8-bit LeapQuant.

* ``serve`` with fewer slots than requests gives every request the tokens ``generate`` gives it
  alone, and the pool's step is traced once however slots fill and empty.
* save -> file -> restore (into another slot, another sequence beside it) -> continue gives the
  logits of uninterrupted decoding bit for bit, a LeapQuant state taken at its last window
  boundary with the prompt's last tokens pending included; the same across the scanned layout.
* damaged files, files of another model or method, and saves off a LeapQuant window boundary are
  refused by name, with the pool and any existing file left as they were.
* ``checkpoint_every`` and ``leapquant generate --save-state / --load-state`` (prompts on and off
  a window boundary: the tokens of a plain ``generate``), ``--compute`` and its refusal on load.

The pools hold ``bucket + MAX_NEW`` positions (what ``generate`` allocates for a prompt of one
bucket), and all tests share the pools of a module fixture: each program compiles once. The
command-line tests write each model once as a checkpoint, and the prompts of a test share one
bucket, so that each of its programs compiles once too.
"""

from __future__ import annotations

import collections
import dataclasses
import json

import numpy as np
import pytest

from leapquant_jax import make_method
from models import prefix_state as ps
from models.base import scan_params
from models.checkpoint import architecture_for_config, save_converted
from models.decode import PROMPT_BUCKET, generate, to_device
from models.serving import DecodePool, PoolConfig, serve, serve_requests
from models.training.model import hf_config, init_params

from helpers import rel

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serving")

VOCAB = 64
MAX_NEW = 24
MAX_LEN = PROMPT_BUCKET + MAX_NEW
SLOTS = 3
WINDOW = 16  # LeapQuant's default window p
METHODS = {"fp32": make_method("fp32"), "leapquant": make_method("leapquant", bits=8)}


def tiny_json(arch: str) -> dict:
    cj = hf_config(arch, vocab_size=VOCAB, eos_token_id=0, size="tiny")
    types = ["linear_attention", "linear_attention", "full_attention"]
    cj.update(num_hidden_layers=3, layer_types=types, initializer_range=0.2)  # decisive logits, varied tokens
    if arch == "kda":
        cj["mlp_layer_types"] = ["dense"] * 3
        cj["linear_attn_config"].update(kda_layers=[1, 2], full_attn_layers=[3])
    return cj


class CountingArch:
    """An architecture that counts its traced forward passes by (mode, method, scanned, ids shape):
    under ``jit`` the forward runs only while a program is traced."""

    def __init__(self, arch):
        self.arch = arch
        self.traces = collections.Counter()

    def init_cache(self, config, **kw):
        return self.arch.init_cache(config, **kw)

    def forward(self, params, config, ids, cache, *, method, mode, **kw):
        self.traces[(mode, method.name, config.scan_layers, tuple(ids.shape))] += 1
        return self.arch.forward(params, config, ids, cache, method=method, mode=mode, **kw)


class Tiny:
    """One architecture: its model, a second one of other weights, and the shared pools."""

    def __init__(self, name: str):
        self.name = name
        self.config_json = tiny_json(name)
        self.arch = architecture_for_config(self.config_json)
        self.counting = CountingArch(self.arch)
        self.config = self.arch.config_from_hf(self.config_json)
        self.params = to_device(init_params(self.config_json, seed=0))
        self.other_params = to_device(init_params(self.config_json, seed=1))
        self.scanned_config = dataclasses.replace(self.config, scan_layers=True)
        self.scanned_params = scan_params(self.params, self.scanned_config)
        self._pools = {}

    def pool(self, method: str, *, scanned: bool = False, other: bool = False) -> DecodePool:
        """The shared pool of ``SLOTS`` x ``MAX_LEN`` (emptied)."""
        key = (method, scanned, other)
        if key not in self._pools:
            config, params = (self.scanned_config, self.scanned_params) if scanned else (self.config, self.params)
            self._pools[key] = DecodePool(self.counting, self.other_params if other else params, config,
                                          method=METHODS[method], pool=PoolConfig(slots=SLOTS, max_len=MAX_LEN))
        pool = self._pools[key]
        for slot in np.flatnonzero(pool.active):
            pool.evict(int(slot))
        return pool

    def alone(self, prompt, method: str, stop_ids=()) -> list[int]:
        return generate(self.arch, self.params, self.config, [list(prompt)], method=METHODS[method],
                        max_new_tokens=MAX_NEW, stop_ids=stop_ids).tokens[0]


@pytest.fixture(scope="module", params=("gdn", "kda"))
def tiny(request):
    return Tiny(request.param)


@pytest.fixture(scope="module")
def gdn():
    """The GDN model alone, for the tests that need one architecture (its programs are shared
    with ``tiny``'s through the same config and architecture)."""
    return Tiny("gdn")


def prompts_for(rng, n: int, *, low: int = 1) -> list[list[int]]:
    return [rng.integers(0, VOCAB, int(t)).tolist() for t in rng.integers(low, PROMPT_BUCKET + 1, n)]


def leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.array(x) for x in jax.tree.leaves(tree)]


def run_steps(pool: DecodePool, slot: int, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Steps the pool; returns the slot's tokens and next-token logits after each step."""
    tokens, logits = [], []
    for _ in range(steps):
        tokens.append(int(pool.step()[slot]))
        logits.append(np.array(pool.logits[slot]))
    return tokens, logits


# ----------------------------------------------------------------------------- continuous batching


@pytest.mark.parametrize("method", list(METHODS))
def test_serve_matches_generate_alone_and_traces_the_step_once(tiny, method):
    rng = np.random.default_rng([7, len(tiny.name), len(method)])
    prompts = prompts_for(rng, 7)
    full = [tiny.alone(p, method) for p in prompts]
    # A stop token that ends about half of the requests early, so that slots free at different steps.
    candidates = collections.Counter(t for toks in full for t in set(toks[1:-1]))
    stop = min(candidates, key=lambda t: (abs(sum(t in toks[:-1] for toks in full) - len(full) // 2), t))
    alone = [tiny.alone(p, method, stop_ids=[stop]) for p in prompts]
    lengths = [len(t) for t in alone]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths

    pool = tiny.pool(method)
    assert serve(pool, prompts, max_new_tokens=MAX_NEW, stop_ids=[stop]) == alone
    assert not pool.active.any()
    traced = {k: n for k, n in tiny.counting.traces.items() if k[1] == METHODS[method].name and not k[2]}
    assert traced == {("prefill", METHODS[method].name, False, (1, PROMPT_BUCKET)): 1,
                      ("decode", METHODS[method].name, False, (SLOTS, 1)): 1}


def test_pool_refuses_what_does_not_fit(tiny):
    pool = tiny.pool("fp32")
    with pytest.raises(ValueError, match="max_len = 40"):
        pool.insert([1] * 17, budget=MAX_NEW + 1)
    with pytest.raises(ValueError, match="vocabulary"):
        pool.insert([1, VOCAB], budget=2)
    for _ in range(SLOTS):
        pool.insert([1, 2, 3], budget=2)
    with pytest.raises(ValueError, match=f"no free slot: all {SLOTS} slots are in use"):
        pool.insert([1, 2, 3], budget=2)
    with pytest.raises(ValueError, match="slot 1 is in use"):
        pool.restore(pool.save(0), budget=2, slot=1)
    pool.evict(1)
    with pytest.raises(ValueError, match="slot 1 is free"):
        pool.evict(1)
    with pytest.raises(ValueError, match="serve needs an empty pool"):
        serve(pool, [[1]], max_new_tokens=1)


# ----------------------------------------------------------------------------- faults


class PoisonArch:
    """The model with its logits made NaN at position ``at``: in decode steps for the rows feeding
    the token at that position, in prefill for prompts of ``at`` tokens. Only the sequences that
    reach it meet the fault."""

    def __init__(self, arch, at: int):
        self.arch, self.at = arch, at

    def init_cache(self, config, **kw):
        return self.arch.init_cache(config, **kw)

    def forward(self, params, config, ids, cache, *, method, mode, lengths=None, **kw):
        import jax.numpy as jnp

        logits, new, traces = self.arch.forward(params, config, ids, cache, method=method, mode=mode,
                                                lengths=lengths, **kw)
        bad = cache["pos"] == self.at if mode == "decode" else lengths == self.at
        return jnp.where(bad[:, None, None], jnp.nan, logits), new, traces


def test_a_bad_request_is_refused_by_name_and_the_other_slots_go_on(gdn):
    rng = np.random.default_rng(41)
    prompts = prompts_for(rng, 4)
    want = [gdn.alone(p, "fp32") for p in prompts]
    pool = gdn.pool("fp32")
    requests = [prompts[0], [3, VOCAB + 5], prompts[1], [1] * (MAX_LEN + 1), "abc", None, prompts[2], prompts[3]]
    served = serve_requests(pool, requests, max_new_tokens=MAX_NEW)
    assert [served[i].error for i in (1, 3, 4, 5)] == [
        f"requests[1][1] = {VOCAB + 5} is outside the vocabulary [0, {VOCAB})",
        f"requests[3] ({MAX_LEN + 1} tokens) and {MAX_NEW} new tokens need {MAX_LEN + MAX_NEW} positions, more than "
        f"the pool's max_len = {MAX_LEN}",
        "requests[4] must hold integer token ids, got the string 'abc'",
        "requests[5] must be a sequence of token ids, got None"]
    good = [served[i] for i in (0, 2, 6, 7)]
    assert [list(r.tokens) for r in good] == want and all(r.error is None for r in good)
    assert all(0 <= r.start_s <= r.first_token_s <= r.end_s for r in good)
    assert not pool.active.any() and not pool.faults

    # In a running pool: a refused insert changes nothing, and the slots in use go on.
    pool.insert(prompts[0], budget=MAX_NEW, slot=0)
    pool.insert(prompts[1], budget=MAX_NEW, slot=2)
    got = {0: [int(pool.pending[0])], 2: [int(pool.pending[2])]}
    for i in range(MAX_NEW - 1):
        if i == 5:
            with pytest.raises(ValueError, match=f"prompt\\[1\\] = {VOCAB} is outside the vocabulary"):
                pool.insert([1, VOCAB], budget=2)
            with pytest.raises(ValueError, match=f"more than the pool's max_len = {MAX_LEN}"):
                pool.insert([1] * MAX_LEN, budget=2)
            assert pool.active.tolist() == [True, False, True]
        nxt = pool.step()
        for slot in got:
            got[slot].append(int(nxt[slot]))
    assert [got[0], got[2]] == want[:2]


def test_a_slot_whose_logits_turn_non_finite_is_ended_and_reported_and_the_others_go_on(gdn):
    """Logits turn NaN at position 16: request 1 reaches it in a decode step (ended after 17
    tokens), request 4's prompt has 16 tokens (refused at its prefill); the rest never reach it."""
    from models.serving import PoolFault, decode_slot

    rng = np.random.default_rng(43)
    at = PROMPT_BUCKET
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (4, 6, 8, 5, at)]
    budgets = [10, MAX_NEW, 8, 10, 4]
    want = [gdn.alone(p, "fp32")[:b] for p, b in zip(prompts, budgets)]
    pool = DecodePool(PoisonArch(gdn.arch, at), gdn.params, gdn.config, method=METHODS["fp32"],
                      pool=PoolConfig(slots=SLOTS, max_len=MAX_LEN))
    served = serve_requests(pool, prompts, max_new_tokens=budgets)
    assert served[1].error == "requests[1]: slot 1 ended after 17 tokens: its next-token logits are not finite"
    assert list(served[1].tokens) == want[1][:at - len(prompts[1]) + 1]  # the tokens before the fault
    assert served[4].error == (f"requests[4]: the logits after the prompt ({at} tokens) are not finite; "
                               "the prompt was not admitted")
    assert [list(served[i].tokens) for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert all(served[i].error is None for i in (0, 2, 3))
    assert [(f.slot, f.tokens) for f in pool.faults] == [(1, at + 1)]
    assert not pool.active.any()
    assert all(np.isfinite(x).all() for x in leaves(pool.cache) if np.issubdtype(x.dtype, np.floating))
    assert np.isfinite(np.asarray(pool.logits)).all()

    with pytest.raises(PoolFault, match=r"requests\[1\]: slot 1 ended after 17 tokens.*requests\[4\]: the logits"):
        serve(pool, prompts, max_new_tokens=budgets)
    slot = pool.insert(prompts[1], budget=MAX_NEW)
    with pytest.raises(PoolFault, match=f"slot {slot} ended after 17 tokens"):
        decode_slot(pool, slot, max_new_tokens=MAX_NEW)
    assert not pool.active.any()


def test_a_slot_whose_state_turns_non_finite_is_ended_and_the_others_go_past_a_flush(gdn):
    """A LeapQuant pool: one slot's cache rows set to NaN mid-window; it ends at the next step, and
    the other two decode through their window's flush (computed for every row) to the tokens they
    decode alone. The slot then serves a new request."""
    import jax
    import jax.numpy as jnp

    from models.base import put_rows, take_rows
    from models.serving import decode_slot

    rng = np.random.default_rng(47)
    prompts = prompts_for(rng, 4, low=3)
    want = [gdn.alone(p, "leapquant") for p in prompts]
    pool = gdn.pool("leapquant")
    known = len(pool.faults)
    for p in prompts[:3]:
        pool.insert(p, budget=MAX_NEW)
    got = [[int(t)] for t in pool.pending]
    for i in range(MAX_NEW - 1):
        if i == 2:
            rows = jnp.asarray([1], jnp.int32)
            nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                               take_rows(pool.cache, rows))
            pool.cache = put_rows(pool.cache, rows, nan)
        nxt = pool.step()
        if i == 2:
            assert pool.active.tolist() == [True, False, True]
            assert [(f.slot, f.tokens) for f in pool.faults[known:]] == [(1, len(prompts[1]) + 3)]
        for slot in (0, 2) if i >= 2 else (0, 1, 2):
            got[slot].append(int(nxt[slot]))
    assert [got[0], got[2]] == [want[0], want[2]]
    assert got[1] == want[1][:3]
    pool.evict(0)
    pool.evict(2)
    assert decode_slot(pool, pool.insert(prompts[3], budget=MAX_NEW, slot=1), max_new_tokens=MAX_NEW) == want[3]


# ----------------------------------------------------------------------------- save and restore


@pytest.mark.parametrize("method", list(METHODS))
def test_save_restore_continue_is_bit_exact(tiny, method, tmp_path):
    rng = np.random.default_rng([11, len(tiny.name), len(method)])
    # LeapQuant keeps a prompt shorter than its window as the empty state and 13 pending ids (the
    # command-line test below takes one past a window, the state after one window and 5 pending).
    prompt = rng.integers(0, VOCAB, 13 if method == "leapquant" else int(rng.integers(1, 17))).tolist()
    budget = MAX_LEN - len(prompt)
    pool = tiny.pool(method)
    whole = pool.insert(prompt, budget=budget, slot=0)  # the whole prompt prefilled, as generate does
    prefix = pool.boundary_state(prompt)
    boundary = 0 if method == "leapquant" else len(prompt)
    assert prefix.ids.tolist() == prompt[:boundary] and prefix.pending.tolist() == prompt[boundary:]
    assert prefix.all_ids.tolist() == prompt and prefix.compute == "exact"
    if method == "leapquant":
        assert not [n for n in prefix.leaves if "buffer" in n or n.endswith("state.pos")]
        assert any(n.endswith("state.checkpoint.residual.codes") for n in prefix.leaves)
        assert prefix.logits.shape == (0,)
    src = pool.restore(prefix, budget=budget, slot=1)
    if method == "fp32":  # no pending ids: the slot is the prefill's, what save takes again
        again = pool.save(src)
        assert np.array_equal(again.logits, prefix.logits) and np.array_equal(again.logits, pool.logits[src])
        assert all(np.array_equal(again.leaves[n], x) for n, x in prefix.leaves.items())
    pending = int(pool.pending[src])
    # The steps run past the next window boundary (a flush) from the restored checkpoint.
    steps = [(pool.step(), np.array(pool.logits)) for _ in range(budget - 1)]
    want_tokens, want_logits = [int(t[src]) for t, _ in steps], [x[src] for _, x in steps]
    # Against the whole-prompt prefill: a per-step state is the same computation; LeapQuant's
    # decode steps round differently (relative logit differences of about 1e-5 after the prompt;
    # a later flush can round a residual code of the two states apart, up to 2e-3), in the same
    # tokens.
    assert [int(t[whole]) for t, _ in steps] == want_tokens
    error = max(rel(x[whole], x[src]) for _, x in steps)
    assert error == 0 if method == "fp32" else 0 < error < 1e-2

    loaded = ps.load_prefix(ps.save_prefix(tmp_path / "prefix.safetensors", prefix))
    assert loaded.pending.tolist() == prefix.pending.tolist() and loaded.compute == prefix.compute
    pool = tiny.pool(method)
    pool.insert(prompts_for(rng, 1)[0], budget=MAX_NEW, slot=1)
    dst = pool.restore(loaded, budget=budget, slot=2)
    assert int(pool.pending[dst]) == pending and pool.ids(dst) == prompt
    got_tokens, got_logits = run_steps(pool, dst, budget - 1)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits):
        assert np.array_equal(want, got)


def test_scanned_layout_serves_and_exchanges_prefix_states(tiny):
    rng = np.random.default_rng([13, len(tiny.name)])
    prompts = prompts_for(rng, 4)
    scanned = tiny.pool("fp32", scanned=True)
    assert "blocks" in scanned.cache
    assert serve(scanned, prompts, max_new_tokens=MAX_NEW) == [tiny.alone(p, "fp32") for p in prompts]
    assert tiny.counting.traces[("decode", "fp32", True, (SLOTS, 1))] == 1

    # A prefix state taken in one layout restores in the other: the same leaves, the same tokens.
    scanned.insert(prompts[0], budget=MAX_NEW, slot=0)
    from_scanned = scanned.save(0)
    want_tokens, _ = run_steps(scanned, 0, 12)
    flat = tiny.pool("fp32")
    flat.insert(prompts[0], budget=MAX_NEW, slot=2)
    from_flat = flat.save(2)
    assert sorted(from_scanned.leaves) == sorted(from_flat.leaves)
    assert from_scanned.fingerprint == from_flat.fingerprint
    flat.evict(2)
    flat.restore(from_scanned, budget=MAX_NEW, slot=1)
    assert run_steps(flat, 1, 12)[0] == want_tokens


# ----------------------------------------------------------------------------- refusals


def flip(path, old: bytes, new: bytes, out):
    data = path.read_bytes()
    assert data.count(old) >= 1
    out.write_bytes(data.replace(old, new, 1))
    return out


def test_damaged_and_foreign_files_are_refused_and_change_nothing(tiny, tmp_path):
    rng = np.random.default_rng([17, len(tiny.name)])
    prompt = rng.integers(0, VOCAB, WINDOW).tolist()
    pool = tiny.pool("leapquant")
    good = ps.save_prefix(tmp_path / "good.safetensors", pool.save(pool.insert(prompt, budget=MAX_NEW)))
    pool.evict(0)
    pool.insert(prompts_for(rng, 1)[0], budget=MAX_NEW, slot=1)
    before, active = leaves(pool.cache), pool.active

    data = good.read_bytes()
    header = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + header])["__metadata__"]
    (tmp_path / "truncated.safetensors").write_bytes(data[:-7])
    fingerprint = meta["fingerprint"].encode()
    flipped_meta = flip(good, fingerprint, fingerprint[:-1] + (b"0" if fingerprint[-1:] != b"0" else b"1"),
                        tmp_path / "meta.safetensors")
    damaged = bytearray(data)
    damaged[-3] ^= 0x40  # a byte of the arrays
    (tmp_path / "bytes.safetensors").write_bytes(bytes(damaged))
    for bad, words in ((tmp_path / "truncated.safetensors", "not a readable prefix-state file"),
                       (flipped_meta, "damaged"), (tmp_path / "bytes.safetensors", "damaged")):
        with pytest.raises(ps.PrefixStateError, match=words):
            ps.load_prefix(bad)

    other_model = tiny.pool("leapquant", other=True)
    foreign_weights = other_model.save(other_model.insert(prompt, budget=MAX_NEW))
    fp32 = tiny.pool("fp32")
    foreign_method = fp32.save(fp32.insert(prompt, budget=MAX_NEW))
    foreign_compute = dataclasses.replace(ps.load_prefix(good), compute="fast")
    for prefix, words in ((foreign_weights, "another model"), (foreign_method, "state method"),
                          (foreign_compute, "made with compute='fast' and this model runs with compute='exact'")):
        loaded = ps.load_prefix(ps.save_prefix(tmp_path / f"{words[:13]}.safetensors", prefix))
        with pytest.raises(ps.PrefixStateError, match=words):
            pool.restore(loaded, budget=MAX_NEW, slot=0)
    assert np.array_equal(pool.active, active)
    assert all(np.array_equal(x, y) for x, y in zip(before, leaves(pool.cache)))

    with pytest.raises(FileExistsError, match="not overwriting"):
        ps.save_prefix(good, foreign_method)
    assert good.read_bytes() == data
    ps.save_prefix(good, foreign_method, overwrite=True)
    assert ps.load_prefix(good).method == repr(METHODS["fp32"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_file_keeps_dtypes_safetensors_lacks(tmp_path):
    import jax.numpy as jnp

    rng = np.random.default_rng(31)
    arrays = {"a.bf16": rng.standard_normal((1, 3, 5)).astype(jnp.bfloat16),
              "a.fp8": rng.standard_normal((1, 4)).astype(jnp.float8_e4m3fn),
              "b.int8": rng.integers(-128, 128, (1, 2, 2)).astype(np.int8), "pos": np.array([3], np.int32)}
    prefix = ps.PrefixState(ids=rng.integers(0, VOCAB, 3).astype(np.int32), logits=rng.standard_normal(VOCAB)
                            .astype(np.float32), leaves=arrays, fingerprint="f" * 64, method="m", model_type="t",
                            compute="fast", pending=np.array([5, 7], np.int32))
    back = ps.load_prefix(ps.save_prefix(tmp_path / "prefix.safetensors", prefix))
    assert sorted(back.leaves) == sorted(arrays)
    for name, x in arrays.items():
        got = back.leaves[name]
        assert got.dtype == x.dtype and got.tobytes() == x.tobytes()
    assert np.array_equal(back.ids, prefix.ids) and np.array_equal(back.logits, prefix.logits)
    assert back.pending.tolist() == [5, 7] and back.compute == "fast" and back.nbytes == prefix.nbytes
    # The pending ids are covered by the digest.
    data = (tmp_path / "prefix.safetensors").read_bytes()
    (tmp_path / "pending.safetensors").write_bytes(data.replace(np.array([5, 7], np.int32).tobytes(),
                                                                np.array([5, 8], np.int32).tobytes(), 1))
    with pytest.raises(ps.PrefixStateError, match="damaged"):
        ps.load_prefix(tmp_path / "pending.safetensors")


def test_prefix_files_keep_the_checkpoint_not_the_window_buffer(gdn):
    # The GDN model has GVA (2 value heads, 1 key head): its live LeapQuant streams keep one key
    # record per key head. A prefix keeps a stream's checkpoint alone, so what a file holds does
    # not depend on the buffer's layout (files written when keys were kept per value head hold
    # the same leaves), and a restore makes the buffer afresh.
    import jax

    method = METHODS["leapquant"]
    shapes, _ = ps._layout(gdn.arch, gdn.config, method)
    state_leaves = [name for name in shapes if ".state." in name]
    assert state_leaves and all(".state.checkpoint." in name for name in state_leaves)
    cache = jax.eval_shape(lambda: gdn.arch.init_cache(gdn.config, batch=1, max_len=4, method=method))
    buffer = cache["layers"][0]["state"].buffer
    assert buffer.k.shape[1] == gdn.config.linear_num_key_heads < buffer.u.shape[1] == gdn.config.linear_num_value_heads


def test_save_is_refused_off_a_window_boundary(tiny):
    rng = np.random.default_rng([19, len(tiny.name)])
    pool = tiny.pool("leapquant")
    short = pool.insert(rng.integers(0, VOCAB, 5).tolist(), budget=MAX_NEW)
    with pytest.raises(ps.PrefixStateError, match=f"holds 5 records of its {WINDOW}-record window after 5 tokens"):
        pool.save(short)
    window = pool.insert(rng.integers(0, VOCAB, WINDOW).tolist(), budget=MAX_NEW)
    pool.save(window)
    for _ in range(3):
        pool.step()
    with pytest.raises(ps.PrefixStateError, match=f"holds 3 records of its {WINDOW}-record window after 19 tokens"):
        pool.save(window)


def test_boundary_state_of_a_short_or_continued_sequence(gdn):
    """Shorter than one window: the empty state, every token pending. After a prefix: the state at
    the sequence's new last boundary, reached by decode steps from the prefix's state, which
    restores to the logits of the prefix restored and fed the same tokens, bit for bit."""
    rng = np.random.default_rng(37)
    first, more = rng.integers(0, VOCAB, 5).tolist(), rng.integers(0, VOCAB, 14).tolist()
    pool = gdn.pool("leapquant")
    short = pool.boundary_state(first)
    assert short.length == 0 and short.pending.tolist() == first and short.logits.shape == (0,)
    assert all(x.shape[1] == 0 for n, x in short.leaves.items() if n.startswith("layers.2."))  # no k, v rows
    with pytest.raises(ps.PrefixStateError, match="holds no token"):
        pool.restore(dataclasses.replace(short, pending=short.pending[:0]), budget=2)

    later = pool.boundary_state(more, prefix=short)
    assert later.ids.tolist() == (first + more)[:WINDOW] and later.pending.tolist() == (first + more)[WINDOW:]
    assert not pool.active.any()
    fed = pool.restore(short, budget=MAX_LEN - 19, slot=0)
    pool.feed(fed, more)
    restored = pool.restore(later, budget=MAX_LEN - 19, slot=1)
    assert pool.ids(fed) == pool.ids(restored) == first + more
    assert np.array_equal(pool.logits[fed], pool.logits[restored])
    for _ in range(MAX_LEN - 19 - 1):
        assert len(set(pool.step()[[fed, restored]].tolist())) == 1
        assert np.array_equal(pool.logits[fed], pool.logits[restored])


# ----------------------------------------------------------------------------- prefix caching


def test_checkpoint_every_keeps_restorable_prefix_states(gdn):
    method = METHODS["leapquant"]
    ids = np.random.default_rng(23).integers(0, VOCAB, 2 * WINDOW + 7)
    cps = ps.checkpoint_every(gdn.arch, gdn.params, gdn.config, ids, method=method)
    assert cps.positions == (WINDOW, 2 * WINDOW)
    first, second = cps.states
    assert second.ids.tolist() == ids[: 2 * WINDOW].tolist()
    # The recurrent part keeps its size; attention rows grow with the prefix.
    kv = [n for n in first.leaves if n.startswith("layers.2.")]  # the attention layer's k, v
    assert len(kv) == 2 and all(first.leaves[n].shape[1] == WINDOW for n in kv)
    assert all(second.leaves[n].shape[1] == 2 * WINDOW for n in kv)
    grown = sum(first.leaves[n].nbytes for n in kv) + first.ids.nbytes
    assert cps.nbytes == (first.nbytes, first.nbytes + grown) and cps.total_bytes == sum(cps.nbytes)
    # Restoring the first and decoding the next window rebuilds the second bit for bit.
    cache = ps.restore_cache(gdn.arch, gdn.params, gdn.config, first, method=method, max_len=ids.shape[0])
    logits, cache = ps.decode_tokens(gdn.arch, gdn.params, gdn.config, cache, ids[None, WINDOW: 2 * WINDOW],
                                     method=method)
    again = ps.take_prefix(gdn.arch, gdn.params, gdn.config, cache, 0, method=method, ids=ids[: 2 * WINDOW],
                           logits=logits[0, -1])
    assert np.array_equal(again.logits, second.logits)
    assert sorted(again.leaves) == sorted(second.leaves)
    assert all(np.array_equal(again.leaves[n], second.leaves[n]) for n in second.leaves)
    with pytest.raises(ValueError, match="multiple of the method's window p = 16"):
        ps.checkpoint_every(gdn.arch, gdn.params, gdn.config, ids, method=method, every=24)


# ----------------------------------------------------------------------------- the CLI


def cli(capsys, *argv):
    from leapquant_cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


CHECKPOINTS = {}


def checkpoint_of(tiny: Tiny, tmp_path_factory):
    """``tiny``'s model written as a converted checkpoint, once per architecture."""
    if tiny.name not in CHECKPOINTS:
        CHECKPOINTS[tiny.name] = save_converted(tmp_path_factory.mktemp(f"ckpt-{tiny.name}") / "ckpt",
                                                config_json=tiny.config_json,
                                                params=init_params(tiny.config_json, seed=0))
    return CHECKPOINTS[tiny.name]


def generated(capsys, *argv) -> tuple[list, dict]:
    code, out, err = cli(capsys, *argv)
    assert code == 0, err
    result = json.loads(out)
    return result["generated_ids"], result


# Per method: the --compute of the command-line runs and their prompt lengths, each test's in one
# bucket. LeapQuant under the default (fast) on a window boundary and off it (the state after one
# window, 5 tokens pending); fp32, whose window is one token, under exact, in the programs of the
# tests above.
CLI_RUNS = {"leapquant": ("fast", (2 * WINDOW, WINDOW + 5)), "fp32": ("exact", (9, PROMPT_BUCKET))}


@pytest.mark.parametrize("method", list(METHODS))
def test_generate_from_a_saved_state_gives_the_tokens_of_plain_generate(tiny, method, tmp_path, tmp_path_factory,
                                                                        capsys):
    """``--save-state`` and ``--load-state`` print the tokens of a plain ``generate``: those of
    ``models.decode.generate`` on the config of that ``--compute``. The two state runs are the same
    computation (bit for bit, checked in the same programs from Python); the plain run prefills
    the whole prompt and agrees with them to round-off (on these prompts, exactly in tokens).
    The files record the compute, and hold the attention rows in its dtype."""
    from models.base import with_runtime
    from models.layers import kv_dtype

    compute, lengths = CLI_RUNS[method]
    ckpt = checkpoint_of(tiny, tmp_path_factory)
    config, params = with_runtime(tiny.config, tiny.params, compute=compute)
    run = ("generate", ckpt, "--max-new-tokens", MAX_NEW, "--stop-ids", "", "--json", "--state", method)
    run += ("--bits", 8) if method == "leapquant" else ("--compute", compute)
    rng = np.random.default_rng([41, len(tiny.name), len(method)])
    for length in lengths:
        prompt = rng.integers(0, VOCAB, length).tolist()
        ids, state = ",".join(map(str, prompt)), tmp_path / f"{length}.safetensors"
        plain, result = generated(capsys, *run, "--prompt-ids", ids)
        assert result["compute"] == compute and plain == generate(tiny.arch, params, config, [prompt],
                                                                  method=METHODS[method], max_new_tokens=MAX_NEW).tokens
        assert generated(capsys, *run, "--prompt-ids", ids, "--save-state", state)[0] == plain
        loaded, result = generated(capsys, *run, "--load-state", state)
        assert loaded == plain and result["prompt_ids"] == [prompt]
        prefix = ps.load_prefix(state)
        boundary = length // WINDOW * WINDOW if method == "leapquant" else length
        assert prefix.ids.tolist() == prompt[:boundary] and prefix.pending.tolist() == prompt[boundary:]
        kv = [n for n in prefix.leaves if n.startswith("layers.2.")]  # the attention layer's cache
        assert prefix.compute == compute and kv
        assert {prefix.leaves[n].dtype for n in kv} == {np.dtype(kv_dtype(compute))}

    # The last prompt's save path (its state taken in memory, restored) and load path (the file
    # restored), in the pool generate_one made for it: the same logits, bit for bit.
    bucket = -(-lengths[-1] // PROMPT_BUCKET) * PROMPT_BUCKET
    pool = DecodePool(tiny.arch, params, config, method=METHODS[method],
                      pool=PoolConfig(slots=1, max_len=bucket + MAX_NEW))
    runs = []
    for source in (pool.boundary_state(prompt), prefix):
        slot = pool.restore(source, budget=MAX_NEW)
        runs.append([np.array(pool.logits[slot])] + run_steps(pool, slot, MAX_NEW - 1)[1])
        pool.evict(slot)
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_generate_saves_and_loads_the_state_after_the_prompt(gdn, tmp_path, tmp_path_factory, capsys):
    ckpt = checkpoint_of(gdn, tmp_path_factory)
    other = save_converted(tmp_path / "other", config_json=gdn.config_json,
                           params=init_params(gdn.config_json, seed=1))
    rng = np.random.default_rng(29)
    prompt, more = rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 4).tolist()
    ids = ",".join(map(str, prompt))
    run = ("generate", ckpt, "--max-new-tokens", MAX_NEW, "--stop-ids", "", "--json")
    exact = ("--compute", "exact")

    # --compute exact: the Python API on the model's own (exact) config.
    state = tmp_path / "state.safetensors"
    plain = generated(capsys, *run, *exact, "--prompt-ids", ids)[0]
    assert plain == [gdn.alone(prompt, "fp32")]
    assert generated(capsys, *run, *exact, "--prompt-ids", ids, "--save-state", state)[0] == plain
    assert generated(capsys, *run, *exact, "--load-state", state)[0] == plain
    assert generated(capsys, *run, *exact, "--load-state", state, "--prompt-ids", ",".join(map(str, more)))[0] == \
        [gdn.alone(prompt + more, "fp32")]

    prefix = ps.load_prefix(state)
    kv = [n for n in prefix.leaves if n.startswith("layers.2.")]  # the attention layer's k, v
    assert prefix.compute == "exact" and kv and {prefix.leaves[n].dtype.name for n in kv} == {"float32"}
    # A file that says it was made under --compute fast: refused by its metadata, before the model loads.
    fast_state = ps.save_prefix(tmp_path / "fast.safetensors", dataclasses.replace(prefix, compute="fast"))

    saved = state.read_bytes()
    for argv, words in (
        (("--prompt-ids", ids, "--save-state", state), "exists; not overwriting"),
        (("--prompt-ids", ids, "--prompt-ids", ids, "--save-state", tmp_path / "new"), "takes one prompt"),
        (("--load-state", state, "--state", "leapquant", *exact), "state method"),
        (("--load-state", state), "saved under --compute exact and this run has --compute fast: pass --compute exact"),
        (("--load-state", fast_state, *exact), "pass --compute fast"),
        (("--load-state", tmp_path / "missing.safetensors"), "no such prefix-state file"),
        ((), "--prompt or --prompt-ids"),
    ):
        code, out, err = cli(capsys, *run, *argv)
        assert code == 2 and out == "" and words in err, err
    code, out, err = cli(capsys, "generate", other, "--max-new-tokens", 2, "--load-state", state, *exact)
    assert code == 2 and "another model" in err and "--load-state" in err, err
    assert state.read_bytes() == saved and not (tmp_path / "new").exists()
