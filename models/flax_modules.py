"""Flax (``flax.linen``) modules for the hybrid models, built on the functional forward passes.

``HybridLM(arch, config)`` is one module for every architecture in ``models/registry.py``
(Qwen3-Next, Qwen3.5 dense and MoE, Kimi-Linear). It declares its weights in Flax's
``params`` collection and runs ``arch.forward`` on them, so the maths lives in one place
(``models/qwen3_next.py``, ``models/kimi_linear.py``) and the module adds only parameter
management::

    module, variables = from_checkpoint("ckpt/")           # or HybridLM(arch, config)
    cache = module.init_cache(batch=B, max_len=L, state_method=method)
    logits, cache, traces = module.apply(variables, ids, cache, state_method=method, mode="prefill", lengths=lengths)

The state method is passed as ``state_method``: Flax's ``init``/``apply`` reserve the keyword
``method`` (the module method to run).

The ``params`` collection is exactly the pytree ``arch.convert`` returns, not a re-nesting of
it: ``{"embed": [V, D], "final_norm": [D], "lm_head": [V, D], "layers": (layer dict, ...)}``.
A converted checkpoint is therefore usable as ``{"params": params}`` unchanged, and
``module.init`` produces random params of the same tree, shapes and dtypes. Flax scopes can
only be dicts, while ``layers`` is a tuple, so each of the four top-level entries is declared
as one ``self.param`` whose value is the whole subtree; the initialisers still act leaf by leaf.

Random initialisation (as transformers initialises these models, up to the conv kernels):
matrices, conv kernels, stacked experts, embeddings and the LM head ``normal(init_std)``;
plain RMSNorm weights ones; Qwen's zero-centred ``(1 + w)`` RMSNorm weights (decoder norms,
final norm, attention ``q_norm``/``k_norm``) zeros; ``A_log = log(U(1, 16))``;
``dt_bias`` ones; every bias (including Kimi's router ``e_bias``) zeros. With tied
embeddings ``lm_head`` starts as a copy of ``embed`` (``convert`` stores the same array twice).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.checkpoint import load_model
from models.qwen3_next import QwenHybridConfig

Array = jax.Array

# Qwen's ``Qwen3NextRMSNorm`` computes ``norm(x) * (1 + w)``: its identity weight is zero. The
# gated norm inside a GDN layer (``gdn.norm``) is a plain ``* w`` norm like all of Kimi's.
QWEN_ZERO_CENTRED_NORMS = ("input_norm", "post_norm", "final_norm", "q_norm", "k_norm")


# ============================================================================= shapes


@functools.lru_cache(maxsize=16)
def _converted_shapes(arch, config) -> Any:
    """The params tree ``arch.convert`` builds for ``config``, leaves ``tuple`` shapes wrapped in
    ``jax.ShapeDtypeStruct`` (float32 placeholder dtype)."""
    specs = arch.param_specs(config)
    try:
        # Zero-itemsize arrays: the converter's copies (stacked experts, split or re-ordered
        # projections) then cost no memory, which matters for checkpoints of tens of GB.
        void = np.dtype([])
        tree = arch.convert({name: np.zeros(shape, void) for name, shape in specs.items()}, config)
    except TypeError:
        # a converter that does arithmetic on a weight: zero-strided float views instead
        zero = np.zeros((), np.float32)
        tree = arch.convert({name: np.broadcast_to(zero, shape) for name, shape in specs.items()}, config)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), jnp.float32), tree)


def param_shapes(arch, config, dtype=jnp.float32) -> Any:
    """The ``params`` tree of ``HybridLM(arch, config)`` as ``jax.ShapeDtypeStruct`` leaves.

    Same tree and shapes as ``arch.convert(tensors, config)`` for any checkpoint matching
    ``config``; every leaf gets ``dtype`` (a converted checkpoint keeps its file's dtype).
    Computed without allocating the weights; cached per ``(arch, config)``.
    """
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), _converted_shapes(arch, config))


def _leaf_kind(name: str, *, zero_centred: tuple[str, ...]) -> str:
    """How the leaf with dotted name ``name`` starts: ``"normal"``, ``"a_log"``, ``"ones"`` or
    ``"zeros"`` (see the module docstring)."""
    key = name.rsplit(".", 1)[-1]
    if key == "a_log":
        return "a_log"
    if key == "dt_bias":
        return "ones"
    if key.endswith("bias"):
        return "zeros"
    if key.endswith("norm"):
        return "zeros" if key in zero_centred else "ones"
    return "normal"


def _init_subtree(prefix: str, shapes, *, zero_centred: tuple[str, ...], std: float):
    """An init function ``rng -> subtree`` for one top-level entry, each leaf by its kind.

    All normal leaves are cut from one draw, and all ``A_log`` leaves from another: one random
    program per entry rather than one per leaf shape, which keeps eager ``init`` fast.
    """

    def init(rng):
        paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
        kinds = [_leaf_kind(_dotted(prefix, path), zero_centred=zero_centred) for path, _ in paths]
        normal_rng, a_log_rng = jax.random.split(rng)
        draws = {}
        for kind, sample in (("normal", lambda n: std * jax.random.normal(normal_rng, (n,), jnp.float32)),
                             ("a_log", lambda n: jnp.log(jax.random.uniform(a_log_rng, (n,), jnp.float32, 1.0, 16.0)))):
            sizes = [int(np.prod(s.shape)) for (_, s), k in zip(paths, kinds) if k == kind]
            if sizes:
                draws[kind] = iter(jnp.split(sample(sum(sizes)), np.cumsum(sizes)[:-1].tolist()))
        leaves = []
        for (_, s), kind in zip(paths, kinds):
            if kind in draws:
                leaves.append(next(draws[kind]).reshape(s.shape).astype(s.dtype))
            else:
                leaves.append((jnp.ones if kind == "ones" else jnp.zeros)(s.shape, s.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return init


def _dotted(prefix: str, path) -> str:
    # ``flatten_params`` naming from a key path: dict keys and tuple indices joined by dots
    return ".".join(([prefix] if prefix else []) + [str(getattr(p, "key", getattr(p, "idx", p))) for p in path])


def _shape_mismatches(params, shapes) -> list[str]:
    """Differences between a params tree and the expected shapes, by dotted name (dtypes may differ)."""
    got = {n: tuple(np.shape(x)) for n, x in _flat_shapes(params).items()}
    want = {n: tuple(s.shape) for n, s in _flat_shapes(shapes).items()}
    out = [f"missing {n}" for n in sorted(set(want) - set(got))]
    out += [f"unexpected {n}" for n in sorted(set(got) - set(want))]
    out += [f"mis-shaped {n}: expected {want[n]}, found {got[n]}" for n in sorted(set(want) & set(got))
            if want[n] != got[n]]
    return out


def _flat_shapes(tree) -> dict:
    # flatten_params' naming without touching the values (they may be tracers or shape structs)
    return {_dotted("", path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ============================================================================= module


class HybridLM(nn.Module):
    """A hybrid linear-attention decoder (any ``models.registry`` architecture) as a Flax module.

    Fields
        arch: the architecture's ``ARCH`` object (``models.registry.get_architecture(...)``).
        config: its frozen config (``arch.config_from_hf(config_json)``).
        param_dtype: dtype (name or dtype) of the parameters ``init`` creates (``apply`` takes
            whatever dtypes it is given: the forward pass computes in float32).
        init_std: standard deviation of the random matrices ``init`` creates.

    ``__call__`` follows ``arch.forward`` (``models/base.py``): ``ids [B, T]`` int32 and a cache
    from ``init_cache`` -> ``(logits [B, T, vocab] float32, new cache, traces)``.
    """

    arch: Any
    config: Any
    param_dtype: str = "float32"
    init_std: float = 0.02

    def setup(self):
        shapes = param_shapes(self.arch, self.config, self.param_dtype)
        if not self.is_initializing():
            # Flax's own check names only the top-level entry, or none for a missing key
            self._check_given_params(shapes)
        zero_centred = QWEN_ZERO_CENTRED_NORMS if isinstance(self.config, QwenHybridConfig) else ()
        declared = {}
        for name, sub in shapes.items():
            if name == "lm_head" and self.config.tie_word_embeddings and "embed" in declared:
                # tied: the head starts as the embedding (``convert`` stores that array twice)
                embed = declared["embed"]
                declared[name] = self.param(name, lambda rng: jnp.array(embed))
            else:
                declared[name] = self.param(name, _init_subtree(name, sub, zero_centred=zero_centred,
                                                                std=self.init_std))
        self.weights = declared

    def _check_given_params(self, shapes) -> None:
        given = self.variables.get("params", {})
        problems = _shape_mismatches(dict(given), shapes)
        if problems:
            raise ValueError(f"params do not match the {self.config.model_type} config: " + "; ".join(problems))

    def params_tree(self) -> Any:
        """The params pytree ``arch.forward`` reads. ``module.init(rng, method="params_tree")``
        creates random params without running the model."""
        return dict(self.weights)

    def __call__(self, ids: Array, cache: Any, *, state_method: Any, mode: str, lengths: Optional[Array] = None,
                 active: Optional[Array] = None, record: bool = False) -> tuple[Array, Any, dict]:
        """``arch.forward`` on the module's params.

        ids ``[B, T]`` int32 (prefill, right-padded, with ``lengths [B]``) or ``[B, 1]``
        (decode, optional ``active [B]`` bool); ``state_method`` the state method (``method`` of
        ``arch.forward``, renamed because ``apply`` takes ``method`` itself); ``mode``
        ``"prefill"`` or ``"decode"``. Returns ``(logits [B, T, vocab] f32, cache, traces)``.
        """
        params = self.params_tree()
        return self.arch.forward(params, self.config, ids, cache, method=state_method, mode=mode, lengths=lengths,
                                 active=active, record=record)

    def init_cache(self, *, batch: int, max_len: int, state_method: Any) -> Any:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens (``arch.init_cache``);
        callable on the unbound module."""
        return self.arch.init_cache(self.config, batch=batch, max_len=max_len, method=state_method)

    def as_architecture(self) -> "FlaxArchitecture":
        """This module behind the ``models.base.Architecture`` interface (for ``models.decode``)."""
        return FlaxArchitecture(self)


@dataclasses.dataclass(frozen=True)
class FlaxArchitecture:
    """``models.base.Architecture`` whose ``forward`` is ``module.apply({"params": params}, ...)``,
    so ``models.decode.generate``/``score`` run the Flax module (it is hashable, hence static
    under ``jit``). Conversion and caches are the wrapped architecture's."""

    module: HybridLM

    @property
    def model_types(self) -> tuple[str, ...]:
        return self.module.arch.model_types

    def config_from_hf(self, config_json):
        return self.module.arch.config_from_hf(config_json)

    def param_specs(self, config):
        return self.module.arch.param_specs(config)

    def convert(self, tensors, config):
        return self.module.arch.convert(tensors, config)

    def init_cache(self, config, *, batch: int, max_len: int, method):
        return self.module.arch.init_cache(config, batch=batch, max_len=max_len, method=method)

    def forward(self, params, config, ids, cache, *, method, mode, lengths=None, active=None, record=False):
        if config != self.module.config:
            raise ValueError("config differs from the wrapped module's config")
        return self.module.apply({"params": params}, ids, cache, state_method=method, mode=mode, lengths=lengths,
                                 active=active, record=record)


def from_checkpoint(path, *, init_std: float = 0.02) -> tuple[HybridLM, dict]:
    """Our converted checkpoint or an HF directory (converted in memory) ->
    ``(module, {"params": params})`` with the params as device arrays in their stored dtypes.
    ``param_dtype`` is the checkpoint's embedding dtype, so ``module.init`` matches it."""
    arch, config, params, _ = load_model(path)
    params = jax.tree.map(jnp.asarray, params)
    # the dtype by name: equal modules hash equal, so jitted code keyed on the module is reused
    module = HybridLM(arch=arch, config=config, param_dtype=jnp.dtype(params["embed"].dtype).name, init_std=init_std)
    return module, {"params": params}


__all__ = ["FlaxArchitecture", "HybridLM", "QWEN_ZERO_CENTRED_NORMS", "from_checkpoint", "param_shapes"]
