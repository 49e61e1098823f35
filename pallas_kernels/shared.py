"""Kernel helpers the decode step and the window flush share: the packed residual codes' planar
layout (``num_parts``, ``load_code_parts``) and the window's log-space decays
(``window_decay_part``). Used inside Pallas kernel bodies only."""

from __future__ import annotations

import jax.numpy as jnp

from ._compat import load, pl

f32 = jnp.float32


def num_parts(bits: int) -> int:
    """Key-row parts the packed codes split into: 1 (8 bits), 2 (4 bits), 4 (6 bits)."""
    return {8: 1, 4: 2, 6: 4}[bits]


def load_code_parts(codes_ref, bits: int, dk: int, start=0, rows: int | None = None, dtype=f32):
    """Signed codes of a packed tile as ``num_parts(bits)`` arrays ``[rows, BV]`` of ``dtype``.

    Part ``i`` holds key rows ``i * dk / parts + start + [0, rows)``; ``rows`` defaults to the
    whole part. Every part of a chunk comes from the same packed byte rows (planar layout).
    """
    n = dk // num_parts(bits)
    rows = n if rows is None else rows
    if bits == 8:
        return [codes_ref[pl.ds(start, rows), :].astype(dtype)]
    if bits == 4:
        p = codes_ref[pl.ds(start, rows), :].astype(jnp.int32)
        return [((p & 15) - 8).astype(dtype), ((p >> 4) - 8).astype(dtype)]
    planes = [codes_ref[pl.ds(i * n + start, rows), :].astype(jnp.int32) for i in range(3)]
    top = ((planes[0] >> 6) & 3) | (((planes[1] >> 6) & 3) << 2) | (((planes[2] >> 6) & 3) << 4)
    return [((q & 63) - 32).astype(dtype) for q in planes] + [(top - 32).astype(dtype)]


def window_decay_part(g_ref, live, part, per_channel: bool):
    """Log-space decays of the live records for key rows ``part`` (a ``pl.ds``).

    Returns ``(D0, d)``: ``D0 = exp(G_l)`` (``[]`` or ``[n]``) and ``d_j = exp(G_l - G_j)`` for
    live slots, 0 for dead ones (``[p]`` or ``[p, n]``). Dead slots are never loaded.
    """
    if per_channel:
        g = load(g_ref.at[:, part], mask=live[:, None], other=0.0).astype(f32)   # [p, n]
        G = jnp.cumsum(g, axis=0)
        G_l = jnp.sum(g, axis=0)                                                   # [n]
        d = jnp.exp(jnp.where(live[:, None], G_l[None, :] - G, -jnp.inf))
        return jnp.exp(G_l), d
    g = load(g_ref, mask=live, other=0.0).astype(f32)                              # [p]
    G = jnp.cumsum(g, axis=0)
    G_l = jnp.sum(g)
    return jnp.exp(G_l), jnp.exp(jnp.where(live, G_l - G, -jnp.inf))


__all__ = ["load_code_parts", "num_parts", "window_decay_part"]
