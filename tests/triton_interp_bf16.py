"""Test-only shim: make Triton's CPU interpreter treat bfloat16 like a GPU does.

Triton's interpreter (``TRITON_INTERPRET=1``) keeps bfloat16 values as raw
16-bit patterns in ``numpy.uint16`` arrays, because numpy has no bfloat16.
Loads, stores and pure data movement (reshape, trans, broadcast, where, ...)
are therefore bit-exact, but every builder op that does arithmetic runs numpy
on the *integer* bit patterns: ``tl.dot``, ``+ - * /``, comparisons,
``tl.maximum``, negation, ``tl.sum``/``tl.max`` on bf16 give garbage, and an
FP32 -> BF16 cast truncates instead of rounding to nearest even
(triton issue 11584).

``install()`` patches ``triton.runtime.interpreter`` (triton 3.9.0 only) so
that every op with a bf16 operand decodes the bit patterns to float32 (exact),
computes there, and rounds the result back to bf16 with round-to-nearest-even
(RNE) whenever the op's result type is bf16:

* casts (``cast_impl``, ``create_fp_to_fp``): bf16 -> f32/f64 exact,
  f32/f64/f16/int/fp8 -> bf16 RNE (or RTZ when ``fp_downcast_rounding="rtz"``);
  f64 -> bf16 rounds once (no double rounding through f32);
* float binary ops, comparisons, min/max, clamp, unary float ops: computed in
  f32, then RNE.  f32 has 24 >= 2*8+2 significand bits, so for + - * / sqrt the
  f32-then-bf16 double rounding equals a single correct rounding;
* ``fma``: exact product, sum rounded once to bf16;
* ``tl.dot`` with bf16 or fp16 operands: operands upcast exactly, product-sum
  in float64, plus the accumulator, rounded once to the accumulator type
  (so bf16 x bf16 + fp32 acc == float32 matmul of the upcast tiles);
* ``tl.sum``/``tl.max``/``tl.min``/``tl.argmax``/``cumsum``/``cumprod`` on bf16
  tensors: computed on the decoded values (sums in float64, rounded once);
* ``tl.atomic_add`` / ``tl.atomic_xchg`` on bf16 pointers (unsupported upstream);
* ``tl.device_print`` shows bf16 values as numbers rather than bit patterns;
* speed only: inside a launch, a call of a ``@triton.jit`` helper does not patch
  ``triton.language`` all over again (``_patch_language_once_per_launch``).

FP16 and FP32 code paths are left untouched except fp16 ``tl.dot``, which also
goes through the exact float64 product-sum.

Usage
-----
``install()`` can be called at any time, before or after kernels are defined
(the patches live on the interpreter's builder class and are looked up when a
kernel *runs*).  It is idempotent.  What it does NOT do is switch the
interpreter on: ``triton.jit`` decides per decoration, from
``triton.knobs.runtime.interpret`` (which reads ``TRITON_INTERPRET`` at that
moment), whether it returns an interpreted function.  So set
``os.environ["TRITON_INTERPRET"] = "1"`` before the modules that define the
kernels are imported (``import triton`` itself may happen earlier)::

    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    from tests import triton_interp_bf16
    triton_interp_bf16.install()

Known gaps: GPU-specific approximations (``ex2.approx``, TF32 dots, fp16/bf16
hardware reduction order) are not emulated; ``tl.dot`` with fp32 operands stays
the interpreter's plain fp32 matmul whatever ``input_precision`` says;
``tl.dot_scaled`` with bf16 operands and NaN-padded tensor-descriptor loads of
bf16 are not fixed.
"""

from __future__ import annotations

import numpy as np

SUPPORTED_TRITON_VERSION = "3.9.0"

# Marker stored on InterpreterBuilder, so that a second install() (even from a
# second copy of this module imported under another name) is a no-op.
_MARKER = "_instability_watch_bf16_shim"


# ---------------------------------------------------------------------------
# Bit-level conversions (pure numpy, no triton dependency)
# ---------------------------------------------------------------------------

