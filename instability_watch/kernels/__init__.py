"""One attention contract, several implementations.

:func:`flash_attention` validates its arguments and dispatches: CUDA tensors go
to the Triton kernels (``attention/triton.py``), everything else to the
reference emulation of FA2's precision model (``attention/reference.py``). Both run
behind the same ``torch.library`` ops (``attention/ops.py``), so ``torch.compile`` sees
one op whichever backend runs.
"""
from __future__ import annotations

import importlib.util
import math
import os
import warnings
from typing import Optional, Tuple, Union

import torch

from instability_watch.kernels.attention.ops import HIGH_PRECISION_DELTA, FlashAttention
from instability_watch.kernels.attention.reference import attention_backward_lse, attention_forward_lse
from instability_watch.kernels.common import (
    DEFAULT_BETA,
    DEFAULT_EPS,
    FLOAT32_MAX,
    MAX_BETA,
    dropout_mask,
    dropout_seed,
)
from instability_watch.probe.bank import Probe, probe_buffers

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "attention_forward_lse",
    "attention_backward_lse",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
    "dropout_mask",
    "dropout_seed",
    "BACKENDS",
    "unsupported",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# The largest head dim D the kernels take (any D from 1 up; the Triton kernels pad D to a
# power-of-two tile of at least 16).
MAX_HEAD_DIM = 256
BACKENDS = ("auto", "triton", "reference")
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Looked up once: flash_attention runs inside torch.compile, which cannot trace importlib.
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_warned_fallback = False


def resolve_backend(q: torch.Tensor, backend: str) -> str:
    """The backend a call runs on: ``"triton"`` or ``"reference"``.

    ``"auto"`` takes Triton for CUDA tensors of a dtype it supports, and the
    reference otherwise (announcing it once if CUDA tensors fall back because
    Triton is missing). ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``
    set before the package is imported (Triton's interpreter, for tests).
    """
    global _warned_fallback
    if backend == "reference":
        return backend
    if backend == "triton":
        if q.dtype not in _TRITON_DTYPES:
            raise TypeError(f"backend='triton' supports dtypes {_TRITON_DTYPES}, got {q.dtype}")
        if not _TRITON_AVAILABLE:
            raise ImportError("backend='triton' needs the triton package: pip install triton")
        if not q.is_cuda and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors, got device {q.device}; to run Triton's "
                "interpreter on CPU set TRITON_INTERPRET=1 before importing instability_watch"
            )
        return backend
    if q.is_cuda and q.dtype in _TRITON_DTYPES:
        if _TRITON_AVAILABLE:
            return "triton"
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn("triton is not installed: CUDA attention runs on the slow PyTorch reference path")
    return "reference"


def _tensor_error(name: str, t) -> Optional[Exception]:
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor of shape (B, H, N, D), got {type(t).__name__}")
    if t.dim() != 4:
        return ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
    return None


