"""Tests for tests/triton_interp_bf16.py (bf16 numerics in Triton's CPU interpreter).

triton 3.9.0's ``triton.jit`` picks interpreter vs. compiler when a function is
*decorated*, by reading ``triton.knobs.runtime.interpret`` (i.e. the
``TRITON_INTERPRET`` env var at that moment, unless overridden in Python).
Importing triton earlier (e.g. from another test module) is therefore fine, but
the variable must be set before the ``@triton.jit`` definitions below run —
hence it is set first thing in this module.  ``_require_interpreter`` turns a
misconfiguration into a clear error instead of a GPU-compile failure.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    # On a GPU machine the package's kernels must compile for the GPU: turning the
    # interpreter on here would leak into them. The shim is a CPU-only matter.
    pytest.skip("the interpreter shim is tested on CPU-only machines", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit definitions below

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

try:  # tests/ may or may not be a package
    from . import triton_interp_bf16 as shim  # type: ignore
except ImportError:
    import triton_interp_bf16 as shim  # type: ignore

if not triton.knobs.runtime.interpret:
    # Someone set triton.knobs.runtime.interpret = False in Python; the env var
    # alone cannot win over that, and these tests only make sense interpreted.
    triton.knobs.runtime.interpret = True

shim.install()

BLOCK = 64


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise equality, except that any NaN matches any NaN."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    bad = (_bits(out) != _bits(ref)) & ~nan
    assert not bad.any(), f"mismatch at {bad.nonzero()[:5].tolist()}: {out[bad][:5]} vs {ref[bad][:5]}"


def _bf16_rne_reference(x: np.ndarray) -> torch.Tensor:
    """Independent float64 -> bf16 RNE reference (finite inputs in range).

    Picks the nearer of the two bf16 neighbours by comparing exact float64
    distances, ties to the even bit pattern.  Unlike torch, it never rounds
    through float32 first.
    """
    out = np.empty(x.shape, dtype=np.uint16)
    for i, v in enumerate(x.ravel()):
        sign, mag = (0x8000 if np.signbit(v) else 0), abs(float(v))
        near = int(np.array([mag], dtype=np.float64).astype(np.float32).view(np.uint32)[0] >> 16)
        cands = [c for c in (near - 1, near, near + 1) if c >= 0]  # magnitudes around it
        vals = [float(np.array([c << 16], dtype=np.uint32).view(np.float32)[0]) for c in cands]
        # distances are exact: operands within a factor of 2 (or one is 0)
        best = min(range(len(cands)), key=lambda k: (abs(vals[k] - mag), cands[k] & 1))
        out.ravel()[i] = cands[best] | sign
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------

@triton.jit
def _copy_kernel(x_ptr, y_ptr, f32_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(y_ptr + offs, x, mask=m)
    tl.store(f32_ptr + offs, x.to(tl.float32), mask=m)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, RTZ: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    if RTZ:
        y = x.to(tl.bfloat16, fp_downcast_rounding="rtz")
    else:
        y = x.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=m)


@triton.jit
def _elementwise_kernel(a_ptr, b_ptr, arith_ptr, cmp_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m)
    b = tl.load(b_ptr + offs, mask=m)
    # arith_ptr: [7, n] of a's dtype, cmp_ptr: [6, n] int8
    tl.store(arith_ptr + 0 * n + offs, a + b, mask=m)
    tl.store(arith_ptr + 1 * n + offs, a - b, mask=m)
    tl.store(arith_ptr + 2 * n + offs, a * b, mask=m)
    tl.store(arith_ptr + 3 * n + offs, a / b, mask=m)
    tl.store(arith_ptr + 4 * n + offs, -a, mask=m)
    tl.store(arith_ptr + 5 * n + offs, tl.abs(a), mask=m)
    tl.store(arith_ptr + 6 * n + offs, a * 3.0 - 2.0, mask=m)  # scalar constants
    tl.store(cmp_ptr + 0 * n + offs, (a < b).to(tl.int8), mask=m)
    tl.store(cmp_ptr + 1 * n + offs, (a <= b).to(tl.int8), mask=m)
    tl.store(cmp_ptr + 2 * n + offs, (a > b).to(tl.int8), mask=m)
    tl.store(cmp_ptr + 3 * n + offs, (a >= b).to(tl.int8), mask=m)
    tl.store(cmp_ptr + 4 * n + offs, (a == b).to(tl.int8), mask=m)
    tl.store(cmp_ptr + 5 * n + offs, (a != b).to(tl.int8), mask=m)


@triton.jit
def _select_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m)
    b = tl.load(b_ptr + offs, mask=m)
    # out_ptr: [5, n]
    tl.store(out_ptr + 0 * n + offs, tl.where(a > b, a, b), mask=m)
    tl.store(out_ptr + 1 * n + offs, tl.maximum(a, b), mask=m)
    tl.store(out_ptr + 2 * n + offs, tl.minimum(a, b), mask=m)
    tl.store(out_ptr + 3 * n + offs, tl.where(a > 0, a, float("-inf")), mask=m)
    # masked load with a constant fill value (cast to bf16 by the frontend)
    tl.store(out_ptr + 4 * n + offs, tl.load(a_ptr + offs, mask=offs < n // 2, other=-1.5), mask=m)


@triton.jit
def _reduce_kernel(x_ptr, max_ptr, sum_ptr, argmax_ptr, M: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, M)[:, None]
    cols = tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + rows * N + cols)
    tl.store(max_ptr + tl.arange(0, M), tl.max(x, axis=1))
    tl.store(sum_ptr + tl.arange(0, M), tl.sum(x, axis=1))
    tl.store(argmax_ptr + tl.arange(0, M), tl.argmax(x, axis=1))


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                USE_ACC: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    if USE_ACC:
        acc = tl.load(c_ptr + rm[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a, b)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sm_scale, S: tl.constexpr, D: tl.constexpr):
    # One-block flash-attention forward, the way a real kernel mixes dtypes.
    rs = tl.arange(0, S)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + rs[:, None] * D + rd[None, :])
    k = tl.load(k_ptr + rs[:, None] * D + rd[None, :])
    v = tl.load(v_ptr + rs[:, None] * D + rd[None, :])
    qk = tl.dot(q, tl.trans(k)) * (sm_scale * 1.4426950408889634)
    causal = rs[:, None] >= rs[None, :]
    qk = tl.where(causal, qk, float("-inf"))
    m = tl.max(qk, axis=1)
    p = tl.math.exp2(qk - m[:, None])
    l = tl.sum(p, axis=1)
    acc = tl.dot(p.to(tl.bfloat16), v)
    tl.store(o_ptr + rs[:, None] * D + rd[None, :], (acc / l[:, None]).to(tl.bfloat16))


@triton.jit
def _atomic_kernel(acc_ptr, val_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.atomic_add(acc_ptr + offs % 4, tl.load(val_ptr + offs, mask=m), mask=m)


@triton.jit
def _fma_kernel(x_ptr, y_ptr, z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    y = tl.load(y_ptr + offs, mask=m)
    z = tl.load(z_ptr + offs, mask=m)
    tl.store(out_ptr + offs, tl.fma(x, y, z), mask=m)


@triton.jit
def _add_twice(a, b):
    return a + b + b


@triton.jit
def _helper_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # a @triton.jit helper called from a kernel, three times per program
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    y = tl.load(y_ptr + offs, mask=m)
    for _ in range(3):
        x = _add_twice(x, y)
    tl.store(out_ptr + offs, tl.maximum(x, y), mask=m)


def _require_interpreter():
    assert isinstance(_copy_kernel, _interp.InterpretedFunction), (
        "kernels were not decorated in interpreter mode; set TRITON_INTERPRET=1 before "
        "this module (and any module defining kernels) is imported")


def _run(kernel, *args, **kwargs):
    _require_interpreter()
    kernel[(1, )](*args, **kwargs)


def _interesting_bf16(n=BLOCK, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n, ), generator=g).float())
    x[:10] = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e-39, 3.3e38])
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def test_install_is_idempotent_and_version_checked(monkeypatch):
    before = _interp.InterpreterBuilder.create_fadd
    shim.install()
    shim.install()
    assert _interp.InterpreterBuilder.create_fadd is before
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    with pytest.raises(RuntimeError, match="triton==3.9.0"):
        shim.install()


def test_bf16_load_store_roundtrip_and_upcast():
    x = _interesting_bf16()
    y = torch.empty_like(x)
    f32 = torch.empty(x.shape, dtype=torch.float32)
    _run(_copy_kernel, x, y, f32, x.numel(), BLOCK=BLOCK)
    assert torch.equal(_bits(y), _bits(x))  # bit-exact, NaN payload included
    _assert_same_bits(f32, x.float())


def test_fp32_to_bf16_cast_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(1)
    hi = torch.randint(0, 0x7F7F, (40, ), generator=g, dtype=torch.int32) << 16
    # low halves: exact, just below a tie, tie, just above a tie, all ones
    lows = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    patterns = (hi[:, None] | lows[None, :]).reshape(-1)
    x = patterns.view(torch.float32)
    x = torch.cat([x, -x[:60]])
    special = torch.tensor([
        0.9995, 0.99999, 1.00390625, 1.01171875, -1.00390625, 1.0 + 2**-8 + 2**-20, 65504.0,
        3.3895314e38, 3.3961e38, 3.4028235e38, float("inf"), -float("inf"), float("nan"),
        1e-40, -1e-45, 1.1754942e-38, 0.0, -0.0
    ], dtype=torch.float32)
    x = torch.cat([special, x])
    n = x.numel()
    y = torch.empty(n, dtype=torch.bfloat16)
    _run(_cast_kernel, x, y, n, RTZ=False, BLOCK=triton.next_power_of_2(n))
    _assert_same_bits(y, x.to(torch.bfloat16))
    assert y[0].item() == 1.0 and y[1].item() == 1.0  # 0.9995 -> 1.0 (not 0.99609375)
    assert y[2].item() == 1.0 and y[3].item() == 1.015625  # ties go to even
    # fp_downcast_rounding="rtz" truncates (finite values)
    _run(_cast_kernel, x, y, n, RTZ=True, BLOCK=triton.next_power_of_2(n))
    finite = torch.isfinite(x)
    trunc = (x.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(_bits(y)[finite], trunc[finite])
    assert torch.isnan(y[~torch.isfinite(x) & torch.isnan(x)]).all()


def test_other_casts_to_and_from_bf16():
    # float64 -> bf16 must round once (1 + 2^-8 + 2^-40 is above the tie, but a
    # float32 intermediate would make it an exact tie and round it down).
    x64 = torch.tensor([1 + 2**-8 + 2**-40, -(1 + 2**-8 + 2**-40), 1 + 2**-8, 0.9995, 123.456, -7e-3, 1e-300],
                       dtype=torch.float64)
    y = torch.empty(x64.shape, dtype=torch.bfloat16)
    _run(_cast_kernel, x64, y, x64.numel(), RTZ=False, BLOCK=8)
    _assert_same_bits(y, _bf16_rne_reference(x64.numpy()))
    assert y[0].item() == 1.0078125
    # fp16 <-> bf16 and int32 -> bf16 agree with torch; bf16 -> fp16 too
    x16 = (torch.randn(BLOCK, generator=torch.Generator().manual_seed(2)) * 100).half()
    y = torch.empty(BLOCK, dtype=torch.bfloat16)
    _run(_cast_kernel, x16, y, BLOCK, RTZ=False, BLOCK=BLOCK)
    _assert_same_bits(y, x16.to(torch.bfloat16))
    back = torch.empty(BLOCK, dtype=torch.float16)
    _run(_cast_kernel, y, back, BLOCK, RTZ=False, BLOCK=BLOCK)
    _assert_same_bits(back, y.to(torch.float16))
    xi = torch.arange(-BLOCK // 2, BLOCK // 2, dtype=torch.int32) * 12345
    _run(_cast_kernel, xi, y, BLOCK, RTZ=False, BLOCK=BLOCK)
    _assert_same_bits(y, xi.to(torch.bfloat16))
    yi = torch.empty(BLOCK, dtype=torch.int32)
    _run(_cast_kernel, y, yi, BLOCK, RTZ=False, BLOCK=BLOCK)
    assert torch.equal(yi, y.float().to(torch.int32))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_elementwise_arithmetic_and_comparisons(dtype):
    g = torch.Generator().manual_seed(3)
    n = BLOCK
    a = (torch.randn(n, generator=g) * 4).to(dtype)
    b = (torch.randn(n, generator=g) * 4).to(dtype)
    a[:6] = torch.tensor([0.0, -0.0, 1.5, float("nan"), float("inf"), -2.0], dtype=dtype)
    b[:6] = torch.tensor([-0.0, 0.0, 1.5, 1.0, 1.0, 0.0], dtype=dtype)
    arith = torch.empty(7, n, dtype=dtype)
    cmp = torch.empty(6, n, dtype=torch.int8)
    _run(_elementwise_kernel, a, b, arith, cmp, n, BLOCK=BLOCK)
    for i, ref in enumerate([a + b, a - b, a * b, a / b, -a, a.abs()]):
        _assert_same_bits(arith[i], ref)
    # The kernel rounds each op to `dtype`; so does this reference.
    _assert_same_bits(arith[6], (a * 3.0).to(dtype) - 2.0)
    for i, ref in enumerate([a < b, a <= b, a > b, a >= b, a == b, a != b]):
        assert torch.equal(cmp[i], ref.to(torch.int8)), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_where_maximum_minimum_and_masked_load(dtype):
    g = torch.Generator().manual_seed(4)
    n = BLOCK
    a = torch.randn(n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    out = torch.empty(5, n, dtype=dtype)
    _run(_select_kernel, a, b, out, n, BLOCK=BLOCK)
    _assert_same_bits(out[0], torch.where(a > b, a, b))
    _assert_same_bits(out[1], torch.maximum(a, b))
    _assert_same_bits(out[2], torch.minimum(a, b))
    _assert_same_bits(out[3], torch.where(a > 0, a, torch.tensor(float("-inf"), dtype=dtype)))
    fill = torch.full_like(a, -1.5)
    _assert_same_bits(out[4], torch.where(torch.arange(n) < n // 2, a, fill))


def test_bf16_reductions():
    M, N = 8, 16
    x = (torch.randn(M, N, generator=torch.Generator().manual_seed(5)) * 10).to(torch.bfloat16)
    mx = torch.empty(M, dtype=torch.bfloat16)
    sm = torch.empty(M, dtype=torch.bfloat16)
    am = torch.empty(M, dtype=torch.int32)
    _run(_reduce_kernel, x, mx, sm, am, M=M, N=N)
    _assert_same_bits(mx, x.max(dim=1).values)
    assert torch.equal(am, x.float().argmax(dim=1).to(torch.int32))
    # sum: exact sum rounded once (GPU order may differ by an ulp)
    torch.testing.assert_close(sm.float(), x.double().sum(dim=1).float(), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_acc", [False, True])
def test_dot_exact_fp32_accumulation(dtype, use_acc):
    M, N, K = 16, 32, 64
    g = torch.Generator().manual_seed(6)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    c = torch.randn(M, N, generator=g)
    out = torch.empty(M, N, dtype=torch.float32)
    _run(_dot_kernel, a, b, c, out, M=M, N=N, K=K, USE_ACC=use_acc)
    ref = a.float() @ b.float() + (c if use_acc else 0)
    exact = (a.double() @ b.double() + (c.double() if use_acc else 0)).float()
    # ~1e-6 relative to the magnitude of the terms (torch's fp32 matmul rounds too)
    scale = a.abs().float() @ b.abs().float() + (c.abs() if use_acc else 0)
    assert ((out - ref).abs() <= 1e-6 * scale).all()
    assert torch.equal(out, exact)  # float64 product-sum rounded once


def test_flash_attention_forward_block():
    S, D = 16, 32
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(S, D, generator=g).to(torch.bfloat16) for _ in range(3))
    o = torch.empty(S, D, dtype=torch.bfloat16)
    scale = D**-0.5
    _run(_attn_fwd_kernel, q, k, v, o, scale, S=S, D=D)
    # Same algorithm in torch (fp32 scores, bf16 probabilities into the PV dot)
    qk = (q.float() @ k.float().T) * (scale * 1.4426950408889634)
    qk = qk.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp2(qk - qk.max(dim=1, keepdim=True).values)
    ref = ((p.to(torch.bfloat16).float() @ v.float()) / p.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(o, ref, rtol=2**-7, atol=2**-7)
    # and close to plain attention
    plain = torch.softmax((q.float() @ k.float().T * scale).masked_fill(qk == float("-inf"), float("-inf")),
                          dim=1) @ v.float()
    torch.testing.assert_close(o.float(), plain, rtol=2e-2, atol=2e-2)


def test_bf16_atomic_add_and_fma():
    n = 16
    vals = (torch.randn(n, generator=torch.Generator().manual_seed(8))).to(torch.bfloat16)
    acc = torch.zeros(4, dtype=torch.bfloat16)
    _run(_atomic_kernel, acc, vals, n, BLOCK=n)
    ref = torch.zeros(4, dtype=torch.bfloat16)
    for i in range(n):  # the interpreter's order: one bf16-rounded add per element
        ref[i % 4] = ref[i % 4] + vals[i]
    _assert_same_bits(acc, ref)

    g = torch.Generator().manual_seed(9)
    x, y, z = ((torch.randn(BLOCK, generator=g) * 8).to(torch.bfloat16) for _ in range(3))
    out = torch.empty(BLOCK, dtype=torch.bfloat16)
    _run(_fma_kernel, x, y, z, out, BLOCK, BLOCK=BLOCK)
    exact = x.double() * y.double() + z.double()  # exact in float64 for these magnitudes
    _assert_same_bits(out, _bf16_rne_reference(exact.numpy()))


@pytest.mark.parametrize("op,ref", [("create_exp", torch.exp), ("create_exp2", torch.exp2),
                                    ("create_log", torch.log), ("create_sqrt", torch.sqrt),
                                    ("create_floor", torch.floor), ("create_fneg", torch.neg),
                                    ("create_fabs", torch.abs)])
def test_unary_builder_ops_on_bf16(op, ref):
    # tl.exp/tl.log/tl.sqrt reject bf16 at the frontend (as on GPU), so call the
    # interpreter's builder directly to check the shim's unary path.
    x = (torch.rand(BLOCK, generator=torch.Generator().manual_seed(10)) * 8 + 0.01).to(torch.bfloat16)
    handle = _interp.TensorHandle(x.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    out = getattr(_interp.interpreter_builder, op)(handle)
    assert out.data.dtype == np.uint16 and out.dtype == tl.bfloat16
    got = torch.from_numpy(out.data.view(np.int16).copy()).view(torch.bfloat16)
    torch.testing.assert_close(got.float(), ref(x.float()).to(torch.bfloat16).float(), rtol=2**-8, atol=0)


def test_helpers_run_on_the_launchs_patched_language_which_is_undone_after(monkeypatch):
    """The language is patched once per launch, not again at each helper call; the helpers' bf16
    arithmetic is the shim's all the same, and after the launch triton.language is as before."""
    patched = []
    original = _interp._patch_builtin
    monkeypatch.setattr(_interp, "_patch_builtin", lambda pkg, *a: patched.append(pkg) or original(pkg, *a))
    x = torch.randn(BLOCK, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    f32 = torch.empty(BLOCK, dtype=torch.float32)
    _run(_copy_kernel, x, torch.empty_like(x), f32, BLOCK, BLOCK=BLOCK)  # no helper
    one_launch, patched[:] = list(patched), []
    before = {name: getattr(tl, name) for name in ("maximum", "load", "store")}
    y = torch.randn(BLOCK, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = torch.empty_like(x)
    _helper_kernel[(2, )](x, y, out, BLOCK, BLOCK=BLOCK)  # 2 programs x 3 helper calls
    assert patched == one_launch and len(one_launch) > 0
    ref = x
    for _ in range(3):
        ref = ref + y + y  # torch rounds each bf16 add to nearest even, as the shim does
    _assert_same_bits(out, torch.maximum(ref, y))
    assert {name: getattr(tl, name) for name in before} == before