def bf16_bits_to_f32(bits) -> np.ndarray:
    """Decode bf16 bit patterns (uint16/int16) to float32; exact."""
    bits = np.asarray(bits)
    if bits.dtype not in (np.uint16, np.int16):
        raise TypeError(f"bf16 data must be stored as 16-bit integers, got {bits.dtype}")
    return (bits.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x, rtz: bool = False) -> np.ndarray:
    """Round float32 values to bf16 bit patterns (RNE, or toward zero if rtz)."""
    x = np.asarray(x, dtype=np.float32)
    # uint64 arithmetic: no wrap-around (and no numpy overflow warnings).
    b = x.view(np.uint32).astype(np.uint64)
    if rtz:
        out = b >> np.uint64(16)
    else:
        # Add 0x7FFF plus the lowest kept bit: ties go to the even neighbour.
        # A carry out of the mantissa correctly bumps the exponent (and turns
        # values above the largest bf16 into inf).
        lsb = (b >> np.uint64(16)) & np.uint64(1)
        out = (b + np.uint64(0x7FFF) + lsb) >> np.uint64(16)
    # NaN: keep sign and top payload bits, force the quiet bit, so that a NaN
    # whose payload lives only in the low 16 bits does not turn into inf.
    quiet_nan = (b >> np.uint64(16)) | np.uint64(0x0040)
    out = np.where(np.isnan(x), quiet_nan, out)
    return out.astype(np.uint16)