def _mask_error(attn_mask, q, k) -> Optional[Exception]:
    if not isinstance(attn_mask, torch.Tensor):
        return TypeError(f"attn_mask must be None or a torch.Tensor, got {type(attn_mask).__name__}")
    if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        return TypeError(f"attn_mask must be boolean (True = attend) or floating point (added to the scores), "
                         f"got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        return ValueError(f"attn_mask must be on q's device {q.device}, got {attn_mask.device}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if attn_mask.dim() > 4 or any(a not in (1, b) for a, b in zip(attn_mask.shape[::-1], full[::-1])):
        return ValueError(f"attn_mask must broadcast to (B, H, N, N_kv) = {full}, got shape {tuple(attn_mask.shape)}")
    return None


def _number_in(x, lo: float, hi: float, *, lo_open: bool, hi_open: bool) -> bool:
    """Whether ``x`` is a real number (not a bool) in the interval from lo to hi."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return (lo < x if lo_open else lo <= x) and (x < hi if hi_open else x <= hi)


def _call_error(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Optional[Exception]:
    """The rules of what the kernels can serve: the first one a call breaks, as the exception
    the public API raises for it (its message names the argument, what is allowed and what was
    given), or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        error = _tensor_error(name, t)
        if error is not None:
            return error
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            return TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            return ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if q.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        return TypeError(f"q, k, v dtype must be one of {allowed}; got {q.dtype}")
    B, H, N, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        return ValueError(f"head dim D (q.shape[-1]) must be in [1, {MAX_HEAD_DIM}], got {D}")
    if k.shape[3] != D or v.shape[3] != D:
        return ValueError(f"head dims q {D}, k {k.shape[3]}, v {v.shape[3]} (supported: equal, at most {MAX_HEAD_DIM})")
    if k.shape != v.shape:
        return ValueError(f"k and v must have the same shape (B, H_kv, N_kv, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B:
        return ValueError(f"k batch size must equal q's ({B}), got {k.shape[0]}")
    h_kv = k.shape[1]
    if h_kv < 1 or H % h_kv != 0:
        return ValueError(f"q heads H must be divisible by k/v heads H_kv (grouped-query attention), got H={H}, H_kv={h_kv}")
    if h_kv != H and not enable_gqa:
        return ValueError(f"k/v heads H_kv must equal q heads H without enable_gqa, got H={H}, H_kv={h_kv}")
    if N < 1 or k.shape[2] < 1:
        return ValueError(f"sequence lengths must be >= 1, got N={N} (q) and N_kv={k.shape[2]} (k, v)")
    if B < 1:
        return ValueError(f"batch size must be >= 1, got {B}")
    if scale is not None and not _number_in(scale, 0, FLOAT32_MAX, lo_open=True, hi_open=False):
        return ValueError(f"scale must be None or a number in (0, {FLOAT32_MAX:.4g}] (the largest float32: "
                          f"scores are float32), got {scale!r}")
    if attn_mask is not None:
        error = _mask_error(attn_mask, q, k)
        if error is not None:
            return error
        if is_causal:
            return ValueError("attn_mask and causal=True cannot be combined (as in SDPA): put the causal mask into attn_mask")
    if not _number_in(dropout_p, 0, 1, lo_open=False, hi_open=True):
        return ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    return None


def unsupported(q, k, v, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False) -> Optional[str]:
    """Why :func:`flash_attention` cannot serve this ``F.scaled_dot_product_attention`` call (``None`` if it can).

    The arguments are SDPA's, after autocast's cast: q (B, H, N, D), k and v (B, H_kv, N_kv, D)
    tensors of one dtype (bfloat16, float16, float32 or float64) and device, D <= 256, ``attn_mask``
    None or a bool/float tensor broadcastable to (B, H, N, N_kv). The one source of these rules:
    :func:`flash_attention` raises with the same message (as TypeError or ValueError); the watch
    keeps such calls on PyTorch's SDPA and says why.
    """
    error = _call_error(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return None if error is None else str(error)


def _check_args(q, k, v, causal, scale, stabilize, beta, eps, probe, backend, attn_mask=None, dropout_p=0.0,
                generator=None, seed=None) -> None:
    """Raise for arguments :func:`flash_attention` cannot take: the call rules of :func:`unsupported`,
    then the options only the public API has."""
    error = _call_error(q, k, v, attn_mask, dropout_p, causal, scale, enable_gqa=True)
    if error is not None:
        raise error
    H = q.shape[1]
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if stabilize is not None and not isinstance(stabilize, bool):
        if not isinstance(stabilize, torch.Tensor):
            raise TypeError(f"stabilize must be None, a bool, or a bool tensor of shape ({H},), got {type(stabilize).__name__}")
        if stabilize.dtype != torch.bool:
            raise TypeError(f"stabilize must be a bool tensor of shape ({H},), got dtype {stabilize.dtype}")
        if tuple(stabilize.shape) != (H,):
            raise ValueError(f"stabilize must have shape ({H},) (one flag per query head), got {tuple(stabilize.shape)}")
        if stabilize.device != q.device:
            raise ValueError(f"stabilize must be on q's device {q.device}, got {stabilize.device}")
    if not _number_in(beta, 1, MAX_BETA, lo_open=True, hi_open=False):
        raise ValueError(f"beta must be a number in (1, {MAX_BETA:g}] (the paper uses 2 to 8), got {beta!r}")
    if not _number_in(eps, 0, FLOAT32_MAX, lo_open=False, hi_open=False):
        raise ValueError(f"eps must be a number in [0, {FLOAT32_MAX:.4g}] (the largest float32), got {eps!r}")
    if probe is not None:
        if not isinstance(probe, Probe):
            raise TypeError(f"probe must be None or an instability_watch.Probe, got {type(probe).__name__}")
        if probe.num_heads != H:
            raise ValueError(f"probe has {probe.num_heads} heads, q has H={H}")
        if probe.device != q.device:
            raise ValueError(f"probe must be on q's device {q.device}, got {probe.device}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")
    if seed is not None:
        if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or tuple(seed.shape) != (2,):
            got = f"{seed.dtype} {tuple(seed.shape)}" if isinstance(seed, torch.Tensor) else type(seed).__name__
            raise TypeError(f"seed must be None or an int64 tensor of shape (2,) (see dropout_seed), got {got}")
        if seed.device != q.device:
            raise ValueError(f"seed must be on q's device {q.device}, got {seed.device}")
        if generator is not None:
            raise ValueError("seed and generator cannot both be given: the seed is what a generator would draw")


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    scale: Optional[float] = None,
    stabilize: Union[None, bool, torch.Tensor] = None,
    probe: Optional[Probe] = None,
    beta: float = DEFAULT_BETA,
    eps: float = DEFAULT_EPS,
    backend: str = "auto",
    generator: Optional[torch.Generator] = None,
    seed: Optional[torch.Tensor] = None,
    high_precision_delta: Optional[bool] = None,
    return_lse: bool = False,
):
    """Attention with FA2's BF16 precision model, per-head stabilization and diagnostics.

    Args:
        q: (B, H, N, D) queries.
        k, v: (B, H_kv, N_kv, D) keys and values; ``H % H_kv == 0`` (grouped-query
            attention: query head ``h`` reads KV head ``h // (H // H_kv)``).
            Same dtype and device as ``q``: bfloat16 (the target), float16,
            float32, or float64 (reference path only, no rounding anywhere).
            Any ``D`` up to ``MAX_HEAD_DIM`` (256); any ``N >= 1``.
        attn_mask: as ``F.scaled_dot_product_attention``'s: boolean (True = attend)
            or floating point (added to the scaled scores; it may require grad, and
            then gets its gradient), broadcastable to ``(B, H, N, N_kv)``, on ``q``'s
            device. Not together with ``causal``. Finite entries below -1e30 count
            as -1e30 (the result is SDPA's). A row whose every key is masked comes
            out 0, with zero gradients.
        dropout_p: attention dropout as SDPA's: entries of the softmax are dropped
            after it with probability ``p`` (rounded to a multiple of 2^-16) and the
            rest scaled by ``1/(1 - p)``; the backward regenerates the same mask
            from the call's seed (Philox; see ``kernels.common.dropout_bits``).
        generator: where a call with dropout draws its seed (two 32-bit words,
            :func:`dropout_seed`); ``None``: ``q``'s device's default generator,
            as SDPA and ``F.dropout``.
        seed: the call's dropout seed itself (int64 ``(2,)`` on ``q``'s device, e.g.
            from :func:`dropout_seed`) instead of drawing one: the same seed gives
            the same keep mask (:func:`~instability_watch.kernels.attention.reference.dropout_mask`).
        causal: causal mask, top-left aligned like ``F.scaled_dot_product_attention``.
        scale: softmax scale, a number in (0, 3.4e38] (scores are float32); default
            ``1/sqrt(D)``. Rows whose scaled scores overflow float32 come out NaN, as in
            PyTorch's float32 SDPA.
        stabilize: which heads use the stabilized softmax shift (paper Alg. 3):
            ``None``/``False`` none, ``True`` all, or a bool tensor ``(H,)`` on
            ``q``'s device, read per head inside the kernel (flipping a head
            never recompiles anything).
        probe: a :class:`~instability_watch.Probe` to accumulate per-head
            statistics into; ``None`` for none (full speed).
        beta: the stabilized shift factor (``m = beta * rowmax`` for positive maxima),
            in (1, 1024]; the shift is capped, so a larger one would change nothing.
        eps: two scores within ``eps`` count as the same maximum (0 to 3.4e38).
        backend: ``"auto"`` (Triton for CUDA tensors, the reference otherwise),
            ``"triton"`` or ``"reference"``.
        high_precision_delta: the paper's control experiment, a research tool
            (:func:`~instability_watch.experimental.high_precision_delta`): ``True``
            takes the backward's ``delta = rowsum(dO * O)`` from ``O`` without rounding
            ``P`` (Triton: a pre-pass of the dQ kernel; reference: PyTorch's float32
            attention); ``None`` (default) reads the
            :func:`~instability_watch.experimental.high_precision_delta` context in
            eager calls and is ``False`` under ``torch.compile`` (pass ``True`` there).
        return_lse: also return the log-sum-exp of each row's scaled scores, (B, H, N) float32
            (float64 for float64 inputs; natural log; +inf for a row that sees no key), differentiable too: its gradient
            enters the backward's ``delta`` (``dS = P * (dP - delta + dlse)``).

    Returns:
        The attention output, (B, H, N, D), in ``q``'s dtype (and the log-sum-exp with
        ``return_lse``). Differentiable with respect to ``q, k, v`` (FA2's backward; unchanged
        by stabilization).

    Raises:
        TypeError, ValueError: for arguments outside the above, naming the
            argument, what is allowed and what was given.

    Example::

        o = flash_attention(q, k, v, causal=True, stabilize=torch.tensor([False, True], device=q.device))
    """
    _check_args(q, k, v, causal, scale, stabilize, beta, eps, probe, backend, attn_mask, dropout_p, generator, seed)
    if high_precision_delta is not None and not isinstance(high_precision_delta, bool):
        raise TypeError(f"high_precision_delta must be None, True or False, got {high_precision_delta!r}")
    backend = resolve_backend(q, backend)
    if isinstance(stabilize, bool):
        stabilize = torch.full((q.shape[1],), True, dtype=torch.bool, device=q.device) if stabilize else None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    counts, values = probe_buffers(probe)
    shadow = probe is not None and probe.shadow
    if not dropout_p:
        seed = None
    elif seed is None:
        seed = dropout_seed(generator, q.device)
    if high_precision_delta is None:
        high_precision_delta = False if torch.compiler.is_compiling() else HIGH_PRECISION_DELTA.get()
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    o, lse = FlashAttention.apply(
        q, k, v, attn_mask, seed, stabilize, counts, values, shadow, causal, scale, float(beta), float(eps),
        float(dropout_p), backend, bool(high_precision_delta), None, None, -1, -1, return_lse,
    )
    return (o, lse) if return_lse else o


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: Optional[torch.Tensor] = None,
    *,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    stabilize: Union[None, bool, torch.Tensor] = None,
    probe: Optional[Probe] = None,
    beta: float = DEFAULT_BETA,
    eps: float = DEFAULT_EPS,
    backend: str = "auto",
    return_lse: bool = False,
    high_precision_delta: Optional[bool] = None,
):
    """:func:`flash_attention` over packed documents, as ``torch.nn.attention.varlen.varlen_attn`` takes them.

    Args:
        q: (T_q, H, D) queries of every document, one after the other; k, v: (T_k, H_kv, D).
        cu_seq_q, cu_seq_k: the documents' boundaries, int32/int64 ``(n + 1,)`` on ``q``'s device:
            document ``d`` holds rows ``cu_seq_q[d] .. cu_seq_q[d + 1]`` and keys ``cu_seq_k[d] ..
            cu_seq_k[d + 1]`` (``cu_seq_k`` None: ``cu_seq_q``). A row sees only its own document's keys;
            rows past ``cu_seq_q[-1]`` see none (output 0).
        causal, window: within a document, bottom-right aligned as flash-attn's: row ``i`` sits at key
            position ``i + len_k - len_q`` and ``window = (left, right)`` keeps keys from ``left`` before to
            ``right`` after it (``-1``: unbounded); ``causal`` is ``right = 0``.
        scale, stabilize, probe, beta, eps, backend: as :func:`flash_attention`.
        return_lse: also return the log-sum-exp of each row's scores, (H, T_q) float32 (natural log; +inf
            for a row that sees no key), as ``varlen_attn``'s auxiliary output; differentiable.
        high_precision_delta: as :func:`flash_attention` (the backward's delta from a float32 O, per document).

    The kernels read the documents from ``cu_seq_q``/``cu_seq_k`` on the device (no mask is formed, no host
    sync): each tile of rows visits only the keys its rows may see (their documents, cut by the causal or window
    bound).

    Returns:
        The output (T_q, H, D) in ``q``'s dtype (and the log-sum-exp with ``return_lse``), differentiable
        with respect to ``q, k, v``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (T, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if cu_seq_k is None:
        cu_seq_k = cu_seq_q
    for name, t in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 2 or t.dtype not in (torch.int32,
                                                                                               torch.int64):
            raise ValueError(f"{name} must be an int32/int64 vector of n + 1 >= 2 boundaries, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__} "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if cu_seq_k.numel() != cu_seq_q.numel():
        raise ValueError(f"cu_seq_q and cu_seq_k must hold the same number of documents, got "
                         f"{cu_seq_q.numel() - 1} and {cu_seq_k.numel() - 1}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise ValueError(f"window must be (left, right), two ints (-1: unbounded), got {window!r}")
    win_l, win_r = int(window[0]), (0 if causal else int(window[1]))
    if high_precision_delta is not None and not isinstance(high_precision_delta, bool):
        raise TypeError(f"high_precision_delta must be None, True or False, got {high_precision_delta!r}")
    if high_precision_delta is None:
        high_precision_delta = False if torch.compiler.is_compiling() else HIGH_PRECISION_DELTA.get()
    q4, k4, v4 = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D) views
    _check_args(q4, k4, v4, False, scale, stabilize, beta, eps, probe, backend)
    backend = resolve_backend(q4, backend)
    if isinstance(stabilize, bool):
        stabilize = torch.full((q.shape[1],), True, dtype=torch.bool, device=q.device) if stabilize else None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    counts, values = probe_buffers(probe)
    shadow = probe is not None and probe.shadow
    o4, lse4 = FlashAttention.apply(
        q4, k4, v4, None, None, stabilize, counts, values, shadow, False, scale, float(beta), float(eps), 0.0,
        backend, bool(high_precision_delta), cu_seq_q, cu_seq_k, win_l, win_r, bool(return_lse),
    )
    o = o4[0].permute(1, 0, 2)
    return (o, lse4[0]) if return_lse else o
