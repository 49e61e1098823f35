"""leapquant-jax: LeapQuant recurrent-state quantization for linear attention in JAX.

The state of a GDN or KDA head, ``S [dk, dv]``, is stored at 8, 6 or 4 bits between
windows of ``p`` tokens; inside a window the tokens are buffered as high-precision records
(paper: "LeapQuant: Efficient Linear Attention with Accurate Recurrent State Quantization").
"""

from .chunked import chunk_delta_rule
from .compensators import cholesky_qr2, fit_subspace, fit_svd, smoothing_scales
from .methods import METHOD_NAMES, PerStepMethod, WindowedMethod, make_method
from .quantizers import FloatFormat, Fp8Format, IntFormat, get_format, pack_codes, unpack_codes
from .recurrence import Token, delta_rule_token, expand_heads, linear_attention_token, recurrent_scan, recurrent_step
from .state import Checkpoint, LeapQuantConfig, LeapQuantState, WindowBuffer

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "FloatFormat",
    "Fp8Format",
    "IntFormat",
    "LeapQuantConfig",
    "LeapQuantState",
    "METHOD_NAMES",
    "PerStepMethod",
    "Token",
    "WindowBuffer",
    "WindowedMethod",
    "cholesky_qr2",
    "chunk_delta_rule",
    "delta_rule_token",
    "expand_heads",
    "fit_subspace",
    "fit_svd",
    "get_format",
    "linear_attention_token",
    "make_method",
    "pack_codes",
    "recurrent_scan",
    "recurrent_step",
    "smoothing_scales",
    "unpack_codes",
]