def _f64_to_f32_sticky(x, rtz: bool = False) -> np.ndarray:
    """float64 -> float32 rounded to odd (or toward zero if rtz).

    Round-to-odd keeps an inexact result's last bit set, which makes a later
    RNE to any precision at least 2 bits narrower (bf16 has 8 vs 24) equal to
    a single direct RNE from float64: no double-rounding error.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)  # numpy rounds to nearest even
        fb = f.view(np.uint32).copy()
        f64 = f.astype(np.float64)
        inexact = (f64 != x) & ~np.isnan(x)
        too_big = np.abs(f64) > np.abs(x)  # RNE went away from zero
        if rtz:
            # Step one ulp toward zero (bit pattern - 1 in sign-magnitude).
            fb = np.where(inexact & too_big, fb - np.uint32(1), fb)
        else:
            # x lies strictly between two adjacent floats; pick the odd one.
            finite = np.isfinite(f)
            even = (fb & np.uint32(1)) == 0
            step = np.where(too_big, fb - np.uint32(1), fb + np.uint32(1))
            fb = np.where(inexact & finite & even, step, fb)
    return fb.view(np.float32)


def f64_to_bf16_bits(x, rtz: bool = False) -> np.ndarray:
    """Round float64 values to bf16 bit patterns with a single rounding."""
    return f32_to_bf16_bits(_f64_to_f32_sticky(x, rtz=rtz), rtz=rtz)


def _fma_f64_round_to_odd(x, y, z) -> np.ndarray:
    """x*y+z for bf16-valued float64 inputs, rounded to odd in float64."""
    p = x * y  # exact: two 8-bit significands need only 16 bits
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + z
        # TwoSum: e is the exact rounding error of s = p + z.
        bb = s - p
        e = (p - (s - bb)) + (z - bb)
        sb = s.view(np.uint64).copy()
        fix = np.isfinite(s) & np.isfinite(e) & (e != 0) & ((sb & np.uint64(1)) == 0)
        # Move one ulp in the direction of the error (toward the odd neighbour).
        away = np.signbit(e) == np.signbit(s)
        step = np.where(away, sb + np.uint64(1), sb - np.uint64(1))
        sb = np.where(fix, step, sb)
    return sb.view(np.float64)


# ---------------------------------------------------------------------------
# Patching
# ---------------------------------------------------------------------------

# Float builder methods whose numpy implementation is wrong on bf16 bit
# patterns.  Each is wrapped by _decode_compute_encode below.
_ELEMENTWISE_OPS = (
    # binary arithmetic and min/max
    "create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem",
    "create_precise_divf", "create_approx_divf",
    "create_minimumf", "create_minnumf", "create_maximumf", "create_maxnumf",
    # comparisons (result is int1, nothing to round)
    "create_fcmpOLT", "create_fcmpOGT", "create_fcmpOLE", "create_fcmpOGE",
    "create_fcmpOEQ", "create_fcmpONE", "create_fcmpULT", "create_fcmpUGT",
    "create_fcmpULE", "create_fcmpUGE", "create_fcmpUEQ", "create_fcmpUNE",
    # unary (most are rejected for bf16 by tl.math's dtype checks, exactly like
    # on GPU, but are patched in case they are reached through other paths)
    "create_fneg", "create_exp", "create_exp2", "create_log", "create_log2",
    "create_sqrt", "create_precise_sqrt", "create_rsqrt", "create_sin",
    "create_cos", "create_floor", "create_ceil", "create_erf",
    # clamp (tl.clamp)
    "create_clampf",
)
# Already bit-exact on bf16, listed so that install() fails loudly if they
# disappear: create_fabs (sign-bit mask), create_select (np.where on bits),
# loads/stores, bitcast, reshape/trans/broadcast/splat/join/split/cat.
_OTHER_REQUIRED = (
    "cast_impl", "create_fp_to_fp", "create_dot", "create_fma", "create_fabs",
    "create_select", "create_atomic_rmw", "create_print", "create_masked_load",
    "create_masked_store",
)


def install() -> None:
    """Patch triton 3.9.0's interpreter for GPU-like bf16 numerics (idempotent)."""
    import triton

    if triton.__version__ != SUPPORTED_TRITON_VERSION:
        raise RuntimeError(
            f"triton_interp_bf16 patches private internals of triton=={SUPPORTED_TRITON_VERSION}; "
            f"found triton=={triton.__version__}. Re-check triton/runtime/interpreter.py and "
            f"update the shim (and SUPPORTED_TRITON_VERSION) before using it.")

    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    if getattr(builder_cls, _MARKER, False):
        return
    missing = [n for n in _ELEMENTWISE_OPS + _OTHER_REQUIRED if not hasattr(builder_cls, n)]
    for cls, names in ((interp.ReduceOps, ("sum", "min_max")), (interp.ScanOps, ("cumsum", "cumprod"))):
        missing += [f"{cls.__name__}.{n}" for n in names if not hasattr(cls, n)]
    if missing or not hasattr(interp, "TensorHandle"):
        raise RuntimeError(f"triton interpreter internals changed; missing: {missing}")

    TensorHandle = interp.TensorHandle
    BF16, F32, F64, F16 = tl.bfloat16, tl.float32, tl.float64, tl.float16

    def is_bf16(h) -> bool:
        # Also require 16-bit storage: the unpatched interpreter labels some
        # boolean results with their operand's type.
        return (isinstance(h, TensorHandle) and h.get_element_ty() == BF16
                and np.asarray(h.data).dtype in (np.uint16, np.int16))

    def bf16_handle(bits) -> TensorHandle:
        return TensorHandle(np.asarray(bits, dtype=np.uint16), BF16)

    def as_f32_handle(h) -> TensorHandle:
        return TensorHandle(bf16_bits_to_f32(h.data), F32)

    def as_array(h, np_dtype) -> np.ndarray:
        """Exact numeric value of a bf16/fp16/fp32 handle as np_dtype."""
        data = bf16_bits_to_f32(h.data) if is_bf16(h) else h.data
        return np.asarray(data).astype(np_dtype)

    def round_to(values: np.ndarray, dst) -> TensorHandle:
        """Round float64/float32 `values` once to tl dtype `dst`."""
        if dst == BF16:
            if values.dtype == np.float32:
                return bf16_handle(f32_to_bf16_bits(values))
            return bf16_handle(f64_to_bf16_bits(values))
        return TensorHandle(values.astype(interp._get_np_dtype(dst)), dst)

    def retype(ty, elem):
        return ty.with_element_ty(elem) if isinstance(ty, tl.block_type) else elem

    # --- elementwise ops: decode -> original fp32 implementation -> RNE ------
    def _decode_compute_encode(orig):

        def patched(self, *args):
            if not any(is_bf16(a) for a in args):
                return orig(self, *args)
            out = orig(self, *[as_f32_handle(a) if is_bf16(a) else a for a in args])
            if out.data.dtype == np.float32:
                return bf16_handle(f32_to_bf16_bits(out.data))
            # Comparisons: boolean data.  Label it int1 (the original code keeps
            # the operand type, which would make later casts treat it as bf16).
            return TensorHandle(out.data, tl.int1)

        patched.__wrapped__ = orig
        return patched

    # --- casts ---------------------------------------------------------------
    orig_cast_impl = builder_cls.cast_impl
    orig_fp_to_fp = builder_cls.create_fp_to_fp
    ir = interp._ir

    def to_bf16(self, src, rtz: bool) -> TensorHandle:
        """Any numeric handle -> bf16 with one rounding."""
        src_ty = src.get_element_ty()
        if src_ty == F32:
            return bf16_handle(f32_to_bf16_bits(src.data, rtz=rtz))
        if src_ty == F16:  # fp16 -> f32 is exact
            return bf16_handle(f32_to_bf16_bits(src.data.astype(np.float32), rtz=rtz))
        if src_ty.is_fp8():  # fp8 -> f32 is exact; reuse triton's decoder
            f32 = orig_fp_to_fp(self, src, F32, None)
            return bf16_handle(f32_to_bf16_bits(f32.data, rtz=rtz))
        # float64 and integers (exact in float64 up to 2**53)
        return bf16_handle(f64_to_bf16_bits(src.data.astype(np.float64), rtz=rtz))

    def cast_impl(self, src, dst_type):
        src_bf16, dst_ty = is_bf16(src), dst_type.scalar
        if not src_bf16 and dst_ty != BF16:
            return orig_cast_impl(self, src, dst_type)
        if dst_ty == BF16:  # fp_trunc / si_to_fp / ui_to_fp: default RNE
            return src if src_bf16 else to_bf16(self, src, rtz=False)
        # bf16 -> f32 exact, then let the original code widen/convert further.
        f32 = as_f32_handle(src)
        return f32 if dst_ty == F32 else orig_cast_impl(self, f32, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_bf16, dst_ty = is_bf16(src), dst_type.scalar
        if not src_bf16 and dst_ty != BF16:
            return orig_fp_to_fp(self, src, dst_type, rounding_mode)
        if dst_ty == BF16:
            if src_bf16:
                return src
            return to_bf16(self, src, rtz=(rounding_mode == ir.ROUNDING_MODE.RTZ))
        f32 = as_f32_handle(src)
        if dst_ty == F32:
            return f32
        if dst_ty in (F16, F64):  # numpy astype: RNE for f16, exact for f64
            return orig_cast_impl(self, f32, dst_type)
        return orig_fp_to_fp(self, f32, dst_type, rounding_mode)  # fp8 targets

    # --- dot -----------------------------------------------------------------
    orig_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        half = (BF16, F16)
        if a.get_element_ty() not in half and b.get_element_ty() not in half:
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        # 16-bit floats upcast exactly; products are exact in float64 and the
        # float64 sum is far more precise than the fp32 accumulator, so the
        # result is the fp32 (or fp16/bf16) rounding of the true product-sum
        # up to float64 round-off.
        acc = np.matmul(as_array(a, np.float64), as_array(b, np.float64)) + as_array(d, np.float64)
        return round_to(acc, d.get_element_ty())

    # --- fma -----------------------------------------------------------------
    orig_fma = builder_cls.create_fma

    def create_fma(self, x, y, z):
        if not any(is_bf16(h) for h in (x, y, z)):
            return orig_fma(self, x, y, z)
        xs, ys, zs = np.broadcast_arrays(*(as_array(h, np.float64) for h in (x, y, z)))
        return bf16_handle(f64_to_bf16_bits(_fma_f64_round_to_odd(xs, ys, zs)))

    # --- atomics on bf16 (the interpreter's C++ helper rejects 16-bit floats)
    orig_atomic_rmw = builder_cls.create_atomic_rmw
    load, store = interp._interpreter.load, interp._interpreter.store

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        if not is_bf16(val) or rmwOp not in (ir.ATOMIC_OP.FADD, ir.ATOMIC_OP.XCHG):
            return orig_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope)
        ptrs, vals, msk = np.broadcast_arrays(ptr.data, val.data, mask.data)
        old = np.zeros(ptrs.shape, dtype=np.uint16)
        one = np.ones(1, dtype=bool)
        # The interpreter runs programs one at a time, so an element-by-element
        # read-modify-write in order is atomic (and handles repeated addresses).
        for idx in np.ndindex(ptrs.shape):
            if not msk[idx]:
                continue
            p = np.array([ptrs[idx]], dtype=np.uint64)
            cur = load(p, one, np.zeros(1, dtype=np.uint16), np.dtype(np.uint16))
            old[idx] = cur[0]
            if rmwOp == ir.ATOMIC_OP.FADD:
                new = f32_to_bf16_bits(bf16_bits_to_f32(cur) + bf16_bits_to_f32(vals[idx]))
            else:
                new = np.array([vals[idx]], dtype=np.uint16)
            store(p, np.asarray(new, dtype=np.uint16).reshape(1), one)
        return bf16_handle(old)

    # --- device_print: show numbers, not bit patterns --------------------------
    orig_print = builder_cls.create_print

    def create_print(self, prefix, hex, values, isSigned):
        if not hex:
            values = [as_f32_handle(v) if is_bf16(v) else v for v in values]
        return orig_print(self, prefix, hex, values, isSigned)

    # --- reductions / scans implemented directly in numpy -----------------------
    orig_sum, orig_min_max = interp.ReduceOps.sum, interp.ReduceOps.min_max
    orig_cumsum, orig_cumprod = interp.ScanOps.cumsum, interp.ScanOps.cumprod

    def f32_tensor(t):
        return tl.core.tensor(as_f32_handle(t.handle), retype(t.type, F32))

    def bf16_tensor_from(t):
        """f32 triton tensor holding bf16-representable values -> bf16 tensor."""
        return tl.core.tensor(bf16_handle(f32_to_bf16_bits(t.handle.data)), retype(t.type, BF16))

    def reduce_sum(self, input):
        if input.dtype != BF16:
            return orig_sum(self, input)
        total = np.sum(bf16_bits_to_f32(input.handle.data).astype(np.float64), axis=self.axis,
                       keepdims=self.keep_dims)
        return self.to_tensor(f64_to_bf16_bits(total), BF16)

    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        inp = input[0] if isinstance(input, tuple) else input
        if inp.dtype != BF16:
            return orig_min_max(self, input, val_reduce_op, idx_reduce_op)
        res = orig_min_max(self, f32_tensor(inp), val_reduce_op, idx_reduce_op)
        if val_reduce_op is None:
            return res  # indices only
        if idx_reduce_op is None:
            return bf16_tensor_from(res)
        return bf16_tensor_from(res[0]), res[1]

    def _scan(orig, np_op):

        def scan(self, input):
            if input.dtype != BF16:
                return orig(self, input)
            vals = np_op(bf16_bits_to_f32(input.handle.data).astype(np.float64), axis=self.axis)
            return [self.to_tensor(f64_to_bf16_bits(vals), BF16)]

        return scan

    # --- apply ----------------------------------------------------------------
    for name in _ELEMENTWISE_OPS:
        setattr(builder_cls, name, _decode_compute_encode(getattr(builder_cls, name)))
    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.create_dot = create_dot
    builder_cls.create_fma = create_fma
    builder_cls.create_atomic_rmw = create_atomic_rmw
    builder_cls.create_print = create_print
    interp.ReduceOps.sum = reduce_sum
    interp.ReduceOps.min_max = min_max
    interp.ScanOps.cumsum = _scan(orig_cumsum, np.cumsum)
    interp.ScanOps.cumprod = _scan(orig_cumprod, np.cumprod)
    _patch_language_once_per_launch(interp, tl)
    setattr(builder_cls, _MARKER, True)


