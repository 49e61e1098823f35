"""Helpers of the kernel tests (``test_kernels``, ``test_mosaic_flush``, ``test_mosaic_dense``,
``test_load_only``), beside the shared ones of ``helpers``.

* ``state_shapes``: a zero stream's shapes and dtypes (``jax.eval_shape`` of
  ``windowed.init_state``), for the checks that read only shapes (support, refusals, lowering):
  nothing is computed, so no shape compiles the checkpoint's encoding.
* ``traced``: a function run on such shapes (``jax.eval_shape``), so its argument checks run
  as they do under ``jit``.
* ``check_writes_nothing_past_the_window``: a step kernel at ``pos == p`` in one sequence.
* ``launch_smem``: the shared memory each Mosaic GPU launch lowered inside it asks for.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np

from leapquant_jax import windowed
from pallas_kernels.leapquant_step import leapquant_step_reference

from helpers import copy_tree, rel


def state_shapes(config, bsz, h, dk, dv, kda=False, *, key_heads=None):
    """``windowed.init_state(...)``'s ``LeapQuantState`` with ``jax.ShapeDtypeStruct`` leaves."""
    return jax.eval_shape(functools.partial(windowed.init_state, config, bsz, h, dk, dv, kda, key_heads=key_heads))


@contextlib.contextmanager
def launch_smem():
    """Within: a list of the shared-memory bytes of each Mosaic GPU launch lowered (buffers and
    barriers, as Mosaic GPU sizes the launch), or ``None`` where this JAX's Mosaic GPU sizes it
    elsewhere (the caller then skips its comparison)."""
    from jax.experimental.mosaic.gpu import core

    measure = getattr(core, "_smem_tree_size", None)
    if measure is None:
        yield None
        return
    sizes = []
    core._smem_tree_size = lambda tree: sizes.append(measure(tree)) or sizes[-1]
    try:
        yield sizes
    finally:
        core._smem_tree_size = measure


def traced(fn, *args):
    """``fn(*args)`` traced on the arguments' shapes (``jax.eval_shape``): its shape and option
    checks run, nothing is computed."""
    return jax.eval_shape(fn, *args)


def check_writes_nothing_past_the_window(config, st, tok, kernel):
    """``st`` has ``pos == p`` in sequence 0 and not in sequence 1 (the step's precondition,
    ``pos < p``, broken in one): ``kernel(config, state, tok)`` must write nothing out of bounds
    (sequence 0's buffer unchanged), and sequence 1's output is the reference's."""
    assert int(st.pos[0]) == config.window and int(st.pos[1]) < config.window
    o_r, _ = leapquant_step_reference(config, st, tok)
    o_k, n_k = kernel(config, copy_tree(st), tok)
    assert rel(o_k[1], o_r[1]) < 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(n_k.buffer), jax.tree_util.tree_leaves(st.buffer)):
        np.testing.assert_array_equal(a[0], b[0])
