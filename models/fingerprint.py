"""Which model a saved thing belongs to: a model's fingerprint, the layout of its recurrent states,
and the check that a state method made for a model (a calibration) is used with it.

A calibration (DAMP's, ``models.calibrate``; the lifetime calibration of ``stepquant-*`` and
``leapquant-alloc-*``, ``models.calibrate_stepquant``) and a prefix state (``models.prefix_state``)
record the fingerprint of the model they were made on; ``check_state_method`` and ``check_prefix``
refuse them on any other model before anything runs.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from leapquant_jax.methods import make_method
from models.base import layer_caches, runtime_free_repr


def model_fingerprint(config, params) -> str:
    """sha256 of the model's configuration (without how it runs: ``models.base.RUNTIME_FIELDS``)
    and of a few of its weights (the first embedding rows and the final norm): a calibration made
    on other weights of the same shape is told apart."""
    h = hashlib.sha256(runtime_free_repr(config).encode())
    for x in (params["embed"][:8], params["final_norm"]):
        h.update(np.ascontiguousarray(np.asarray(x, np.float32)).tobytes())
    return h.hexdigest()


def linear_state_layout(arch, config) -> tuple[tuple, int, int, int]:
    """``(layers, heads, dk, dv)``: the model's linear-attention layer indices and their state shape
    (measured on ``arch.init_cache``'s shapes, nothing allocated)."""
    cache = jax.eval_shape(lambda: arch.init_cache(config, batch=1, max_len=1, method=make_method("fp32")))
    layers, shape = [], None
    for i, c in enumerate(layer_caches(cache, config)):
        if "state" in c:
            layers.append(i)
            shape = c["state"].shape
    if shape is None:
        raise ValueError("the model has no linear-attention layer: no recurrent state to calibrate")
    return tuple(layers), shape[1], shape[2], shape[3]


def check_state_method(method, arch, config, params) -> None:
    """Raises the calibration's error (``DampCalibrationError``, ``LifetimeCalibrationError``) when
    ``method`` carries a calibration made for another model (fingerprint, layers or head shape);
    a method without one passes."""
    calibration = getattr(method, "calibration", None)
    if calibration is None:
        return
    layers, heads, dk, dv = linear_state_layout(arch, config)
    calibration.check_model(fingerprint=model_fingerprint(config, params), layers=layers, heads=heads, dk=dk, dv=dv)


__all__ = ["check_state_method", "linear_state_layout", "model_fingerprint"]