def _patch_language_once_per_launch(interp, tl) -> None:
    """Speed only: a device function's call does not patch ``triton.language`` again inside a launch.

    triton 3.9.0's interpreter patches the language modules (``tl``, ``tl.core``: every builtin,
    found by ``inspect.getmembers``) when a kernel launches (``GridExecutor.__call__``), and undoes it
    when the grid is done; but ``InterpretedFunction.__call__``, each call of a ``@triton.jit`` helper
    from inside a kernel, patches them all over again (and never undoes that): about a quarter of our
    kernels' time in the interpreter. Inside a launch the language modules are already patched with the
    same functions, so a helper that sees no other language module than those skips the repeat; one
    that sees another patches as before, and outside a launch nothing changes. Numerics are not touched.
    """
    original_patch, original_launch = interp._patch_lang, interp.GridExecutor.__call__
    launch = {"patched": None}  # ids of the language modules patched in the running launch; None outside one

    def languages(fn):
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        patched = launch["patched"]
        if patched is None:
            return original_patch(fn)
        if languages(fn) <= patched:
            return interp._LangPatchScope()  # already patched by this launch: nothing to do, nothing to undo
        scope = original_patch(fn)  # the launch's own patching, or a helper that sees another module
        patched |= languages(fn)
        return scope

    def grid_call(self, *args, **kwargs):
        launch["patched"] = set()
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launch["patched"] = None

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = grid_call
