"""FLA's fp32 recurrent kernels and a device copy, the yardsticks of the kernel benchmarks
(torch, triton and fla-core: the ``bench`` extra; imported only where called)."""

from __future__ import annotations


def fla_fns():
    """``{False: gdn, True: kda}`` callables ``(tensors [B, T, H, ...], h0) -> (o, state)``, or None."""
    try:
        __import__("torch")
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        from fla.ops.kda import fused_recurrent_kda
    except Exception as err:  # reported in the results
        print(f"FLA unavailable: {err!r}", flush=True)
        return None

    def gdn(x, h0):
        return fused_recurrent_gated_delta_rule(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=1.0,
                                                initial_state=h0, output_final_state=True)

    def kda(x, h0):
        return fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=1.0,
                                   initial_state=h0, output_final_state=True)

    return {False: gdn, True: kda}


def time_fla(fn, bsz, h, dk, dv, kda):
    """µs per step of ``fn`` (one of ``fla_fns``) on one token of ``bench.inputs``-like statistics
    (CUDA events via ``triton.testing.do_bench``, median)."""
    import torch
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(bsz, 1, h, dk, device="cuda", generator=gen), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(bsz, 1, h, dk, device="cuda", generator=gen), dim=-1) / dk ** 0.5
    v = torch.randn(bsz, 1, h, dv, device="cuda", generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(*((bsz, 1, h, dk) if kda else (bsz, 1, h)), device="cuda", generator=gen) - 4)
    beta = torch.sigmoid(torch.randn(bsz, 1, h, device="cuda", generator=gen))
    h0 = torch.randn(bsz, h, dk, dv, device="cuda", generator=gen) * 0.3
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    ms = do_bench(lambda: fn(x, h0), warmup=100, rep=500, return_mode="median")
    x = h0 = None   # free before empty_cache (the lambda's cells hold them)
    torch.cuda.empty_cache()
    return ms * 1e3


def time_copy(nbytes=2 << 30):
    """Device-to-device copy bandwidth in B/s (bytes read + written), the ceiling GB/s is read against."""
    import torch
    from triton.testing import do_bench

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=100, rep=500, return_mode="median")
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)
