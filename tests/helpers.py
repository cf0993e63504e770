"""Shared test helpers (imported by the test modules; tests/ is on sys.path under pytest)."""
import math
import zlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def seeded(*key) -> torch.Generator:
    """A generator seeded from a test case's parameters: fresh inputs per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def sdpa_math(q, k, v, *, causal=False, scale=None):
    """PyTorch's own SDPA, math backend, computing in the inputs' dtype: the yardstick.

    By default PyTorch's math backend upcasts BF16/FP16 to float32 inside and
    rounds once at the end, which is not a BF16 computation; with
    ``allow_fp16_bf16_reduction_math_sdp(True)`` it computes in the inputs'
    dtype, like the PyTorch reference of flash-attention's own tests. For
    float32/float64 inputs the flag changes nothing.
    """
    flag = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(flag)


def run_fwd_bwd(fn, q, k, v, do, dtype):
    """Outputs and gradients of ``fn`` on inputs cast to ``dtype``: [o, dq, dk, dv]."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do.to(dtype))
    return [o.detach(), qq.grad, kk.grad, vv.grad]


def max_err(a, ref) -> float:
    return (a.double() - ref.double()).abs().max().item()


def ulp_bf16(x: float) -> float:
    """Spacing of bfloat16 numbers at magnitude x."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)
